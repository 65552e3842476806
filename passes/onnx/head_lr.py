"""The head's own learning rate, as an exact reparametrisation (issue #30, ``--head-lr-scale``).

onnxruntime-training's AdamW has one learning rate for every parameter. To train the output
layer (the *head*) at ``S`` times that rate, :class:`ScaleHeadLrPass` stores the head's
initializers (kernel and bias) divided by ``S`` and multiplies its output by ``S`` (one ``Mul``
by a scalar constant): the function is unchanged, ``S * layer(x; p / S) == layer(x; p)`` for a
dense layer, linear in its parameters jointly. AdamW's step is invariant to the gradient's scale
(``m / sqrt(v)``, up to eps), so each stored parameter ``p / S`` moves about ``lr`` per step and
the real ``p`` about ``S * lr``; the decoupled weight decay shrinks ``p`` by ``lr * wd * p`` as
before. The torch form is :class:`models.zoo.LearningRateScale`.

The head is the layer producing the logits the loss is computed on (the model's single output
after legalisation, :attr:`etgraph.io_specs.Task.output`) — the same layer the ``last-layer``
strategy trains (:func:`etgraph.selection.strategy_mask`). Supported forms: ``Gemm`` with its
kernel (B, or A) an initializer and its bias C an initializer or absent; ``MatMul`` with one
initializer operand, alone or followed by ``Add`` of a bias initializer. A kernel reached
through a ``Transpose`` of an initializer (torch's ``nn.Linear`` on 3-D inputs) is scaled at
the initializer.

What was done is recorded in the model's metadata (:data:`HEAD_LR_KEY`, JSON of
:class:`HeadLrScale`), so :class:`FoldHeadLrScalePass` can undo it: the initializers multiplied
back by ``S``, the ``Mul`` removed, the record dropped (the exported trained model: the
original architecture and parametrisation).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from etgraph.errors import HeadLrScaleError

from .head import _is  # a node of this op in the default domain

log = logging.getLogger(__name__)

__all__ = [
    "HEAD_LR_KEY",
    "FoldHeadLrScalePass",
    "HeadLrScale",
    "ScaleHeadLrPass",
    "check_head_lr_scale",
    "head_lr_of",
]

#: Metadata key (model ``metadata_props``) of the head's scale: JSON of :class:`HeadLrScale`.
HEAD_LR_KEY = "etgraph.head_lr_scale"
_GUIDE = "docs/guide.md, 'A fresh head learns faster'"


@dataclass(frozen=True)
class HeadLrScale:
    """What :class:`ScaleHeadLrPass` did to a model.

    Attributes:
        scale: ``S`` (> 0, finite): the head trains at ``S`` times the learning rate.
        tensors: the initializers stored divided by ``S`` (the head's kernel, then its bias).
        layer: the head layer's node (Gemm or MatMul).
        node: the ``Mul`` node multiplying the head's output by ``S``.
        constant: the scalar float32 initializer holding ``S``.
    """

    scale: float
    tensors: tuple[str, ...]
    layer: str
    node: str
    constant: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> HeadLrScale:
        data = json.loads(text)
        return cls(
            scale=float(data["scale"]),
            tensors=tuple(data["tensors"]),
            layer=data["layer"],
            node=data["node"],
            constant=data["constant"],
        )

    def original(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``weights`` (name -> array, as stored) in the original parametrisation: the head's
        tensors multiplied by ``scale`` (new arrays, dtype kept), the others as they are."""
        return {k: _times(v, self.scale) if k in self.tensors else v for k, v in weights.items()}

    def stored(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Inverse of :meth:`original`: the head's tensors divided by ``scale``."""
        return {
            k: _times(v, 1.0 / self.scale) if k in self.tensors else v for k, v in weights.items()
        }


def _times(array, factor: float) -> np.ndarray:
    """``array * factor`` computed in float64 and returned in ``array``'s dtype."""
    array = np.asarray(array)
    if array.dtype.kind != "f":
        return array  # not a float tensor: left for the caller's dtype check to refuse
    return (array.astype(np.float64) * factor).astype(array.dtype)


def head_lr_of(model: ir.Model | onnx.ModelProto) -> HeadLrScale | None:
    """The :class:`HeadLrScale` recorded in ``model``'s metadata, or None (not scaled)."""
    if isinstance(model, onnx.ModelProto):
        text = next((p.value for p in model.metadata_props if p.key == HEAD_LR_KEY), None)
    else:
        text = model.metadata_props.get(HEAD_LR_KEY)
    return None if text is None else HeadLrScale.from_json(text)


def check_head_lr_scale(scale) -> float:
    """``scale`` as a float if it is positive and finite.

    Raises:
        HeadLrScaleError: it is not (one line: what and what to do).
    """
    try:
        value = float(scale)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise HeadLrScaleError(
            f"--head-lr-scale (head_lr_scale) must be a positive, finite number, got {scale!r}: "
            "use e.g. 10 (a fresh head at 10x the learning rate) or 1 (the same rate)"
        )
    return value


def _weight(value: ir.Value | None) -> ir.Value | None:
    """The float initializer ``value`` is, or is a ``Transpose`` of; else None."""
    if value is None:
        return None
    producer = value.producer()
    if _is(producer, "Transpose") and len(value.uses()) == 1:
        value = producer.inputs[0]
    if value is None or not value.is_initializer() or value.const_value is None:
        return None
    if value.dtype is None or not value.dtype.is_floating_point() or value.is_graph_input():
        return None
    return value


def _kernel(node: ir.Node) -> ir.Value | None:
    """The kernel of a Gemm or MatMul ``node``: its one initializer operand (A or B); None if
    both or neither are."""
    operands = [_weight(v) for v in node.inputs[:2]]
    found = [w for w in operands if w is not None]
    return found[0] if len(found) == 1 else None


def _unsupported(graph: ir.Graph, reason: str) -> HeadLrScaleError:
    name = graph.outputs[0].name if len(graph.outputs) == 1 else "?"
    return HeadLrScaleError(
        f"--head-lr-scale needs the output {name!r} made by a dense layer (Gemm, or MatMul "
        f"[+ Add bias]) whose weights are initializers read by it alone, but {reason}: train "
        f"without --head-lr-scale, or scale the head in the model before export ({_GUIDE})"
    )


def find_head(graph: ir.Graph) -> tuple[ir.Node, list[ir.Value]]:
    """The head layer of ``graph`` (module docstring) and its initializers (kernel, then bias).

    Raises:
        HeadLrScaleError: the single output is not made by a supported head.
    """
    if len(graph.outputs) != 1:
        raise _unsupported(graph, f"the model has {len(graph.outputs)} outputs")
    node = graph.outputs[0].producer()
    if node is None:
        raise _unsupported(graph, "no node makes it")
    found = f"it is made by {node.op_type} {node.name!r}"
    bias = None
    if _is(node, "Add"):
        biases = [_weight(v) for v in node.inputs]
        matmuls = [v.producer() if v is not None else None for v in node.inputs]
        for i in (0, 1):
            if biases[i] is not None and _is(matmuls[1 - i], "MatMul"):
                bias, node = biases[i], matmuls[1 - i]
                if len(node.outputs[0].uses()) != 1:
                    raise _unsupported(graph, f"the output of {node.name!r} is read elsewhere")
                break
        else:
            raise _unsupported(graph, found + " (not a MatMul plus a bias initializer)")
    elif _is(node, "Gemm"):
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            bias = _weight(node.inputs[2])
            if bias is None:
                raise _unsupported(graph, found + " with a bias C that is not an initializer")
    elif not _is(node, "MatMul"):
        raise _unsupported(graph, found)
    kernel = _kernel(node)
    if kernel is None:
        raise _unsupported(graph, f"{node.op_type} {node.name!r} has no single kernel initializer")
    weights = [kernel] if bias is None else [kernel, bias]
    for value in weights:
        readers = {use.node.name for use in value.uses()}
        if len(readers) != 1:
            raise _unsupported(graph, f"initializer {value.name!r} is read by {sorted(readers)}")
    return node, weights


def _set(value: ir.Value, factor: float) -> None:
    """Multiply the initializer ``value`` by ``factor`` (in float64, dtype kept)."""
    array = _times(value.const_value.numpy(), factor)
    value.const_value = ir.tensor(array, name=value.name)


class ScaleHeadLrPass(InPlacePass):
    """Store the head's initializers divided by ``scale`` and multiply its output by ``scale``
    (module docstring); record it (:data:`HEAD_LR_KEY`). A model already scaled by ``scale`` is
    left as it is (legalising a legalised model gives the same model); ``scale`` 1 changes
    nothing.

    Args:
        scale: ``S``, positive and finite.

    Raises:
        HeadLrScaleError: ``scale`` is not positive and finite (at construction); the model has
            no head of a supported form, or is already scaled by another ``S`` (from ``call``).
    """

    def __init__(self, scale: float):
        super().__init__()
        self.scale = check_head_lr_scale(scale)

    def call(self, model: ir.Model) -> PassResult:
        recorded = head_lr_of(model)
        if recorded is not None:
            if recorded.scale == self.scale:
                return PassResult(model, modified=False)
            raise HeadLrScaleError(
                f"the model's head is stored scaled by {recorded.scale:g} already (a model "
                f"etgraph compiled): use --head-lr-scale {recorded.scale:g}, or start from the "
                "original model"
            )
        if self.scale == 1.0:
            return PassResult(model, modified=False)
        graph = model.graph
        layer, weights = find_head(graph)
        for value in weights:
            _set(value, 1.0 / self.scale)
        output = graph.outputs[0]
        name = output.name
        constant = ir.Value(
            name=f"{name}/head_lr_scale",
            shape=ir.Shape([]),
            type=ir.TensorType(ir.DataType.FLOAT),
            const_value=ir.tensor(np.array(self.scale, np.float32), name=f"{name}/head_lr_scale"),
        )
        graph.register_initializer(constant)
        mul = ir.node("Mul", [output, constant], name=f"{name}/HeadLrScale")
        output.name = f"{name}/before_head_lr_scale"
        scaled = mul.outputs[0]
        scaled.name, scaled.type, scaled.shape = name, output.type, output.shape
        graph.append(mul)
        graph.outputs[0] = scaled
        record = HeadLrScale(
            scale=self.scale,
            tensors=tuple(v.name for v in weights),
            layer=layer.name,
            node=mul.name,
            constant=constant.name,
        )
        model.metadata_props[HEAD_LR_KEY] = record.to_json()
        log.info("head %r stored at 1/%g, its output times %g", layer.name, self.scale, self.scale)
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        recorded = head_lr_of(model)
        if self.scale != 1.0 and recorded is None:
            raise PostconditionError("the head's scale is not recorded")
        if recorded is not None and not _is(model.graph.outputs[0].producer(), "Mul"):
            raise PostconditionError("the output of a scaled head is not made by its Mul")


class FoldHeadLrScalePass(InPlacePass):
    """Undo :class:`ScaleHeadLrPass`: the recorded initializers multiplied by ``S``, the ``Mul``
    removed (its input takes the output's name back), the record and the constant dropped.

    Args:
        record: what was done (default: the model's own record; ``generate_artifacts`` keeps
            the metadata in the training and eval graphs). Pass the trained model's record for
            a model that lost its metadata. A model with no record is left as it is.

    Raises:
        HeadLrScaleError: the model does not hold the recorded ``Mul`` on its output, or a
            recorded initializer.
    """

    def __init__(self, record: HeadLrScale | None = None):
        super().__init__()
        self.record = record

    def call(self, model: ir.Model) -> PassResult:
        record = self.record if self.record is not None else head_lr_of(model)
        if record is None:
            return PassResult(model, modified=False)
        graph = model.graph
        output = graph.outputs[0] if len(graph.outputs) == 1 else None
        mul = output.producer() if output is not None else None
        if mul is None or mul.name != record.node or not _is(mul, "Mul"):
            raise HeadLrScaleError(
                f"the model's output is not made by the head's scale {record.node!r}: "
                "it is not the model its record describes"
            )
        missing = [n for n in record.tensors if n not in graph.initializers]
        if missing:
            raise HeadLrScaleError(f"the model has no initializer {missing[0]!r} to fold into")
        for name in record.tensors:
            _set(graph.initializers[name], record.scale)
        source, name = mul.inputs[0], output.name
        if source.type is None:
            source.type = output.type
        source.shape = output.shape if output.shape is not None else source.shape
        graph.outputs[0] = source
        graph.remove(mul, safe=True)
        source.name = name
        constant = graph.initializers.get(record.constant)
        if constant is not None and not constant.uses():
            graph.initializers.pop(record.constant)
        model.metadata_props.pop(HEAD_LR_KEY, None)
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        if HEAD_LR_KEY in model.metadata_props:
            raise PostconditionError("the head's scale is still recorded")
