"""Load, validate and legalise ONNX models for onnxruntime-training 1.19.2 (DESIGN: import).

:func:`load_model` is the one entry point for user models. It returns a model that
:func:`etgraph.artifacts.generate` can turn into training artifacts:

* one graph input (besides initializers) renamed ``input`` and one output renamed ``logits``;
* IR version <= 10 and default-domain opset <= 21 (what ORT 1.19.2 reads);
* every node has a unique, non-empty name (the profiler maps ORT's per-node events by name);
* LayerNormalization nodes carry their optional Mean/InvStdDev outputs and Dropout its mask
  (ORT issues #22465, #22955: the gradient builder indexes them);
* HardSwish, HardSigmoid and variadic Sum on the data path are rewritten into ops that have
  gradients; any other op without a gradient builder in 1.19.2 is refused with
  :class:`UnsupportedOpError` naming the node.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from .errors import ModelError, UnsupportedOpError
from .ops import data_path_values, no_gradient_ops

log = logging.getLogger(__name__)

MAX_IR_VERSION = 10
MAX_OPSET = 21
INPUT_NAME = "input"
OUTPUT_NAME = "logits"


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX model from ``path``, validate it and legalise it for ORT 1.19.2 training.

    Args:
        path: an ``.onnx`` file (external data next to it is loaded too).

    Returns:
        The legalised model (see the module docstring); the input is renamed ``input``
        (float32 ``[B, C, H, W]``) and the output ``logits`` (``[B, classes]``).

    Raises:
        ModelError: the file is missing, not ONNX, truncated, fails ``onnx.checker``, has not
            exactly one input and one output, an opset that cannot be converted to <= 21, or no
            trainable tensor (:func:`etgraph.graph.trainable_tensors`).
        UnsupportedOpError: an op on the data path has no gradient in ORT 1.19.2 and no
            built-in rewrite (the message names node and op and suggests the rewrite).
    """
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such model file")
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # protobuf DecodeError, external-data errors, ...
        raise ModelError(f"{path}: not a readable ONNX model ({_first_line(exc)})") from exc
    if not model.graph.node:
        raise ModelError(f"{path}: not an ONNX model with a graph (empty or truncated file?)")
    if model.ir_version > MAX_IR_VERSION:  # onnx 1.17's checker itself stops at IR 10
        log.info("%s: IR version %d lowered to %d", path, model.ir_version, MAX_IR_VERSION)
        model.ir_version = MAX_IR_VERSION
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelError(f"{path}: invalid ONNX model: {_first_line(exc)}") from exc
    return legalize(model, source=str(path))


def legalize(model: onnx.ModelProto, source: str = "model") -> onnx.ModelProto:
    """Return a legalised copy of ``model`` (module docstring); ``source`` names it in errors.

    Raises:
        ModelError, UnsupportedOpError: as :func:`load_model`.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out = _legalize_opset(out, source)
    if out.ir_version > MAX_IR_VERSION:
        log.info("%s: IR version %d lowered to %d", source, out.ir_version, MAX_IR_VERSION)
        out.ir_version = MAX_IR_VERSION
    graph = out.graph
    init_names = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in init_names]
    if len(inputs) != 1:
        raise ModelError(
            f"{source}: expected exactly one graph input (the image batch), found "
            f"{len(inputs)}: {[i.name for i in inputs][:5]}"
        )
    if len(graph.output) != 1:
        raise ModelError(
            f"{source}: expected exactly one graph output (the logits), found "
            f"{len(graph.output)}: {[o.name for o in graph.output][:5]}"
        )
    _name_nodes(graph)
    _rename_value(graph, inputs[0].name, INPUT_NAME, source)
    _rename_value(graph, graph.output[0].name, OUTPUT_NAME, source)
    _add_optional_outputs(graph)
    _rewrite_no_grad_ops(graph, source)
    _refuse_no_grad_ops(graph, source)
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 0


def _legalize_opset(model: onnx.ModelProto, source: str) -> onnx.ModelProto:
    opset = _default_opset(model)
    if opset <= MAX_OPSET:
        return model
    try:
        from onnx import version_converter

        converted = version_converter.convert_version(model, MAX_OPSET)
    except Exception as exc:
        raise ModelError(
            f"{source}: opset {opset} is newer than onnxruntime-training 1.19.2 supports "
            f"({MAX_OPSET}) and conversion failed ({_first_line(exc)}); re-export with opset <= 17"
        ) from exc
    log.info("%s: converted opset %d to %d", source, opset, MAX_OPSET)
    return converted


def _name_nodes(graph: onnx.GraphProto) -> None:
    """Give every node a unique non-empty name (``<op_type>_<i>`` for unnamed ones)."""
    seen: set[str] = set()
    for i, node in enumerate(graph.node):
        name = node.name or f"{node.op_type}_{i}"
        base, k = name, 1
        while name in seen:
            name = f"{base}_{k}"
            k += 1
        node.name = name
        seen.add(name)


def _all_value_names(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
    return names


def _rename_value(graph: onnx.GraphProto, old: str, new: str, source: str) -> None:
    """Rename value ``old`` to ``new`` everywhere in the graph (inputs, outputs, node edges)."""
    if old == new:
        return
    if new in _all_value_names(graph):
        raise ModelError(f"{source}: cannot rename {old!r} to {new!r}: the name is already used")
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        if vi.name == old:
            vi.name = new
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new


def _add_optional_outputs(graph: onnx.GraphProto) -> None:
    """LayerNormalization: add Mean and InvStdDev outputs; Dropout: add the mask output."""
    for node in graph.node:
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            for i, suffix in ((1, "mean"), (2, "inv_std_dev")):
                if len(node.output) <= i:
                    node.output.append(f"{node.name}/{suffix}")
                elif not node.output[i]:
                    node.output[i] = f"{node.name}/{suffix}"
        elif node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            if len(node.output) < 2:
                node.output.append(f"{node.name}/mask")
            elif not node.output[1]:
                node.output[1] = f"{node.name}/mask"


def _const(name: str, value: float) -> onnx.NodeProto:
    """A float32 scalar Constant node (a node, not an initializer: it must not become trainable)."""
    return helper.make_node(
        "Constant",
        [],
        [name],
        name=name,
        value=helper.make_tensor(name, TensorProto.FLOAT, [], [value]),
    )


def _rewrite_no_grad_ops(graph: onnx.GraphProto, source: str) -> None:
    """Rewrite HardSwish, HardSigmoid and variadic Sum into ops that have gradients in ORT."""
    new_nodes: list[onnx.NodeProto] = []
    changed = False
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in (
            "HardSwish",
            "HardSigmoid",
            "Sum",
        ):
            new_nodes.append(node)
            continue
        changed = True
        p = node.name
        x, y = (node.input[0] if node.input else ""), node.output[0]
        if node.op_type == "HardSwish":  # y = x * clip(x + 3, 0, 6) / 6
            new_nodes += [
                _const(f"{p}/three", 3.0),
                _const(f"{p}/zero", 0.0),
                _const(f"{p}/six", 6.0),
                helper.make_node("Add", [x, f"{p}/three"], [f"{p}/x3"], name=f"{p}/Add"),
                helper.make_node(
                    "Clip", [f"{p}/x3", f"{p}/zero", f"{p}/six"], [f"{p}/relu6"], name=f"{p}/Clip"
                ),
                helper.make_node("Mul", [x, f"{p}/relu6"], [f"{p}/xr"], name=f"{p}/Mul"),
                helper.make_node("Div", [f"{p}/xr", f"{p}/six"], [y], name=f"{p}/Div"),
            ]
        elif node.op_type == "HardSigmoid":  # y = clip(alpha * x + beta, 0, 1)
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            new_nodes += [
                _const(f"{p}/alpha", float(attrs.get("alpha", 0.2))),
                _const(f"{p}/beta", float(attrs.get("beta", 0.5))),
                _const(f"{p}/zero", 0.0),
                _const(f"{p}/one", 1.0),
                helper.make_node("Mul", [x, f"{p}/alpha"], [f"{p}/ax"], name=f"{p}/Mul"),
                helper.make_node("Add", [f"{p}/ax", f"{p}/beta"], [f"{p}/axb"], name=f"{p}/Add"),
                helper.make_node(
                    "Clip", [f"{p}/axb", f"{p}/zero", f"{p}/one"], [y], name=f"{p}/Clip"
                ),
            ]
        else:  # Sum(a, b, c, ...) -> Add(Add(a, b), c) ...
            if len(node.input) == 1:
                new_nodes.append(helper.make_node("Identity", [x], [y], name=f"{p}/Identity"))
                continue
            acc = node.input[0]
            for i, term in enumerate(node.input[1:], start=1):
                out = y if i == len(node.input) - 1 else f"{p}/partial_{i}"
                new_nodes.append(helper.make_node("Add", [acc, term], [out], name=f"{p}/Add_{i}"))
                acc = out
        log.info("%s: rewrote %s node %r into ops with gradients", source, node.op_type, p)
    if changed:
        del graph.node[:]
        graph.node.extend(new_nodes)


def _refuse_no_grad_ops(graph: onnx.GraphProto, source: str) -> None:
    carrying = data_path_values(graph)
    no_gradient = no_gradient_ops()
    for node in graph.node:
        if node.op_type not in no_gradient or node.domain not in ("", "ai.onnx"):
            continue
        rule = no_gradient[node.op_type]
        if any(v in carrying for i, v in enumerate(node.input) if i not in rule.nondiff_slots):
            raise UnsupportedOpError(
                f"{source}: node {node.name!r} uses op {node.op_type}, which has no gradient in "
                f"onnxruntime-training 1.19.2; {rule.fix} and re-export"
            )


def model_hash(model: onnx.ModelProto) -> str:
    """A 16-hex-digit sha256 of the model's *structure*: nodes, attributes, opsets, input/output
    types and initializer names/dtypes/shapes — not initializer values, so the hash of a model
    survives training (profiles and artifacts depend only on structure)."""
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    for init in graph.initializer:
        for fld in (
            "raw_data",
            "float_data",
            "int32_data",
            "int64_data",
            "double_data",
            "uint64_data",
            "external_data",
        ):
            init.ClearField(fld)
    h = hashlib.sha256(graph.SerializeToString(deterministic=True))
    for imp in sorted(model.opset_import, key=lambda i: i.domain):
        h.update(f"{imp.domain}:{imp.version};".encode())
    return h.hexdigest()[:16]
