"""``etgraph compile``: the main job, model -> graph -> timings -> selection -> artifacts.

One function, :func:`compile_model`, runs the whole chain once and writes a compiled directory
that ``etgraph train OUT`` continues from and ``etgraph inspect OUT`` reads, and nothing else::

    OUT/model.onnx          the legalised forward model (what everything else was built from)
    OUT/graph.json|.graphml|.dot   tensor-level backward graph with timings, importance, selection
    OUT/profile.json        per-tensor t_dw_us / t_dy_us, forward_us, measured_full_step_us
    OUT/memory.json         with --memory-mb: the memory model (etgraph.memory.MemoryProfile)
    OUT/plan.json           the selection: rho, budget, t_full_us, predicted step time, the
                            per-tensor table, frozen and trainable parameter lists; the
                            model's input normalisation (``preprocess``) and the frozen
                            batch-norm mode (``frozen_bn``), reused by ``etgraph train OUT``
    OUT/artifacts/          training_model.onnx, eval_model.onnx, optimizer_model.onnx, checkpoint
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from passes.layout import tensor_id
from passes.onnx import DEFAULT_FROZEN_BN

from . import artifacts, dumps, graph, memory_profiler, profile, profiler, selection, timing
from .artifacts import ArtifactCache, check_frozen_bn
from .data import DEFAULT_MODEL_PATH, DEFAULT_PREPROCESS, Preprocess, load_task_data
from .errors import ConfigError
from .files import atomic_target, ensure_writable_dir, write_json_atomic
from .importance import probe_importance
from .memory import MemoryProfile
from .model import LoadedModel, TensorInfo, exported_batch_hint
from .plan import PLAN_FILE, data_record
from .rundir import check_not_run_dir
from .text import check_text_options

log = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"
MEMORY_FILE = "memory.json"
MODEL_FILE = "model.onnx"
ARTIFACTS_DIR = "artifacts"


def data_free_importance(tensors: list[TensorInfo]) -> np.ndarray:
    """Importance prior used when no data is given: each tensor's share of the parameters.

    Without a probe batch there is no gradient, so the first-order importance of paper Eq. (2)
    cannot be evaluated; the number of weights a tensor holds is its capacity to reduce the loss
    and the neutral choice. ``etgraph train`` replaces it with measured importance every period.

    Returns:
        float64 [N], summing to 1, forward order.
    """
    params = np.array([t.params for t in tensors], dtype=np.float64)
    return params / params.sum()


def check_rho(rho: float) -> float:
    """Return ``rho`` if it lies in (0, 1]; raise ConfigError otherwise."""
    if not (0.0 < rho <= 1.0):
        raise ConfigError(
            f"rho must be in (0, 1], got {rho}: it is the step-time ratio to full training"
        )
    return rho


def check_batch_size(batch_size: int) -> int:
    """Return ``batch_size`` if positive; raise ConfigError otherwise."""
    if batch_size <= 0:
        raise ConfigError(f"batch size must be a positive integer, got {batch_size}")
    return batch_size


@dataclass
class CompileResult:
    """What :func:`compile_model` produced (paths inside ``out_dir``) and its key figures."""

    out_dir: Path
    n_tensors: int
    n_selected: int
    rho: float
    predicted_step_us: float
    t_full_us: float  # T_full of the time model (Profile.t_full_us)
    memory_mb: float | None = None  # the peak-memory budget, MiB (None: time budget only)
    predicted_peak_mb: float | None = None  # the memory model's peak of the selection, MiB

    @property
    def predicted_speedup(self) -> float:
        """Full step time over predicted step time of the selection (dimensionless)."""
        return self.t_full_us / self.predicted_step_us


def compile_model(
    model_path: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    *,
    rho: float = 0.5,
    batch_size: int = 4,
    input_shape=None,
    data: str | None = None,
    tokenizer: str | None = None,
    output: str | None = None,
    loss: str = "ce",
    profile_level: str = "fast",
    repeats: int | None = None,
    threads: int | None = None,
    resolution: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    preprocess: Preprocess | None = None,
    frozen_bn: str = DEFAULT_FROZEN_BN,
    memory_mb: float | None = None,
    memory_resolution_mb: float = 1.0,
) -> CompileResult:
    """Compile ``model_path`` for elastic training at step-time ratio ``rho``.

    Runs import + legalisation, the tensor-graph passes (paper §5), profiling on this device
    (cached), importance (first-order, paper Eq. 2, on a probe batch of ``data`` when given;
    otherwise :func:`data_free_importance`), the DP of paper Eq. (3) under
    ``rho * T_full`` (``Profile.t_full_us``, the time model's full step), and writes ORT
    training artifacts for the selection.

    Args:
        model_path: ONNX model (any data inputs; the output trained on ``[B, K]`` logits, or
            ``[B, D]`` for mse); None = embedded default.
        out_dir: the compiled directory to write (created; must be writable).
        rho: requested step time as a fraction of full training, in (0, 1].
        batch_size: training batch size the profile and plan are for (> 0).
        input_shape: per-input shapes (``--input-shape`` texts ``NAME=DIMS`` or a bare
            ``"CxHxW"``, a mapping, or ``(C, H, W)``; :func:`etgraph.model.input_shapes`);
            required where the model's dims are symbolic.
        data: dataset spec for the importance probe (``"digits"``, an image-folder path or a
            ``.npz`` file, or a .csv/.jsonl text file; :func:`etgraph.data.load_task_data`).
        tokenizer: the model's ``tokenizer.json`` for text ``data``.
        output: the graph output to train on (None: the model's only output).
        loss: ``"ce"`` (cross-entropy on logits) or ``"mse"`` (:class:`etgraph.model.Task`).
        profile_level: ``"fast"`` or ``"thorough"`` (:data:`etgraph.profiler.LEVELS`).
        repeats: profiler repetitions per configuration (None: the level's default).
        threads: ORT intra-op threads (default: profiler's default).
        resolution: DP time resolution ``T_q`` (None = exact µs).
        cache_dir: profile cache (default: the profiler's).
        preprocess: the model's input normalisation for image folders (None: ImageNet);
            recorded in ``plan.json`` for ``etgraph train``.
        frozen_bn: ``"inference"`` or ``"train"``: how unselected batch norms run in the
            artifacts (:mod:`etgraph.artifacts`); recorded in ``plan.json``.
        memory_mb: peak-memory budget, MiB (issue #17): bounds the training process's peak
            resident memory as the OS reports it, libraries included. The memory model is
            measured (:func:`etgraph.memory_profiler.profile_memory`, cached beside the
            profiles), written to ``memory.json``, and the DP selects under both budgets.
            None = time budget only (no memory measurement).
        memory_resolution_mb: the DP's memory unit, MiB.

    Returns:
        A :class:`CompileResult`.

    Raises:
        ModelError, UnsupportedOpError: the model cannot be loaded or trained.
        ConfigError: bad rho, batch size, input shape, output, loss or output directory.
        InfeasibleBudgetError: rho is below what the forward pass costs (gives the smallest rho).
        InfeasibleMemoryError: no selection fits ``memory_mb`` (gives the smallest budget).
        DataError: the probe dataset cannot be loaded.
    """
    check_rho(rho)
    check_text_options(data, tokenizer)
    check_batch_size(batch_size)
    check_frozen_bn(frozen_bn)
    preprocess = DEFAULT_PREPROCESS if preprocess is None else preprocess
    if memory_mb is not None and not 0 < memory_mb < float("inf"):
        raise ConfigError(f"--memory-mb must be a positive number of MiB, got {memory_mb}")
    source = Path(model_path) if model_path is not None else Path(DEFAULT_MODEL_PATH)
    out = ensure_writable_dir(out_dir, "-o")
    check_not_run_dir(out, "-o")

    model = LoadedModel.load(source, output=output, loss=loss)
    shapes = model.input_shapes(input_shape)
    dataset = None
    if data is not None:  # every data/model mismatch is an error before anything is measured
        dataset = load_task_data(
            data,
            inputs=model.inputs,
            shapes=shapes,
            task=model.task,
            tokenizer=tokenizer,
            preprocess=preprocess,
        )
    (out / PLAN_FILE).unlink(missing_ok=True)  # written last: a directory without it is not done
    (out / MEMORY_FILE).unlink(missing_ok=True)  # an earlier compile's, with --memory-mb
    with atomic_target(out / MODEL_FILE) as tmp:
        onnx.save(model.proto, str(tmp))
    tensors = list(model.tensors)
    log.info("%s: %d trainable tensors, inputs %s", source.name, len(tensors), shapes)

    with tempfile.TemporaryDirectory(prefix="etgraph-compile-") as work:
        # One cache for the graph and the profiler: the all-trainable artifacts are generated
        # once and the tensor-graph passes run once.
        cache = ArtifactCache(work)
        with exported_batch_hint(model.proto, batch_size):
            tensor_graph = graph.build_tensor_graph(
                model.with_batch(batch_size, shapes), cache=cache, loss=model.task.loss
            )
        prof = profiler.profile_model(
            model,
            batch_size=batch_size,
            input_shapes=shapes,
            level=profile_level,
            repeats=repeats,
            threads=threads,
            cache_dir=cache_dir if cache_dir is not None else profile.default_cache_dir(),
            tensor_graph=tensor_graph,
            artifact_cache=cache,
        )
        mem_prof: MemoryProfile | None = None
        if memory_mb is not None:
            mem_prof = memory_profiler.profile_memory(
                model,
                batch_size=batch_size,
                input_shapes=shapes,
                threads=prof.threads,
                cache_dir=cache_dir if cache_dir is not None else profile.default_cache_dir(),
                artifact_cache=cache,
                frozen_bn=frozen_bn,  # measured in the mode the artifacts will run
            )
    prof.save(out / PROFILE_FILE)
    prof = prof.for_frozen_bn(frozen_bn)  # the time model of the artifacts' batch-norm mode
    memory = None
    if mem_prof is not None:
        mem_prof.save(out / MEMORY_FILE)
        memory = selection.MemoryCosts.from_profile(
            mem_prof, memory_mb, resolution_mb=memory_resolution_mb
        )

    if data is None:
        importance = data_free_importance(tensors)
        importance_source = "data-free prior: parameter share"
    else:
        importance = probe_importance(
            model,
            data,
            batch_size=batch_size,
            input_shapes=shapes,
            tokenizer=tokenizer,
            preprocess=preprocess,
            dataset=dataset,
        )
        importance_source = f"first-order importance on a probe batch of {data}"

    chosen = selection.select_for_rho(prof, rho, importance, resolution=resolution, memory=memory)
    predicted = prof.predicted_step_us(chosen.mask)
    memory_parts = mem_prof.parts_mb(chosen.mask) if mem_prof is not None else None
    trainable, frozen = model.split(chosen.mask)
    artifacts.generate(
        model.proto,
        trainable,
        frozen,
        out / ARTIFACTS_DIR,
        loss=model.task.loss,
        frozen_bn=frozen_bn,
        static_batch=(batch_size, shapes),  # as the profile measured: static shapes
    )

    rows = [
        {
            "index": t.index,
            "name": t.name,
            "kind": t.kind,
            "t_dw_us": float(dw),
            "t_dy_us": float(dy),
            "importance": float(imp),
            "selected": bool(s),
        }
        for t, s, imp, dw, dy in zip(
            tensors, chosen.mask, importance, prof.t_dw_us, prof.t_dy_us, strict=True
        )
    ]
    columns = ["t_dw_us", "t_dy_us", "importance", "selected"]
    if mem_prof is not None:  # what each tensor adds, and the workspace if it is the earliest
        columns += ["tensor_mb", "earliest_mb"]
        for row, t_mb, e_mb in zip(rows, mem_prof.tensor_mb, mem_prof.earliest_mb, strict=True):
            row.update({"tensor_mb": float(t_mb), "earliest_mb": float(e_mb)})
    for row in rows:
        tensor_graph.nodes[tensor_id(row["name"])].update({k: row[k] for k in columns})
    for fmt in dumps.GRAPH_FORMATS:
        dumps.write_graph(tensor_graph, out / f"graph.{fmt}", fmt)

    plan = {
        "model": str(source),
        "model_hash": model.hash,
        "rho": rho,
        "batch_size": batch_size,
        "input_shapes": {name: list(dims) for name, dims in shapes.items()},
        "task": model.task.to_json(),  # output trained on, loss, K or D; `train OUT` reuses it
        "forward_us": prof.forward_us,
        "t_full_us": prof.t_full_us,
        "measured_full_step_us": prof.measured_full_step_us,
        "budget_us": timing.budget_us(rho, prof.forward_us, prof.t_full_us),
        "predicted_step_us": predicted,
        "memory_mb": memory_mb,  # the peak-memory budget (MiB), None = time only
        "predicted_peak_mb": None if memory_parts is None else memory_parts["peak_mb"],
        "memory_parts_mb": memory_parts,  # etgraph.memory.MemoryProfile.parts_mb
        "memory_resolution_mb": memory_resolution_mb if memory_mb is not None else None,
        "importance_source": importance_source,
        **data_record(data, tokenizer),  # etgraph train OUT trains on it (etgraph.plan)
        "removed_head": model.head,  # restored on the trained model etgraph train exports
        "resolution": resolution,
        "preprocess": preprocess.to_json(),  # reused by etgraph train OUT (etgraph.plan)
        "frozen_bn": frozen_bn,
        "tensors": rows,
        "frozen_params": frozen,
        "trainable_params": trainable,
    }
    write_json_atomic(out / PLAN_FILE, plan)
    return CompileResult(
        out_dir=out,
        n_tensors=len(tensors),
        n_selected=len(trainable),
        rho=rho,
        predicted_step_us=predicted,
        t_full_us=prof.t_full_us,
        memory_mb=memory_mb,
        predicted_peak_mb=None if memory_parts is None else memory_parts["peak_mb"],
    )
