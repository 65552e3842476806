"""A batch dimension fixed at export (zoo models ship with batch 1) becomes symbolic, so the
model trains at any ``--batch-size`` (issue #14).

The shapes recorded for intermediate values carry the old batch size and would contradict
shape inference at another one (ORT: "Inferred shape and existing shape differ in dimension 0"),
so they are dropped with it; ORT infers them again. Reshapes on the data path whose constant
target shape starts with the old batch size (Caffe2-era zoo models flatten to ``[1, 2048]``;
torch writes ``x.view(B, T, heads, d)`` with every size known at export as a Concat of scalar
Constants) get ``0`` there instead: ONNX's "copy this dimension from the input". A batch
folded into a product (``[T, B*heads, d]``) stays: the error at another batch names the export
batch (:func:`etgraph.io_specs.exported_batch_hint`).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from .io_names import data_inputs

log = logging.getLogger(__name__)

__all__ = ["BATCH_DIM", "EXPORTED_BATCH_KEY", "FreeBatchDimPass"]

#: Name of the symbolic batch dimension.
BATCH_DIM = "batch"
#: Metadata key (model ``metadata_props``) of the batch size the model was exported at, when
#: this pass freed it: a graph may still fix it where no pass can see (an attention's
#: ``[T, B*heads, d]`` reshape computed from constants), and errors at another batch name it.
EXPORTED_BATCH_KEY = "etgraph.exported_batch"


def _fixed_batch(value: ir.Value) -> bool:
    shape = value.shape
    return shape is not None and len(shape) > 0 and isinstance(shape[0], int)


class FreeBatchDimPass(InPlacePass):
    """Make a fixed batch dimension of the data input and the outputs symbolic (`batch`) and
    drop the intermediate shapes recorded at the old batch size.

    Args:
        reshapes: also give data-path Reshapes whose constant shape starts with the old batch
            size a leading 0 (a zoo model's own constants). False for a model etgraph fixed
            the batch of itself (its constants never held it).
    """

    def __init__(self, reshapes: bool = True):
        super().__init__()
        self.reshapes = reshapes

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        fixed = [v for v in (*data_inputs(graph), *graph.outputs) if _fixed_batch(v)]
        if not fixed:
            return PassResult(model, modified=False)
        batch = fixed[0].shape[0]
        model.metadata_props[EXPORTED_BATCH_KEY] = str(batch)
        for value in fixed:
            value.shape = ir.Shape([BATCH_DIM, *list(value.shape)[1:]])
        reshapes = _free_reshapes(graph, batch) if self.reshapes else 0
        outputs = {id(v) for v in graph.outputs}
        for node in graph:
            for value in node.outputs:
                if id(value) not in outputs:
                    value.shape = None
        log.info(
            "fixed batch dimension %d of %s made symbolic (%d reshapes)",
            batch,
            [v.name for v in fixed],
            reshapes,
        )
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        graph = model.graph
        fixed = [v.name for v in (*data_inputs(graph), *graph.outputs) if _fixed_batch(v)]
        if fixed:
            raise PostconditionError(f"batch dimension still fixed on {fixed}")


def _data_path(graph: ir.Graph) -> set[int]:
    """ids of the values computed from the data input (node order is topological)."""
    reached = {id(v) for v in data_inputs(graph)}
    for node in graph:
        if any(v is not None and id(v) in reached for v in node.inputs):
            reached.update(id(v) for v in node.outputs)
    return reached


def _constant_ints(value: ir.Value | None) -> np.ndarray | None:
    """The int64 values of ``value`` when they are known statically: an initializer, a
    ``Constant`` node (``value`` or ``value_ints``), or an ``Unsqueeze`` of one (how torch
    writes a shape's elements)."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy().astype(np.int64).reshape(-1)
    node = value.producer()
    if node is None or node.domain != "":
        return None
    if node.op_type == "Constant" and "value" in node.attributes:
        return node.attributes["value"].as_tensor().numpy().astype(np.int64).reshape(-1)
    if node.op_type == "Constant" and "value_ints" in node.attributes:  # torch's dynamo exporter
        return np.array(node.attributes["value_ints"].as_ints(), dtype=np.int64)
    if node.op_type == "Unsqueeze" and node.inputs:
        return _constant_ints(node.inputs[0])
    return None


def _free_concat_shape(graph: ir.Graph, concat: ir.Node, batch: int) -> int:
    """A shape built by ``Concat`` (torch: ``x.view(B, T, heads, d)`` with every size known
    at export) whose first element is the export batch: that element becomes a 0 of its own
    (a new Constant; shared constants stay). Only for a Concat that feeds this one Reshape.
    Returns 1 if rewritten."""
    out = concat.outputs[0]
    if len(out.uses()) != 1 or not concat.inputs:
        return 0
    first = _constant_ints(concat.inputs[0])
    if first is None or first.size != 1 or first[0] != batch:
        return 0
    name = f"{concat.name or 'concat'}/batch"
    zero = ir.Node(
        "",
        "Constant",
        [],
        attributes=[ir.AttrTensor("value", ir.tensor(np.zeros(1, np.int64)))],
        name=name,
    )
    zero.outputs[0].name = name
    graph.insert_before(concat, zero)
    concat.replace_input_with(0, zero.outputs[0])
    return 1


def _no_zero_after_batch(shape: ir.Value, kind: str | None) -> bool:
    """The constant shape (an initializer, a Constant, or a Concat of constants) has no 0
    after its first element, so a Reshape with ``allowzero=1`` (torch's dynamo exporter) can
    take ``allowzero=0`` and a leading 0 that copies the batch."""
    if kind == "Concat":
        parts = [_constant_ints(v) for v in shape.producer().inputs]
        if any(p is None for p in parts):
            return False
        target = np.concatenate(parts)
    else:
        target = _constant_ints(shape)
    return target is not None and not (target[1:] == 0).any()


def _free_reshapes(graph: ir.Graph, batch: int) -> int:
    """Give data-path Reshapes whose constant shape (an initializer, a ``Constant`` node as a
    torch TRAINING export writes it, or torch's Concat of scalar Constants:
    :func:`_free_concat_shape`) starts with ``batch`` a leading 0 (copy the input's batch; a
    Reshape with ``allowzero=1`` gets ``allowzero=0`` when its shape has no other 0); a shape
    constant used anywhere else is left alone. Returns the count."""
    data = _data_path(graph)
    count = 0
    for node in graph:
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        data_in, shape_in = node.inputs[0], node.inputs[1]
        if data_in is None or id(data_in) not in data or shape_in is None:
            continue
        if len(shape_in.uses()) != 1:
            continue
        producer = shape_in.producer()
        kind = "initializer" if shape_in.is_initializer() else None
        if producer is not None and producer.domain == "":
            kind = producer.op_type
        if node.attributes.get_int("allowzero", 0) and not _no_zero_after_batch(shape_in, kind):
            continue  # a 0 there is a literal 0: the leading one cannot mean "copy"
        if kind == "Concat":
            freed = _free_concat_shape(graph, producer, batch)
            if freed and node.attributes.get_int("allowzero", 0):
                node.attributes["allowzero"] = ir.AttrInt64("allowzero", 0)
            count += freed
            continue
        target = _constant_ints(shape_in) if kind in ("initializer", "Constant") else None
        if target is None or target.size == 0 or target[0] != batch:
            continue
        target[0] = 0  # _constant_ints returns a copy
        if node.attributes.get_int("allowzero", 0):  # torch's dynamo exporter sets it
            node.attributes["allowzero"] = ir.AttrInt64("allowzero", 0)
        if kind == "initializer":
            shape_in.const_value = ir.tensor(target, name=shape_in.name)
        else:
            producer.attributes["value"] = ir.AttrTensor("value", ir.tensor(target))
        count += 1
    return count
