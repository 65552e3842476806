"""Every ONNX Runtime session etgraph opens, in one place (the seam for a later backend).

* :func:`session_options` — the options of every session, by role (:data:`ROLES`: ``train``,
  ``profile``, ``probe``, ``eval``; :class:`OrtConfig`, measured by
  ``benchmarks/ort_config.py``).
* :func:`choose_train_config` — the training sessions' options chosen per run by measurement
  (:data:`TRAIN_CANDIDATES` stepped side by side on the run's own full artifacts).
* :class:`TrainingSession` — ORT training ``Module`` + ``Optimizer`` for one selection, started
  from a checkpoint: the training loop, the profiler's real steps and ``measure`` use it.
* :class:`GradientSession` — a ``Module`` without optimizer whose parameters are overwritten
  before each use: importance evaluation reads gradients from it.
* :func:`inference_session` — a plain ``onnxruntime.InferenceSession`` (profiled training graphs,
  the optimizer model, exported inference models).
* :func:`evaluate_onnx` — loss and metric (accuracy, or MSE) of an exported inference model.
* :func:`check_sessions` — the first steps of a model's sessions run in a forked child process
  (:func:`run_isolated`), so a native crash in ORT becomes a one-line :class:`NativeCrashError`
  instead of taking the process down; recorded per model, so it is paid once.

Models are fed by input name: a batch's inputs are a mapping input name -> array (or, for a
single-input model, one array; :func:`as_inputs`); the target goes last, as ORT's loss blocks
add it (``labels`` int64 ``[B]`` for cross-entropy, ``target`` float32 ``[B, D]`` for MSE).

The onnxruntime-training wheel imports ``onnxruntime.training`` (and with it torch) as part of
``import onnxruntime``, so importing its training API here costs nothing more.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.training import api

from .artifact_weights import bake_frozen
from .artifacts import ArtifactCache
from .checkpoint import checkpoint_target, read_checkpoint
from .errors import ModelError, NativeCrashError
from .files import private_temp_dir, write_atomic
from .host import usable_threads
from .io_specs import random_batch
from .model import LoadedModel

log = logging.getLogger(__name__)

__all__ = [
    "ROLES",
    "TRAIN_CANDIDATES",
    "ConfigChoice",
    "GradientSession",
    "Isolated",
    "NativeCrashError",
    "OrtConfig",
    "TrainingSession",
    "as_inputs",
    "check_sessions",
    "choose_train_config",
    "evaluate_onnx",
    "inference_session",
    "looks_like_probabilities",
    "padded_batch",
    "pick_fastest",
    "run_isolated",
    "score",
    "session_options",
    "shared_arena",
    "softmax_cross_entropy",
]


@dataclass(frozen=True)
class OrtConfig:
    """Session options etgraph varies per session role (measured by
    ``benchmarks/ort_config.py``; docs/results.md, "ORT session options"). The defaults are ORT's.

    Attributes:
        spinning: ``session.intra_op.allow_spinning``: pool threads busy-wait for work between
            the parallel sections of a run (ORT's default: on).
        stop_spinning: ``session.force_spinning_stop``: the pool stops spinning as soon as a run
            returns, so an idle session never takes the cores from the one that runs next.
        optimization: graph optimisation level, ``"basic"``, ``"extended"`` or ``"all"``.
        arena: the CPU memory arena (``enable_cpu_mem_arena``).
        mem_pattern: memory-pattern planning (``enable_mem_pattern``).
        shared_arena: the session allocates from the process's one shared CPU arena
            (:func:`shared_arena`, ``session.use_env_allocators``), which grows by exactly what
            is requested (``kSameAsRequested``), instead of its own arena growing by powers of
            two (ORT's default). With ORT's default, the memory pattern's one block, requested
            on the second step, does not fit in the chunks the first step left and the arena
            grows again: +116 MiB on a one-tensor selection at ResNet50's input (128 px, batch
            4), +91 MiB on MobileNetV2's full training; the shared arena stays flat and was no
            slower (docs/how-it-works.md, "The memory model"). Ignored with ``arena=False``.
    """

    spinning: bool = True
    stop_spinning: bool = False
    optimization: str = "all"
    arena: bool = True
    mem_pattern: bool = True
    shared_arena: bool = False


_LEVELS = {
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

_NO_SPINNING = OrtConfig(spinning=False, shared_arena=True)

#: The configuration of each session role: ``train`` (the training loop's Module + Optimizer,
#: its full reference steps and the profiler's real steps: the profile measures what training
#: runs), ``profile`` (the profiler's per-node profiled graphs and optimizer runs), ``probe``
#: (importance's GradientSession), ``eval`` (inference sessions scoring an exported model).
#: Measured on 2 cores shared with other work (``benchmarks/ort_config.py``, README): spinning
#: on (ORT's default) made every role 2-4x slower under load, force_spinning_stop halved that
#: but did not remove it; graph optimisation below "all", no arena or no memory pattern were
#: slower or no better. Spinning off wins in every role there. On a quiet machine spinning on
#: wins, so a training run measures which to use (:func:`choose_train_config`) and passes the
#: winner as ``config`` to its sessions; ``train`` here is the choice of a run that does not.
#: Every role allocates from the shared arena (:func:`shared_arena`): what a released session
#: frees is reused by the next.
ROLES: dict[str, OrtConfig] = {
    "train": _NO_SPINNING,
    "profile": _NO_SPINNING,
    "probe": _NO_SPINNING,
    "eval": _NO_SPINNING,
}


_SHARED_ARENA: list[bool] = []  # registered in this process (an ORT environment holds one)


def shared_arena() -> None:
    """Register the process's shared CPU arena with ORT's environment, once per process.

    One BFC arena for every session whose options set ``session.use_env_allocators`` (an
    :class:`OrtConfig` with ``shared_arena``): no memory limit, extended by exactly the bytes
    requested (``arena_extend_strategy`` 1, ``kSameAsRequested``), ORT's default initial chunk
    (1 MiB) and dead-bytes limit (128 MiB). Like every ORT CPU arena it never returns memory to
    the OS while the process lives, but a released session's chunks serve the next session.
    """
    if _SHARED_ARENA:
        return
    info = ort.OrtMemoryInfo(
        "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
    )
    ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))
    _SHARED_ARENA.append(True)


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


def session_options(
    threads: int | None,
    profile_prefix: str | None = None,
    *,
    role: str = "train",
    config: OrtConfig | None = None,
) -> ort.SessionOptions:
    """``onnxruntime.SessionOptions`` of every ORT session etgraph opens.

    Sequential execution, ``threads`` intra-op threads (None = ORT's default, one per core; at
    most the CPUs this process may use, :func:`etgraph.host.usable_threads`), and the
    :class:`OrtConfig` of ``role`` (:data:`ROLES`) unless ``config`` is given.

    Args:
        threads: intra-op threads, or None.
        profile_prefix: turn on ORT's per-node profiling, trace files named by this prefix.
        role: a key of :data:`ROLES`.
        config: explicit options (benchmarks), overriding ``role``.

    Raises:
        KeyError: unknown role.
    """
    cfg = config if config is not None else ROLES[role]
    so = ort.SessionOptions()
    if threads is not None:
        so.intra_op_num_threads = usable_threads(int(threads))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if cfg.spinning else "0")
    if cfg.spinning and cfg.stop_spinning:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    so.graph_optimization_level = _LEVELS[cfg.optimization]
    so.enable_cpu_mem_arena = cfg.arena
    so.enable_mem_pattern = cfg.mem_pattern
    if cfg.arena and cfg.shared_arena:
        shared_arena()
        so.add_session_config_entry("session.use_env_allocators", "1")
    # Errors come back as exceptions; native log lines would break the one-line CLI errors.
    so.log_severity_level = 4
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so


def inference_session(
    model: str | os.PathLike | bytes, options: ort.SessionOptions | None = None
) -> ort.InferenceSession:
    """A plain CPU ``InferenceSession`` of ``model`` (path or serialized bytes)."""
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def class_logits(outputs: np.ndarray) -> np.ndarray:
    """A classifier's output as logits [B, K]: unit dims after K dropped (the ``[B, K, 1, 1]``
    of a 1x1-conv classifier, restored on the exported model by
    :class:`passes.onnx.RestoreHeadPass`).

    Raises:
        ValueError: a dim after K is not 1 (not a classifier's output).
    """
    if outputs.ndim > 2:
        if any(d != 1 for d in outputs.shape[2:]):
            raise ValueError(f"output of shape {list(outputs.shape)} is not [B, K] logits")
        return outputs.reshape(outputs.shape[:2])
    return outputs


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
    """Sum of cross-entropy losses and number of correct argmax predictions.

    Args:
        logits: float [B, K] (or [B, K, 1, ...], :func:`class_logits`). labels: int [B] in
            [0, K).
    """
    logits = class_logits(logits)
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss = -float(log_p[np.arange(labels.size), labels].sum())
    return loss, int((logits.argmax(axis=1) == labels).sum())


def score(loss: str, outputs: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Sum over the batch of the loss and of the metric.

    Args:
        loss: ``"ce"`` (outputs logits float [B, K], y int [B]: metric = correct predictions)
            or ``"mse"`` (outputs and y float [B, D]: metric = per-example mean squared error,
            so its mean over examples is the MSE).

    Returns:
        ``(loss sum, metric sum)``; divide by the number of examples for means.
    """
    if loss == "ce":
        return softmax_cross_entropy(outputs, y)
    err = ((outputs.astype(np.float64) - y.astype(np.float64)) ** 2).reshape(len(y), -1)
    total = float(err.mean(axis=1).sum())
    return total, total


def as_inputs(x, names: Sequence[str]) -> dict[str, np.ndarray]:
    """A batch's model inputs by name: a mapping is taken as it is; an array is the one input
    of a single-input model (``names`` = the model's input names, graph order)."""
    if isinstance(x, Mapping):
        return dict(x)
    if len(names) != 1:
        raise ValueError(f"a single array cannot feed the {len(names)} inputs {list(names)}")
    return {names[0]: x}


def _batch_size_of(inputs: Mapping[str, np.ndarray]) -> int:
    return int(next(iter(inputs.values())).shape[0])


def padded_batch(
    inputs: Mapping[str, np.ndarray], y: np.ndarray, batch_size: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Pad a short batch to ``batch_size`` by repeating its last example (fixed-batch models)."""
    short = batch_size - _batch_size_of(inputs)
    if short <= 0:
        return dict(inputs), y

    def pad(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.repeat(a[-1:], short, axis=0)])

    return {k: pad(v) for k, v in inputs.items()}, pad(y)


def _module_args(module, inputs: Mapping[str, np.ndarray], y: np.ndarray) -> list[np.ndarray]:
    """Positional user inputs of a training ``Module``: the model's inputs in the order of
    ``module.input_names()``, the target (ORT's loss block adds it as the last input) last."""
    names = module.input_names()
    return [inputs[n] for n in names[:-1]] + [y]


class TrainingSession:
    """ORT training ``Module`` + ``Optimizer`` for one selection, started from a checkpoint.

    Args:
        directory: artifact directory (``training_model.onnx``, ``eval_model.onnx``,
            ``optimizer_model.onnx``; :class:`etgraph.artifacts.ArtifactPaths`).
        checkpoint: ORT checkpoint whose trainable parameters are exactly the artifacts'
            ``requires_grad`` (:func:`etgraph.checkpoint.write_checkpoint`, or the artifacts' own);
            its weights, moments and step are loaded.
        threads: ORT intra-op threads (None = ORT's default).
        loss: the loss the artifacts were built with (``"ce"`` or ``"mse"``; :func:`score`).
        input_names: the model's input names (graph order), needed to feed batches whose
            inputs are one array (:func:`as_inputs`).
        config: session options (benchmarks); default the "train" role's.
        bake: open the Module on copies of the graphs in which the frozen parameters are
            constants valued from ``checkpoint`` (:func:`etgraph.artifacts.bake_frozen`, in a
            temporary directory removed with the session), so ORT optimises the frozen part of
            the network (issue #16); False: the artifacts as generated (benchmarks).
        weights: the values ``checkpoint`` holds, by name, if the caller has them (baking
            then does not read the file again); at least every frozen parameter.

    Raises:
        RuntimeError: ORT cannot load the artifacts or the checkpoint.
        CheckpointError: ``bake`` and the checkpoint cannot be read.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        checkpoint: str | os.PathLike,
        threads,
        *,
        loss: str = "ce",
        input_names: Sequence[str] = (),
        config: OrtConfig | None = None,
        bake: bool = True,
        weights: Mapping[str, np.ndarray] | None = None,
    ):
        d = Path(directory)
        self.loss = loss
        self.input_names = list(input_names)
        self._baked = None
        if bake:
            self._baked = private_temp_dir("baked")
            if weights is None:  # frozen: no moments
                weights = read_checkpoint(checkpoint, moments=False)[0].weights
            d = bake_frozen(d, weights, self._baked.name)
            del weights
        self.state = api.CheckpointState.load_checkpoint(str(checkpoint))
        self.module = api.Module(
            str(d / "training_model.onnx"),
            self.state,
            str(d / "eval_model.onnx"),
            session_options=session_options(threads, role="train", config=config),
        )
        self.optimizer = api.Optimizer(str(d / "optimizer_model.onnx"), self.module)
        self.module.train()
        self.fresh = True  # no step taken yet (the first step pays one-off allocations)

    def step(self, x, y: np.ndarray):
        """One training step at the optimizer's current learning rate: forward, backward,
        AdamW update, gradient reset. ``x``: the inputs by name (:func:`as_inputs`). Returns
        the Module's outputs ``(loss, output)``."""
        out = self.module(*_module_args(self.module, as_inputs(x, self.input_names), y))
        self.optimizer.step()
        self.module.lazy_reset_grad()
        return out

    def train_step(self, x, y: np.ndarray, learning_rate: float) -> tuple[float, float]:
        """One step at ``learning_rate``; returns (mean loss, metric sum over the batch:
        correct predictions for ce, summed per-example MSE for mse; :func:`score`)."""
        self.optimizer.set_learning_rate(learning_rate)
        loss, outputs = self.step(x, y)
        if self.loss == "ce":
            return float(loss), int((class_logits(outputs).argmax(axis=1) == y).sum())
        return float(loss), score(self.loss, outputs, y)[1]

    def evaluate(self, batches, batch_size: int) -> tuple[float, float]:
        """Mean loss and metric (accuracy for ce, MSE for mse) over ``batches`` with the eval
        model (short batches padded, the padding not scored)."""
        self.module.eval()
        total_loss, total_metric, count = 0.0, 0.0, 0
        try:
            for x, y in batches:
                inputs = as_inputs(x, self.input_names)
                b = _batch_size_of(inputs)
                xp, yp = padded_batch(inputs, y, batch_size)
                _, outputs = self.module(*_module_args(self.module, xp, yp))
                loss, metric = score(self.loss, outputs[:b], y)
                total_loss, total_metric = total_loss + loss, total_metric + metric
                count += b
        finally:
            self.module.train()
        return total_loss / max(count, 1), total_metric / max(count, 1)

    def save(self, path: str | os.PathLike, properties: Mapping[str, str]) -> None:
        """Save weights + optimizer state + string properties to ``path`` atomically, its
        digest recorded and the previous version kept (:func:`etgraph.checkpoint.
        checkpoint_target`)."""
        for key, value in properties.items():
            self.state.properties[key] = value
        with checkpoint_target(path) as tmp:
            api.CheckpointState.save_checkpoint(self.state, str(tmp), include_optimizer_state=True)

    def release_sessions(self) -> None:
        """Drop the Module and Optimizer (their ORT sessions and arenas: the step's workspace),
        keeping the state (weights, gradients, AdamW moments): :meth:`save` still works, no
        other method does. For saving under a memory budget."""
        self.module = self.optimizer = None

    def weights(self) -> dict[str, np.ndarray]:
        """Copies of every parameter's current value, by name."""
        return {name: p.data.copy() for name, p in self.state.parameters}


class GradientSession:
    """A training ``Module`` (no optimizer) whose parameters are set before each use.

    Args:
        directory: artifact directory with every tensor trainable.
        threads: ORT intra-op threads (None = ORT's default).
        input_names: the model's input names (graph order), needed to feed batches whose
            inputs are one array (:func:`as_inputs`).
        config: session options (benchmarks); default the "probe" role's.
        checkpoint: the checkpoint to start from (trainable set = the artifacts'); default the
            artifacts' own.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        threads: int | None,
        *,
        input_names: Sequence[str] = (),
        config: OrtConfig | None = None,
        checkpoint: str | os.PathLike | None = None,
    ):
        self.directory = Path(directory)
        self.input_names = list(input_names)
        source = self.directory / "checkpoint" if checkpoint is None else Path(checkpoint)
        self.state = api.CheckpointState.load_checkpoint(str(source))
        self.module = api.Module(
            str(self.directory / "training_model.onnx"),
            self.state,
            session_options=session_options(threads, role="probe", config=config),
        )
        self._optimizer = None  # opened by the first train_step

    def set_parameters(self, weights: Mapping[str, np.ndarray], names: Iterable[str]) -> None:
        """Overwrite parameters ``names`` with ``weights[name]``, in place.

        Writes through the zero-copy views: assigning ``parameters[name] = a`` segfaults in ORT
        1.19.2 before a Module exists on the state; the views are safe.
        """
        params = self.state.parameters
        for name in names:
            params[name].data[...] = weights[name]

    def accumulate(self, batches) -> list[float]:
        """Forward + backward of every batch, gradients accumulated from zero (ORT accumulates
        until ``lazy_reset_grad``). Returns the loss of each batch."""
        self.module.train()
        self.module.lazy_reset_grad()  # drop the previous use's gradients at the next call
        losses = []
        for x, y in batches:
            out = self.module(*_module_args(self.module, as_inputs(x, self.input_names), y))
            losses.append(float(out[0] if isinstance(out, (tuple, list)) else out))
        return losses

    def gradient(self, name: str) -> np.ndarray:
        """Zero-copy view of the accumulated gradient of ``name`` (valid until the next use)."""
        return self.state.parameters[name].grad

    def train_step(self, x, y: np.ndarray, learning_rate: float) -> float:
        """A full training step, as :meth:`TrainingSession.train_step` (the training loop's
        reference steps, at learning rate 0: AdamW then changes no weight, at the same cost).
        The AdamW session is opened at the first call. Returns the mean loss."""
        if self._optimizer is None:
            self._optimizer = api.Optimizer(
                str(self.directory / "optimizer_model.onnx"), self.module
            )
        self.module.train()
        self._optimizer.set_learning_rate(learning_rate)
        out = self.module(*_module_args(self.module, as_inputs(x, self.input_names), y))
        self._optimizer.step()
        self.module.lazy_reset_grad()
        return float(out[0] if isinstance(out, (tuple, list)) else out)


def evaluate_onnx(
    model_path: str | os.PathLike,
    batches,
    batch_size: int,
    *,
    loss: str = "ce",
    output: str | None = None,
) -> tuple[float, float]:
    """Mean loss and metric of an inference ONNX model in a plain InferenceSession.

    Short batches are padded to ``batch_size`` (models exported with a fixed batch dimension)
    and the padding is not scored.

    Args:
        model_path: inference model, fed by input name.
        batches: ``(x, y)``: ``x`` the inputs by name (or one array for a single-input model),
            ``y`` int64 [b] class indices (ce) or float32 [b, D] targets (mse), b <= batch_size.
        loss: ``"ce"`` or ``"mse"`` (:func:`score`).
        output: the output scored (default: the first).

    Returns:
        ``(mean loss, metric)``: accuracy in [0, 1] for ce, the MSE for mse.
    """
    sess = inference_session(model_path, session_options(None, role="eval"))  # no native lines
    names = [i.name for i in sess.get_inputs()]
    fetch = [output] if output is not None else [sess.get_outputs()[0].name]
    total_loss, total_metric, count = 0.0, 0.0, 0
    for x, y in batches:
        inputs = as_inputs(x, names)
        b = _batch_size_of(inputs)
        xp, _ = padded_batch(inputs, y, batch_size)
        outputs = sess.run(fetch, xp)[0][:b]
        loss_sum, metric = score(loss, outputs, y)
        total_loss, total_metric, count = total_loss + loss_sum, total_metric + metric, count + b
    return total_loss / max(count, 1), total_metric / max(count, 1)


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

    One all-trainable session per candidate (:class:`GradientSession` on ``directory``, the
    run's full artifacts, from their own checkpoint) takes one warm-up step, then
    :func:`pick_fastest` times ``rounds`` steps of each side by side. Every step runs at
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


# ---- the first steps of a model's sessions, in a child process (issue 27) --------------------


#: Seconds the isolated first steps may take; past it the child is stopped and the command goes
#: on in-process (a hang is not a crash; nothing is recorded).
ISOLATION_TIMEOUT_S = 900.0


#: Signals a process raises on itself when native code fails (a crash, not a kill from outside).
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}


@dataclass(frozen=True)
class Isolated:
    """How a function run by :func:`run_isolated` ended.

    Attributes:
        status: ``"ok"`` (it returned), ``"error"`` (it raised: the caller meets the same error
            again in-process, with its usual message), ``"crashed"`` (the child raised SIGSEGV,
            SIGABRT, SIGBUS, SIGFPE or SIGILL), ``"killed"`` (another signal: the OOM killer, a
            user) or ``"timeout"``.
        value: what the function returned (``"ok"``), through JSON.
        detail: for ``"crashed"``, the signal's name and the last line native code wrote to
            stderr (e.g. ``SIGABRT: free(): invalid next size (normal)``); the exception's last
            line for ``"error"``.
    """

    status: str
    detail: str = ""
    value: object = None


def run_isolated(fn: Callable[[], object], *, timeout_s: float = ISOLATION_TIMEOUT_S) -> Isolated:
    """Run ``fn()`` in a forked child process and report how it ended (:class:`Isolated`).

    The child shares the parent's memory as it was at the fork (no imports, no copies: a fork
    costs milliseconds) and writes its stderr to a private file, so ORT's native messages never
    reach the user's terminal; it exits with ``os._exit`` (nothing of the parent's is flushed or
    finalised twice). Call it while the process holds no running ORT session: a fork copies
    only the calling thread.

    Args:
        fn: the work, e.g. opening a session and running one step; returns something JSON can
            carry (or None).
        timeout_s: the child is killed after this many seconds (status ``"timeout"``).
    """
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as result:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 0
            try:
                os.dup2(err.fileno(), 2)
                result.write(json.dumps(fn()).encode())
                result.flush()
            except BaseException:  # noqa: BLE001  (reported through the exit code)
                os.write(2, traceback.format_exc().encode())
                code = 1
            finally:
                os._exit(code)
        status = None
        deadline = time.monotonic() + timeout_s
        try:
            while status is None:
                done, wait_status = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = wait_status
                elif time.monotonic() > deadline:
                    break
                else:
                    time.sleep(0.01)
        finally:
            if status is None:  # timed out, or the parent was interrupted
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        err.seek(0)
        lines = [line.strip() for line in err.read().decode(errors="replace").splitlines()]
        result.seek(0)
        value = result.read()
    last = next((line for line in reversed(lines) if line), "")[:300]
    if status is None:
        return Isolated("timeout", f"no answer in {timeout_s:g} s")
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        name = signal.Signals(number).name
        if number not in _CRASH_SIGNALS:  # killed from outside (the OOM killer, a user)
            return Isolated("killed", name)
        return Isolated("crashed", f"{name}: {last}" if last else name)
    if os.WEXITSTATUS(status) != 0:
        return Isolated("error", last)
    return Isolated("ok", value=json.loads(value))


def first_steps(
    directories: Sequence[str | os.PathLike],
    batch: tuple,
    threads: int | None,
    *,
    loss: str = "ce",
    input_names: Sequence[str] = (),
) -> np.ndarray:
    """One training step and one evaluation of each artifact directory, as a training run
    opens them (:class:`TrainingSession`, frozen parameters baked): the graphs etgraph's
    sessions run on a model (the profiler's and the importance probe's are the all-trainable
    training graph), each run once (:func:`check_sessions` runs this in a child process).

    Args:
        directories: artifact directories with their checkpoints (the first all-trainable).
        batch: ``(x, y)``, one full batch at the artifacts' static shape.

    Returns:
        The model's output on the batch in the first directory's training step.

    Raises:
        whatever ORT raises.
    """
    x, y = batch
    first = None
    for d in directories:
        session = TrainingSession(
            d, Path(d) / "checkpoint", threads, loss=loss, input_names=input_names
        )
        _, outputs = session.step(x, y)
        first = np.asarray(outputs) if first is None else first
        session.evaluate([(x, y)], len(y))
        del session
    return first


def check_sessions(
    model: LoadedModel,
    batch_size: int,
    shapes: Mapping[str, Sequence[int]],
    *,
    threads: int | None,
    frozen_bn: str = "inference",
    cache: ArtifactCache | None = None,
    record_dir: str | os.PathLike | None = None,
    timeout_s: float = ISOLATION_TIMEOUT_S,
) -> None:
    """Run the first steps of ``model``'s sessions in a child process (:func:`first_steps`,
    :func:`run_isolated`): all tensors trainable, and the last tensor alone (every other
    parameter baked in, batch norms frozen as ``frozen_bn``), on a random batch at the run's
    static shape. A native crash in ORT (a bug in a kernel, triggered by this graph) then ends
    the child, not the command: :class:`NativeCrashError`, one line. Once per model, batch shape,
    loss, batch-norm mode and ORT version in this process, and in ``record_dir`` (a file per
    model that passed) across processes; the command then opens its sessions as usual (a Python
    error of the child is met again there, with its usual message).

    Cost: generating the two sets of artifacts (the all-trainable one usually cached already),
    a fork, and two sessions' first steps — paid once per model (ResNet50 at 128 px, batch 4:
    18 s at load average 10 on 2 cores; a tiny DistilBERT 0.6 s).

    Args:
        model: the loaded model. batch_size, shapes: the run's static batch shape
            (:meth:`LoadedModel.input_shapes`). threads: ORT intra-op threads.
        frozen_bn: the batch-norm mode of the run's artifacts.
        cache: artifact cache to generate through (default: a temporary one).
        record_dir: where models that passed are recorded (None: this process only).

    Raises:
        NativeCrashError: ORT crashed; names the signal and ORT's last message.
        ModelError, ConfigError: the artifacts cannot be generated.
    """
    key_text = json.dumps(
        [
            model.hash,
            model.task.loss,
            int(batch_size),
            {k: list(map(int, v)) for k, v in sorted(shapes.items())},
            frozen_bn,
            ort.__version__,
        ]
    )
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    record = Path(record_dir) / "checked" / key if record_dir is not None else None
    if key in _CHECKED or (record is not None and record.is_file()):
        return
    n = len(model.tensors)
    selections = [np.ones(n, dtype=bool)]
    if n > 1:
        selections.append(np.arange(n) == n - 1)
    with tempfile.TemporaryDirectory(prefix="etgraph-check-") as tmp:
        if cache is None:
            cache = ArtifactCache(tmp, static_batch=(batch_size, shapes))
        proto = model.proto if cache.static_batch else model.with_batch(batch_size, shapes)
        directories = [
            cache.get(proto, *model.split(m), loss=model.task.loss, frozen_bn=frozen_bn)[
                0
            ].directory
            for m in selections
        ]
        b = random_batch(batch_size, model.inputs, shapes, model.task)

        def work() -> bool:
            """The first steps; returns whether the output looks like probabilities."""
            outputs = first_steps(
                directories,
                (b.inputs, b.labels),
                threads,
                loss=model.task.loss,
                input_names=model.input_names,
            )
            return model.task.loss == "ce" and looks_like_probabilities(outputs)

        t0 = time.perf_counter()
        outcome = run_isolated(work, timeout_s=timeout_s)
    log.debug("first steps in a child process: %s in %.2f s", outcome, time.perf_counter() - t0)
    if outcome.status == "crashed":
        raise NativeCrashError(
            f"{model.source}: ONNX Runtime {ort.__version__} crashed ({outcome.detail}) in the "
            f"first training step of this model at batch {batch_size} (caught in a child "
            "process): a bug in ORT's training kernels on this graph, not in your data; sizes "
            "computed from the data rather than the input shape are a known trigger: export "
            "without them, or report it to onnxruntime with the model"
        )
    if outcome.status == "ok" and outcome.value:
        raise ModelError(
            f"{model.source}: output {model.task.output!r} holds probabilities, not logits "
            f"(non-negative, every row sums to 1; made by {producers(model.proto)}): "
            "cross-entropy on it would train the wrong loss. Export the model without the "
            "layers that normalise its logits (etgraph takes a final Softmax off and puts it "
            "back on the trained model itself)"
        )
    if outcome.status != "ok":  # met again in-process, or a hang: not recorded
        return
    _CHECKED.add(key)
    if record is not None:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(record, key_text.encode())


_CHECKED: set[str] = set()  # check_sessions keys that passed in this process


def looks_like_probabilities(outputs: np.ndarray, tolerance: float = 1e-4) -> bool:
    """Whether a classifier's output ``[B, K]`` (or ``[B, K, 1, ...]``) is probabilities rather
    than logits: K >= 2, every entry non-negative and every row summing to 1 within
    ``tolerance`` (what a Softmax makes, whatever its input; logits almost never do)."""
    try:
        p = class_logits(np.asarray(outputs)).astype(np.float64)
    except ValueError:
        return False
    if p.ndim != 2 or p.shape[1] < 2 or not np.isfinite(p).all():
        return False
    return bool((p >= 0).all() and np.abs(p.sum(axis=1) - 1.0).max() <= tolerance)


def producers(model: onnx.ModelProto, depth: int = 4) -> str:
    """The ops that make the first output, nearest first, e.g. ``"Mul <- Softmax <- Gemm"``
    (at most ``depth``; following each node's first input)."""
    made_by = {v: n for n in model.graph.node for v in n.output}
    chain, value = [], model.graph.output[0].name
    while value in made_by and len(chain) < depth:
        node = made_by[value]
        chain.append(node.op_type)
        value = node.input[0] if node.input else ""
    return " <- ".join(chain) or "a graph input"
