"""The settings of one training run (:class:`TrainConfig`) and its learning-rate schedule.

Kept apart from the loop so that a program, the CLI and ``run.json`` share one definition of a
run's configuration (:meth:`TrainConfig.to_json` / :meth:`TrainConfig.from_json`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from passes.onnx import DEFAULT_FROZEN_BN, check_head_lr_scale

from .arrays import ArrayDataset
from .artifacts import check_frozen_bn
from .config_choice import TRAIN_CANDIDATES
from .data import Dataset, as_dataset
from .errors import ConfigError, DataError, ProfileMismatchError
from .images import DEFAULT_PREPROCESS, Preprocess
from .importance_rules import check_importance_variant
from .memory import check_step_fits
from .selection import BUDGETED_STRATEGIES, STRATEGIES

if TYPE_CHECKING:
    from .memory import MemoryProfile
    from .model import LoadedModel
    from .profile import Profile

__all__ = ["RHO_SCOPES", "TrainConfig", "check_run_inputs", "load_run_data", "steps_per_epoch"]

#: What ``TrainConfig.rho`` bounds: a step's time (paper Eq. 3), or the whole run's.
RHO_SCOPES = ("step", "run")


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (paper §8 defaults: 12 epochs, batch 4, lr 1e-4).

    The optimizer is AdamW (decoupled weight decay) with betas (0.9, 0.999), eps 1e-6 — ORT's
    training runtime runs only AdamW and momentum-less SGD (the paper uses SGDW with momentum
    0.9 for CNNs, Adam for ViT). The learning rate follows the paper's cosine decay over all
    training steps, set every step (ORT's LinearLRScheduler is broken in 1.19.2); the step count
    is global (one optimizer group), so bias correction continues across selections.

    Attributes:
        epochs: training epochs (> 0).
        batch_size: examples per step (> 0); must match the profile's batch size.
        learning_rate: peak AdamW learning rate (> 0), decayed by a cosine over all steps.
        weight_decay: AdamW decoupled weight decay (>= 0).
        rho: requested time as a fraction of full training's, in (0, 1]: of a step, or of
            the whole run (``rho_scope``).
        rho_scope: what ``rho`` bounds: ``"step"`` (an elastic step's time over a full step's,
            paper Eq. 3) or ``"run"`` (the whole run's wall time, its per-period overheads,
            validation and export included, over what full training would take; each period's
            step rho is then planned from the run's measured progress as in deadline mode,
            :class:`etgraph.clock.DeadlinePlanner`). Budgeted strategies only for ``"run"``.
        period: epochs between re-selections (> 0; paper: 3).
        strategy: one of :data:`etgraph.selection.STRATEGIES`.
        seed: run seed (data order, probe batches, train/val split, Dropout masks).
        data: dataset spec for :func:`etgraph.data.load_task_data` (None = embedded digits
            task).
        tokenizer: the model's ``tokenizer.json`` for text data (``data`` a .csv/.jsonl file).
        val_fraction: fraction of each class held out for validation.
        probe_batches: probe batches per importance evaluation (paper: one batch of 4). With
            one at the run's batch size (``probe_batch_size >= batch_size``), periods after the
            first take it on the previous period's last training batch, whose full step's
            gradients the run already has (:mod:`etgraph.period`).
        probe_batch_size: examples per probe batch, at most ``batch_size`` (paper §4: a batch
            of 4 keeps the importance ranking at under 1% of the computation). Smaller than
            ``batch_size``, importance runs in an all-trainable session of its own at this
            batch: a pass costs a fraction of a full step (MobileNetV2 96 px: batch 4 takes
            16% of batch 32's time).
        max_steps_per_epoch: cap on training steps per epoch (None = the whole training set);
            for quick runs on a subsample.
        max_val_batches: cap on validation batches (None = the whole validation set).
        resolution: DP time resolution T_q (None = 1-µs units, exact).
        threads: ORT intra-op threads (None = ORT's default); use the profile's setting.
        frozen_bn: how a batch norm whose gamma and beta are both unselected runs:
            ``"inference"`` (running statistics used and kept) or ``"train"`` (batch
            statistics; running statistics updated) — :mod:`etgraph.artifacts`.
        preprocess: the model's input normalisation for image-folder data
            (:class:`etgraph.images.Preprocess`; the embedded digits keep their own).
        closed_loop: re-fit the time model to the measured steps every period and select with
            the corrected model (selections then vary with the machine's timing).
        reference_budget: share of each period's elastic step time spent on full reference
            steps, in (0, 1] (at least one per period); more = a less noisy achieved rho and fit.
        deadline_s: finish the run (training, validation, export) within this many seconds
            of its start, choosing rho per period from the measured progress
            (:class:`etgraph.clock.DeadlinePlanner`; ``rho`` is then not used).
            Budgeted strategies only. None = a fixed ``rho``.
        memory_mb: peak-memory budget, MiB (issue #17; ``elastic`` only): the DP selects under
            it with the run's memory model (:class:`etgraph.memory.MemoryProfile`), and the log
            records the predicted peak beside the measured one. None = time budget only.
        spinning: the ORT session options the run trains with: ``"auto"`` measures the
            candidates of :data:`etgraph.config_choice.TRAIN_CANDIDATES` at the start
            (:func:`etgraph.config_choice.choose_train_config`, on the full artifacts at learning
            rate 0) and keeps the fastest; or a candidate's label (``"off"``, ``"on"``,
            ``"on+stop"``), not measured. Under ``memory_mb`` ``"auto"`` means ``"off"`` (the
            probe would hold two all-trainable sessions at once).
        importance: which update defines delta_w in the importance (``elastic``, ``topk``;
            :data:`etgraph.selection.IMPORTANCE_VARIANTS`): ``"adam"`` (the optimizer's next
            step with the run's moments), ``"first-step"`` (AdamW's first step from zero
            moments), ``"grad-sq"`` or ``"random"``.
        head_lr_scale: the head (the dense layer making the output) trains at this factor
            times ``learning_rate``, exactly: an ONNX reparametrisation applied when the model
            is loaded (:func:`etgraph.load_model`'s ``head_lr_scale``, :mod:`passes.onnx.head_lr`;
            ``etgraph compile/train --head-lr-scale``), so the model must be loaded with the same
            factor. 10 is the measured useful value for a fresh head (docs/results.md, "Head
            learning rate"); 1 = one rate for all.
    """

    epochs: int = 12
    batch_size: int = 4
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    rho: float = 0.5
    rho_scope: str = "step"
    period: int = 3
    strategy: str = "elastic"
    seed: int = 0
    data: str | None = None
    tokenizer: str | None = None
    val_fraction: float = 0.2
    probe_batches: int = 1
    probe_batch_size: int = 4
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
    importance: str = "adam"
    head_lr_scale: float = 1.0

    @property
    def importance_batch_size(self) -> int:
        """The probe batches' size: ``probe_batch_size``, at most ``batch_size``."""
        return min(self.probe_batch_size, self.batch_size)

    @property
    def plans_rho(self) -> bool:
        """Whether each period's rho is planned from the run's progress
        (:class:`etgraph.clock.DeadlinePlanner`): deadline mode, or rho of the whole run."""
        return self.deadline_s is not None or self.rho_scope == "run"

    def _require_budgeted(self, option: str) -> None:
        """Raise ConfigError naming ``option`` (what it does with rho) unless the strategy
        selects under a time budget (:data:`etgraph.selection.BUDGETED_STRATEGIES`)."""
        if self.strategy not in BUDGETED_STRATEGIES:
            raise ConfigError(
                f"{option}, which strategy {self.strategy!r} ignores: use one of "
                f"{', '.join(BUDGETED_STRATEGIES)}"
            )

    def validate(self) -> TrainConfig:
        """Return self if every field is in range; raise ConfigError naming the bad option."""
        positive = {
            "epochs": self.epochs,
            "batch size": self.batch_size,
            "period": self.period,
            "probe batches": self.probe_batches,
            "probe batch size": self.probe_batch_size,
        }
        for name, value in positive.items():
            if int(value) != value or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value}")
        if int(self.seed) != self.seed or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed}")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning rate must be positive, got {self.learning_rate}")
        if not self.weight_decay >= 0:
            raise ConfigError(f"weight decay must be >= 0, got {self.weight_decay}")
        if not (0.0 < self.rho <= 1.0):
            raise ConfigError(
                f"rho must be in (0, 1] (fraction of the full step time), got {self.rho}"
            )
        check_frozen_bn(self.frozen_bn)
        check_importance_variant(self.importance)
        check_head_lr_scale(self.head_lr_scale)
        if not (0.0 < self.reference_budget <= 1.0):
            raise ConfigError(f"reference budget must be in (0, 1], got {self.reference_budget}")
        if self.rho_scope not in RHO_SCOPES:
            raise ConfigError(
                f"unknown rho scope {self.rho_scope!r}: choose one of {', '.join(RHO_SCOPES)}"
            )
        if self.rho_scope == "run":
            self._require_budgeted("--rho-scope run plans rho per period")
            if self.deadline_s is not None:
                raise ConfigError(
                    "--deadline and --rho-scope run both plan the run's time: give one of them"
                )
        if self.deadline_s is not None:
            if not self.deadline_s > 0:
                raise ConfigError(f"deadline must be positive, got {self.deadline_s} s")
            self._require_budgeted("--deadline chooses rho")
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
        ConfigError: more probe batches than the data has batches; a step at ``shapes``
            cannot fit in memory (:func:`etgraph.memory.check_step_fits`).
    """
    check_step_fits(model, config.batch_size, shapes)  # before the data is allocated
    if config.memory_mb is not None:  # the budget does not count decoded images kept
        kwargs.setdefault("cache_mb", 0.0)
    dataset = as_dataset(
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
    dataset.check_probe_batches(config.importance_batch_size, config.probe_batches)
    return dataset


def check_run_inputs(
    config: TrainConfig,
    model: LoadedModel,
    profile: Profile,
    shapes: Mapping[str, Sequence[int]],
    memory_profile: MemoryProfile | None = None,
) -> None:
    """Check that ``profile`` (and ``memory_profile``) can serve a run of ``config`` on
    ``model`` at per-example input ``shapes``.

    Raises:
        ProfileMismatchError: the profile is of another model, batch size, input shape or
            loss, or the memory model of another batch-norm mode.
        ConfigError: ``memory_mb`` without a memory model; a ``head_lr_scale`` other than
            the model was loaded with.
    """
    if config.head_lr_scale != model.head_lr_scale:
        raise ConfigError(
            f"the run asks for head learning-rate scale {config.head_lr_scale:g} but the model "
            f"was loaded with {model.head_lr_scale:g}: load (or compile) it with "
            f"head_lr_scale={config.head_lr_scale:g} (--head-lr-scale), or train at "
            f"{model.head_lr_scale:g}"
        )
    if config.memory_mb is not None and memory_profile is None:
        raise ConfigError("--memory-mb needs the model's memory profile: compile with it")
    if memory_profile is not None and memory_profile.frozen_bn != config.frozen_bn:
        raise ProfileMismatchError(
            f"memory profile is of --frozen-bn {memory_profile.frozen_bn}, not "
            f"{config.frozen_bn}: measure it in the run's mode (etgraph.memory_profiler)"
        )
    profile.check_matches(
        model.hash, batch_size=config.batch_size, input_shapes=shapes, loss=model.task.loss
    )
    if list(profile.tensors) != model.names:
        raise ProfileMismatchError(
            f"the profile lists {len(profile.tensors)} tensors that differ from the "
            f"{len(model.names)} of {model.source.resolve()}: re-run `etgraph profile` for "
            "this model"
        )


def steps_per_epoch(dataset, config: TrainConfig) -> int:
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
