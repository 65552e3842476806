"""The model's data inputs and the output it trains: what feeds it and what it is trained on.

* :func:`input_specs`, :func:`parse_input_shapes`, :func:`input_shapes` — the data inputs (name,
  dtype, dims), ``--input-shape`` (per input) and the model's own dims.
* :func:`task_of` — the output trained on and the loss (``--output``, ``--loss``).
* :func:`with_batch`, :func:`exported_batch_hint` — the model at a static batch, and the error
  that names the batch it was exported at.
* :func:`random_batch` — a reproducible batch of the inputs and labels (:class:`Batch`).

:class:`etgraph.model.LoadedModel` works these out once per model.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from passes.onnx import HEAD_KEY
from passes.onnx.batch_dim import EXPORTED_BATCH_KEY

from .errors import ConfigError, ModelError, NativeCrashError, UnsupportedOpError, first_line
from .exporters import remedy
from .labels import class_names_of
from .ops import FLOAT_TYPES, op_rule

__all__ = [
    "LOSSES",
    "Batch",
    "InputSpec",
    "Task",
    "input_shapes",
    "input_specs",
    "parse_input_shapes",
    "random_batch",
    "removed_head",
    "task_of",
    "with_batch",
]


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
    inits = {i.name: i for i in graph.initializer}
    rows, frontier, seen = [], [name], {name}
    while frontier:
        value = frontier.pop()
        readers = [(n, s) for n in graph.node for s, v in enumerate(n.input) if v == value]
        for node, slot in readers:
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
            static one. A named symbolic dim given for one input sets it for every input that
            shares it (:func:`_bind_symbols`).

    Raises:
        ConfigError: malformed override, a name that is no input of the model, a bare shape for
            a model with several inputs, wrong rank or channel count, two lengths for one named
            dim, a changed static dim another input shares (:func:`_check_static_changes`), or
            an input with symbolic dims no shape sets (the message names the input and
            ``--input-shape``).
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
    bound = _bind_symbols(specs, out)
    _check_static_changes(specs, out)
    for spec in specs:
        if spec.name in out:
            continue
        dims = [bound.get(d, d) if isinstance(d, str) else d for d in spec.dims[1:]]
        if all(isinstance(d, int) for d in dims):  # static, or named dims the others bound
            out[spec.name] = tuple(dims)
            continue
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
    return {spec.name: out[spec.name] for spec in specs}


def _bind_symbols(
    specs: Sequence[InputSpec], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, int]:
    """The length each named symbolic dim (after the batch) takes in the given per-sample
    ``shapes``: inputs that share a dim name (a transformer's ``input_ids``,
    ``attention_mask`` and ``token_type_ids`` share ``sequence``) take one length, so one
    ``--input-shape`` sets it for all of them. A name one input gives several lengths (an
    exporter that names every dim ``n``) binds nothing.

    Raises:
        ConfigError: two given shapes set one named dim to different lengths.
    """
    per_input: list[tuple[str, dict[str, set[int]]]] = []
    for spec in (spec for spec in specs if spec.name in shapes):
        lengths: dict[str, set[int]] = {}
        for symbol, value in zip(spec.dims[1:], shapes[spec.name], strict=True):
            if isinstance(symbol, str) and symbol != "?":
                lengths.setdefault(symbol, set()).add(value)
        per_input.append((spec.name, lengths))
    loose = {s for _, lengths in per_input for s, values in lengths.items() if len(values) > 1}
    bound: dict[str, tuple[int, str]] = {}
    for name, lengths in per_input:
        for symbol, (value,) in ((s, v) for s, v in lengths.items() if s not in loose):
            if symbol in bound and bound[symbol][0] != value:
                length, other = bound[symbol]
                raise ConfigError(
                    f"--input-shape gives dim {symbol!r} length {length} for {other} and "
                    f"{value} for {name}: inputs that share it take one length"
                )
            bound.setdefault(symbol, (value, name))
    return {symbol: length for symbol, (length, _) in bound.items()}


def _check_static_changes(specs: Sequence[InputSpec], shapes: Mapping[str, tuple]) -> None:
    """Refuse a given shape that changes a static dim which an input not given shares: a
    static export (``input_ids`` and ``attention_mask`` both ``[1, 128]``) carries no name
    that ties the two, so one ``--input-shape input_ids=8`` left the mask at 128 and ended in
    ORT's shape inference ("Incompatible dimensions", blamed on the batch size). Dims count
    the batch as dim 0.

    Raises:
        ConfigError: naming both inputs, the dim and the ``--input-shape`` that fixes it.
    """
    changed: dict[tuple[int, int], tuple[str, int]] = {}
    for spec in (spec for spec in specs if spec.name in shapes):
        for axis, (model_dim, dim) in enumerate(zip(spec.dims[1:], shapes[spec.name], strict=True)):
            if isinstance(model_dim, int) and model_dim != dim:
                changed.setdefault((axis, model_dim), (spec.name, dim))
    for spec in (spec for spec in specs if spec.name not in shapes):
        for axis, model_dim in enumerate(spec.dims[1:]):
            if (axis, model_dim) not in changed:
                continue
            name, dim = changed[(axis, model_dim)]
            fixed = [dim if (j, d) == (axis, model_dim) else d for j, d in enumerate(spec.dims[1:])]
            example = "x".join(str(d) for d in fixed)
            raise ConfigError(
                f"--input-shape changes dim {axis + 1} of {name!r} from the model's static "
                f"{model_dim} to {dim}, and input {spec.name!r} is static {model_dim} there too: "
                f"give its shape as well (--input-shape {spec.name}={example}; its own "
                f"{model_dim} if the two are unrelated)"
            )


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
        class_names: the label of each of the K outputs the head was trained with (a model
            ``etgraph train`` exported: :func:`etgraph.labels.class_names_of`), or ``()``;
            data whose labels are all among them keeps these indices
            (:func:`etgraph.labels.known_class_names`). Not part of :meth:`to_json`.
    """

    loss: str
    output: str
    width: int | None
    class_names: tuple[str, ...] = ()

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
    names = class_names_of(model) if loss == "ce" else None
    if names is None or len(names) != width:  # none, or not of this output (--output)
        names = []
    return Task(loss, output.name, width, tuple(names))


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
        label_name: the training graph's target input (:attr:`Task.label_name`).
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
