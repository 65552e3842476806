"""A graph input read by a normalisation layer and by other nodes reaches the normalisation layer
through an ``Identity``.

onnxruntime-training 1.19.2's gradient builder of BatchNormalization always writes the gradient
of its input, named ``<input>_grad``, even when nothing needs it; when the input is a graph input
that another node reads too (a stem that concatenates the normalised image with the raw one), the
other reader's gradient writes ``<input>_grad`` again and ORT refuses its own training graph
("Duplicate definition of name (x_grad)", measured on a torch export). Behind an Identity the
normalisation layer's input gradient has a name of its own; the model computes the same.
"""

from __future__ import annotations

import logging

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from etgraph.ops import op_rule

log = logging.getLogger(__name__)

__all__ = ["IsolateInputNormPass"]


def _shared_norm_inputs(graph: ir.Graph) -> list[tuple[ir.Value, list[tuple[ir.Node, int]]]]:
    """Graph inputs read by a normalisation layer (registry family ``norm``) and by some other
    node: ``(input, [(norm node, input index), ...])``."""
    found = []
    for value in graph.inputs:
        uses = list(value.uses())
        norm = [(u.node, u.idx) for u in uses if op_rule(u.node.op_type).family == "norm"]
        if norm and (len(uses) > len(norm) or len(norm) > 1):
            found.append((value, norm))
    return found


class IsolateInputNormPass(InPlacePass):
    """Route a shared graph input into each normalisation layer that reads it through an
    ``Identity`` named ``<layer>/input``."""

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        shared = _shared_norm_inputs(graph)
        for value, readers in shared:
            for node, index in readers:
                name = f"{node.name or node.op_type}/input"
                identity = ir.Node("", "Identity", [value], name=name)
                identity.outputs[0].name = name
                identity.outputs[0].type = value.type
                identity.outputs[0].shape = value.shape
                graph.insert_before(node, identity)
                node.replace_input_with(index, identity.outputs[0])
            log.info(
                "graph input %r reaches %d normalisation layers through an Identity",
                value.name,
                len(readers),
            )
        return PassResult(model, modified=bool(shared))

    def ensures(self, model: ir.Model) -> None:
        left = [v.name for v, _ in _shared_norm_inputs(model.graph)]
        if left:
            raise PostconditionError(f"graph inputs still read by norms and others: {left}")
