"""Weights wherever they live: float tensors held in ``Constant`` / ``ConstantOfShape`` nodes
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

log = logging.getLogger(__name__)

__all__ = ["MaterializeWeightsPass"]


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
    else:
        return None
    return array if array.dtype.kind == "f" and array.size >= 2 else None


class MaterializeWeightsPass(InPlacePass):
    """Turn float Constant/ConstantOfShape weights (>= 2 elements) into initializers."""

    def call(self, model: ir.Model) -> PassResult:
        moved = 0
        for node in list(model.graph):
            array = _weight_value(node)
            if array is None:
                continue
            output = node.outputs[0]
            shape_input = node.inputs[0] if node.op_type == "ConstantOfShape" else None
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
                model.graph.initializers.pop(shape_input.name)  # its only use was the weight
            moved += 1
        if moved:
            log.info("%d float weights held in Constant/ConstantOfShape nodes lifted", moved)
        return PassResult(model, modified=moved > 0)

    def ensures(self, model: ir.Model) -> None:
        left = [n.name for n in model.graph if _weight_value(n) is not None]
        if left:
            raise PostconditionError(f"float weights still held in nodes: {left[:3]}")
