"""What each profiling level measures (:mod:`etgraph.profiler`'s module docstring, steps 1-6 and
"Profiling levels"): the configurations of trainable tensors, their training graphs and ORT runs,
gathered as :class:`Measured` for the folding into the time model (:func:`etgraph.profiler.
fold`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from .artifact_weights import placeholder_weights, save_baked
from .artifacts import (
    ArtifactCache,
    inference_batch_norms,
    no_gradient_error,
    training_graphs,
)
from .errors import ModelError, first_line
from .fold import fit_optimizer, fused_grad_parts, optimizer_subsets
from .measure import (
    Batch,
    OptimizerSubsets,
    ProfiledGraph,
    TrainStep,
    reproduced,
    round_robin,
)
from .model import LoadedModel, TensorInfo
from .profile import format_shapes

__all__ = [
    "FAST_MAX_REPEATS",
    "FAST_QUANTILE",
    "REPRODUCED_TOLERANCE",
    "Measured",
    "batch_norm_layers",
    "measure_fast",
    "measure_thorough",
    "ort_error",
    "selection_mask",
]

#: Fast level: more rounds follow its ``repeats`` until two rounds' wall times agree within this
#: relative tolerance (:func:`etgraph.measure.reproduced`), up to :data:`FAST_MAX_REPEATS`.
REPRODUCED_TOLERANCE = 0.03
FAST_MAX_REPEATS = 10

#: Fast level: the statistic of a node's (and a run's) times is their minimum, not the 20th
#: percentile: of 3-10 runs on a busy machine, one run of a node stalled by a scheduler time
#: slice (10-30 ms on a 0.02-1 ms kernel, seen at load 9) moves any interpolated quantile; other
#: processes only ever add time.
FAST_QUANTILE = 0.0


#: Configurations whose batch norms with frozen gamma and beta run in inference mode.
_INFERENCE_CONFIGS = frozenset({"bn_inference", "last_only_inference", "first_only_inference"})


def _configurations(tensors: Sequence[TensorInfo]) -> dict[str, list[int]]:
    """Sets of trainable tensor indices to profile: ``full``, ``no_kernels`` (when the model
    has kernels and other tensors), ``first_only`` (when N > 1)."""
    n = len(tensors)
    configs = {"full": list(range(n))}
    no_kernels = [t.index for t in tensors if t.kind != "kernel"]
    if no_kernels and len(no_kernels) < n:
        configs["no_kernels"] = no_kernels
    if n > 1:
        configs["first_only"] = [0]
    return configs


def batch_norm_layers(
    model: LoadedModel, requires_grad: Sequence[str]
) -> list[tuple[str, int, int]]:
    """``(node name, gamma index, beta index)`` of every batch norm that ``--frozen-bn
    inference`` puts in inference mode when ``requires_grad`` train (both its gamma and beta
    are trainable tensors, neither in ``requires_grad``)."""
    index = {t.name: t.index for t in model.tensors}
    nodes = {n.name: n for n in model.proto.graph.node}
    layers = []
    for name in inference_batch_norms(model.proto, list(requires_grad), "inference"):
        gamma, beta = nodes[name].input[1:3]
        if gamma in index and beta in index:
            layers.append((name, index[gamma], index[beta]))
    return layers


def selection_mask(n: int, selected: Sequence[int]) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    mask[list(selected)] = True
    return mask


@dataclass
class Measured:
    """What one profiling level measured, for :func:`etgraph.profiler.fold`.

    Attributes:
        masks: selection mask (bool [N]) per configuration measured.
        node_times: ``{configuration: {node: NodeTiming}}`` of the train-mode profiled graphs
            (``"full"`` first; the others split fused nodes).
        bn_times: node times of a graph with the batch norms of ``bn_layers`` in inference mode.
        steps: measured step per configuration, µs.
        calibrate: the configurations :func:`etgraph.fold.calibrate` averages over.
        frozen_bn: batch-norm mode per configuration whose step was measured in inference mode.
        observations: ``(count, elements, µs)`` of the optimizer subsets.
        full_training_model: the all-trainable training graph (path or ModelProto).
        trace_us: what ORT's per-node trace adds to a run, µs per node (fast level; 0 when
            steps are timed by the training API).
        repeats: measured rounds when more than asked were run (fast level), else None.
        reproduced: whether two rounds' wall times agreed within :data:`REPRODUCED_TOLERANCE`
            (fast level), else None (not checked).
    """

    masks: dict[str, np.ndarray]
    node_times: dict[str, dict]
    bn_times: dict | None
    steps: dict[str, float]
    calibrate: list[str]
    frozen_bn: dict[str, str]
    observations: list
    full_training_model: object
    trace_us: float = 0.0
    repeats: int | None = None
    reproduced: bool | None = None


def ort_error(exc: Exception, batch: Batch) -> Exception:
    """The one-line :class:`ModelError` for an ORT failure at the batch's input shapes; other
    errors as they are."""
    if not (isinstance(exc, RuntimeError) or type(exc).__module__.startswith("onnxruntime")):
        return exc
    unsupported = no_gradient_error(exc)
    if unsupported is not None:
        return unsupported
    shapes = {name: a.shape[1:] for name, a in batch.inputs.items()}
    size = next(iter(batch.inputs.values())).shape[0]
    return ModelError(
        f"onnxruntime cannot run the model at input shape {format_shapes(shapes)}, batch "
        f"{size} ({first_line(exc)[-300:]}): pass the shape it was exported for with "
        "--input-shape"
    )


def measure_thorough(
    model: LoadedModel,
    model_b,
    batch,
    weights,
    bn_layers,
    *,
    repeats: int,
    warmup: int,
    threads: int,
    clock: str,
    work: Path,
    cache: ArtifactCache,
) -> Measured:
    """Level ``thorough``: artifacts per configuration, profiled graphs AND real training-API
    steps of each, the optimizer on seven subsets (module docstring, steps 1-6)."""
    names = model.names
    n = len(names)
    loss = model.task.loss
    configs = _configurations(model.tensors)
    masks = {c: selection_mask(n, sel) for c, sel in configs.items()}
    if n > 2:  # only the last tensor trainable: the forward runs almost as inference
        masks["last_only"] = selection_mask(n, [n - 1])
    bn_tensors = {i for _, g, b in bn_layers for i in (g, b)}
    if bn_layers and len(bn_tensors) < n:  # every batch norm in inference mode
        masks["bn_inference"] = selection_mask(n, [i for i in range(n) if i not in bn_tensors])
        if "last_only" in masks:  # the frozen forward in inference mode (baked: fused)
            masks["last_only_inference"] = masks["last_only"]
            # the frozen layers a gradient passes, in inference mode (baked: fused)
            masks["first_only_inference"] = masks["first_only"]
    art_dirs = {
        c: cache.get(
            model_b,
            *model.split(m),
            loss=loss,
            frozen_bn="inference" if c in _INFERENCE_CONFIGS else "train",
        )[0].directory
        for c, m in masks.items()
    }
    try:  # ORT raises here when the model does not run at this input shape
        # All measurements interleaved round by round: profiled graphs, real steps, optimizer.
        graphs = {
            c: ProfiledGraph(
                art_dirs[c] / "training_model.onnx", weights, batch, threads=threads, work_dir=work
            )
            for c in (*configs, "bn_inference")
            if c in art_dirs
        }
        steps = {c: TrainStep(d, batch, threads=threads, clock=clock) for c, d in art_dirs.items()}
        params = {name: weights[name].astype(np.float32) for name in names}
        optimizer = OptimizerSubsets(
            art_dirs["full"] / "optimizer_model.onnx",
            params,
            optimizer_subsets(params),
            threads=threads,
            work_dir=work,
        )
        runners = [r for c in configs for r in (graphs[c], steps[c])] + [optimizer]
        if "last_only" in steps:
            runners.append(steps["last_only"])
        if "bn_inference" in steps:
            runners += [graphs["bn_inference"], steps["bn_inference"]]
        runners += [steps[c] for c in ("last_only_inference", "first_only_inference") if c in steps]
        round_robin(runners, repeats, warmup)
    except Exception as exc:
        raise ort_error(exc, batch) from exc
    node_times = {c: g.result(warmup) for c, g in graphs.items()}
    return Measured(
        masks=masks,
        node_times={c: node_times[c] for c in configs},
        bn_times=node_times.get("bn_inference"),
        steps={c: s.result(warmup) for c, s in steps.items()},
        calibrate=list(configs),
        frozen_bn={c: "inference" for c in _INFERENCE_CONFIGS if c in masks},
        observations=optimizer.result(warmup),
        full_training_model=art_dirs["full"] / "training_model.onnx",
    )


def has_fused_bias_grad(training_model) -> bool:
    """Whether a fused gradient node of the training graph (ConvGrad) computes a bias
    gradient (``db`` part) beside dX and dW."""
    return any(
        "db" in fused_grad_parts(node.op_type, node.output) for node in training_model.graph.node
    )


def _fast_configurations(
    model: LoadedModel, full: onnx.ModelProto, bn_layers
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The fast level's configurations (:mod:`etgraph.profiler`, "Profiling levels"): selection
    mask per configuration (``full`` first) and the batch-norm mode of each configuration
    measured in inference mode. ``full``: the all-trainable training graph."""
    n = len(model.names)
    masks = {"full": selection_mask(n, range(n))}
    frozen_bn = {}
    if n > 1:
        masks["first_only"] = selection_mask(n, [0])
        if bn_layers:  # the batch norms' inference mode is measured in the same graph
            frozen_bn["first_only"] = "inference"
        no_kernels = [t.index for t in model.tensors if t.kind != "kernel"]
        if has_fused_bias_grad(full) and 0 < len(no_kernels) < n:
            # splits a fused node's dB from its dX
            masks["no_kernels"] = selection_mask(n, no_kernels)
    if n > 2:
        masks["last_only"] = selection_mask(n, [n - 1])
        if bn_layers:  # the frozen forward of --frozen-bn inference as training runs it: baked
            masks["last_only_inference"] = masks["last_only"]
            frozen_bn["last_only_inference"] = "inference"
    return masks, frozen_bn


def _fast_training_graphs(
    model: LoadedModel, light, full, masks, frozen_bn, weights, work: Path
) -> dict:
    """The training graph of each configuration, built in memory from ``light`` (the model
    without weights); ``full`` is the all-trainable one. The ``last_only`` graphs, and
    ``first_only`` in inference mode, are saved with their frozen parameters baked in, as
    training sessions run them."""
    graphs_in = {"full": full}
    for c, m in masks.items():
        if c not in graphs_in:
            graphs_in[c], _ = training_graphs(
                light, *model.split(m), loss=model.task.loss, frozen_bn=frozen_bn.get(c, "train")
            )
    # As training sessions run them: frozen parameters baked in
    # (etgraph.artifact_weights.bake_frozen). The last_only graphs' nodes fuse (their steps
    # only are used); in first_only's (batch norms in inference mode) the backward nodes keep
    # their names (the ConvGrad split and the batch norms' inference backward read them) and
    # the frozen layers' forward fuses as it does in training (profiler step 6).
    baked = ["last_only", "last_only_inference"]
    if frozen_bn.get("first_only") == "inference":
        baked.append("first_only")
    for c in baked:
        if c in graphs_in:
            graphs_in[c] = save_baked(graphs_in[c], weights, work / f"{c}_baked.onnx")
    return graphs_in


def measure_fast(
    model: LoadedModel,
    model_b,
    batch,
    weights,
    bn_layers,
    *,
    repeats: int,
    warmup: int,
    threads: int,
    clock: str,
    work: Path,
    node_overhead_us: float,
    full_artifacts: Path | None,
) -> Measured:
    """Level ``fast`` (module docstring, "Profiling levels"): training graphs built in memory
    (no checkpoint, no training-API session), profiled graphs only, a step from its graph's
    runs without the trace (:meth:`etgraph.measure.ProfiledGraph.untraced_time_us`) plus the
    AdamW fit, the optimizer on four subsets. ``full_artifacts``: a directory holding the
    all-trainable artifacts already (their graphs are used), or None."""
    names = model.names
    n = len(names)
    loss = model.task.loss
    full_mask = selection_mask(n, range(n))
    light = placeholder_weights(model_b, model.names + model.split(full_mask)[1])  # once
    if full_artifacts is not None:
        full = onnx.load(str(full_artifacts / "training_model.onnx"), load_external_data=False)
        optimizer_model = full_artifacts / "optimizer_model.onnx"
    else:
        full, optimizer_model = training_graphs(light, *model.split(full_mask), loss=loss)
    masks, frozen_bn = _fast_configurations(model, full, bn_layers)
    graphs_in = _fast_training_graphs(model, light, full, masks, frozen_bn, weights, work)
    params = {name: np.asarray(weights[name], dtype=np.float32) for name in names}
    zeros: dict[str, np.ndarray] = {}
    try:
        graphs = {
            c: ProfiledGraph(
                g, weights, batch, threads=threads, work_dir=work, name=c, clock=clock, zeros=zeros
            )
            for c, g in graphs_in.items()
        }
        optimizer = OptimizerSubsets(
            optimizer_model,
            params,
            optimizer_subsets(params, fast=True),
            threads=threads,
            work_dir=work,
            zeros={},  # not the graphs' buffers: those hold gradients after a run
        )

        # Until a round's wall time (every graph once; the clock of the kernel times) is
        # reproduced: a loaded machine gets more rounds.
        def rounds_agree() -> bool:
            walls = zip(*(g.wall[warmup:] for g in graphs.values()), strict=True)
            return reproduced([sum(r) for r in walls], REPRODUCED_TOLERANCE)

        measured_rounds = round_robin(
            [*graphs.values(), optimizer],
            repeats,
            warmup,
            until=rounds_agree,
            max_repeats=max(repeats, FAST_MAX_REPEATS),
        )
        agreed = rounds_agree()
    except Exception as exc:
        raise ort_error(exc, batch) from exc
    # Every graph's result (it reads the trace); the baked one's nodes are fused: its step only.
    node_times = {c: g.result(warmup, FAST_QUANTILE) for c, g in graphs.items()}
    observations = optimizer.result(warmup, FAST_QUANTILE)
    opt_fit = fit_optimizer(observations)
    numel = np.array([weights[name].size for name in names], dtype=np.float64)
    # A step: the graph's run without the trace, plus the AdamW step of its tensors.
    steps = {
        c: g.untraced_time_us(warmup, node_overhead_us)
        + opt_fit.fixed_us
        + float(opt_fit.tensor_us(numel[masks[c]]).sum())
        for c, g in graphs.items()
    }
    trace_us = max(0.0, graphs["full"].trace_us_per_node(warmup) - node_overhead_us)
    return Measured(
        masks=masks,
        node_times={c: node_times[c] for c in ("full", "first_only", "no_kernels") if c in masks},
        bn_times=node_times["first_only"] if frozen_bn.get("first_only") else None,
        steps=steps,
        # first_only only in training mode: for_frozen_bn's batch-norm differences miss part
        # of what inference mode saves (its bn_inference check over-predicts by 2-16% at the
        # thorough level), which would move the fixed cost
        calibrate=[
            c for c in ("full", "no_kernels", "first_only") if c in masks and c not in frozen_bn
        ],
        frozen_bn=frozen_bn,
        observations=observations,
        full_training_model=full,
        trace_us=trace_us,
        repeats=measured_rounds,
        reproduced=agreed,
    )
