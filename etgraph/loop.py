"""The period loop of elastic training on onnxruntime-training (paper §3-§4, the setup of §8).

What ``etgraph train`` runs on the device. Every ``period`` epochs (paper: 3):

1. **importance** — first-order importance of every tensor on probe batch(es), from one AdamW
   update of all tensors in a separate session (:mod:`etgraph.importance`);
2. **selection** — the DP of paper Eq. (3) under ``rho * t_full_us`` (the time model's full
   step) with the profiled ``t_dw_us``/``t_dy_us`` (or a baseline strategy, see
   :data:`etgraph.selection.STRATEGIES`);
3. **artifacts** for the selection (cached by selection, so a repeated selection costs nothing);
4. **carry state** — every weight (trainable tensors, frozen tensors, BatchNorm running
   statistics) goes into the new session, and the AdamW moments of tensors that stay selected
   (newly selected tensors start from zero moments); the AdamW step count is global (ORT keeps one
   optimizer group), as in TensorFlow/Keras, so bias correction continues. The state goes through
   a checkpoint file in ORT's format (:mod:`etgraph.checkpoint`);
5. **train** ``period`` epochs with cosine learning-rate decay set every step
   (:class:`etgraph.sessions.TrainingSession`).

**Session options.** Before the first period the run measures which ORT options its sessions
train fastest with (:meth:`_Run.choose_ort_config`: thread-pool spinning off / on / on with
``force_spinning_stop``, full steps side by side at learning rate 0 on the full artifacts;
``spinning``), and chooses again when the full step measured alike moves by
:data:`REPROBE_FACTOR` (:meth:`_Run.recheck_ort_config`).

**Measured alike, closed loop.** A few full training steps (all tensors, a separate persistent
session on the full artifacts, the same batches and clock) are interleaved with the period's
steps — about ``reference_budget`` (1%) of the period's time, at least one
(:func:`period_reference_positions`) — so that the achieved
rho is an elastic step over a full step measured in the same conditions (``rho_measured`` per
epoch, ``rho_achieved`` in the summary). With ``closed_loop`` (default) every period fits the
time model to those measurements (:func:`etgraph.timing.fit_step_times`: the median of the
epochs' per-step offsets, the load scale from the last epoch; by process CPU time unless the
sessions spin, :func:`fit_clock`) and the DP budgets with the corrected model
(:meth:`etgraph.timing.StepTimeFit.time_model`). ``deadline_s`` chooses rho per period from
the measured progress instead (:meth:`_Run.deadline_rho`). Selections then depend on measured
times: only the open loop (``closed_loop=False``) repeats its selections run to run.

Baselines run through the same loop (same data order, optimizer, schedule, logging), so
comparisons are fair: ``full`` (all tensors), ``last-layer`` (traditional transfer learning: the
output layer), ``bn-bias`` (BatchNorm gamma/beta + all biases + the output layer; TinyTL-style),
``prefix`` and ``topk`` (DP-free selectors under the same budget, :mod:`etgraph.selection`).

**Optimizer.** AdamW (decoupled weight decay, ``w -= lr * wd * w`` each step) with betas
(0.9, 0.999), eps 1e-6 — ORT's training runtime runs only AdamW and momentum-less SGD. The paper
uses SGDW with momentum 0.9 and weight decay 5e-4 for CNNs (Adam for ViT); AdamW normalises each
weight's step by its gradient's running RMS, so its effective step size differs from SGDW's at
the same nominal learning rate. The learning rate follows the paper's cosine decay,
``lr_t = lr * (1 + cos(pi * t / T)) / 2`` over all ``T`` training steps, set each step with
``Optimizer.set_learning_rate`` (ORT's LinearLRScheduler is broken in 1.19.2).

**Under a memory budget** (``memory_mb``, issue #17) the whole process stays within it, not
only the selection's session: at any moment one heavy thing is alive. The model's weights leave
the process at the start (:func:`etgraph.artifacts.placeholder_weights`; they go to a checkpoint
file, written from the model's bytes tensor by tensor), artifacts are generated from the
placeholders (graphs only: every session starts from a checkpoint etgraph writes), and the
state always goes through a file: at a period's end the Module and Optimizer are released and
the state saved, importance runs chunk by chunk with no other session open
(:func:`etgraph.importance.gradient_chunks`), the next session's checkpoint is rewritten from a
mapped view of the file, and the trained model is exported from the checkpoint without a session
(:func:`etgraph.artifacts.export_inference_model`). The selection is budgeted for the run
(:meth:`_Run.memory_costs`: the memory model, the process's own resident memory beyond the
model's libraries measured before every selection, and ORT's checkpoint save,
:data:`CHECKPOINT_SAVE_COPIES`); the DP runs at :data:`MEMORY_DP_RESOLUTION` time units. glibc's
mmap threshold is fixed (:func:`etgraph.host.limit_heap_retention`). No full reference steps are
taken (a full training step does not fit the budget): the loop runs open, ``rho_measured`` is
NaN. ``peak_rss_mb`` in the log is the process's ``VmHWM`` since the end of the previous period
(the first period's includes start-up; a period's checkpoint save counts in the next period's
records), so the largest one is the run's peak.

**Outputs** in the run directory (:mod:`etgraph.rundir`): ``log.jsonl``, ``checkpoint`` (after
every period, atomic), ``model_trained.onnx`` (plain inference model; its ``metadata_props``
hold the class names, :mod:`etgraph.labels`), ``classes.json`` (output index -> label, from the
data), ``curves.png``, ``selection.png``, ``summary.json``, and ``run.json`` + ``profile.json``
for :func:`resume`.

**Determinism.** All randomness derives from the run seed: epoch ``e`` shuffles with
``seed * 1000 + e``, period ``p`` probes with ``seed * 1000 + 100_000 + p``. Same seed, same data
=> same selections and the same losses (to floating-point tolerance); a resumed run continues
exactly as the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from tqdm import tqdm

from passes.onnx import DEFAULT_FROZEN_BN

from .artifacts import (
    ArtifactCache,
    ArtifactPaths,
    check_frozen_bn,
    export_inference_model,
    lazy_initializer_values,
    placeholder_weights,
)
from .checkpoint import CarriedState, read_checkpoint, write_checkpoint
from .data import DEFAULT_PREPROCESS, ArrayDataset, Dataset, Preprocess, load_task_data
from .errors import (
    ConfigError,
    DataError,
    InfeasibleMemoryError,
    ModelError,
    ProfileMismatchError,
    TrainingDivergedError,
)
from .host import (
    freeze_gc,
    limit_heap_retention,
    peak_rss_mb,
    release_native_memory,
    reset_peak_rss,
    rss_mb,
)
from .importance import SCRATCH_MB, ImportanceEvaluator, gradient_chunks
from .labels import save_class_names, set_class_names, stamp_onnx
from .memory import MemoryProfile
from .model import LoadedModel
from .onnx_io import export_with_original_outputs, original_outputs, restore_exported
from .plots import plot_run
from .profile import Profile, default_cache_dir
from .rundir import (
    ARTIFACTS_DIR,
    CHECKPOINT_FILE,
    MEMORY_FILE,
    PROFILE_FILE,
    SESSION_DIR,
    TRAINED_MODEL_FILE,
    EpochRecord,
    TrainResult,
    append_log,
    checkpoint_properties,
    prepare_run_dir,
    read_run_checkpoint,
    read_run_file,
    read_run_task,
    remove_temporaries,
    start_log,
    summarize,
    truncate_log,
    write_run_file,
    write_summary,
)
from .selection import (
    BUDGETED_STRATEGIES,
    IMPORTANCE_STRATEGIES,
    STRATEGIES,
    MemoryCosts,
    check_memory_floor,
    strategy_mask,
)
from .sessions import (
    TRAIN_CANDIDATES,
    ConfigChoice,
    GradientSession,
    TrainingSession,
    check_sessions,
    choose_train_config,
    evaluate_onnx,
)
from .timing import StepTimeFit, fit_step_times, min_feasible_rho

log = logging.getLogger(__name__)

__all__ = ["TrainConfig", "cosine_learning_rate", "load_run_data", "resume", "train"]


# ---- configuration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (paper §8 defaults: 12 epochs, batch 4, lr 1e-4).

    Attributes:
        epochs: training epochs (> 0).
        batch_size: examples per step (> 0); must match the profile's batch size.
        learning_rate: peak AdamW learning rate (> 0), decayed by a cosine over all steps.
        weight_decay: AdamW decoupled weight decay (>= 0).
        rho: requested step time as a fraction of full training's, in (0, 1].
        period: epochs between re-selections (> 0; paper: 3).
        strategy: one of :data:`etgraph.selection.STRATEGIES`.
        seed: run seed (data order, probe batches, train/val split).
        data: dataset spec for :func:`etgraph.data.load_task_data` (None = embedded digits
            task).
        tokenizer: the model's ``tokenizer.json`` for text data (``data`` a .csv/.jsonl file).
        val_fraction: fraction of each class held out for validation.
        probe_batches: probe batches per importance evaluation (paper: one batch of 4).
        max_steps_per_epoch: cap on training steps per epoch (None = the whole training set);
            for quick runs on a subsample.
        max_val_batches: cap on validation batches (None = the whole validation set).
        resolution: DP time resolution T_q (None = 1-µs units, exact).
        threads: ORT intra-op threads (None = ORT's default); use the profile's setting.
        frozen_bn: how a batch norm whose gamma and beta are both unselected runs:
            ``"inference"`` (running statistics used and kept) or ``"train"`` (batch
            statistics; running statistics updated) — :mod:`etgraph.artifacts`.
        preprocess: the model's input normalisation for image-folder data
            (:class:`etgraph.data.Preprocess`; the embedded digits keep their own).
        closed_loop: re-fit the time model to the measured steps every period and select with
            the corrected model (selections then vary with the machine's timing).
        reference_budget: share of each period's elastic step time spent on full reference
            steps, in (0, 1] (at least one per period); more = a less noisy achieved rho and fit.
        deadline_s: finish the run (training, validation, export) within this many seconds
            of its start, choosing rho per period from the measured progress
            (:meth:`_Run.deadline_rho`; ``rho`` is then not used).
            Budgeted strategies only. None = a fixed ``rho``.
        memory_mb: peak-memory budget, MiB (issue #17; ``elastic`` only): the DP selects under
            it with the run's memory model (:class:`etgraph.memory.MemoryProfile`), and the log
            records the predicted peak beside the measured one. None = time budget only.
        spinning: the ORT session options the run trains with: ``"auto"`` measures the
            candidates of :data:`etgraph.sessions.TRAIN_CANDIDATES` at the start
            (:func:`etgraph.sessions.choose_train_config`, on the full artifacts at learning
            rate 0) and keeps the fastest; or a candidate's label (``"off"``, ``"on"``,
            ``"on+stop"``), not measured. Under ``memory_mb`` ``"auto"`` means ``"off"`` (the
            probe would hold two all-trainable sessions at once).
    """

    epochs: int = 12
    batch_size: int = 4
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    rho: float = 0.5
    period: int = 3
    strategy: str = "elastic"
    seed: int = 0
    data: str | None = None
    tokenizer: str | None = None
    val_fraction: float = 0.2
    probe_batches: int = 1
    max_steps_per_epoch: int | None = None
    max_val_batches: int | None = None
    resolution: int | None = None
    threads: int | None = None
    frozen_bn: str = DEFAULT_FROZEN_BN
    preprocess: Preprocess = DEFAULT_PREPROCESS
    closed_loop: bool = True
    reference_budget: float = 0.01
    deadline_s: float | None = None
    memory_mb: float | None = None
    spinning: str = "auto"

    def validate(self) -> TrainConfig:
        """Return self if every field is in range; raise ConfigError naming the bad option."""
        positive = {
            "epochs": self.epochs,
            "batch size": self.batch_size,
            "period": self.period,
            "probe batches": self.probe_batches,
        }
        for name, value in positive.items():
            if int(value) != value or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value}")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning rate must be positive, got {self.learning_rate}")
        if not self.weight_decay >= 0:
            raise ConfigError(f"weight decay must be >= 0, got {self.weight_decay}")
        if not (0.0 < self.rho <= 1.0):
            raise ConfigError(
                f"rho must be in (0, 1] (fraction of the full step time), got {self.rho}"
            )
        check_frozen_bn(self.frozen_bn)
        if not (0.0 < self.reference_budget <= 1.0):
            raise ConfigError(f"reference budget must be in (0, 1], got {self.reference_budget}")
        if self.deadline_s is not None:
            if not self.deadline_s > 0:
                raise ConfigError(f"deadline must be positive, got {self.deadline_s} s")
            if self.strategy not in BUDGETED_STRATEGIES:
                raise ConfigError(
                    f"--deadline chooses rho, which strategy {self.strategy!r} ignores: use "
                    f"one of {', '.join(BUDGETED_STRATEGIES)}"
                )
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}"
            )
        if self.memory_mb is not None and not (
            0 < self.memory_mb < math.inf and self.strategy == "elastic"
        ):
            raise ConfigError(
                f"--memory-mb must be positive and used with the elastic strategy, got "
                f"{self.memory_mb} with {self.strategy!r}"
            )
        if self.spinning != "auto" and self.spinning not in TRAIN_CANDIDATES:
            raise ConfigError(
                f"unknown spinning setting {self.spinning!r}: choose auto or one of "
                f"{', '.join(TRAIN_CANDIDATES)}"
            )
        for name in ("max_steps_per_epoch", "max_val_batches", "resolution", "threads"):
            value = getattr(self, name)
            if value is not None and (int(value) != value or value < 1):
                raise ConfigError(
                    f"{name.replace('_', ' ')} must be a positive integer, got {value}"
                )
        return self

    def to_json(self) -> dict:
        """The settings as a JSON-ready dict (``run.json``)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TrainConfig:
        """Inverse of :meth:`to_json`, validated.

        Raises:
            TypeError: an unknown or missing field. ConfigError: as :meth:`validate`.
        """
        data = dict(data)
        if isinstance(data.get("preprocess"), dict):
            data["preprocess"] = Preprocess.from_json(data["preprocess"])
        return cls(**data).validate()

    def digest(self) -> str:
        """Stable 16-hex-digit hash of the configuration (stored in checkpoints).

        Only the fields that differ from their defaults are hashed, so a field added later
        with a default leaves the digests of earlier runs unchanged: they still resume.
        """
        default = type(self)().to_json()
        changed = {k: v for k, v in self.to_json().items() if v != default[k]}
        return hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:16]


def cosine_learning_rate(base_lr: float, step: int, total_steps: int) -> float:
    """Cosine-decayed learning rate at ``step`` of ``total_steps`` (paper §8, TF CosineDecay).

    ``base_lr * (1 + cos(pi * step / total_steps)) / 2``; ``step`` is clamped to
    ``[0, total_steps]``.
    """
    if total_steps <= 0:
        return float(base_lr)
    t = min(max(step, 0), total_steps) / total_steps
    return float(base_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


# ---- the run --------------------------------------------------------------------------------


def spins(label: str) -> bool:
    """Whether the sessions of a logged ``ort_config`` label spun (unknown labels: no)."""
    config = TRAIN_CANDIDATES.get(label)
    return bool(config is not None and config.spinning)


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


def fit_clock(spinning: bool) -> str:
    """The measurements the closed loop fits, by the run's sessions' spinning: ``"_cpu"`` =
    process CPU time (every thread of the process) when their pool threads do not spin (CPU
    time is then work, not waiting), ``""`` = wall time when they spin (a spinning thread's CPU
    time is waiting). On a machine shared with other work the wall time of one reference step
    swings 2x with the neighbours' load, its CPU time by a few % (README, "Closed loop"); on a
    quiet device, where spinning wins (:func:`etgraph.sessions.choose_train_config`), they
    agree."""
    return "" if spinning else "_cpu"


#: Share of a run's step time the start-of-run probe of session options may take
#: (:meth:`_Run.choose_ort_config`; at least 3 rounds).
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

#: Seconds the end of a run takes besides scoring the exported model (export, plots, summary,
#: the interpreter's exit with ORT and torch loaded) at the profile's speed, which deadline mode
#: keeps free at the end, times the machine's slowdown since (the full step measured now over
#: the profile's, at least 1). Measured on the default model: 0.4 s to the summary (plots 0.35
#: s) and 0.15-0.3 s of exit on a quiet machine; 2-4 s of exit alone at load 7-11, where steps
#: ran 3-5x slower than profiled. A fixed 2.5 s (until session 7) ended quiet runs 12-34% early.
FINISH_S = 0.6

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

#: Once the closed loop has corrected the time model with measured steps, rho is a target
#: within this fraction, not only a ceiling (:func:`etgraph.selection.select_for_rho`
#: ``tolerance``; issue #16's target band): on a model of few tensors the selection nearest rho
#: may lie just above it. Not with the profile's model alone: VGG16 at 128 px, whose profile
#: under-predicts its selections by ~6%, then ran the selection taken above rho at 1.10x.
RHO_TOLERANCE = 0.05

#: Full steps before each reference step's last: the elastic steps around it have warm caches,
#: and so would full training's. All are timed and the reference is the fastest: the first
#: after elastic steps is ~5% slower, but one full step can also be stalled by a neighbour (a
#: 263 ms reference among 191-197 ms ones on ResNet50 at 128 px, quiet machine, made its
#: period 28% off), and the minimum of two keeps that period within ~5%.
REFERENCE_WARMUP = 1


def reference_positions(steps: int, count: int) -> frozenset[int]:
    """Indices (0-based) of the ``count`` steps of an epoch of ``steps`` after which a reference
    step runs: spread evenly, never after step 0 (a fresh session's first step) unless the
    epoch has one step."""
    if steps <= 1:
        return frozenset([0])
    count = min(count, steps - 1)
    return frozenset(1 + int((j + 0.5) * (steps - 1) / count) for j in range(count))


def period_reference_positions(
    steps_per_epoch: int, epochs: int, budget: float, rho: float
) -> list[frozenset[int]]:
    """Per epoch of a period, the steps (0-based) after which a full reference step runs.

    Counted over the period, not per epoch: ``budget`` of the period's elastic step time (a
    reference step costs ``1 + REFERENCE_WARMUP`` full steps, a full step about ``1 / rho``
    elastic ones), at least one per period, spread evenly over the period's steps
    (:func:`reference_positions`), so an epoch may have none. On the default model's 179-step
    epochs at period 3 and rho 0.5 that is one per period, about 0.75% of its time (one per
    epoch was 2.1-2.5%).

    Args:
        steps_per_epoch: >= 1. epochs: epochs in the period, >= 1. budget: fraction in (0, 1].
        rho: the period's requested rho, in (0, 1].
    """
    steps = steps_per_epoch * epochs
    count = max(1, int(budget * rho * steps / (1 + REFERENCE_WARMUP)))
    out: list[set[int]] = [set() for _ in range(epochs)]
    for i in reference_positions(steps, count):
        out[i // steps_per_epoch].add(i % steps_per_epoch)
    return [frozenset(s) for s in out]


def reference_ratio(
    step_times: list[float], reference_times: list[tuple[int, float]], first: int = 0
) -> float:
    """Elastic over full step, measured alike: for each reference step (taken after elastic
    step ``i``), the median of the elastic steps around it (``i-4 .. i`` and ``i+2 .. i+6``:
    the step right after it pays for the switch of sessions) over its time; the median over the
    epoch's reference steps. Load drift slower than a few steps cancels. NaN without any.

    Args:
        step_times: the epoch's elastic step times (s), in order.
        reference_times: ``(i, seconds)`` per timed reference step.
        first: elastic steps before this index are not used (a fresh session's first step).
    """
    ratios = []
    for i, ref in reference_times:
        window = [j for j in (*range(i - 4, i + 1), *range(i + 2, i + 7)) if first <= j]
        local = [step_times[j] for j in window if j < len(step_times)]
        if local and ref > 0:
            ratios.append(float(np.median(local)) / ref)
    return float(np.median(ratios)) if ratios else float("nan")


def _memory_log(what: str) -> None:
    """Debug log of this process's resident memory and peak (MiB) after ``what``."""
    log.debug("memory after %s: RSS %.0f MiB, peak %.0f MiB", what, rss_mb(), peak_rss_mb())


def _file_mb(path: Path) -> float:
    return path.stat().st_size / float(1 << 20)


def _epoch_seed(seed: int, epoch: int) -> int:
    return seed * 1000 + epoch


def _probe_seed(seed: int, period: int) -> int:
    return seed * 1000 + 100_000 + period


def load_run_data(
    config: TrainConfig, model: LoadedModel, shapes: dict[str, tuple[int, ...]]
) -> Dataset | ArrayDataset:
    """The run's data (``config.data``, ``tokenizer``, split, preprocessing) for ``model`` at
    its per-example input ``shapes`` (:func:`etgraph.data.load_task_data`).

    Raises:
        DataError: as :func:`etgraph.data.load_task_data`.
    """
    return load_task_data(
        config.data,
        inputs=model.inputs,
        shapes=shapes,
        task=model.task,
        tokenizer=config.tokenizer,
        val_fraction=config.val_fraction,
        seed=config.seed,
        preprocess=config.preprocess,
    )


class _Run:
    """State of one run (see :func:`train`); built fresh or from a run directory.

    Raises:
        ProfileMismatchError: the profile is of another model, batch size or input shape.
        DataError, ModelError: the data cannot be used with the model.
    """

    def __init__(
        self,
        model: LoadedModel,
        profile: Profile,
        config: TrainConfig,
        out_dir: Path,
        *,
        artifacts_root: Path | None,
        progress: bool,
        memory_profile: MemoryProfile | None = None,
        dataset: Dataset | ArrayDataset | None = None,
    ):
        self.config = config.validate()
        if config.memory_mb is not None and memory_profile is None:
            raise ConfigError("--memory-mb needs the model's memory profile: compile with it")
        if memory_profile is not None and memory_profile.frozen_bn != config.frozen_bn:
            raise ProfileMismatchError(
                f"memory profile is of --frozen-bn {memory_profile.frozen_bn}, not "
                f"{config.frozen_bn}: measure it in the run's mode (etgraph.memory_profiler)"
            )
        self.memory_profile = memory_profile
        self.bounded = config.memory_mb is not None  # the whole run under a memory budget
        self.out = out_dir
        self.progress = progress
        self.model = model
        if self.bounded:  # the weights live in checkpoint files only (module docstring)
            limit_heap_retention()
            params = model.names + list(model.running_stats)
            self.model = dataclasses.replace(model, proto=placeholder_weights(model.proto, params))
        self.input_shapes = model.input_shapes(profile.input_shapes)
        self.tensors = list(model.tensors)
        self.names = model.names
        profile.check_matches(
            model.hash,
            batch_size=config.batch_size,
            input_shapes=self.input_shapes,
            loss=model.task.loss,
        )
        if list(profile.tensors) != self.names:
            raise ProfileMismatchError(
                f"the profile lists {len(profile.tensors)} tensors that differ from the "
                f"{len(self.names)} of {model.source.resolve()}: re-run `etgraph profile` for "
                "this model"
            )
        # The time model of this run's batch-norm mode (the profile measured both).
        self.profile = profile.for_frozen_bn(config.frozen_bn)
        # Train with the thread count the timings were measured with, unless told otherwise.
        self.threads = config.threads if config.threads is not None else profile.threads
        # No preloading of onnxruntime.training: the training wheel's `import onnxruntime`
        # (etgraph.sessions) already imports it and torch, so period 0 does not pay for it.
        self.dataset = (
            dataset if dataset is not None else load_run_data(config, model, self.input_shapes)
        )
        steps = self.dataset.steps_per_epoch(config.batch_size)
        if steps < 1:
            raise DataError(
                f"dataset {self.dataset.name} has {self.dataset.n_train} training examples, "
                f"fewer than the batch size {config.batch_size}: add examples (part of them "
                "are held out for validation) or lower --batch-size (compile again at it)"
            )
        if config.max_steps_per_epoch is not None:
            steps = min(steps, config.max_steps_per_epoch)
        self.steps_per_epoch = steps
        self.total_steps = steps * config.epochs
        # Sessions train at the run's one batch shape (training batches are full, validation
        # pads), as the profile measured: static shapes let ORT fold the shape arithmetic
        # (ViT-B/16 at 128 px: full step 511 vs 697 ms with a symbolic batch; MobileNetV2 the
        # same). The exported model gets its symbolic batch back (_finish).
        self.cache = ArtifactCache(
            artifacts_root or out_dir / ARTIFACTS_DIR,
            static_batch=(config.batch_size, self.input_shapes),
        )
        self._evaluator = None
        self._reference: GradientSession | None = None  # full steps measured alike
        self.fit = StepTimeFit()
        self._predicted_peak_mb: float | None = None  # the run's, under a memory budget
        self._startup_peak_mb: float | None = None
        # The training sessions' options: measured at the start of run() unless given.
        label = "off" if config.spinning == "auto" else config.spinning
        self.ort = self._given(label)
        self._probe_s = 0.0  # the probe's time, charged to the next epoch trained
        self._ort_pending = False  # the choice is logged with the next epoch
        self._ort_base_ms: float | None = None  # the full step (ms) when it was chosen
        self.rho = config.rho  # this period's requested rho (deadline mode chooses it)
        self.started_at = time.perf_counter()  # the deadline counts from here (or the CLI's)
        p = profile
        self.floor_rho = min_feasible_rho(p.t_dw_us, p.t_dy_us, p.forward_us, p.t_full_us)

    # -- pieces ------------------------------------------------------------------------------

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
            self._evaluator = ImportanceEvaluator(
                self.model.proto,
                self.names,
                list(self.model.running_stats),
                self.cache,
                weight_decay=self.config.weight_decay,
                threads=self.threads,
                loss=self.model.task.loss,
                input_names=self.model.input_names,
                chunks=chunks,
                config=self.ort.config,
            )
            if chunks is not None:
                log.info(
                    "importance in %d chunks of %s tensors under %.0f MiB",
                    len(chunks),
                    "/".join(str(len(c)) for c in chunks),
                    memory.budget_mb,
                )
        return self._evaluator

    def memory_costs(self) -> MemoryCosts | None:
        """The memory side of this period's selection: the whole run's peak (module
        docstring), MiB. The memory model (the selection's training process), plus this
        process's resident memory beyond the model's libraries (measured now, with no session
        and no weights held) on its base and start-up floor, plus validation's eval session
        (its arena keeps a forward pass: about ``earliest_mb[-1]``), plus saving the period's
        checkpoint (:data:`CHECKPOINT_SAVE_COPIES` copies of the file: every weight, and two
        AdamW moments per selected parameter). The floor is at least the process's start-up
        peak (loading the model). None without a budget.
        """
        if self.config.memory_mb is None:
            return None
        mp = self.memory_profile
        gc.collect()
        release_native_memory()
        overhead = max(0.0, rss_mb() - mp.import_mb)
        if self._evaluator is None and self.config.strategy in IMPORTANCE_STRATEGIES:
            overhead += SCRATCH_MB  # the evaluator about to be built keeps its scratch
        _memory_log(f"release (resident beyond the model's libraries {overhead:.0f} MiB)")
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

    def val_batches(self) -> Iterator:
        batches = self.dataset.val_batches(self.config.batch_size)
        limit = self.config.max_val_batches
        for i, batch in enumerate(batches):
            if limit is not None and i >= limit:
                return
            yield batch

    def train_batches(self, epoch: int) -> Iterator:
        batches = self.dataset.train_batches(
            self.config.batch_size, seed=_epoch_seed(self.config.seed, epoch)
        )
        for i, batch in enumerate(batches):
            if i >= self.steps_per_epoch:
                return
            yield batch

    def artifacts(
        self, mask: np.ndarray, checkpoint: bool = False
    ) -> tuple[ArtifactPaths, bool, list[str]]:
        """``(paths, cache hit, trainable tensor names)``: the artifacts of selection ``mask``
        (bool [N], forward order) for the run's weight decay, loss and batch-norm mode (their
        graphs, unless ``checkpoint``: sessions start from checkpoints the run writes)."""
        trainable, frozen = self.model.split(mask)
        paths, hit = self.cache.get(
            self.model.proto,
            trainable,
            frozen,
            weight_decay=self.config.weight_decay,
            loss=self.model.task.loss,
            frozen_bn=self.config.frozen_bn,
            checkpoint=checkpoint,
        )
        return paths, hit, trainable

    def predicted_step_us(self, mask: np.ndarray) -> float:
        return self.profile.predicted_step_us(mask)

    def reference_session(self) -> GradientSession:
        """The persistent all-trainable session that measures the reference step: importance's
        own session where the strategy has one (one all-trainable session, not two), else one
        on the same artifacts. Its steps run at learning rate 0, so its weights never change and
        it never diverges (importance overwrites them anyway): the cost is any rate's."""
        if self._reference is None:
            if self.config.strategy in IMPORTANCE_STRATEGIES:
                self._reference = self.evaluator().session()
            else:
                paths, _, _ = self.artifacts(np.ones(len(self.names), dtype=bool), checkpoint=True)
                self._reference = GradientSession(
                    paths.directory,
                    self.threads,
                    input_names=self.model.input_names,
                    config=self.ort.config,
                )
            batch = self.dataset.probe_batch(
                self.config.batch_size, _probe_seed(self.config.seed, 0)
            )
            for _ in range(2):  # a fresh session's first steps allocate its buffers
                self._reference.train_step(*batch, 0.0)
        return self._reference

    def deadline_rho(self, epoch: int, records: list[dict]) -> float:
        """The rho of the period starting at ``epoch`` (0-based) that ends the run at the deadline.

        The time left, ``deadline_s - elapsed - end`` (``end``: scoring and exporting the
        model, estimated as one validation pass plus :data:`FINISH_S` times the slowdown), is
        spent on ``E`` epochs of ``S`` steps: ``E * fixed + E * S * rho * u``. From the last
        period's epochs (measured progress, the machine's load included): ``u`` = mean step /
        the rho it was asked for (s per unit of rho), ``fixed`` = an epoch's wall time outside
        its steps (re-selection, reference steps, validation; not the one-off choice of
        session options). Before any epoch: ``u`` = the profile's full step measured now
        (:meth:`_full_step_now_s`), ``fixed`` = a validation pass at a third of a full step
        per batch. Clamped to [the cheapest selection's rho, 1].
        """
        cfg = self.config
        epochs_left = cfg.epochs - epoch
        left_s = cfg.deadline_s - (time.perf_counter() - self.started_at)
        last = records[-min(cfg.period, len(records)) :] if records else []
        if last:
            u = float(np.mean([r["measured_step_us"] / r["rho_requested"] for r in last])) * 1e-6
            fixed = float(
                np.mean(
                    [
                        r["wall_time_s"]
                        - r.get("ort_probe_s", 0.0)  # one-off, not per epoch
                        + r["val_s"]
                        - r["steps"] * r["measured_step_us"] * 1e-6
                        for r in last
                    ]
                )
            )
            full_us = last[-1].get("reference_step_us", float("nan"))  # measured alike
            end = last[-1]["val_s"] + FINISH_S * self._slowdown(full_us * 1e-6)
        else:  # nothing trained yet: full steps now, and validation at a third of one per batch
            u = self._full_step_now_s()
            fixed, end = self._untrained_epoch_costs_s(u)
        steps = epochs_left * self.steps_per_epoch
        rho = (left_s - end - epochs_left * fixed) / (steps * u) if u > 0 else 1.0
        chosen = float(min(1.0, max(rho, self.floor_rho * 1.02)))
        log.info("deadline: %.1f s left for %d epochs -> rho %.3f", left_s, epochs_left, chosen)
        return chosen

    def _untrained_epoch_costs_s(self, full_step_s: float) -> tuple[float, float]:
        """``(fixed, end)`` of :meth:`deadline_rho` before any epoch has run: an epoch's time
        outside its steps (a validation pass at a third of a full step per batch) and the end
        of the run (one more validation pass, and :data:`FINISH_S` times the slowdown), s."""
        val_batches = math.ceil(self.dataset.n_val / self.config.batch_size)
        if self.config.max_val_batches is not None:
            val_batches = min(val_batches, self.config.max_val_batches)
        fixed = val_batches * full_step_s / 3
        return fixed, fixed + FINISH_S * self._slowdown(full_step_s)

    def _slowdown(self, full_step_s: float) -> float:
        """How much slower than profiled the machine runs: a full step measured now (s) over
        the profile's, at least 1 (1 when not measured)."""
        ratio = full_step_s / (self.profile.measured_full_step_us * 1e-6)
        return max(1.0, ratio) if math.isfinite(ratio) else 1.0

    def _full_step_now_s(self, steps: int = 3) -> float:
        """Median wall time (s) of ``steps`` full steps of the (warm) reference session on a
        probe batch: the machine's speed at the start of a deadline run. Under a memory budget
        (no full session fits) the profile's measured full step."""
        if self.bounded:
            return self.profile.measured_full_step_us * 1e-6
        reference = self.reference_session()
        x, y = self.dataset.probe_batch(self.config.batch_size, _probe_seed(self.config.seed, 0))
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            reference.train_step(x, y, 0.0)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def check_deadline(self) -> None:
        """Raise ConfigError at the start when even the cheapest selection cannot finish in time.

        Raises:
            ConfigError: names the shortest feasible deadline: the time already spent, the
                cheapest selection's steps at the profile's measured full step, and the epochs'
                and the end's other costs as :meth:`deadline_rho` plans them.
        """
        cfg = self.config
        if cfg.deadline_s is None:
            return
        elapsed = time.perf_counter() - self.started_at
        full_step_s = self.profile.measured_full_step_us * 1e-6
        fixed, end = self._untrained_epoch_costs_s(full_step_s)
        need = elapsed + self.total_steps * self.floor_rho * full_step_s + cfg.epochs * fixed + end
        if cfg.deadline_s < need:
            raise ConfigError(
                f"deadline {cfg.deadline_s:g} s cannot be met: even the cheapest selection "
                f"(rho {self.floor_rho:.2f}) needs about {math.ceil(need)} s for "
                f"{self.total_steps} steps on this device: give --deadline {math.ceil(need)}s "
                "or more, or fewer --epochs"
            )

    def _given(self, label: str, note: str = "") -> ConfigChoice:
        """The candidate ``label`` without a probe; under a memory budget on per-session arenas,
        without the memory pattern and without baking (:meth:`_session`). The shared arena
        keeps what a released session freed and baking holds the frozen weights twice:
        measured on ResNet50 128 px under a 718 MiB budget, the whole run peaked at 1094 MiB
        with both, 873 without baking, 673 without either. A per-session arena grows again on
        the second step to fit the memory pattern's block (README, "The memory model"), which
        the memory model (measured on the shared arena) does not hold: MobileNetV2 at 447 MiB
        peaked at 478 MiB with the pattern, 446 without."""
        choice = ConfigChoice.given(label, note)
        if not self.bounded:
            return choice
        config = dataclasses.replace(choice.config, shared_arena=False, mem_pattern=False)
        return dataclasses.replace(choice, config=config)

    def choose_ort_config(self, slowdown: float | None = None) -> bool:
        """Measure which options the run's sessions train fastest with (``spinning="auto"``):
        :func:`etgraph.sessions.choose_train_config` on the full artifacts (the reference
        steps' and importance's, so nothing more is generated), on a probe batch at learning
        rate 0. Rounds: what :data:`PROBE_BUDGET` of the run's steps allows, 3 to
        :data:`PROBE_ROUNDS`. The winner's session becomes the full reference session (and
        importance's), so only the losers' cost is extra; the probe's time is charged to the
        next epoch's wall time (``ort_probe_s``). Not probed (spinning off) under ``memory_mb``
        (two all-trainable sessions at once) or at a load average of
        :data:`PROBE_MAX_LOAD_PER_CORE` per core or more; in a run too short to pay for it
        (:data:`PROBE_COST_FULL_STEPS` above :data:`PROBE_BUDGET` of its steps) below that load,
        :data:`QUIET_CANDIDATE` without a probe — unless this is a re-check because the full
        step became ``slowdown`` (> 1) times slower: other work started, and the 1-minute load
        average lags it (a CPU hog started 20 s before read as 1.4 on 2 cores), so spinning
        off. Returns whether the options changed (the training session must then be opened
        again)."""
        cfg = self.config
        if cfg.spinning != "auto":
            return False
        before = self.ort.label
        note, label = "", "off"
        cores = len(os.sched_getaffinity(0))
        load = os.getloadavg()[0]
        if self.ort.config.spinning:  # the run's own spinning pool threads count as load
            load = max(0.0, load - ((self.threads or cores) - 1))
        if cfg.memory_mb is not None:
            note = "not probed under --memory-mb"
        elif load >= PROBE_MAX_LOAD_PER_CORE * cores:
            note = f"not probed: load average {load:.1f} (other work) >= {cores} cores"
        elif PROBE_BUDGET * self.total_steps * self.rho < PROBE_COST_FULL_STEPS:
            at = f"rho {self.rho:.2f}" + (
                " (deadline mode: the probe's estimate, before rho is chosen)"
                if cfg.deadline_s is not None
                else ""
            )
            note = (
                f"not probed: {self.total_steps} steps at {at} are too few to pay "
                f"for it (about {PROBE_COST_FULL_STEPS} full steps); "
            )
            if slowdown is not None and slowdown > 1:
                note += f"the full step is {slowdown:.1f}x slower than at the last choice"
            else:
                # Below the load gate the machine is quiet: take what won there in every role,
                # round robin included (docs/results.md, "ORT session options": on + stop
                # 0.80-0.94x of off at load 0.3-1.7; 0.78x in the loop at load 1.5).
                label = QUIET_CANDIDATE
                note += f"load average {load:.1f} < {cores} cores: the quiet-machine choice"
        if note:
            self.ort = self._given(label, note)
            self._ort_base_ms = None  # the speed to watch: the first period's full step
            self._ort_pending = True
            log.info("session options: spinning %s (%s)", label, note)
            if before != label:  # sessions open with other options: open them again
                self._reference = None
                if self._evaluator is not None:
                    self._evaluator.config = self.ort.config
                    self._evaluator.close()
            return before != label
        t0 = time.perf_counter()
        # importance's all-trainable artifacts too (same cache key)
        directory = self.artifacts(np.ones(len(self.names), dtype=bool), checkpoint=True)[
            0
        ].directory
        batch = self.dataset.probe_batch(cfg.batch_size, _probe_seed(cfg.seed, 0))
        per_round = 2 * len(TRAIN_CANDIDATES)  # full steps a round costs
        affordable = PROBE_BUDGET * self.total_steps * self.rho / per_round
        rounds = int(min(PROBE_ROUNDS, max(3, affordable)))
        choice, winner = choose_train_config(
            directory, batch, self.threads, input_names=self.model.input_names, rounds=rounds
        )
        self.ort = choice
        self._ort_base_ms = choice.step_ms[choice.label]
        self._reference = None  # the winner replaces any session open with other options
        if cfg.strategy in IMPORTANCE_STRATEGIES:  # one all-trainable session serves both
            self.evaluator().config = choice.config
            self.evaluator().adopt(winner)
            self._reference = winner
        elif cfg.strategy != "full":
            self._reference = winner
        self._probe_s += time.perf_counter() - t0
        self._ort_pending = True
        log.info(
            "session options: spinning %s (full step %s; probe %.2f s)",
            choice.label,
            ", ".join(f"{k} {v:.2f} ms" for k, v in choice.step_ms.items()),
            self._probe_s,
        )
        return choice.label != before

    def recheck_ort_config(self, records: list[dict]) -> bool:
        """At a period start: choose the options again (:meth:`choose_ort_config`) when the
        last period's full step measured alike (``reference_step_us``, wall) moved by
        :data:`REPROBE_FACTOR` or more from the one measured when they were chosen — or, with
        spinning on, when its elastic steps ran that much slower than the closed loop predicted
        (wall clock): MobileNetV2 at 128 px, a CPU hog starting with the period, slowed its
        elastic steps 2.3x and its one reference 1.37x, and the next period's reference 2.2x.
        Returns whether they changed."""
        cfg = self.config
        last = [
            r["reference_step_us"]
            for r in records[-cfg.period :]
            if np.isfinite(r.get("reference_step_us", np.nan))
        ]
        if cfg.spinning != "auto" or cfg.memory_mb is not None or not last:
            return False
        now_ms = float(np.median(last)) / 1e3
        if self._ort_base_ms is None:
            self._ort_base_ms = now_ms
            return False
        factor = now_ms / self._ort_base_ms
        if self.ort.config.spinning:  # the fit's clock is the wall clock then (fit_clock)
            elastic = [
                r["median_step_us"] / r["predicted_measured_step_us"]
                for r in records[-cfg.period :]
                if np.isfinite(r.get("predicted_measured_step_us", np.nan))
            ]
            if elastic and np.median(elastic) >= REPROBE_FACTOR:
                factor = max(factor, float(np.median(elastic)))
        if 1 / REPROBE_FACTOR < factor < REPROBE_FACTOR:
            return False
        log.info("full step %.2f ms, %.2fx the last choice's: choosing again", now_ms, factor)
        changed = self.choose_ort_config(slowdown=factor)
        if not changed and (self._ort_base_ms is None or not self.ort.step_ms):
            self._ort_base_ms = now_ms  # changed: the next period's step, in the new options
        return changed

    def fit_time_model(self, records: list[dict]) -> StepTimeFit:
        """The time-model correction from the epochs measured so far (:func:`fit_rows`;
        identity in the open loop or before any reference step)."""
        clock, rows = fit_rows(records, self.ort.config.spinning)
        if not self.config.closed_loop or not rows:
            return StepTimeFit()
        return fit_step_times(
            [r["predicted_step_us"] for r in rows],
            [r[f"median_step{clock}_us"] for r in rows],
            [r[f"reference_step{clock}_us"] for r in rows],
            self.profile.t_full_us,
        )

    # -- the loop ----------------------------------------------------------------------------

    def initial_state(self, model: LoadedModel) -> CarriedState | Path:
        """The state a run starts from: the model's initial weights; under a memory budget
        written to a checkpoint file instead (straight from the model's bytes, one tensor at
        a time) and the file's path returned, so the run never holds them."""
        if not self.bounded:
            return CarriedState(model.initial_weights())
        path = self.out / SESSION_DIR / "initial.ckpt"
        params = model.names + list(model.running_stats)
        write_checkpoint(path, CarriedState(lazy_initializer_values(model.proto, params)), [])
        _memory_log("the initial checkpoint")
        return path

    def run(
        self, start_epoch: int, carried: CarriedState | Path, history: list[dict]
    ) -> TrainResult:
        """Train from ``start_epoch`` (a period boundary) with ``carried`` state to the end
        (a checkpoint file under a memory budget)."""
        cfg = self.config
        freeze_gc()  # re-selections build graphs: collections then skip the libraries' objects
        session: TrainingSession | None = None
        mask_prev: np.ndarray | None = None
        (self.out / SESSION_DIR).mkdir(parents=True, exist_ok=True)
        records = list(history)
        period_start = start_epoch
        self.choose_ort_config()
        while period_start < cfg.epochs:
            period = period_start // cfg.period
            period_end = min((period + 1) * cfg.period, cfg.epochs)
            if session is not None:  # the state at the end of the last period, as checkpointed
                if self.bounded:  # released before importance: the state is in the file
                    session, carried = None, self.out / CHECKPOINT_FILE
                else:
                    carried, _, _ = read_checkpoint(self.out / CHECKPOINT_FILE)
                    if self.recheck_ort_config(records):
                        session = None  # opened again with the new options
            if cfg.deadline_s is not None:
                self.rho = self.deadline_rho(period_start, records)
            session, mask, timings = self._reselect(period, session, mask_prev, carried, records)
            mask_prev = mask
            for epoch in range(period_start, period_end):
                record = self._train_epoch(epoch, period, session, mask, timings, records)
                timings = None  # re-selection is charged to the period's first epoch only
                records.append(asdict(record))
                append_log(self.out, records[-1])
            _memory_log(f"period {period}'s epochs")
            reset_peak_rss()  # the next period's peak counts from here (checkpoint save on)
            if self.bounded:  # the save builds the file in memory: the workspace goes first
                session.release_sessions()
                release_native_memory()
                _memory_log("releasing the sessions")
            t0 = time.perf_counter()
            self._save_checkpoint(session, period_end, mask)
            _memory_log(f"saving the checkpoint ({_file_mb(self.out / CHECKPOINT_FILE):.0f} MiB)")
            log.debug("checkpoint after epoch %d: %.3f s", period_end, time.perf_counter() - t0)
            period_start = period_end
        session = None  # _finish exports from the checkpoint without a session
        if self.bounded:
            gc.collect()
            release_native_memory()
        return self._finish(records)

    def _reselect(
        self,
        period: int,
        session: TrainingSession | None,
        mask_prev: np.ndarray | None,
        carried: CarriedState | Path,
        records: list[dict],
    ) -> tuple[TrainingSession, np.ndarray, dict]:
        """Importance -> selection -> artifacts -> new session (kept if the mask is unchanged).

        ``carried``: the state, or under a memory budget the checkpoint file holding it (no
        session is open then). Returns the session, the mask and the timings (s) of each part,
        all counted as training time.
        """
        cfg = self.config
        t0 = time.perf_counter()
        memory = self.memory_costs()  # under a budget: measured with nothing large held
        importance = None
        if cfg.strategy in IMPORTANCE_STRATEGIES:
            batches = [
                self.dataset.probe_batch(cfg.batch_size, _probe_seed(cfg.seed, period) + 7919 * i)
                for i in range(cfg.probe_batches)
            ]
            if isinstance(carried, Path):
                result = self.evaluator(memory).evaluate_checkpoint(
                    carried, batches, cfg.learning_rate, self.out / SESSION_DIR
                )
            else:
                result = self.evaluator().evaluate(carried.weights, batches, cfg.learning_rate)
            importance = result.importance
            _memory_log("importance")
        t1 = time.perf_counter()
        self.fit = self.fit_time_model(records)
        time_model = self.profile
        if self.fit.observations:
            p = self.profile
            time_model = self.fit.time_model(p.t_dw_us, p.t_dy_us, p.forward_us, self.rho)
        fit_s = time.perf_counter() - t1
        resolution = cfg.resolution
        if resolution is None and memory is not None:
            resolution = MEMORY_DP_RESOLUTION

        def select(memory: MemoryCosts | None) -> np.ndarray:
            return strategy_mask(
                cfg.strategy,
                self.tensors,
                time_model,
                self.rho,
                importance,
                resolution=resolution,
                memory=memory,
                tolerance=RHO_TOLERANCE if self.fit.observations else 0.0,
            )

        try:
            mask = select(memory)
        except InfeasibleMemoryError as exc:
            if not records:  # the budget cannot hold from the start: the one-line error
                raise
            # The process grew since the run started (its resident memory beyond the model's
            # libraries is measured every period): finish at the smallest peak rather than
            # lose the run; the log shows the excess.
            log.warning("%s: this period trains at that peak instead", exc)
            memory = dataclasses.replace(memory, budget_mb=exc.min_memory_mb)
            mask = select(memory)
        self._predicted_peak_mb = None if memory is None else memory.peak_mb(mask)
        t2 = time.perf_counter()
        cache_hit = None
        if session is None or mask_prev is None or not np.array_equal(mask, mask_prev):
            paths, cache_hit, trainable = self.artifacts(mask)
            t3 = time.perf_counter()
            session = None  # release the old session before building the new one
            ckpt = self.out / SESSION_DIR / CHECKPOINT_FILE
            if isinstance(carried, Path):  # rewritten from a view of the file, then dropped
                state, _, _ = read_checkpoint(carried, copy=False)
                write_checkpoint(ckpt, state, trainable, initial_learning_rate=cfg.learning_rate)
                del state
                gc.collect()
                release_native_memory()
                _memory_log("the selection's checkpoint")
            else:
                write_checkpoint(ckpt, carried, trainable, initial_learning_rate=cfg.learning_rate)
            session = self._session(paths.directory, ckpt)
            _memory_log("the training session")
        else:
            t3 = time.perf_counter()
        release_native_memory()
        t4 = time.perf_counter()
        timings = {
            "importance_s": t1 - t0,
            "selection_s": t2 - t1,
            "artifacts_s": t3 - t2,
            "session_s": t4 - t3,
            "reselection_s": t4 - t0,
            "artifacts_cache_hit": cache_hit,
            "fit_s": fit_s,
        }
        log.info(
            "period %d: %d/%d tensors selected, predicted step %.0f us, re-selection %.3f s",
            period,
            int(mask.sum()),
            mask.size,
            self.predicted_step_us(mask),
            timings["reselection_s"],
        )
        return session, mask, timings

    def _train_epoch(
        self,
        epoch: int,
        period: int,
        session: TrainingSession,
        mask: np.ndarray,
        timings: dict | None,
        records: list[dict],
    ) -> EpochRecord:
        """Train one epoch, validate, and return its log record."""
        cfg = self.config
        global_step = epoch * self.steps_per_epoch
        step_times, losses, correct, seen = [], [], 0, 0
        lr = cosine_learning_rate(cfg.learning_rate, global_step, self.total_steps)
        bar = tqdm(
            total=self.steps_per_epoch,
            desc=f"epoch {epoch + 1}/{cfg.epochs}",
            disable=not self.progress,
            leave=False,
            unit="step",
        )
        # Full reference steps, measured alike (module docstring); full training is its own.
        reference, reference_at, reference_times = None, frozenset(), []
        step_cpu, reference_cpu = [], []  # the same steps by process CPU time
        t_ref = time.perf_counter()
        if cfg.strategy != "full" and not self.bounded:  # a full step would not fit a budget
            reference = self.reference_session()
            reference_at = self.reference_steps_at(epoch, period)
        reference_setup_s = time.perf_counter() - t_ref  # the first epoch opens the session
        reference_s = reference_setup_s
        t_epoch = time.perf_counter()
        for i, (x, y) in enumerate(self.train_batches(epoch)):
            lr = cosine_learning_rate(cfg.learning_rate, global_step, self.total_steps)
            ts, cs = time.perf_counter(), time.process_time()
            loss, right = session.train_step(x, y, lr)
            step_times.append(time.perf_counter() - ts)
            step_cpu.append(time.process_time() - cs)
            if i in reference_at:
                t_ref = time.perf_counter()
                wall, cpu = [], []
                for _ in range(1 + REFERENCE_WARMUP):  # the fastest of them (REFERENCE_WARMUP)
                    ts, cs = time.perf_counter(), time.process_time()
                    reference.train_step(x, y, 0.0)
                    wall.append(time.perf_counter() - ts)
                    cpu.append(time.process_time() - cs)
                reference_times.append((i, min(wall)))
                reference_cpu.append((i, min(cpu)))
                reference_s += time.perf_counter() - t_ref
            if not math.isfinite(loss):
                bar.close()
                self._diverged(epoch, period, len(step_times), loss, lr)
            global_step += 1
            losses.append(loss)
            correct, seen = correct + right, seen + y.shape[0]
            bar.update(1)
            bar.set_postfix(
                loss=f"{np.mean(losses):.3f}", acc=f"{correct / seen:.3f}", refresh=False
            )
        train_s = time.perf_counter() - t_epoch
        bar.close()
        timed = step_times[1:] if (session.fresh and len(step_times) > 1) else step_times
        session.fresh = False
        t_val = time.perf_counter()
        val_loss, val_acc = session.evaluate(self.val_batches(), cfg.batch_size)
        classify = self.model.task.loss == "ce"  # accuracy; for mse the loss is the metric
        val_s = time.perf_counter() - t_val
        first = 1 if len(timed) < len(step_times) else 0
        median_us = float(np.median(timed) * 1e6) if timed else float("nan")
        median_cpu_us = float(np.median(step_cpu[first:]) * 1e6) if timed else float("nan")
        if cfg.strategy != "full" and reference is None:  # a memory budget: not measured
            reference_us = reference_cpu_us = float("nan")
        elif reference is None:  # full training: its own steps are the reference
            reference_us, reference_cpu_us = median_us, median_cpu_us
        else:
            ratio = reference_ratio(step_times, reference_times, first)
            reference_us = median_us / ratio if ratio > 0 else float("nan")
            ratio = reference_ratio(step_cpu, reference_cpu, first)
            reference_cpu_us = median_cpu_us / ratio if ratio > 0 else float("nan")
        t = timings or {}
        probe_s, self._probe_s = self._probe_s, 0.0
        chose, self._ort_pending = self._ort_pending, False
        epoch_s = train_s + t.get("reselection_s", 0.0) + reference_setup_s + probe_s
        previous = records[-1]["cumulative_wall_time_s"] if records else 0.0
        record = EpochRecord(
            epoch=epoch + 1,
            period=period,
            train_loss=float(np.mean(losses)),
            train_acc=correct / max(seen, 1) if classify else float("nan"),
            val_loss=val_loss,
            val_acc=val_acc if classify else float("nan"),
            wall_time_s=epoch_s,
            cumulative_wall_time_s=previous + epoch_s,
            learning_rate=lr,
            selection=[int(i) for i in np.flatnonzero(mask)],
            n_tensors=int(mask.size),
            predicted_step_us=self.predicted_step_us(mask),
            measured_step_us=float(np.mean(timed) * 1e6) if timed else float("nan"),
            reselection_s=t.get("reselection_s", 0.0),
            importance_s=t.get("importance_s", 0.0),
            selection_s=t.get("selection_s", 0.0),
            artifacts_s=t.get("artifacts_s", 0.0),
            session_s=t.get("session_s", 0.0),
            artifacts_cache_hit=t.get("artifacts_cache_hit"),
            peak_rss_mb=peak_rss_mb(),
            steps=len(step_times),
            rho_requested=self.rho,
            rho_predicted=self.fit.rho(self.predicted_step_us(mask), self.profile.t_full_us),
            predicted_measured_step_us=self.fit.predict_us(self.predicted_step_us(mask))
            if self.fit.observations
            else float("nan"),
            median_step_us=median_us,
            reference_step_us=reference_us,
            reference_steps=len(reference_times),
            rho_measured=median_us / reference_us,
            reference_s=reference_s,
            fit_s=t.get("fit_s", 0.0),
            fit_scale=self.fit.scale,
            fit_fixed_us=self.fit.fixed_us,
            median_step_cpu_us=median_cpu_us,
            reference_step_cpu_us=reference_cpu_us,
            rho_measured_cpu=median_cpu_us / reference_cpu_us,
            val_s=val_s,
            ort_config=self.ort.label,
            ort_probe_s=probe_s,
            ort_probe_step_ms=dict(self.ort.step_ms) if chose and self.ort.step_ms else None,
            ort_note=self.ort.note if chose else "",
            predicted_peak_mb=(
                self._predicted_peak_mb
                if self._predicted_peak_mb is not None
                else None
                if self.memory_profile is None
                else self.memory_profile.peak_mb(mask)
            ),
        )
        if self.progress:
            tqdm.write(
                f"epoch {epoch + 1:>3}/{cfg.epochs}  loss {record.train_loss:.4f}  "
                f"acc {record.train_acc:.3f}  val_loss {val_loss:.4f}  "
                f"val_acc {record.val_acc:.3f}  "
                f"{epoch_s:.1f}s  {int(mask.sum())}/{mask.size} tensors"
            )
        return record

    def reference_steps_at(self, epoch: int, period: int) -> frozenset[int]:
        """Steps of ``epoch`` (0-based) after which a full reference step runs
        (:func:`period_reference_positions` of its period)."""
        cfg = self.config
        first = period * cfg.period
        epochs = min(first + cfg.period, cfg.epochs) - first
        positions = period_reference_positions(
            self.steps_per_epoch, epochs, cfg.reference_budget, self.rho
        )
        return positions[epoch - first]

    def _diverged(self, epoch: int, period: int, step: int, loss: float, lr: float) -> None:
        """Stop the run at the first non-finite loss (epoch 0-based, step 1-based): one line that
        names where and suggests a lower learning rate; the last checkpoint is left as it is."""
        message = (
            f"training diverged: the loss is {loss} at epoch {epoch + 1}, step {step} "
            f"(learning rate {lr:.3g}): start a new run with a lower --lr"
        )
        if (self.out / CHECKPOINT_FILE).exists():
            message += (
                f"; the last good checkpoint, after epoch {period * self.config.period}, is kept "
                f"in {self.out / CHECKPOINT_FILE}"
            )
        raise TrainingDivergedError(message, epoch + 1, step)

    def _save_checkpoint(self, session: TrainingSession, epoch: int, mask: np.ndarray) -> None:
        """Checkpoint after ``epoch`` (a period end): weights, moments, step and run state."""
        properties = checkpoint_properties(
            epoch=epoch,
            global_step=epoch * self.steps_per_epoch,
            mask=mask,
            config_hash=self.config.digest(),
            seed=self.config.seed,
        )
        session.save(self.out / CHECKPOINT_FILE, properties)

    def _finish(self, records: list[dict]) -> TrainResult:
        """Export the trained model, score it, plot, summarise; remove the session directory.

        The export streams the last selection's eval graph (as generated, frozen parameters
        not baked) with the weights of the run's last checkpoint, saved at the end of the last
        period (:func:`etgraph.artifacts.export_inference_model`: no session, the weights held
        once), so sessions may keep their baked graphs' constants outside the graph files."""
        cfg = self.config
        trained = self.out / TRAINED_MODEL_FILE
        ckpt = self.out / CHECKPOINT_FILE
        _, requires_grad, _ = read_checkpoint(ckpt, copy=False, moments=False)
        selected = set(requires_grad)
        paths, _, _ = self.artifacts(np.array([n in selected for n in self.names]))
        labelled = onnx.ModelProto()
        if self.dataset.class_names:  # a prediction reads back as a label (metadata_props)
            set_class_names(labelled, self.dataset.class_names)
        metadata = {p.key: p.value for p in labelled.metadata_props}
        export_inference_model(paths.eval_model, ckpt, trained, [self.model.output_name], metadata)
        # the artifacts' batch size was fixed (self.cache); the original output meaning
        restore_exported(trained, self.model.head)
        _memory_log("export")
        if self._export_original_outputs(trained) and self.dataset.class_names:
            stamp_onnx(trained, self.dataset.class_names)  # the original's file had none
        _, inference_acc = evaluate_onnx(
            trained,
            self.val_batches(),
            cfg.batch_size,
            loss=self.model.task.loss,
            output=self.model.output_name,
        )
        if self.model.task.loss != "ce":  # the metric is the MSE: no accuracy
            inference_acc = float("nan")
        _memory_log("scoring the exported model")
        with contextlib.suppress(Exception):
            plot_run(self.out)
        shutil.rmtree(self.out / SESSION_DIR, ignore_errors=True)
        result = summarize(
            self.out,
            records,
            strategy=cfg.strategy,
            rho=cfg.rho,
            profile=self.profile,
            inference_acc=inference_acc,
            trained_model=trained,
            deadline_s=cfg.deadline_s,
            elapsed_s=time.perf_counter() - self.started_at,
        )
        write_summary(self.out, result)
        return result

    def _export_original_outputs(self, trained: Path) -> bool:
        """When ``--output`` picked one of several outputs: the exported model becomes the
        original model (all its outputs) with the trained weights, if the original file is
        still there and holds its weights as initializers; else it keeps the trained output
        only (logged). Returns whether the file was rewritten from the original."""
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

    def _session(self, directory: Path, checkpoint: Path) -> TrainingSession:
        """A training session of the run's model and loss on ``checkpoint``."""
        return TrainingSession(
            directory,
            checkpoint,
            self.threads,
            loss=self.model.task.loss,
            input_names=self.model.input_names,
            config=self.ort.config,
            bake=not self.bounded,  # under a memory budget (_given)
        )


# ---- entry points -----------------------------------------------------------------------------


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
    """Train ``model`` with ``config.strategy``, re-selecting every ``config.period`` epochs.

    Args:
        model: the loaded forward classifier (one input ``[B, C, H, W]``, output logits
            ``[B, K]``); ``model.source`` must stay loadable, :func:`resume` reloads it.
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
        dataset: the run's data when the caller loaded it (:func:`load_run_data`, e.g. before
            profiling, so a data error comes first); default: loaded here.

    Returns:
        A :class:`~etgraph.rundir.TrainResult` (also in ``out_dir/summary.json``).

    Raises:
        ConfigError: bad settings, an unwritable ``out_dir`` or an existing run in it, or a
            deadline even the cheapest selection cannot meet (gives the shortest feasible one).
        ProfileMismatchError: the profile is of another model or batch size.
        InfeasibleBudgetError: ``rho`` is too small for any selection (gives the smallest rho).
        DataError, ModelError: the data or model cannot be used.
        TrainingDivergedError: a training loss was NaN or infinite (the run stops at that step;
            the last period's checkpoint stays in ``out_dir``).
    """
    out = Path(out_dir)
    config = config.validate()
    prepare_run_dir(out)
    run = _Run(
        model,
        profile,
        config,
        out,
        artifacts_root=Path(artifacts_root) if artifacts_root else None,
        progress=progress,
        memory_profile=memory_profile,
        dataset=dataset,
    )
    if started_at is not None:
        run.started_at = started_at
    run.check_deadline()
    if config.memory_mb is None:  # a native crash of ORT: one line (once per model; under a
        check_sessions(  # budget the profile's check stands: no all-trainable weights here)
            model, config.batch_size, run.input_shapes, threads=run.threads,
            frozen_bn=config.frozen_bn, cache=run.cache, record_dir=default_cache_dir(),
        )  # fmt: skip
    if memory_profile is not None and config.memory_mb is not None:  # the model's own floor
        check_memory_floor(MemoryCosts.from_profile(memory_profile, config.memory_mb))
    profile.save(out / PROFILE_FILE)
    if memory_profile is not None:
        memory_profile.save(out / MEMORY_FILE)
    write_run_file(
        out,
        model=model.source.resolve(),
        config=config.to_json(),
        config_hash=config.digest(),
        artifacts_root=artifacts_root,
        task=model.task.to_json(),
    )
    if run.dataset.class_names:
        save_class_names(out, run.dataset.class_names)
    start_log(out)
    carried = run.initial_state(model)
    del model  # under a memory budget the weights are in the file now (the caller's copy too)
    return run.run(0, carried, [])


def resume(out_dir: str | os.PathLike, *, progress: bool = True) -> TrainResult:
    """Continue the run in ``out_dir`` from its last checkpoint (after any interruption).

    The work after the last checkpoint (at most the current period) is repeated; the run ends
    with the configured number of epochs and, given the same data, the same selections and
    losses as an uninterrupted run (open loop; the closed loop's selections depend on measured
    times). A run that had not reached its first checkpoint restarts. A ``deadline_s`` counts
    from the resume.
    The model is reloaded from the path in ``run.json``.

    Raises:
        CheckpointError: ``out_dir`` holds no run, or its checkpoint is corrupt or from another
            configuration or model.
        ModelError, ProfileMismatchError, DataError: the model, profile or data recorded for the
            run can no longer be used.
        TrainingDivergedError: as :func:`train`.
    """
    out = Path(out_dir)
    model_path, config, artifacts_root = read_run_file(out, TrainConfig.from_json)
    profile = Profile.load(out / PROFILE_FILE)
    task = read_run_task(out)
    model = LoadedModel.load(model_path, output=task.get("output"), loss=task.get("loss", "ce"))
    memory_profile = (
        MemoryProfile.load(out / MEMORY_FILE) if (out / MEMORY_FILE).is_file() else None
    )
    run = _Run(
        model,
        profile,
        config,
        out,
        artifacts_root=artifacts_root,
        progress=progress,
        memory_profile=memory_profile,
    )
    remove_temporaries(out)
    if run.dataset.class_names:  # the same mapping again (a kill may have come before it)
        save_class_names(out, run.dataset.class_names)
    if artifacts_root is None:  # the run's own cache (a shared one may be in use)
        run.cache.remove_temporaries()
    if not (out / CHECKPOINT_FILE).exists():
        log.info("no checkpoint in %s yet: restarting the run", out)
        if progress:
            tqdm.write(f"no checkpoint in {out} yet: the run starts over")
        start_log(out)
        carried = run.initial_state(model)
        del model
        return run.run(0, carried, [])
    carried, epoch = read_run_checkpoint(out, model, config.digest())
    del model
    if run.bounded:  # checked; the run reads the file itself (the state is never held)
        carried = out / CHECKPOINT_FILE
        gc.collect()
    records = truncate_log(out, epoch)
    log.info("resuming %s at epoch %d of %d", out, epoch, config.epochs)
    if progress:  # the user sees where the run continues from
        tqdm.write(f"resuming {out} after epoch {epoch} of {config.epochs} (its last checkpoint)")
    return run.run(epoch, carried, records)
