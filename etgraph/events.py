"""What :class:`etgraph.trainer.ElasticTrainer` tells a program while it trains: the
:class:`PeriodInfo` of each period's selection and the :class:`Callback` hooks at run, period and
epoch boundaries (the shapes of Lightning's callbacks and Hugging Face's ``TrainerCallback``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import rundir

if TYPE_CHECKING:
    from .trainer import ElasticTrainer

__all__ = ["Callback", "PeriodInfo", "RunDirectoryLog"]


@dataclass(frozen=True)
class PeriodInfo:
    """One period's selection, as its start chose it (paper §4).

    Attributes:
        period: 0-based index. first_epoch, end_epoch: its epochs, ``[first, end)``, 0-based.
        rho: the requested step-time ratio of the period (deadline mode chooses it).
        mask: the selection mask, bool [N], forward order (:attr:`LoadedModel.names`).
        selected: the selected tensors' initializer names, forward order.
        importance: float64 [N] (None for strategies without importance).
        predicted_step_us: the time model's step of the selection, µs.
        timings: seconds of each part of the period start (``importance_s``, ``selection_s``,
            ``artifacts_s``, ``session_s``, ``reselection_s``) and ``artifacts_cache_hit``.
        predicted_peak_mb: the memory model's peak of the selection, MiB (None: no model).
    """

    period: int
    first_epoch: int
    end_epoch: int
    rho: float
    mask: np.ndarray
    selected: list[str]
    importance: np.ndarray | None
    predicted_step_us: float
    timings: dict
    predicted_peak_mb: float | None = None


class Callback:
    """Hooks of :class:`ElasticTrainer` at run, period and epoch boundaries (all do nothing).

    Subclass and override what you need; pass instances as ``callbacks=[...]``. The records are
    the dicts ``log.jsonl`` holds (:class:`etgraph.rundir.EpochRecord` fields).
    """

    def on_fit_start(self, trainer: ElasticTrainer) -> None:
        """Before the first period of :meth:`ElasticTrainer.fit`."""

    def on_period_start(self, trainer: ElasticTrainer, info: PeriodInfo) -> None:
        """After a period's selection, before its first step."""

    def on_epoch_end(self, trainer: ElasticTrainer, record: dict) -> None:
        """After an epoch's validation, with its log record."""

    def on_period_end(self, trainer: ElasticTrainer, info: PeriodInfo) -> None:
        """After a period's checkpoint is saved."""

    def on_fit_end(self, trainer: ElasticTrainer, result: rundir.TrainResult) -> None:
        """After the run's end (export and summary)."""


class RunDirectoryLog(Callback):
    """Appends every epoch's record to the run directory's ``log.jsonl`` (fsynced)."""

    def __init__(self, out: Path):
        self.out = out

    def on_epoch_end(self, trainer: ElasticTrainer, record: dict) -> None:
        rundir.append_log(self.out, record)
