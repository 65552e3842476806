"""Optional outputs ORT 1.19.2's gradient builders read (ORT issues #22465, #22955).

The builders of LayerNormalization and Dropout index outputs the exporter may leave out
(LayerNormalization: Mean, InvStdDev; Dropout: mask); ``generate_artifacts`` then fails with
``GradientBuilderBase::O ... i < node_->OutputDefs().size()``. Giving the nodes those outputs
(unused by the forward graph) fixes it.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError, PreconditionError

__all__ = [
    "OPTIONAL_OUTPUTS",
    "AddOptionalOutputsPass",
    "NamedOutputsPass",
    "name_outputs",
    "value_names",
]

#: Default-domain op type -> name suffixes of outputs 1, 2, ... it must carry.
OPTIONAL_OUTPUTS: dict[str, tuple[str, ...]] = {
    "LayerNormalization": ("mean", "inv_std_dev"),
    "Dropout": ("mask",),
}


def value_names(graph: ir.Graph) -> set[str]:
    """Every value name in use in ``graph`` (inputs, initializers, node outputs)."""
    taken = {v.name for node in graph for v in node.outputs if v.name}
    return taken | {v.name for v in graph.inputs} | set(graph.initializers)


def name_outputs(node: ir.Node, suffixes: tuple[str, ...], taken: set[str]) -> bool:
    """Give ``node`` outputs 1, 2, ... named ``<node>/<suffix>`` (unique in ``taken``, which
    records them) where they are missing or unnamed. Returns whether anything changed."""
    if len(node.outputs) < 1 + len(suffixes):
        node.resize_outputs(1 + len(suffixes))
    changed = False
    for value, suffix in zip(node.outputs[1:], suffixes, strict=False):
        if not value.name:
            value.name = _fresh(f"{node.name}/{suffix}", taken)
            changed = True
    return changed


class NamedOutputsPass(InPlacePass):
    """A pass that names new node outputs after their nodes: it requires named nodes."""

    def requires(self, model: ir.Model) -> None:
        if any(not node.name for node in model.graph):
            raise PreconditionError("nodes must be named first (NameNodesPass)")


class AddOptionalOutputsPass(NamedOutputsPass):
    """Give LayerNormalization its Mean/InvStdDev outputs and Dropout its mask output, named
    ``<node>/<what>``."""

    def call(self, model: ir.Model) -> PassResult:
        taken = value_names(model.graph)
        modified = False
        for node in model.graph:
            suffixes = OPTIONAL_OUTPUTS.get(node.op_type) if node.domain == "" else None
            if suffixes:
                modified |= name_outputs(node, suffixes, taken)
        return PassResult(model, modified=modified)

    def ensures(self, model: ir.Model) -> None:
        for node in model.graph:
            suffixes = OPTIONAL_OUTPUTS.get(node.op_type) if node.domain == "" else None
            wanted = node.outputs[1 : 1 + len(suffixes)] if suffixes else ()
            if suffixes and (len(wanted) < len(suffixes) or not all(v.name for v in wanted)):
                raise PostconditionError(f"node {node.name!r} lacks an optional output")


def _fresh(name: str, taken: set[str]) -> str:
    """``name``, or ``name_<k>`` if taken; recorded in ``taken``."""
    base, k = name, 1
    while name in taken:
        name = f"{base}_{k}"
        k += 1
    taken.add(name)
    return name
