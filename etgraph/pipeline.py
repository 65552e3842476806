"""``etgraph compile``: the main job, model -> graph -> timings -> selection -> artifacts.

:func:`compile` runs the whole chain once and returns a :class:`etgraph.plan.Plan` in memory;
:meth:`Plan.save` writes the compiled directory that ``etgraph train OUT`` continues from and
``etgraph inspect OUT`` reads (:mod:`etgraph.plan` lists its files). :func:`compile_model` is
the command's: it checks the output directory before any work, holds its lock, compiles and
saves.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import numpy as np
import onnx

from passes.onnx import DEFAULT_FROZEN_BN, check_head_lr_scale

from . import graph, memory_profiler, onnx_io, profile, profiler, selection
from .artifacts import ArtifactCache, check_frozen_bn
from .data import DEFAULT_MODEL_PATH, load_task_data, recorded_spec
from .errors import ConfigError, DataError, HeadLrScaleError
from .files import exclusive_lock, private_temp_dir
from .images import DEFAULT_PREPROCESS, Preprocess
from .importance import probe_importance
from .io_specs import exported_batch_hint
from .memory import MemoryProfile, check_step_fits
from .model import LoadedModel, TensorInfo
from .plan import Plan, prepare_compiled_dir
from .text import check_text_options

log = logging.getLogger(__name__)

__all__ = ["CompileResult", "compile", "compile_model", "data_free_importance"]


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


def _check_settings(rho, batch_size, data, tokenizer, frozen_bn, memory_mb, head_lr_scale) -> None:
    """The settings' one-line errors, before anything is loaded or measured."""
    check_rho(rho)
    if head_lr_scale is not None:
        check_head_lr_scale(head_lr_scale)
    if data is not None and not isinstance(data, (str, os.PathLike)):
        raise DataError(
            "compile's data is a spec (digits, an image folder, FILE.npz, FILE.csv|.jsonl), "
            f"not {type(data).__name__}: give arrays in memory to plan.trainer(config, "
            "data=...), which measures importance on them at its first period"
        )
    check_text_options(data, tokenizer)
    check_batch_size(batch_size)
    check_frozen_bn(frozen_bn)
    if memory_mb is not None and not 0 < memory_mb < float("inf"):
        raise ConfigError(f"--memory-mb must be a positive number of MiB, got {memory_mb}")


def compile(  # noqa: A001 (the API's verb, as torch.compile)
    model: LoadedModel | str | os.PathLike | onnx.ModelProto | None = None,
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
    head_lr_scale: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Compile a model for elastic training at step-time ratio ``rho``, in memory.

    Runs import + legalisation, the tensor-graph passes (paper §5), profiling on this device
    (cached), importance (first-order, paper Eq. 2, on a probe batch of ``data`` when given;
    otherwise :func:`data_free_importance`) and the DP of paper Eq. (3) under
    ``rho * T_full`` (``Profile.t_full_us``, the time model's full step). The artifacts are
    generated when the plan is saved (:meth:`etgraph.plan.Plan.save`).

    Args:
        model: a loaded model (:func:`etgraph.load_model`), an ONNX file, an
            ``onnx.ModelProto``, or None for the embedded default.
        rho: requested step time as a fraction of full training, in (0, 1].
        batch_size: training batch size the profile and plan are for (> 0).
        input_shape: per-input shapes (``--input-shape`` texts ``NAME=DIMS`` or a bare
            ``"CxHxW"``, a mapping, or ``(C, H, W)``; :func:`etgraph.io_specs.input_shapes`);
            required where the model's dims are symbolic.
        data: dataset spec for the importance probe (``"digits"``, an image-folder path, a
            ``.npz`` file, or a .csv/.jsonl text file; :func:`etgraph.data.load_task_data`);
            recorded in the plan as the data to train on.
        tokenizer: the model's ``tokenizer.json`` for text ``data``.
        output, loss: the graph output to train on and the loss (a model given as a file or
            proto; :func:`etgraph.load_model`).
        profile_level: ``"fast"`` or ``"thorough"`` (:data:`etgraph.profiler.LEVELS`).
        repeats: profiler repetitions per configuration (None: the level's default).
        threads: ORT intra-op threads (default: profiler's default).
        resolution: DP time resolution ``T_q`` (None = exact µs).
        cache_dir: profile cache (default: the profiler's).
        preprocess: the model's input normalisation for image folders (None: ImageNet).
        frozen_bn: ``"inference"`` or ``"train"``: how unselected batch norms run in the
            artifacts (:mod:`etgraph.artifacts`).
        memory_mb: peak-memory budget, MiB (issue #17): bounds the training process's peak
            resident memory as the OS reports it, libraries included. The memory model is
            measured (:func:`etgraph.memory_profiler.profile_memory`, cached beside the
            profiles) and the DP selects under both budgets. None = time budget only.
        memory_resolution_mb: the DP's memory unit, MiB.
        head_lr_scale: train the head at this factor times the learning rate (``S``;
            :func:`etgraph.load_model`): the profile, importance, selection and artifacts are of
            the scaled model, and its plan trains at ``S``. None: as the model records (1 for a
            model etgraph did not compile).
        progress: called with one line per stage as it starts (a command's progress output).

    Returns:
        A :class:`etgraph.plan.Plan`.

    Raises:
        ModelError, UnsupportedOpError: the model cannot be loaded or trained.
        ConfigError: bad rho, batch size, input shape, output or loss.
        InfeasibleBudgetError: rho is below what the forward pass costs (gives the smallest rho).
        InfeasibleMemoryError: no selection fits ``memory_mb`` (gives the smallest budget).
        DataError: the probe dataset cannot be loaded, or ``data`` is not a spec (arrays in
            memory go to :meth:`Plan.trainer`).
    """
    _check_settings(rho, batch_size, data, tokenizer, frozen_bn, memory_mb, head_lr_scale)
    say = progress or (lambda line: None)
    preprocess = DEFAULT_PREPROCESS if preprocess is None else preprocess
    if not isinstance(model, LoadedModel):
        from .api import load_model

        say(f"loading {model if model is not None else 'the embedded default model'}")
        model = load_model(model, output=output, loss=loss, head_lr_scale=head_lr_scale)
    elif head_lr_scale is not None and head_lr_scale != model.head_lr_scale:
        raise HeadLrScaleError(
            f"head_lr_scale {head_lr_scale:g} given with a model loaded at "
            f"{model.head_lr_scale:g}: load it with etgraph.load_model(..., "
            f"head_lr_scale={head_lr_scale:g}), or pass the model's path"
        )
    shapes = model.input_shapes(input_shape)
    check_step_fits(model, batch_size, shapes)  # before anything is allocated
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
    cache_dir = cache_dir if cache_dir is not None else profile.default_cache_dir()
    log.info("%s: %d trainable tensors, inputs %s", model.source.name, len(model.tensors), shapes)
    tensor_graph, prof, mem_prof = _graph_and_timings(
        model,
        batch_size,
        shapes,
        profile_level=profile_level,
        repeats=repeats,
        threads=threads,
        cache_dir=cache_dir,
        frozen_bn=frozen_bn,
        with_memory=memory_mb is not None,
        say=say,
    )
    memory = None
    if mem_prof is not None:
        memory = selection.MemoryCosts.from_profile(
            mem_prof, memory_mb, resolution_mb=memory_resolution_mb
        )
    importance, importance_source = _importance(
        model, data, batch_size, shapes, tokenizer, preprocess, dataset, say
    )
    say(f"selecting tensors under rho {rho:g} (DP, paper Eq. 3)")
    time_model = prof.for_frozen_bn(frozen_bn)  # the artifacts' batch-norm mode
    chosen = selection.select_for_rho(
        time_model, rho, importance, resolution=resolution, memory=memory
    )
    return Plan(
        model=model,
        profile=prof,
        rho=rho,
        batch_size=batch_size,
        input_shapes=dict(shapes),
        mask=np.asarray(chosen.mask, dtype=bool),
        importance=importance,
        importance_source=importance_source,
        preprocess=preprocess,
        frozen_bn=frozen_bn,
        data=recorded_spec(data),
        tokenizer=recorded_spec(tokenizer),
        resolution=resolution,
        memory_profile=mem_prof,
        memory_mb=memory_mb,
        memory_resolution_mb=memory_resolution_mb if memory_mb is not None else None,
        tensor_graph=tensor_graph,
    )


def _graph_and_timings(
    model: LoadedModel,
    batch_size: int,
    shapes,
    *,
    profile_level: str,
    repeats: int | None,
    threads: int | None,
    cache_dir,
    frozen_bn: str,
    with_memory: bool,
    say: Callable[[str], None],
) -> tuple[nx.DiGraph, profile.Profile, MemoryProfile | None]:
    """The tensor graph, the time model and (``with_memory``) the memory model of ``model`` at
    this batch and shapes, measured on this device (profiles cached in ``cache_dir``)."""
    with private_temp_dir("compile") as work:
        # One cache for the graph and the profiler: the all-trainable artifacts are generated
        # once and the tensor-graph passes run once.
        cache = ArtifactCache(work)
        say(f"building the tensor graph of {len(model.tensors)} tensors")
        with exported_batch_hint(model.proto, batch_size):
            tensor_graph = graph.build_tensor_graph(
                model.with_batch(batch_size, shapes), cache=cache, loss=model.task.loss
            )
        say("profiling the backward pass on this device (cached)")
        prof = profiler.profile_model(
            model,
            batch_size=batch_size,
            input_shapes=shapes,
            level=profile_level,
            repeats=repeats,
            threads=threads,
            cache_dir=cache_dir,
            tensor_graph=tensor_graph,
            artifact_cache=cache,
        )
        if prof.cached_from:
            say(f"profile from the cache ({prof.cached_from})")
        mem_prof: MemoryProfile | None = None
        if with_memory:
            say("measuring the memory model (cached)")
            mem_prof = memory_profiler.profile_memory(
                model,
                batch_size=batch_size,
                input_shapes=shapes,
                threads=prof.threads,
                cache_dir=cache_dir,
                artifact_cache=cache,
                frozen_bn=frozen_bn,  # measured in the mode the artifacts will run
            )
    return tensor_graph, prof, mem_prof


def _importance(
    model: LoadedModel, data, batch_size, shapes, tokenizer, preprocess, dataset, say
) -> tuple[np.ndarray, str]:
    """The tensors' importance (float64 [N], forward order) and where it came from: measured
    on a probe batch of ``data`` (paper Eq. 2), or :func:`data_free_importance` without data."""
    if data is None:
        return data_free_importance(list(model.tensors)), "data-free prior: parameter share"
    say(f"importance on a probe batch of {data}")
    importance = probe_importance(
        model,
        data,
        batch_size=batch_size,
        input_shapes=shapes,
        tokenizer=tokenizer,
        preprocess=preprocess,
        dataset=dataset,
    )
    return importance, f"first-order importance on a probe batch of {data}"


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
    head_lr_scale: float = 1.0  # the head's learning-rate factor the artifacts train at

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
    head_lr_scale: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> CompileResult:
    """Compile ``model_path`` into the compiled directory ``out_dir``: :func:`compile`, then
    :meth:`etgraph.plan.Plan.save`'s work under the directory's lock, the directory checked
    before any work (``etgraph compile``). A directory this call created is removed again when
    the compile fails.

    Args:
        model_path: ONNX model (any data inputs; the output trained on ``[B, K]`` logits, or
            ``[B, D]`` for mse); None = embedded default.
        out_dir: the compiled directory to write (created; must be writable).
        rho: requested step time as a fraction of full training, in (0, 1].
        batch_size: training batch size the profile and plan are for (> 0).
        input_shape: per-input shapes (``--input-shape`` texts ``NAME=DIMS`` or a bare
            ``"CxHxW"``, a mapping, or ``(C, H, W)``; :func:`etgraph.io_specs.input_shapes`);
            required where the model's dims are symbolic.
        data: dataset spec for the importance probe (``"digits"``, an image-folder path or a
            ``.npz`` file, or a .csv/.jsonl text file; :func:`etgraph.data.load_task_data`).
        tokenizer: the model's ``tokenizer.json`` for text ``data``.
        output: the graph output to train on (None: the model's only output).
        loss: ``"ce"`` (cross-entropy on logits) or ``"mse"`` (:class:`etgraph.io_specs.Task`).
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
        head_lr_scale: the head's learning-rate factor (:func:`compile`); recorded in
            ``plan.json`` (``head_lr_scale``, ``head_lr``).
        progress: called with one line per stage as it starts.

    Returns:
        A :class:`CompileResult`.

    Raises:
        ModelError, UnsupportedOpError: the model cannot be loaded or trained.
        ConfigError: bad rho, batch size, input shape, output, loss or output directory.
        InfeasibleBudgetError: rho is below what the forward pass costs (gives the smallest rho).
        InfeasibleMemoryError: no selection fits ``memory_mb`` (gives the smallest budget).
        DataError: the probe dataset cannot be loaded.
    """
    source = Path(model_path) if model_path is not None else Path(DEFAULT_MODEL_PATH)
    _check_settings(rho, batch_size, data, tokenizer, frozen_bn, memory_mb, head_lr_scale)
    created = not Path(out_dir).exists()
    out = prepare_compiled_dir(out_dir, inputs=[*onnx_io.model_files(source), data, tokenizer])
    settings = dict(
        rho=rho,
        batch_size=batch_size,
        input_shape=input_shape,
        data=data,
        tokenizer=tokenizer,
        output=output,
        loss=loss,
        profile_level=profile_level,
        repeats=repeats,
        threads=threads,
        resolution=resolution,
        cache_dir=cache_dir,
        preprocess=preprocess,
        frozen_bn=frozen_bn,
        memory_mb=memory_mb,
        memory_resolution_mb=memory_resolution_mb,
        head_lr_scale=head_lr_scale,
    )
    try:
        plan = _compile_into(out, source, progress, **settings)
    except BaseException:
        if created:  # a failed compile leaves nothing behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    parts = plan.memory_parts_mb
    return CompileResult(
        out_dir=out,
        n_tensors=len(plan.mask),
        n_selected=int(plan.mask.sum()),
        rho=rho,
        predicted_step_us=plan.predicted_step_us,
        t_full_us=plan.t_full_us,
        memory_mb=memory_mb,
        predicted_peak_mb=None if parts is None else parts["peak_mb"],
        head_lr_scale=plan.model.head_lr_scale,
    )


def _compile_into(out: Path, source: Path, progress, **settings) -> Plan:
    """Compile and write ``out`` under its lock: one compile at a time in OUT, built beside it
    and swapped in only when complete (plan.json last), so a failed or killed re-compile leaves
    the last good one."""
    with exclusive_lock(out, "-o"):
        plan = compile(source, progress=progress, **settings)
        if progress is not None:
            progress(f"writing the artifacts of {int(plan.mask.sum())} tensors to {out}")
        plan.write(out)
    return plan
