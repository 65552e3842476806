"""The period controller: importance -> selection -> artifacts -> a training session on the
carried state (paper §4: elastic selection every period; §3.1 Eq. 2; §3.2 Eq. 3).

At each period start :meth:`PeriodController.reselect`:

1. **importance** — first-order importance of every tensor on probe batch(es), from one AdamW
   update of all tensors in a separate session (:mod:`etgraph.importance`; under a memory
   budget chunk by chunk from the state's checkpoint file). The probe batch has
   ``probe_batch_size`` examples (paper §4: 4), in an all-trainable session of its own when
   that is smaller than the run's batch: the pass then costs a fraction of a full step. At the
   run's batch, one all-trainable session serves importance and the reference steps, and
   after the first period the period start takes no pass of its own: the pass after the
   previous period's last step (that period's last reference step where one is due), on the
   all-trainable session brought to the trained tensors' values, left the gradients at
   exactly the carried weights (:meth:`PeriodController.carries_gradients`; on that step's
   training batch instead of a probe batch);
2. **selection** — the DP of Eq. (3) under ``rho * t_full_us`` of the time model, corrected by
   the fit to the steps measured so far (:mod:`etgraph.clock`), or a baseline strategy
   (:data:`etgraph.selection.STRATEGIES`);
3. **artifacts** for the selection (cached by selection: a repeated selection costs nothing);
4. **carried state** — every weight (trainable tensors, frozen tensors, BatchNorm running
   statistics) goes into the new session, with the AdamW moments of the tensors that stay
   selected (newly selected tensors start from zero moments; the step count is global, as in
   TensorFlow/Keras, so bias correction continues), through a checkpoint file in ORT's format
   (:mod:`etgraph.checkpoint`). The session is kept when the selection did not change.

It also owns the run's all-trainable sessions: the importance evaluator's and the session that
times full reference steps (:meth:`reference_session`; one session when importance's batch is
the run's). It knows nothing of run
directories: the files it writes go to the ``work_dir`` it is given.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .artifacts import ArtifactCache, ArtifactPaths
from .checkpoint import CarriedState, checkpoint_bytes, read_checkpoint, write_checkpoint
from .clock import RHO_TOLERANCE, fit_time_model, reference_steps_at
from .config import TrainConfig
from .data import Dataset
from .errors import InfeasibleMemoryError
from .files import transient_file
from .host import peak_rss_mb, release_native_memory, rss_mb
from .importance import SCRATCH_MB, ImportanceEvaluator, gradient_chunks
from .isolation import check_sessions
from .memory import MemoryProfile
from .model import LoadedModel
from .ort_probe import OrtOptions
from .profile import Profile, default_cache_dir
from .selection import IMPORTANCE_STRATEGIES, MemoryCosts, strategy_mask
from .sessions import GradientSession, TrainingSession
from .timing import StepTimeFit

log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_SAVE_COPIES",
    "MEMORY_DP_RESOLUTION",
    "PeriodController",
    "Reselection",
    "probe_seed",
]

#: Copies of the checkpoint file ORT 1.19.2's ``CheckpointState.save_checkpoint`` holds at its
#: peak beside the live session (it builds the whole file in memory): 1.62x and 1.93x measured
#: on ResNet50 128 px (143 and 217 MiB files, moments included); budgeted as 2.
CHECKPOINT_SAVE_COPIES = 2.0

#: DP time resolution T_q under a memory budget when none is given: the 2-D (time x memory)
#: table of the exact 1-us DP is the run's largest allocation there (VGG16 128 px, 2583 MiB
#: budget: the process peaked at 2752 MiB in the DP, 1.6 GB above anything else); with 1000
#: time units it is tens of MiB (issue #17's benchmark setting; times round up, so the time
#: budget still holds).
MEMORY_DP_RESOLUTION = 1000

#: The checkpoint a new selection's session starts from, in the controller's work directory.
SESSION_CHECKPOINT = "session.ckpt"


def probe_seed(seed: int, period: int) -> int:
    """Seed of period ``period``'s probe batches (run seed ``seed``)."""
    return seed * 1000 + 100_000 + period


def memory_log(what: str) -> None:
    """Debug log of this process's resident memory and peak (MiB) after ``what``."""
    log.debug("memory after %s: RSS %.0f MiB, peak %.0f MiB", what, rss_mb(), peak_rss_mb())


@dataclass(frozen=True)
class Reselection:
    """What one period start chose (:meth:`PeriodController.reselect`).

    Attributes:
        session: the training session of the selection (kept if the selection is unchanged).
        mask: the selection mask, bool [N], forward order.
        importance: float64 [N] of this period (None for strategies without importance).
        fit: the time-model correction the selection was budgeted with.
        predicted_peak_mb: the memory model's peak of the selection, MiB (None: no budget).
        timings: seconds of each part (``importance_s``, ``selection_s``, ``artifacts_s``,
            ``session_s``, ``reselection_s``, ``fit_s``) and ``artifacts_cache_hit``.
    """

    session: TrainingSession
    mask: np.ndarray
    importance: np.ndarray | None
    fit: StepTimeFit
    predicted_peak_mb: float | None
    timings: dict


class PeriodController:
    """Chooses each period's selection and opens its training session (module docstring).

    Args:
        model: the loaded model (under a memory budget with placeholder weights).
        profile: the run's time model (in its batch-norm mode).
        config: the run's settings.
        dataset: the run's data (probe batches).
        cache: the artifact cache.
        options: the run's session options (:class:`etgraph.ort_probe.OrtOptions`).
        work_dir: where the session checkpoints and importance's chunk files go.
        threads: ORT intra-op threads.
        memory_profile: the memory model (required under ``config.memory_mb``).

    Raises:
        NativeCrashError: the model's first steps crash ORT (:func:`etgraph.sessions.
            check_sessions`, in a child process, once per model).
    """

    def __init__(
        self,
        model: LoadedModel,
        profile: Profile,
        config: TrainConfig,
        dataset,
        cache: ArtifactCache,
        options: OrtOptions,
        work_dir: Path,
        *,
        threads: int | None,
        memory_profile: MemoryProfile | None = None,
    ):
        self.model, self.profile, self.config = model, profile, config
        self.dataset: Dataset = dataset
        self.cache, self.options, self.work_dir = cache, options, Path(work_dir)
        self.threads = threads
        self.memory_profile = memory_profile
        self.names = model.names
        self.tensors = list(model.tensors)
        self._evaluator: ImportanceEvaluator | None = None
        self._reference: GradientSession | None = None  # full steps measured alike
        self._held: tuple[int, GradientSession, int] | None = None  # (period, session, uses)
        self._startup_peak_mb: float | None = None
        self.last_artifacts_cpu_s = 0.0  # process CPU time of the last artifacts fetched
        if config.memory_mb is None:  # a native crash of ORT: one line (once per model; under
            check_sessions(  # a budget the profile's check stands: no all-trainable weights)
                model,
                config.batch_size,
                model.input_shapes(profile.input_shapes),
                threads=threads,
                frozen_bn=config.frozen_bn,
                cache=cache,
                record_dir=default_cache_dir(),
            )

    @property
    def bounded(self) -> bool:
        """The run is under a memory budget."""
        return self.config.memory_mb is not None

    # -- artifacts and the all-trainable sessions -----------------------------------------------

    def artifacts(
        self, mask: np.ndarray, checkpoint: bool = False
    ) -> tuple[ArtifactPaths, bool, list[str]]:
        """``(paths, cache hit, trainable tensor names)``: the artifacts of selection ``mask``
        (bool [N], forward order) for the run's weight decay, loss and batch-norm mode (their
        graphs, unless ``checkpoint``: sessions start from checkpoints the run writes). A
        selection's graphs are derived from the all-trainable artifacts the run holds anyway
        for importance and the reference steps (:func:`etgraph.artifacts.derive`), not
        generated; not under a memory budget (no all-trainable artifacts there)."""
        trainable, frozen = self.model.split(mask)
        source = None
        if not checkpoint and not self.bounded and not mask.all():
            source = self.full_artifacts_paths()
        paths, hit = self.cache.get(
            self.model.proto,
            trainable,
            frozen,
            weight_decay=self.config.weight_decay,
            loss=self.model.task.loss,
            frozen_bn=self.config.frozen_bn,
            checkpoint=checkpoint,
            source=source,
        )
        return paths, hit, trainable

    def full_artifacts_paths(self) -> ArtifactPaths:
        """The all-trainable artifacts with their checkpoint (:meth:`full_artifacts`)."""
        return self.artifacts(np.ones(len(self.names), dtype=bool), checkpoint=True)[0]

    def full_artifacts(self) -> Path:
        """The directory of the all-trainable artifacts with their checkpoint (importance's,
        the reference steps' and the session-options probe's: one cache entry)."""
        return self.full_artifacts_paths().directory

    @property
    def shared_session(self) -> bool:
        """Importance and the reference steps share one all-trainable session: a strategy
        with importance, whose probe batch is the run's (sessions are static at one batch
        shape; ``TrainConfig.importance_batch_size``)."""
        cfg = self.config
        return cfg.strategy in IMPORTANCE_STRATEGIES and cfg.importance_batch_size == cfg.batch_size

    def probe_batches(self, period: int) -> list:
        """The importance probe batches of ``period``, of ``TrainConfig.importance_batch_size``
        (reproducible from the run seed)."""
        seed = probe_seed(self.config.seed, period)
        return [
            self.dataset.probe_batch(self.config.importance_batch_size, seed + 7919 * i)
            for i in range(self.config.probe_batches)
        ]

    def timing_batch(self) -> tuple:
        """The batch, of the run's batch size, that full steps are timed on and the session
        options are chosen with (reproducible from the run seed)."""
        return self.dataset.probe_batch(self.config.batch_size, probe_seed(self.config.seed, 0))

    def evaluator(self, memory: MemoryCosts | None = None) -> ImportanceEvaluator:
        """The importance evaluator of the run: one all-trainable session built once, or under
        a memory budget (``memory``) chunks whose sessions fit it (re-planned when the budget
        left for them changes)."""
        chunks = None
        if memory is not None:  # no checkpoint is saved while a chunk's session is open
            mp = self.memory_profile
            session_only = dataclasses.replace(
                memory,
                tensor_mb=mp.tensor_mb,
                base_mb=memory.base_mb
                - CHECKPOINT_SAVE_COPIES * mp.weights_mb
                - float(mp.earliest_mb[-1]),
            )
            chunks = gradient_chunks(session_only.peak_mb, len(self.names), memory.budget_mb)
        if self._evaluator is None or self._evaluator.chunks != chunks:
            cache = self.cache
            if not self.shared_session:  # its own all-trainable artifacts at its batch
                probe = (self.config.importance_batch_size, self.cache.static_batch[1])
                cache = ArtifactCache(self.cache.root, static_batch=probe)
            self._evaluator = ImportanceEvaluator(
                self.model.proto,
                self.names,
                list(self.model.running_stats),
                cache,
                weight_decay=self.config.weight_decay,
                threads=self.threads,
                loss=self.model.task.loss,
                input_names=self.model.input_names,
                chunks=chunks,
                config=self.options.config,
                variant=self.config.importance,
            )
            if chunks is not None:
                log.info(
                    "importance in %d chunks of %s tensors under %.0f MiB",
                    len(chunks),
                    "/".join(str(len(c)) for c in chunks),
                    memory.budget_mb,
                )
        return self._evaluator

    def reference_session(self) -> GradientSession:
        """The persistent all-trainable session that measures the reference step: importance's
        own session where the strategy has one at the run's batch (:attr:`shared_session`: one
        all-trainable session, not two), else one on the all-trainable artifacts. Its steps
        run at learning rate 0, so its weights never change and it never diverges (importance
        overwrites them anyway): the cost is any rate's. A fresh session's first step
        allocates its buffers (1.7 s against 1.1 s for the next on MobileNetV2 96 px at batch
        32; the second is still 0-10% slower than later ones): one untimed step warms it,
        unless importance's pass already ran on it; each reference then keeps the faster of
        its two timed steps."""
        if self._reference is None:
            if self.shared_session:
                self._reference = self.evaluator().session()
            else:
                self._reference = GradientSession(
                    self.full_artifacts(),
                    self.threads,
                    input_names=self.model.input_names,
                    config=self.options.config,
                )
            if self._reference.uses == 0:
                self._reference.train_step(*self.timing_batch(), 0.0)
        return self._reference

    def full_steps(
        self,
        epoch: int,
        first_epoch: int,
        end_epoch: int,
        steps_per_epoch: int,
        rho: float,
        records: list[dict],
    ) -> tuple[GradientSession | None, frozenset[int], float, int | None]:
        """The full steps of ``epoch`` in the period of epochs ``[first_epoch, end_epoch)``:
        ``(reference session, reference step positions, seconds opening the session,
        carry_after)`` for :func:`etgraph.steps.train_steps`; none for full training or under
        a memory budget (a full step would not fit it). A period with a next one carries its
        last step's gradients (:attr:`carries_gradients`) and takes its last reference step
        (:func:`etgraph.clock.reference_steps_at`, given the run's ``records``) there."""
        cfg = self.config
        if cfg.strategy == "full" or self.bounded:
            return None, frozenset(), 0.0, None
        carry = end_epoch < cfg.epochs and self.carries_gradients
        t0 = time.perf_counter()
        reference = self.reference_session()  # the first epoch opens it
        setup_s = time.perf_counter() - t0
        reference_at = reference_steps_at(
            epoch,
            first_epoch,
            end_epoch,
            steps_per_epoch,
            cfg.reference_budget,
            rho,
            records,
            end=carry,
        )
        carry_after = steps_per_epoch - 1 if carry and epoch == end_epoch - 1 else None
        return reference, reference_at, setup_s, carry_after

    def full_step_now_s(self, steps: int = 3) -> float:
        """Median wall time (s) of ``steps`` full steps of the (warm) reference session on a
        probe batch: the machine's speed at the start of a deadline run. Under a memory budget
        (no full session fits) the profile's measured full step."""
        if self.bounded:
            return self.profile.measured_full_step_us * 1e-6
        reference = self.reference_session()
        x, y = self.timing_batch()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            reference.train_step(x, y, 0.0)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def use_options(self, changed: bool, winner: GradientSession | None) -> None:
        """Follow a choice of session options (:meth:`etgraph.ort_probe.OrtOptions.choose`):
        the probe's winner becomes the reference session (and importance's, when they share
        one); options changed close the other sessions open with the old ones."""
        config, shared = self.options.config, self.shared_session
        if winner is not None or changed:
            self._reference = None  # open with other options
        if self._evaluator is not None and changed and not (winner is not None and shared):
            self._evaluator.config = config
            self._evaluator.close()
        if winner is not None:
            if shared:  # one session serves both
                self.evaluator().config = config
                self.evaluator().adopt(winner)
            if self.config.strategy != "full":
                self._reference = winner

    def _steps_rho(self, rho: float) -> float:
        """The fraction of the full step the run's steps take (1 under the full strategy)."""
        return 1.0 if self.config.strategy == "full" else rho

    def choose_options(self, rho: float) -> None:
        """Choose the session options at the run's start (:meth:`OrtOptions.choose`)."""
        changed, winner = self.options.choose(
            self._steps_rho(rho),
            self.full_artifacts,
            self.timing_batch(),
            self.model.input_names,
        )
        self.use_options(changed, winner)

    def recheck_options(self, records: list[dict], rho: float) -> bool:
        """Choose the options again if the machine's speed moved (:meth:`OrtOptions.recheck`).
        Returns whether they changed (the training session must be opened again)."""
        changed, winner = self.options.recheck(
            records,
            self.config.period,
            self._steps_rho(rho),
            self.full_artifacts,
            self.timing_batch(),
            self.model.input_names,
        )
        self.use_options(changed, winner)
        return changed

    # -- the next period's importance from the period-end step --------------------------------

    @property
    def on_last_batch(self) -> bool:
        """A period's importance is taken on the previous period's last training batch
        (:meth:`importance`): strategies with importance, on one batch (``probe_batches`` 1)
        of the run's batch size (:attr:`shared_session`)."""
        return self.shared_session and self.config.probe_batches == 1

    @property
    def carries_gradients(self) -> bool:
        """The next period's importance comes from the gradients of a full step on the
        reference session after a period's last step (:func:`etgraph.steps.train_steps`
        ``carry_after``, :meth:`hold_gradients`): :attr:`on_last_batch`, for importance that
        needs gradients, without a memory budget (no all-trainable session there)."""
        return self.on_last_batch and self.config.importance != "random" and not self.bounded

    def hold_gradients(self, period: int) -> None:
        """The reference session now holds the gradients at the carried weights of
        ``period``'s start (the previous period's last step was carried): its importance
        uses them unless anything uses the session first."""
        self._held = (period, self._reference, self._reference.uses)

    def forget_gradients(self) -> None:
        """The carried state changed outside training (weights set, a run restored): the held
        gradients are not at it."""
        self._held = None

    def close(self) -> None:
        """Release the all-trainable sessions (importance's and the reference steps')."""
        self._held = None
        self._reference = None
        if self._evaluator is not None:
            self._evaluator.close()

    # -- memory ---------------------------------------------------------------------------------

    def memory_costs(self) -> MemoryCosts | None:
        """The memory side of this period's selection: the whole run's peak, MiB (the run's
        module docstring, "Under a memory budget"). The memory model (the selection's training
        process), plus this process's resident memory beyond the model's libraries (measured
        now, with no session and no weights held) on its base and start-up floor, plus
        validation's eval session (its arena keeps a forward pass: about ``earliest_mb[-1]``),
        plus saving the period's checkpoint (:data:`CHECKPOINT_SAVE_COPIES` copies of the file:
        every weight, and two AdamW moments per selected parameter). The floor is at least the
        process's start-up peak (loading the model). None without a budget.
        """
        if self.config.memory_mb is None:
            return None
        mp = self.memory_profile
        gc.collect()
        release_native_memory()
        overhead = max(0.0, rss_mb() - mp.import_mb)
        if self._evaluator is None and self.config.strategy in IMPORTANCE_STRATEGIES:
            overhead += SCRATCH_MB  # the evaluator about to be built keeps its scratch
        memory_log(f"release (resident beyond the model's libraries {overhead:.0f} MiB)")
        if self._startup_peak_mb is None:  # what loading the model took, already spent
            self._startup_peak_mb = peak_rss_mb()
        moments_mb = mp.tensor_mb * (8.0 / mp.bytes_per_param)  # 2 float32 moments / param
        # Validation runs the eval session, whose arena keeps a forward pass's activations:
        # about the workspace of training the last tensor alone (forward + one layer back).
        validation_mb = float(mp.earliest_mb[-1])
        return dataclasses.replace(
            MemoryCosts.from_profile(mp, self.config.memory_mb),
            tensor_mb=mp.tensor_mb + CHECKPOINT_SAVE_COPIES * moments_mb,
            base_mb=mp.base_mb + overhead + validation_mb + CHECKPOINT_SAVE_COPIES * mp.weights_mb,
            floor_mb=max(mp.load_mb + overhead, self._startup_peak_mb),
        )

    # -- the period start -----------------------------------------------------------------------

    def importance(
        self,
        period: int,
        carried: CarriedState | Path,
        memory,
        last_batch: Callable[[], tuple] | None = None,
    ) -> np.ndarray | None:
        """This period's importance at the carried weights (None for strategies without it).
        ``carried``: the state, or under a memory budget the checkpoint file holding it.

        Taken on the previous period's last training batch where ``last_batch`` gives it and
        :attr:`on_last_batch`: from the gradients held since that step (:meth:`hold_gradients`)
        or, when none are held (a memory budget, a resumed run, weights set), by a pass on it,
        so every run selects alike; else on the period's probe batches."""
        if self.config.strategy not in IMPORTANCE_STRATEGIES:
            return None
        lr = self.config.learning_rate
        seed = probe_seed(self.config.seed, period)  # the "random" variant's draw
        held, self._held = self._held, None
        if held is not None and isinstance(carried, CarriedState):
            held_period, session, uses = held
            if held_period == period and session is self._reference and session.uses == uses:
                result = self.evaluator().evaluate_held(
                    carried.weights, lr, moments=carried.moments, step=carried.step
                )
                return result.importance
        if last_batch is not None and self.on_last_batch:
            batches = [last_batch()]
        else:
            batches = self.probe_batches(period)
        if isinstance(carried, Path):
            result = self.evaluator(memory).evaluate_checkpoint(
                carried, batches, lr, self.work_dir, seed=seed
            )
        else:
            result = self.evaluator().evaluate(
                carried.weights, batches, lr, moments=carried.moments, step=carried.step, seed=seed
            )
        memory_log("importance")
        return result.importance

    def select(
        self,
        importance: np.ndarray | None,
        fit: StepTimeFit,
        rho: float,
        memory: MemoryCosts | None,
        first_period: bool,
    ) -> tuple[np.ndarray, MemoryCosts | None]:
        """The selection mask of the strategy under ``rho`` with the time model corrected by
        ``fit``, and the memory costs it was taken under. Under a memory budget that the process
        has outgrown since the start, the smallest feasible peak (a warning; the log shows the
        excess) rather than losing the run.

        Raises:
            InfeasibleBudgetError: rho below what the forward pass costs.
            InfeasibleMemoryError: in the first period, no selection fits the memory budget.
        """
        cfg = self.config
        time_model = self.profile
        if fit.observations:
            p = self.profile
            time_model = fit.time_model(p.t_dw_us, p.t_dy_us, p.forward_us, rho)
        resolution = cfg.resolution
        if resolution is None and memory is not None:
            resolution = MEMORY_DP_RESOLUTION

        def select(memory: MemoryCosts | None) -> np.ndarray:
            return strategy_mask(
                cfg.strategy,
                self.tensors,
                time_model,
                rho,
                importance,
                resolution=resolution,
                memory=memory,
                tolerance=RHO_TOLERANCE if fit.observations else 0.0,
            )

        try:
            return select(memory), memory
        except InfeasibleMemoryError as exc:
            if first_period:  # the budget cannot hold from the start: the one-line error
                raise
            log.warning("%s: this period trains at that peak instead", exc)
            memory = dataclasses.replace(memory, budget_mb=exc.min_memory_mb)
            return select(memory), memory

    def open_session(
        self, mask: np.ndarray, carried: CarriedState | Path, config_lr: float
    ) -> tuple[TrainingSession, bool, float]:
        """A training session of selection ``mask`` on the carried state (a checkpoint file
        under a memory budget, rewritten from a view of it). Returns it, whether its artifacts
        were a cache hit, and the seconds the artifacts took."""
        t0, cpu0 = time.perf_counter(), time.process_time()
        paths, cache_hit, trainable = self.artifacts(mask)
        artifacts_s = time.perf_counter() - t0
        self.last_artifacts_cpu_s = time.process_time() - cpu0
        weights = carried.weights if not isinstance(carried, Path) else None
        size = 0
        if weights is not None:
            size = checkpoint_bytes(weights, trainable, optimizer_state=carried.optimizer_state)
        # A transient file ORT reads at once: in RAM where there is room, except under a memory
        # budget; the run's own checkpoint is the durable state.
        with transient_file(SESSION_CHECKPOINT, size, self.work_dir, ram=not self.bounded) as ckpt:
            if weights is None:  # rewritten from a view of the file, then dropped
                state, _, _ = read_checkpoint(carried, copy=False)
                write_checkpoint(
                    ckpt,
                    state,
                    trainable,
                    initial_learning_rate=config_lr,
                    optimizer_state=state.optimizer_state,
                )
                del state
                gc.collect()
                release_native_memory()
                memory_log("the selection's checkpoint")
            else:
                write_checkpoint(
                    ckpt,
                    carried,
                    trainable,
                    initial_learning_rate=config_lr,
                    optimizer_state=carried.optimizer_state,
                    durable=False,
                )
            session = TrainingSession(
                paths.directory,
                ckpt,
                self.threads,
                loss=self.model.task.loss,
                input_names=self.model.input_names,
                config=self.options.config,
                bake=not self.bounded,  # under a memory budget (OrtOptions.given)
                weights=weights,
            )
        memory_log("the training session")
        return session, cache_hit, artifacts_s

    def reselect(
        self,
        period: int,
        carried: CarriedState | Path,
        records: list[dict],
        rho: float,
        session: TrainingSession | None = None,
        mask_prev: np.ndarray | None = None,
        importance_fn=None,
        last_batch: Callable[[], tuple] | None = None,
    ) -> Reselection:
        """Importance -> selection -> artifacts -> session (kept if the mask is unchanged and
        ``session`` is open). ``records``: the run's epochs so far (the fit);
        ``importance_fn``: maps the measured importance to the one the DP maximises
        (:meth:`etgraph.trainer.ElasticTrainer.begin_period`); ``last_batch``: the previous
        period's last training batch (:meth:`importance`). Every part is timed (counted as
        training time; ``artifacts_cpu_s`` is the artifacts' process CPU time).

        Raises:
            InfeasibleBudgetError, InfeasibleMemoryError: as :meth:`select`.
            ModelError: the selection's artifacts cannot be generated.
        """
        cfg = self.config
        t0 = time.perf_counter()
        memory = self.memory_costs()  # under a budget: measured with nothing large held
        importance = self.importance(period, carried, memory, last_batch)
        if importance is not None and importance_fn is not None:
            importance = np.asarray(importance_fn(importance), dtype=np.float64)
        t1 = time.perf_counter()
        fit = fit_time_model(
            records,
            spinning=self.options.config.spinning,
            closed_loop=cfg.closed_loop,
            t_full_us=self.profile.t_full_us,
        )
        fit_s = time.perf_counter() - t1
        mask, memory = self.select(importance, fit, rho, memory, first_period=not records)
        t2 = time.perf_counter()
        cache_hit, artifacts_s, artifacts_cpu_s = None, 0.0, 0.0
        if session is None or mask_prev is None or not np.array_equal(mask, mask_prev):
            session = None  # release the old session before building the new one
            session, cache_hit, artifacts_s = self.open_session(mask, carried, cfg.learning_rate)
            artifacts_cpu_s = self.last_artifacts_cpu_s
        release_native_memory()
        t3 = time.perf_counter()
        timings = {
            "importance_s": t1 - t0,
            "selection_s": t2 - t1,
            "artifacts_s": artifacts_s,
            "artifacts_cpu_s": artifacts_cpu_s,
            "session_s": t3 - t2 - artifacts_s,
            "reselection_s": t3 - t0,
            "artifacts_cache_hit": cache_hit,
            "fit_s": fit_s,
        }
        log.info(
            "period %d: %d/%d tensors selected, predicted step %.0f us, re-selection %.3f s",
            period,
            int(mask.sum()),
            mask.size,
            self.profile.predicted_step_us(mask),
            timings["reselection_s"],
        )
        peak = None if memory is None else memory.peak_mb(mask)
        return Reselection(session, mask, importance, fit, peak, timings)
