"""Output heads (issue #14): what an inference export puts after the logits, taken off for the
loss and put back on the exported inference model, so the trained model keeps the original
output's meaning.

* :class:`DropOutputNoOpsPass` — ops that change nothing at the end of the output (Identity, a
  Cast to the type it has, a Reshape/Flatten/Squeeze that keeps ``[B, K]``): skl2onnx ends its
  MLPClassifier with ``Softmax -> Identity``; taken off so the heads below are seen, not
  recorded (the output is the same without them);
* :class:`RemoveSoftmaxHeadPass` — a trailing Softmax/LogSoftmax over the class axis: the loss
  (ORT's SoftmaxCrossEntropyLoss) needs the logits before it;
* :class:`FlattenClassOutputPass` — an output ``[B, K, 1, ..., 1]`` (a 1x1-conv classifier, as
  DenseNet and SqueezeNet end) becomes ``[B, K]`` by a ``Flatten``.

Each records what it took off in the model's metadata (:data:`HEAD_KEY`): the ops that rebuild
the original output from the logits, in order, joined by ``" -> "``, e.g.
``"Reshape(shape=0,-1,1,1) -> Softmax(axis=1)"``. :class:`RestoreHeadPass` applies them.
"""

from __future__ import annotations

import contextlib
import logging
import re

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError
from onnx_ir.passes.common import ShapeInferencePass

log = logging.getLogger(__name__)

__all__ = [
    "HEAD_KEY",
    "DropOutputNoOpsPass",
    "FlattenClassOutputPass",
    "RemoveSoftmaxHeadPass",
    "RestoreHeadPass",
    "head_of",
]

#: Metadata key (model ``metadata_props``) of the removed head, e.g. ``"Softmax(axis=1)"``.
HEAD_KEY = "etgraph.removed_head"
_HEADS = ("Softmax", "LogSoftmax")
_STEP = re.compile(
    r"^(?:(Softmax|LogSoftmax)\(axis=(-?\d+)\)|Reshape\(shape=(-?\d+(?:,-?\d+)*)\))$"
)
_SEPARATOR = " -> "


def head_of(model: ir.Model) -> str | None:
    """The recorded head (``"Softmax(axis=1)"``), or None when none was removed."""
    return model.metadata_props.get(HEAD_KEY)


def _record(model: ir.Model, step: str) -> None:
    """Put ``step`` first in the head record: it was taken off after the steps already there,
    so it is the first to put back."""
    old = head_of(model)
    model.metadata_props[HEAD_KEY] = step if old is None else f"{step}{_SEPARATOR}{old}"


def _static_dims(value: ir.Value) -> list[int | None] | None:
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


def _is(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _legacy_softmax(node: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
    """onnx's version converter turns an opset < 13 Softmax (over the flattened dims from
    ``axis`` on) into ``Reshape(Softmax(Flatten(x, axis)), Shape(x))``: for ``node`` (the
    Reshape) of that form, ``(x, [the four nodes])``, else None."""
    if not _is(node, "Reshape") or len(node.inputs) < 2:
        return None
    softmax, shape = node.inputs[0].producer(), node.inputs[1].producer()
    if not (_is(softmax, "Softmax") or _is(softmax, "LogSoftmax")) or not _is(shape, "Shape"):
        return None
    flatten = softmax.inputs[0].producer()
    if not _is(flatten, "Flatten") or flatten.inputs[0] is not shape.inputs[0]:
        return None
    if flatten.attributes.get_int("axis", 1) != 1:
        return None
    return flatten.inputs[0], [node, softmax, flatten, shape]


def _trailing_head(graph: ir.Graph) -> tuple[str, ir.Value, list[ir.Node]] | None:
    """``(spec, logits, nodes to remove)`` of a Softmax/LogSoftmax over the class axis that
    ends the single output (directly or in the version converter's legacy form), else None."""
    if len(graph.outputs) != 1:
        return None
    node = graph.outputs[0].producer()
    if node is None:
        return None
    legacy = _legacy_softmax(node)
    if legacy is not None:
        logits, nodes = legacy
        op_type, axis = nodes[1].op_type, 1
    elif node.op_type in _HEADS and node.domain in ("", "ai.onnx"):
        logits, nodes = node.inputs[0], [node]
        op_type, axis = node.op_type, node.attributes.get_int("axis", -1)
    else:
        return None
    dims = _static_dims(logits) if logits is not None else None
    if dims is None:
        dims = _static_dims(graph.outputs[0])
    if dims is not None:
        rank = len(dims)
        class_axis = axis in (-1, rank - 1) or (axis == 1 and all(d == 1 for d in dims[2:]))
        if not class_axis:
            return None  # not over the class axis of a [B, K] (or [B, K, 1, 1]) output
    if logits is None or logits.is_graph_input():
        return None
    if any(use.node not in nodes for use in logits.uses()):
        return None  # the logits feed something else too
    return f"{op_type}(axis={axis})", logits, nodes


#: Ops that reshape without changing a ``[B, K]`` output when input and output are ``[B, K]``.
_RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


def _output_no_op(graph: ir.Graph) -> ir.Node | None:
    """The node making the single output if it changes nothing (an Identity, a Cast to its
    input's type, a reshape whose input and output are both ``[B, K]`` with the same static K)
    and its input is an inner value read by nothing else; else None."""
    if len(graph.outputs) != 1:
        return None
    output = graph.outputs[0]
    node = output.producer()
    if node is None or node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    source = node.inputs[0]
    if source is None or source.is_graph_input() or source.is_initializer():
        return None
    if any(use.node is not node for use in source.uses()) or len(output.uses()) > 0:
        return None
    if node.op_type == "Identity":
        return node
    if node.op_type == "Cast":
        to = node.attributes.get_int("to", None)
        same = source.dtype is not None and to is not None and int(source.dtype) == to
        return node if same else None
    if node.op_type in _RESHAPES:
        before, after = _static_dims(source), _static_dims(output)
        if before is None or after is None or len(before) != 2 or len(after) != 2:
            return None
        return node if before[1] is not None and before[1] == after[1] else None
    return None


class DropOutputNoOpsPass(InPlacePass):
    """Take ops that change nothing off the end of the single output (:func:`_output_no_op`),
    so a Softmax before them is seen as the head; the output keeps its name."""

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        modified = False
        last = graph.outputs[0].producer() if len(graph.outputs) == 1 else None
        if last is not None and last.op_type in ("Cast", *_RESHAPES) and last.inputs:
            if last.inputs[0] is not None and (
                last.inputs[0].dtype is None or last.inputs[0].shape is None
            ):
                with contextlib.suppress(Exception):  # exporters that record no value types
                    ShapeInferencePass(data_prop=False)(model)  # as batch_norm.py
        while (node := _output_no_op(graph)) is not None:
            output, source = graph.outputs[0], node.inputs[0]
            name = output.name
            if source.type is None:
                source.type = output.type
            if source.shape is None:
                source.shape = output.shape
            graph.outputs[0] = source
            graph.remove(node, safe=True)
            source.name = name
            log.info("dropped the output's trailing %s (it changes nothing)", node.op_type)
            modified = True
        return PassResult(model, modified=modified)

    def ensures(self, model: ir.Model) -> None:
        if _output_no_op(model.graph) is not None:
            raise PostconditionError("a no-op is left at the end of the output")


class RemoveSoftmaxHeadPass(InPlacePass):
    """Take a trailing Softmax/LogSoftmax off the output (the loss needs logits); record it."""

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        head = _trailing_head(graph)
        if head is None:
            return PassResult(model, modified=False)
        spec, logits, nodes = head
        output = graph.outputs[0]
        name = output.name
        if logits.type is None:  # the head keeps type and shape: the logits have the same
            logits.type = output.type
        if logits.shape is None:
            logits.shape = output.shape
        graph.outputs[0] = logits
        for node in nodes:  # consumers first
            graph.remove(node, safe=True)
        logits.name = name  # the model's output keeps its name
        _record(model, spec)
        log.info("removed the trailing %s: the loss is computed on its input", spec)
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        if _trailing_head(model.graph) is not None and head_of(model) is None:
            raise PostconditionError("a trailing Softmax/LogSoftmax is left unrecorded")


def _unit_class_output(graph: ir.Graph) -> bool:
    """The single output is ``[B, K, 1, ..., 1]`` (rank > 2, static unit dims after K)."""
    if len(graph.outputs) != 1:
        return False
    dims = _static_dims(graph.outputs[0])
    return dims is not None and len(dims) > 2 and all(d == 1 for d in dims[2:])


class FlattenClassOutputPass(InPlacePass):
    """Flatten an output ``[B, K, 1, ..., 1]`` to ``[B, K]`` logits; record the Reshape back."""

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        if not _unit_class_output(graph):
            return PassResult(model, modified=False)
        output = graph.outputs[0]
        dims = list(output.shape)
        name = output.name
        output.name = f"{name}/unflattened"
        node = ir.node("Flatten", [output], attributes={"axis": 1}, name=f"{name}/Flatten")
        flat = node.outputs[0]
        flat.name = name
        flat.type = output.type
        flat.shape = ir.Shape(dims[:2])
        graph.append(node)
        graph.outputs[0] = flat
        _record(model, "Reshape(shape=" + ",".join(["0", "-1"] + ["1"] * (len(dims) - 2)) + ")")
        log.info("output %r of shape %s flattened to [B, K] for the loss", name, dims)
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        if _unit_class_output(model.graph):
            raise PostconditionError("the output still has unit dims after the class axis")


class RestoreHeadPass(InPlacePass):
    """Put the recorded head back on the single output of an inference model.

    Args:
        spec: the recorded head (:func:`head_of` of the legalised model), e.g.
            ``"Reshape(shape=0,-1,1,1) -> Softmax(axis=1)"``.

    Raises:
        ValueError: ``spec`` is not a head record.
    """

    def __init__(self, spec: str):
        super().__init__()
        self.steps = [_STEP.match(step) for step in spec.split(_SEPARATOR)]
        if not all(self.steps):
            raise ValueError(f"not a head spec: {spec!r}")

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        for step in self.steps:
            value = graph.outputs[0]
            name = value.name
            if step.group(1):
                op_type = step.group(1)
                node = ir.node(op_type, [value], attributes={"axis": int(step.group(2))})
                shape = value.shape
            else:
                op_type = "Reshape"
                target = [int(d) for d in step.group(3).split(",")]
                const = ir.tensor(target, dtype=ir.DataType.INT64, name=f"{name}/shape")
                shape_value = ir.node("Constant", [], attributes={"value": const})
                shape_value.name = f"{name}/Constant_shape"
                shape_value.outputs[0].name = f"{name}/shape"
                graph.append(shape_value)
                node = ir.node("Reshape", [value, shape_value.outputs[0]])
                known = value.shape is not None and len(value.shape) == 2
                shape = ir.Shape([*value.shape, *target[2:]]) if known else None
            value.name = f"{name}/before_{op_type.lower()}"
            node.name = f"{name}/{op_type}"
            node.outputs[0].name = name
            node.outputs[0].type = value.type
            node.outputs[0].shape = shape
            graph.append(node)
            graph.outputs[0] = node.outputs[0]
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        producer = model.graph.outputs[0].producer()
        last = self.steps[-1].group(1) or "Reshape"
        if producer is None or producer.op_type != last:
            raise PostconditionError(f"the output is not produced by {last}")
