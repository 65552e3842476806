"""Post-processing of the training graph ``generate_artifacts`` writes (issue #16).

:class:`DropUnusedOptionalOutputsPass` — ORT's training graph keeps the optional outputs the
gradient builders would read even where no gradient is computed: a MaxPool in the frozen part
of a selection still produces its Indices (``<output>_mask``), which sends ORT 1.19.2 to its
generic pooling loop instead of MLAS's (ResNet50 stem at 128 px, batch 4, one thread: 14 ms per
step for the MaxPool alone); Dropout still writes its mask. Outputs nothing reads (no node, not
a graph output) are dropped: trailing ones removed, others given the empty name ONNX uses for
an omitted optional output.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

__all__ = ["DROPPABLE_OUTPUTS", "DropUnusedOptionalOutputsPass"]

#: Default-domain op type -> indices of optional outputs whose absence changes no other
#: output (ONNX spec): MaxPool Indices, Dropout mask, LayerNormalization Mean/InvStdDev.
DROPPABLE_OUTPUTS: dict[str, tuple[int, ...]] = {
    "MaxPool": (1,),
    "Dropout": (1,),
    "LayerNormalization": (1, 2),
}


def _unused(value: ir.Value | None) -> bool:
    return value is not None and not value.uses() and not value.is_graph_output()


def _droppable(node: ir.Node) -> list[int]:
    if node.domain not in ("", "ai.onnx"):
        return []
    return [
        i
        for i in DROPPABLE_OUTPUTS.get(node.op_type, ())
        if i < len(node.outputs) and node.outputs[i].name and _unused(node.outputs[i])
    ]


class DropUnusedOptionalOutputsPass(InPlacePass):
    """Drop the optional outputs of :data:`DROPPABLE_OUTPUTS` nothing reads."""

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for node in model.graph:
            drop = _droppable(node)
            if not drop:
                continue
            for i in drop:
                node.outputs[i].name = ""
            keep = len(node.outputs)
            while keep > 1 and not node.outputs[keep - 1].name and _unused(node.outputs[keep - 1]):
                keep -= 1
            node.resize_outputs(keep)
            modified = True
        return PassResult(model, modified=modified)

    def ensures(self, model: ir.Model) -> None:
        left = [node.name for node in model.graph if _droppable(node)]
        if left:
            raise PostconditionError(f"unused optional outputs left on {left[:5]}")
