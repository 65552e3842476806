"""A batch dimension fixed at export (zoo models ship with batch 1) becomes symbolic, so the
model trains at any ``--batch-size`` (issue #14).

The shapes recorded for intermediate values carry the old batch size and would contradict
shape inference at another one (ORT: "Inferred shape and existing shape differ in dimension 0"),
so they are dropped with it; ORT infers them again.
"""

from __future__ import annotations

import logging

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from .io_names import data_inputs

log = logging.getLogger(__name__)

__all__ = ["BATCH_DIM", "FreeBatchDimPass"]

#: Name of the symbolic batch dimension.
BATCH_DIM = "batch"


def _fixed_batch(value: ir.Value) -> bool:
    shape = value.shape
    return shape is not None and len(shape) > 0 and isinstance(shape[0], int)


class FreeBatchDimPass(InPlacePass):
    """Make a fixed batch dimension of the data input and the outputs symbolic (`batch`) and
    drop the intermediate shapes recorded at the old batch size."""

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        fixed = [v for v in (*data_inputs(graph), *graph.outputs) if _fixed_batch(v)]
        if not fixed:
            return PassResult(model, modified=False)
        for value in fixed:
            value.shape = ir.Shape([BATCH_DIM, *list(value.shape)[1:]])
        outputs = {id(v) for v in graph.outputs}
        for node in graph:
            for value in node.outputs:
                if id(value) not in outputs:
                    value.shape = None
        log.info("fixed batch dimension of %s made symbolic", [v.name for v in fixed])
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        graph = model.graph
        fixed = [v.name for v in (*data_inputs(graph), *graph.outputs) if _fixed_batch(v)]
        if fixed:
            raise PostconditionError(f"batch dimension still fixed on {fixed}")
