"""The training sessions' options, chosen per run by measurement.

* :data:`TRAIN_CANDIDATES` — the candidate options (spinning off, on, on with spin stop), the
  default first.
* :func:`pick_fastest` — the fastest of several ways to run one step, measured side by side.
* :func:`choose_train_config` — full steps of each candidate stepped side by side on the run's
  own full artifacts; the winner as a :class:`ConfigChoice`.

When a run chooses (again) is :mod:`etgraph.ort_probe`'s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .ort_options import ROLES, OrtConfig
from .sessions import GradientSession

__all__ = [
    "CHOICE_MARGIN",
    "TRAIN_CANDIDATES",
    "ConfigChoice",
    "choose_train_config",
    "pick_fastest",
]


#: The training sessions' candidate options, chosen per run by :func:`choose_train_config`:
#: spinning off (fastest on a shared, loaded machine: spinning on was 1.6-3.3x slower at load
#: 1.4-12), ORT's default (spinning on: 0.79x of off for a training step alone on a quiet
#: machine, but 2.3x slower when another session runs next) and spinning on with
#: ``force_spinning_stop`` (0.80-0.94x of off on a quiet machine in every role). The first is
#: the default: another must be faster by :data:`CHOICE_MARGIN` to be chosen. Each is the
#: ``train`` role's options with only the spinning changed.
TRAIN_CANDIDATES: dict[str, OrtConfig] = {
    "off": replace(ROLES["train"], spinning=False, stop_spinning=False),
    "on": replace(ROLES["train"], spinning=True, stop_spinning=False),
    "on+stop": replace(ROLES["train"], spinning=True, stop_spinning=True),
}

#: A candidate replaces the first (the default) only if its median step is this much shorter.
CHOICE_MARGIN = 0.03


@dataclass(frozen=True)
class ConfigChoice:
    """The session options a run trains with, chosen by :func:`choose_train_config`.

    Attributes:
        label: the key of :data:`TRAIN_CANDIDATES` chosen.
        config: its options.
        step_ms: median full step (wall ms) of every candidate probed, by label; empty when
            the options were given, not probed.
        steps: timed steps per candidate.
        seconds: wall time of the probe (sessions opened, warm-up and timed steps), s.
        note: why it was not probed ("" if it was, or was given).
    """

    label: str
    config: OrtConfig
    step_ms: dict[str, float]
    steps: int = 0
    seconds: float = 0.0
    note: str = ""

    @classmethod
    def given(cls, label: str, note: str = "") -> ConfigChoice:
        """The candidate ``label`` without a probe (``note``: why).

        Raises:
            KeyError: ``label`` is not a key of :data:`TRAIN_CANDIDATES`.
        """
        return cls(label, TRAIN_CANDIDATES[label], {}, note=note)

    def to_json(self) -> dict:
        """``{"label", "step_ms", "steps", "seconds", "note"}`` for logs and summaries."""
        return {
            "label": self.label,
            "step_ms": dict(self.step_ms),
            "steps": self.steps,
            "seconds": self.seconds,
            "note": self.note,
        }


def pick_fastest(
    steppers: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    margin: float = CHOICE_MARGIN,
    drop: float = 0.25,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[str, dict[str, float]]:
    """The fastest of several ways to run one step, measured side by side.

    Every round runs each stepper twice, one after the other (the first run absorbs the switch
    from the previous stepper: caches, a pool waking up, and is not timed), the order reversed
    every other round, so load drift hits all alike. After each round a stepper whose median so
    far exceeds the best one's by more than ``drop`` runs no more (under load spinning is 2-3x
    slower: one round settles it; with only the default left the measurement stops). The first
    stepper is the default and runs every round:
    another wins only if its median is below the default's by more than ``margin`` (a
    fraction) and it was faster than the default in every round (a burst of other work on the
    machine can make any one step slow; a real gain shows in each).

    Args:
        steppers: label -> a callable running one step (at least one; insertion order).
        rounds: timed steps per stepper at most (>= 1).
        margin: the default's advantage, fraction of its median (>= 0).
        drop: a stepper this much slower than the best (fraction) is dropped.
        clock: seconds.

    Returns:
        ``(label of the fastest, {label: median seconds})`` (medians of every stepper, dropped
        ones included).

    Raises:
        ValueError: no stepper, or ``rounds`` < 1.
    """
    labels = list(steppers)
    if not labels or rounds < 1:
        raise ValueError(f"need at least one stepper and one round, got {labels} x {rounds}")
    times: dict[str, list[float]] = {label: [] for label in labels}
    running = list(labels)
    for r in range(rounds):
        for label in running if r % 2 == 0 else running[::-1]:
            steppers[label]()
            t0 = clock()
            steppers[label]()
            times[label].append(clock() - t0)
        so_far = {label: float(np.median(times[label])) for label in running}
        fastest = min(so_far.values())
        running = [
            label
            for label in running
            if label == labels[0] or so_far[label] <= fastest * (1.0 + drop)
        ]
        if len(running) == 1:  # the default alone: nothing left to compare
            break
    medians = {label: float(np.median(t)) for label, t in times.items()}
    default = labels[0]

    def wins(label: str) -> bool:
        paired = zip(times[label], times[default], strict=False)  # the rounds both ran
        return medians[label] < medians[default] * (1.0 - margin) and all(t < d for t, d in paired)

    faster = [label for label in running if label != default and wins(label)]
    return min(faster, key=medians.__getitem__, default=default), medians


def choose_train_config(
    directory: str | os.PathLike,
    batch: tuple,
    threads: int | None,
    *,
    input_names: Sequence[str] = (),
    candidates: Mapping[str, OrtConfig] | None = None,
    rounds: int = 3,
) -> tuple[ConfigChoice, GradientSession]:
    """Choose the training sessions' options by measuring full steps of each candidate.

    One all-trainable session per candidate (:class:`etgraph.sessions.GradientSession` on
    ``directory``, the run's full artifacts, from their own checkpoint) takes one warm-up step,
    then :func:`pick_fastest` times ``rounds`` steps of each side by side. Every step runs at
    learning rate 0 on a throwaway copy of the weights (the artifacts' checkpoint, never
    saved): nothing a run trains changes.

    Args:
        directory: all-trainable artifacts (``training_model.onnx``, ``optimizer_model.onnx``,
            ``checkpoint``).
        batch: ``(x, y)``, one training batch (``x`` by input name or one array).
        threads: ORT intra-op threads (the run's).
        input_names: the model's input names (single-array batches).
        candidates: label -> options, the default first (:data:`TRAIN_CANDIDATES`).
        rounds: timed steps per candidate.

    Returns:
        The :class:`ConfigChoice` and the winner's session (warm; keep it as the run's full
        reference session, or drop it).

    Raises:
        RuntimeError: ORT cannot load the artifacts.
    """
    candidates = dict(TRAIN_CANDIDATES if candidates is None else candidates)
    t0 = time.perf_counter()
    x, y = batch
    sessions = {}
    for label, config in candidates.items():
        session = GradientSession(directory, threads, input_names=input_names, config=config)
        session.train_step(x, y, 0.0)  # a fresh session's first step allocates its buffers
        sessions[label] = session
    best, medians = pick_fastest(
        {label: (lambda s=s: s.train_step(x, y, 0.0)) for label, s in sessions.items()}, rounds
    )
    winner = sessions[best]
    sessions.clear()  # release the others before returning
    choice = ConfigChoice(
        best,
        candidates[best],
        {label: 1e3 * m for label, m in medians.items()},
        rounds,
        time.perf_counter() - t0,
    )
    return choice, winner
