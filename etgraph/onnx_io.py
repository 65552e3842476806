"""Read and validate ONNX models, and legalise them for onnxruntime-training 1.19.2 (README:
"Your own model").

:func:`load_model` is the one entry point for user models: it reads the file, checks it with
``onnx.checker`` and runs the legalisation pipeline (:func:`passes.onnx.legalization_pipeline`,
passes over an ``onnx_ir.Model``). The result is a model :func:`etgraph.artifacts.generate`
can turn into training artifacts:

* at least one graph input (besides initializers), names kept, and one output: the one trained
  on (the only one, or the one named by ``output``), name kept;
* IR version <= 10 and default-domain opset <= 21 (what ORT 1.19.2 reads);
* every node has a unique, non-empty name (the profiler maps ORT's per-node events by name);
* LayerNormalization nodes carry their optional Mean/InvStdDev outputs and Dropout its mask
  (ORT issues #22465, #22955: the gradient builder indexes them);
* HardSwish, HardSigmoid and variadic Sum are rewritten into ops that have gradients; any other
  op without a gradient builder in 1.19.2 on the data path is refused with
  :class:`UnsupportedOpError` naming the node.

Legalisation is idempotent: loading a legalised model that was saved gives the same model
(same :func:`model_hash`), so ``etgraph compile``'s ``model.onnx`` matches its profile.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Collection
from pathlib import Path

import onnx
import onnx_ir as ir
from onnx import external_data_helper, helper
from onnx_ir.passes import PassManager

from passes.base import run_passes
from passes.onnx import (
    MAX_IR_VERSION,
    OUTPUTS_KEY,
    SOURCE_KEY,
    FoldHeadLrScalePass,
    FreeBatchDimPass,
    HeadLrScale,
    RestoreHeadPass,
    legalization_pipeline,
    unzip_map_outputs,
)

from .errors import ModelError, first_line
from .files import atomic_target, require_model_path
from .ops import FLOAT_TYPES

__all__ = [
    "export_with_original_outputs",
    "legalize",
    "load_model",
    "model_files",
    "model_hash",
    "model_structure",
    "original_outputs",
    "read_onnx",
    "restore_exported",
]


def read_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    """Parse the ONNX file ``path`` with its external data, reading nothing outside its folder.

    onnx refuses ``../`` and absolute external-data locations but follows a symlink inside the
    folder to anywhere: here every location is resolved to its real path and must lie in the
    real folder of ``path``. Every tensor (initializers and attribute tensors, subgraphs
    included) must then hold as many bytes as its dims and dtype declare.

    Raises:
        ModelError: not a readable ONNX file; an external-data location outside the model's
            folder, missing or too short; a tensor holding another number of bytes than it
            declares (each message names the tensor and the path).
    """
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf DecodeError, ...
        raise ModelError(f"{path}: not a readable ONNX model ({first_line(exc)})") from exc
    _check_text(model, path)
    folder = path.parent.resolve()
    for tensor in external_data_helper._get_all_tensors(model):
        if external_data_helper.uses_external_data(tensor):
            _read_external(tensor, folder, path)
        _check_size(tensor, path)
    return model


def model_files(path: str | os.PathLike) -> list[Path]:
    """The files the ONNX model ``path`` is read from: ``path`` and its external-data files
    (``model.onnx.data``), which no output may replace. Just ``[path]`` when it cannot be
    parsed (:func:`read_onnx` says why when the model is loaded)."""
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # not a model: loading it is the error
        return [path]
    locations = {
        entry.value
        for tensor in external_data_helper._get_all_tensors(model)
        if external_data_helper.uses_external_data(tensor)
        for entry in tensor.external_data
        if entry.key == "location" and entry.value
    }
    return [path, *(path.parent / location for location in sorted(locations))]


def _check_text(message, path: Path, where: str = "model") -> None:
    """Raise ModelError at the first string field of ``message`` (recursively) that is not valid
    UTF-8 (protobuf then hands bytes over; onnx_ir cannot write such a model)."""
    for field, value in message.ListFields():
        if field.type == field.TYPE_MESSAGE:
            items = value if field.is_repeated else [value]
            for i, item in enumerate(items):
                name = getattr(item, "name", "")
                label = f"{name!r}" if isinstance(name, str) and name else f"#{i}"
                _check_text(item, path, f"{where} {field.name} {label}")
        elif field.type == field.TYPE_STRING:
            for text in value if field.is_repeated else [value]:
                if isinstance(text, bytes):
                    raise ModelError(
                        f"{path}: the {field.name} of {where} is not valid UTF-8 ({text[:40]!r}): "
                        "rename it with valid text (ONNX strings are UTF-8)"
                    )


def _read_external(tensor: onnx.TensorProto, folder: Path, path: Path) -> None:
    """Read ``tensor``'s external data into ``raw_data``, from a file inside ``folder`` (its
    real path), checking its length against the tensor's dims and dtype before reading."""
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = info.get("location", "")
    real = (folder / location).resolve()
    if not location or not real.is_relative_to(folder):
        raise ModelError(
            f"{path}: tensor {tensor.name!r} stores its data at {location!r}, which resolves to "
            f"{real}, outside the model's folder {folder}: keep external data beside the model "
            "(links resolved)"
        )
    try:
        offset, length = int(info.get("offset") or 0), info.get("length")
        length = None if length is None else int(length)
        with open(real, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = size - offset if length is None else length
            if offset < 0 or length < 0 or offset + length > size:
                raise ModelError(
                    f"{path}: tensor {tensor.name!r} reads bytes {offset}..{offset + length} of "
                    f"{real}, which has {size}: the external data is truncated or of another "
                    "model"
                )
            _check_size(tensor, path, held=length)
            f.seek(offset)
            tensor.raw_data = f.read(length)
    except (OSError, ValueError) as exc:
        hint = "keep it beside the model"
        if path.is_symlink() and (path.resolve().parent / location).exists():
            hint = (  # onnx and ORT read it beside the path given, not beside the link's target
                f"{path} is a link and its data is beside the real file {path.resolve()}: "
                "pass that file, or link the data beside the link too"
            )
        raise ModelError(
            f"{path}: cannot read the external data of tensor {tensor.name!r} from {real} "
            f"({getattr(exc, 'strerror', None) or exc}): {hint}"
        ) from exc
    del tensor.external_data[:]
    tensor.ClearField("data_location")  # as if saved without external data (same hash)


#: The typed value fields of a TensorProto (one value per element; two for complex types).
_TYPED_FIELDS = (
    "float_data",
    "int32_data",
    "int64_data",
    "double_data",
    "uint64_data",
)


def _check_size(tensor: onnx.TensorProto, path: Path, held: int | None = None) -> None:
    """Raise ModelError if ``tensor`` holds another amount of data than its dims and dtype
    declare (``held``: bytes of its external data, not yet read). Strings and packed 4-bit
    types are not checked."""
    unchecked = (onnx.TensorProto.STRING, onnx.TensorProto.INT4, onnx.TensorProto.UINT4)
    if tensor.data_type in unchecked:
        return
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return  # UNDEFINED, or a type numpy has no dtype for: not checked
    elements = math.prod(tensor.dims)
    if held is not None or tensor.HasField("raw_data"):
        count = held if held is not None else len(tensor.raw_data)
        unit, want = "bytes", elements * itemsize
    else:
        field = next((f for f in _TYPED_FIELDS if len(getattr(tensor, f))), None)
        if field is None:
            return  # no value (a graph input's placeholder, or an empty tensor)
        complex_ = tensor.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128)
        count, unit, want = len(getattr(tensor, field)), "values", elements * (2 if complex_ else 1)
    if count != want:
        raise ModelError(
            f"{path}: tensor {tensor.name!r} declares {elements} elements (dims "
            f"{list(tensor.dims)}, {helper.tensor_dtype_to_np_dtype(tensor.data_type)}: {want} "
            f"{unit}) but holds {count} {unit}: the file is damaged or was written incompletely"
        )


def load_model(
    path: str | os.PathLike, output: str | None = None, head_lr_scale: float | None = None
) -> onnx.ModelProto:
    """Load an ONNX model from ``path``, validate it and legalise it for ORT 1.19.2 training.

    Args:
        path: an ``.onnx`` file (external data next to it is loaded too).
        output: the graph output to train on; None = the model's only output.
        head_lr_scale: train the head at this factor times the learning rate
            (:class:`passes.onnx.ScaleHeadLrPass`: its weights stored divided by it, its output
            multiplied by it); None = as the model records (1 for a model etgraph did not
            compile).

    Returns:
        The legalised model (see the module docstring): the original data inputs and the one
        output trained on, names kept.

    Raises:
        ModelError: the file is missing, not ONNX, truncated, fails ``onnx.checker``, has no
            input or output, or an opset that cannot be converted to <= 21.
        ConfigError: several outputs and no ``output``, or no output named ``output``.
        UnsupportedOpError: an op on the data path has no gradient in ORT 1.19.2 and no
            built-in rewrite (the message names node and op and suggests the rewrite).
        HeadLrScaleError: ``head_lr_scale`` is not positive and finite, the model's head is
            not a supported form, or the model is already scaled by another factor.
    """
    path = require_model_path(path)
    model = read_onnx(path)
    if not model.graph.node:
        raise ModelError(f"{path}: not an ONNX model with a graph (empty or truncated file?)")
    _check(model, path)
    return legalize(model, source=str(path), output=output, head_lr_scale=head_lr_scale)


def legalize_proto(
    model: onnx.ModelProto,
    source: str = "<in-memory model>",
    output: str | None = None,
    head_lr_scale: float | None = None,
) -> onnx.ModelProto:
    """As :func:`load_model` for a model already in memory (``model`` is not modified; its
    external data, if any, must be loaded). ``source`` names it in messages.

    Raises:
        As :func:`load_model`.
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    if not model.graph.node:
        raise ModelError(f"{source}: not an ONNX model with a graph")
    _check(model, Path(source))
    return legalize(model, source=source, output=output, head_lr_scale=head_lr_scale)


def _check(model: onnx.ModelProto, path: Path) -> None:
    """``onnx.checker`` on the model as legalisation will write it: with IR version <= 10 (the
    pipeline lowers it; onnx 1.17's checker stops at IR 10)."""
    ir_version = model.ir_version
    model.ir_version = min(ir_version, MAX_IR_VERSION)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelError(f"{path}: invalid ONNX model: {first_line(exc)}") from exc
    finally:
        model.ir_version = ir_version


def legalize(
    model: onnx.ModelProto,
    source: str = "model",
    output: str | None = None,
    head_lr_scale: float | None = None,
) -> onnx.ModelProto:
    """Return a legalised copy of ``model`` (module docstring); ``source`` names it in errors,
    ``output`` is the graph output to train on (None: the only one), ``head_lr_scale`` the
    head's learning-rate factor (:func:`load_model`).

    The model should pass ``onnx.checker`` (:func:`load_model` checks it); ``model`` itself is
    not changed.

    Raises:
        ModelError, UnsupportedOpError, ConfigError: as :func:`load_model`.
    """
    model, output = unzip_map_outputs(model, output, source)  # onnx_ir cannot read maps
    pipeline = legalization_pipeline(source, output, head_lr_scale)
    result = run_passes(pipeline, ir.from_proto(model))
    return ir.to_proto(result.model)


def model_structure(model: onnx.ModelProto) -> onnx.GraphProto:
    """A copy of ``model``'s graph without initializer values and without ``value_info``: what
    profiles and artifacts depend on.

    ``value_info`` holds optional shape annotations; onnx_ir writes them for initializers, so
    leaving them out keeps the hash a model had before legalisation moved to onnx_ir (and its
    profiles valid).
    """
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    graph.ClearField("value_info")
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
    return graph


def model_hash(model: onnx.ModelProto) -> str:
    """A 16-hex-digit sha256 of the model's *structure* (:func:`model_structure`: nodes,
    attributes, input/output types, initializer names/dtypes/shapes) and opsets — not
    initializer values, so the hash of a model survives training (profiles and artifacts
    depend only on structure)."""
    h = hashlib.sha256(model_structure(model).SerializeToString(deterministic=True))
    for imp in sorted(model.opset_import, key=lambda i: i.domain):
        h.update(f"{imp.domain}:{imp.version};".encode())
    return h.hexdigest()[:16]


def restore_exported(
    path: str | os.PathLike, head: str | None = None, head_lr: HeadLrScale | None = None
) -> None:
    """Give the inference model exported at ``path`` (from artifacts of a fixed batch size) the
    user's model's interface back, in one rewrite, in place and atomically: its symbolic batch
    dimension (:class:`passes.onnx.FreeBatchDimPass`, constants untouched: it runs at any batch
    size, as the model it was trained from); with ``head_lr`` (the trained model's
    :func:`passes.onnx.head_lr_of`) the head's learning-rate scale folded back
    (:class:`passes.onnx.FoldHeadLrScalePass`: no ``Mul``, the head's weights in the original
    parametrisation); with ``head``
    (:attr:`etgraph.model.LoadedModel.head`, e.g. ``"Softmax(axis=1)"`` or
    ``"Reshape(shape=0,-1,1,1) -> Softmax(axis=1)"``), the head legalisation removed
    (:class:`passes.onnx.RestoreHeadPass`), so it keeps the original model's output meaning."""
    model = ir.load(path)
    passes = [FreeBatchDimPass(reshapes=False)]
    if head_lr is not None:
        passes.append(FoldHeadLrScalePass(head_lr))
    if head is not None:
        passes.append(RestoreHeadPass(head))
    run_passes(PassManager(passes), model)
    with atomic_target(path) as tmp:
        ir.save(model, tmp)


def original_outputs(model: onnx.ModelProto) -> tuple[list[str], str] | None:
    """``(output names, source file)`` of the model legalisation took outputs off (``--output``
    picked one of several; recorded by :class:`passes.onnx.SelectOutputPass`), or None."""
    meta = {p.key: p.value for p in model.metadata_props}
    if OUTPUTS_KEY not in meta:
        return None
    return list(json.loads(meta[OUTPUTS_KEY])), meta.get(SOURCE_KEY, "")


def export_with_original_outputs(
    trained_path: str | os.PathLike,
    original_path: str | os.PathLike,
    params: Collection[str] | None = None,
) -> None:
    """Rewrite the trained inference model at ``trained_path`` as the user's original model
    (``original_path``: every original input and output, its own head and opset) holding the
    trained values, matched by initializer name; in place and atomically. The output trained on
    is added when it is not one of the original's (the tensor a ZipMap output maps: ORT fetches
    graph outputs only, and the exported model is scored on it). ``params``: the
    names of the tensors training changed (weights and running statistics); default every
    float initializer of the trained model (its other constants may be legalisation's own).

    Raises:
        ModelError: the original file cannot be read, or a trained tensor is not an initializer
            of it (its weights were held in nodes): the single-output export is then kept.
    """
    try:
        original = read_onnx(original_path)
    except ModelError as exc:
        raise ModelError(f"cannot re-read the original model: {exc}") from exc
    trained_model = onnx.load(str(trained_path))
    trained = {  # weights and running statistics; the values of other constants are the same
        i.name: i
        for i in trained_model.graph.initializer
        if i.data_type in FLOAT_TYPES and (params is None or i.name in params)
    }
    output = trained_model.graph.output[0]
    if output.name not in {o.name for o in original.graph.output}:  # a ZipMap's tensor
        original.graph.output.append(output)
    inits = {i.name: i for i in original.graph.initializer}
    missing = [name for name in trained if name not in inits]
    if missing:
        raise ModelError(
            f"{original_path}: trained tensor {missing[0]!r} is not an initializer of the "
            "original model"
        )
    for name, tensor in trained.items():
        inits[name].CopyFrom(tensor)
    with atomic_target(trained_path) as tmp:
        onnx.save(original, str(tmp))
