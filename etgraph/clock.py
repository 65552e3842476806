"""The run's clock: full reference steps measured alike, the time-model fit and deadline planning.

What the period loop measures and how it turns measurements into the next selection's budget
(paper §2.2: the step time a selection costs; issue #16's closed loop):

* **Reference steps** — a few full training steps (all tensors) interleaved with a period's
  elastic steps, on the same batches and clock (:func:`period_reference_positions`), so that
  achieved rho is an elastic step over a full step measured alike (:func:`reference_ratio`).
* **The fit** — every period the time model is fitted to the epochs measured so far
  (:func:`fit_time_model`; by process CPU time unless the sessions spin, :func:`fit_clock`).
* **Deadline mode** — :class:`DeadlinePlanner` chooses rho per period from the measured
  progress so that the run ends at its deadline, and refuses at the start a deadline the
  cheapest selection cannot meet. With rho of the whole run (``TrainConfig.rho_scope ==
  "run"``) its deadline is rho times the time full training would take, estimated from the
  run's own measurements (:meth:`DeadlinePlanner.full_run_s`).

Pure functions over epoch records (the dicts of :class:`etgraph.rundir.EpochRecord`) and
times; no session, no file.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .config_choice import TRAIN_CANDIDATES
from .errors import ConfigError
from .timing import StepTimeFit, fit_step_times

log = logging.getLogger(__name__)

__all__ = [
    "FINISH_S",
    "REFERENCE_WARMUP",
    "RHO_TOLERANCE",
    "DeadlinePlanner",
    "fit_clock",
    "fit_rows",
    "fit_time_model",
    "period_reference_positions",
    "reference_positions",
    "reference_ratio",
    "reference_steps_at",
    "spins",
    "steps_since_reference",
]

#: Full steps before each reference step's last: the elastic steps around it have warm caches,
#: and so would full training's. All are timed and the reference is the fastest: the first
#: after elastic steps is ~5% slower, but one full step can also be stalled by a neighbour (a
#: 263 ms reference among 191-197 ms ones on ResNet50 at 128 px, quiet machine, made its
#: period 28% off), and the minimum of two keeps that period within ~5%.
REFERENCE_WARMUP = 1

#: Once the closed loop has corrected the time model with measured steps, rho is a target
#: within this fraction, not only a ceiling (:func:`etgraph.selection.select_for_rho`
#: ``tolerance``; issue #16's target band): on a model of few tensors the selection nearest rho
#: may lie just above it. Not with the profile's model alone: VGG16 at 128 px, whose profile
#: under-predicts its selections by ~6%, then ran the selection taken above rho at 1.10x.
RHO_TOLERANCE = 0.05

#: Seconds the end of a run takes besides scoring the exported model (export, plots, summary,
#: the interpreter's exit with ORT and torch loaded) at the profile's speed, which deadline mode
#: keeps free at the end, times the machine's slowdown since (the full step measured now over
#: the profile's, at least 1). Measured on the default model: 0.4 s to the summary (plots 0.35
#: s) and 0.15-0.3 s of exit on a quiet machine; 2-4 s of exit alone at load 7-11, where steps
#: ran 3-5x slower than profiled. A fixed 2.5 s (until session 7) ended quiet runs 12-34% early.
FINISH_S = 0.6


# ---- reference steps --------------------------------------------------------------------------


def reference_positions(steps: int, count: int, end: bool = False) -> frozenset[int]:
    """Indices (0-based) of the ``count`` steps of an epoch of ``steps`` after which a reference
    step runs: spread evenly, never after step 0 (a fresh session's first step) unless the
    epoch has one step; ``end``: the last of them after the last step."""
    if steps <= 1:
        return frozenset([0])
    count = min(count, steps - 1)
    if end:
        return frozenset(int((j + 1) * (steps - 1) / count) for j in range(count))
    return frozenset(1 + int((j + 0.5) * (steps - 1) / count) for j in range(count))


def period_reference_positions(
    steps_per_epoch: int,
    epochs: int,
    budget: float,
    rho: float,
    since_steps: int | None = None,
    end: bool = False,
) -> list[frozenset[int]]:
    """Per epoch of a period, the steps (0-based) after which a full reference step runs.

    Counted over the period, not per epoch: ``budget`` of the period's elastic step time (a
    reference step costs ``1 + REFERENCE_WARMUP`` full steps, a full step about ``1 / rho``
    elastic ones), spread evenly over the period's steps (:func:`reference_positions`), so an
    epoch may have none. On the default model's 179-step epochs at period 3 and rho 0.5 that is
    one per period, about 0.75% of its time (one per epoch was 2.1-2.5%).

    A period too short to afford one gets one only when the budget of the elastic steps since
    the last reference step (``since_steps``) and its own affords it, or when nothing was
    measured yet (``since_steps`` None): on small on-device datasets one per period was the
    budget several times over (ResNet-18 at 64 px, 30-step epochs, period 3: two full steps per
    90 elastic ones, 4.4% of the run; issue 31). The closed loop's fit keeps the epochs
    measured before.

    Args:
        steps_per_epoch: >= 1. epochs: epochs in the period, >= 1. budget: fraction in (0, 1].
        rho: the period's requested rho, in (0, 1].
        since_steps: elastic steps trained since the last reference step, or None.
        end: the last reference step after the period's last step, where the run needs the
            gradients of a full step anyway (the next period's importance,
            :func:`etgraph.steps.train_steps` ``carry_after``).
    """
    steps = steps_per_epoch * epochs
    per_step = budget * rho / (1 + REFERENCE_WARMUP)
    if since_steps is not None and per_step * (since_steps + steps) < 1:
        return [frozenset() for _ in range(epochs)]
    count = max(1, int(per_step * steps))
    out: list[set[int]] = [set() for _ in range(epochs)]
    for i in reference_positions(steps, count, end):
        out[i // steps_per_epoch].add(i % steps_per_epoch)
    return [frozenset(s) for s in out]


def reference_steps_at(
    epoch: int,
    first_epoch: int,
    end_epoch: int,
    steps_per_epoch: int,
    budget: float,
    rho: float,
    records: list[dict] | None = None,
    end: bool = False,
) -> frozenset[int]:
    """Steps of ``epoch`` (0-based) after which a full reference step runs: its period's
    (epochs ``[first_epoch, end_epoch)``) :func:`period_reference_positions`, given the run's
    epoch ``records`` before the period (:func:`steps_since_reference`; None: measure)."""
    since = steps_since_reference(records[:first_epoch]) if records is not None else None
    positions = period_reference_positions(
        steps_per_epoch, end_epoch - first_epoch, budget, rho, since, end
    )
    return positions[epoch - first_epoch]


def steps_since_reference(records: list[dict]) -> int | None:
    """Elastic steps of the epochs after the last one with a reference step (that epoch's
    own steps counted too: where in it the step ran is not recorded), or None when no epoch
    had one."""
    for i in range(len(records) - 1, -1, -1):
        if records[i].get("reference_steps"):
            return int(sum(r["steps"] for r in records[i:]))
    return None


def reference_ratio(
    step_times: list[float], reference_times: list[tuple[int, float]], first: int = 0
) -> float:
    """Elastic over full step, measured alike: for each reference step (taken after elastic
    step ``i``; its time the faster of its ``1 + REFERENCE_WARMUP`` full steps), the same
    statistic of the elastic steps around it (``i-4 .. i`` and ``i+2 .. i+6``: the step right
    after it pays for the switch of sessions) — the median of the faster of each two adjacent
    steps — over its time; the median over the epoch's reference steps. Load drift slower than
    a few steps cancels. NaN without any.

    The faster of two noisy steps is below a typical one: against the elastic steps' median
    (the rule until session 21) the ratio came out 7.4% (ResNet-18, 64 px) and 5.4%
    (MobileNetV2, 96 px) above elastic over full training's median steps, now 3.0% and 0.6%
    (means of 4 runs side by side, ``benchmarks/reference_estimator.py``).

    Args:
        step_times: the epoch's elastic step times (s), in order.
        reference_times: ``(i, seconds)`` per timed reference step.
        first: elastic steps before this index are not used (a fresh session's first step).
    """
    ratios = []
    for i, ref in reference_times:
        sides = (range(max(first, i - 4), i + 1), range(max(first, i + 2), i + 7))
        runs = [[step_times[j] for j in side if j < len(step_times)] for side in sides]
        faster = [min(pair) for run in runs for pair in itertools.pairwise(run)]
        local = faster or [t for run in runs for t in run]  # a lone step: itself
        if local and ref > 0:
            ratios.append(float(np.median(local)) / ref)
    return float(np.median(ratios)) if ratios else float("nan")


# ---- the fit ----------------------------------------------------------------------------------


def spins(label: str) -> bool:
    """Whether the sessions of a logged ``ort_config`` label spun (unknown labels: no)."""
    config = TRAIN_CANDIDATES.get(label)
    return bool(config is not None and config.spinning)


def fit_clock(spinning: bool) -> str:
    """The measurements the closed loop fits, by the run's sessions' spinning: ``"_cpu"`` =
    process CPU time (every thread of the process) when their pool threads do not spin (CPU
    time is then work, not waiting), ``""`` = wall time when they spin (a spinning thread's CPU
    time is waiting). On a machine shared with other work the wall time of one reference step
    swings 2x with the neighbours' load, its CPU time by a few % (docs/how-it-works.md,
    "Closed loop"); on a quiet device, where spinning wins
    (:func:`etgraph.config_choice.choose_train_config`), they agree."""
    return "" if spinning else "_cpu"


def fit_rows(records: list[dict], spinning: bool) -> tuple[str, list[dict]]:
    """``(clock, epochs)`` the closed loop fits when its sessions' spinning is ``spinning``
    (:func:`fit_clock`): the epochs with reference steps, by process CPU time only those whose
    sessions did not spin (a spinning pool's CPU time is waiting: epochs before a re-check
    turned spinning off would skew the fit — MobileNetV2 under a hog: scale 1.9, the next
    period 21% low by wall clock). Right after such a switch none is left: the wall clock of
    the epochs that spun then (their wall time is real time; at the switch period of 8 logged
    CPU-hog runs it predicted the measured ratio within 7.4% on average, the profile's model
    within 9.5%)."""
    clock = fit_clock(spinning)
    measured = [r for r in records if r.get("reference_steps")]
    rows = [r for r in measured if clock == "" or not spins(r.get("ort_config", "off"))]
    return (clock, rows) if rows else ("", measured)


def fit_time_model(
    records: list[dict], *, spinning: bool, closed_loop: bool, t_full_us: float
) -> StepTimeFit:
    """The time-model correction from the epochs measured so far (:func:`fit_rows`,
    :func:`etgraph.timing.fit_step_times`); the identity in the open loop or before any
    reference step.

    Args:
        records: the run's epoch records so far. spinning: the sessions' spinning now.
        closed_loop: False = the open loop (the profile's time model as is).
        t_full_us: the profile's full step, µs.
    """
    clock, rows = fit_rows(records, spinning)
    if not closed_loop or not rows:
        return StepTimeFit()
    return fit_step_times(
        [r["predicted_step_us"] for r in rows],
        [r[f"median_step{clock}_us"] for r in rows],
        [r[f"reference_step{clock}_us"] for r in rows],
        t_full_us,
    )


# ---- deadline mode ----------------------------------------------------------------------------


@dataclass
class DeadlinePlanner:
    """Deadline mode, and rho of the whole run: the rho of each period that ends the run
    (training, validation, export) at its deadline, ``started_at`` plus:

    * ``deadline_s`` (deadline mode, ``TrainConfig.deadline_s``), or
    * ``run_rho`` times the time full training would take from ``started_at``
      (``TrainConfig.rho_scope == "run"``, :meth:`full_run_s`): the same setup, every epoch's
      steps at the full step measured alike (the run's reference steps), its validation pass,
      full training's checkpoints and the same end. The whole run then takes about
      ``run_rho`` of full training's, its per-period overheads (importance, selection,
      sessions, reference steps) included.

    Attributes:
        started_at: ``time.perf_counter()`` when the run (or the command) started.
        epochs, period, steps_per_epoch: the run's shape.
        val_batches: validation batches per epoch.
        floor_rho: the cheapest selection's rho (:func:`etgraph.timing.min_feasible_rho`).
        profiled_full_step_s: the profile's measured full step, s.
        full_step_now_s: measures a full step now, s (a warm all-trainable session).
        deadline_s: the deadline, seconds from ``started_at`` (deadline mode).
        run_rho: the whole run's time over full training's, in (0, 1] (rho of the run).
        param_bytes: bytes of the model's trainable tensors (float32): what the export
            writes, and a third of full training's checkpoint (weights and two AdamW moments),
            both timed at the rate this run's checkpoints were written
            (:meth:`checkpoint_written`).
        reference_budget: ``TrainConfig.reference_budget`` (0: no reference steps, as under a
            memory budget).
    """

    started_at: float
    epochs: int
    period: int
    steps_per_epoch: int
    val_batches: int
    floor_rho: float
    profiled_full_step_s: float
    full_step_now_s: Callable[[], float] = field(repr=False)
    deadline_s: float | None = None
    run_rho: float | None = None
    param_bytes: int = 0
    reference_budget: float = 0.0
    _write_s_per_byte: list[float] = field(default_factory=list, repr=False)
    _setup_s: float | None = field(default=None, repr=False)  # started_at to the first period
    _first_epoch: int = field(default=0, repr=False)  # this process's first epoch
    _planned_at: tuple[float, int] | None = field(default=None, repr=False)  # (elapsed, epoch)

    @classmethod
    def for_run(
        cls,
        config,
        *,
        started_at: float,
        steps_per_epoch: int,
        n_val: int,
        floor_rho: float,
        profiled_full_step_s: float,
        full_step_now_s: Callable[[], float],
        param_bytes: int = 0,
    ) -> DeadlinePlanner | None:
        """The planner of a run of ``config`` (:class:`etgraph.config.TrainConfig`; None
        unless ``config.plans_rho``) with ``n_val`` validation examples."""
        if not config.plans_rho:
            return None
        run_rho = config.rho if config.rho_scope == "run" else None
        val_batches = math.ceil(n_val / config.batch_size)
        if config.max_val_batches is not None:
            val_batches = min(val_batches, config.max_val_batches)
        return cls(
            started_at=started_at,
            epochs=config.epochs,
            period=config.period,
            steps_per_epoch=steps_per_epoch,
            val_batches=val_batches,
            floor_rho=floor_rho,
            profiled_full_step_s=profiled_full_step_s,
            full_step_now_s=full_step_now_s,
            deadline_s=config.deadline_s,
            run_rho=run_rho,
            param_bytes=param_bytes,
            reference_budget=0.0 if config.memory_mb is not None else config.reference_budget,
        )

    def checkpoint_written(self, seconds: float, nbytes: int) -> None:
        """A period end's checkpoint of ``nbytes`` bytes took ``seconds`` s (its rate times
        the export and full training's checkpoints, :meth:`full_run_s`)."""
        if nbytes > 0 and seconds > 0:
            self._write_s_per_byte.append(seconds / nbytes)

    def check(self) -> None:
        """Raise ConfigError at the start when even the cheapest selection cannot finish in time.

        Raises:
            ConfigError: names the shortest feasible deadline (or, for rho of the whole run,
                the smallest feasible rho): the time already spent, the cheapest selection's
                steps at the profile's measured full step, and the epochs' and the end's other
                costs as :meth:`rho` plans them.
        """
        elapsed = time.perf_counter() - self.started_at
        fixed, end = self._untrained_epoch_costs_s(self.profiled_full_step_s)
        steps = self.epochs * self.steps_per_epoch
        need = elapsed + steps * self.floor_rho * self.profiled_full_step_s
        need += self.epochs * fixed + end
        if self.run_rho is not None:
            full = self.full_run_s([], setup_s=elapsed)
            if self.run_rho * full < need:
                raise ConfigError(
                    f"rho {self.run_rho:g} of the whole run cannot be met: even the cheapest "
                    f"selection (rho {self.floor_rho:.2f} of a step) takes about "
                    f"{need / full:.2f} of full training's time here: give --rho "
                    f"{math.ceil(100 * need / full) / 100:g} or more, or --rho-scope step"
                )
        elif self.deadline_s < need:
            raise ConfigError(
                f"deadline {self.deadline_s:g} s cannot be met: even the cheapest selection "
                f"(rho {self.floor_rho:.2f}) needs about {math.ceil(need)} s for "
                f"{steps} steps on this device: give --deadline {math.ceil(need)}s "
                "or more, or fewer --epochs"
            )

    def full_run_s(self, records: list[dict], setup_s: float | None = None) -> float:
        """Seconds full training would take from ``started_at`` over this process's epochs
        and periods: ``setup + E * (S * t_full + val) + P * checkpoint + end``. ``t_full`` is
        the median reference step of ``records`` (full steps measured alike; before any, the
        profile's measured full step), ``val`` their mean validation pass (before any: a third
        of a full step per batch), ``checkpoint`` a checkpoint of the weights and both AdamW
        moments of every tensor at this run's write rate (0 before its first), ``end`` as
        :meth:`rho` plans its own, and ``setup`` the time from ``started_at`` to the first
        period (``setup_s``)."""
        t_full = self._t_full_s(records)
        if records:
            val = float(np.mean([r["val_s"] for r in records]))
            end = self._end_s(val, t_full)
        else:
            val, end = self._untrained_epoch_costs_s(t_full)
        setup = self._setup_s if setup_s is None else setup_s
        epochs = self.epochs - self._first_epoch
        periods = math.ceil(self.epochs / self.period) - self._first_epoch // self.period
        checkpoint = 3 * self.param_bytes * self._s_per_byte()
        epochs_s = epochs * (self.steps_per_epoch * t_full + val)
        return (setup or 0.0) + epochs_s + periods * checkpoint + end

    def _references_s(self, epoch: int, records: list[dict]) -> float:
        """Seconds per epoch the reference steps of the period starting at ``epoch`` will take
        (:func:`period_reference_positions` at the last period's rho, each reference ``1 +``
        :data:`REFERENCE_WARMUP` full steps measured alike): the last period's own are not a
        guide, its first opened their session and a short run's later periods may have none."""
        if self.reference_budget <= 0 or not records:
            return 0.0
        epochs = min((epoch // self.period + 1) * self.period, self.epochs) - epoch
        positions = period_reference_positions(
            self.steps_per_epoch,
            epochs,
            self.reference_budget,
            records[-1]["rho_requested"],
            steps_since_reference(records),
        )
        count = sum(len(p) for p in positions)
        return count * (1 + REFERENCE_WARMUP) * self._t_full_s(records) / epochs

    def _t_full_s(self, records: list[dict]) -> float:
        """The full step, s: the median reference step of ``records`` (measured alike), or
        before any the profile's measured full step."""
        refs = [r.get("reference_step_us", math.nan) for r in records]
        refs = [t for t in refs if math.isfinite(t)]
        return float(np.median(refs)) * 1e-6 if refs else self.profiled_full_step_s

    def _s_per_byte(self) -> float:
        """Seconds per byte of this run's checkpoints so far (median; 0 before the first)."""
        return float(np.median(self._write_s_per_byte)) if self._write_s_per_byte else 0.0

    def _end_s(self, val_s: float, full_step_s: float) -> float:
        """The end of a run: scoring the exported model (one validation pass, ``val_s``),
        exporting it (its tensors at this run's write rate), and :data:`FINISH_S` times the
        slowdown, s."""
        export_s = self.param_bytes * self._s_per_byte()
        return val_s + export_s + FINISH_S * self._slowdown(full_step_s)

    def rho(self, epoch: int, records: list[dict]) -> float:
        """The rho of the period starting at ``epoch`` (0-based) that ends the run at the deadline.

        The time left, ``deadline - elapsed - end`` (``deadline``: ``deadline_s``, or
        ``run_rho`` times :meth:`full_run_s` of ``records``; ``end``: scoring and exporting the
        model, estimated as one validation pass, the export at the run's checkpoint write rate
        and :data:`FINISH_S` times the slowdown), is
        spent on ``E`` epochs of ``S`` steps: ``E * fixed + E * S * rho * u``. From the last
        period's epochs (measured progress, the machine's load included): ``u`` = mean step /
        the rho it was asked for (s per unit of rho), ``fixed`` = an epoch's wall time outside
        its steps and reference steps (re-selection, validation, the period end's checkpoint
        when this planner timed the period from its start; not the one-off choice of session
        options), plus the next period's reference steps as planned (:meth:`_references_s`).
        Before any epoch: ``u`` = a full step measured now
        (``full_step_now_s``; rho of the run: the profile's, as :meth:`full_run_s` takes it),
        ``fixed`` = a validation pass at a third of a full step per batch. Clamped to [the
        cheapest selection's rho, 1].
        """
        elapsed = time.perf_counter() - self.started_at
        if self._setup_s is None:  # the first period of this process
            self._setup_s, self._first_epoch = elapsed, epoch
        deadline = self.deadline_s
        if self.run_rho is not None:
            deadline = self.run_rho * self.full_run_s(records)
        epochs_left = self.epochs - epoch
        left_s = deadline - elapsed
        last = records[-min(self.period, len(records)) :] if records else []
        planned_at, self._planned_at = self._planned_at, (elapsed, epoch)
        if last:
            u = float(np.mean([r["measured_step_us"] / r["rho_requested"] for r in last])) * 1e-6
            probe_s = sum(r.get("ort_probe_s", 0.0) for r in last)  # one-off, not per epoch
            steps_s = sum(r["steps"] * r["measured_step_us"] * 1e-6 for r in last)
            references_s = sum(r.get("reference_s", 0.0) for r in last)  # planned apart
            if planned_at is not None and planned_at[1] == epoch - len(last):
                # this process planned the last period: its whole span since, so what the
                # records do not hold (the period end's checkpoint, callbacks) counts too
                outside_s = elapsed - planned_at[0]
            else:
                outside_s = sum(r["wall_time_s"] + r["val_s"] for r in last)
            fixed = (outside_s - probe_s - steps_s - references_s) / len(last)
            fixed += self._references_s(epoch, records)
            full_us = last[-1].get("reference_step_us", float("nan"))  # measured alike
            end = self._end_s(last[-1]["val_s"], full_us * 1e-6)
        else:  # nothing trained yet: full steps now, and validation at a third of one per batch
            # (rho of the run: the profile's, as its full run is planned: the ratio is what counts)
            u = self.full_step_now_s() if self.run_rho is None else self.profiled_full_step_s
            fixed, end = self._untrained_epoch_costs_s(u)
        steps = epochs_left * self.steps_per_epoch
        rho = (left_s - end - epochs_left * fixed) / (steps * u) if u > 0 else 1.0
        chosen = float(min(1.0, max(rho, self.floor_rho * 1.02)))
        log.info(
            "%s: %.1f s left for %d epochs -> rho %.3f",
            "deadline" if self.run_rho is None else f"rho {self.run_rho:g} of the run",
            left_s,
            epochs_left,
            chosen,
        )
        return chosen

    def _untrained_epoch_costs_s(self, full_step_s: float) -> tuple[float, float]:
        """``(fixed, end)`` of :meth:`rho` before any epoch has run: an epoch's time outside
        its steps (a validation pass at a third of a full step per batch) and the end of the
        run (:meth:`_end_s` with one more such pass), s."""
        fixed = self.val_batches * full_step_s / 3
        return fixed, self._end_s(fixed, full_step_s)

    def _slowdown(self, full_step_s: float) -> float:
        """How much slower than profiled the machine runs: a full step measured now (s) over
        the profile's, at least 1 (1 when not measured)."""
        ratio = full_step_s / self.profiled_full_step_s
        return max(1.0, ratio) if math.isfinite(ratio) else 1.0
