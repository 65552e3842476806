"""Refuse ops without a gradient in ORT 1.19.2 where a gradient must pass through them.

An op the registry (:mod:`etgraph.ops`) marks ``gradient=False`` (or ``"rewrite"`` left over)
is refused when one of its differentiable inputs can carry a gradient
(:func:`etgraph.ops.data_path_values`); off the data path (shape arithmetic, masks) it is
harmless. The error names the node, the op and the registry's ``fix``.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PreconditionError

from etgraph.errors import UnsupportedOpError
from etgraph.ops import data_path_values, is_default_domain, no_gradient_ops, node_reads

__all__ = ["RefuseNoGradOpsPass", "graph_skeleton"]


def graph_skeleton(graph: ir.Graph) -> onnx.GraphProto:
    """``graph`` as a ``GraphProto`` for :func:`etgraph.ops.data_path_values`: inputs, nodes and
    initializer names/types, without copying any weights."""
    proto = onnx.GraphProto()
    for value in graph.inputs:  # with the element type: non-float inputs carry no gradient
        proto.input.add(name=value.name).type.tensor_type.elem_type = int(value.dtype or 0)
    for name, value in graph.initializers.items():
        proto.initializer.add(name=name, data_type=int(value.dtype or 0))
    proto.node.extend(ir.serde.serialize_node(node) for node in graph)
    return proto


class RefuseNoGradOpsPass(InPlacePass):
    """Refuse an op without a gradient in ORT 1.19.2 on the data path (an analysis: changes
    nothing).

    Raises (from ``call``):
        UnsupportedOpError: ``<source>: node '<name>' uses op <Op>, which <why> in
            onnxruntime-training 1.19.2; <fix> and re-export`` (registry ``why`` and ``fix``).
    """

    def __init__(self, source: str = "model"):
        super().__init__()
        self.source = source

    def requires(self, model: ir.Model) -> None:
        # data_path_values walks the nodes once, in order: they must be topologically sorted
        produced: set[ir.Value] = set()
        for node in model.graph:
            for value in node.inputs:
                if value is not None and value.producer() is not None and value not in produced:
                    raise PreconditionError(f"node {node.name!r} precedes its input {value.name!r}")
            produced.update(node.outputs)

    def call(self, model: ir.Model) -> PassResult:
        no_gradient = no_gradient_ops()
        suspects = [n for n in model.graph if n.domain == "" and n.op_type in no_gradient]
        if not suspects:
            return PassResult(model, modified=False)
        skeleton = graph_skeleton(model.graph)
        carrying = data_path_values(skeleton)
        for node in skeleton.node:
            rule = no_gradient.get(node.op_type)
            if rule is None or not is_default_domain(node):
                continue
            if any(  # a subgraph's outer reads count (node_reads): an If of the data
                v in carrying for i, v in enumerate(node_reads(node)) if i not in rule.nondiff_slots
            ):
                raise UnsupportedOpError(
                    f"{self.source}: node {node.name!r} uses op {node.op_type}, which "
                    f"{rule.why} in onnxruntime-training 1.19.2; {rule.fix} and re-export"
                )
        return PassResult(model, modified=False)
