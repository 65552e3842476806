"""The elastic trainer: ElasticTrainer's period loop (paper §3-§4, the setup of §8) as an object a
program drives — a whole run (:meth:`ElasticTrainer.fit`), a period or an epoch at a time, or
one step — with callbacks at period and epoch boundaries and weights in and out as arrays.

Every ``period`` epochs (paper: 3) the period controller (:mod:`etgraph.period`) evaluates
importance, solves the DP of Eq. (3), gets the selection's artifacts and opens a training
session on the carried state; the step executor (:mod:`etgraph.steps`) trains the period's
epochs with cosine learning-rate decay, interleaving full reference steps measured alike; the
clock (:mod:`etgraph.clock`) fits the time model to them (the closed loop) or plans rho for a
deadline; :mod:`etgraph.ort_probe` chooses the sessions' options. At a period's end the state
(weights, AdamW moments, step) is saved to a checkpoint.

**The run directory is optional.** With ``out_dir`` the run writes what ``etgraph train``
writes (:mod:`etgraph.rundir`: ``run.json``, ``log.jsonl``, a checkpoint after every period,
``model_trained.onnx``, plots, ``summary.json``) and can be resumed after a kill
(:meth:`ElasticTrainer.resume`); without it everything lives in a private temporary directory
removed by :meth:`ElasticTrainer.close` (or the ``with`` block's end).

**Optimizer.** AdamW (decoupled weight decay) with betas (0.9, 0.999), eps 1e-6 — ORT's
training runtime runs only AdamW and momentum-less SGD. The paper uses SGDW with momentum 0.9 for
CNNs (Adam for ViT). The learning rate follows the paper's cosine decay over all training steps,
set each step (ORT's LinearLRScheduler is broken in 1.19.2). The step count is global (one
optimizer group), so bias correction continues across selections.

**Under a memory budget** (``memory_mb``, issue #17) the whole process stays within it: at any
moment one heavy thing is alive. The model's weights leave the process at the start (they go to
a checkpoint file, tensor by tensor), artifacts are generated from placeholders, the state always
goes through a file (at a period's end the sessions are released before the save), importance
runs chunk by chunk, and the trained model is exported from the checkpoint without a session. No
full reference steps are taken (a full step does not fit): the loop runs open, ``rho_measured``
is NaN. ``peak_rss_mb`` in the log is the process's ``VmHWM`` since the previous period's end.

**Determinism.** All randomness derives from the run seed: epoch ``e`` shuffles with
``seed * 1000 + e``, period ``p`` probes with ``seed * 1000 + 100_000 + p``. Same seed, same data
=> the same selections and losses (open loop; the closed loop's selections depend on measured
times); a resumed run continues exactly as the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper
from tqdm import tqdm

from . import rundir
from .artifacts import (
    ArtifactCache,
    export_inference_model,
    lazy_initializer_values,
    placeholder_weights,
)
from .checkpoint import CarriedState, read_checkpoint, write_checkpoint
from .clock import DeadlinePlanner, period_reference_positions
from .config import TrainConfig
from .data import ArrayDataset, Dataset, as_dataset
from .errors import ConfigError, DataError, ProfileMismatchError, TrainingDivergedError
from .files import temporary_prefix
from .host import (
    freeze_gc,
    limit_heap_retention,
    peak_rss_mb,
    release_native_memory,
    reset_peak_rss,
)
from .labels import save_class_names, set_class_names, stamp_onnx
from .memory import MemoryProfile
from .model import LoadedModel
from .onnx_io import export_with_original_outputs, original_outputs, restore_exported
from .ort_probe import OrtOptions
from .period import PeriodController, memory_log
from .profile import Profile
from .selection import MemoryCosts, check_memory_floor, strategy_mask
from .sessions import TrainingSession, evaluate_onnx
from .steps import EpochSteps, cosine_learning_rate, epoch_record, train_steps
from .timing import StepTimeFit, min_feasible_rho

log = logging.getLogger(__name__)

__all__ = ["Callback", "ElasticTrainer", "PeriodInfo", "load_run_data"]

#: Under a memory budget the run's initial weights go to this file (in the work directory).
INITIAL_CHECKPOINT = "initial.ckpt"


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


class _RunDirectoryLog(Callback):
    """Appends every epoch's record to the run directory's ``log.jsonl`` (fsynced)."""

    def __init__(self, out: Path):
        self.out = out

    def on_epoch_end(self, trainer: ElasticTrainer, record: dict) -> None:
        rundir.append_log(self.out, record)


class ElasticTrainer:
    """Elastic training of one model on one dataset: the period loop of paper §4.

    Args:
        model: the loaded model (:func:`etgraph.load_model`; its ``source`` must stay loadable
            for :meth:`resume`).
        profile: its :class:`etgraph.profile.Profile` at ``config.batch_size``.
        config: the run's settings (:class:`etgraph.config.TrainConfig`).
        data: the data: None (``config.data``: a spec, or the embedded digits task), a spec
            string or path (image folder, ``.npz``, ``.csv``/``.jsonl`` with
            ``config.tokenizer``), a loaded dataset, ``(inputs, labels)`` arrays in memory, or
            an iterable of ``(inputs, labels)`` batches (:func:`etgraph.data.as_dataset`).
        val_data: validation data in memory (as ``data``); default: ``config.val_fraction``
            of ``data`` held out.
        out_dir: run directory (created; must not hold another run), or None: no files
            outside a private temporary directory.
        callbacks: :class:`Callback` instances, called in order.
        progress: tqdm bars and per-epoch lines on stderr.
        memory_profile: the memory model (required with ``config.memory_mb``).
        artifacts_root: an artifact cache shared between runs of the same model (default: the
            run directory's ``artifacts/``, or the temporary directory).
        started_at: ``time.perf_counter()`` the deadline counts from (default: now).

    Raises:
        ConfigError: bad settings, an unwritable ``out_dir`` or a run in it, a deadline even
            the cheapest selection cannot meet, a memory budget below the model's floor.
        ProfileMismatchError: the profile is of another model, batch size or input shape.
        DataError, ModelError: the data cannot be used with the model.
    """

    def __init__(
        self,
        model: LoadedModel,
        profile: Profile,
        config: TrainConfig | None = None,
        *,
        data=None,
        val_data=None,
        out_dir: str | os.PathLike | None = None,
        callbacks: Sequence[Callback] = (),
        progress: bool = False,
        memory_profile: MemoryProfile | None = None,
        artifacts_root: str | os.PathLike | None = None,
        started_at: float | None = None,
        _resuming: bool = False,
    ):
        config = (config or TrainConfig()).validate()
        if isinstance(data, (str, os.PathLike)):  # a spec: recorded in run.json
            config = dataclasses.replace(config, data=str(data))
            data = None
        self.config = config
        self.started_at = time.perf_counter() if started_at is None else started_at
        self.progress = progress
        self.callbacks = list(callbacks)
        self.out = Path(out_dir) if out_dir is not None else None
        _check_memory_profile(config, memory_profile)
        if self.out is not None and not _resuming:
            rundir.prepare_run_dir(self.out)
        self._tmp = None if self.out is not None else tempfile.mkdtemp(prefix="etgraph-train-")
        self.work_dir = (self.out / rundir.SESSION_DIR) if self.out is not None else Path(self._tmp)
        self.source_model = model
        self.bounded = config.memory_mb is not None
        if self.bounded:  # the weights live in checkpoint files only (module docstring)
            limit_heap_retention()
            params = model.names + list(model.running_stats)
            model = dataclasses.replace(model, proto=placeholder_weights(model.proto, params))
        self.model = model
        self.names = model.names
        self.input_shapes = model.input_shapes(profile.input_shapes)
        _check_profile(profile, model, config, self.input_shapes)
        self.profile = profile.for_frozen_bn(config.frozen_bn)  # the run's batch-norm mode
        self.memory_profile = memory_profile
        self.threads = config.threads if config.threads is not None else profile.threads
        self.dataset: Dataset | ArrayDataset = self._load_data(data, val_data=val_data)
        self.steps_per_epoch = _steps_per_epoch(self.dataset, config)
        self.total_steps = self.steps_per_epoch * config.epochs
        root = artifacts_root or (
            self.out / rundir.ARTIFACTS_DIR if self.out is not None else self.work_dir / "artifacts"
        )
        self.artifacts_root = Path(artifacts_root) if artifacts_root else None
        # Sessions train at the run's one batch shape (training batches are full, validation
        # pads), as the profile measured: static shapes let ORT fold the shape arithmetic
        # (ViT-B/16 at 128 px: full step 511 vs 697 ms with a symbolic batch). The exported
        # model gets its symbolic batch back (export).
        self.cache = ArtifactCache(root, static_batch=(config.batch_size, self.input_shapes))
        self.options = OrtOptions(
            config.spinning,
            bounded=self.bounded,
            threads=self.threads,
            total_steps=self.total_steps,
            deadline_mode=config.deadline_s is not None,
        )
        self.controller = PeriodController(
            model,
            self.profile,
            config,
            self.dataset,
            self.cache,
            self.options,
            self.work_dir,
            threads=self.threads,
            memory_profile=memory_profile,
        )
        p = self.profile
        self.floor_rho = min_feasible_rho(p.t_dw_us, p.t_dy_us, p.forward_us, p.t_full_us)
        self.deadline = None
        if config.deadline_s is not None:
            val_batches = math.ceil(self.dataset.n_val / config.batch_size)
            if config.max_val_batches is not None:
                val_batches = min(val_batches, config.max_val_batches)
            self.deadline = DeadlinePlanner(
                deadline_s=config.deadline_s,
                started_at=self.started_at,
                epochs=config.epochs,
                period=config.period,
                steps_per_epoch=self.steps_per_epoch,
                val_batches=val_batches,
                floor_rho=self.floor_rho,
                profiled_full_step_s=p.measured_full_step_us * 1e-6,
                full_step_now_s=self._full_step_now_s,
            )
        # the run's progress
        self.rho = config.rho  # this period's requested rho (deadline mode chooses it)
        self.epoch = 0  # epochs done
        self.global_step = 0  # training steps done (the cosine schedule's position)
        self.records: list[dict] = []
        self.fit_model = StepTimeFit()
        self._carried: CarriedState | Path | None = None  # the state between periods
        self._session: TrainingSession | None = None
        self._mask: np.ndarray | None = None  # the current (or last) selection
        self._period: PeriodInfo | None = None  # the period in progress
        self._predicted_peak_mb: float | None = None
        self._pending_timings: dict | None = None  # the period start's, for its first epoch
        self._options_chosen = False
        self._since_set: set[str] = set()  # tensors trained since set_weights
        self._stats_at_set: dict[str, np.ndarray] | None = None
        if not _resuming:
            if self.deadline is not None:
                self.deadline.check()
            if memory_profile is not None and config.memory_mb is not None:  # the model's floor
                check_memory_floor(MemoryCosts.from_profile(memory_profile, config.memory_mb))
            self._carried = self._initial_state()
            if self.out is not None:
                self._start_run_directory(profile)

    # -- construction helpers -------------------------------------------------------------------

    def _initial_state(self) -> CarriedState | Path:
        """The model's initial weights; under a memory budget written to a checkpoint file
        instead (straight from the model's bytes, one tensor at a time) and its path returned,
        so the run never holds them."""
        model = self.source_model
        if not self.bounded:
            return CarriedState(model.initial_weights())
        self.work_dir.mkdir(parents=True, exist_ok=True)
        path = self.work_dir / INITIAL_CHECKPOINT
        params = model.names + list(model.running_stats)
        write_checkpoint(path, CarriedState(lazy_initializer_values(model.proto, params)), [])
        self.source_model = None  # the caller's copy may go: the weights are in the file
        memory_log("the initial checkpoint")
        return path

    def _start_run_directory(self, profile: Profile) -> None:
        """Write what resuming the run needs (run.json, profile, memory model, classes) and an
        empty log."""
        out, cfg = self.out, self.config
        profile.save(out / rundir.PROFILE_FILE)
        if self.memory_profile is not None:
            self.memory_profile.save(out / rundir.MEMORY_FILE)
        rundir.write_run_file(
            out,
            model=self.model.source.resolve(),
            config=cfg.to_json(),
            config_hash=cfg.digest(),
            artifacts_root=self.artifacts_root,
            task=self.model.task.to_json(),
        )
        if self.dataset.class_names:
            save_class_names(out, self.dataset.class_names)
        rundir.start_log(out)
        self.callbacks.insert(0, _RunDirectoryLog(out))

    @classmethod
    def resume(
        cls,
        out_dir: str | os.PathLike,
        *,
        data=None,
        val_data=None,
        callbacks: Sequence[Callback] = (),
        progress: bool = False,
        epochs: int | None = None,
    ) -> ElasticTrainer:
        """The run in ``out_dir`` at its last checkpoint, ready to :meth:`fit` on (after any
        interruption). The work after the last checkpoint (at most the current period) is done
        again; given the same data the run ends as an uninterrupted one would. A run that had
        not reached its first checkpoint starts over. A ``deadline_s`` counts from the resume.
        The model is reloaded from the path in ``run.json``; in-memory data must be given again.

        Args:
            epochs: extend the run (finished or not) to this many epochs (more than its own);
                the cosine learning-rate schedule then spans the new total. ``run.json`` records
                the new configuration.

        Raises:
            CheckpointError: ``out_dir`` holds no run, or its checkpoint is corrupt or of
                another configuration or model.
            ConfigError: ``epochs`` fewer than the run's.
            ModelError, ProfileMismatchError, DataError: the model, profile or data recorded for
                the run can no longer be used.
        """
        out = Path(out_dir)
        model_path, config, artifacts_root = rundir.read_run_file(out, TrainConfig.from_json)
        accepted = [config.digest(), *rundir.read_earlier_hashes(out)]
        if epochs is not None and epochs != config.epochs:
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
            )
        profile = Profile.load(out / rundir.PROFILE_FILE)
        task = rundir.read_run_task(out)
        model = LoadedModel.load(model_path, output=task.get("output"), loss=task.get("loss", "ce"))
        memory_file = out / rundir.MEMORY_FILE
        memory_profile = MemoryProfile.load(memory_file) if memory_file.is_file() else None
        trainer = cls(
            model,
            profile,
            config,
            data=data,
            val_data=val_data,
            out_dir=out,
            callbacks=callbacks,
            progress=progress,
            memory_profile=memory_profile,
            artifacts_root=artifacts_root,
            _resuming=True,
        )
        rundir.remove_temporaries(out)
        if trainer.dataset.class_names:  # the same mapping again (a kill may have come first)
            save_class_names(out, trainer.dataset.class_names)
        if artifacts_root is None:  # the run's own cache (a shared one may be in use)
            trainer.cache.remove_temporaries()
        trainer.callbacks.insert(0, _RunDirectoryLog(out))
        if not (out / rundir.CHECKPOINT_FILE).exists():
            log.info("no checkpoint in %s yet: restarting the run", out)
            if progress:
                tqdm.write(f"no checkpoint in {out} yet: the run starts over")
            rundir.start_log(out)
            trainer._carried = trainer._initial_state()
            return trainer
        carried, epoch = rundir.read_run_checkpoint(out, model, accepted + [config.digest()])
        trainer.source_model = None
        del model
        if trainer.bounded:  # checked; the run reads the file itself (the state is never held)
            carried = out / rundir.CHECKPOINT_FILE
            gc.collect()
        trainer._carried = carried
        trainer.records = rundir.truncate_log(out, epoch)
        trainer.epoch, trainer.global_step = epoch, epoch * trainer.steps_per_epoch
        log.info("resuming %s at epoch %d of %d", out, epoch, config.epochs)
        if progress:  # the user sees where the run continues from
            tqdm.write(
                f"resuming {out} after epoch {epoch} of {config.epochs} (its last checkpoint)"
            )
        return trainer

    # -- the whole run --------------------------------------------------------------------------

    def fit(self) -> rundir.TrainResult:
        """Train to ``config.epochs``, re-selecting every ``config.period`` epochs, then export
        and summarise (with a run directory: ``model_trained.onnx``, plots, ``summary.json``).

        Returns:
            The :class:`etgraph.rundir.TrainResult` (``inference_val_acc`` NaN and
            ``trained_model`` empty without a run directory: call :meth:`export`).

        Raises:
            InfeasibleBudgetError: ``rho`` is too small for any selection (gives the smallest).
            TrainingDivergedError: a training loss was NaN or infinite (the run stops at that
                step; the last period's checkpoint is kept).
        """
        for callback in self.callbacks:
            callback.on_fit_start(self)
        freeze_gc()  # re-selections build graphs: collections then skip the libraries' objects
        while self.epoch < self.config.epochs:
            self.train_epoch()
        if self._period is not None:  # a period left open by a caller driving it by hand
            self.end_period()
        self._session = None  # the end exports from the checkpoint without a session
        if self.bounded:
            gc.collect()
            release_native_memory()
        result = self._finish()
        for callback in self.callbacks:
            callback.on_fit_end(self, result)
        return result

    # -- one period -----------------------------------------------------------------------------

    def begin_period(self) -> PeriodInfo:
        """Start the period of the next epoch: importance -> selection -> artifacts -> session
        (:meth:`etgraph.period.PeriodController.reselect`). Returns what it chose.

        Raises:
            ConfigError: a period is already in progress, or the run has trained every epoch.
            InfeasibleBudgetError, InfeasibleMemoryError: no selection fits the budgets.
        """
        cfg = self.config
        if self._period is not None:
            raise ConfigError(f"period {self._period.period} is in progress: end it first")
        if self.epoch >= cfg.epochs:
            raise ConfigError(f"the run has trained all {cfg.epochs} epochs")
        if not self._options_chosen:  # the sessions' options, measured once at the start
            self.controller.choose_options(self.rho)
            self._options_chosen = True
        carried = self._state_between_periods()
        if self.deadline is not None:
            self.rho = self.deadline.rho(self.epoch, self.records)
        period = self.epoch // cfg.period
        chosen = self.controller.reselect(
            period, carried, self.records, self.rho, self._session, self._mask
        )
        self._session, self._mask, self.fit_model = chosen.session, chosen.mask, chosen.fit
        self._predicted_peak_mb = chosen.predicted_peak_mb
        self._since_set.update(np.asarray(self.names)[chosen.mask].tolist())
        self._period = PeriodInfo(
            period=period,
            first_epoch=self.epoch,
            end_epoch=min((period + 1) * cfg.period, cfg.epochs),
            rho=self.rho,
            mask=chosen.mask,
            selected=[n for n, s in zip(self.names, chosen.mask, strict=True) if s],
            importance=chosen.importance,
            predicted_step_us=self.profile.predicted_step_us(chosen.mask),
            timings=chosen.timings,
        )
        self._pending_timings = chosen.timings
        for callback in self.callbacks:
            callback.on_period_start(self, self._period)
        return self._period

    def _state_between_periods(self) -> CarriedState | Path:
        """The carried state at a period start: as the last period's end checkpointed it (the
        file itself under a memory budget, the session released); the training session is kept
        for an unchanged selection unless the session options change."""
        if self._session is None:
            return self._carried
        if self.bounded:  # released before importance: the state is in the file
            self._session, self._carried = None, self.checkpoint_path
        else:
            self._carried, _, _ = read_checkpoint(self.checkpoint_path)
            if self.controller.recheck_options(self.records, self.rho):
                self._session = None  # opened again with the new options
        return self._carried

    def end_period(self) -> None:
        """Save the checkpoint at the end of the period in progress (weights, AdamW moments,
        step and run state; with a run directory its ``checkpoint``).

        Raises:
            ConfigError: no period is in progress.
        """
        info = self._period
        if info is None:
            raise ConfigError("no period is in progress")
        memory_log(f"period {info.period}'s epochs")
        reset_peak_rss()  # the next period's peak counts from here (checkpoint save on)
        if self.bounded:  # the save builds the file in memory: the workspace goes first
            self._session.release_sessions()
            release_native_memory()
            memory_log("releasing the sessions")
        t0 = time.perf_counter()
        properties = rundir.checkpoint_properties(
            epoch=self.epoch,
            global_step=self.global_step,
            mask=self._mask,
            config_hash=self.config.digest(),
            seed=self.config.seed,
        )
        self._session.save(self.checkpoint_path, properties)
        log.debug("checkpoint after epoch %d: %.3f s", self.epoch, time.perf_counter() - t0)
        self._period = None
        self._carried = self.checkpoint_path  # the state, until a session moves on from it
        if self.bounded:
            self._session = None
        for callback in self.callbacks:
            callback.on_period_end(self, info)

    @property
    def checkpoint_path(self) -> Path:
        """Where the checkpoint of each period's end goes (the run directory's ``checkpoint``,
        or the private work directory's)."""
        if self.out is not None:
            return self.out / rundir.CHECKPOINT_FILE
        return self.work_dir / rundir.CHECKPOINT_FILE

    # -- one epoch ------------------------------------------------------------------------------

    def train_epoch(self) -> dict:
        """Train the next epoch (starting its period if none is in progress), validate, and
        end the period if this was its last epoch. Returns the epoch's log record.

        Raises:
            TrainingDivergedError: a NaN or infinite loss.
        """
        if self._period is None:
            self.begin_period()
        cfg, info = self.config, self._period
        epoch, period = self.epoch, info.period
        session = self._ensure_session()
        reference, reference_at, setup_s = None, frozenset(), 0.0
        if cfg.strategy != "full" and not self.bounded:  # a full step would not fit a budget
            t0 = time.perf_counter()
            reference = self.controller.reference_session()  # the first epoch opens it
            setup_s = time.perf_counter() - t0
            reference_at = self._reference_steps_at(epoch, info)
        bar = tqdm(
            total=self.steps_per_epoch,
            desc=f"epoch {epoch + 1}/{cfg.epochs}",
            disable=not self.progress,
            leave=False,
            unit="step",
        )

        def shown(steps: EpochSteps) -> None:
            bar.update(1)
            bar.set_postfix(
                loss=f"{np.mean(steps.losses):.3f}",
                acc=f"{steps.correct / steps.seen:.3f}",
                refresh=False,
            )

        def diverged(step: int, loss: float, lr: float) -> None:
            bar.close()
            self._diverged(epoch, period, step, loss, lr)

        steps = train_steps(
            session,
            self._train_batches(epoch),
            lambda s: cosine_learning_rate(cfg.learning_rate, s, self.total_steps),
            self.global_step,
            reference=reference,
            reference_at=reference_at,
            on_step=shown,
            on_nonfinite=diverged,
        )
        bar.close()
        fresh, session.fresh = session.fresh, False
        t_val = time.perf_counter()
        val_loss, val_metric = session.evaluate(self._val_batches(), cfg.batch_size)
        val_s = time.perf_counter() - t_val
        probe_s, chose = self.options.take_epoch_fields()
        choice = self.options.choice
        record = epoch_record(
            steps,
            epoch=epoch,
            period=period,
            fresh_session=fresh,
            mask=self._mask,
            val=(val_loss, val_metric, val_s),
            classify=self.model.task.loss == "ce",
            timings=self._pending_timings,
            reference_setup_s=setup_s,
            probe_s=probe_s,
            previous_s=self.records[-1]["cumulative_wall_time_s"] if self.records else 0.0,
            reference="measured"
            if reference is not None
            else ("self" if cfg.strategy == "full" else "none"),
            predicted_step_us=info.predicted_step_us,
            t_full_us=self.profile.t_full_us,
            fit=self.fit_model,
            rho=self.rho,
            peak_rss_mb=peak_rss_mb(),
            predicted_peak_mb=self._predicted_peak_mb
            if self._predicted_peak_mb is not None
            else None
            if self.memory_profile is None
            else self.memory_profile.peak_mb(self._mask),
            ort={
                "ort_config": choice.label,
                "ort_probe_s": probe_s,
                "ort_probe_step_ms": dict(choice.step_ms) if chose and choice.step_ms else None,
                "ort_note": choice.note if chose else "",
            },
        )
        self._pending_timings = None  # the period start is charged to its first epoch only
        self.records.append(asdict(record))
        self.epoch += 1
        self.global_step += len(steps.step_times)
        if self.progress:
            tqdm.write(
                f"epoch {epoch + 1:>3}/{cfg.epochs}  loss {record.train_loss:.4f}  "
                f"acc {record.train_acc:.3f}  val_loss {val_loss:.4f}  "
                f"val_acc {record.val_acc:.3f}  "
                f"{record.wall_time_s:.1f}s  {int(self._mask.sum())}/{self._mask.size} tensors"
            )
        for callback in self.callbacks:
            callback.on_epoch_end(self, self.records[-1])
        if self.epoch >= info.end_epoch:
            self.end_period()
        return self.records[-1]

    def _reference_steps_at(self, epoch: int, info: PeriodInfo) -> frozenset[int]:
        """Steps of ``epoch`` (0-based) after which a full reference step runs
        (:func:`etgraph.clock.period_reference_positions` of its period)."""
        first = info.period * self.config.period
        epochs = min(first + self.config.period, self.config.epochs) - first
        positions = period_reference_positions(
            self.steps_per_epoch, epochs, self.config.reference_budget, self.rho
        )
        return positions[epoch - first]

    def _diverged(self, epoch: int, period: int, step: int, loss: float, lr: float) -> None:
        """Stop the run at the first non-finite loss (epoch 0-based, step 1-based): one line that
        names where and suggests a lower learning rate; the last checkpoint is left as it is."""
        message = (
            f"training diverged: the loss is {loss} at epoch {epoch + 1}, step {step} "
            f"(learning rate {lr:.3g}): start a new run with a lower --lr"
        )
        if self.out is not None and self.checkpoint_path.exists():
            message += (
                f"; the last good checkpoint, after epoch {period * self.config.period}, is kept "
                f"in {self.checkpoint_path}"
            )
        raise TrainingDivergedError(message, epoch + 1, step)

    # -- one step -------------------------------------------------------------------------------

    def step(self, inputs, labels: np.ndarray) -> float:
        """One training step of the current period's selection on one batch, at the cosine
        schedule's learning rate of :attr:`global_step` (which it advances); starts a period if
        none is in progress. For programs that run their own loop: no reference step, no
        record, no validation (:meth:`evaluate`); end the period with :meth:`end_period`.

        Args:
            inputs: float32 ``[B, ...]`` for a one-input model, or input name -> array
                ``[B, ...]`` in each input's dtype; ``B`` = ``config.batch_size``.
            labels: int64 ``[B]`` class indices (loss ce) or float32 ``[B, D]`` targets (mse).

        Returns:
            The batch's mean loss.

        Raises:
            DataError: the batch is not of the run's batch size.
            TrainingDivergedError: the loss is NaN or infinite.
        """
        labels = np.asarray(labels)
        if labels.shape[0] != self.config.batch_size:
            raise DataError(
                f"a step takes batches of {self.config.batch_size} (the batch size the sessions "
                f"were built for), got {labels.shape[0]}"
            )
        if self._period is None:
            self.begin_period()
        lr = cosine_learning_rate(self.config.learning_rate, self.global_step, self.total_steps)
        loss, _ = self._ensure_session().train_step(inputs, labels, lr)
        if not math.isfinite(loss):
            self._diverged(self.epoch, self._period.period, 1, loss, lr)
        self.global_step += 1
        return loss

    def _ensure_session(self) -> TrainingSession:
        """The period's training session (opened again on the carried state after
        :meth:`set_weights`)."""
        if self._session is None:
            carried = self._carried
            self._session, _, _ = self.controller.open_session(
                self._mask, carried, self.config.learning_rate
            )
        return self._session

    # -- weights --------------------------------------------------------------------------------

    def _state(self) -> CarriedState:
        """The current state (weights, moments, step), read from the open session through a
        checkpoint written to the work directory, else the carried one."""
        if self._session is not None and self._session.module is not None:
            path = self.work_dir / "state.ckpt"
            self.work_dir.mkdir(parents=True, exist_ok=True)
            self._session.save(path, {})
            state, _, _ = read_checkpoint(path)
            path.unlink()
            return state
        if isinstance(self._carried, Path):
            return read_checkpoint(self._carried)[0]
        return self._carried

    def get_weights(self) -> dict[str, np.ndarray]:
        """Copies of the current value of every parameter: each trainable tensor (kernel, bias,
        gamma, beta, ...) and each BatchNorm running statistic, by ONNX initializer name; numpy
        arrays of the initializer's shape and dtype (float32)."""
        return {k: np.array(v, copy=True) for k, v in self._state().weights.items()}

    def set_weights(self, weights: Mapping[str, np.ndarray], *, reset_moments: bool = False):
        """Overwrite parameters by initializer name (any subset of :meth:`get_weights`' names),
        e.g. a federated server's global model. The optimizer's AdamW moments of the tensors set
        are kept (Keras' ``set_weights``; the step count too), or with ``reset_moments`` zeroed
        for them (a fresh optimizer). Starts the record of :meth:`trained_weights` anew. The
        training session is reopened on the new state at the next step.

        Raises:
            ConfigError: an unknown name, or an array of another shape or dtype than the
                initializer's.
        """
        specs = {i.name: i for i in self.model.proto.graph.initializer}
        params = set(self.names) | set(self.model.running_stats)
        state = self._state()
        for name, value in weights.items():
            if name not in params:
                raise ConfigError(f"{name!r} is not a parameter of the model: use get_weights()'s")
            value = np.asarray(value)
            dims = tuple(specs[name].dims)
            dtype = helper.tensor_dtype_to_np_dtype(specs[name].data_type)
            if value.shape != dims or value.dtype != dtype:
                raise ConfigError(
                    f"{name!r} is {dtype} {list(dims)}; got {value.dtype} {list(value.shape)}"
                )
            state.weights[name] = np.array(value, copy=True)
            if reset_moments:
                state.moments.pop(name, None)
        self._carried = state
        if self.bounded:  # the state lives in a file (with the moments it has)
            path = self.work_dir / "set.ckpt"
            write_checkpoint(path, state, sorted(state.moments))
            self._carried = path
        self._session = None  # reopened on the new state (a baked session holds constants)
        self._since_set = set()
        stats = list(self.model.running_stats)
        self._stats_at_set = {n: np.array(state.weights[n], copy=True) for n in stats}

    def trained_weights(self) -> dict[str, np.ndarray]:
        """The parameters training may have changed since the last :meth:`set_weights` (or the
        start): every tensor selected in a period since, and every running statistic whose value
        changed. Copies, by initializer name (what a federated client uploads)."""
        weights = self.get_weights()
        names = set(self._since_set)
        at_set = self._stats_at_set or {}
        for name in self.model.running_stats:
            if name not in at_set or not np.array_equal(at_set[name], weights[name]):
                names.add(name)
        return {n: weights[n] for n in weights if n in names}

    # -- evaluation and export ------------------------------------------------------------------

    def evaluate(self, data=None) -> tuple[float, float]:
        """``(mean loss, metric)`` of the current weights on ``data`` (default: the validation
        set): accuracy in [0, 1] for loss ce, the MSE for mse. ``data`` as the constructor's
        ``val_data``. Before any period, the last layer's session evaluates.

        Raises:
            DataError: ``data`` does not fit the model.
        """
        cfg = self.config
        batches = self._val_batches()
        if data is not None:
            batches = self._load_data(data, all_val=True).val_batches(cfg.batch_size)
        if self._mask is None:  # nothing selected yet: the output layer's (cheapest) session
            self._mask = strategy_mask(
                "last-layer", list(self.model.tensors), self.profile, self.rho, None
            )
        return self._ensure_session().evaluate(batches, cfg.batch_size)

    def export(self, path: str | os.PathLike) -> Path:
        """Write the trained inference model (the user's interface: symbolic batch, the head
        legalisation took off restored, the other outputs when ``--output`` picked one, class
        names in ``metadata_props``) with the current weights, atomically.

        Returns:
            ``path``.
        """
        path = Path(path)
        partial = path.with_name(f"{temporary_prefix(path.name)}partial")  # hidden until done
        if self._session is not None and self._session.module is not None:
            ckpt = self.work_dir / "export.ckpt"
            self.work_dir.mkdir(parents=True, exist_ok=True)
            self._session.save(ckpt, {})
            mask = self._mask
        else:  # the carried state, as the last period's end saved it
            ckpt = self._carried if isinstance(self._carried, Path) else None
            if ckpt is None:
                ckpt = self.work_dir / "export.ckpt"
                self.work_dir.mkdir(parents=True, exist_ok=True)
                write_checkpoint(ckpt, self._carried, [])
            _, requires_grad, _ = read_checkpoint(ckpt, copy=False, moments=False)
            selected = set(requires_grad)
            mask = self._mask
            if selected:
                mask = np.array([n in selected for n in self.names])
            if mask is None:
                mask = strategy_mask(
                    "last-layer", list(self.model.tensors), self.profile, self.rho, None
                )
        paths, _, _ = self.controller.artifacts(mask)
        labelled = onnx.ModelProto()
        if self.dataset.class_names:  # a prediction reads back as a label (metadata_props)
            set_class_names(labelled, self.dataset.class_names)
        metadata = {p.key: p.value for p in labelled.metadata_props}
        export_inference_model(paths.eval_model, ckpt, partial, [self.model.output_name], metadata)
        # the artifacts' batch size was fixed (the cache); the original output meaning
        restore_exported(partial, self.model.head)
        memory_log("export")
        if self._export_original_outputs(partial) and self.dataset.class_names:
            stamp_onnx(partial, self.dataset.class_names)  # the original's file had none
        os.replace(partial, path)  # a user never picks up a half-made model
        return path

    def _export_original_outputs(self, trained: Path) -> bool:
        """When ``--output`` picked one of several outputs: the exported model becomes the
        original model (all its outputs) with the trained weights, if the original file is
        still there and holds its weights as initializers; else it keeps the trained output
        only (logged). Returns whether the file was rewritten from the original."""
        from .errors import ModelError

        recorded = original_outputs(self.model.proto)
        if recorded is None:
            return False
        names, source = recorded
        try:
            export_with_original_outputs(
                trained, source, set(self.names) | set(self.model.running_stats)
            )
        except ModelError as exc:
            log.warning(
                "%s; %s has the trained output %r only", exc, trained, self.model.output_name
            )
            return False
        log.info("exported %s with the original outputs %s", trained, names)
        return True

    def _finish(self) -> rundir.TrainResult:
        """The run's end: with a run directory export ``model_trained.onnx`` from the last
        checkpoint (no session: the weights held once), score it, plot, write the summary and
        remove the session directory; without one only the summary."""
        cfg = self.config
        inference_acc, trained = float("nan"), ""
        if self.out is not None:
            trained = str(self.export(self.out / rundir.TRAINED_MODEL_FILE))
            _, inference_acc = evaluate_onnx(
                trained,
                self._val_batches(),
                cfg.batch_size,
                loss=self.model.task.loss,
                output=self.model.output_name,
            )
            if self.model.task.loss != "ce":  # the metric is the MSE: no accuracy
                inference_acc = float("nan")
            memory_log("scoring the exported model")
            from .plots import plot_run  # matplotlib only at the end of a run

            with contextlib.suppress(Exception):
                plot_run(self.out)
            shutil.rmtree(self.work_dir, ignore_errors=True)
        result = rundir.summarize(
            self.out if self.out is not None else Path(""),
            self.records,
            strategy=cfg.strategy,
            rho=cfg.rho,
            profile=self.profile,
            inference_acc=inference_acc,
            trained_model=trained,
            deadline_s=cfg.deadline_s,
            elapsed_s=time.perf_counter() - self.started_at,
        )
        if self.out is not None:
            rundir.write_summary(self.out, result)
        return result

    # -- data -----------------------------------------------------------------------------------

    def _load_data(self, data, **kwargs) -> Dataset | ArrayDataset:
        return load_run_data(self.config, self.model, self.input_shapes, data, **kwargs)

    def _val_batches(self) -> Iterator:
        batches = self.dataset.val_batches(self.config.batch_size)
        limit = self.config.max_val_batches
        for i, batch in enumerate(batches):
            if limit is not None and i >= limit:
                return
            yield batch

    def _train_batches(self, epoch: int) -> Iterator:
        cfg = self.config
        batches = self.dataset.train_batches(cfg.batch_size, seed=cfg.seed * 1000 + epoch)
        for i, batch in enumerate(batches):
            if i >= self.steps_per_epoch:
                return
            yield batch

    def _full_step_now_s(self, steps: int = 3) -> float:
        """Median wall time (s) of ``steps`` full steps of the (warm) reference session on a
        probe batch: the machine's speed at the start of a deadline run. Under a memory budget
        (no full session fits) the profile's measured full step."""
        if self.bounded:
            return self.profile.measured_full_step_us * 1e-6
        reference = self.controller.reference_session()
        x, y = self.controller.probe_batches(0)[0]
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            reference.train_step(x, y, 0.0)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the ORT sessions and remove the private temporary directory (a run without
        a run directory). The trainer cannot train after it."""
        self._session = None
        self.controller.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> ElasticTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)


def load_run_data(
    config: TrainConfig,
    model: LoadedModel,
    shapes: Mapping[str, Sequence[int]],
    data=None,
    **kwargs,
) -> Dataset | ArrayDataset:
    """The data of a run of ``config`` on ``model`` at per-example input ``shapes``: ``data``
    in any form :func:`etgraph.data.as_dataset` takes, or ``config.data`` (a spec; None: the
    embedded digits task) with the run's tokenizer, split and preprocessing. Keyword arguments
    go to :func:`etgraph.data.as_dataset` (``val_data``, ``all_val``).

    Raises:
        DataError: as :func:`etgraph.data.as_dataset`.
    """
    return as_dataset(
        data,
        inputs=model.inputs,
        shapes=shapes,
        task=model.task,
        spec=config.data,
        tokenizer=config.tokenizer,
        val_fraction=config.val_fraction,
        seed=config.seed,
        preprocess=config.preprocess,
        **kwargs,
    )


def _check_memory_profile(config: TrainConfig, memory_profile: MemoryProfile | None) -> None:
    """Raise ConfigError/ProfileMismatchError when the memory model cannot serve the run."""
    if config.memory_mb is not None and memory_profile is None:
        raise ConfigError("--memory-mb needs the model's memory profile: compile with it")
    if memory_profile is not None and memory_profile.frozen_bn != config.frozen_bn:
        raise ProfileMismatchError(
            f"memory profile is of --frozen-bn {memory_profile.frozen_bn}, not "
            f"{config.frozen_bn}: measure it in the run's mode (etgraph.memory_profiler)"
        )


def _check_profile(profile: Profile, model: LoadedModel, config: TrainConfig, shapes) -> None:
    """Raise ProfileMismatchError when ``profile`` is not of this model, batch and shapes."""
    profile.check_matches(
        model.hash, batch_size=config.batch_size, input_shapes=shapes, loss=model.task.loss
    )
    if list(profile.tensors) != model.names:
        raise ProfileMismatchError(
            f"the profile lists {len(profile.tensors)} tensors that differ from the "
            f"{len(model.names)} of {model.source.resolve()}: re-run `etgraph profile` for "
            "this model"
        )


def _steps_per_epoch(dataset, config: TrainConfig) -> int:
    """Training steps per epoch (full batches, capped by ``max_steps_per_epoch``).

    Raises:
        DataError: fewer training examples than one batch.
    """
    steps = dataset.steps_per_epoch(config.batch_size)
    if steps < 1:
        raise DataError(
            f"dataset {dataset.name} has {dataset.n_train} training examples, "
            f"fewer than the batch size {config.batch_size}: add examples (part of them "
            "are held out for validation) or lower --batch-size (compile again at it)"
        )
    if config.max_steps_per_epoch is not None:
        steps = min(steps, config.max_steps_per_epoch)
    return steps
