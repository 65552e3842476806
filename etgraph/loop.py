"""``etgraph train``'s runs: elastic training into a run directory, and resuming one.

Two entry points over :class:`etgraph.trainer.ElasticTrainer` (the period loop, paper §3-§4 and
the setup of §8) with a run directory (:mod:`etgraph.rundir`): :func:`train` starts a run,
:func:`resume` continues one from its last checkpoint after any interruption.

Baselines run through the same loop (same data order, optimizer, schedule, logging), so
comparisons are fair: ``full`` (all tensors), ``last-layer`` (traditional transfer learning: the
output layer), ``bn-bias`` (BatchNorm gamma/beta + all biases + the output layer; TinyTL-style),
``prefix`` and ``topk`` (DP-free selectors under the same budget, :mod:`etgraph.selection`).
"""

from __future__ import annotations

import os

from .config import TrainConfig
from .data import ArrayDataset, Dataset
from .memory import MemoryProfile
from .model import LoadedModel
from .profile import Profile
from .rundir import TrainResult, locked
from .trainer import ElasticTrainer

__all__ = ["resume", "train"]


@locked(new=True)  # one process per run directory, for the whole run
def train(
    model: LoadedModel,
    profile: Profile,
    config: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    artifacts_root: str | os.PathLike | None = None,
    progress: bool = True,
    started_at: float | None = None,
    memory_profile: MemoryProfile | None = None,
    dataset: Dataset | ArrayDataset | None = None,
) -> TrainResult:
    """Train ``model`` with ``config.strategy`` into the run directory ``out_dir``,
    re-selecting every ``config.period`` epochs (:meth:`ElasticTrainer.fit`).

    Args:
        model: the loaded model; ``model.source`` must stay loadable, :func:`resume` reloads it.
        profile: :class:`etgraph.profile.Profile` of this model at ``config.batch_size``.
        config: the run's settings.
        out_dir: run directory (created). Must not hold another run's checkpoint (use
            :func:`resume` to continue one).
        artifacts_root: artifact cache (default ``out_dir/artifacts``); share it between runs
            of the same model to make repeated selections free.
        progress: show tqdm bars and per-epoch lines on stderr.
        started_at: ``time.perf_counter()`` at the command's start (``config.deadline_s``
            counts from it; default: this call).
        memory_profile: the model's memory model (:mod:`etgraph.memory`); required with
            ``config.memory_mb``, optional otherwise (the log then records predicted peaks).
        dataset: the run's data when the caller loaded it (e.g. before profiling, so a data
            error comes first); default: ``config.data``, loaded here.

    Returns:
        A :class:`~etgraph.rundir.TrainResult` (also in ``out_dir/summary.json``).

    Raises:
        As :class:`ElasticTrainer` and :meth:`ElasticTrainer.fit`.
    """
    trainer = ElasticTrainer(
        model,
        profile,
        config,
        data=dataset,
        out_dir=out_dir,
        progress=progress,
        memory_profile=memory_profile,
        artifacts_root=artifacts_root,
        started_at=started_at,
    )
    del model  # under a memory budget the weights are in the file now
    return trainer.fit()


@locked(new=False)
def resume(
    out_dir: str | os.PathLike, *, progress: bool = True, epochs: int | None = None
) -> TrainResult:
    """Continue the run in ``out_dir`` from its last checkpoint (:meth:`ElasticTrainer.resume`)
    to its end — or, with ``epochs`` above the run's, extend a run to that many epochs.

    Raises:
        As :meth:`ElasticTrainer.resume` and :meth:`ElasticTrainer.fit`.
    """
    return ElasticTrainer.resume(out_dir, progress=progress, epochs=epochs).fit()
