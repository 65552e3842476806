"""Weights wherever they live: float tensors held in ``Constant`` / ``ConstantOfShape`` nodes, or
aliased by an ``Identity`` of an initializer (how a torch export shares a deduplicated weight),
become initializers, so the importer finds them as trainable tensors (issue #14: inference
exports from model zoos and other frameworks, e.g. paddle2onnx, hold weights in nodes).

Only float tensors of at least two elements move: integer constants (shapes, axes) and float
scalars (``x * 0.5``, eps, the constants of etgraph's own rewrites) stay nodes, so a model
exported for training keeps its structure and hash.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from etgraph.ops import op_rule

log = logging.getLogger(__name__)

__all__ = ["MaterializeWeightsPass", "UntieSharedWeightsPass"]


def _weight_value(node: ir.Node) -> np.ndarray | None:
    """The float array (>= 2 elements) a Constant or ConstantOfShape node produces, or None."""
    if node.domain not in ("", "ai.onnx") or node.outputs[0].is_graph_output():
        return None
    if node.op_type == "Constant":
        attr = node.attributes.get("value")
        if attr is None or len(node.attributes) != 1:
            return None
        array = attr.as_tensor().numpy()
    elif node.op_type == "ConstantOfShape":
        shape = node.inputs[0].const_value if node.inputs and node.inputs[0] else None
        if shape is None:
            return None
        attr = node.attributes.get("value")
        fill = attr.as_tensor().numpy().reshape(-1) if attr is not None else np.zeros(1, np.float32)
        array = np.full(tuple(int(d) for d in shape.numpy().reshape(-1)), fill[0], fill.dtype)
    elif node.op_type == "Identity":  # exporters alias a deduplicated weight this way
        source = node.inputs[0] if node.inputs else None
        if source is None or not source.is_initializer() or source.const_value is None:
            return None
        array = source.const_value.numpy().copy()
    else:
        return None
    return array if array.dtype.kind == "f" and array.size >= 2 else None


class MaterializeWeightsPass(InPlacePass):
    """Turn float Constant/ConstantOfShape weights and Identity aliases of float initializers
    (>= 2 elements) into initializers of their own."""

    def call(self, model: ir.Model) -> PassResult:
        moved = 0
        for node in list(model.graph):
            array = _weight_value(node)
            if array is None:
                continue
            output = node.outputs[0]
            shape_input = (
                node.inputs[0] if node.op_type in ("ConstantOfShape", "Identity") else None
            )
            initializer = ir.Value(
                name=output.name,
                shape=ir.Shape(array.shape),
                type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                const_value=ir.tensor(array, name=output.name),
            )
            model.graph.register_initializer(initializer)
            output.replace_all_uses_with(initializer)
            model.graph.remove(node, safe=True)
            if (
                shape_input is not None
                and shape_input.is_initializer()
                and not shape_input.uses()
                and not shape_input.is_graph_input()
            ):
                model.graph.initializers.pop(shape_input.name)  # its only use was this weight
            moved += 1
        if moved:
            log.info("%d float weights held in Constant/ConstantOfShape nodes lifted", moved)
        return PassResult(model, modified=moved > 0)

    def ensures(self, model: ir.Model) -> None:
        left = [n.name for n in model.graph if _weight_value(n) is not None]
        if left:
            raise PostconditionError(f"float weights still held in nodes: {left[:3]}")


def _weight_uses(graph: ir.Graph) -> dict[str, list[tuple[ir.Node, int]]]:
    """Float initializer name -> the (node, input index) weight slots (registry
    ``weight_slots``) that read it."""
    uses: dict[str, list[tuple[ir.Node, int]]] = {}
    for node in graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        for index in op_rule(node.op_type).weight_slots:
            value = node.inputs[index] if index < len(node.inputs) else None
            if value is None or not value.is_initializer() or value.const_value is None:
                continue
            if value.dtype is None or not value.dtype.is_floating_point():
                continue
            uses.setdefault(value.name, []).append((node, index))
    return uses


class UntieSharedWeightsPass(InPlacePass):
    """Give every layer its own copy of a float initializer several layers' weight slots read.

    Exporters deduplicate identical initializers: an eval-mode torch export folds BatchNorm into
    each convolution, and the folded biases of a freshly initialised model are all zeros, so one
    bias tensor serves several convolutions (seen: 10 tensors shared by 3-8 layers in a
    MobileNetV2). etgraph's tensors are one layer's each (paper §5: a tensor's ``t_dw`` is its
    layer's), so the second and later uses read a copy named ``<name>/<node>``.

    Genuinely tied weights (one parameter used by several layers: a weight-tied embedding and
    output layer, a block applied twice) are untied too, and the copies then train apart: the
    trained model no longer ties them. That is said as a warning whenever the shared values are
    not all equal (an exporter deduplicates constant-valued tensors — zeros, ones — and only a
    tie shares arbitrary values); a constant-valued share is logged at info.
    """

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        copies = 0
        for name, slots in _weight_uses(graph).items():
            if len(slots) < 2:
                continue
            original = graph.initializers[name]
            for node, index in slots[1:]:
                copy_name = f"{name}/{node.name or node.op_type}_{index}"
                array = original.const_value.numpy().copy()
                copy = ir.Value(
                    name=copy_name,
                    shape=ir.Shape(array.shape),
                    type=original.type,
                    const_value=ir.tensor(array, name=copy_name),
                )
                graph.register_initializer(copy)
                node.replace_input_with(index, copy)
                copies += 1
            values = original.const_value.numpy()
            if values.size and np.all(values == values.flat[0]):
                log.info(
                    "initializer %r read by %d layers: untied (one copy each)", name, len(slots)
                )
            else:
                log.warning(
                    "tensor %r %s is read by %d layers (tied weights): etgraph trains one copy "
                    "per layer, so the trained model no longer ties them",
                    name,
                    "x".join(map(str, values.shape)),
                    len(slots),
                )
        return PassResult(model, modified=copies > 0)

    def ensures(self, model: ir.Model) -> None:
        shared = [n for n, slots in _weight_uses(model.graph).items() if len(slots) > 1]
        if shared:
            raise PostconditionError(f"initializers still shared by several layers: {shared[:3]}")
