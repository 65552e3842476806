"""The loaded model: built once per command and passed down the pipeline (DESIGN: import).

:meth:`LoadedModel.load` reads an ONNX file, legalises it for ORT 1.19.2 training
(:func:`etgraph.onnx_io.load_model`) and works out, once, what every later stage needs: the
structure hash, the data inputs (name, dtype, dims), the task (output trained on, loss, K or D),
the trainable tensors in forward order (index 0 nearest the input; paper §5) and the running
statistics. The graph builder, the
profiler, the selector, the artifact generator and the runtime take this object instead of
reloading the file.

* :func:`trainable_tensors` — the tensors the DP selects among, with their kind (kernel, bias,
  gamma, beta, embedding), found through the op registry (:mod:`etgraph.ops`).
* :func:`running_statistics` — BatchNorm running mean/var: frozen, carried, never trained.
* :func:`input_specs`, :func:`parse_input_shapes`, :func:`input_shapes` — the data inputs,
  ``--input-shape`` (per input) and the model's own dims.
* :func:`task_of` — the output trained on and the loss (``--output``, ``--loss``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from passes.onnx import HEAD_KEY
from passes.onnx.batch_dim import EXPORTED_BATCH_KEY

from . import onnx_io
from .errors import ConfigError, ModelError, NativeCrashError, UnsupportedOpError, first_line
from .exporters import exporter_of, remedy
from .ops import FLOAT_TYPES, data_path_values, op_rule

log = logging.getLogger(__name__)

__all__ = [
    "LOSSES",
    "Batch",
    "InputSpec",
    "LoadedModel",
    "Task",
    "TensorInfo",
    "input_shapes",
    "input_specs",
    "normalisation_note",
    "parse_input_shapes",
    "random_batch",
    "removed_head",
    "running_statistics",
    "task_of",
    "trainable_tensors",
    "with_batch",
]


@dataclass(frozen=True)
class TensorInfo:
    """One trainable tensor.

    Attributes:
        index: position in forward order (0 nearest the input).
        name: initializer name in the ONNX model.
        kind: ``kernel``, ``bias``, ``gamma``, ``beta`` or ``embedding``.
        layer: name of the ONNX node that applies the tensor to the data (for a MatMul+Add bias:
            the MatMul).
        op_type: that node's op type.
        shape: initializer shape.
        params: number of elements.
        values: value names that carry the tensor into its layer (its name, then the outputs of
            weight-preprocessing nodes such as ``Transpose(W)``).
    """

    index: int
    name: str
    kind: str
    layer: str
    op_type: str
    shape: tuple[int, ...]
    params: int
    values: tuple[str, ...] = field(default=())


# ---- trainable tensors and running statistics ----


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[int, int]]]:
    """value name -> [(node position, input slot)] in graph order."""
    out: dict[str, list[tuple[int, int]]] = {}
    for pos, node in enumerate(graph.node):
        for slot, name in enumerate(node.input):
            if name:
                out.setdefault(name, []).append((pos, slot))
    return out


def _locate(
    model: onnx.ModelProto,
) -> tuple[dict[str, tuple[int, int, tuple[str, ...]]], set[str]]:
    """For every float initializer that reaches the data path through differentiable inputs:
    (position of the node mixing it into the data path, input slot there, carrying values).
    Also returns the names of running statistics (registry ``stat_slots``: BN mean/var)."""
    graph = model.graph
    consumers = _consumers(graph)
    data = data_path_values(graph, from_initializers=False)
    found: dict[str, tuple[int, int, tuple[str, ...]]] = {}
    stats: set[str] = set()
    for init in graph.initializer:
        if init.data_type not in FLOAT_TYPES:
            continue
        name = init.name
        frontier, carrying, best = [name], [name], None
        seen = {name}
        while frontier:
            value = frontier.pop()
            for pos, slot in consumers.get(value, []):
                node = graph.node[pos]
                rule = op_rule(node.op_type)
                if slot in rule.stat_slots:
                    stats.add(name)
                    continue
                if slot in rule.nondiff_slots or not rule.differentiable:
                    continue
                if any(o in data for o in node.output):
                    if best is None or (pos, slot) < best:
                        best = (pos, slot)
                    continue
                for out in node.output:  # weight preprocessing (Transpose, Reshape, Expand ...)
                    if out and out not in seen:
                        seen.add(out)
                        frontier.append(out)
                        carrying.append(out)
        if best is None:
            continue
        numel = int(np.prod(init.dims)) if init.dims else 1
        rule = op_rule(graph.node[best[0]].op_type)
        if best[1] not in rule.weight_slots and numel <= 1:
            continue  # a scalar constant (x * 0.5, x + eps), not a tensor worth training
        found[name] = (best[0], best[1], tuple(carrying))
    return found, stats


def trainable_tensors(model: onnx.ModelProto) -> list[TensorInfo]:
    """The trainable tensors of ``model`` in forward order (paper §5; DESIGN: TensorGraph).

    A float initializer is trainable when it reaches the data path through differentiable op
    inputs (registry :data:`etgraph.ops.OP_RULES`); its *layer* is the node where it meets the
    data (after weight preprocessing such as Transpose). Kind by the layer's registry
    ``weight_slots``: Conv/ConvTranspose/Gemm/MatMul kernel and bias, normalisation gamma and
    beta, Gather data -> embedding. Two cases are not slot-based: a MatMul (or Gemm A/B) operand
    is a kernel whichever side it is on, and an initializer added right after a conv/dense layer
    that has a kernel is that layer's bias (torch exports ``nn.Linear`` on 3-D inputs as
    MatMul + Add). Any other non-scalar float initializer on the data path (cls token, position
    embedding) is an embedding. Excluded: running statistics, integer/shape constants, scalar
    float constants, anything only feeding shapes.

    Order: position of the layer node in the (topological) node order, then input slot.

    Returns:
        One :class:`TensorInfo` per tensor, ``index`` 0..N-1.

    Raises:
        ModelError: no trainable tensor at all.
    """
    graph = model.graph
    located, _ = _locate(model)
    inits = {i.name: i for i in graph.initializer}
    producer = {o: pos for pos, node in enumerate(graph.node) for o in node.output if o}
    kernel_layers = {
        pos for pos, slot, _ in located.values() if op_rule(graph.node[pos].op_type).weight_slots
    }
    rows = []
    for name, (pos, slot, carrying) in located.items():
        node = graph.node[pos]
        rule = op_rule(node.op_type)
        kind, layer = rule.weight_slots.get(slot, "embedding"), node
        # Not slot-based, so not in the registry: a MatMul (or Gemm A/B) operand is the kernel
        # on whichever side it sits (x @ W and W @ x both occur in exports).
        if node.op_type == "MatMul" or (node.op_type == "Gemm" and slot in (0, 1)):
            kind = "kernel"
        # An initializer added to a conv/dense layer's output is that layer's bias (torch
        # exports nn.Linear on 3-D inputs as MatMul + Add): found by the producer, not a slot.
        if kind == "embedding" and node.op_type == "Add":
            other = [v for i, v in enumerate(node.input) if i != slot]
            src = producer.get(other[0]) if len(other) == 1 else None
            if (
                src is not None
                and src in kernel_layers
                and op_rule(graph.node[src].op_type).family == "conv_dense"
            ):
                kind, layer = "bias", graph.node[src]
        shape = tuple(int(d) for d in inits[name].dims)
        rows.append((pos, slot, name, kind, layer.name, layer.op_type, shape, carrying))
    if not rows:
        raise ModelError(
            "the model has no trainable tensors (no float initializer reaches the data path); "
            + remedy(
                "export it with its weights as initializers",
                producer_name=model.producer_name,
                torch="do_constant_folding=False",
                needed="weights it can train (float initializers)",
            )
        )
    rows.sort(key=lambda r: (r[0], r[1]))
    return [
        TensorInfo(
            index=i,
            name=name,
            kind=kind,
            layer=layer,
            op_type=op_type,
            shape=shape,
            params=int(np.prod(shape)) if shape else 1,
            values=carrying,
        )
        for i, (_, _, name, kind, layer, op_type, shape, carrying) in enumerate(rows)
    ]


def running_statistics(model: onnx.ModelProto) -> list[str]:
    """Names of BatchNormalization running mean/var initializers, in graph order.

    They are updated by the training graph but never trained: they go to ``frozen_params`` of
    :func:`etgraph.artifacts.generate` so they stay in the checkpoint.
    """
    _, stats = _locate(model)
    return [i.name for i in model.graph.initializer if i.name in stats]


# ---- input and output specs ----

#: Losses etgraph trains with (``--loss``): cross-entropy on logits, mean squared error.
LOSSES = ("ce", "mse")

#: Ops an integer input passes through unchanged on its way to a lookup (for ``index_rows``).
_INDEX_CARRIERS = frozenset({"Cast", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten"})

_NUMPY_DTYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.INT8: "int8",
}


@dataclass(frozen=True)
class InputSpec:
    """One data input of the model (a graph input that is not an initializer).

    Attributes:
        name: the graph input's name (kept from the user's model; feeds use it).
        dtype: numpy dtype name (``"float32"`` images, ``"int64"`` token ids and masks).
        dims: the model's dims, batch first: an int where static, the symbolic name (``"?"``
            when unnamed) elsewhere.
        index_rows: for an integer input used as lookup indices (Gather into an embedding
            table, possibly after Cast/Unsqueeze/Reshape): rows of the smallest table it
            indexes, so valid values are ``0 .. index_rows - 1``; None otherwise.
    """

    name: str
    dtype: str
    dims: tuple[int | str, ...]
    index_rows: int | None = None

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def is_float(self) -> bool:
        return np.dtype(self.dtype).kind == "f"


def _index_rows(graph: onnx.GraphProto, name: str) -> int | None:
    """Rows of the smallest initializer table that value ``name`` indexes (through
    :data:`_INDEX_CARRIERS`), or None."""
    consumers = _consumers(graph)
    inits = {i.name: i for i in graph.initializer}
    rows, frontier, seen = [], [name], {name}
    while frontier:
        value = frontier.pop()
        for pos, slot in consumers.get(value, []):
            node = graph.node[pos]
            if slot in op_rule(node.op_type).index_slots and node.input[0] in inits:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                dims = inits[node.input[0]].dims
                if dims:
                    rows.append(int(dims[axis]))
            elif node.op_type in _INDEX_CARRIERS and slot == 0:
                for out in node.output:
                    if out and out not in seen:
                        seen.add(out)
                        frontier.append(out)
    return min(rows) if rows else None


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The model's data inputs in graph order (graph inputs that are not initializers).

    Raises:
        ModelError: the model has no data input, or an input is not a tensor of a known type.
    """
    init_names = {i.name for i in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in init_names:
            continue
        tt = vi.type.tensor_type
        if tt.elem_type not in _NUMPY_DTYPES:
            raise ModelError(
                f"input {vi.name!r} has element type "
                f"{onnx.TensorProto.DataType.Name(tt.elem_type)}; etgraph feeds float, integer "
                "and bool tensors"
            )
        dims = tuple(
            int(d.dim_value)
            if d.HasField("dim_value") and d.dim_value > 0
            else (d.dim_param or "?")
            for d in tt.shape.dim
        )
        if not dims:
            raise ModelError(f"input {vi.name!r} is a scalar; etgraph feeds batches [B, ...]")
        rows = None if tt.elem_type in FLOAT_TYPES else _index_rows(model.graph, vi.name)
        specs.append(InputSpec(vi.name, _NUMPY_DTYPES[tt.elem_type], dims, rows))
    if not specs:
        raise ModelError("the model has no graph input (besides weights)")
    return specs


_DIMS_RE = re.compile(r"^\s*\d+(\s*[xX,]\s*\d+)*\s*$")


def _example(spec: InputSpec) -> str:
    """What ``--input-shape`` looks like for ``spec``, for error messages."""
    if spec.rank == 4:
        return "CxHxW, e.g. 3x224x224"
    sample = "x".join(str(d) if isinstance(d, int) else "128" for d in spec.dims[1:]) or "1"
    return f"{spec.name}=DIMS with the {spec.rank - 1} dims after the batch, e.g. {sample}"


def parse_input_shapes(
    texts: str | Sequence[str] | None,
) -> dict[str | None, tuple[int, ...]]:
    """Parse ``--input-shape`` values: ``"NAME=1x3x224x224"`` (also ``NAME=3x224x224``;
    repeatable, one per input) or a bare ``"3x224x224"`` for a single-input model (key None).
    Dims are separated by ``x`` or ``,`` and must be positive.

    Raises:
        ConfigError: malformed text, a zero dimension, or an input named twice.
    """
    if texts is None:
        return {}
    if isinstance(texts, str):
        texts = [texts]
    out: dict[str | None, tuple[int, ...]] = {}
    for text in texts:
        name, sep, dims_text = str(text).rpartition("=")
        key = name.strip() if sep else None
        if (sep and not key) or not _DIMS_RE.match(dims_text):
            raise ConfigError(
                f"input shape {text!r} is malformed: use CxHxW, e.g. 3x224x224, or "
                "NAME=DIMS per input, e.g. input_ids=1x128"
            )
        dims = tuple(int(d) for d in re.split(r"\s*[xX,]\s*", dims_text.strip()))
        if min(dims) <= 0:
            raise ConfigError(
                f"input shape {text!r} has a zero dimension: use CxHxW, e.g. 3x224x224"
            )
        if key in out:
            raise ConfigError(f"--input-shape gives input {key or text!r} twice: give it once")
        out[key] = dims
    return out


def _per_sample(spec: InputSpec, given: Sequence[int], text: str, named: bool) -> tuple[int, ...]:
    """``given`` as the per-sample dims of ``spec`` (a NAME= shape may include the batch dim,
    which is then dropped: the batch is ``--batch-size``)."""
    dims = tuple(int(d) for d in given)
    if named and len(dims) == spec.rank:
        dims = dims[1:]
    if len(dims) != spec.rank - 1 or min(dims, default=1) <= 0:
        raise ConfigError(
            f"input shape {text!r} does not fit input {spec.name!r} of rank {spec.rank}: "
            f"use {_example(spec)}"
        )
    if spec.rank == 4 and isinstance(spec.dims[1], int) and spec.dims[1] != dims[0]:
        raise ConfigError(
            f"input shape {dims} has {dims[0]} channels, the model expects {spec.dims[1]}"
        )
    return dims


def input_shapes(
    model: onnx.ModelProto | Sequence[InputSpec],
    override: str | Sequence[str] | Mapping | None = None,
) -> dict[str, tuple[int, ...]]:
    """The per-sample shape (dims after the batch) of every data input, in graph order.

    Args:
        model: the model, or its :func:`input_specs`.
        override: ``--input-shape`` text(s) (:func:`parse_input_shapes`), or a mapping input
            name -> dims (per-sample, or with the batch dim first), or, for a single-input
            model, a bare dims sequence ``(C, H, W)``. Given dims win over the model's static
            ones (needed where they are symbolic); a rank-4 input's channel count must match a
            static one.

    Raises:
        ConfigError: malformed override, a name that is no input of the model, a bare shape for
            a model with several inputs, wrong rank or channel count, or an input with symbolic
            dims and no shape given (the message names the input and ``--input-shape``).
    """
    specs = list(model) if not isinstance(model, onnx.ModelProto) else input_specs(model)
    if override is None or isinstance(override, str) or _is_text_list(override):
        given = parse_input_shapes(override)  # type: ignore[arg-type]
        texts = {k: _shape_text(k, v) for k, v in given.items()}
    elif isinstance(override, Mapping):
        given = {k: tuple(v) for k, v in override.items()}
        texts = {k: _shape_text(k, v) for k, v in given.items()}
    else:
        try:
            given = {None: tuple(int(d) for d in override)}
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"input shape {override!r} is malformed: use CxHxW") from exc
        texts = {None: _shape_text(None, given[None])}
    names = [s.name for s in specs]
    if None in given:
        if len(specs) != 1:
            raise ConfigError(
                f"input shape {texts[None]!r} names no input, and the model has {len(specs)} "
                f"inputs {names[:8]}: give one --input-shape NAME=DIMS per input"
            )
        given[specs[0].name] = given.pop(None)
        texts[specs[0].name] = texts.pop(None)
    unknown = [k for k in given if k not in names]
    if unknown:
        raise ConfigError(
            f"--input-shape names {unknown[0]!r}, which is not an input of the model "
            f"(inputs: {', '.join(names[:8])})"
        )
    out = {}
    for spec in specs:
        if spec.name in given:
            named = texts[spec.name].partition("=")[1] == "="
            out[spec.name] = _per_sample(spec, given[spec.name], texts[spec.name], named)
            continue
        if any(not isinstance(d, int) for d in spec.dims[1:]):
            shown = list(spec.dims)
            if len(specs) == 1:
                raise ConfigError(
                    f"input {spec.name!r} has symbolic dims {shown}: pass the input shape, e.g. "
                    f"--input-shape {_example(spec).split('e.g. ')[-1]}"
                )
            raise ConfigError(
                f"input {spec.name!r} has symbolic dims {shown}: pass its shape with "
                f"--input-shape {spec.name}=DIMS (the dims after the batch, e.g. "
                f"{spec.name}={_example(spec).split('e.g. ')[-1]})"
            )
        out[spec.name] = tuple(int(d) for d in spec.dims[1:])
    return out


def _is_text_list(value) -> bool:
    return (
        isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)
    )


def _shape_text(name: str | None, dims: Sequence[int]) -> str:
    text = "x".join(str(d) for d in dims)
    return f"{name}={text}" if name is not None else text


@dataclass(frozen=True)
class Task:
    """What is trained: one graph output and the loss on it (``--output``, ``--loss``).

    Attributes:
        loss: ``"ce"`` — cross-entropy on logits ``[B, K]`` against int64 class indices ``[B]``
            (ORT's SoftmaxCrossEntropyLoss; metric accuracy); ``"mse"`` — mean squared error
            on ``[B, D]`` against float32 targets ``[B, D]`` (metric: the MSE itself).
        output: name of the graph output the loss is computed on.
        width: K (classes) or D (regression width); None when the model leaves it symbolic.
    """

    loss: str
    output: str
    width: int | None

    @property
    def label_name(self) -> str:
        """Name of the training graph's target input (as ORT's loss blocks name it)."""
        return "labels" if self.loss == "ce" else "target"

    @property
    def metric(self) -> str:
        """``"accuracy"`` (ce) or ``"mse"``."""
        return "accuracy" if self.loss == "ce" else "mse"

    def to_json(self) -> dict:
        return {"loss": self.loss, "output": self.output, "width": self.width}


def task_of(model: onnx.ModelProto, loss: str = "ce", source: str | None = None) -> Task:
    """The :class:`Task` of training ``model``'s (only) output with ``loss``; ``source`` (the
    model's path) shapes what an error says to do (:func:`etgraph.exporters.remedy`).

    Raises:
        ConfigError: ``loss`` is not one of :data:`LOSSES`.
        ModelError: the output is not ``[B, K]`` (ce) or ``[B, D]`` (mse), or not float32
            (onnxruntime-training 1.19.2's loss and optimizer blocks are float32).
    """
    if loss not in LOSSES:
        raise ConfigError(f"unknown loss {loss!r}: choose one of {', '.join(LOSSES)}")
    output = model.graph.output[0]
    elem_type = output.type.tensor_type.elem_type

    def fix(what: str, torch: str | None = None, needed: str | None = None) -> str:
        return remedy(
            what, producer_name=model.producer_name, source=source, torch=torch, needed=needed
        )

    if elem_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.UNDEFINED):
        raise ModelError(
            f"output {output.name!r} is {onnx.TensorProto.DataType.Name(elem_type).lower()}; "
            "onnxruntime-training 1.19.2 trains float32 models: "
            + fix("convert it to float32", torch="model.float()", needed="float32 weights")
        )
    dims = output.type.tensor_type.shape.dim
    if output.type.tensor_type.HasField("shape") and len(dims) != 2:
        shown = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
        if loss == "ce" and len(dims) == 3:
            raise ModelError(
                f"output {output.name!r} has shape {shown}: a label per position (token "
                "classification) is not supported; etgraph trains one label per example, from "
                "[B, K] logits: "
                + fix(
                    "pool over the sequence (mean or the first token)",
                    needed="a loss over positions (per-token or CTC)",
                )
            )
        width = "K" if loss == "ce" else "D"
        trains = {
            "ce": "etgraph trains classifiers whose output is [B, K] logits",
            "mse": "--loss mse trains an output [B, D]",
        }[loss]
        raise ModelError(
            f"output {output.name!r} has shape {shown}; {trains}: "
            + fix(
                f"end the model with Flatten (or Reshape to [B, {width}])",
                needed=f"an output [B, {width}]",
            )
        )
    width = None
    if dims and dims[-1].HasField("dim_value") and dims[-1].dim_value > 0:
        width = int(dims[-1].dim_value)
    return Task(loss, output.name, width)


def removed_head(model: onnx.ModelProto) -> str | None:
    """What legalisation took off the output, as the ops that put it back (``"Softmax(axis=1)"``,
    ``"Reshape(shape=0,-1,1,1)"``; recorded in the model's metadata by
    :class:`passes.onnx.RemoveSoftmaxHeadPass` / :class:`passes.onnx.FlattenClassOutputPass`),
    or None."""
    return next((p.value for p in model.metadata_props if p.key == HEAD_KEY), None)


def exported_batch(model: onnx.ModelProto) -> int | None:
    """The batch size the model was exported at, if legalisation made it symbolic
    (:class:`passes.onnx.FreeBatchDimPass`), else None."""
    value = next((p.value for p in model.metadata_props if p.key == EXPORTED_BATCH_KEY), None)
    return int(value) if value is not None else None


@contextlib.contextmanager
def exported_batch_hint(model: onnx.ModelProto, batch_size: int) -> Iterator[None]:
    """Turn an ORT failure (a :class:`ModelError`) at a batch size other than the one the model
    was exported at into the error that says so: a graph may fix its export batch where
    legalisation cannot free it (an attention's reshapes to ``[T, B*heads, d]``).

    Raises:
        ModelError: ``onnxruntime cannot run the model at batch B: it was exported at batch E
            ...: use --batch-size E, or export it with a dynamic batch dimension``.
    """
    try:
        yield
    except ModelError as exc:
        exported = exported_batch(model)
        if (
            exported is None
            or exported == batch_size
            or isinstance(exc, (UnsupportedOpError, NativeCrashError))
        ):
            raise
        cause = first_line(exc.__cause__ or exc)
        if len(cause) > 160:  # ORT's C++ signature first: its end says what failed
            cause = "... " + cause[-160:].split(" ", 1)[-1]
        raise ModelError(
            f"onnxruntime cannot run the model at batch {batch_size}: it was exported at batch "
            f"{exported}, which its graph fixes where etgraph cannot free it (e.g. attention "
            f"reshapes) ({cause}): use --batch-size {exported}, or "
            + remedy(
                "export it with a dynamic batch dimension",
                producer_name=model.producer_name,
                torch="dynamic_axes={'input': {0: 'batch'}}",
            ).removesuffix(" and re-export")
        ) from exc


def with_batch(
    model: onnx.ModelProto, batch_size: int, shapes: Mapping[str, Sequence[int]]
) -> onnx.ModelProto:
    """A copy of ``model`` whose data inputs are the static ``[batch_size, *shapes[name]]``
    and whose output batch dimension is ``batch_size`` (the training graph then has static
    shapes). ``shapes``: :func:`input_shapes`.

    Raises:
        TypeError: ``shapes`` is not a mapping (a bare ``(C, H, W)`` would fix nothing).
    """
    if not isinstance(shapes, Mapping):
        raise TypeError(f"shapes must map input names to dims, got {type(shapes).__name__}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for vi in out.graph.input:
        if vi.name not in shapes:
            continue
        dims = vi.type.tensor_type.shape.dim
        for d, v in zip(dims, (batch_size, *shapes[vi.name]), strict=True):
            d.Clear()
            d.dim_value = int(v)
    odim = out.graph.output[0].type.tensor_type.shape.dim[0]
    odim.Clear()
    odim.dim_value = int(batch_size)
    return out


@dataclass
class Batch:
    """One fixed training batch.

    Attributes:
        inputs: every model input by name, ``[B, ...]`` each, of the input's dtype.
        labels: the target: int64 [B] class indices (ce) or float32 [B, D] (mse).
        label_name: the training graph's target input (:attr:`etgraph.model.Task.label_name`).
    """

    inputs: dict[str, np.ndarray]
    labels: np.ndarray
    label_name: str = "labels"


def random_batch(
    batch_size: int,
    inputs: Sequence[InputSpec],
    shapes: Mapping[str, Sequence[int]],
    task: Task,
) -> Batch:
    """A reproducible random batch (seed 0) for a model.

    Float inputs are standard normal; integer inputs used as lookup indices are uniform in
    ``[0, index_rows)`` (valid token ids); other integer and bool inputs are ones (a mask that
    keeps everything). Labels: uniform in ``[0, K)`` (ce) or standard normal ``[B, D]`` (mse).

    Raises:
        ModelError: the output width (K or D) is not static.
    """
    if task.width is None:
        raise ModelError(
            f"model output {task.output!r} must be [B, K] (or [B, D] for mse) with a static "
            "last dim"
        )
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in inputs:
        shape = (batch_size, *shapes[spec.name])
        if spec.is_float:
            feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif spec.index_rows:
            feeds[spec.name] = rng.integers(0, spec.index_rows, size=shape).astype(spec.dtype)
        else:
            feeds[spec.name] = np.ones(shape, dtype=spec.dtype)
    if task.loss == "ce":
        labels = rng.integers(0, task.width, size=batch_size).astype(np.int64)
    else:
        labels = rng.standard_normal((batch_size, task.width)).astype(np.float32)
    return Batch(inputs=feeds, labels=labels, label_name=task.label_name)


#: A model with at least this many convolution kernels and no normalisation layer gets
#: :func:`normalisation_note` (a CNN's batch norms folded at export).
FOLDED_NORM_CONVS = 4


def normalisation_note(model: onnx.ModelProto, tensors: Sequence[TensorInfo]) -> str | None:
    """What to say about a CNN with no normalisation tensors at all (at least
    :data:`FOLDED_NORM_CONVS` convolution kernels, no gamma or beta): exporters fold a
    network's batch norms into its convolutions at export (torch's default dynamo exporter
    does unless ``optimize=False``; ``dynamo=False`` in eval mode), leaving nothing of them to
    train. None for any other model."""
    convs = sum(1 for t in tensors if t.kind == "kernel" and t.op_type in ("Conv", "ConvTranspose"))
    if convs < FOLDED_NORM_CONVS or any(t.kind in ("gamma", "beta") for t in tensors):
        return None
    if exporter_of(model.producer_name) == "tf2onnx":  # its frozen graph folds them: no option
        how = "tf2onnx offers no way to keep them; the folded kernels and biases train"
    else:
        how = remedy(
            "keep them at export",
            producer_name=model.producer_name,
            torch="torch.onnx.export(..., optimize=False) with the default dynamo exporter; "
            "training=torch.onnx.TrainingMode.TRAINING with dynamo=False or timm's onnx_export",
            needed="the model's batch norms, which the exporter folded",
        )
    return (
        f"{convs} convolutions and no normalisation layer: if the network has batch norms, the "
        f"exporter folded them into the convolutions and they cannot be trained; {how}"
    )


# ---- the loaded model ----


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A legalised model and what every stage needs to know about it (build with :meth:`load`).

    Attributes:
        source: the file it was loaded from.
        proto: the legalised ``onnx.ModelProto`` (its data inputs and the one output trained
            on, names as in the user's model); treat it as read-only.
        hash: :func:`etgraph.onnx_io.model_hash` (structure only, survives training).
        tensors: trainable tensors in forward order (:func:`trainable_tensors`), length N.
        running_stats: BatchNorm running mean/var names (:func:`running_statistics`).
        inputs: the data inputs in graph order (:func:`input_specs`); everything that feeds
            the model feeds them by name.
        task: the output trained on and the loss (:class:`Task`).
        head: the Softmax/LogSoftmax head legalisation took off the output (the loss needs
            logits), e.g. ``"Softmax(axis=1)"``; restored on the exported model. None if none.
    """

    source: Path
    proto: onnx.ModelProto
    hash: str
    tensors: tuple[TensorInfo, ...]
    running_stats: tuple[str, ...]
    inputs: tuple[InputSpec, ...]
    task: Task
    head: str | None = None

    @classmethod
    def load(
        cls, path: str | os.PathLike, *, output: str | None = None, loss: str = "ce"
    ) -> LoadedModel:
        """Load, validate and legalise ``path`` (:func:`etgraph.onnx_io.load_model`) to train
        its output ``output`` (None: the only one) with ``loss`` (:data:`LOSSES`).

        Raises:
            ModelError, UnsupportedOpError: as :func:`etgraph.onnx_io.load_model`, or the model
                has no trainable tensor (the message names the file).
            ConfigError: bad ``output`` or ``loss``; several outputs and no ``output``.
        """
        path = Path(path)
        if loss not in LOSSES:
            raise ConfigError(f"unknown loss {loss!r}: choose one of {', '.join(LOSSES)}")
        loaded = cls.from_proto(onnx_io.load_model(path, output=output), source=path, loss=loss)
        note = normalisation_note(loaded.proto, loaded.tensors)
        if note is not None:
            log.warning("%s: %s", path, note)
        return loaded

    @classmethod
    def from_proto(
        cls, proto: onnx.ModelProto, *, source: str | os.PathLike, loss: str = "ce"
    ) -> LoadedModel:
        """Wrap an already legalised model (e.g. one just written by ``etgraph compile``).

        Raises:
            ModelError: the model has no trainable tensor or data input, or an output that does
                not fit ``loss`` (the message names ``source``).
        """
        try:
            tensors = trainable_tensors(proto)
            inputs = input_specs(proto)
            task = task_of(proto, loss, str(source))
        except ModelError as exc:
            raise ModelError(f"{source}: {exc}") from None
        return cls(
            source=Path(source),
            proto=proto,
            hash=onnx_io.model_hash(proto),
            tensors=tuple(tensors),
            running_stats=tuple(running_statistics(proto)),
            inputs=tuple(inputs),
            task=task,
            head=removed_head(proto),
        )

    @property
    def num_classes(self) -> int | None:
        """K of a classifier's output ``[B, K]`` (loss ce); None when symbolic or for mse."""
        return self.task.width if self.task.loss == "ce" else None

    @property
    def input_names(self) -> list[str]:
        """Names of the data inputs, graph order."""
        return [i.name for i in self.inputs]

    @property
    def names(self) -> list[str]:
        """Trainable tensor names in forward order."""
        return [t.name for t in self.tensors]

    @property
    def output_name(self) -> str:
        """Name of the graph output the loss is computed on."""
        return self.task.output

    def input_shapes(self, override=None) -> dict[str, tuple[int, ...]]:
        """Per-sample shape of every data input (:func:`input_shapes`; raises as it does)."""
        return input_shapes(self.inputs, override)

    def with_batch(self, batch_size: int, shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
        """The proto with static inputs ``[batch_size, *shapes[name]]`` (:func:`with_batch`)."""
        return with_batch(self.proto, batch_size, shapes)

    def split(self, mask) -> tuple[list[str], list[str]]:
        """``(requires_grad, frozen_params)`` for a selection mask (bool [N], forward order):
        the selected tensors, then the unselected ones followed by the running statistics.

        Raises:
            ConfigError: the mask does not have one entry per trainable tensor.
        """
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (len(self.tensors),):
            raise ConfigError(
                f"selection mask has shape {mask.shape}, expected ({len(self.tensors)},)"
            )
        trainable = [t.name for t, s in zip(self.tensors, mask, strict=True) if s]
        frozen = [t.name for t, s in zip(self.tensors, mask, strict=True) if not s]
        return trainable, frozen + list(self.running_stats)

    def initial_weights(self) -> dict[str, np.ndarray]:
        """Copies of the model's values of every trainable tensor and running statistic."""
        wanted = set(self.names) | set(self.running_stats)
        return {
            init.name: numpy_helper.to_array(init).copy()
            for init in self.proto.graph.initializer
            if init.name in wanted
        }
