"""Elastic training runtime on onnxruntime-training (paper §3-§4 and the setup of §8).

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
   optimizer group), as in TensorFlow/Keras, so bias correction continues;
5. **train** ``period`` epochs with cosine learning-rate decay set every step.

The state is carried through a checkpoint file in ORT's flatbuffer format that this module reads
and writes itself (``onnxruntime/tools/ort_format_model/ort_flatbuffers_py``): ORT 1.19.2 has no
Python API for optimizer moments, but loads them from a checkpoint.

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

**Outputs** in the run directory (see :func:`train`): ``log.jsonl``, ``checkpoint`` (after every
period, atomic), ``model_trained.onnx`` (plain inference model), ``curves.png``,
``selection.png``, ``summary.json``, and ``run.json`` + ``profile.json`` for ``--resume``.

**Determinism.** All randomness derives from the run seed: epoch ``e`` shuffles with
``seed * 1000 + e``, period ``p`` probes with ``seed * 1000 + 100_000 + p``. Same seed, same data
=> same selections and the same losses (to floating-point tolerance); a resumed run continues
exactly as the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .artifacts import ArtifactCache, ArtifactPaths
from .errors import CheckpointError, ConfigError, ProfileMismatchError
from .model import LoadedModel
from .model import input_shape as model_input_shape
from .selection import IMPORTANCE_STRATEGIES, STRATEGIES, strategy_mask
from .sessions import session_options

log = logging.getLogger(__name__)

__all__ = [
    "TrainConfig",
    "CarriedState",
    "EpochRecord",
    "TrainResult",
    "TrainingSession",
    "train",
    "resume",
    "read_checkpoint",
    "write_checkpoint",
    "cosine_learning_rate",
    "evaluate_onnx",
    "format_summary",
]


LOG_FILE = "log.jsonl"
CHECKPOINT_FILE = "checkpoint"
RUN_FILE = "run.json"
PROFILE_FILE = "profile.json"
SUMMARY_FILE = "summary.json"
TRAINED_MODEL_FILE = "model_trained.onnx"
ARTIFACTS_DIR = "artifacts"
SESSION_DIR = ".session"
RUN_PROPERTY = "etgraph_run"
MOMENT_NAMES = ("momentum0", "momentum1")


# ---------------------------------------------------------------------------------------------
# Configuration


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
        data: dataset spec for :func:`etgraph.data.load_dataset` (None = embedded digits task).
        val_fraction: fraction of each class held out for validation.
        probe_batches: probe batches per importance evaluation (paper: one batch of 4).
        max_steps_per_epoch: cap on training steps per epoch (None = the whole training set);
            for quick runs on a subsample.
        max_val_batches: cap on validation batches (None = the whole validation set).
        resolution: DP time resolution T_q (None = 1-µs units, exact).
        threads: ORT intra-op threads (None = ORT's default); use the profile's setting.
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
    val_fraction: float = 0.2
    probe_batches: int = 1
    max_steps_per_epoch: int | None = None
    max_val_batches: int | None = None
    resolution: int | None = None
    threads: int | None = None

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
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}"
            )
        for name in ("max_steps_per_epoch", "max_val_batches", "resolution", "threads"):
            value = getattr(self, name)
            if value is not None and (int(value) != value or value < 1):
                raise ConfigError(
                    f"{name.replace('_', ' ')} must be a positive integer, got {value}"
                )
        return self

    def to_json(self) -> dict:
        return asdict(self)

    def digest(self) -> str:
        """Stable 16-hex-digit hash of the configuration (stored in checkpoints)."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def cosine_learning_rate(base_lr: float, step: int, total_steps: int) -> float:
    """Cosine-decayed learning rate at ``step`` of ``total_steps`` (paper §8, TF CosineDecay).

    ``base_lr * (1 + cos(pi * step / total_steps)) / 2``; ``step`` is clamped to
    ``[0, total_steps]``.
    """
    if total_steps <= 0:
        return float(base_lr)
    t = min(max(step, 0), total_steps) / total_steps
    return float(base_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


# ---------------------------------------------------------------------------------------------
# Carried state and the ORT checkpoint format


@dataclass
class CarriedState:
    """Everything that survives a re-selection.

    Attributes:
        weights: name -> array for every parameter of the session: trainable tensors (selected
            or not) and BatchNorm running statistics.
        moments: name -> {"momentum0": m, "momentum1": v} for the tensors that were trainable
            in the session the state came from (AdamW first/second moments, tensor shape).
        step: AdamW step count (shared by all tensors: ORT has one optimizer group).
    """

    weights: dict[str, np.ndarray]
    moments: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    step: int = 0


def _fbs():
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py import fbs

    return fbs


def _tensor_to_array(t) -> np.ndarray:
    dtype = helper.tensor_dtype_to_np_dtype(t.DataType())
    dims = tuple(int(d) for d in t.DimsAsNumpy()) if t.DimsLength() else ()
    raw = t.RawDataAsNumpy() if t.RawDataLength() else np.zeros(0, np.uint8)
    return np.frombuffer(raw.tobytes(), dtype=dtype).reshape(dims)


def read_checkpoint(path: str | os.PathLike) -> tuple[CarriedState, list[str], dict[str, str]]:
    """Read an ORT training checkpoint (flatbuffer ``ODTC``, as saved by ORT 1.19.2).

    Args:
        path: checkpoint file (``CheckpointState.save_checkpoint`` or :func:`write_checkpoint`).

    Returns:
        ``(state, requires_grad, properties)``: the carried state (weights of all parameters,
        moments if the checkpoint holds optimizer state, step), the names of the trainable
        parameters, and the string properties.

    Raises:
        CheckpointError: the file is missing, truncated, or not an ORT checkpoint.
    """
    fbs = _fbs()
    path = Path(path)
    try:
        buf = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}") from exc
    if len(buf) < 8 or buf[4:8] != b"ODTC":
        raise CheckpointError(f"{path} is not an onnxruntime training checkpoint (bad header)")
    try:
        ck = fbs.Checkpoint.Checkpoint.GetRootAs(buf, 0)
        ms = ck.ModuleState()
        weights: dict[str, np.ndarray] = {}
        requires_grad = []
        for j in range(ms.RequiresGradParamsLength()):
            t = ms.RequiresGradParams(j)
            name = t.Name().decode()
            weights[name] = _tensor_to_array(t)
            requires_grad.append(name)
        for j in range(ms.FrozenParamsLength()):
            t = ms.FrozenParams(j)
            weights[t.Name().decode()] = _tensor_to_array(t)
        moments: dict[str, dict[str, np.ndarray]] = {}
        step = 0
        for g in range(ck.OptimizerGroupsLength()):
            group = ck.OptimizerGroups(g)
            step = int(group.Step())
            for s in range(group.OptimizerStatesLength()):
                ps = group.OptimizerStates(s)
                moments[ps.ParamName().decode()] = {
                    ps.Momentums(k).Name().decode(): _tensor_to_array(ps.Momentums(k))
                    for k in range(ps.MomentumsLength())
                }
        properties = {}
        bag = ck.PropertyBag()
        if bag is not None:
            for j in range(bag.StringsLength()):
                sp = bag.Strings(j)
                properties[sp.Name().decode()] = sp.Value().decode()
    except Exception as exc:  # flatbuffers raises IndexError/struct.error on corrupt data
        raise CheckpointError(
            f"checkpoint {path} is corrupt ({type(exc).__name__}): delete it to start over"
        ) from exc
    return CarriedState(weights, moments, step), requires_grad, properties


def _fb_tensor(builder, name: str, array: np.ndarray) -> int:
    fbs = _fbs()
    array = np.ascontiguousarray(array)
    name_off = builder.CreateString(name)
    dims_off = builder.CreateNumpyVector(np.asarray(array.shape, dtype=np.int64))
    raw_off = builder.CreateNumpyVector(np.frombuffer(array.tobytes(), dtype=np.uint8))
    fbs.Tensor.Start(builder)
    fbs.Tensor.AddName(builder, name_off)
    fbs.Tensor.AddDims(builder, dims_off)
    fbs.Tensor.AddDataType(builder, helper.np_dtype_to_tensor_dtype(array.dtype))
    fbs.Tensor.AddRawData(builder, raw_off)
    return fbs.Tensor.End(builder)


def _fb_vector(builder, start, offsets: list[int]) -> int:
    start(builder, len(offsets))
    for off in reversed(offsets):
        builder.PrependUOffsetTRelative(off)
    return builder.EndVector()


def write_checkpoint(
    path: str | os.PathLike,
    state: CarriedState,
    requires_grad: Sequence[str],
    *,
    initial_learning_rate: float = 1e-4,
    properties: Mapping[str, str] | None = None,
) -> None:
    """Write an ORT training checkpoint that starts a session for a new selection.

    Every weight in ``state.weights`` is stored: the names in ``requires_grad`` as trainable,
    the rest as frozen. The optimizer state holds ``state.step`` and, for every trainable name,
    its moments from ``state.moments`` when present, zeros otherwise (ORT requires an entry for
    every trainable parameter). Written to a temporary file and renamed (atomic).

    Args:
        path: destination file.
        state: weights (all parameters), moments, step.
        requires_grad: names of the parameters the new session trains (subset of weights).
        initial_learning_rate: stored in the optimizer group (the runtime sets lr each step).
        properties: string properties stored in the checkpoint.

    Raises:
        ConfigError: a ``requires_grad`` name has no weight, or a moment's shape differs.
    """
    import flatbuffers

    fbs = _fbs()
    trainable = set(requires_grad)
    missing = trainable - set(state.weights)
    if missing:
        raise ConfigError(f"no weight for trainable tensors {sorted(missing)[:5]}")
    b = flatbuffers.Builder(1 << 20)
    train_offs, frozen_offs = [], []
    for name in sorted(state.weights):
        off = _fb_tensor(b, name, state.weights[name])
        (train_offs if name in trainable else frozen_offs).append(off)
    train_vec = _fb_vector(b, fbs.ModuleState.StartRequiresGradParamsVector, train_offs)
    frozen_vec = _fb_vector(b, fbs.ModuleState.StartFrozenParamsVector, frozen_offs)
    fbs.ModuleState.Start(b)
    fbs.ModuleState.AddRequiresGradParams(b, train_vec)
    fbs.ModuleState.AddFrozenParams(b, frozen_vec)
    fbs.ModuleState.AddIsNominalState(b, False)
    fbs.ModuleState.AddHasExternalData(b, False)
    module_off = fbs.ModuleState.End(b)

    param_offs = []
    for name in sorted(trainable):
        weight = state.weights[name]
        carried = state.moments.get(name, {})
        moment_offs = []
        for moment in MOMENT_NAMES:
            value = carried.get(moment)
            if value is None:
                value = np.zeros_like(weight)
            elif value.shape != weight.shape:
                raise ConfigError(f"moment {moment} of {name!r} has shape {value.shape}")
            moment_offs.append(_fb_tensor(b, moment, value))
        moments_vec = _fb_vector(b, fbs.ParameterOptimizerState.StartMomentumsVector, moment_offs)
        name_off = b.CreateString(name)
        fbs.ParameterOptimizerState.Start(b)
        fbs.ParameterOptimizerState.AddParamName(b, name_off)
        fbs.ParameterOptimizerState.AddMomentums(b, moments_vec)
        param_offs.append(fbs.ParameterOptimizerState.End(b))
    states_vec = _fb_vector(b, fbs.OptimizerGroup.StartOptimizerStatesVector, param_offs)
    group_name = b.CreateString("group0")
    fbs.OptimizerGroup.Start(b)
    fbs.OptimizerGroup.AddGroupName(b, group_name)
    fbs.OptimizerGroup.AddStep(b, int(state.step))
    fbs.OptimizerGroup.AddInitialLearningRate(b, float(initial_learning_rate))
    fbs.OptimizerGroup.AddOptimizerStates(b, states_vec)
    group_off = fbs.OptimizerGroup.End(b)
    groups_vec = _fb_vector(b, fbs.Checkpoint.StartOptimizerGroupsVector, [group_off])

    bag_off = None
    if properties:
        prop_offs = []
        for key, value in sorted(properties.items()):
            k_off, v_off = b.CreateString(key), b.CreateString(value)
            fbs.StringProperty.Start(b)
            fbs.StringProperty.AddName(b, k_off)
            fbs.StringProperty.AddValue(b, v_off)
            prop_offs.append(fbs.StringProperty.End(b))
        strings_vec = _fb_vector(b, fbs.PropertyBag.StartStringsVector, prop_offs)
        fbs.PropertyBag.Start(b)
        fbs.PropertyBag.AddStrings(b, strings_vec)
        bag_off = fbs.PropertyBag.End(b)

    fbs.Checkpoint.Start(b)
    fbs.Checkpoint.AddVersion(b, 2)  # the version ORT 1.19.2 writes and reads
    fbs.Checkpoint.AddModuleState(b, module_off)
    fbs.Checkpoint.AddOptimizerGroups(b, groups_vec)
    if bag_off is not None:
        fbs.Checkpoint.AddPropertyBag(b, bag_off)
    b.Finish(fbs.Checkpoint.End(b), file_identifier=b"ODTC")
    _write_bytes_atomic(Path(path), bytes(b.Output()))


def _temporary_prefix(name: str) -> str:
    """Name prefix of the temporary file an atomic write of ``name`` goes through."""
    return f".{name}."


@contextlib.contextmanager
def _atomic_target(path: Path) -> Iterator[str]:
    """Yield a temporary path beside ``path`` (``.<name>.<random>``) to write to; once the block
    completes, fsync it and rename it over ``path``. On any error it is deleted; a SIGKILL
    leaves it for :func:`_remove_temporaries`, and ``path`` keeps its last complete version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(path.name), dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    with _atomic_target(path) as tmp:
        Path(tmp).write_bytes(data)


def _write_text_atomic(path: Path, text: str) -> None:
    _write_bytes_atomic(path, text.encode())


# ---------------------------------------------------------------------------------------------
# One ORT training session (one selection)


def _softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
    """Sum of cross-entropy losses and number of correct argmax predictions."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss = -float(log_p[np.arange(labels.size), labels].sum())
    return loss, int((logits.argmax(axis=1) == labels).sum())


def _padded(x: np.ndarray, y: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad a short batch to ``batch_size`` by repeating its last example (fixed-batch models)."""
    short = batch_size - x.shape[0]
    if short <= 0:
        return x, y
    return (
        np.concatenate([x, np.repeat(x[-1:], short, axis=0)]),
        np.concatenate([y, np.repeat(y[-1:], short)]),
    )


class TrainingSession:
    """ORT Module + Optimizer for one selection, started from a checkpoint file.

    Args:
        paths: training artifacts of the selection.
        checkpoint: ORT checkpoint whose trainable parameters are exactly the selection
            (:func:`write_checkpoint`); its weights, moments and step are loaded.
        threads: ORT intra-op threads (None = ORT's default).
    """

    def __init__(self, paths: ArtifactPaths, checkpoint: Path, threads: int | None):
        from onnxruntime.training.api import CheckpointState, Module, Optimizer

        options = session_options(threads)
        self.state = CheckpointState.load_checkpoint(str(checkpoint))
        self.module = Module(
            str(paths.training_model), self.state, str(paths.eval_model), session_options=options
        )
        self.optimizer = Optimizer(str(paths.optimizer_model), self.module)
        self.module.train()
        self.fresh = True  # no step taken yet (the first step pays one-off allocations)

    def train_step(self, x: np.ndarray, y: np.ndarray, learning_rate: float) -> tuple[float, int]:
        """One step; returns (mean loss, correct predictions)."""
        self.optimizer.set_learning_rate(learning_rate)
        loss, logits = self.module(x, y)
        self.optimizer.step()
        self.module.lazy_reset_grad()
        return float(loss), int((logits.argmax(axis=1) == y).sum())

    def evaluate(self, batches, batch_size: int) -> tuple[float, float]:
        """Mean cross-entropy and accuracy over ``batches`` with the eval model."""
        self.module.eval()
        total_loss, correct, count = 0.0, 0, 0
        try:
            for x, y in batches:
                b = x.shape[0]
                xp, yp = _padded(x, y, batch_size)
                _, logits = self.module(xp, yp)
                loss, right = _softmax_cross_entropy(logits[:b], y)
                total_loss, correct, count = total_loss + loss, correct + right, count + b
        finally:
            self.module.train()
        return total_loss / max(count, 1), correct / max(count, 1)

    def save(self, path: Path, properties: Mapping[str, str]) -> None:
        """Save weights + optimizer state + properties to ``path`` atomically."""
        from onnxruntime.training.api import CheckpointState

        for key, value in properties.items():
            self.state.properties[key] = value
        with _atomic_target(path) as tmp:
            CheckpointState.save_checkpoint(self.state, tmp, include_optimizer_state=True)

    def weights(self) -> dict[str, np.ndarray]:
        return {name: p.data.copy() for name, p in self.state.parameters}


# ---------------------------------------------------------------------------------------------
# Records and result


@dataclass
class EpochRecord:
    """One line of ``log.jsonl`` (times in seconds unless ``_us``; accuracies in [0, 1])."""

    epoch: int  # 1-based
    period: int  # 0-based period index
    train_loss: float
    train_acc: float
    val_loss: float
    val_acc: float
    wall_time_s: float  # this epoch, training only (validation excluded, as in the paper)
    cumulative_wall_time_s: float
    learning_rate: float  # at the end of the epoch
    selection: list[int]  # indices of the selected tensors (forward order)
    n_tensors: int
    predicted_step_us: float
    measured_step_us: float  # mean step (forward+backward+update), first step of a session excluded
    reselection_s: float  # importance + selection + artifacts + session creation (0 if none)
    importance_s: float
    selection_s: float
    artifacts_s: float
    session_s: float
    artifacts_cache_hit: bool | None
    peak_rss_mb: float  # peak resident memory of this period so far
    steps: int


@dataclass
class TrainResult:
    """Summary of a finished run (also written to ``summary.json``)."""

    out_dir: str
    strategy: str
    epochs: int
    final_val_acc: float
    final_val_loss: float
    inference_val_acc: float  # of the exported model in a plain InferenceSession
    wall_time_s: float
    predicted_full_time_s: float  # full_step_us * steps (what full training would take)
    speedup: float  # predicted_full_time_s / wall_time_s
    rho_requested: float
    rho_predicted: float  # mean predicted step / t_full_us (both from the time model)
    rho_achieved: float  # mean measured step / full_step_us
    first_selection_s: float  # period 0: importance + DP + the first session (full pays one too)
    reselection_overhead_pct: float  # re-selections of periods >= 1, % of those periods' wall time
    peak_rss_mb_first_period: float
    peak_rss_mb_last_period: float
    trained_model: str


def release_native_memory() -> None:
    """Return freed native heap to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Rebuilding ORT sessions every period (importance, re-selection) frees and re-allocates
    hundreds of buffers; glibc keeps the freed pages, so RSS creeps up by ~10% over 12
    re-selections on the default model, then plateaus. Trimming after each re-selection keeps
    RSS flat (measured: 326 MiB after 1 and after 40 importance evaluations).
    """
    import ctypes

    # No gc.collect(): sessions are freed by reference counting, and a full collection costs
    # ~0.2 s once torch is imported (onnxruntime.training imports it); malloc_trim costs ~1-6 ms.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss_reset_peak() -> None:
    """Reset this process's peak RSS counter (Linux ``clear_refs``), if allowed."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _rss_peak_mb() -> float:
    """Peak resident set size (MiB) since the last reset (Linux ``VmHWM``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ---------------------------------------------------------------------------------------------
# The run


def _initial_weights(model: onnx.ModelProto, names: set[str]) -> dict[str, np.ndarray]:
    return {
        init.name: numpy_helper.to_array(init).copy()
        for init in model.graph.initializer
        if init.name in names
    }


def _num_classes(model: onnx.ModelProto) -> int | None:
    dims = model.graph.output[0].type.tensor_type.shape.dim
    if dims and dims[-1].HasField("dim_value"):
        return int(dims[-1].dim_value)
    return None


def _epoch_seed(seed: int, epoch: int) -> int:
    return seed * 1000 + epoch


def _probe_seed(seed: int, period: int) -> int:
    return seed * 1000 + 100_000 + period


class _Run:
    """State of one run (see :func:`train`); built fresh or from a run directory."""

    def __init__(
        self,
        model_path: Path,
        profile,
        config: TrainConfig,
        out_dir: Path,
        *,
        artifacts_root: Path | None,
        progress: bool,
    ):
        from . import graph, onnx_io
        from .data import load_dataset

        self.config = config.validate()
        self.out = out_dir
        self.progress = progress
        self.model_path = model_path
        self.model = LoadedModel.load(model_path).proto
        self.input_shape = tuple(model_input_shape(self.model, tuple(profile.input_shape)))
        self.tensors = graph.trainable_tensors(self.model)
        self.names = [t.name for t in self.tensors]
        self.running_stats = list(graph.running_statistics(self.model))
        self.profile = profile
        profile.check_matches(
            onnx_io.model_hash(self.model),
            batch_size=config.batch_size,
            input_shape=self.input_shape,
        )
        if list(profile.tensors) != self.names:
            raise ProfileMismatchError(
                f"the profile lists {len(profile.tensors)} tensors that differ from the "
                f"{len(self.names)} of {model_path}: re-run `etgraph profile` for this model"
            )
        # Train with the thread count the timings were measured with, unless told otherwise.
        self.threads = config.threads if config.threads is not None else profile.threads
        import onnxruntime.training.api  # noqa: F401  (one-off ~1-4 s torch import, not re-selection)

        self.dataset = load_dataset(
            config.data,
            input_shape=self.input_shape,
            num_classes=_num_classes(self.model),
            val_fraction=config.val_fraction,
            seed=config.seed,
        )
        steps = self.dataset.steps_per_epoch(config.batch_size)
        if steps < 1:
            from .errors import DataError

            raise DataError(
                f"dataset {self.dataset.name} has {self.dataset.n_train} training images, "
                f"fewer than the batch size {config.batch_size}"
            )
        if config.max_steps_per_epoch is not None:
            steps = min(steps, config.max_steps_per_epoch)
        self.steps_per_epoch = steps
        self.total_steps = steps * config.epochs
        self.cache = ArtifactCache(artifacts_root or out_dir / ARTIFACTS_DIR)
        self._evaluator = None

    # -- pieces ------------------------------------------------------------------------------

    def evaluator(self):
        from .importance import ImportanceEvaluator

        if self._evaluator is None:
            self._evaluator = ImportanceEvaluator(
                self.model,
                self.names,
                self.running_stats,
                self.cache,
                weight_decay=self.config.weight_decay,
                threads=self.threads,
            )
        return self._evaluator

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

    def predicted_step_us(self, mask: np.ndarray) -> float:
        return self.profile.predicted_step_us(mask)

    # -- the loop ----------------------------------------------------------------------------

    def run(self, start_epoch: int, carried: CarriedState, history: list[dict]) -> TrainResult:
        """Train from ``start_epoch`` (a period boundary) with ``carried`` state to the end."""
        cfg = self.config
        session: TrainingSession | None = None
        mask_prev: np.ndarray | None = None
        (self.out / SESSION_DIR).mkdir(parents=True, exist_ok=True)
        records = list(history)
        period_start = start_epoch
        while period_start < cfg.epochs:
            period = period_start // cfg.period
            period_end = min((period + 1) * cfg.period, cfg.epochs)
            _rss_reset_peak()
            if session is not None:  # the state at the end of the last period, as checkpointed
                carried, _, _ = read_checkpoint(self.out / CHECKPOINT_FILE)
            session, mask, timings = self._reselect(period, session, mask_prev, carried)
            mask_prev = mask
            for epoch in range(period_start, period_end):
                record = self._train_epoch(epoch, period, session, mask, timings, records)
                timings = None  # re-selection is charged to the period's first epoch only
                records.append(asdict(record))
                self._append_log(records[-1])
            t0 = time.perf_counter()
            self._save_checkpoint(session, period_end, mask)
            log.debug("checkpoint after epoch %d: %.3f s", period_end, time.perf_counter() - t0)
            period_start = period_end
        return self._finish(session, records)

    def _reselect(
        self,
        period: int,
        session: TrainingSession | None,
        mask_prev: np.ndarray | None,
        carried: CarriedState,
    ) -> tuple[TrainingSession, np.ndarray, dict]:
        """Importance -> selection -> artifacts -> new session (kept if the mask is unchanged).

        Returns the session, the mask and the timings (s) of each part, all counted as
        training time.
        """
        cfg = self.config
        t0 = time.perf_counter()
        importance = None
        if cfg.strategy in IMPORTANCE_STRATEGIES:
            batches = [
                self.dataset.probe_batch(cfg.batch_size, _probe_seed(cfg.seed, period) + 7919 * i)
                for i in range(cfg.probe_batches)
            ]
            importance = self.evaluator().evaluate(carried.weights, batches, cfg.learning_rate)
            importance = importance.importance
        t1 = time.perf_counter()
        mask = strategy_mask(
            cfg.strategy, self.tensors, self.profile, cfg.rho, importance, resolution=cfg.resolution
        )
        t2 = time.perf_counter()
        cache_hit = None
        if session is None or mask_prev is None or not np.array_equal(mask, mask_prev):
            trainable = [n for n, s in zip(self.names, mask, strict=True) if s]
            frozen = [n for n, s in zip(self.names, mask, strict=True) if not s]
            frozen += self.running_stats
            paths, cache_hit = self.cache.get(
                self.model, trainable, frozen, weight_decay=cfg.weight_decay
            )
            t3 = time.perf_counter()
            session = None  # release the old session before building the new one
            ckpt = self.out / SESSION_DIR / CHECKPOINT_FILE
            write_checkpoint(ckpt, carried, trainable, initial_learning_rate=cfg.learning_rate)
            session = TrainingSession(paths, ckpt, self.threads)
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
        from tqdm import tqdm

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
        t_epoch = time.perf_counter()
        for x, y in self.train_batches(epoch):
            lr = cosine_learning_rate(cfg.learning_rate, global_step, self.total_steps)
            ts = time.perf_counter()
            loss, right = session.train_step(x, y, lr)
            step_times.append(time.perf_counter() - ts)
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
        val_loss, val_acc = session.evaluate(self.val_batches(), cfg.batch_size)
        t = timings or {}
        epoch_s = train_s + t.get("reselection_s", 0.0)
        previous = records[-1]["cumulative_wall_time_s"] if records else 0.0
        record = EpochRecord(
            epoch=epoch + 1,
            period=period,
            train_loss=float(np.mean(losses)),
            train_acc=correct / max(seen, 1),
            val_loss=val_loss,
            val_acc=val_acc,
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
            peak_rss_mb=_rss_peak_mb(),
            steps=len(step_times),
        )
        if self.progress:
            tqdm.write(
                f"epoch {epoch + 1:>3}/{cfg.epochs}  loss {record.train_loss:.4f}  "
                f"acc {record.train_acc:.3f}  val_loss {val_loss:.4f}  val_acc {val_acc:.3f}  "
                f"{epoch_s:.1f}s  {int(mask.sum())}/{mask.size} tensors"
            )
        return record

    def _append_log(self, record: dict) -> None:
        with open(self.out / LOG_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _save_checkpoint(self, session: TrainingSession, epoch: int, mask: np.ndarray) -> None:
        """Checkpoint after ``epoch`` (a period end): weights, moments, step and run state."""
        run_state = {
            "epoch": epoch,
            "global_step": epoch * self.steps_per_epoch,
            "selection": [int(i) for i in np.flatnonzero(mask)],
            "config_hash": self.config.digest(),
            "rng": {
                "scheme": "epoch seed = seed*1000+epoch; probe seed = seed*1000+100000+period",
                "seed": self.config.seed,
            },
        }
        session.save(self.out / CHECKPOINT_FILE, {RUN_PROPERTY: json.dumps(run_state)})

    def _finish(self, session: TrainingSession | None, records: list[dict]) -> TrainResult:
        from .plots import plot_run

        cfg = self.config
        if session is None:  # resumed after the last checkpoint: rebuild from it
            session = self._session_from_checkpoint()
        trained = self.out / TRAINED_MODEL_FILE
        tmp = self.out / f".{TRAINED_MODEL_FILE}.tmp"
        session.module.export_model_for_inferencing(str(tmp), [self.model.graph.output[0].name])
        os.replace(tmp, trained)
        _, inference_acc = evaluate_onnx(trained, self.val_batches(), cfg.batch_size)
        with contextlib.suppress(Exception):
            plot_run(self.out)
        shutil.rmtree(self.out / SESSION_DIR, ignore_errors=True)
        result = _result(self, records, inference_acc, trained)
        _write_text_atomic(self.out / SUMMARY_FILE, json.dumps(asdict(result), indent=2) + "\n")
        return result

    def _session_from_checkpoint(self) -> TrainingSession:
        state, requires_grad, _ = read_checkpoint(self.out / CHECKPOINT_FILE)
        frozen = [n for n in self.names if n not in set(requires_grad)] + self.running_stats
        paths, _ = self.cache.get(
            self.model, requires_grad, frozen, weight_decay=self.config.weight_decay
        )
        return TrainingSession(paths, self.out / CHECKPOINT_FILE, self.threads)


def _result(run: _Run, records: list[dict], inference_acc: float, trained: Path) -> TrainResult:
    cfg, prof = run.config, run.profile
    steps = sum(r["steps"] for r in records)
    wall = sum(r["wall_time_s"] for r in records)
    later = [r for r in records if r["period"] > 0]
    later_wall = sum(r["wall_time_s"] for r in later)
    first_selection = sum(r["reselection_s"] for r in records if r["period"] == 0)
    predicted_full = prof.full_step_us * 1e-6 * steps
    weights = np.array([r["steps"] for r in records], dtype=np.float64)
    measured = np.array([r["measured_step_us"] for r in records], dtype=np.float64)
    predicted = np.array([r["predicted_step_us"] for r in records], dtype=np.float64)
    ok = np.isfinite(measured)
    rss = {}
    for r in records:
        rss[r["period"]] = max(rss.get(r["period"], 0.0), r["peak_rss_mb"])
    last = records[-1] if records else {}
    return TrainResult(
        out_dir=str(run.out),
        strategy=cfg.strategy,
        epochs=len(records),
        final_val_acc=float(last.get("val_acc", float("nan"))),
        final_val_loss=float(last.get("val_loss", float("nan"))),
        inference_val_acc=float(inference_acc),
        wall_time_s=float(wall),
        predicted_full_time_s=float(predicted_full),
        speedup=float(predicted_full / wall) if wall > 0 else float("nan"),
        rho_requested=cfg.rho,
        rho_predicted=float(np.average(predicted, weights=weights) / prof.t_full_us),
        rho_achieved=float(np.average(measured[ok], weights=weights[ok]) / prof.full_step_us)
        if ok.any()
        else float("nan"),
        first_selection_s=float(first_selection),
        reselection_overhead_pct=float(
            100.0 * sum(r["reselection_s"] for r in later) / later_wall if later_wall > 0 else 0.0
        ),
        peak_rss_mb_first_period=float(rss[min(rss)]) if rss else float("nan"),
        peak_rss_mb_last_period=float(rss[max(rss)]) if rss else float("nan"),
        trained_model=str(trained),
    )


def evaluate_onnx(model_path: str | os.PathLike, batches, batch_size: int) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of an inference ONNX model in a plain InferenceSession.

    Short batches are padded to ``batch_size`` (models exported with a fixed batch dimension)
    and the padding is not scored.

    Returns:
        ``(mean loss, accuracy in [0, 1])``.
    """
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    input_name = sess.get_inputs()[0].name
    total_loss, correct, count = 0.0, 0, 0
    for x, y in batches:
        b = x.shape[0]
        xp, _ = _padded(x, y, batch_size)
        logits = sess.run(None, {input_name: xp})[0][:b]
        loss, right = _softmax_cross_entropy(logits, y)
        total_loss, correct, count = total_loss + loss, correct + right, count + b
    return total_loss / max(count, 1), correct / max(count, 1)


# ---------------------------------------------------------------------------------------------
# Public entry points


def train(
    model_path: str | os.PathLike,
    profile,
    config: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    artifacts_root: str | os.PathLike | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train ``model_path`` with ``config.strategy``, re-selecting every ``config.period`` epochs.

    Args:
        model_path: forward ONNX classifier (one input, output ``logits``).
        profile: :class:`etgraph.profiler.Profile` of this model at ``config.batch_size``.
        config: the run's settings.
        out_dir: run directory (created). Must not hold another run's checkpoint (use
            :func:`resume` to continue one).
        artifacts_root: artifact cache (default ``out_dir/artifacts``); share it between runs
            of the same model to make repeated selections free.
        progress: show tqdm bars and per-epoch lines on stderr.

    Returns:
        A :class:`TrainResult` (also in ``out_dir/summary.json``).

    Raises:
        ConfigError: bad settings or an existing run in ``out_dir``.
        ProfileMismatchError: the profile is of another model or batch size.
        InfeasibleBudgetError: ``rho`` is too small for any selection (gives the smallest rho).
        DataError, ModelError: the data or model cannot be used.
    """
    out = Path(out_dir)
    config = config.validate()
    _ensure_writable(out)
    if (out / CHECKPOINT_FILE).exists() or (out / RUN_FILE).exists():
        raise ConfigError(
            f"{out} already holds a training run: continue it with `etgraph train --resume {out}` "
            "or choose another --out"
        )
    model_path = Path(model_path).resolve()
    run = _Run(
        model_path,
        profile,
        config,
        out,
        artifacts_root=Path(artifacts_root) if artifacts_root else None,
        progress=progress,
    )
    profile.save(out / PROFILE_FILE)
    run_info = {
        "model": str(model_path),
        "config": config.to_json(),
        "config_hash": config.digest(),
        "artifacts_root": str(Path(artifacts_root).resolve()) if artifacts_root else None,
    }
    _write_text_atomic(out / RUN_FILE, json.dumps(run_info, indent=2) + "\n")
    (out / LOG_FILE).write_text("")
    carried = CarriedState(_initial_weights(run.model, set(run.names) | set(run.running_stats)))
    return run.run(0, carried, [])


def resume(out_dir: str | os.PathLike, *, progress: bool = True) -> TrainResult:
    """Continue the run in ``out_dir`` from its last checkpoint (after any interruption).

    The work after the last checkpoint (at most the current period) is repeated; the run ends
    with the configured number of epochs and, given the same data, the same selections and
    losses as an uninterrupted run. A run that had not reached its first checkpoint restarts.

    Raises:
        CheckpointError: ``out_dir`` holds no run, or its checkpoint is corrupt or from another
            configuration.
    """
    from .profiler import Profile

    out = Path(out_dir)
    try:
        info = json.loads((out / RUN_FILE).read_text())
        config = TrainConfig(**info["config"]).validate()
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{out} holds no training run ({RUN_FILE} missing): start one with `etgraph train`"
        ) from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{out / RUN_FILE} is corrupt: start a new run") from exc
    if info.get("config_hash") != config.digest():
        raise CheckpointError(f"{out / RUN_FILE} was modified (config hash differs)")
    profile = Profile.load(out / PROFILE_FILE)
    run = _Run(
        Path(info["model"]),
        profile,
        config,
        out,
        artifacts_root=Path(info["artifacts_root"]) if info.get("artifacts_root") else None,
        progress=progress,
    )
    _remove_temporaries(out)
    if not info.get("artifacts_root"):  # the run's own cache (a shared one may be in use)
        run.cache.remove_temporaries()
    records = _read_log(out / LOG_FILE)
    if not (out / CHECKPOINT_FILE).exists():
        log.info("no checkpoint in %s yet: restarting the run", out)
        (out / LOG_FILE).write_text("")
        carried = CarriedState(_initial_weights(run.model, set(run.names) | set(run.running_stats)))
        return run.run(0, carried, [])
    carried, requires_grad, properties = read_checkpoint(out / CHECKPOINT_FILE)
    try:
        run_state = json.loads(properties[RUN_PROPERTY])
        epoch = int(run_state["epoch"])
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint {out / CHECKPOINT_FILE} has no run state: it was not written by etgraph"
        ) from exc
    if run_state.get("config_hash") != config.digest():
        raise CheckpointError(
            f"checkpoint {out / CHECKPOINT_FILE} belongs to another configuration"
        )
    missing = (set(run.names) | set(run.running_stats)) - set(carried.weights)
    if missing:
        raise CheckpointError(
            f"checkpoint {out / CHECKPOINT_FILE} lacks tensors {sorted(missing)[:3]}: "
            "it belongs to another model"
        )
    # A tensor of the wrong shape or dtype would fail deep inside ORT: refuse it here.
    for init in run.model.graph.initializer:
        if init.name in carried.weights:
            have = carried.weights[init.name]
            want = (tuple(init.dims), onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
            if (have.shape, have.dtype) != want:
                raise CheckpointError(
                    f"checkpoint {out / CHECKPOINT_FILE} holds {init.name!r} as {have.dtype} "
                    f"{list(have.shape)}, the model needs {want[1]} {list(want[0])}: it is "
                    "corrupt or of another model; delete the run directory to start over"
                )
    records = [r for r in records if r["epoch"] <= epoch]
    _write_text_atomic(out / LOG_FILE, "".join(json.dumps(r) + "\n" for r in records))
    log.info("resuming %s at epoch %d of %d", out, epoch, config.epochs)
    return run.run(epoch, carried, records)


def _remove_temporaries(out: Path) -> None:
    """Delete the temporary files of atomic writes (:func:`_atomic_target`) a killed run left
    half-written in its directory. Never read, they would otherwise stay forever."""
    names = (CHECKPOINT_FILE, LOG_FILE, SUMMARY_FILE, RUN_FILE, TRAINED_MODEL_FILE)
    for p in out.iterdir():
        if p.is_file() and any(p.name.startswith(_temporary_prefix(n)) for n in names):
            log.info("removing %s, left by an interrupted run", p)
            with contextlib.suppress(OSError):
                p.unlink()


def _read_log(path: Path) -> list[dict]:
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            break  # a line cut by a kill: everything after it is repeated anyway
    return records


def _ensure_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".etgraph-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"output directory {path} is not writable ({exc.strerror}): choose another with --out"
        ) from exc


def format_summary(result: TrainResult) -> str:
    """One screen of text summarising ``result`` for the CLI."""
    lines = [
        f"strategy            {result.strategy}  ({result.epochs} epochs)",
        f"val accuracy        {100 * result.final_val_acc:.2f} %   "
        f"(exported model: {100 * result.inference_val_acc:.2f} %)",
        f"val loss            {result.final_val_loss:.4f}",
        f"wall time           {result.wall_time_s:.1f} s  (training, validation excluded)",
        f"full training (pred){result.predicted_full_time_s:>8.1f} s  "
        f"-> speedup {result.speedup:.2f}x",
        f"rho                 requested {result.rho_requested:.2f}  predicted "
        f"{result.rho_predicted:.2f}  achieved {result.rho_achieved:.2f}",
        f"selection           first {result.first_selection_s:.2f} s, re-selections "
        f"{result.reselection_overhead_pct:.2f} % of their periods' wall time",
        f"peak RSS            first period {result.peak_rss_mb_first_period:.0f} MiB, last "
        f"{result.peak_rss_mb_last_period:.0f} MiB",
        f"trained model       {result.trained_model}",
    ]
    return "\n".join(lines)
