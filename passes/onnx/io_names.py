"""The model's interface: one data input named ``input`` and one output named ``logits``.

Every later stage (the tensor graph, the profiler's feeds, ORT's loss on ``logits``) relies on
these two names, so they are fixed here once.
"""

from __future__ import annotations

import logging

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from etgraph.errors import ModelError

log = logging.getLogger(__name__)

__all__ = ["INPUT_NAME", "OUTPUT_NAME", "NameInputOutputPass", "data_inputs"]

#: Name of the legalised model's one data input (float32 ``[B, C, H, W]``).
INPUT_NAME = "input"
#: Name of the legalised model's one output (``[B, classes]``).
OUTPUT_NAME = "logits"


def data_inputs(graph: ir.Graph) -> list[ir.Value]:
    """Graph inputs that are not initializers (IR < 4 lists initializers as inputs too)."""
    return [v for v in graph.inputs if v.name not in graph.initializers]


def _value_names(graph: ir.Graph) -> set[str]:
    names = {v.name for v in graph.inputs} | set(graph.initializers)
    for node in graph:
        names.update(v.name for v in (*node.inputs, *node.outputs) if v is not None)
    return names


class NameInputOutputPass(InPlacePass):
    """Rename the one data input ``input`` and the one output ``logits``.

    Raises (from ``call``):
        ModelError: the graph has not exactly one data input or one output (the message lists
            up to five of their names), or another value already has the name to give.
    """

    def __init__(
        self, source: str = "model", input_name: str = INPUT_NAME, output_name: str = OUTPUT_NAME
    ):
        super().__init__()
        self.source = source
        self.input_name = input_name
        self.output_name = output_name

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        inputs = data_inputs(graph)
        if len(inputs) != 1:
            raise ModelError(
                f"{self.source}: expected exactly one graph input (the image batch), found "
                f"{len(inputs)}: {[v.name for v in inputs][:5]}"
            )
        if len(graph.outputs) != 1:
            raise ModelError(
                f"{self.source}: expected exactly one graph output (the logits), found "
                f"{len(graph.outputs)}: {[v.name for v in graph.outputs][:5]}"
            )
        modified = self._rename(graph, inputs[0], self.input_name)
        modified = self._rename(graph, graph.outputs[0], self.output_name) or modified
        return PassResult(model, modified=modified)

    def _rename(self, graph: ir.Graph, value: ir.Value, new: str) -> bool:
        old = value.name
        if old == new:
            return False
        if new in _value_names(graph):
            raise ModelError(
                f"{self.source}: cannot rename {old!r} to {new!r}: the name is already used"
            )
        value.name = new  # every use, graph input/output and value_info follow the Value
        log.debug("%s: value %r renamed %r", self.source, old, new)
        return True

    def ensures(self, model: ir.Model) -> None:
        names = ([v.name for v in data_inputs(model.graph)], [v.name for v in model.graph.outputs])
        if names != ([self.input_name], [self.output_name]):
            raise PostconditionError(f"graph inputs/outputs are {names}")
