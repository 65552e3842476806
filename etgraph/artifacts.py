"""Emit onnxruntime-training artifacts for a selection of trainable tensors (README: Training).

The artifacts are the four files ``onnxruntime.training.api`` loads: ``training_model.onnx``,
``eval_model.onnx``, ``optimizer_model.onnx`` and ``checkpoint``. The three graphs do not hold
weights (parameters are graph inputs); the weights live in ``checkpoint``. So artifacts depend
only on the model's structure and the selection, and :class:`ArtifactCache` keys them by both.

Facts relied on (observed with onnxruntime-training 1.19.2): ``requires_grad`` tensors get
gradients, ``frozen_params`` are stored in the checkpoint as non-trainable, and the eval model
keeps BatchNormalization's three outputs with ``training_mode=0`` (it then fails to load), so
the eval model goes through :func:`passes.onnx.eval_model_pipeline` after generation.

**Frozen batch norm** (``frozen_bn``, issue #14): with ``"inference"``, every BatchNormalization
whose gamma and beta are both unselected runs in inference mode in that selection's graphs
(:class:`passes.onnx.InferenceBatchNormPass`: the per-channel affine map of its running
statistics, which then stay as they are); with ``"train"`` every batch norm runs in training
mode and updates its running statistics, selected or not. The mode changes the graphs, so the
names of the batch norms in inference mode are part of :func:`selection_key`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir
from onnxruntime.training import artifacts as ort_artifacts
from onnxruntime.training import onnxblock

from passes.base import run_passes
from passes.onnx import (
    FROZEN_BN_MODES,
    InferenceBatchNormPass,
    eval_model_pipeline,
    frozen_batch_norms,
)

from . import files
from .errors import ConfigError, ModelError, first_line
from .onnx_io import model_structure

log = logging.getLogger(__name__)

ARTIFACT_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")

#: ORT's loss blocks by etgraph's loss names (``--loss``; :class:`etgraph.model.Task`).
_LOSSES = {"ce": ort_artifacts.LossType.CrossEntropyLoss, "mse": ort_artifacts.LossType.MSELoss}


@dataclass(frozen=True)
class ArtifactPaths:
    """Paths of one set of training artifacts (all inside ``directory``)."""

    directory: Path

    @property
    def training_model(self) -> Path:
        return self.directory / "training_model.onnx"

    @property
    def eval_model(self) -> Path:
        return self.directory / "eval_model.onnx"

    @property
    def optimizer_model(self) -> Path:
        return self.directory / "optimizer_model.onnx"

    @property
    def checkpoint(self) -> Path:
        return self.directory / "checkpoint"

    def exists(self) -> bool:
        return all((self.directory / name).is_file() for name in ARTIFACT_FILES)


@contextlib.contextmanager
def _captured_native_stderr(captured: list[str]):
    """Capture what native code writes to file descriptor 2 (ORT's graph builder logs every
    transformer at INFO level there, whatever the logger severity) into ``captured`` (appended
    when the block exits)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read().decode(errors="replace"))


def _fix_eval_model(path: Path) -> None:
    """Run :func:`passes.onnx.eval_model_pipeline` on the eval model file (rewritten if the
    pipeline changed it)."""
    model = ir.load(path)
    if run_passes(eval_model_pipeline(), model).modified:
        ir.save(model, path)


def check_frozen_bn(frozen_bn: str) -> str:
    """Return ``frozen_bn`` if it is one of :data:`passes.onnx.FROZEN_BN_MODES`.

    Raises:
        ConfigError: any other value.
    """
    if frozen_bn not in FROZEN_BN_MODES:
        raise ConfigError(
            f"unknown frozen batch-norm mode {frozen_bn!r}: choose one of "
            f"{', '.join(FROZEN_BN_MODES)}"
        )
    return frozen_bn


def inference_batch_norms(
    model: onnx.ModelProto, requires_grad: Sequence[str], frozen_bn: str
) -> list[str]:
    """Names of the BatchNormalization nodes that run in inference mode in the artifacts of
    the selection ``requires_grad``: none with ``frozen_bn="train"``; with ``"inference"``
    those whose gamma and beta are both unselected (:func:`passes.onnx.frozen_batch_norms`).

    Raises:
        ConfigError: unknown ``frozen_bn``.
    """
    if check_frozen_bn(frozen_bn) == "train":
        return []
    return frozen_batch_norms(ir.from_proto(model), requires_grad)


def with_bn_mode(
    model: onnx.ModelProto, requires_grad: Sequence[str], frozen_bn: str
) -> onnx.ModelProto:
    """``model`` with the batch norms of :func:`inference_batch_norms` in inference mode
    (:class:`passes.onnx.InferenceBatchNormPass`); ``model`` itself when there are none."""
    names = inference_batch_norms(model, requires_grad, frozen_bn)
    if not names:
        return model
    ir_model = ir.from_proto(model)
    run_passes(InferenceBatchNormPass(names), ir_model)
    return ir.to_proto(ir_model)


def generate(
    model: onnx.ModelProto,
    requires_grad: Sequence[str],
    frozen_params: Sequence[str],
    out_dir: str | os.PathLike,
    *,
    weight_decay: float = 0.01,
    loss: str = "ce",
    frozen_bn: str = "train",
) -> ArtifactPaths:
    """Generate ORT training artifacts for one selection, atomically.

    The files are written to a temporary sibling directory and renamed onto ``out_dir``
    (:func:`etgraph.files.atomic_directory`), so a crash leaves either the old directory or the
    complete new one, never a partial one.

    Args:
        model: forward ONNX model (legalised for training) whose initializers hold the weights
            to start from; they are stored in the checkpoint.
        requires_grad: initializer names to train (the selected tensors), at least one.
        frozen_params: initializer names to keep in the checkpoint without training (unselected
            tensors and BatchNorm running statistics), so weights can be carried over.
        out_dir: destination directory (replaced if it exists).
        weight_decay: AdamW decoupled weight decay.
        loss: ``"ce"`` — ORT's CrossEntropyLoss on the model's output (logits ``[B, K]``,
            target input ``labels`` int64 ``[B]``); ``"mse"`` — ORT's MSELoss (output
            ``[B, D]``, target input ``target`` float ``[B, D]``, mean over all elements).
        frozen_bn: ``"inference"``: batch norms with gamma and beta both unselected run in
            inference mode (their running statistics, in ``frozen_params``, stay as they are);
            ``"train"``: every batch norm runs in training mode (module docstring).

    Returns:
        The paths of the four artifacts.

    Raises:
        ConfigError: ``requires_grad`` is empty or overlaps ``frozen_params``; unknown loss or
            ``frozen_bn``.
        ModelError: onnxruntime-training cannot build the gradient graph (the message names the
            failing op when ORT does).
    """
    requires_grad = list(requires_grad)
    frozen_params = list(frozen_params)
    if not requires_grad:
        raise ConfigError("no tensor is selected for training: select at least one tensor")
    overlap = set(requires_grad) & set(frozen_params)
    if overlap:
        raise ConfigError(f"tensors both trainable and frozen: {sorted(overlap)[:5]}")
    model = with_bn_mode(model, requires_grad, frozen_bn)

    if loss not in _LOSSES:
        raise ConfigError(f"unknown loss {loss!r}: choose one of {', '.join(_LOSSES)}")
    out_dir = Path(out_dir)
    native_log: list[str] = []
    with files.atomic_directory(out_dir) as tmp:
        try:
            with _captured_native_stderr(native_log):
                ort_artifacts.generate_artifacts(
                    model,
                    requires_grad=requires_grad,
                    frozen_params=frozen_params,
                    loss=_LOSSES[loss],
                    optimizer=onnxblock.optim.AdamW(weight_decay=weight_decay),
                    artifact_directory=str(tmp),
                    # also output the logits, so training/eval steps give accuracy for free
                    additional_output_names=[model.graph.output[0].name],
                )
        except Exception as exc:  # ORT raises RuntimeError/Fail with the C++ message
            log.debug("onnxruntime-training log:\n%s", "".join(native_log))
            raise ModelError(
                f"onnxruntime-training could not build the training graph: {first_line(exc)}"
            ) from exc
        _fix_eval_model(tmp / "eval_model.onnx")
    log.debug("artifacts for %d trainable tensors in %s", len(requires_grad), out_dir)
    return ArtifactPaths(out_dir)


def without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose float initializers over 4 KiB hold 4 placeholder bytes (dims
    kept). The graphs built from a model hold no weights and nothing reads their values
    (shape-carrying int64 tensors are kept), so building them from this copy gives the same
    graphs, without onnxblock's copies, checks and shape inference of every weight (ResNet-50:
    1.2 s -> 0.1 s per graph)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT and len(init.raw_data) > 4096:
            init.raw_data = b"\0\0\0\0"
    return out


def training_graphs(
    model: onnx.ModelProto,
    requires_grad: Sequence[str],
    frozen_params: Sequence[str],
    *,
    loss: str = "ce",
    frozen_bn: str = "train",
    weight_decay: float = 0.01,
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The ``training_model.onnx`` and ``optimizer_model.onnx`` :func:`generate` writes for this
    selection, built in memory: no files, no eval model, no checkpoint (the profiler's fast
    level runs them in plain inference sessions and feeds the weights itself).

    Built by the same onnxblock calls as ORT's ``generate_artifacts`` (a training block of the
    loss with the model's output as an additional output; ``requires_grad``/``frozen_params``;
    AdamW over the trainable parameters) from a copy of the model without its weights
    (:func:`without_weights`). ORT numbers some node names per process (the loss node), so
    node names may differ from another generation's.

    Args and errors: as :func:`generate`.

    Returns:
        ``(training graph, optimizer graph)``; parameters are graph inputs in both.
    """
    requires_grad = list(requires_grad)
    frozen_params = list(frozen_params)
    if not requires_grad:
        raise ConfigError("no tensor is selected for training: select at least one tensor")
    if loss not in _LOSSES:
        raise ConfigError(f"unknown loss {loss!r}: choose one of {', '.join(_LOSSES)}")
    model = with_bn_mode(without_weights(model), requires_grad, frozen_bn)
    loss_block = {"ce": onnxblock.loss.CrossEntropyLoss, "mse": onnxblock.loss.MSELoss}[loss]()
    extra_output = model.graph.output[0].name

    class _Training(onnxblock.TrainingBlock):
        def build(self, *outputs):
            return (loss_block(*outputs), extra_output)

    block = _Training()
    for name in requires_grad:
        block.requires_grad(name)
    for name in frozen_params:
        block.requires_grad(name, False)
    native_log: list[str] = []
    try:
        with _captured_native_stderr(native_log), onnxblock.base(model):
            block(*[o.name for o in model.graph.output])
            training, _ = block.to_model_proto()
            params = block.parameters()
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        with onnxblock.empty_base(opset_version=opset):
            optim = onnxblock.optim.AdamW(weight_decay=weight_decay)
            optim(params)
            optimizer = optim.to_model_proto()
    except Exception as exc:  # ORT raises RuntimeError/Fail with the C++ message
        log.debug("onnxruntime-training log:\n%s", "".join(native_log))
        raise ModelError(
            f"onnxruntime-training could not build the training graph: {first_line(exc)}"
        ) from exc
    return training, optimizer


def selection_key(
    model: onnx.ModelProto,
    requires_grad: Sequence[str],
    *,
    loss: str = "ce",
    frozen_bn: str = "train",
) -> str:
    """A short stable key for (model structure, selection, loss, batch-norm modes): sha256 over
    :func:`etgraph.onnx_io.model_structure`, the sorted names, the loss when it is not ``ce``
    and the names of the batch norms in inference mode (:func:`inference_batch_norms`) (16 hex
    digits).

    Initializer values are excluded (the graphs hold no weights), so the key survives training.

    Raises:
        ConfigError: unknown ``frozen_bn``.
    """
    h = hashlib.sha256(model_structure(model).SerializeToString(deterministic=True))
    h.update("\0".join(sorted(requires_grad)).encode())
    if loss != "ce":
        h.update(f"\0loss={loss}".encode())
    inference = inference_batch_norms(model, requires_grad, frozen_bn)
    if inference:  # keys of all-training-mode artifacts are as before issue #14
        h.update(("\1" + "\0".join(inference)).encode())
    return h.hexdigest()[:16]


class ArtifactCache:
    """Artifacts on disk keyed by :func:`selection_key`, so a repeated selection costs nothing.

    Cached checkpoints hold the weights of the moment they were generated; the runtime writes
    current weights into the loaded state before training, so reuse never trains stale weights.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def get(
        self,
        model: onnx.ModelProto,
        requires_grad: Sequence[str],
        frozen_params: Sequence[str],
        *,
        frozen_bn: str = "train",
        **kwargs,
    ) -> tuple[ArtifactPaths, bool]:
        """Return ``(paths, hit)``: cached artifacts for this selection and batch-norm mode
        (see :func:`generate`), generating on a miss.

        Keyword arguments (``weight_decay``, ``loss``) go to :func:`generate`; the loss is part
        of the key. Raises what :func:`generate` raises.
        """
        key = selection_key(
            model, requires_grad, loss=kwargs.get("loss", "ce"), frozen_bn=frozen_bn
        )
        paths = ArtifactPaths(self.root / key)
        if paths.exists():
            return paths, True
        paths = generate(
            model, requires_grad, frozen_params, paths.directory, frozen_bn=frozen_bn, **kwargs
        )
        return paths, False

    def lookup(
        self,
        model: onnx.ModelProto,
        requires_grad: Sequence[str],
        frozen_params: Sequence[str],
        *,
        frozen_bn: str = "train",
        loss: str = "ce",
    ) -> ArtifactPaths | None:
        """The cached artifacts of this selection (as :meth:`get`), or None: never generates.
        ``frozen_params`` is taken for symmetry with :meth:`get` (not part of the key)."""
        del frozen_params
        paths = ArtifactPaths(
            self.root / selection_key(model, requires_grad, loss=loss, frozen_bn=frozen_bn)
        )
        return paths if paths.exists() else None

    def remove_temporaries(self) -> None:
        """Delete the temporary directories (``.<key>.<random>``) :func:`generate` leaves when
        its process is killed mid-generation. Only for a root no other process is writing to."""
        files.remove_temporaries(self.root)
