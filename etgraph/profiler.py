"""Tensor timing profiler: measure ``t_dw_us``, ``t_dy_us`` and ``forward_us`` on this device.

Paper §2.2 (time model) and §5 (profiling execution times of tensor training), on ONNX Runtime.
Wall-clock time is measured, never FLOPs. The result is a :class:`etgraph.profile.Profile`
whose timings make :func:`etgraph.timing.step_us` predict the measured step time of any
selection mask::

    step_us(M) = forward_us + sum_k M[k] * t_dw_us[k] + sum_{k >= e(M)} t_dy_us[k]

(branch work counted exactly with ``Profile.branches``, see :mod:`etgraph.timing`).

:func:`profile_model` orchestrates; the measuring is in :mod:`etgraph.measure`, the folding of
measured times into the time model in :mod:`etgraph.fold`:

1. **Per-node backward times.** Artifacts are generated for a few *configurations* (sets of
   trainable tensors, :func:`_configurations`): ``full`` (all tensors), ``no_kernels`` (kernels
   frozen, biases/norms/embeddings trainable, so gradients still flow everywhere) and
   ``first_only`` (only tensor 0 trainable, so every later layer computes its input gradient
   and nothing else). Each ``training_model.onnx`` runs in a profiled plain
   ``InferenceSession`` (:class:`etgraph.measure.ProfiledGraph`); ``warmup`` runs are
   discarded, and of ``repeats`` runs of each node the 20th percentile is kept
   (:func:`etgraph.measure.robust_time`; a shared machine only ever adds time, so the low end
   is what reproduces; the same statistic times real steps). Each node also pays the
   executor's per-node cost outside its kernel (``node_overhead_us``, ~1 µs).
2. **Charging** (README, "The time model and the charging rule"): every node of the ``full``
   training graph is charged through :func:`etgraph.graph.charges` to one tensor's ``t_dw_us``
   or ``t_dy_us``, or to the forward pass (:func:`etgraph.fold.charge_node_times`). Fused
   ``ConvGrad`` nodes (kind ``split``) compute dX, dW and dB in one kernel; they are split
   **by measurement**: in each configuration the node's non-empty outputs say which parts it
   computed, and its times over the configurations are solved for the per-part times by
   non-negative least squares (:func:`etgraph.fold.split_by_measurement`).
3. **Optimizer.** ORT's optimizer model is ONE ``AdamWOptimizer`` node over the sequence of
   trainable tensors; its kernel time is measured on several subsets of the tensors and fitted
   as ``fixed + per_tensor * count + per_element * elements``
   (:func:`etgraph.fold.fit_optimizer`); the per-tensor part is added to ``t_dw_us[k]``, the
   fixed part goes into ``forward_us``.
4. **Calibration.** ``measured_full_step_us`` is MEASURED with ``onnxruntime.training.api``
   (:class:`etgraph.measure.TrainStep`), as are the steps of the other configurations; all
   measurements (profiled graphs, real steps, optimizer subsets) are taken round-robin, one run
   each per round, so load changes on a shared machine hit them alike. What the node and
   optimizer times do not explain is ``step_overhead_us`` (:func:`etgraph.fold.calibrate`),
   folded into ``forward_us``. Measured vs predicted steps of the configurations are kept in
   ``checks``. ``clock="cpu"`` (one thread only) times steps by the calling thread's CPU time
   (:func:`etgraph.measure.step_clock`).
5. **Batch norms in inference mode** (``--frozen-bn inference``, issue #14). When the model
   has batch norms, a fifth configuration, ``bn_inference`` (every batch norm's gamma and
   beta frozen, so every batch norm runs in inference mode; all other tensors trainable), is
   profiled per node and timed as a real step: each batch norm's inference forward and
   backward (a per-channel ``Mul`` of ``dy``) against its training-mode ``BatchNormInternal``
   and ``BatchNormalizationGrad`` of the ``full`` graph (:func:`etgraph.fold.batch_norm_modes`)
   go into ``Profile.batch_norms``; :meth:`etgraph.profile.Profile.for_frozen_bn` turns them
   into the time model of that mode, checked against the measured step in
   ``checks["bn_inference"]``.
6. **Forward work only training needs.** A fourth configuration, ``last_only`` (only the last
   tensor trainable), is timed as a real step; the share of the forward it saves
   (:func:`etgraph.fold.saved_forward_fraction`) is moved from the forward pass to ``t_dy_us``
   of each forward node's anchor tensor (:func:`etgraph.fold.forward_us_by_anchor`). Sessions
   bake frozen parameters into their graphs (:func:`etgraph.artifacts.bake_frozen`), so with
   batch norms in inference mode the frozen forward is fused further (Conv + BN + activation):
   ``last_only_inference`` (the same mask, ``--frozen-bn inference``) is timed too, and what
   the inference time model does not explain of it is spread over the anchors likewise
   (``Profile.inference_forward_moved_us``, applied by ``Profile.for_frozen_bn``).

``forward_us`` is therefore the selection-independent part of a step: forward pass and loss
(``forward_pass_us``, less the moved share) + optimizer fixed cost + ``step_overhead_us``.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import networkx as nx
import numpy as np
import onnxruntime as ort

from . import graph
from .artifacts import ArtifactCache, inference_batch_norms
from .errors import ConfigError, ModelError, first_line
from .fold import (
    batch_norm_modes,
    calibrate,
    charge_node_times,
    fit_optimizer,
    forward_us_by_anchor,
    optimizer_subsets,
    saved_forward_fraction,
)
from .host import host_description, physical_cores
from .measure import (
    OptimizerSubsets,
    ProfiledGraph,
    TrainStep,
    measure_node_overhead_us,
    random_batch,
    round_robin,
    step_clock,
)
from .model import LoadedModel, TensorInfo
from .profile import Profile, format_shapes, profile_key
from .timing import BranchCharges, backward_us, step_us

log = logging.getLogger(__name__)

__all__ = ["profile_model"]


#: Configurations whose batch norms with frozen gamma and beta run in inference mode.
_INFERENCE_CONFIGS = frozenset({"bn_inference", "last_only_inference"})


def profile_model(
    model: LoadedModel,
    *,
    batch_size: int = 4,
    input_shapes=None,
    repeats: int = 10,
    warmup: int = 3,
    threads: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    clock: str = "wall",
    tensor_graph: nx.DiGraph | None = None,
    artifact_cache: ArtifactCache | None = None,
) -> Profile:
    """Profile per-tensor backward times of a model on this device (paper §5).

    See the module docstring for the method (configurations, charging, ConvGrad split by
    measurement, optimizer fit, calibration against a measured step).

    Args:
        model: the loaded model (any data inputs, fed by name; the output of its task with a
            static K or D).
        batch_size: B, > 0.
        input_shapes: per-input shapes (:meth:`etgraph.model.LoadedModel.input_shapes`:
            ``--input-shape`` texts, a mapping, or ``(C, H, W)`` for one input); None = the
            model's own static shapes.
        repeats, warmup: measured / discarded runs per measurement (repeats >= 1, warmup >= 0).
        threads: ORT intra-op threads; None = physical cores. Recorded in the profile.
        cache_dir: if given, profiles are cached there as ``<key>.json`` keyed by model hash,
            input shapes, batch size, threads, clock and loss
            (:func:`etgraph.profile.profile_key`);
            a hit is returned as is.
        clock: how real steps (``measured_full_step_us``, calibration) are timed: ``"wall"``
            (default) or ``"cpu"`` (thread CPU time, needs ``threads=1``;
            :func:`etgraph.measure.step_clock`).
        tensor_graph: the charged tensor graph (:func:`etgraph.graph.build_tensor_graph`) of
            the all-trainable training model of ``model.with_batch(batch_size, shapes)`` in
            ``artifact_cache``, when the caller has it. Else (or when its node names are not
            those of that training model: ORT numbers the loss node per process) the graph is
            built once from the ``full`` configuration's training model.
        artifact_cache: where the configurations' artifacts are generated (a caller that
            generated the all-trainable artifacts of ``model.with_batch(batch_size, shapes)``
            through it gets a hit); default a temporary cache, removed.

    Returns:
        The :class:`~etgraph.profile.Profile` (``t_dw_us``/``t_dy_us`` float64 [N], µs,
        forward order).

    Raises:
        ModelError: ORT cannot build or run the training graph at this shape; the output has
            no static class count.
        ConfigError: bad batch size, input shape, repeats, threads or clock.
        ProfileMismatchError: a cached profile under this key belongs to another setting.
    """
    if batch_size <= 0:
        raise ConfigError(f"batch size must be a positive integer, got {batch_size}")
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    threads = physical_cores() if threads is None else int(threads)
    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    step_clock(clock, threads)
    shapes = model.input_shapes(input_shapes)
    loss = model.task.loss

    cache_path = None
    if cache_dir is not None:
        key = profile_key(model.hash, shapes, batch_size, threads, clock, loss)
        cache_path = Path(cache_dir) / f"{key}.json"
        if cache_path.is_file():
            cached = Profile.load(cache_path)
            cached.check_matches(
                model.hash,
                batch_size=batch_size,
                input_shapes=shapes,
                threads=threads,
                clock=clock,
                loss=loss,
            )
            log.info("profile cache hit: %s", cache_path)
            return cached

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="etgraph-profile-") as work:
        cache = artifact_cache if artifact_cache is not None else ArtifactCache(Path(work) / "a")
        prof = _profile(
            model,
            shapes,
            batch_size=batch_size,
            repeats=repeats,
            warmup=warmup,
            threads=threads,
            clock=clock,
            work=Path(work),
            cache=cache,
            tensor_graph=tensor_graph,
        )
    prof.profiling_s = time.perf_counter() - start
    log.info("profiled %d tensors in %.1f s", len(prof.tensors), prof.profiling_s)
    if cache_path is not None:
        prof.save(cache_path)
    return prof


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


def _batch_norm_layers(model: LoadedModel) -> list[tuple[str, int, int]]:
    """``(node name, gamma index, beta index)`` of every batch norm that ``--frozen-bn
    inference`` can put in inference mode (both its gamma and beta are trainable tensors)."""
    index = {t.name: t.index for t in model.tensors}
    nodes = {n.name: n for n in model.proto.graph.node}
    layers = []
    for name in inference_batch_norms(model.proto, [], "inference"):
        gamma, beta = nodes[name].input[1:3]
        if gamma in index and beta in index:
            layers.append((name, index[gamma], index[beta]))
    return layers


def _mask(n: int, selected: Sequence[int]) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    mask[list(selected)] = True
    return mask


def _profile(
    model: LoadedModel,
    shapes: dict[str, tuple[int, ...]],
    *,
    batch_size: int,
    repeats: int,
    warmup: int,
    threads: int,
    clock: str,
    work: Path,
    cache: ArtifactCache,
    tensor_graph: nx.DiGraph | None,
) -> Profile:
    names = model.names
    n = len(names)
    weights = model.initial_weights()
    batch = random_batch(batch_size, model.inputs, shapes, model.task)
    model_b = model.with_batch(batch_size, shapes)
    loss = model.task.loss

    configs = _configurations(model.tensors)
    masks = {c: _mask(n, sel) for c, sel in configs.items()}
    if n > 2:  # only the last tensor trainable: the forward runs almost as inference
        masks["last_only"] = _mask(n, [n - 1])
    bn_layers = _batch_norm_layers(model)
    bn_tensors = {i for _, g, b in bn_layers for i in (g, b)}
    if bn_layers and len(bn_tensors) < n:  # every batch norm in inference mode
        masks["bn_inference"] = _mask(n, [i for i in range(n) if i not in bn_tensors])
        if "last_only" in masks:  # the frozen forward in inference mode (baked: fused)
            masks["last_only_inference"] = masks["last_only"]
    art_dirs = {
        c: cache.get(
            model_b,
            *model.split(m),
            loss=loss,
            frozen_bn="inference" if c in _INFERENCE_CONFIGS else "train",
        )[0].directory
        for c, m in masks.items()
    }
    node_overhead = measure_node_overhead_us(threads)
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
        if "last_only_inference" in steps:
            runners.append(steps["last_only_inference"])
        round_robin(runners, repeats, warmup)
    except Exception as exc:
        if not (isinstance(exc, RuntimeError) or type(exc).__module__.startswith("onnxruntime")):
            raise
        raise ModelError(
            f"onnxruntime cannot run the model at input shape {format_shapes(shapes)}, batch "
            f"{batch_size} ({first_line(exc)[-300:]}): pass the shape it was exported for with "
            "--input-shape"
        ) from exc
    node_times = {c: g.result(warmup) for c, g in graphs.items()}
    bn_times = node_times.pop("bn_inference", None)
    measured = {c: s.result(warmup) for c, s in steps.items()}
    opt_fit = fit_optimizer(optimizer.result(warmup))
    del graphs, steps, optimizer, runners
    for c in configs:
        log.info("config %s: %d nodes, step %.0f us", c, len(node_times[c]), measured[c])
    if "last_only" in measured:
        log.info("config last_only: step %.0f us", measured["last_only"])
    numel = np.array([weights[name].size for name in names], dtype=np.float64)

    charges = graph.charges(tensor_graph) if tensor_graph is not None else {}
    if not set(node_times["full"]) <= set(charges):
        if tensor_graph is not None:
            # ORT numbers some node names per process (the loss node): a graph built from
            # another generation of the training model names them differently.
            log.info("the given tensor graph is of another training model: building it again")
        # Built once, from the training model just profiled.
        full_training_model = art_dirs["full"] / "training_model.onnx"
        charges = graph.charges(
            graph.build_tensor_graph(model_b, training_model=full_training_model, loss=loss)
        )
    charged = charge_node_times(node_times, charges, names, node_overhead)
    t_dw = charged.t_dw_us + opt_fit.tensor_us(numel)
    t_dy = charged.t_dy_us
    forward_pass = charged.forward_pass_us
    branches = BranchCharges.from_rows(charged.branches, n)

    constant = forward_pass + opt_fit.fixed_us
    explained = {c: constant + backward_us(m, t_dw, t_dy, branches) for c, m in masks.items()}
    step_overhead = calibrate([explained[c] for c in configs], [measured[c] for c in configs])
    # Forward work that only a training graph does (activations kept, no fusion): saved when
    # no gradient passes the layer, so it belongs on t_dy of the layer's anchor tensor.
    by_anchor = forward_us_by_anchor(model_b, charged.rows, names, node_overhead)
    forward_saved = 0.0
    if "last_only" in measured:
        forward_saved = saved_forward_fraction(
            step_overhead, measured["last_only"] - explained["last_only"], by_anchor[:-1].sum()
        )
    moved = forward_saved * by_anchor
    t_dy = t_dy + moved
    forward_pass -= moved.sum()
    forward_us = forward_pass + opt_fit.fixed_us + step_overhead
    if forward_us < 0:
        log.warning("negative constant step time %.0f us; clamping to 0", forward_us)
        forward_us = 0.0

    checks = {
        c: {
            "measured_us": measured[c],
            "predicted_us": step_us(mask, t_dw, t_dy, forward_us, branches),
            "trainable": int(mask.sum()),
        }
        for c, mask in masks.items()
    }
    batch_norms = []
    if bn_times is not None:
        batch_norms = batch_norm_modes(
            node_times["full"], bn_times, bn_layers, charges, node_overhead
        )
    prof = Profile(
        model_hash=model.hash,
        tensors=names,
        kinds=[t.kind for t in model.tensors],
        t_dw_us=t_dw,
        t_dy_us=t_dy,
        forward_us=float(forward_us),
        measured_full_step_us=float(measured["full"]),
        batch_size=int(batch_size),
        input_shapes=shapes,
        threads=threads,
        clock=clock,
        loss=loss,
        ort_version=ort.__version__,
        host=host_description(),
        forward_pass_us=float(forward_pass),
        optimizer_fixed_us=opt_fit.fixed_us,
        optimizer_per_tensor_us=opt_fit.per_tensor_us,
        optimizer_per_element_us=opt_fit.per_element_us,
        node_overhead_us=float(node_overhead),
        step_overhead_us=float(step_overhead),
        forward_saved_fraction=float(forward_saved),
        repeats=int(repeats),
        warmup=int(warmup),
        checks=checks,
        nodes=charged.rows,
        branches=charged.branches,
        batch_norms=batch_norms,
    )
    if "last_only_inference" in measured:
        # What the per-node inference deltas do not explain of the frozen forward in inference
        # mode (sessions bake frozen weights: ORT fuses Conv + BN + activation there), moved
        # from the forward pass to t_dy of the anchors, as forward_saved is in training mode.
        residual = (
            prof.for_frozen_bn("inference").predicted_step_us(masks["last_only_inference"])
            - measured["last_only_inference"]
        )
        skipped = by_anchor[:-1].sum()
        if skipped > 0:
            extra = float(np.clip(residual / skipped, -forward_saved, 1.0 - forward_saved))
            prof.inference_forward_moved_us = [float(v) for v in extra * by_anchor]
    for c in _INFERENCE_CONFIGS & set(checks):  # inference-mode time model vs measured step
        checks[c]["predicted_us"] = prof.for_frozen_bn("inference").predicted_step_us(masks[c])
    return prof
