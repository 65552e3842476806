"""Measure the memory model of a model on this device (issue #17; the model is
:mod:`etgraph.memory`).

Every measurement is a **fresh process** (:func:`measure_peaks`; or a process forked after the
imports, which starts from the same resident memory: :mod:`etgraph.memory_child`) that does what
a training process does for one selection — import onnxruntime-training (and torch), read the
checkpoint, build the training Module and the AdamW Optimizer from the selection's artifacts,
take a few training steps on a random batch — and reports its resident memory after each phase
(``VmRSS``) and its peak (``VmHWM``). A fresh process because ORT's CPU arena never returns
memory: a second selection in the same process would start from the first one's arena. Peak RSS
is what the OS counts against the process (what gets it killed on a device) and is not disturbed
by other processes' CPU load. ORT's allocator statistics are not used: the Python training API
exposes none for a Module's sessions, and they would miss the libraries, the checkpoint and the
weights, which are most of the peak on a small model.

:func:`profile_memory` measures ``anchors + 2`` selections — each a suffix of the forward order
(tensors ``e .. N-1``: the backward pass from the output down to ``e``, every buffer of those
tensors), at ``e = 0`` (full training), ``e = N-1`` and interior anchors spread by activation
bytes, then (``refine`` rounds) the midpoint of every two adjacent anchors whose workspaces
differ a lot — and fits the parts of :class:`etgraph.memory.MemoryProfile`. The anchors'
artifacts are generated in the batch-norm mode training will run (``frozen_bn``; default
``inference``, as ``etgraph train``): their frozen batch norms (before ``e``) run as inference
affine maps.

* ``load_mb``: the largest start-up peak (``VmHWM`` before the sessions are built);
* ``base_mb`` and ``bytes_per_param``: least squares of the RSS after building the sessions
  against the number of selected parameters (the gradient buffer and two AdamW moments are
  allocated there: 12 bytes in theory, 12.7 measured on ResNet50); when the anchors' parameter
  counts differ by less than 16 MiB of buffers (a small model) the RSS noise hides the slope and
  the theoretical 12 bytes are used;
* ``earliest_mb`` at each anchor: RSS after the steps minus RSS after building the sessions (the
  arena's workspace for a backward pass down to ``e``); less the suffix's largest weight-gradient
  temporary (``grad_mb``), interpolated between anchors by
  :func:`etgraph.memory.interpolate_earliest_mb`, and that temporary added back.

The child process runs :func:`etgraph.memory_child.main` (``python -c``), with this package first on
its path.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from passes.onnx import DEFAULT_FROZEN_BN

from .artifacts import ArtifactCache, check_frozen_bn
from .errors import ConfigError, ModelError
from .files import ensure_writable_dir, private_temp_dir
from .host import host_description, physical_cores
from .memory import (
    MemoryProfile,
    activation_bytes_after,
    interpolate_earliest_mb,
    memory_key,
)
from .model import LoadedModel

log = logging.getLogger(__name__)

__all__ = ["anchor_indices", "fit_memory_profile", "measure_peaks", "profile_memory"]

_MIB = float(1 << 20)
#: Bytes a selected float32 parameter adds: its gradient buffer and two AdamW moments.
_THEORY_BYTES_PER_PARAM = 12.0
#: Workspace difference (MiB) between adjacent anchors above which their midpoint is measured.
_REFINE_MB = 8.0
#: Seconds a measuring process may take before it is considered hung.
_CHILD_TIMEOUT_S = 900


def _run_child(dirs, batch_size, shape: str, threads: int, steps: int) -> dict:
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "-c",
        "from etgraph.memory_child import main; main()",
        str(int(batch_size)),
        shape,
        str(int(threads)),
        str(int(steps)),
        *map(str, dirs),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=_CHILD_TIMEOUT_S, check=False
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise ModelError(
            f"measuring the memory of {dirs[0]} failed (exit {proc.returncode}): "
            f"{err[-1] if err else 'no output'}"
        )
    return json.loads(lines[-1])


def measure_peaks(
    artifact_dirs: Sequence[str | os.PathLike],
    *,
    batch_size: int,
    input_shape: Sequence[int],
    threads: int,
    steps: int = 3,
    fresh: bool = True,
) -> list[dict]:
    """Resident memory of training each set of artifacts.

    Args:
        artifact_dirs: directories of training artifacts (:class:`etgraph.artifacts.ArtifactPaths`,
            with their own ``checkpoint``).
        batch_size, input_shape (C, H, W): the random training batch. threads: intra-op threads.
        steps: training steps taken (the arena reaches its size within two).
        fresh: one fresh process per directory (the ground truth). False: one process imports
            the libraries once and measures each directory in a process forked from it
            (:mod:`etgraph.memory_child`: same figures within ~2 MiB, without paying the imports
            per directory); its figures are rebased to a fresh process's (each phase minus the
            RSS before that selection plus the RSS after the imports: ~+2 MiB).

    Returns:
        Per directory ``{"start", "imported", "loaded", "session", "steps"}``, each
        ``{"VmRSS": MiB, "VmHWM": MiB}`` (after Python started, after the imports, after reading
        the checkpoint, after building Module + Optimizer, after the steps). ``steps.VmHWM`` is
        the process's peak.

    Raises:
        ModelError: a measuring process failed (its last stderr line is quoted).
    """
    shape = "x".join(str(int(d)) for d in input_shape)
    groups = [[d] for d in artifact_dirs] if fresh else [list(artifact_dirs)]
    results = []
    for group in groups:
        if not group:
            continue
        out = _run_child(group, batch_size, shape, threads, steps)
        imported = out["imported"]["VmRSS"]
        for run in out["runs"]:
            shift = imported - run["before"]["VmRSS"]
            rebased = {
                phase: {k: v + shift for k, v in run[phase].items()}
                for phase in ("loaded", "session", "steps")
            }
            results.append({"start": out["start"], "imported": out["imported"], **rebased})
    return results


def anchor_indices(proxy: np.ndarray, anchors: int) -> list[int]:
    """Tensor indices where ``earliest_mb`` is measured: 0, N-1 and ``anchors`` interior ones at
    evenly spaced fractions of the activation proxy (float [N], non-increasing in practice)."""
    n = proxy.size
    chosen = {0, n - 1}
    top = float(proxy[0]) if proxy[0] > 0 else 1.0
    for f in np.linspace(1.0, 0.0, anchors + 2)[1:-1]:
        below = np.flatnonzero(proxy <= f * top)
        if below.size:
            chosen.add(int(below[0]))
    return sorted(chosen)


def _cpu_s() -> float:
    """CPU seconds of this process and its waited-for children."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _workspace_mb(run: dict) -> float:
    """The step's workspace of one measured selection: RSS after the steps minus after the
    sessions were built, MiB (>= 0)."""
    return max(run["steps"]["VmRSS"] - run["session"]["VmRSS"], 0.0)


def _suffix_grad_mb(params: np.ndarray) -> np.ndarray:
    """float64 [N] MiB: the largest float32 weight gradient among tensors ``e .. N-1``."""
    return np.maximum.accumulate((params * 4 / _MIB)[::-1])[::-1]


def _refinements(points: list[int], raw: list[dict], suffix_grad_mb: np.ndarray) -> list[int]:
    """Midpoints of adjacent anchors whose workspaces, less the suffix's largest weight
    gradient (known, :func:`_suffix_grad_mb`), differ by more than :data:`_REFINE_MB` or a
    quarter of the largest: where the workspace moves more than the activation proxy can be
    trusted to interpolate (a MobileNetV2 block near the input drops it 110 MiB within three
    tensors; ResNet50's falls smoothly, no refinement)."""
    order = np.argsort(points)
    idx = np.asarray(points)[order]
    ws = np.array([_workspace_mb(r) for r in raw])[order] - suffix_grad_mb[idx]
    limit = max(_REFINE_MB, 0.25 * float(ws.max()))
    return [
        int((a + b) // 2)
        for a, b, wa, wb in zip(idx[:-1], idx[1:], ws[:-1], ws[1:], strict=True)
        if b - a > 1 and abs(wa - wb) > limit
    ]


def image_input_shape(model: LoadedModel, input_shapes=None) -> tuple[int, ...]:
    """``(C, H, W)`` of the model's one float image input (``input_shapes``: an override as
    :meth:`LoadedModel.input_shapes` takes, or a profile's shapes).

    Raises:
        ConfigError: the model has other inputs, or a loss other than cross-entropy: the
            memory model measures image classifiers (its measuring process feeds one random
            float batch and class-index labels).
    """
    specs = model.inputs
    if len(specs) != 1 or specs[0].rank != 4 or not specs[0].is_float:
        raise ConfigError(
            f"--memory-mb measures models with one float image input [B, C, H, W]; this model "
            f"has inputs {[s.name for s in specs][:8]}: drop --memory-mb"
        )
    if model.task.loss != "ce":  # the measuring process feeds class-index labels
        raise ConfigError(
            f"--memory-mb measures classifiers (--loss ce), not --loss {model.task.loss}: "
            "drop --memory-mb"
        )
    return tuple(model.input_shapes(input_shapes)[specs[0].name])


def fit_memory_profile(
    model: LoadedModel,
    proxy: np.ndarray,
    points: Sequence[int],
    raw: Sequence[dict],
    *,
    batch_size: int,
    input_shape: Sequence[int],
    threads: int,
    frozen_bn: str,
) -> MemoryProfile:
    """The :class:`etgraph.memory.MemoryProfile` fitted to measured anchor selections (module
    docstring): ``raw[i]`` is :func:`measure_peaks`'s record of the suffix selection from
    tensor ``points[i]``; ``proxy`` is :func:`etgraph.memory.activation_bytes_after` (float
    [N]). Pure arithmetic: a profile can be re-fitted to a stored profile's ``measurements``.

    Raises:
        ConfigError: no anchors, or an anchor index out of range.
    """
    n = len(model.tensors)
    params = np.array([t.params for t in model.tensors], dtype=np.float64)
    masks = []
    for e in points:
        mask = np.zeros(n, dtype=bool)
        mask[int(e) :] = True
        masks.append(mask)
    points = [int(e) for e in points]
    shape = tuple(int(d) for d in input_shape)
    selected = np.array([params[m].sum() for m in masks])
    session_rss = np.array([r["session"]["VmRSS"] for r in raw])
    design = np.stack([np.ones(len(masks)), selected], axis=1)
    (base_mb, mb_per_param), *_ = np.linalg.lstsq(design, session_rss, rcond=None)
    resolvable = (selected.max() - selected.min()) * _THEORY_BYTES_PER_PARAM / _MIB >= 16.0
    if not resolvable or not 4.0 <= mb_per_param * _MIB <= 40.0:
        # Too few parameters to see their buffers above the RSS noise (a few MiB): take the
        # allocations as known, a gradient buffer and two AdamW moments of float32.
        mb_per_param = _THEORY_BYTES_PER_PARAM / _MIB
        base_mb = float(np.mean(session_rss - selected * mb_per_param))
    workspace = np.array([_workspace_mb(r) for r in raw])
    # The suffix's largest weight-gradient temporary steps where a big layer enters the suffix;
    # the rest (activations) follows the activation proxy: interpolate that, add the step back.
    suffix_grad_mb = _suffix_grad_mb(params)
    rest = np.maximum(workspace - suffix_grad_mb[points], 0.0)
    earliest_mb = interpolate_earliest_mb(points, rest, proxy) + suffix_grad_mb
    prof = MemoryProfile(
        model_hash=model.hash,
        tensors=list(model.names),
        tensor_mb=params * mb_per_param,
        earliest_mb=earliest_mb,
        base_mb=float(base_mb),
        load_mb=float(max(r["loaded"]["VmHWM"] for r in raw)),
        import_mb=float(np.median([r["imported"]["VmRSS"] for r in raw])),
        weights_mb=float(params.sum() * 4 / _MIB),
        bytes_per_param=mb_per_param * _MIB,
        batch_size=int(batch_size),
        input_shape=tuple(shape),
        threads=threads,
        frozen_bn=frozen_bn,
        ort_version=ort.__version__,
        host=host_description(),
        anchors=points,
        measurements=[
            {"mask_from": int(e), "selected_params": int(p), "rss": r}
            for e, p, r in zip(points, selected, raw, strict=True)
        ],
    )
    return prof


def _measure_anchors(
    model: LoadedModel,
    model_b: onnx.ModelProto,
    todo: Sequence[int],
    cache: ArtifactCache,
    *,
    refine: int,
    batch_size: int,
    input_shape: tuple[int, ...],
    threads: int,
    steps: int,
    fresh: bool,
    frozen_bn: str,
) -> tuple[list[int], list[dict]]:
    """Measure the suffix selections from each tensor in ``todo`` (:func:`measure_peaks`, the
    smallest selection first; their artifacts from ``model_b``, the model at the batch shape,
    in ``cache``), then ``refine`` rounds of :func:`_refinements` between adjacent anchors.

    Returns:
        ``(points, raw)``: the measured anchors, in measurement order, and their records.
    """
    n = len(model.tensors)
    points: list[int] = []
    raw: list[dict] = []
    suffix_grad = _suffix_grad_mb(np.array([t.params for t in model.tensors], dtype=np.float64))
    for _ in range(refine + 1):
        todo = sorted(set(todo) - set(points), reverse=True)  # smallest selection first
        if not todo:
            break
        dirs = []
        for e in todo:
            mask = np.zeros(n, dtype=bool)
            mask[e:] = True
            paths, _ = cache.get(
                model_b, *model.split(mask), loss=model.task.loss, frozen_bn=frozen_bn
            )
            dirs.append(paths.directory)
        raw += measure_peaks(
            dirs,
            batch_size=batch_size,
            input_shape=input_shape,
            threads=threads,
            steps=steps,
            fresh=fresh,
        )
        points += todo
        todo = _refinements(points, raw, suffix_grad)
    return points, raw


def profile_memory(
    model: LoadedModel,
    *,
    batch_size: int = 4,
    input_shapes=None,
    threads: int | None = None,
    anchors: int = 3,
    steps: int = 3,
    fresh: bool = False,
    refine: int = 2,
    cache_dir: str | os.PathLike | None = None,
    artifact_cache: ArtifactCache | None = None,
    frozen_bn: str = DEFAULT_FROZEN_BN,
) -> MemoryProfile:
    """Measure the memory model of ``model`` on this device (module docstring).

    Args:
        model: the loaded model (static class count).
        batch_size: B (> 0). input_shapes: the image input's shape (an override as
            :meth:`LoadedModel.input_shapes` takes); None = the model's own.
        threads: intra-op threads (None = physical cores), as training will use.
        anchors: interior anchor tensors (>= 0); ``anchors + 2`` selections are measured
            first, smallest first (so no selection runs in heap a larger one freed).
        steps: training steps per selection.
        refine: rounds of refinement: after each round, the midpoint of every two adjacent
            anchors whose workspaces differ by more than 8 MiB or a quarter of the largest is
            measured too (one more process per round).
        fresh: one fresh process per anchor selection (slower: each pays the imports, ~3-8 s)
            instead of processes forked after one import (:func:`measure_peaks`).
        cache_dir: if given, memory profiles are cached there as ``memory-<key>.json``
            (:func:`etgraph.memory.memory_key`); a hit is returned as is.
        artifact_cache: where the anchor selections' artifacts go (default a temporary one); the
            compiler passes its own so the all-trainable artifacts are reused.
        frozen_bn: the batch-norm mode training runs (``--frozen-bn``: ``"inference"`` or
            ``"train"``); the anchors are measured in it, and it is part of the cache key.

    Returns:
        The :class:`etgraph.memory.MemoryProfile`.

    Raises:
        ConfigError: bad batch size, threads, anchors or ``frozen_bn``; a model without one
            float image input (:func:`image_input_shape`).
        ModelError: ORT cannot build or run the training graph; a measurement failed.
    """
    if batch_size <= 0:
        raise ConfigError(f"batch size must be a positive integer, got {batch_size}")
    if anchors < 0:
        raise ConfigError(f"anchors must be >= 0, got {anchors}")
    check_frozen_bn(frozen_bn)
    threads = physical_cores() if threads is None else int(threads)
    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    shape = image_input_shape(model, input_shapes)
    cache_path = None
    if cache_dir is not None:
        ensure_writable_dir(cache_dir, "$ETGRAPH_CACHE")  # before measuring
        key = memory_key(model.hash, shape, batch_size, threads, frozen_bn=frozen_bn)
        cache_path = Path(cache_dir) / f"memory-{key}.json"
        if cache_path.is_file():
            cached = MemoryProfile.load(cache_path)
            cached.check_matches(
                model.hash,
                batch_size=batch_size,
                input_shape=shape,
                threads=threads,
                frozen_bn=frozen_bn,
            )
            log.info("memory profile cache hit: %s", cache_path)
            return cached

    start, start_cpu = time.perf_counter(), _cpu_s()
    model_b = model.with_batch(batch_size, {model.inputs[0].name: shape})
    proxy = activation_bytes_after(model_b, [t.layer for t in model.tensors])
    with private_temp_dir("memory") as work:
        cache = artifact_cache if artifact_cache is not None else ArtifactCache(work)
        points, raw = _measure_anchors(
            model,
            model_b,
            anchor_indices(proxy, anchors),
            cache,
            refine=refine,
            batch_size=batch_size,
            input_shape=shape,
            threads=threads,
            steps=steps,
            fresh=fresh,
            frozen_bn=frozen_bn,
        )
    prof = fit_memory_profile(
        model,
        proxy,
        points,
        raw,
        batch_size=batch_size,
        input_shape=shape,
        threads=threads,
        frozen_bn=frozen_bn,
    )
    prof.profiling_s = time.perf_counter() - start
    prof.profiling_cpu_s = _cpu_s() - start_cpu
    log.info(
        "memory profile (--frozen-bn %s): %d selections in %.1f s (%.1f s CPU), base %.0f MiB, "
        "%.1f B/param, workspace %.0f..%.0f MiB",
        frozen_bn,
        len(points),
        prof.profiling_s,
        prof.profiling_cpu_s,
        prof.base_mb,
        prof.bytes_per_param,
        prof.earliest_mb.min(),
        prof.earliest_mb.max(),
    )
    if cache_path is not None:
        prof.save(cache_path)
    return prof
