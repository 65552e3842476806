"""Emit onnxruntime-training artifacts for a selection of trainable tensors (docs/guide.md,
"Training").

The artifacts are the four files ``onnxruntime.training.api`` loads: ``training_model.onnx``,
``eval_model.onnx``, ``optimizer_model.onnx`` and ``checkpoint``. The three graphs do not hold
weights (parameters are graph inputs); the weights live in ``checkpoint``. So artifacts depend
only on the model's structure and the selection, and :class:`ArtifactCache` keys them by both.

**Weights never enter generation.** The graphs are generated from
:func:`etgraph.artifact_weights.placeholder_weights` (every parameter's value replaced by a
one-element placeholder, dims and dtype kept): the three graphs come out byte-identical, and
``generate_artifacts``'s copies of the model (its accessor's clone, the checker's and the
gradient builder's serialisations, the checkpoint) cost nothing — measured on ResNet50 128 px:
+8 MiB peak and 0.1 s instead of +476 MiB and 1.5 s. The
checkpoint is then written by :func:`etgraph.checkpoint.write_checkpoint` from the model's
values (or not at all: ``checkpoint=False``, for a run that writes its own checkpoints from its
state and must not hold the weights twice, ``etgraph train --memory-mb``).

Facts relied on (observed with onnxruntime-training 1.19.2): ``requires_grad`` tensors get
gradients, ``frozen_params`` are stored in the checkpoint as non-trainable, and the eval model
keeps BatchNormalization's three outputs with ``training_mode=0`` (it then fails to load), so
the eval model goes through :func:`passes.onnx.eval_model_pipeline` after generation, and the
training model through :func:`passes.onnx.training_model_pipeline` (work ORT keeps needlessly:
unused optional outputs such as a frozen MaxPool's Indices).

**Frozen parameters as constants** (issue #16): the artifacts take every parameter as a graph
input, so a session's graphs can be opened on any weights; a session about to train from a
given checkpoint bakes its frozen parameters in as constants
(:func:`etgraph.artifact_weights.bake_frozen`).

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
import re
import sys
import tempfile
from collections.abc import Collection, Mapping, Sequence
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
    training_model_pipeline,
)

from . import files
from .artifact_weights import initializer_values, placeholder_weights
from .checkpoint import CarriedState, write_checkpoint
from .derive import derive_training_graph
from .errors import ConfigError, ModelError, UnsupportedOpError, first_line
from .io_specs import with_batch
from .onnx_io import model_structure

#: ``(batch size, per-input shapes without the batch)``: artifacts at a static batch shape.
StaticBatch = tuple[int, Mapping[str, Sequence[int]]]

log = logging.getLogger(__name__)

ARTIFACT_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")

#: ORT's loss blocks by etgraph's loss names (``--loss``; :class:`etgraph.io_specs.Task`).
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

    def exists(self, checkpoint: bool = True) -> bool:
        """All four files are there (``checkpoint=False``: the three graphs)."""
        names = ARTIFACT_FILES if checkpoint else ARTIFACT_FILES[:3]
        return all((self.directory / name).is_file() for name in names)


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


_NO_BUILDER = re.compile(r"gradient builder has not been registered: (\w+) for node (\S+)")
_NO_KERNEL = re.compile(r"implementation for (\w+)Grad\(\d+\) node with name '([^']*)'")


def no_gradient_error(exc: Exception) -> UnsupportedOpError | None:
    """The one-line :class:`UnsupportedOpError` for onnxruntime-training failing on an op that
    has no gradient builder, or whose gradient has no CPU kernel (``exc``: ORT's RuntimeError
    or Fail, with its C++ message); None for any other failure.

    The registry (:mod:`etgraph.ops`) refuses the known ops at load; this names the others.
    """
    text = str(exc)
    for pattern, why in (
        (_NO_BUILDER, "has no gradient"),
        (_NO_KERNEL, "has no CPU gradient kernel"),
    ):
        found = pattern.search(text)
        if found:
            op, node = found.groups()
            return UnsupportedOpError(
                f"node {node!r} uses op {op}, which {why} in onnxruntime-training 1.19.2: "
                "replace it on the trained path and re-export"
            )
    return None


def training_error(exc: Exception) -> ModelError:
    """The one-line :class:`ModelError` for onnxruntime-training failing to build a training
    graph: :func:`no_gradient_error`, else the first line of ORT's message."""
    return no_gradient_error(exc) or ModelError(
        f"onnxruntime-training could not build the training graph: {first_line(exc)}"
    )


def _fix_model(path: Path, pipeline) -> None:
    """Run ``pipeline`` on the model file (rewritten if the pipeline changed it)."""
    model = ir.load(path)
    if run_passes(pipeline, model).modified:
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
    return _facts(model).inference_batch_norms(requires_grad, frozen_bn)


def with_bn_mode(
    model: onnx.ModelProto, requires_grad: Sequence[str], frozen_bn: str
) -> onnx.ModelProto:
    """``model`` with the batch norms of :func:`inference_batch_norms` in inference mode
    (:class:`passes.onnx.InferenceBatchNormPass`); ``model`` itself when there are none."""
    if check_frozen_bn(frozen_bn) == "train":
        return model
    ir_model = ir.from_proto(model)  # once: ResNet50's graph takes ~50 ms to read
    names = frozen_batch_norms(ir_model, requires_grad)
    if not names:
        return model
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
    checkpoint: bool = True,
    static_batch: StaticBatch | None = None,
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
        checkpoint: write ``checkpoint`` with ``model``'s values (no optimizer state); False:
            the three graphs only (``model`` may then be a :func:`placeholder_weights` copy).
        static_batch: ``(batch size, per-input shapes)``: the graphs' data inputs get these
            static shapes (:func:`etgraph.io_specs.with_batch`, on the weightless copy: no second
            copy of the weights), as the profile measures them — ORT then folds the shape
            arithmetic (ViT-B/16 at 128 px: full step 511 vs 697 ms with a symbolic batch).

    Returns:
        The paths of the four artifacts (three without ``checkpoint``).

    Raises:
        ConfigError: ``requires_grad`` is empty or overlaps ``frozen_params``; unknown loss or
            ``frozen_bn``; ``checkpoint`` with a model whose weights are placeholders.
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
    params = requires_grad + frozen_params
    weights = initializer_values(model, params) if checkpoint else None
    model = placeholder_weights(model, params)
    if static_batch is not None:
        model = with_batch(model, *static_batch)
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
            raise training_error(exc) from exc
        _fix_model(tmp / "eval_model.onnx", eval_model_pipeline())
        _fix_model(tmp / "training_model.onnx", training_model_pipeline())
        (tmp / "checkpoint").unlink()  # ORT's, of the placeholders
        if weights is not None:
            write_checkpoint(
                tmp / "checkpoint", CarriedState(weights), requires_grad, optimizer_state=False
            )
    log.debug("artifacts for %d trainable tensors in %s", len(requires_grad), out_dir)
    return ArtifactPaths(out_dir)


def derive(
    full: onnx.ModelProto,
    source: ArtifactPaths,
    requires_grad: Sequence[str],
    frozen_bn: str,
    out_dir: str | os.PathLike,
) -> bool:
    """Write the three graphs of the selection ``requires_grad`` to ``out_dir`` (atomically),
    derived from the all-trainable artifacts ``source`` whose training graph ``full`` is
    (:func:`etgraph.derive.derive_training_graph`; the eval and optimizer graphs are
    ``source``'s own, linked or copied): what :func:`generate` would write for the same model,
    loss, weight decay and static batch, without onnxblock. Returns False, writing nothing,
    when the selection cannot be derived (then generate it).

    Raises:
        ConfigError: unknown ``frozen_bn``, or ``requires_grad`` empty or not a subset of the
            source's trainable parameters.
    """
    if not requires_grad:
        raise ConfigError("no tensor is selected for training: select at least one tensor")
    inference = check_frozen_bn(frozen_bn) == "inference"
    try:
        training = derive_training_graph(full, requires_grad, inference_bn=inference)
    except ValueError as exc:
        raise ConfigError(f"cannot derive the selection's graphs: {exc}") from exc
    if training is None:
        return False
    with files.atomic_directory(out_dir) as tmp:
        onnx.save(training, str(tmp / "training_model.onnx"))
        for name in ARTIFACT_FILES[1:3]:
            try:
                os.link(source.directory / name, tmp / name)
            except OSError:
                (tmp / name).write_bytes((source.directory / name).read_bytes())
    log.debug("artifacts for %d trainable tensors derived in %s", len(requires_grad), out_dir)
    return True


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
    (:func:`placeholder_weights`), and the training graph goes through the same
    :func:`passes.onnx.training_model_pipeline`. ORT numbers some node names per process (the
    loss node), so node names may differ from another generation's.

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
    model = with_bn_mode(
        placeholder_weights(model, requires_grad + frozen_params), requires_grad, frozen_bn
    )
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
        raise training_error(exc) from exc
    training_ir = ir.from_proto(training)
    if run_passes(training_model_pipeline(), training_ir).modified:
        training = ir.to_proto(training_ir)
    return training, optimizer


class _ModelFacts:
    """What artifact keys need of a model's structure, computed once per model object
    (:func:`_facts`): the sha256 of :func:`etgraph.onnx_io.model_structure` (a copy of the
    graph: 0.1-0.4 s on ResNet-18 when it was taken per selection) and, per BatchNormalization
    node that :func:`passes.onnx.frozen_batch_norms` considers, its name and gamma/beta."""

    def __init__(self, model: onnx.ModelProto):
        self.structure_digest = hashlib.sha256(
            model_structure(model).SerializeToString(deterministic=True)
        ).digest()
        candidates = set(frozen_batch_norms(ir.from_proto(model), []))  # 4 initializers
        self.batch_norms = [
            (node.name, tuple(node.input[1:3]))
            for node in model.graph.node
            if node.name in candidates
        ]

    def inference_batch_norms(self, requires_grad: Collection[str], frozen_bn: str) -> list[str]:
        """:func:`inference_batch_norms` from the table."""
        if check_frozen_bn(frozen_bn) == "train":
            return []
        selected = set(requires_grad)
        return [name for name, params in self.batch_norms if not selected & set(params)]


#: The last models :func:`_facts` saw (kept alive, so their ids stay theirs).
_FACTS: list[tuple[onnx.ModelProto, _ModelFacts]] = []
_FACTS_KEPT = 4


def _facts(model: onnx.ModelProto) -> _ModelFacts:
    """The :class:`_ModelFacts` of ``model``, memoised for the last few model objects (a model's
    structure must not be changed in place after its first key)."""
    for known, facts in _FACTS:
        if known is model:
            return facts
    facts = _ModelFacts(model)
    _FACTS.insert(0, (model, facts))
    del _FACTS[_FACTS_KEPT:]
    return facts


def selection_key(
    model: onnx.ModelProto,
    requires_grad: Sequence[str],
    *,
    loss: str = "ce",
    frozen_bn: str = "train",
    static_batch: StaticBatch | None = None,
) -> str:
    """A short stable key for (model structure, selection, loss, batch-norm modes, static
    batch): sha256 over :func:`etgraph.onnx_io.model_structure`, the sorted names, the loss when
    it is not ``ce``, the names of the batch norms in inference mode
    (:func:`inference_batch_norms`) and the static batch shape when there is one (16 hex
    digits).

    Initializer values are excluded (the graphs hold no weights), so the key survives training.

    Raises:
        ConfigError: unknown ``frozen_bn``.
    """
    facts = _facts(model)
    h = hashlib.sha256(facts.structure_digest)
    h.update("\0".join(sorted(requires_grad)).encode())
    if loss != "ce":
        h.update(f"\0loss={loss}".encode())
    inference = facts.inference_batch_norms(requires_grad, frozen_bn)
    if inference:  # keys of all-training-mode artifacts are as before issue #14
        h.update(("\1" + "\0".join(inference)).encode())
    if static_batch is not None:
        batch_size, shapes = static_batch
        dims = ";".join(f"{k}={list(map(int, shapes[k]))}" for k in sorted(shapes))
        h.update(f"\2{int(batch_size)};{dims}".encode())
    return h.hexdigest()[:16]


class ArtifactCache:
    """Artifacts on disk keyed by :func:`selection_key`, so a repeated selection costs nothing.

    Cached checkpoints hold the weights of the moment they were generated; the runtime writes
    current weights into the loaded state before training, so reuse never trains stale weights.
    """

    def __init__(self, root: str | os.PathLike, *, static_batch: StaticBatch | None = None):
        self.root = Path(root)
        self.static_batch = static_batch  # every graph of this cache (generate, selection_key)
        self._sources: dict[Path, onnx.ModelProto] = {}  # all-trainable training graphs read

    def get(
        self,
        model: onnx.ModelProto,
        requires_grad: Sequence[str],
        frozen_params: Sequence[str],
        *,
        frozen_bn: str = "train",
        checkpoint: bool = True,
        source: ArtifactPaths | None = None,
        **kwargs,
    ) -> tuple[ArtifactPaths, bool]:
        """Return ``(paths, hit)``: cached artifacts for this selection and batch-norm mode
        (see :func:`generate`), generating on a miss.

        Keyword arguments (``weight_decay``, ``loss``) go to :func:`generate`; the loss is part
        of the key. ``checkpoint=False``: the graphs suffice (a directory without a checkpoint
        is a hit; one is generated again, with its checkpoint, when a later call needs it).
        ``source``: the all-trainable artifacts of this model, loss and weight decay in this
        cache: on a miss without ``checkpoint`` the selection's graphs are derived from them
        (:func:`derive`, milliseconds) instead of generated, unless they cannot be.
        Raises what :func:`generate` raises.
        """
        key = selection_key(
            model,
            requires_grad,
            loss=kwargs.get("loss", "ce"),
            frozen_bn=frozen_bn,
            static_batch=self.static_batch,
        )
        paths = ArtifactPaths(self.root / key)
        if paths.exists(checkpoint):
            return paths, True
        if source is not None and not checkpoint and source.directory != paths.directory:
            full = self._sources.get(source.directory)
            if full is None:
                full = self._sources[source.directory] = onnx.load(str(source.training_model))
            if derive(full, source, requires_grad, frozen_bn, paths.directory):
                return paths, False
        paths = generate(
            model,
            requires_grad,
            frozen_params,
            paths.directory,
            frozen_bn=frozen_bn,
            checkpoint=checkpoint,
            static_batch=self.static_batch,
            **kwargs,
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
        key = selection_key(
            model, requires_grad, loss=loss, frozen_bn=frozen_bn, static_batch=self.static_batch
        )
        paths = ArtifactPaths(self.root / key)
        return paths if paths.exists() else None

    def remove_temporaries(self) -> None:
        """Delete the temporary directories (``.<key>.<random>``) :func:`generate` leaves when
        its process is killed mid-generation. Only for a root no other process is writing to."""
        files.remove_temporaries(self.root)
