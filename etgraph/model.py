"""The loaded model: built once per command and passed down the pipeline (DESIGN: import).

:meth:`LoadedModel.load` reads an ONNX file, legalises it for ORT 1.19.2 training
(:func:`etgraph.onnx_io.load_model`) and works out, once, what every later stage needs: the
structure hash, the data inputs and the task (:mod:`etgraph.io_specs`), the trainable tensors in
forward order (index 0 nearest the input; paper §5) and the running statistics. The graph
builder, the profiler, the selector, the artifact generator and the runtime take this object
instead of reloading the file.

* :func:`trainable_tensors` — the tensors the DP selects among, with their kind (kernel, bias,
  gamma, beta, embedding), found through the op registry (:mod:`etgraph.ops`).
* :func:`running_statistics` — BatchNorm running mean/var: frozen, carried, never trained.
* :func:`normalisation_note` — the warning for a CNN whose batch norms the exporter folded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from passes.onnx import HeadLrScale, head_lr_of

from . import onnx_io
from .errors import ConfigError, ModelError
from .exporters import exporter_of, remedy
from .io_specs import (
    LOSSES,
    InputSpec,
    Task,
    input_shapes,
    input_specs,
    removed_head,
    task_of,
    with_batch,
)
from .ops import FLOAT_TYPES, data_path_values, op_rule

log = logging.getLogger(__name__)

__all__ = [
    "LoadedModel",
    "TensorInfo",
    "normalisation_note",
    "running_statistics",
    "trainable_tensors",
]


@dataclass(frozen=True)
class TensorInfo:
    """One trainable tensor.

    Attributes:
        index: position in forward order (0 nearest the input).
        name: initializer name in the ONNX model.
        kind: ``kernel``, ``bias``, ``gamma``, ``beta`` or ``embedding``.
        layer: name of the ONNX node that applies the tensor to the data (for a MatMul+Add bias:
            the MatMul).
        op_type: that node's op type.
        shape: initializer shape.
        params: number of elements.
        values: value names that carry the tensor into its layer (its name, then the outputs of
            weight-preprocessing nodes such as ``Transpose(W)``).
    """

    index: int
    name: str
    kind: str
    layer: str
    op_type: str
    shape: tuple[int, ...]
    params: int
    values: tuple[str, ...] = field(default=())


# ---- trainable tensors and running statistics ----


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[int, int]]]:
    """value name -> [(node position, input slot)] in graph order."""
    out: dict[str, list[tuple[int, int]]] = {}
    for pos, node in enumerate(graph.node):
        for slot, name in enumerate(node.input):
            if name:
                out.setdefault(name, []).append((pos, slot))
    return out


def _locate(
    model: onnx.ModelProto,
) -> tuple[dict[str, tuple[int, int, tuple[str, ...]]], set[str]]:
    """For every float initializer that reaches the data path through differentiable inputs:
    (position of the node mixing it into the data path, input slot there, carrying values).
    Also returns the names of running statistics (registry ``stat_slots``: BN mean/var)."""
    graph = model.graph
    consumers = _consumers(graph)
    data = data_path_values(graph, from_initializers=False)
    found: dict[str, tuple[int, int, tuple[str, ...]]] = {}
    stats: set[str] = set()
    for init in graph.initializer:
        if init.data_type not in FLOAT_TYPES:
            continue
        name = init.name
        frontier, carrying, best = [name], [name], None
        seen = {name}
        while frontier:
            value = frontier.pop()
            for pos, slot in consumers.get(value, []):
                node = graph.node[pos]
                rule = op_rule(node.op_type)
                if slot in rule.stat_slots:
                    stats.add(name)
                    continue
                if slot in rule.nondiff_slots or not rule.differentiable:
                    continue
                if any(o in data for o in node.output):
                    if best is None or (pos, slot) < best:
                        best = (pos, slot)
                    continue
                for out in node.output:  # weight preprocessing (Transpose, Reshape, Expand ...)
                    if out and out not in seen:
                        seen.add(out)
                        frontier.append(out)
                        carrying.append(out)
        if best is None:
            continue
        numel = int(np.prod(init.dims)) if init.dims else 1
        rule = op_rule(graph.node[best[0]].op_type)
        if best[1] not in rule.weight_slots and numel <= 1:
            continue  # a scalar constant (x * 0.5, x + eps), not a tensor worth training
        found[name] = (best[0], best[1], tuple(carrying))
    return found, stats


def trainable_tensors(model: onnx.ModelProto) -> list[TensorInfo]:
    """The trainable tensors of ``model`` in forward order (paper §5; DESIGN: TensorGraph).

    A float initializer is trainable when it reaches the data path through differentiable op
    inputs (registry :data:`etgraph.ops.OP_RULES`); its *layer* is the node where it meets the
    data (after weight preprocessing such as Transpose). Kind by the layer's registry
    ``weight_slots``: Conv/ConvTranspose/Gemm/MatMul kernel and bias, normalisation gamma and
    beta, Gather data -> embedding. Two cases are not slot-based: a MatMul (or Gemm A/B) operand
    is a kernel whichever side it is on, and an initializer added right after a conv/dense layer
    that has a kernel is that layer's bias (torch exports ``nn.Linear`` on 3-D inputs as
    MatMul + Add). Any other non-scalar float initializer on the data path (cls token, position
    embedding) is an embedding. Excluded: running statistics, integer/shape constants, scalar
    float constants, anything only feeding shapes.

    Order: position of the layer node in the (topological) node order, then input slot.

    Returns:
        One :class:`TensorInfo` per tensor, ``index`` 0..N-1.

    Raises:
        ModelError: no trainable tensor at all.
    """
    graph = model.graph
    located, _ = _locate(model)
    inits = {i.name: i for i in graph.initializer}
    producer = {o: pos for pos, node in enumerate(graph.node) for o in node.output if o}
    kernel_layers = {
        pos for pos, slot, _ in located.values() if op_rule(graph.node[pos].op_type).weight_slots
    }
    rows = []
    for name, (pos, slot, carrying) in located.items():
        node = graph.node[pos]
        rule = op_rule(node.op_type)
        kind, layer = rule.weight_slots.get(slot, "embedding"), node
        # Not slot-based, so not in the registry: a MatMul (or Gemm A/B) operand is the kernel
        # on whichever side it sits (x @ W and W @ x both occur in exports).
        if node.op_type == "MatMul" or (node.op_type == "Gemm" and slot in (0, 1)):
            kind = "kernel"
        # An initializer added to a conv/dense layer's output is that layer's bias (torch
        # exports nn.Linear on 3-D inputs as MatMul + Add): found by the producer, not a slot.
        if kind == "embedding" and node.op_type == "Add":
            other = [v for i, v in enumerate(node.input) if i != slot]
            src = producer.get(other[0]) if len(other) == 1 else None
            if (
                src is not None
                and src in kernel_layers
                and op_rule(graph.node[src].op_type).family == "conv_dense"
            ):
                kind, layer = "bias", graph.node[src]
        shape = tuple(int(d) for d in inits[name].dims)
        rows.append((pos, slot, name, kind, layer.name, layer.op_type, shape, carrying))
    if not rows:
        raise ModelError(
            "the model has no trainable tensors (no float initializer reaches the data path); "
            + remedy(
                "export it with its weights as initializers",
                producer_name=model.producer_name,
                torch="do_constant_folding=False",
                needed="weights it can train (float initializers)",
            )
        )
    rows.sort(key=lambda r: (r[0], r[1]))
    return [
        TensorInfo(
            index=i,
            name=name,
            kind=kind,
            layer=layer,
            op_type=op_type,
            shape=shape,
            params=int(np.prod(shape)) if shape else 1,
            values=carrying,
        )
        for i, (_, _, name, kind, layer, op_type, shape, carrying) in enumerate(rows)
    ]


def running_statistics(model: onnx.ModelProto) -> list[str]:
    """Names of BatchNormalization running mean/var initializers, in graph order.

    They are updated by the training graph but never trained: they go to ``frozen_params`` of
    :func:`etgraph.artifacts.generate` so they stay in the checkpoint.
    """
    _, stats = _locate(model)
    return [i.name for i in model.graph.initializer if i.name in stats]


#: A model with at least this many convolution kernels and no normalisation layer gets
#: :func:`normalisation_note` (a CNN's batch norms folded at export).
FOLDED_NORM_CONVS = 4


def normalisation_note(model: onnx.ModelProto, tensors: Sequence[TensorInfo]) -> str | None:
    """What to say about a CNN with no normalisation tensors at all (at least
    :data:`FOLDED_NORM_CONVS` convolution kernels, no gamma or beta): exporters fold a
    network's batch norms into its convolutions at export (torch's default dynamo exporter
    does unless ``optimize=False``; ``dynamo=False`` in eval mode), leaving nothing of them to
    train. None for any other model."""
    convs = sum(1 for t in tensors if t.kind == "kernel" and t.op_type in ("Conv", "ConvTranspose"))
    if convs < FOLDED_NORM_CONVS or any(t.kind in ("gamma", "beta") for t in tensors):
        return None
    if exporter_of(model.producer_name) == "tf2onnx":  # its frozen graph folds them: no option
        how = "tf2onnx offers no way to keep them; the folded kernels and biases train"
    else:
        how = remedy(
            "keep them at export",
            producer_name=model.producer_name,
            torch="torch.onnx.export(..., optimize=False) with the default dynamo exporter; "
            "training=torch.onnx.TrainingMode.TRAINING with dynamo=False or timm's onnx_export",
            needed="the model's batch norms, which the exporter folded",
        )
    return (
        f"{convs} convolutions and no normalisation layer: if the network has batch norms, the "
        f"exporter folded them into the convolutions and they cannot be trained; {how}"
    )


# ---- the loaded model ----


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A legalised model and what every stage needs to know about it (build with :meth:`load`).

    Attributes:
        source: the file it was loaded from.
        proto: the legalised ``onnx.ModelProto`` (its data inputs and the one output trained
            on, names as in the user's model); treat it as read-only.
        hash: :func:`etgraph.onnx_io.model_hash` (structure only, survives training).
        tensors: trainable tensors in forward order (:func:`trainable_tensors`), length N.
        running_stats: BatchNorm running mean/var names (:func:`running_statistics`).
        inputs: the data inputs in graph order (:func:`etgraph.io_specs.input_specs`);
            everything that feeds the model feeds them by name.
        task: the output trained on and the loss (:class:`etgraph.io_specs.Task`).
        head: the Softmax/LogSoftmax head legalisation took off the output (the loss needs
            logits), e.g. ``"Softmax(axis=1)"``; restored on the exported model. None if none.
        head_lr: the head layer's learning-rate scale (``--head-lr-scale``,
            :class:`passes.onnx.HeadLrScale`): its tensors are stored divided by the scale in
            ``proto``, the checkpoints and the artifacts; folded back on export and in the
            trainer's weights API. None if not scaled.
    """

    source: Path
    proto: onnx.ModelProto
    hash: str
    tensors: tuple[TensorInfo, ...]
    running_stats: tuple[str, ...]
    inputs: tuple[InputSpec, ...]
    task: Task
    head: str | None = None
    head_lr: HeadLrScale | None = None

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        output: str | None = None,
        loss: str = "ce",
        head_lr_scale: float | None = None,
    ) -> LoadedModel:
        """Load, validate and legalise ``path`` (:func:`etgraph.onnx_io.load_model`) to train
        its output ``output`` (None: the only one) with ``loss``
        (:data:`etgraph.io_specs.LOSSES`), its head at ``head_lr_scale`` times the learning
        rate (None: as the model records, 1 for a model etgraph did not compile).

        Raises:
            ModelError, UnsupportedOpError: as :func:`etgraph.onnx_io.load_model`, or the model
                has no trainable tensor (the message names the file).
            ConfigError: bad ``output`` or ``loss``; several outputs and no ``output``.
            HeadLrScaleError: as :func:`etgraph.onnx_io.load_model`.
        """
        path = Path(path)
        if loss not in LOSSES:
            raise ConfigError(f"unknown loss {loss!r}: choose one of {', '.join(LOSSES)}")
        proto = onnx_io.load_model(path, output=output, head_lr_scale=head_lr_scale)
        loaded = cls.from_proto(proto, source=path, loss=loss)
        note = normalisation_note(loaded.proto, loaded.tensors)
        if note is not None:
            log.warning("%s: %s", path, note)
        return loaded

    @classmethod
    def from_proto(
        cls, proto: onnx.ModelProto, *, source: str | os.PathLike, loss: str = "ce"
    ) -> LoadedModel:
        """Wrap an already legalised model (e.g. one just written by ``etgraph compile``).

        Raises:
            ModelError: the model has no trainable tensor or data input, or an output that does
                not fit ``loss`` (the message names ``source``).
        """
        try:
            tensors = trainable_tensors(proto)
            inputs = input_specs(proto)
            task = task_of(proto, loss, str(source))
        except ModelError as exc:
            raise ModelError(f"{source}: {exc}") from None
        return cls(
            source=Path(source),
            proto=proto,
            hash=onnx_io.model_hash(proto),
            tensors=tuple(tensors),
            running_stats=tuple(running_statistics(proto)),
            inputs=tuple(inputs),
            task=task,
            head=removed_head(proto),
            head_lr=head_lr_of(proto),
        )

    @property
    def head_lr_scale(self) -> float:
        """The head's learning-rate factor ``S`` (1.0: not scaled; :attr:`head_lr`)."""
        return self.head_lr.scale if self.head_lr is not None else 1.0

    @property
    def num_classes(self) -> int | None:
        """K of a classifier's output ``[B, K]`` (loss ce); None when symbolic or for mse."""
        return self.task.width if self.task.loss == "ce" else None

    @property
    def input_names(self) -> list[str]:
        """Names of the data inputs, graph order."""
        return [i.name for i in self.inputs]

    @property
    def names(self) -> list[str]:
        """Trainable tensor names in forward order."""
        return [t.name for t in self.tensors]

    @property
    def output_name(self) -> str:
        """Name of the graph output the loss is computed on."""
        return self.task.output

    def input_shapes(self, override=None) -> dict[str, tuple[int, ...]]:
        """Per-sample shape of every data input (:func:`input_shapes`; raises as it does)."""
        return input_shapes(self.inputs, override)

    def with_batch(self, batch_size: int, shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
        """The proto with static inputs ``[batch_size, *shapes[name]]`` (:func:`with_batch`)."""
        return with_batch(self.proto, batch_size, shapes)

    def split(self, mask) -> tuple[list[str], list[str]]:
        """``(requires_grad, frozen_params)`` for a selection mask (bool [N], forward order):
        the selected tensors, then the unselected ones followed by the running statistics.

        Raises:
            ConfigError: the mask does not have one entry per trainable tensor.
        """
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (len(self.tensors),):
            raise ConfigError(
                f"selection mask has shape {mask.shape}, expected ({len(self.tensors)},)"
            )
        trainable = [t.name for t, s in zip(self.tensors, mask, strict=True) if s]
        frozen = [t.name for t, s in zip(self.tensors, mask, strict=True) if not s]
        return trainable, frozen + list(self.running_stats)

    def initial_weights(self) -> dict[str, np.ndarray]:
        """Copies of the model's values of every trainable tensor and running statistic, as
        stored (with :attr:`head_lr`, the head's divided by its scale: what training starts
        from; ``head_lr.original(...)`` gives the original parametrisation)."""
        wanted = set(self.names) | set(self.running_stats)
        return {
            init.name: numpy_helper.to_array(init).copy()
            for init in self.proto.graph.initializer
            if init.name in wanted
        }
