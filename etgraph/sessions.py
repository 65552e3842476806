"""Every ONNX Runtime session etgraph opens, in one place (the seam for a later backend).

* :class:`TrainingSession` — ORT training ``Module`` + ``Optimizer`` for one selection, started
  from a checkpoint: the training loop, the profiler's real steps and ``measure`` use it.
* :class:`GradientSession` — a ``Module`` without optimizer whose parameters are overwritten
  before each use: importance evaluation reads gradients from it.
* :func:`inference_session` — a plain ``onnxruntime.InferenceSession`` (profiled training graphs,
  the optimizer model, exported inference models).
* :func:`evaluate_onnx` — loss and metric (accuracy, or MSE) of an exported inference model.

Their options come from :mod:`etgraph.ort_options` (by role) or, for the training sessions, a
per-run measurement (:mod:`etgraph.config_choice`); a model's first steps are run in a child
process first (:mod:`etgraph.isolation`).

Models are fed by input name: a batch's inputs are a mapping input name -> array (or, for a
single-input model, one array; :func:`as_inputs`); the target goes last, as ORT's loss blocks
add it (``labels`` int64 ``[B]`` for cross-entropy, ``target`` float32 ``[B, D]`` for MSE).

The onnxruntime-training wheel imports ``onnxruntime.training`` (and with it torch) as part of
``import onnxruntime``, so importing its training API here costs nothing more.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.training import api

from .artifact_weights import bake_frozen
from .checkpoint import checkpoint_target, read_checkpoint
from .files import private_temp_dir
from .ort_options import OrtConfig, session_options

__all__ = [
    "GradientSession",
    "TrainingSession",
    "as_inputs",
    "class_logits",
    "evaluate_onnx",
    "inference_session",
    "padded_batch",
    "score",
    "seed_random",
    "softmax_cross_entropy",
]


def seed_random(seed: int | None) -> None:
    """Seed ONNX Runtime's process-wide random generator (None: leave it), which draws the
    masks of a training graph's Dropout nodes (exported without a seed of their own). Unseeded,
    a step's masks depend on every training-mode run before it in the process — profiling,
    option probes, an earlier run — so the same seed and data trained differently from a cold
    and a warm profile cache (MobileNetV2, VGG16, ViT and the text models have Dropout)."""
    if seed is not None:
        ort.set_seed(int(seed))


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
            constants valued from ``checkpoint`` (:func:`etgraph.artifact_weights.bake_frozen`, in a
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

    def train_step(
        self, x, y: np.ndarray, learning_rate: float, *, seed: int | None = None
    ) -> tuple[float, float]:
        """One step at ``learning_rate``, its Dropout masks drawn from ``seed``
        (:func:`seed_random`); returns (mean loss, metric sum over the batch: correct
        predictions for ce, summed per-example MSE for mse; :func:`score`)."""
        seed_random(seed)
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

    def save(
        self, path: str | os.PathLike, properties: Mapping[str, str], *, durable: bool = True
    ) -> None:
        """Save weights + optimizer state + string properties to ``path`` atomically; when
        ``durable`` (a run directory's checkpoint), fsynced, its digest recorded and the previous
        version kept (:func:`etgraph.checkpoint.checkpoint_target`)."""
        for key, value in properties.items():
            self.state.properties[key] = value
        with checkpoint_target(path, durable=durable) as tmp:
            api.CheckpointState.save_checkpoint(self.state, str(tmp), include_optimizer_state=True)

    def release_sessions(self) -> None:
        """Drop the Module and Optimizer (their ORT sessions and arenas: the step's workspace),
        keeping the state (weights, gradients, AdamW moments): :meth:`save` still works, no
        other method does. For saving under a memory budget."""
        self.module = self.optimizer = None

    def weights(self) -> dict[str, np.ndarray]:
        """Copies of every parameter's current value, by name."""
        return {name: p.data.copy() for name, p in self.state.parameters}

    def trainable_views(self) -> dict[str, np.ndarray]:
        """Zero-copy views of the trainable parameters' current values, by name (valid until
        the next step)."""
        return {name: p.data for name, p in self.state.parameters if p.requires_grad}


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

    Attributes:
        uses: how many times parameters were set or gradients computed: a caller that keeps
            the gradients of one use for later (the next period's importance, :mod:`etgraph.
            period`) checks that nothing used the session since.
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
        self.uses = 0

    def set_parameters(self, weights: Mapping[str, np.ndarray], names: Iterable[str]) -> None:
        """Overwrite parameters ``names`` with ``weights[name]``, in place.

        Writes through the zero-copy views: assigning ``parameters[name] = a`` segfaults in ORT
        1.19.2 before a Module exists on the state; the views are safe.
        """
        self.uses += 1
        params = self.state.parameters
        for name in names:
            params[name].data[...] = weights[name]

    def accumulate(self, batches, *, seed: int | None = None) -> list[float]:
        """Forward + backward of every batch, gradients accumulated from zero (ORT accumulates
        until ``lazy_reset_grad``), the Dropout masks drawn from ``seed`` (:func:`seed_random`):
        a pass on the same batch at the same weights and seed gives the same gradients wherever
        it runs. Returns the loss of each batch."""
        self.uses += 1
        seed_random(seed)
        self.module.train()
        self.module.lazy_reset_grad()  # drop the previous use's gradients at the next call
        losses = []
        for x, y in batches:
            out = self.module(*_module_args(self.module, as_inputs(x, self.input_names), y))
            losses.append(float(out[0] if isinstance(out, (tuple, list)) else out))
        return losses

    def gradient(self, name: str) -> np.ndarray:
        """Zero-copy view of the gradient of ``name`` the last :meth:`accumulate` or
        :meth:`train_step` left (``lazy_reset_grad`` clears it only at the next call; valid
        until the next use: :attr:`uses` tells whether there was one)."""
        return self.state.parameters[name].grad

    def train_step(
        self, x, y: np.ndarray, learning_rate: float, *, seed: int | None = None
    ) -> float:
        """A full training step, as :meth:`TrainingSession.train_step` (the training loop's
        reference steps, at learning rate 0: AdamW then changes no weight, at the same cost).
        The AdamW session is opened at the first call. Returns the mean loss."""
        self.uses += 1
        seed_random(seed)
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
