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
from etgraph.exporters import remedy
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


#: The domain of classical machine-learning ops (skl2onnx, onnxmltools): none has a gradient.
ML_DOMAIN = "ai.onnx.ml"


class RefuseNoGradOpsPass(InPlacePass):
    """Refuse every op without a gradient in ORT 1.19.2 on the data path, at once (an
    analysis: changes nothing): the registry's ops (:func:`etgraph.ops.no_gradient_ops`) and
    classical machine-learning ops (:data:`ML_DOMAIN`: LinearClassifier, TreeEnsemble...,
    their weights in attributes).

    Raises (from ``call``):
        UnsupportedOpError: one line naming every blocking node, grouped by op, with the
            registry's ``why`` and ``fix`` and what to do for the model's exporter
            (:func:`etgraph.exporters.remedy`), e.g. ``<source>: 2 nodes use ops without a
            gradient in onnxruntime-training 1.19.2: GlobalMaxPool 'a', 'b' (has no gradient:
            replace it by ...); ... and re-export``.
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
        suspects = [
            n
            for n in model.graph
            if (n.domain in ("", "ai.onnx") and n.op_type in no_gradient) or n.domain == ML_DOMAIN
        ]
        if not suspects:
            return PassResult(model, modified=False)
        skeleton = graph_skeleton(model.graph)
        carrying = data_path_values(skeleton)
        blocking: dict[str, list[str]] = {}  # op -> node names, in graph order
        for node in skeleton.node:
            if node.domain == ML_DOMAIN:
                if any(v in carrying for v in node.input):
                    blocking.setdefault(f"{ML_DOMAIN}.{node.op_type}", []).append(node.name)
                continue
            rule = no_gradient.get(node.op_type)
            if rule is None or not is_default_domain(node):
                continue
            if any(  # a subgraph's outer reads count (node_reads): an If of the data
                v in carrying for i, v in enumerate(node_reads(node)) if i not in rule.nondiff_slots
            ):
                blocking.setdefault(node.op_type, []).append(node.name)
        if blocking:
            raise UnsupportedOpError(self._message(model, blocking, no_gradient))
        return PassResult(model, modified=False)

    def _message(self, model: ir.Model, blocking: dict[str, list[str]], rules) -> str:
        """One line: a single node as ``node 'x' uses op Op, which <why> in ...; <fix> and
        re-export``; several grouped by op (the classical machine-learning ops together), each
        with its why and fix, the exporter's remedy last."""
        version = "onnxruntime-training 1.19.2"
        ml = {op: names for op, names in blocking.items() if op.startswith(ML_DOMAIN)}
        ops = {op: names for op, names in blocking.items() if op not in ml}
        ml_fix = "use a neural-network estimator (MLPClassifier, MLPRegressor)"
        ending = remedy(
            ml_fix if ml else "change them" if len(blocking) > 1 else rules[next(iter(ops))].fix,
            producer_name=model.producer_name,
            source=self.source,
            torch="; ".join(rules[op].torch_fix for op in ops if rules[op].torch_fix) or None,
            needed=f"a rewrite of {', '.join(op.split('.')[-1] for op in blocking)} into ops "
            "with gradients",
        )

        def named(op: str, names: list[str]) -> str:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            return f"{op.split('.')[-1]} {', '.join(repr(n) for n in names[:3])}{more}"

        if not ml and sum(len(names) for names in ops.values()) == 1:
            ((op, (name,)),) = ops.items()
            why = rules[op].why
            return f"{self.source}: node {name!r} uses op {op}, which {why} in {version}; {ending}"
        parts = [
            f"{named(op, names)} ({rules[op].why}: {rules[op].fix})" for op, names in ops.items()
        ]
        if ml:
            parts.append(
                f"{ML_DOMAIN} {', '.join(named(op, names) for op, names in ml.items())} "
                "(classical machine-learning ops: their weights are attributes, not tensors, "
                "and they have no gradient)"
            )
        count = sum(len(names) for names in blocking.values())
        nodes = "a node uses an op" if count == 1 else f"{count} nodes use ops"
        return (
            f"{self.source}: {nodes} without a gradient in {version}: {'; '.join(parts)}; {ending}"
        )
