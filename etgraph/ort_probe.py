"""Which ORT session options the run's sessions train fastest with, measured on this device.

Thread-pool spinning cuts both ways (ORT_NOTES, "Sessions and threads"): on a quiet device a
spinning pool is faster; beside other work, or with several sessions stepped round robin, it
steals the cores. With ``spinning="auto"`` the run measures the candidates of
:data:`etgraph.config_choice.TRAIN_CANDIDATES` at its start (full steps side by side at learning
rate 0 on the full artifacts, :func:`etgraph.config_choice.choose_train_config`) and chooses again
when the full step measured alike moves by :data:`REPROBE_FACTOR` (:meth:`OrtOptions.recheck`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .config_choice import TRAIN_CANDIDATES, ConfigChoice, choose_train_config
from .sessions import GradientSession

log = logging.getLogger(__name__)

__all__ = [
    "PROBE_BUDGET",
    "PROBE_COST_FULL_STEPS",
    "PROBE_MAX_LOAD_PER_CORE",
    "PROBE_ROUNDS",
    "QUIET_CANDIDATE",
    "REPROBE_FACTOR",
    "OrtOptions",
]

#: Share of a run's step time the start-of-run probe of session options may take
#: (:meth:`OrtOptions.choose`; at least 3 rounds).
PROBE_BUDGET = 0.02

#: What a probe costs, in full steps of the run's model: three sessions opened, their first
#: steps and 3 rounds (0.48 s against a 6.1 ms full step on the default model, load 2.2). A
#: run whose :data:`PROBE_BUDGET` is less is not probed.
PROBE_COST_FULL_STEPS = 80

#: What a run too short to probe trains with below the load gate (a quiet machine): spinning
#: on + ``force_spinning_stop``, faster than off in every role there, round robin included.
QUIET_CANDIDATE = "on+stop"

#: Rounds of the probe (timed full steps per candidate) at most.
PROBE_ROUNDS = 4

#: No probe when the 1-minute load average is at least this many times the cores the process
#: may use: spinning then loses to spinning off (1.6-3.3x slower at every load >= 1.4 measured
#: on 2 cores, docs/results.md "ORT session options") and the probe would only cost time.
PROBE_MAX_LOAD_PER_CORE = 1.0

#: The options are chosen again at a period start when the last period's full step measured
#: alike moved by this factor from the one measured when they were chosen (the machine's
#: speed changed: other work started or stopped).
REPROBE_FACTOR = 1.5


class OrtOptions:
    """The session options of one run: given, or measured (``spinning="auto"``).

    Args:
        spinning: ``"auto"`` or a label of :data:`etgraph.config_choice.TRAIN_CANDIDATES`.
        bounded: the run is under a memory budget: never probed (two all-trainable sessions at
            once would not fit), per-session arenas without the memory pattern (:meth:`given`).
        threads: ORT intra-op threads of the run's sessions (None = ORT's default).
        total_steps: the run's training steps (what the probe's cost is weighed against).
        deadline_mode: rho is chosen per period (the probe's estimate uses the first rho).

    Attributes:
        choice: the :class:`etgraph.config_choice.ConfigChoice` the sessions open with now.
    """

    def __init__(
        self,
        spinning: str,
        *,
        bounded: bool,
        threads: int | None,
        total_steps: int,
        deadline_mode: bool = False,
    ):
        self.spinning = spinning
        self.bounded = bounded
        self.threads = threads
        self.total_steps = total_steps
        self.deadline_mode = deadline_mode
        self.choice = self.given("off" if spinning == "auto" else spinning)
        self._probe_s = 0.0  # the probe's time, charged to the next epoch trained
        self._pending = False  # the choice is logged with the next epoch
        self._base_ms: float | None = None  # the full step (ms) when it was chosen

    @property
    def config(self):
        """The :class:`etgraph.ort_options.OrtConfig` of :attr:`choice`."""
        return self.choice.config

    def given(self, label: str, note: str = "") -> ConfigChoice:
        """The candidate ``label`` without a probe; under a memory budget on per-session arenas,
        without the memory pattern and without baking (the training session's ``bake``). The
        shared arena keeps what a released session freed and baking holds the frozen weights
        twice: measured on ResNet50 128 px under a 718 MiB budget, the whole run peaked at 1094
        MiB with both, 873 without baking, 673 without either. A per-session arena grows again
        on the second step to fit the memory pattern's block (docs/how-it-works.md, "The memory
        model"), which
        the memory model (measured on the shared arena) does not hold: MobileNetV2 at 447 MiB
        peaked at 478 MiB with the pattern, 446 without."""
        choice = ConfigChoice.given(label, note)
        if not self.bounded:
            return choice
        config = dataclasses.replace(choice.config, shared_arena=False, mem_pattern=False)
        return dataclasses.replace(choice, config=config)

    def record_fields(self) -> dict:
        """The next epoch record's fields of the options (``ort_config``; ``ort_probe_s``: the
        probe's time since the last record; ``ort_probe_step_ms``, ``ort_note``: set on the
        epoch after the options were chosen), then reset."""
        probe_s, self._probe_s = self._probe_s, 0.0
        chose, self._pending = self._pending, False
        choice = self.choice
        return {
            "ort_config": choice.label,
            "ort_probe_s": probe_s,
            "ort_probe_step_ms": dict(choice.step_ms) if chose and choice.step_ms else None,
            "ort_note": choice.note if chose else "",
        }

    def choose(
        self,
        rho: float,
        full_artifacts: Callable[[], Path],
        batch: tuple,
        input_names: list[str],
        slowdown: float | None = None,
    ) -> tuple[bool, GradientSession | None]:
        """Measure which options the run's sessions train fastest with (``spinning="auto"``):
        :func:`etgraph.config_choice.choose_train_config` on the full artifacts
        (``full_artifacts()`` gives their directory: the reference steps' and importance's, so
        nothing more is generated), on the probe ``batch`` at learning rate 0. Rounds: what
        :data:`PROBE_BUDGET` of the run's steps allows, 3 to :data:`PROBE_ROUNDS`; the probe's
        time is charged to the next epoch's wall time (``ort_probe_s``). Not probed (spinning
        off) under a memory budget or at a load average of :data:`PROBE_MAX_LOAD_PER_CORE` per
        core or more; in a run too short to pay for it (:data:`PROBE_COST_FULL_STEPS` above
        :data:`PROBE_BUDGET` of its steps) below that load, :data:`QUIET_CANDIDATE` without a
        probe — unless this is a re-check because the full step became ``slowdown`` (> 1)
        times slower: other work started, and the 1-minute load average lags it (a CPU hog
        started 20 s before read as 1.4 on 2 cores), so spinning off.

        Returns:
            ``(changed, winner)``: whether the options changed (the training session must be
            opened again), and the winner's open all-trainable session when a probe ran, else
            None: the caller makes it its reference and importance session, replacing any open
            with other options.
        """
        if self.spinning != "auto":
            return False, None
        before = self.choice.label
        note = self._no_probe_note(rho, slowdown)
        if note is not None:
            note, label = note
            self.choice = self.given(label, note)
            self._base_ms = None  # the speed to watch: the first period's full step
            self._pending = True
            log.info("session options: spinning %s (%s)", label, note)
            return before != label, None
        t0 = time.perf_counter()
        per_round = 2 * len(TRAIN_CANDIDATES)  # full steps a round costs
        affordable = PROBE_BUDGET * self.total_steps * rho / per_round
        rounds = int(min(PROBE_ROUNDS, max(3, affordable)))
        choice, winner = choose_train_config(
            full_artifacts(), batch, self.threads, input_names=input_names, rounds=rounds
        )
        self.choice = choice
        self._base_ms = choice.step_ms[choice.label]
        self._probe_s += time.perf_counter() - t0
        self._pending = True
        log.info(
            "session options: spinning %s (full step %s; probe %.2f s)",
            choice.label,
            ", ".join(f"{k} {v:.2f} ms" for k, v in choice.step_ms.items()),
            self._probe_s,
        )
        return choice.label != before, winner

    def _no_probe_note(self, rho: float, slowdown: float | None) -> tuple[str, str] | None:
        """``(note, label)`` when the options are taken without a probe (why, and which);
        None when a probe pays."""
        cores = len(os.sched_getaffinity(0))
        load = os.getloadavg()[0]
        if self.choice.config.spinning:  # the run's own spinning pool threads count as load
            load = max(0.0, load - ((self.threads or cores) - 1))
        if self.bounded:
            return "not probed under --memory-mb", "off"
        if load >= PROBE_MAX_LOAD_PER_CORE * cores:
            return f"not probed: load average {load:.1f} (other work) >= {cores} cores", "off"
        if PROBE_BUDGET * self.total_steps * rho >= PROBE_COST_FULL_STEPS:
            return None
        if rho >= 1.0:
            steps = f"{self.total_steps} full steps"
        else:
            steps = f"{self.total_steps} steps at rho {rho:.2f}" + (
                " (deadline mode: the probe's estimate, before rho is chosen)"
                if self.deadline_mode
                else ""
            )
        note = (
            f"not probed: {steps} are too few to pay "
            f"for it (about {PROBE_COST_FULL_STEPS} full steps); "
        )
        if slowdown is not None and slowdown > 1:
            return note + f"the full step is {slowdown:.1f}x slower than at the last choice", "off"
        # Below the load gate the machine is quiet: take what won there in every role, round
        # robin included (docs/results.md, "ORT session options": on + stop 0.80-0.94x of off
        # at load 0.3-1.7; 0.78x in the loop at load 1.5).
        note += f"load average {load:.1f} < {cores} cores: the quiet-machine choice"
        return note, QUIET_CANDIDATE

    def recheck(
        self,
        records: list[dict],
        period: int,
        rho: float,
        full_artifacts: Callable[[], Path],
        batch: tuple,
        input_names: list[str],
    ) -> tuple[bool, GradientSession | None]:
        """At a period start: choose the options again (:meth:`choose`) when the last period's
        full step measured alike (``reference_step_us``, wall) moved by :data:`REPROBE_FACTOR`
        or more from the one measured when they were chosen — or, with spinning on, when its
        elastic steps ran that much slower than the closed loop predicted (wall clock):
        MobileNetV2 at 128 px, a CPU hog starting with the period, slowed its elastic steps
        2.3x and its one reference 1.37x, and the next period's reference 2.2x.

        Args:
            records: the run's epoch records so far. period: epochs per period.

        Returns:
            As :meth:`choose`; ``(False, None)`` when the options were not chosen again.
        """
        last = [
            r["reference_step_us"]
            for r in records[-period:]
            if np.isfinite(r.get("reference_step_us", np.nan))
        ]
        if self.spinning != "auto" or self.bounded or not last:
            return False, None
        now_ms = float(np.median(last)) / 1e3
        if self._base_ms is None:
            self._base_ms = now_ms
            return False, None
        factor = now_ms / self._base_ms
        if self.choice.config.spinning:  # the fit's clock is the wall clock then (fit_clock)
            elastic = [
                r["median_step_us"] / r["predicted_measured_step_us"]
                for r in records[-period:]
                if np.isfinite(r.get("predicted_measured_step_us", np.nan))
            ]
            if elastic and np.median(elastic) >= REPROBE_FACTOR:
                factor = max(factor, float(np.median(elastic)))
        if 1 / REPROBE_FACTOR < factor < REPROBE_FACTOR:
            return False, None
        log.info("full step %.2f ms, %.2fx the last choice's: choosing again", now_ms, factor)
        changed, winner = self.choose(rho, full_artifacts, batch, input_names, slowdown=factor)
        if not changed and (self._base_ms is None or not self.choice.step_ms):
            self._base_ms = now_ms  # changed: the next period's step, in the new options
        return changed, winner
