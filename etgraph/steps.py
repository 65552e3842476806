"""The step executor: one epoch of training steps, with full reference steps measured alike.

:func:`train_steps` runs the elastic steps of one epoch on a training session at the cosine
learning rate of each global step, and after the chosen steps (:mod:`etgraph.clock`) a full
reference step on the all-trainable session, on the same batch and clock: the first of
``1 + REFERENCE_WARMUP`` timed full steps warms the caches, the fastest is kept. After a
period's last step (``carry_after``) the all-trainable session takes the trained tensors'
values, so the gradients of its step there are the next period's importance at the period's
final weights (issue 31: no pass of its own at the next period start).
:func:`epoch_record` turns what was timed into the epoch's :class:`etgraph.rundir.EpochRecord`
(medians, rho measured alike by wall and CPU clock, the fit's prediction). No files.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from .clock import REFERENCE_WARMUP, reference_ratio
from .rundir import EpochRecord
from .sessions import GradientSession, TrainingSession
from .timing import StepTimeFit

__all__ = ["EpochSteps", "cosine_learning_rate", "epoch_record", "step_seed", "train_steps"]


def cosine_learning_rate(base_lr: float, step: int, total_steps: int) -> float:
    """Cosine-decayed learning rate at ``step`` of ``total_steps`` (paper §8, TF CosineDecay).

    ``base_lr * (1 + cos(pi * step / total_steps)) / 2``; ``step`` is clamped to
    ``[0, total_steps]``.
    """
    if total_steps <= 0:
        return float(base_lr)
    t = min(max(step, 0), total_steps) / total_steps
    return float(base_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


@dataclass
class EpochSteps:
    """What one epoch's steps measured (times in seconds).

    Attributes:
        step_times, step_cpu: each elastic step's wall and process CPU time, in order.
        reference_times, reference_cpu: ``(i, s)`` per full reference step taken after elastic
            step ``i``, wall and CPU (the fastest of its timed full steps).
        reference_s: the reference steps, warm-ups included.
        gradients_s: the pass after ``carry_after`` when no reference step was due there
            (the next period's importance; copying the trained tensors included).
        carried: the step ``carry_after`` was trained, and the reference session was left
            holding the gradients at the trained tensors' values after it.
        last_batch: the epoch's last batch ``(x, y)`` (the next period's importance batch).
        train_s: the epoch's steps, wall (reference steps included).
        losses: each step's mean loss. correct: the metric summed over the epoch (correct
            predictions for ce). seen: examples trained on. learning_rate: the last step's.
    """

    step_times: list[float] = field(default_factory=list)
    step_cpu: list[float] = field(default_factory=list)
    reference_times: list[tuple[int, float]] = field(default_factory=list)
    reference_cpu: list[tuple[int, float]] = field(default_factory=list)
    reference_s: float = 0.0
    gradients_s: float = 0.0
    carried: bool = False
    last_batch: tuple | None = None
    train_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    correct: float = 0
    seen: int = 0
    learning_rate: float = 0.0


def step_seed(seed: int, global_step: int) -> int:
    """ORT's random seed before global step ``global_step`` of a run of seed ``seed``: the
    step's Dropout masks (:func:`etgraph.sessions.seed_random`) depend on nothing else, so a
    resumed or repeated run draws the masks an uninterrupted one did."""
    return seed * 1000 + 200_000 + global_step


def train_steps(
    session: TrainingSession,
    batches: Iterable[tuple],
    learning_rate: Callable[[int], float],
    first_step: int,
    *,
    seed: int | None = None,
    reference: GradientSession | None = None,
    reference_at: frozenset[int] = frozenset(),
    carry_after: int | None = None,
    carry_seed: int | None = None,
    on_nonfinite: Callable[[int, float, float], None] | None = None,
    progress: str | None = None,
    total: int | None = None,
) -> EpochSteps:
    """Train on ``batches`` (one epoch), timing every step.

    Args:
        session: the selection's training session.
        batches: ``(x, y)`` batches of the run's batch size.
        learning_rate: the rate of a global step (0-based).
        first_step: the global step of the first batch.
        seed: the run's seed: each step's Dropout masks come from :func:`step_seed` (None:
            ORT's generator as it stands).
        reference: the all-trainable session the reference steps run on (learning rate 0).
        reference_at: the epoch's step indices after which a reference step runs.
        carry_after: the step index after which ``reference`` takes the trainable tensors of
            ``session`` and is left holding the gradients at them on that step's batch: those
            of the reference steps if one is due there, else of one forward and backward pass.
        carry_seed: the Dropout seed of the pass whose gradients are held (the next period's
            probe seed, as a pass of its own on that batch would use).
        on_nonfinite: called with ``(steps taken, loss, learning rate)`` at a NaN or infinite
            loss, before anything else; it should raise (the run stops there).
        progress: a tqdm bar of this title on stderr (running loss and accuracy), or none.
        total: the epoch's steps (the bar's length).
    """
    out = EpochSteps(learning_rate=learning_rate(first_step))
    carry = (carry_after, carry_seed)
    t_epoch = time.perf_counter()
    # closed however the epoch ends (an interrupt, a signal), so no half-drawn bar is left
    # before the line that says why the run stopped
    with tqdm(
        total=total, desc=progress, disable=progress is None, leave=False, unit="step"
    ) as bar:
        for i, (x, y) in enumerate(batches):
            lr = out.learning_rate = learning_rate(first_step + i)
            ts, cs = time.perf_counter(), time.process_time()
            step_s = None if seed is None else step_seed(seed, first_step + i)
            loss, right = session.train_step(x, y, lr, seed=step_s)
            out.step_times.append(time.perf_counter() - ts)
            out.step_cpu.append(time.process_time() - cs)
            out.last_batch = (x, y)
            if reference is not None:
                _full_steps(out, i, x, y, session, reference, reference_at, carry)
            if not math.isfinite(loss) and on_nonfinite is not None:
                bar.close()
                on_nonfinite(len(out.step_times), loss, lr)
            out.losses.append(loss)
            out.correct += right
            out.seen += y.shape[0]
            bar.update(1)
            bar.set_postfix(
                loss=f"{np.mean(out.losses):.3f}",
                acc=f"{out.correct / out.seen:.3f}",
                refresh=False,
            )
    out.train_s = time.perf_counter() - t_epoch
    return out


def _full_steps(
    out: EpochSteps,
    i: int,
    x,
    y: np.ndarray,
    session: TrainingSession,
    reference: GradientSession,
    reference_at: frozenset[int],
    carry: tuple[int | None, int | None],
) -> None:
    """After elastic step ``i`` on batch ``(x, y)``: the carry of :func:`train_steps`
    (``carry``: its step index and seed) and the reference steps due there, recorded in
    ``out``."""
    carry_after, carry_seed = carry
    if i == carry_after:
        tg = time.perf_counter()
        views = session.trainable_views()
        reference.set_parameters(views, views)
        if i not in reference_at:
            reference.accumulate([(x, y)], seed=carry_seed)
        out.gradients_s += time.perf_counter() - tg
        out.carried = True
    if i in reference_at:
        t_ref = time.perf_counter()
        wall, cpu = [], []
        for k in range(1 + REFERENCE_WARMUP):  # the fastest of them (REFERENCE_WARMUP)
            held = i == carry_after and k == REFERENCE_WARMUP  # the gradients kept
            ts, cs = time.perf_counter(), time.process_time()
            reference.train_step(x, y, 0.0, seed=carry_seed if held else None)
            wall.append(time.perf_counter() - ts)
            cpu.append(time.process_time() - cs)
        out.reference_times.append((i, min(wall)))
        out.reference_cpu.append((i, min(cpu)))
        out.reference_s += time.perf_counter() - t_ref


def epoch_record(
    steps: EpochSteps,
    *,
    epoch: int,
    period: int,
    fresh_session: bool,
    mask: np.ndarray,
    val: tuple[float, float, float],
    classify: bool,
    timings: dict | None,
    reference_setup_s: float,
    previous_s: float,
    reference: str,
    predicted_step_us: float,
    t_full_us: float,
    fit: StepTimeFit,
    rho: float,
    peak_rss_mb: float,
    predicted_peak_mb: float | None,
    ort: dict,
) -> EpochRecord:
    """The :class:`etgraph.rundir.EpochRecord` of an epoch.

    Args:
        steps: what the epoch's steps measured (:func:`train_steps`).
        epoch: 0-based. period: 0-based.
        fresh_session: the session took its first step in this epoch (that step's one-off
            allocations are left out of the medians).
        mask: the selection, bool [N].
        val: ``(val_loss, val_metric, val_s)``.
        classify: the metric is an accuracy (loss ce); else the loss is the metric.
        timings: the period start's (:class:`etgraph.period.Reselection`), for the period's
            first epoch only.
        reference_setup_s: opening the reference session (charged to the reference steps).
        previous_s: the cumulative wall time before this epoch.
        reference: ``"measured"`` (reference steps taken), ``"self"`` (full training: its own
            steps are the reference) or ``"none"`` (not measured: a memory budget).
        predicted_step_us: the time model's step of the selection. t_full_us: its full step.
        fit: the time-model correction of this period. rho: this period's requested rho.
        peak_rss_mb, predicted_peak_mb: measured and predicted peak memory, MiB.
        ort: the session options' fields (:meth:`etgraph.ort_probe.OrtOptions.record_fields`;
            ``ort_probe_s``, the probe since the last epoch, is part of the epoch's wall time).
    """
    st = steps
    timed = st.step_times[1:] if (fresh_session and len(st.step_times) > 1) else st.step_times
    first = 1 if len(timed) < len(st.step_times) else 0
    median_us = float(np.median(timed) * 1e6) if timed else float("nan")
    median_cpu_us = float(np.median(st.step_cpu[first:]) * 1e6) if timed else float("nan")
    if reference == "none":
        reference_us = reference_cpu_us = float("nan")
    elif reference == "self":
        reference_us, reference_cpu_us = median_us, median_cpu_us
    else:
        ratio = reference_ratio(st.step_times, st.reference_times, first)
        reference_us = median_us / ratio if ratio > 0 else float("nan")
        ratio = reference_ratio(st.step_cpu, st.reference_cpu, first)
        reference_cpu_us = median_cpu_us / ratio if ratio > 0 else float("nan")
    t = timings or {}
    val_loss, val_metric, val_s = val
    epoch_s = st.train_s + t.get("reselection_s", 0.0) + reference_setup_s + ort["ort_probe_s"]
    return EpochRecord(
        epoch=epoch + 1,
        period=period,
        train_loss=float(np.mean(st.losses)),
        train_acc=st.correct / max(st.seen, 1) if classify else float("nan"),
        val_loss=val_loss,
        val_acc=val_metric if classify else float("nan"),
        wall_time_s=epoch_s,
        cumulative_wall_time_s=previous_s + epoch_s,
        learning_rate=st.learning_rate,
        selection=[int(i) for i in np.flatnonzero(mask)],
        n_tensors=int(mask.size),
        predicted_step_us=predicted_step_us,
        measured_step_us=float(np.mean(timed) * 1e6) if timed else float("nan"),
        reselection_s=t.get("reselection_s", 0.0),
        importance_s=t.get("importance_s", 0.0) + st.gradients_s,
        selection_s=t.get("selection_s", 0.0),
        artifacts_s=t.get("artifacts_s", 0.0),
        session_s=t.get("session_s", 0.0),
        artifacts_cache_hit=t.get("artifacts_cache_hit"),
        peak_rss_mb=peak_rss_mb,
        steps=len(st.step_times),
        rho_requested=rho,
        rho_predicted=fit.rho(predicted_step_us, t_full_us),
        predicted_measured_step_us=fit.predict_us(predicted_step_us)
        if fit.observations
        else float("nan"),
        median_step_us=median_us,
        reference_step_us=reference_us,
        reference_steps=len(st.reference_times),
        rho_measured=median_us / reference_us,
        reference_s=st.reference_s + reference_setup_s,
        fit_s=t.get("fit_s", 0.0),
        fit_scale=fit.scale,
        fit_fixed_us=fit.fixed_us,
        median_step_cpu_us=median_cpu_us,
        reference_step_cpu_us=reference_cpu_us,
        rho_measured_cpu=median_cpu_us / reference_cpu_us,
        val_s=val_s,
        predicted_peak_mb=predicted_peak_mb,
        **ort,
    )
