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
writes (:mod:`etgraph.rundir`, under its lock) and can be resumed after a kill; without it
everything lives in a private temporary directory removed by :meth:`ElasticTrainer.close`.
The optimizer and the run under a memory budget: docs/architecture.md, "The training loop".

**Determinism.** All randomness derives from the run seed: epoch ``e`` shuffles with
``seed * 1000 + e``, period ``p`` probes with ``seed * 1000 + 100_000 + p``. Same seed, same data
=> the same selections and losses (open loop; the closed loop's selections depend on measured
times); a resumed run continues exactly as the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from . import files, rundir
from .artifact_weights import lazy_initializer_values, placeholder_weights
from .artifacts import ArtifactCache
from .checkpoint import CarriedState, read_checkpoint, write_checkpoint
from .clock import DeadlinePlanner
from .config import TrainConfig, check_run_inputs, load_run_data, steps_per_epoch
from .data import recorded_spec, reloadable
from .errors import ConfigError, DataError, TrainingDivergedError
from .events import Callback, PeriodInfo
from .export import export_trained
from .host import (
    freeze_gc,
    limit_heap_retention,
    peak_rss_mb,
    release_native_memory,
    reset_peak_rss,
)
from .memory import MemoryProfile
from .model import LoadedModel
from .ort_probe import OrtOptions
from .period import PeriodController, memory_log, probe_seed
from .profile import Profile
from .selection import MemoryCosts, check_memory_floor, strategy_mask
from .sessions import TrainingSession
from .steps import cosine_learning_rate, epoch_record, step_seed, train_steps
from .timing import StepTimeFit, min_feasible_rho
from .weights import WeightsAccess, open_only

log = logging.getLogger(__name__)

__all__ = ["ElasticTrainer"]

#: Under a memory budget the run's initial weights go to this file (in the work directory).
INITIAL_CHECKPOINT = "initial.ckpt"


class ElasticTrainer(WeightsAccess):
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
        resuming: the run directory holds the run: nothing is written at the start; the state
            comes from :meth:`restore` (:func:`etgraph.loop.resume_trainer`).

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
        resuming: bool = False,
    ):
        constructed_at = time.perf_counter()  # rho of the whole run counts from here
        config = (config or TrainConfig()).validate()
        if isinstance(data, (str, os.PathLike)):  # a spec: recorded in run.json
            config = dataclasses.replace(config, data=str(data))
            data = None
        if not resuming:  # a resume finds the data from any working directory
            config = dataclasses.replace(
                config, data=recorded_spec(config.data), tokenizer=recorded_spec(config.tokenizer)
            )
        # what config.data does not name ("data", "val_data"): a resume is given it again
        self.data_in_memory = [] if reloadable(data, config.data) else ["data"]
        if val_data is not None:
            self.data_in_memory.append("val_data")
        self.config = config
        self.closed = False
        self.started_at = time.perf_counter() if started_at is None else started_at
        self.progress = progress
        self.callbacks = list(callbacks)
        self.out = Path(out_dir) if out_dir is not None else None
        self._lock = contextlib.ExitStack()  # one process per run directory: its lock, held
        if self.out is not None and not resuming:
            rundir.prepare_run_dir(self.out, (model.source, config.data, config.tokenizer))
        files.sweep_stale_temp_dirs()  # what killed etgraph processes left (as the CLI does)
        self._tmp = None if self.out is not None else files.private_temp_dir("train")
        self.work_dir = self.out / rundir.SESSION_DIR if self._tmp is None else Path(self._tmp.name)
        self.source_model = model
        self.bounded = config.memory_mb is not None
        if self.bounded:  # the weights live in checkpoint files only (module docstring)
            limit_heap_retention()
            params = model.names + list(model.running_stats)
            model = dataclasses.replace(model, proto=placeholder_weights(model.proto, params))
        self.model = model
        self.names = model.names
        self.input_shapes = model.input_shapes(profile.input_shapes)
        check_run_inputs(config, model, profile, self.input_shapes, memory_profile)
        self.profile = profile.for_frozen_bn(config.frozen_bn)  # the run's batch-norm mode
        self.memory_profile = memory_profile
        self.threads = config.threads if config.threads is not None else profile.threads
        self.dataset = load_run_data(config, model, self.input_shapes, data, val_data=val_data)
        self.steps_per_epoch = steps_per_epoch(self.dataset, config)
        self.total_steps = self.steps_per_epoch * config.epochs
        self._build_parts(artifacts_root, constructed_at)
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
        self._pending_timings: dict | None = None  # the period start's, for its first epoch
        self._options_chosen = False
        self.periods_ended = 0  # the next step-driven period's index (a resuming program sets it)
        self._since_set: set[str] = set()  # tensors trained since set_weights
        self._epoch_last_batch: tuple | None = None  # the last epoch's last batch, if trained
        self._stats_at_set: dict[str, np.ndarray] | None = None
        if not resuming:
            if self.deadline is not None:
                self.deadline.check()
            if memory_profile is not None and config.memory_mb is not None:  # the model's floor
                check_memory_floor(MemoryCosts.from_profile(memory_profile, config.memory_mb))
        if self.out is not None:  # everything checked: the run directory is this trainer's
            self._lock.enter_context(files.exclusive_lock(self.out, "--out"))
        with self._released_on_error():
            if not resuming:
                self._carried = self._initial_state()
            if self.out is not None and not resuming:
                from .loop import start_run

                start_run(self, profile)
        # Periods build graphs and sessions, whoever drives them (fit, a program on the API, a
        # federated client): collections then skip the libraries' objects. Without it a
        # client process's full collection took 33-444 ms of CPU, growing with its clients,
        # one inside a round (issue 29; docs/results.md).
        freeze_gc()

    # -- construction helpers -------------------------------------------------------------------

    def _build_parts(self, artifacts_root: str | os.PathLike | None, constructed_at: float) -> None:
        """The parts the run is wired from (docs/architecture.md, "The training loop"): the
        artifact cache, the sessions' options (:class:`OrtOptions`), the period controller
        (:class:`PeriodController`) and the deadline planner, with the smallest feasible rho.
        A deadline counts from ``self.started_at``; rho of the whole run from
        ``constructed_at`` (the trainer's start: a profile measured before it is not part of
        either run)."""
        root = artifacts_root or (
            self.out / rundir.ARTIFACTS_DIR if self.out is not None else self.work_dir / "artifacts"
        )
        self.artifacts_root = Path(artifacts_root) if artifacts_root else None
        # Sessions train at the run's one batch shape, as the profile measured (static shapes:
        # ViT-B/16 128 px steps 1.38x faster); the exported model gets its symbolic batch back.
        self.cache = ArtifactCache(root, static_batch=(self.config.batch_size, self.input_shapes))
        self.options = OrtOptions(
            self.config.spinning,
            bounded=self.bounded,
            threads=self.threads,
            total_steps=self.total_steps,
            deadline_mode=self.config.plans_rho,
        )
        self.controller = PeriodController(
            self.model,
            self.profile,
            self.config,
            self.dataset,
            self.cache,
            self.options,
            self.work_dir,
            threads=self.threads,
            memory_profile=self.memory_profile,
        )
        p = self.profile
        self.floor_rho = min_feasible_rho(p.t_dw_us, p.t_dy_us, p.forward_us, p.t_full_us)
        self.deadline = DeadlinePlanner.for_run(
            self.config,
            started_at=self.started_at if self.config.deadline_s is not None else constructed_at,
            steps_per_epoch=self.steps_per_epoch,
            n_val=self.dataset.n_val,
            floor_rho=self.floor_rho,
            profiled_full_step_s=p.measured_full_step_us * 1e-6,
            full_step_now_s=self.controller.full_step_now_s,
            param_bytes=4 * sum(t.params for t in self.model.tensors),  # float32
        )

    @contextlib.contextmanager
    def _released_on_error(self):
        """Release the run directory's lock when the block fails (the trainer is not made)."""
        try:
            yield
        except BaseException:
            self._lock.close()
            raise

    @open_only
    def restore(self, state: CarriedState | Path | None, epoch: int, records: list[dict]) -> None:
        """Continue from ``state`` (a checkpoint's state, or its file under a memory budget;
        None: the model's initial weights) after ``epoch`` epochs, whose log ``records`` were
        kept (a resumed run). Only between periods.

        Raises:
            ConfigError: a period is in progress.
        """
        if self._period is not None:
            raise ConfigError("restore() between periods only")
        self._carried = self._initial_state() if state is None else state
        self.controller.forget_gradients()
        self._epoch_last_batch = None  # not trained here: built again from the epoch's seed
        if state is not None:
            self.source_model = None
        self._session, self._mask = None, None
        self.records = list(records)
        self.epoch, self.global_step = epoch, epoch * self.steps_per_epoch

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

    @classmethod
    def resume(cls, out_dir: str | os.PathLike, **kwargs) -> ElasticTrainer:
        """The run in the run directory ``out_dir`` at its last checkpoint, ready to
        :meth:`fit` on (:func:`etgraph.loop.resume_trainer`: keyword arguments and errors)."""
        from .loop import resume_trainer

        return resume_trainer(out_dir, **kwargs)

    # -- the whole run --------------------------------------------------------------------------

    @open_only
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

    @open_only
    def begin_period(
        self,
        rho: float | None = None,
        *,
        importance_fn: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> PeriodInfo:
        """Start the period of the next epoch: importance -> selection -> artifacts -> session
        (:meth:`etgraph.period.PeriodController.reselect`). Returns what it chose.

        A program that plans its own budget per period (a federated client under a round's
        deadline, :mod:`etgraph.federated`) passes this period's ``rho``; ``importance_fn``
        maps the importance measured on the probe batch (float64 [N], forward order) to the
        one the DP maximises (e.g. blended with a server's, or restricted to a window of
        tensors by making the others' negative). Periods driven by :meth:`step` alone (no
        epoch ends) are numbered on, so each probes new batches.

        Args:
            rho: this period's step-time ratio in (0, 1] (default: ``config.rho``, or the
                planner's choice: deadline mode, rho of the whole run).
            importance_fn: float64 [N] -> float64 [N] (finite), applied before the DP
                (strategies with importance only).

        Raises:
            ConfigError: a period is already in progress, the run has trained every epoch, or
                ``rho`` is out of range.
            InfeasibleBudgetError, InfeasibleMemoryError: no selection fits the budgets.
        """
        cfg = self.config
        if self._period is not None:
            raise ConfigError(f"period {self._period.period} is in progress: end it first")
        if self.epoch >= cfg.epochs:
            raise ConfigError(f"the run has trained all {cfg.epochs} epochs")
        if rho is not None and not 0.0 < rho <= 1.0:
            raise ConfigError(f"rho must be in (0, 1] (fraction of the full step), got {rho}")
        if not self._options_chosen:  # the sessions' options, measured once at the start
            self.controller.choose_options(rho or self.rho)
            self._options_chosen = True
        carried = self._state_between_periods()
        if rho is not None:
            self.rho = float(rho)
        elif self.deadline is not None:
            self.rho = self.deadline.rho(self.epoch, self.records)
        period = max(self.epoch // cfg.period, self.periods_ended)
        chosen = self.controller.reselect(
            period,
            carried,
            self.records,
            self.rho,
            self._session,
            self._mask,
            importance_fn=importance_fn,
            last_batch=self._last_batch if self.epoch > 0 else None,
        )
        self._session, self._mask, self.fit_model = chosen.session, chosen.mask, chosen.fit
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
            predicted_peak_mb=chosen.predicted_peak_mb
            if chosen.predicted_peak_mb is not None or self.memory_profile is None
            else self.memory_profile.peak_mb(chosen.mask),
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
            # views into the mapped file: importance, the next checkpoint and the baked
            # constants each copy what they need (no whole-state copy per period)
            self._carried, _, _ = read_checkpoint(self.checkpoint_path, copy=False)
            if self.controller.recheck_options(self.records, self.rho):
                self._session = None  # opened again with the new options
        return self._carried

    @open_only
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
        # a run directory's checkpoint survives a crash; the work directory's is gone with it
        self._session.save(self.checkpoint_path, properties, durable=self.out is not None)
        save_s = time.perf_counter() - t0
        log.debug("checkpoint after epoch %d: %.3f s", self.epoch, save_s)
        if self.deadline is not None:
            self.deadline.checkpoint_written(save_s, self.checkpoint_path.stat().st_size)
        self._period = None
        self.periods_ended = info.period + 1
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

    @open_only
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
        reference, reference_at, setup_s, carry_after = self.controller.full_steps(
            epoch, info.first_epoch, info.end_epoch, self.steps_per_epoch, self.rho, self.records
        )

        def diverged(step: int, loss: float, lr: float) -> None:
            self._diverged(epoch, period, step, loss, lr)

        steps = train_steps(
            session,
            self._train_batches(epoch),
            lambda s: cosine_learning_rate(cfg.learning_rate, s, self.total_steps),
            self.global_step,
            seed=cfg.seed,
            reference=reference,
            reference_at=reference_at,
            carry_after=carry_after,
            carry_seed=probe_seed(cfg.seed, period + 1),
            on_nonfinite=diverged,
            progress=f"epoch {epoch + 1}/{cfg.epochs}" if self.progress else None,
            total=self.steps_per_epoch,
        )
        self._epoch_last_batch = steps.last_batch
        if steps.carried:
            self.controller.hold_gradients(period + 1)
        fresh, session.fresh = session.fresh, False
        t_val = time.perf_counter()
        val_loss, val_metric = session.evaluate(self.val_batches(), cfg.batch_size)
        val = (val_loss, val_metric, time.perf_counter() - t_val)
        record = epoch_record(
            steps,
            epoch=epoch,
            period=period,
            fresh_session=fresh,
            mask=self._mask,
            val=val,
            classify=self.model.task.loss == "ce",
            timings=self._pending_timings,
            reference_setup_s=setup_s,
            previous_s=self.records[-1]["cumulative_wall_time_s"] if self.records else 0.0,
            reference="measured"
            if reference is not None
            else ("self" if cfg.strategy == "full" else "none"),
            predicted_step_us=info.predicted_step_us,
            t_full_us=self.profile.t_full_us,
            fit=self.fit_model,
            rho=self.rho,
            peak_rss_mb=peak_rss_mb(),
            predicted_peak_mb=info.predicted_peak_mb,
            ort=self.options.record_fields(),
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

    @open_only
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
        seed = step_seed(self.config.seed, self.global_step)
        loss, _ = self._ensure_session().train_step(inputs, labels, lr, seed=seed)
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

    # -- evaluation and export ------------------------------------------------------------------

    @open_only
    def evaluate(self, data=None) -> tuple[float, float]:
        """``(mean loss, metric)`` of the current weights on ``data`` (default: the validation
        set): accuracy in [0, 1] for loss ce, the MSE for mse. ``data`` as the constructor's
        ``val_data``. Before any period, the last layer's session evaluates.

        Raises:
            DataError: ``data`` does not fit the model.
        """
        cfg = self.config
        batches = self.val_batches()
        if data is not None:
            held = load_run_data(cfg, self.model, self.input_shapes, data, all_val=True)
            batches = held.val_batches(cfg.batch_size)
        if self._mask is None:  # nothing selected yet: the output layer's (cheapest) session
            self._mask = self._cheapest_mask()
        return self._ensure_session().evaluate(batches, cfg.batch_size)

    @open_only
    def export(self, path: str | os.PathLike) -> Path:
        """Write the trained inference model with the current weights, atomically
        (:func:`etgraph.export.export_trained`: the user's interface — symbolic batch, the head
        legalisation took off, the other outputs when one of several was trained, class names
        in ``metadata_props``).

        Returns:
            ``path``.
        """
        ckpt = self._state_file()
        mask = self._mask
        if mask is None:  # the checkpoint's selection (a finished run resumed), else the cheapest
            trained = set(read_checkpoint(ckpt, copy=False, moments=False)[1])
            mask = np.array([n in trained for n in self.names]) if trained else None
        if mask is None:
            mask = self._cheapest_mask()
        paths, _, _ = self.controller.artifacts(mask)
        return export_trained(
            self.model, paths.eval_model, ckpt, Path(path), self.dataset.class_names
        )

    def _cheapest_mask(self) -> np.ndarray:
        """The output layer's selection (:data:`etgraph.selection.STRATEGIES` ``last-layer``):
        what evaluation and export use before any period has selected."""
        return strategy_mask("last-layer", list(self.model.tensors), self.profile, self.rho, None)

    def _finish(self) -> rundir.TrainResult:
        """The run's summary; with a run directory first its end (:func:`etgraph.loop.
        finish_run`: the exported and scored model, plots, ``summary.json``)."""
        cfg = self.config
        inference_acc, trained = float("nan"), ""
        if self.out is not None:
            from .loop import finish_run

            trained, inference_acc = finish_run(self)
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
            head_lr_scale=cfg.head_lr_scale,
            run_rho=self.deadline.run_rho if self.deadline is not None else None,
        )
        if self.out is not None:
            rundir.write_summary(self.out, result)
        return result

    # -- data -----------------------------------------------------------------------------------

    def val_batches(self) -> Iterator:
        """The validation batches (at most ``config.max_val_batches``)."""
        batches = self.dataset.val_batches(self.config.batch_size)
        return itertools.islice(batches, self.config.max_val_batches)

    def _train_batches(self, epoch: int) -> Iterator:
        """Epoch ``epoch``'s shuffled training batches (seed ``seed * 1000 + epoch``)."""
        seed = self.config.seed * 1000 + epoch
        batches = self.dataset.train_batches(self.config.batch_size, seed=seed)
        return itertools.islice(batches, self.steps_per_epoch)

    def _last_batch(self) -> tuple:
        """The last training batch of the epoch before this one (its period's last step): the
        one it trained on, else (a restored run) built again from that epoch's seed."""
        if self._epoch_last_batch is not None:
            return self._epoch_last_batch
        *_, last = self._train_batches(self.epoch - 1)
        return last

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the ORT sessions and the run directory's lock, and remove the private
        temporary directory (a run without a run directory). Training, weights, evaluation
        and export then raise ConfigError (:func:`etgraph.weights.open_only`); closing again
        does nothing."""
        self.closed = True
        self._session = None
        self.controller.close()
        self._lock.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> ElasticTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # the lock and the temporary directory: not later than this
        with contextlib.suppress(Exception):
            self.close()
