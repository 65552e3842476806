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

import contextlib
import dataclasses
import gc
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from . import rundir
from .arrays import ArrayDataset
from .config import TrainConfig
from .data import Dataset
from .errors import ConfigError, DataError, ModelError
from .events import Callback, RunDirectoryLog
from .labels import load_class_names, save_class_names
from .memory import MemoryProfile
from .model import LoadedModel
from .profile import Profile
from .rundir import TrainResult, locked
from .sessions import evaluate_onnx
from .trainer import ElasticTrainer

log = logging.getLogger(__name__)

__all__ = ["finish_run", "resume", "resume_trainer", "start_run", "train"]


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
    with trainer:
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
    with resume_trainer(out_dir, progress=progress, epochs=epochs) as trainer:
        return trainer.fit()


# ---- the run directory around a trainer -------------------------------------------------------


def start_run(trainer: ElasticTrainer, profile: Profile) -> None:
    """Write what resuming ``trainer``'s run needs into its run directory (``run.json``, the
    profile, the memory model, the classes) and an empty log that a :class:`RunDirectoryLog`
    callback (added first) fills."""
    out, cfg = trainer.out, trainer.config
    profile.save(out / rundir.PROFILE_FILE)
    if trainer.memory_profile is not None:
        trainer.memory_profile.save(out / rundir.MEMORY_FILE)
    rundir.write_run_file(
        out,
        model=trainer.model.source.resolve(),
        config=cfg.to_json(),
        config_hash=cfg.digest(),
        artifacts_root=trainer.artifacts_root,
        task=trainer.model.task.to_json(),
        data_in_memory=trainer.data_in_memory,
    )
    if trainer.dataset.class_names:
        save_class_names(out, trainer.dataset.class_names)
    rundir.start_log(out)
    trainer.callbacks.insert(0, RunDirectoryLog(out))


def _check_same_classes(out: Path, class_names: Sequence[str]) -> None:
    """Refuse to resume the run in ``out`` on data whose classes (``class_names``, label index
    -> name) are not the ones its head trained with (``classes.json``): the head's outputs
    would change meaning mid-run, silently (a class folder added or removed since the start
    renumbers the others).

    Raises:
        DataError: the class names differ.
    """
    saved = load_class_names(out)
    names = [str(v) for v in class_names]
    if saved is None or not names or names == saved:
        return
    added, missing = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
    change = "; ".join(
        f"{what} {', '.join(group[:5])}{' ...' if len(group) > 5 else ''}"
        for what, group in (("new classes", added), ("missing", missing))
        if group
    )
    raise DataError(
        f"the data's classes are not the ones the run in {out} trained with "
        f"({change or 'numbered in another order'}): resume with the data as it was, or "
        "start a new run"
    )


def resume_trainer(
    out_dir: str | os.PathLike,
    *,
    data=None,
    val_data=None,
    callbacks: Sequence[Callback] = (),
    progress: bool = False,
    epochs: int | None = None,
) -> ElasticTrainer:
    """The run in ``out_dir`` at its last checkpoint, ready to :meth:`ElasticTrainer.fit` on
    (after any interruption). The work after the last checkpoint (at most the current period)
    is done again; given the same data the run ends as an uninterrupted one would. A run that
    had not reached its first checkpoint starts over. A ``deadline_s`` counts from the resume.
    The model is reloaded from the path in ``run.json``; in-memory data must be given again.

    Args:
        epochs: extend the run (finished or not) to this many epochs (more than its own); the
            cosine learning-rate schedule then spans the new total. ``run.json`` records the
            new configuration.

    Raises:
        CheckpointError: ``out_dir`` holds no run, or its checkpoint is corrupt or of another
            configuration or model.
        ConfigError: ``epochs`` fewer than the run's.
        DataError: the run was given data in memory and ``data`` (or ``val_data``) is not
            given again; the data recorded for the run can no longer be used; its classes are
            not the run's (:func:`_check_same_classes`).
        ModelError, ProfileMismatchError: the model or profile recorded for the run can no
            longer be used.
    """
    out = Path(out_dir)
    model_path, config, artifacts_root = rundir.read_run_file(out, TrainConfig.from_json)
    rundir.check_resume_data(out, data, val_data)
    accepted = [config.digest(), *rundir.read_earlier_hashes(out)]
    if epochs is not None and epochs != config.epochs:
        config = _extended(out, model_path, config, artifacts_root, epochs, accepted)
    profile = Profile.load(out / rundir.PROFILE_FILE)
    task = rundir.read_run_task(out)
    model = LoadedModel.load(
        model_path,
        output=task.get("output"),
        loss=task.get("loss", "ce"),
        head_lr_scale=config.head_lr_scale,  # a model file is scaled again, a compiled one is
    )
    if model.hash != profile.model_hash:  # the file was replaced since the run started
        raise ModelError(
            f"{model_path} is no longer the model the run in {out} started with (its graph "
            "changed): put that model back, or start a new run"
        )
    memory_file = out / rundir.MEMORY_FILE
    trainer = ElasticTrainer(
        model,
        profile,
        config,
        data=data,
        val_data=val_data,
        out_dir=out,
        callbacks=callbacks,
        progress=progress,
        memory_profile=MemoryProfile.load(memory_file) if memory_file.is_file() else None,
        artifacts_root=artifacts_root,
        resuming=True,
    )
    try:
        _check_same_classes(out, trainer.dataset.class_names)
    except DataError:
        trainer.close()
        raise
    rundir.remove_temporaries(out)
    if trainer.dataset.class_names:  # the same mapping again (a kill may have come first)
        save_class_names(out, trainer.dataset.class_names)
    if artifacts_root is None:  # the run's own cache (a shared one may be in use)
        trainer.cache.remove_temporaries()
    trainer.callbacks.insert(0, RunDirectoryLog(out))
    if not (out / rundir.CHECKPOINT_FILE).exists():
        log.info("no checkpoint in %s yet: restarting the run", out)
        if progress:
            tqdm.write(f"no checkpoint in {out} yet: the run starts over")
        rundir.start_log(out)
        trainer.restore(None, 0, [])
        return trainer
    carried, epoch = rundir.read_run_checkpoint(out, model, accepted + [config.digest()])
    del model
    if trainer.bounded:  # checked; the run reads the file itself (the state is never held)
        carried = out / rundir.CHECKPOINT_FILE
        gc.collect()
    trainer.restore(carried, epoch, rundir.truncate_log(out, epoch))
    log.info("resuming %s at epoch %d of %d", out, epoch, config.epochs)
    if progress:  # the user sees where the run continues from
        tqdm.write(f"resuming {out} after epoch {epoch} of {config.epochs} (its last checkpoint)")
    return trainer


def _extended(out, model_path, config, artifacts_root, epochs: int, accepted) -> TrainConfig:
    """The run's configuration extended to ``epochs``, recorded in ``run.json`` (the earlier
    digests with it, so the run's checkpoints still resume it).

    Raises:
        ConfigError: ``epochs`` is not more than the run's.
    """
    if not epochs > config.epochs:
        raise ConfigError(
            f"--epochs {epochs} with --resume extends a run: give more than its "
            f"{config.epochs} epochs"
        )
    config = dataclasses.replace(config, epochs=epochs).validate()
    rundir.write_run_file(
        out,
        model=model_path,
        config=config.to_json(),
        config_hash=config.digest(),
        artifacts_root=artifacts_root,
        task=rundir.read_run_task(out),
        earlier_hashes=accepted,
        data_in_memory=rundir.read_data_in_memory(out),
    )
    return config


def finish_run(trainer: ElasticTrainer) -> tuple[str, float]:
    """The end of a run with a run directory: export ``model_trained.onnx`` from the last
    checkpoint (no session: the weights held once), score it in a plain InferenceSession, plot
    the curves and the selections, remove the session directory. Returns the model's path and
    its validation accuracy (NaN for mse)."""
    cfg, out = trainer.config, trainer.out
    trained = str(trainer.export(out / rundir.TRAINED_MODEL_FILE))
    _, accuracy = evaluate_onnx(
        trained,
        trainer.val_batches(),
        cfg.batch_size,
        loss=trainer.model.task.loss,
        output=trainer.model.output_name,
    )
    if trainer.model.task.loss != "ce":  # the metric is the MSE: no accuracy
        accuracy = float("nan")
    from .plots import plot_run  # matplotlib only at the end of a run

    with contextlib.suppress(Exception):
        plot_run(out)
    shutil.rmtree(trainer.work_dir, ignore_errors=True)
    return trained, accuracy
