"""Unique, non-empty node names: the profiler maps ORT's per-node events (``<node>_kernel_time``)
and the backward nodes (``<node>_Grad/...``) to forward nodes by name.

onnx_ir's ``NameFixPass`` is not used: besides nodes it names every unnamed *value*, and an
empty name is how ONNX leaves out an optional output (naming MaxPool's Indices makes ORT
compute them; ORT refuses a BatchNormalization with ``training_mode=0`` and a named running
mean output).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

__all__ = ["NameNodesPass", "check_node_names"]


def check_node_names(graph: ir.Graph) -> None:
    """Raise ``PostconditionError`` unless every node of ``graph`` has a unique non-empty name."""
    names = [node.name for node in graph]
    if not all(names) or len(set(names)) != len(names):
        empty = sum(not n for n in names)
        raise PostconditionError(
            f"{empty} unnamed node(s), {len(names) - len(set(names))} duplicate name(s)"
        )


class NameNodesPass(InPlacePass):
    """Name unnamed nodes ``<op_type>_<position>`` and make duplicate names unique (``_<k>``)."""

    def call(self, model: ir.Model) -> PassResult:
        seen: set[str] = set()
        modified = False
        for position, node in enumerate(model.graph):
            name = base = node.name or f"{node.op_type}_{position}"
            k = 1
            while name in seen:
                name = f"{base}_{k}"
                k += 1
            if name != node.name:
                node.name = name
                modified = True
            seen.add(name)
        return PassResult(model, modified=modified)

    def ensures(self, model: ir.Model) -> None:
        check_node_names(model.graph)
