"""Fix-up of the eval model ``generate_artifacts`` writes (an onnxruntime-training 1.19.2 bug).

ORT 1.19.2's eval model keeps BatchNormalization's three training outputs while setting
``training_mode=0``; it then fails to load ("This number of op outputs should be 1 when
Training_mode = False"). The extra outputs are unused in the eval graph and are dropped.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError, PreconditionError

__all__ = ["TrimEvalBatchNormPass"]


def _batch_norms(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.domain == "" and n.op_type == "BatchNormalization"]


class TrimEvalBatchNormPass(InPlacePass):
    """Keep only output 0 (Y) of BatchNormalization nodes in ORT's eval model."""

    def requires(self, model: ir.Model) -> None:
        for node in _batch_norms(model):
            used = [v.name for v in node.outputs[1:] if v.uses() or v.is_graph_output()]
            if used:
                raise PreconditionError(f"eval model uses BatchNormalization outputs {used}")

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for node in _batch_norms(model):
            if len(node.outputs) > 1:
                node.resize_outputs(1)
                modified = True
        return PassResult(model, modified=modified)

    def ensures(self, model: ir.Model) -> None:
        if any(len(node.outputs) != 1 for node in _batch_norms(model)):
            raise PostconditionError("a BatchNormalization node kept more than one output")
