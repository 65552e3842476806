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
2. **Charging** (docs/how-it-works.md, "The time model and the charging rule"): every node of
   the ``full``
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
   bake frozen parameters into their graphs (:func:`etgraph.artifact_weights.bake_frozen`), so with
   batch norms in inference mode the frozen forward is fused further (Conv + BN + activation):
   ``last_only_inference`` (the same mask, ``--frozen-bn inference``) is timed too, and what
   the inference time model does not explain of it is spread over the anchors likewise
   (``Profile.inference_forward_moved_us``, applied by ``Profile.for_frozen_bn``). A frozen
   layer the gradient still *passes* runs baked as well, and faster than the profile's
   unbaked nodes (issue 30: MobileNetV2's top-k and DP selections were over-predicted by up
   to 30%): ``first_only_inference`` (the ``first_only`` mask baked, ``--frozen-bn
   inference``: every layer but the first frozen and passed; at the fast level ``first_only``
   itself is baked) is timed, and what the inference
   model does not explain of it, as a share of the forward time per anchor, moves from
   ``t_dy_us`` to ``t_dw_us`` of the anchor (``Profile.inference_path_moved_us``): a layer's
   forward costs its training-mode time only when its tensor trains.

``forward_us`` is therefore the selection-independent part of a step: forward pass and loss
(``forward_pass_us``, less the moved share) + optimizer fixed cost + ``step_overhead_us``.

**Profiling levels** (``level``, :data:`LEVELS`; issue #16). Steps 1-6 above are the
``thorough`` level. The default ``fast`` level measures less, because the training loop's
closed loop re-fits the time model's scale and fixed per-step cost to the steps it runs
(:mod:`etgraph.timing`, ``StepTimeFit``); what it cannot correct online is the *shape* of the
model (which tensors cost what), and that comes from the same per-node measurements:

* graphs only: the training graphs are built in memory
  (:func:`etgraph.artifacts.training_graphs`, from a copy of the model without weights; no
  checkpoint, no eval model, no training-API session; parameters bound once), and a step is
  the profiled graph's own run without the trace
  (:meth:`etgraph.measure.ProfiledGraph.untraced_time_us`) plus the optimizer fit for its
  tensors; the all-trainable graph of the caller's artifact cache is used when it is there (so
  the caller's tensor graph fits);
* configurations ``full``, ``first_only`` — built with every batch norm in inference mode when
  the model has batch norms, so one graph splits the fused ConvGrad nodes (dX alone) AND
  measures each batch norm's inference mode (a batch norm of tensor 0 stays in training mode
  and out of ``Profile.batch_norms``; baked, as training runs it, step 6: its backward nodes
  keep their names) — ``last_only`` (the saved-forward share), with batch norms
  ``last_only_inference`` (baked, step 6; its step only), and ``no_kernels`` only when a fused
  node also computes a bias gradient (dB apart from dX);
* the optimizer on four subsets (:func:`etgraph.fold.optimizer_subsets` ``fast``);
* 1 warm-up and 3 measured rounds, then more, one at a time, until two rounds (every graph
  run once) took the same wall time within :data:`REPRODUCED_TOLERANCE` (up to
  :data:`FAST_MAX_REPEATS`): on an idle machine 3 rounds, on a busy one as many as it takes;
  of the rounds each node's minimum is kept (:data:`FAST_QUANTILE`), so one graph's disturbed
  run does not call for another round of all of them.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import networkx as nx
import numpy as np
import onnxruntime as ort

from . import graph
from .artifacts import (
    ArtifactCache,
)
from .errors import ConfigError
from .files import ensure_writable_dir, private_temp_dir
from .fold import (
    batch_norm_modes,
    calibrate,
    charge_node_times,
    fit_optimizer,
    forward_us_by_anchor,
    saved_forward_fraction,
)
from .host import freeze_gc, host_description, physical_cores, usable_threads
from .io_specs import exported_batch_hint
from .isolation import check_sessions
from .measure import (
    measure_node_overhead_us,
    random_batch,
    step_clock,
)
from .memory import check_step_fits
from .model import LoadedModel
from .profile import Profile, profile_key
from .profile_levels import (
    REPRODUCED_TOLERANCE,
    Measured,
    batch_norm_layers,
    measure_fast,
    measure_thorough,
    selection_mask,
)
from .timing import BranchCharges, backward_us, step_us

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_LEVEL", "LEVELS", "profile_model"]

#: Profiling levels and their ``(repeats, warmup)`` defaults (module docstring, "Profiling
#: levels"; docs/results.md, "Profiling cost").
LEVELS: dict[str, tuple[int, int]] = {"fast": (3, 1), "thorough": (10, 3)}

#: The level ``etgraph compile/profile/train`` use unless ``--profile-level`` says otherwise.
DEFAULT_LEVEL = "fast"


def check_level(level: str) -> str:
    """Return ``level`` if it is one of :data:`LEVELS`.

    Raises:
        ConfigError: any other value.
    """
    if level not in LEVELS:
        raise ConfigError(f"unknown profile level {level!r}: choose one of {', '.join(LEVELS)}")
    return level


def profile_model(
    model: LoadedModel,
    *,
    batch_size: int = 4,
    input_shapes=None,
    level: str = DEFAULT_LEVEL,
    repeats: int | None = None,
    warmup: int | None = None,
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
        level: ``"fast"`` (default) or ``"thorough"`` (module docstring, "Profiling levels");
            recorded in the profile and in its cache key.
        repeats, warmup: measured / discarded runs per measurement (repeats >= 1, warmup >= 0);
            None = the level's default (:data:`LEVELS`).
        threads: ORT intra-op threads; None = physical cores. Recorded in the profile.
        cache_dir: if given, profiles are cached there as ``<key>.json`` keyed by model hash,
            input shapes, batch size, threads, clock and loss
            (:func:`etgraph.profile.profile_key`);
            a hit is returned as is.
        clock: how steps (``measured_full_step_us``, calibration) are timed: ``"wall"``
            (default) or ``"cpu"`` (thread CPU time, needs ``threads=1``;
            :func:`etgraph.measure.step_clock`).
        tensor_graph: the charged tensor graph (:func:`etgraph.graph.build_tensor_graph`) of
            the all-trainable training model of ``model.with_batch(batch_size, shapes)`` in
            ``artifact_cache``, when the caller has it. Else (or when its node names are not
            those of that training model: ORT numbers the loss node per process) the graph is
            built once from the ``full`` configuration's training model.
        artifact_cache: where the configurations' artifacts are generated (a caller that
            generated the all-trainable artifacts of ``model.with_batch(batch_size, shapes)``
            through it gets a hit; the fast level only looks the all-trainable ones up there
            and builds the rest in memory); default a temporary cache, removed.

    Returns:
        The :class:`~etgraph.profile.Profile` (``t_dw_us``/``t_dy_us`` float64 [N], µs,
        forward order).

    Raises:
        ModelError: ORT cannot build or run the training graph at this shape; the output has
            no static class count.
        ConfigError: bad batch size, input shape, level, repeats, threads or clock.
        ProfileMismatchError: a cached profile under this key belongs to another setting.
    """
    repeats, warmup, threads = _measurement_settings(
        batch_size, level, repeats, warmup, threads, clock
    )
    shapes = model.input_shapes(input_shapes)
    check_step_fits(model, batch_size, shapes)  # before anything is allocated
    loss = model.task.loss

    cache_path = None
    if cache_dir is not None:
        ensure_writable_dir(cache_dir, "--cache-dir or $ETGRAPH_CACHE")  # before measuring
        key = profile_key(model.hash, shapes, batch_size, threads, clock, loss, level)
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
                level=level,
            )
            log.info("profile cache hit: %s", cache_path)
            cached.cached_from = str(cache_path)
            return cached

    start = time.perf_counter()
    freeze_gc()
    with (
        private_temp_dir("profile") as work,
        exported_batch_hint(model.proto, batch_size),
    ):
        # A native crash of ORT on this graph: one line, before any session runs in-process.
        check_sessions(
            model, batch_size, shapes, threads=threads, cache=artifact_cache, record_dir=cache_dir
        )
        prof = _profile(
            model,
            shapes,
            level=level,
            batch_size=batch_size,
            repeats=repeats,
            warmup=warmup,
            threads=threads,
            clock=clock,
            work=Path(work),
            cache=artifact_cache,
            tensor_graph=tensor_graph,
        )
    prof.profiling_s = time.perf_counter() - start
    log.info(
        "profiled %d tensors in %.1f s (level %s, load average %s)",
        len(prof.tensors),
        prof.profiling_s,
        level,
        prof.load_average,
    )
    _keep(prof, threads, cache_path)
    return prof


def _measurement_settings(
    batch_size: int, level: str, repeats, warmup, threads, clock: str
) -> tuple[int, int, int]:
    """``(repeats, warmup, threads)`` as the profile measures with: the level's defaults where
    None, threads as this process can use them.

    Raises:
        ConfigError: bad batch size, level, repeats, warmup, threads or clock.
    """
    if batch_size <= 0:
        raise ConfigError(f"batch size must be a positive integer, got {batch_size}")
    check_level(level)
    repeats = LEVELS[level][0] if repeats is None else int(repeats)
    warmup = LEVELS[level][1] if warmup is None else int(warmup)
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    threads = physical_cores() if threads is None else int(threads)
    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    threads = usable_threads(threads)  # the profile records the threads it measured with
    step_clock(clock, threads)
    return repeats, warmup, threads


def _keep(prof: Profile, threads: int, cache_path: Path | None) -> None:
    """Warn if other work alone filled the cores while profiling, and cache ``prof`` at
    ``cache_path`` (None: no cache) unless its rounds also never reproduced (issue 30): a
    profile measured while other work stretched its runs has the wrong shape (MobileNetV2 at
    load 6: late kernels' t_dw 15x too high), and from the cache it would serve every later run,
    on a quiet machine too. On a quiet machine whose rounds still vary by more than the
    tolerance (MobileNetV2 128 px at load 0.6 here) a new profile would be no sharper: that one
    is cached, so later runs select alike."""
    loaded = _loaded(prof.load_average, threads)
    if loaded:
        log.warning(
            "profiled at load average %.1f on %d cores: other work may have stretched the "
            "measured times; profile again on a quieter machine for a sharper time model",
            prof.load_average,
            len(os.sched_getaffinity(0)),
        )
    if cache_path is not None and prof.reproduced is False and loaded:
        log.warning(
            "profile not cached: no two of its %d rounds took the same time within %.0f%% "
            "(load average %s); later runs profile again",
            prof.repeats,
            100 * REPRODUCED_TOLERANCE,
            prof.load_average,
        )
    elif cache_path is not None:
        prof.save(cache_path)


def _loaded(load_average: float | None, threads: int) -> bool:
    """Whether other work alone filled the cores while profiling with ``threads`` threads (the
    profiler's own threads count up to ``threads`` in the load average): at load >= 6 on 2
    cores every kernel longer than a time slice was stretched in every run (docs/results.md,
    "Time model validation"); the closed loop re-fits the scale, not that."""
    cores = len(os.sched_getaffinity(0))
    return load_average is not None and load_average - threads >= cores


def _profile(
    model: LoadedModel,
    shapes: dict[str, tuple[int, ...]],
    *,
    level: str,
    batch_size: int,
    repeats: int,
    warmup: int,
    threads: int,
    clock: str,
    work: Path,
    cache: ArtifactCache | None,
    tensor_graph: nx.DiGraph | None,
) -> Profile:
    names = model.names
    n = len(names)
    weights = model.initial_weights()
    batch = random_batch(batch_size, model.inputs, shapes, model.task)
    model_b = model.with_batch(batch_size, shapes)
    loss = model.task.loss
    # The fast level times shorter chains, fewer times (0.2 s of its 0.5 s on a small model).
    chain = {"nodes": 200, "repeats": 10} if level == "fast" else {}
    node_overhead = measure_node_overhead_us(threads, **chain)
    if level == "thorough":
        bn_layers = batch_norm_layers(model, [])
        measured = measure_thorough(
            model,
            model_b,
            batch,
            weights,
            bn_layers,
            repeats=repeats,
            warmup=warmup,
            threads=threads,
            clock=clock,
            work=work,
            cache=cache if cache is not None else ArtifactCache(work / "a"),
        )
    else:
        # The first tensor trains in the graph that also measures the batch norms' inference
        # mode, so a batch norm of tensor 0 stays out of it.
        bn_layers = batch_norm_layers(model, names[:1]) if n > 1 else []
        full_artifacts = None
        if cache is not None:  # the caller's all-trainable artifacts, when it has them
            paths = cache.lookup(model_b, *model.split(selection_mask(n, range(n))), loss=loss)
            full_artifacts = paths.directory if paths is not None else None
        measured = measure_fast(
            model,
            model_b,
            batch,
            weights,
            bn_layers,
            repeats=repeats,
            warmup=warmup,
            threads=threads,
            clock=clock,
            work=work,
            node_overhead_us=node_overhead,
            full_artifacts=full_artifacts,
        )
    return fold(
        model,
        model_b,
        measured,
        bn_layers,
        level=level,
        batch_size=batch_size,
        shapes=shapes,
        repeats=repeats,
        warmup=warmup,
        threads=threads,
        clock=clock,
        node_overhead=node_overhead,
        tensor_graph=tensor_graph,
        weights=weights,
    )


def fold(
    model: LoadedModel,
    model_b,
    measured: Measured,
    bn_layers,
    *,
    level: str,
    batch_size: int,
    shapes,
    repeats: int,
    warmup: int,
    threads: int,
    clock: str,
    node_overhead: float,
    tensor_graph: nx.DiGraph | None,
    weights,
) -> Profile:
    """Measured times → the time model (module docstring, steps 2-6)."""
    names = model.names
    loss = model.task.loss
    masks, node_times, steps = measured.masks, measured.node_times, measured.steps
    opt_fit = fit_optimizer(measured.observations)
    for c, us in steps.items():
        log.info("config %s: step %.0f us", c, us)
    numel = np.array([weights[name].size for name in names], dtype=np.float64)

    charges = _charges(model_b, measured, tensor_graph, loss)
    carried = {t.name: t.values for t in model.tensors}
    charged = charge_node_times(node_times, charges, names, node_overhead, carried)
    t_dw = charged.t_dw_us + opt_fit.tensor_us(numel)
    t_dy = charged.t_dy_us
    forward_pass = charged.forward_pass_us
    branches = BranchCharges.from_rows(charged.branches, len(names))

    batch_norms = []
    if measured.bn_times is not None:
        batch_norms = batch_norm_modes(
            node_times["full"], measured.bn_times, bn_layers, charges, node_overhead
        )

    constant = forward_pass + opt_fit.fixed_us
    explained = {c: constant + backward_us(m, t_dw, t_dy, branches) for c, m in masks.items()}
    step_overhead = calibrate(
        [explained[c] for c in measured.calibrate], [steps[c] for c in measured.calibrate]
    )
    by_anchor, forward_saved = _saved_forward(
        model_b, charged.rows, names, node_overhead, step_overhead, steps, explained
    )
    moved = forward_saved * by_anchor
    t_dy = t_dy + moved
    forward_pass -= moved.sum()
    forward_us = forward_pass + opt_fit.fixed_us + step_overhead
    if forward_us < 0:
        log.warning("negative constant step time %.0f us; clamping to 0", forward_us)
        forward_us = 0.0

    checks = _checks(masks, steps, t_dw, t_dy, forward_us, branches)
    prof = Profile(
        model_hash=model.hash,
        tensors=names,
        kinds=[t.kind for t in model.tensors],
        t_dw_us=t_dw,
        t_dy_us=t_dy,
        forward_us=float(forward_us),
        measured_full_step_us=float(steps["full"]),
        batch_size=int(batch_size),
        input_shapes=shapes,
        threads=threads,
        clock=clock,
        loss=loss,
        level=level,
        ort_version=ort.__version__,
        host=host_description(),
        forward_pass_us=float(forward_pass),
        optimizer_fixed_us=opt_fit.fixed_us,
        optimizer_per_tensor_us=opt_fit.per_tensor_us,
        optimizer_per_element_us=opt_fit.per_element_us,
        node_overhead_us=float(node_overhead),
        trace_overhead_us=float(measured.trace_us),
        step_overhead_us=float(step_overhead),
        forward_saved_fraction=float(forward_saved),
        repeats=int(measured.repeats or repeats),
        reproduced=measured.reproduced,
        warmup=int(warmup),
        load_average=_load_average(),
        checks=checks,
        nodes=charged.rows,
        branches=charged.branches,
        batch_norms=batch_norms,
    )
    _inference_mode(prof, masks, steps, measured.frozen_bn, by_anchor, forward_saved)
    return prof


def _charges(model_b, measured: Measured, tensor_graph: nx.DiGraph | None, loss: str) -> dict:
    """The charge of every node of the profiled ``full`` training graph
    (:func:`etgraph.graph.charges`): from ``tensor_graph`` when its node names are those of the
    profiled graph, else from a tensor graph built once from that training model."""
    charges = graph.charges(tensor_graph) if tensor_graph is not None else {}
    if not set(measured.node_times["full"]) <= set(charges):
        if tensor_graph is not None:
            # ORT numbers some node names per process (the loss node): a graph built from
            # another generation of the training model names them differently.
            log.info("the given tensor graph is of another training model: building it again")
        # Built once, from the training model just profiled.
        charges = graph.charges(
            graph.build_tensor_graph(
                model_b, training_model=measured.full_training_model, loss=loss
            )
        )
    return charges


def _saved_forward(
    model_b, rows, names, node_overhead: float, step_overhead: float, steps, explained
) -> tuple[np.ndarray, float]:
    """``(by_anchor, forward_saved)`` (module docstring, step 6): the training-only forward
    work per anchor tensor, µs float64 [N], and the share of it the ``last_only`` step saves
    (0 when that step was not measured)."""
    # Forward work that only a training graph does (activations kept, no fusion): saved when
    # no gradient passes the layer, so it belongs on t_dy of the layer's anchor tensor.
    by_anchor = forward_us_by_anchor(model_b, rows, names, node_overhead)
    forward_saved = 0.0
    if "last_only" in steps:
        forward_saved = saved_forward_fraction(
            step_overhead, steps["last_only"] - explained["last_only"], by_anchor[:-1].sum()
        )
    return by_anchor, forward_saved


def _checks(masks, steps, t_dw, t_dy, forward_us: float, branches) -> dict[str, dict]:
    """Measured vs predicted step, µs, and trainable tensors of each configuration timed."""
    return {
        c: {
            "measured_us": steps[c],
            "predicted_us": step_us(masks[c], t_dw, t_dy, forward_us, branches),
            "trainable": int(masks[c].sum()),
        }
        for c in steps
    }


#: The configurations that time first_only baked in inference mode (profiler step 6).
_PATH_CONFIGS = ("first_only_inference", "first_only")


def _inference_mode(prof: Profile, masks, steps, frozen_bn, by_anchor, forward_saved) -> None:
    """The inference-mode part of ``prof`` (``--frozen-bn inference``, module docstring step 6),
    and the checks of the steps measured in that mode."""
    extra = 0.0
    if "last_only_inference" in steps:
        # What the per-node inference deltas do not explain of the frozen forward in inference
        # mode (sessions bake frozen weights: ORT fuses Conv + BN + activation there), moved
        # from the forward pass to t_dy of the anchors, as forward_saved is in training mode.
        residual = (
            prof.for_frozen_bn("inference").predicted_step_us(masks["last_only_inference"])
            - steps["last_only_inference"]
        )
        skipped = by_anchor[:-1].sum()
        if skipped > 0:
            extra = float(np.clip(residual / skipped, -forward_saved, 1.0 - forward_saved))
            prof.inference_forward_moved_us = [float(v) for v in extra * by_anchor]
    # first_only baked with batch norms in inference mode: its own configuration at the
    # thorough level, the fast level's first_only itself
    path = next((c for c in _PATH_CONFIGS if frozen_bn.get(c) == "inference"), None)
    if path is not None and path in steps:
        # A frozen layer the gradient passes runs baked too (its forward fused as far as the
        # backward lets it): what the model does not explain of the first_only step baked (every
        # layer but the first frozen and on the gradient path) is the forward a layer pays only
        # when one of its tensors trains, moved per anchor from t_dy to t_dw
        # (inference_path_moved_us), at most the share moved to t_dy above.
        residual = prof.for_frozen_bn("inference").predicted_step_us(masks[path]) - steps[path]
        on_path = by_anchor[1:].sum()
        if on_path > 0:
            share = float(np.clip(residual / on_path, 0.0, max(0.0, forward_saved + extra)))
            prof.inference_path_moved_us = [float(v) for v in share * by_anchor]
    inference = prof.for_frozen_bn("inference")
    for c, mode in frozen_bn.items():  # steps measured with batch norms in inference
        prof.checks[c]["frozen_bn"] = mode
        prof.checks[c]["predicted_us"] = inference.predicted_step_us(masks[c])


def _load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): a profile measured on a busy
    machine is recorded as such."""
    try:
        return float(os.getloadavg()[0])
    except OSError:
        return None
