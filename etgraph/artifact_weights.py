"""The weights of the weightless artifact graphs: taken out of a model before generation, put
back after it.

The artifacts (:mod:`etgraph.artifacts`) hold no weights: parameters are graph inputs, the
weights live in ``checkpoint``. This module moves weights between them and the model:

* **Out**: :func:`placeholder_weights` — a copy of the model whose parameters hold a
  one-element placeholder (what generation runs on); :func:`initializer_values`,
  :func:`lazy_initializer_values` — the model's values, for a checkpoint.
* **In, as constants** (issue #16): a session about to train from a given checkpoint gets copies
  of the training and eval graphs in which the frozen parameters are constants holding the
  checkpoint's values (:func:`bake_frozen`, :func:`save_baked`,
  :class:`passes.onnx.BakeFrozenParamsPass`), so ORT optimises the frozen part of the network as
  it would at inference (constant folding, Conv + BN fusion, its NCHWc conv layout).
* **In, as initializers**: :func:`export_inference_model` — the inference model of an eval
  graph with a checkpoint's weights, streamed from the checkpoint without a session.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from passes.onnx import bake_into, bakeable_params

from . import files
from .checkpoint import read_checkpoint
from .errors import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "bake_frozen",
    "export_inference_model",
    "initializer_values",
    "initializer_values_of",
    "lazy_initializer_values",
    "placeholder_weights",
    "save_baked",
]


def _itemsize(init: onnx.TensorProto) -> int:
    return int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize)


def _is_placeholder(init: onnx.TensorProto) -> bool:
    """A :func:`placeholder_weights` value: raw bytes of one element for a larger tensor."""
    count = int(np.prod(init.dims, dtype=np.int64))
    return count > 1 and len(init.raw_data) == _itemsize(init) and not init.external_data


def _copy_fields(src, dst, skip: str) -> None:
    """Copy every set field of message ``src`` but ``skip`` into the empty ``dst``."""
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if fd.is_repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def placeholder_weights(model: onnx.ModelProto, names: Collection[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers ``names`` hold a one-element placeholder value
    (zero bytes of one element; name, dtype and dims kept) instead of their values.

    Everything that depends on the model's structure only (artifact graphs, keys, batch-norm
    modes, shape inference) gives the same result on it, at a fraction of the memory; the
    weights themselves never get copied (the original's bytes are not read). Tensors of one
    element keep their value. ``names`` not among the initializers are ignored.
    """
    names = set(names)
    out = onnx.ModelProto()
    _copy_fields(model, out, skip="graph")
    _copy_fields(model.graph, out.graph, skip="initializer")
    for init in model.graph.initializer:
        if init.name in names and int(np.prod(init.dims, dtype=np.int64)) > 1:
            t = out.graph.initializer.add()
            t.name, t.data_type = init.name, init.data_type
            t.dims.extend(init.dims)
            t.raw_data = bytes(_itemsize(init))
        else:
            out.graph.initializer.add().CopyFrom(init)
    return out


class lazy_initializer_values(Mapping):  # noqa: N801 (a function-like mapping)
    """The values of initializers ``names`` of ``model`` as a read-only mapping whose arrays are
    converted when read, one at a time: a checkpoint is written from it holding one tensor's
    copy at a time, not all (:func:`etgraph.checkpoint.write_checkpoint`).

    Raises (on reading a value): ConfigError: as :func:`initializer_values`.
    """

    def __init__(self, model: onnx.ModelProto, names: Collection[str]):
        names = set(names)
        self._inits = {i.name: i for i in model.graph.initializer if i.name in names}

    def __getitem__(self, name: str) -> np.ndarray:
        return next(iter(initializer_values_of([self._inits[name]]).values()))

    def __iter__(self):
        return iter(self._inits)

    def __len__(self) -> int:
        return len(self._inits)


def initializer_values_of(inits) -> dict[str, np.ndarray]:
    """Copies of the values of the initializers ``inits`` (TensorProtos), by name.

    Raises:
        ConfigError: one is a :func:`placeholder_weights` placeholder.
    """
    out = {}
    for init in inits:
        if _is_placeholder(init):
            raise ConfigError(
                f"initializer {init.name!r} holds a placeholder, not its weights: generate "
                "artifacts without a checkpoint (checkpoint=False) or from the full model"
            )
        out[init.name] = numpy_helper.to_array(init).copy()
    return out


def initializer_values(model: onnx.ModelProto, names: Collection[str]) -> dict[str, np.ndarray]:
    """Copies of the values of initializers ``names`` of ``model``, by name.

    Raises:
        ConfigError: one of them is a :func:`placeholder_weights` placeholder (the model's
            weights were taken out).
    """
    names = set(names)
    return initializer_values_of(i for i in model.graph.initializer if i.name in names)


def save_baked(
    training_model: onnx.ModelProto, weights: Mapping[str, np.ndarray], path: str | os.PathLike
) -> Path:
    """Write a copy of an in-memory training graph with its frozen parameters as constants
    valued from ``weights`` (as :func:`bake_frozen` does to artifacts: what a
    :class:`etgraph.sessions.TrainingSession` runs) to ``path``, the constants raw in
    ``<path>.data`` beside it (:func:`passes.onnx.bake_into`). ``weights``: name -> float32
    array of every frozen parameter (running statistics included). Returns ``path``."""
    model = onnx.ModelProto()
    model.CopyFrom(training_model)
    path = Path(path)
    bake_into(model, weights, bakeable_params(model, weights), path.with_name(f"{path.name}.data"))
    onnx.save(model, str(path))
    return path


def bake_frozen(
    directory: str | os.PathLike, weights: Mapping[str, np.ndarray], out_dir: str | os.PathLike
) -> Path:
    """The artifacts in ``directory`` with every frozen parameter a constant of the training
    and eval graphs (:func:`passes.onnx.bakeable_params`: parameters without a gradient buffer,
    except the running statistics a training-mode batch norm updates), valued from ``weights``.

    Writes ``training_model.onnx`` and ``eval_model.onnx`` into ``out_dir`` (created), the
    constants raw beside them (:func:`passes.onnx.bake_into`: ResNet50 through onnx_ir or
    protobuf took seconds), and links (or copies) ``optimizer_model.onnx`` beside them; the
    session is then opened on ``out_dir`` with the checkpoint it would have used. The
    checkpoint still holds every parameter, so carrying weights is unchanged; the baked values
    must be the ones that checkpoint holds (the frozen parameters never change during a
    session).

    Args:
        directory: artifacts (:func:`etgraph.artifacts.generate`).
        weights: name -> value of (at least) every frozen parameter, float32 as in the
            checkpoint (:func:`etgraph.checkpoint.read_checkpoint`).
        out_dir: where the baked copies go (``directory`` itself: baked in place).

    Returns:
        ``out_dir``, or ``directory`` itself when the training graph has no frozen parameter
        (all-trainable artifacts).
    """
    directory, out_dir = Path(directory), Path(out_dir)
    training = onnx.load(str(directory / "training_model.onnx"))  # graphs without weights
    frozen = bakeable_params(training, weights)
    if not frozen:
        return directory
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / "training_model.onnx.data"  # one file: the eval graph's are a subset
    written = None
    for name, model in (("training_model.onnx", training), ("eval_model.onnx", None)):
        model = model if model is not None else onnx.load(str(directory / name))
        # The trained model is exported from the generated eval graph and a checkpoint
        # (etgraph.loop), never from these.
        written = bake_into(model, weights, frozen, data, written=written)
        onnx.save(model, str(out_dir / name))
    target = out_dir / "optimizer_model.onnx"
    if target.resolve() != (directory / target.name).resolve():  # else baked in place
        target.unlink(missing_ok=True)
        try:
            os.link(directory / target.name, target)
        except OSError:
            target.write_bytes((directory / target.name).read_bytes())
    log.debug("baked %d frozen parameters into %s", len(frozen), out_dir)
    return out_dir


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_prefix(field: int, length: int) -> bytes:
    """Protobuf tag (wire type 2) and length of a field of ``length`` bytes."""
    return _varint(field << 3 | 2) + _varint(length)


#: Field numbers of onnx.proto used by :func:`export_inference_model`'s streamed writing.
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def export_inference_model(
    eval_model: str | os.PathLike,
    checkpoint: str | os.PathLike,
    path: str | os.PathLike,
    output_names: Sequence[str],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write the inference model of a selection's eval model with the weights of a checkpoint
    (what ``Module.export_model_for_inferencing`` writes), without an ORT session and without
    holding the weights twice; atomically.

    The eval model (parameters as graph inputs, no weights) keeps ``output_names`` as its
    outputs and only the nodes they need; every parameter input it still reads becomes an
    initializer with the checkpoint's value, other unused inputs (the loss's target) go. The
    file is the serialized graph followed by one ``graph { initializer }`` record per weight,
    each written straight from the checkpoint's mapped bytes: protobuf merges repeated
    occurrences of a message field, so onnx and ORT read one graph (memory: one tensor's
    header at a time, instead of ~3 copies of the weights beside the session with ORT's export:
    +280 MiB on ResNet50 128 px).

    Args:
        eval_model: the artifacts' ``eval_model.onnx``. checkpoint: an ORT checkpoint holding
            every parameter it reads. path: the ONNX file to write.
        output_names: outputs kept, in order. metadata: ``metadata_props`` entries to set.

    Raises:
        ConfigError: an output is not one of the eval model's.
        CheckpointError: the checkpoint cannot be read.
    """
    model = onnx.load(str(eval_model))
    graph = model.graph
    outputs = {o.name: o for o in graph.output}
    missing = [n for n in output_names if n not in outputs]
    if missing:
        raise ConfigError(f"the eval model has no output {missing[0]!r}")
    kept_outputs = [outputs[n] for n in output_names]
    needed, nodes = set(output_names), []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            nodes.append(node)
            needed.update(i for i in node.input if i)
    nodes.reverse()
    state, _, _ = read_checkpoint(checkpoint, copy=False, moments=False)
    params = [i.name for i in graph.input if i.name in state.weights and i.name in needed]
    inputs = [i for i in graph.input if i.name not in state.weights and i.name in needed]
    for field, values in (("output", kept_outputs), ("node", nodes), ("input", inputs)):
        kept = [type(v)() for v in values]
        for copy, value in zip(kept, values, strict=True):
            copy.CopyFrom(value)
        graph.ClearField(field)
        getattr(graph, field).extend(kept)
    for key, value in (metadata or {}).items():
        model.metadata_props.add(key=key, value=value)
    with files.atomic_target(path) as tmp, open(tmp, "wb") as f:
        f.write(model.SerializeToString())
        for name in params:
            array = np.ascontiguousarray(state.weights[name])
            header = onnx.TensorProto(
                name=name,
                data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype),
                dims=array.shape,
            ).SerializeToString()
            raw = _length_prefix(_TENSOR_RAW_DATA, array.nbytes)
            tensor_len = len(header) + len(raw) + array.nbytes
            initializer = _length_prefix(_GRAPH_INITIALIZER, tensor_len)
            f.write(_length_prefix(_MODEL_GRAPH, len(initializer) + tensor_len))
            f.write(initializer + header + raw)
            f.write(memoryview(array).cast("B"))
        os.chmod(tmp, 0o644)
