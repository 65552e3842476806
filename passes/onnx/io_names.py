"""The model's interface: its data inputs keep their names; one output is trained on.

Every later stage feeds the model by its own input names (an image batch ``input``, token
inputs ``input_ids``, ``attention_mask``, ``token_type_ids`` ...) and computes the loss on one
graph output: the only one, or the one the user names (``--output NAME``). The other outputs
are taken off the graph, with the nodes only they needed, so ORT's loss block sees one output.
Names are not changed, so the exported inference model has the original input and output names.
"""

from __future__ import annotations

import json
import logging

import onnx
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from etgraph.errors import ConfigError, ModelError

log = logging.getLogger(__name__)

__all__ = ["OUTPUTS_KEY", "SOURCE_KEY", "SelectOutputPass", "data_inputs", "unzip_map_outputs"]

#: Metadata keys recorded when outputs are dropped: the original outputs (JSON list) and the
#: file they came from, so the trained model can be exported with all of them
#: (:func:`etgraph.onnx_io.export_with_original_outputs`).
OUTPUTS_KEY = "etgraph.original_outputs"
SOURCE_KEY = "etgraph.source"


def unzip_map_outputs(
    model: onnx.ModelProto, output: str | None = None, source: str = "model"
) -> tuple[onnx.ModelProto, str | None]:
    """An output that is a ZipMap of a float tensor (skl2onnx's default classifier output:
    a sequence of {class: probability} maps, which onnx_ir and ORT's training graphs cannot
    hold) becomes that tensor; proto level, before the model is read into onnx_ir.

    The original outputs are recorded (:data:`OUTPUTS_KEY`), so the trained model is exported
    as the original, ZipMap included (:func:`etgraph.onnx_io.export_with_original_outputs`).
    ``value_info`` entries of map or sequence type are dropped.

    Args:
        model: the user's model (not changed). output: ``--output`` as given (None: not
            given); the name of a ZipMap output stands for its tensor.

    Returns:
        ``(model, output)``: a copy when something changed, and the output name to select.
    """
    made_by = {v: n for n in model.graph.node for v in n.output}
    zipped = {
        o.name: made_by[o.name]
        for o in model.graph.output
        if o.name in made_by
        and made_by[o.name].op_type == "ZipMap"
        and made_by[o.name].domain == "ai.onnx.ml"
    }
    if not zipped:
        return model, output
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = [o.name for o in model.graph.output]
    tensors = {name: node.input[0] for name, node in zipped.items()}
    try:  # the tensor's type and shape: skl2onnx records none for inner values
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001  (a model shape inference cannot follow: no shapes)
        inferred = model.graph
    known = {v.name: v for v in [*inferred.value_info, *inferred.output]}
    del out.graph.output[:]
    for o in model.graph.output:
        if o.name not in tensors:
            out.graph.output.append(o)
            continue
        tensor = tensors[o.name]
        info = known.get(tensor)
        if info is None or not info.type.HasField("tensor_type"):
            info = onnx.helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT, None)
        out.graph.output.append(info)
    keep = [n for n in out.graph.node if not (n.op_type == "ZipMap" and n.output[0] in tensors)]
    del out.graph.node[:]
    out.graph.node.extend(keep)
    tensor_infos = [v for v in out.graph.value_info if v.type.HasField("tensor_type")]
    del out.graph.value_info[:]
    out.graph.value_info.extend(tensor_infos)
    if OUTPUTS_KEY not in {p.key for p in out.metadata_props}:
        out.metadata_props.add(key=OUTPUTS_KEY, value=json.dumps(names))
        out.metadata_props.add(key=SOURCE_KEY, value=source)
    log.info("%s: output(s) %s are ZipMaps: trained on their tensors", source, sorted(tensors))
    return out, tensors.get(output, output)


def data_inputs(graph: ir.Graph) -> list[ir.Value]:
    """Graph inputs that are not initializers (IR < 4 lists initializers as inputs too)."""
    return [v for v in graph.inputs if v.name not in graph.initializers]


_FLOAT_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16)


class SelectOutputPass(InPlacePass):
    """Keep the one graph output the loss is computed on (the only one, or ``output``) and drop
    the others with the nodes only they used (recorded in the metadata: :data:`OUTPUTS_KEY`,
    :data:`SOURCE_KEY`); check the model has a data input.

    Args:
        source: what the model is called in errors.
        output: name of the output to train on; None = the model's only output, or its only
            float output beside integer ones (a classifier's label output).

    Raises (from ``call``):
        ModelError: the graph has no data input or no output.
        ConfigError: several float outputs and no ``output`` (the message lists them), or
            ``output`` is not one of the outputs.
    """

    def __init__(self, source: str = "model", output: str | None = None):
        super().__init__()
        self.source = source
        self.output = output

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        if not data_inputs(graph):
            raise ModelError(f"{self.source}: the model has no graph input (besides weights)")
        names = [v.name for v in graph.outputs]
        if not names:
            raise ModelError(f"{self.source}: the model has no graph output")
        output = self.output
        if output is None and len(names) > 1:
            floats = [v.name for v in graph.outputs if v.dtype in _FLOAT_DTYPES]
            if len(floats) != 1:
                raise ConfigError(
                    f"{self.source} has {len(names)} outputs {names[:8]}: pick the one to train "
                    "on with --output NAME"
                )
            output = floats[0]  # beside integer labels (a classifier's predicted class)
        if output is None:
            return PassResult(model, modified=False)
        if output not in names:
            raise ConfigError(
                f"{self.source} has no output {output!r}: choose --output from {names[:8]}"
            )
        if names == [output]:
            return PassResult(model, modified=False)
        keep = graph.outputs[names.index(output)]
        graph.outputs.clear()
        graph.outputs.append(keep)
        removed = _remove_dead_nodes(graph)
        if OUTPUTS_KEY not in model.metadata_props:  # unzip_map_outputs recorded them first
            model.metadata_props[OUTPUTS_KEY] = json.dumps(names)
            model.metadata_props[SOURCE_KEY] = self.source
        log.info(
            "%s: training on output %r; %d other outputs and %d nodes only they used removed",
            self.source,
            output,
            len(names) - 1,
            removed,
        )
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        if len(model.graph.outputs) != 1:
            raise PostconditionError(f"graph outputs are {[v.name for v in model.graph.outputs]}")


def _remove_dead_nodes(graph: ir.Graph) -> int:
    """Remove the nodes none of whose outputs reach a graph output (reverse order); returns
    the count."""
    live = {id(v) for v in graph.outputs}
    dead = []
    for node in reversed(list(graph)):
        if any(id(v) in live for v in node.outputs):
            live.update(id(v) for v in node.inputs if v is not None)
        else:
            dead.append(node)
    for node in dead:
        graph.remove(node, safe=True)
    return len(dead)
