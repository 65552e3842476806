"""Frozen parameters become constants of a selection's training and eval graphs (issue #16).

``generate_artifacts`` makes every parameter a graph *input*, the frozen ones too (etgraph
lists them in ``frozen_params`` so the checkpoint carries their values across re-selection).
ONNX Runtime cannot optimise around a value fed at run time: a Conv whose weight is an input
runs ORT's plain NCHW convolution (MLAS im2col + GEMM; a depthwise conv one group at a time),
and a frozen batch norm's affine map (:class:`passes.onnx.InferenceBatchNormPass`) is
recomputed from its four statistics every step. With the frozen weight an initializer, ORT's
session optimisations apply to the frozen part of the network as they do at inference: the
affine map and Conv + BN are constant-folded and fused, and the NCHWc layout transformer
(ORT_ENABLE_ALL) runs those Convs in its blocked layout with fused activations — measured on
MobileNetV2 at 128 px, a depthwise 3x3 conv on 960 channels at 4x4 runs in 0.036 ms blocked vs
0.445 ms plain (one thread), and the DP selection's step at rho 0.5 (``--frozen-bn
inference``) in 0.64-0.73x the time (ResNet50 0.91-0.93x; docs/results.md).

:class:`BakeFrozenParamsPass` turns the graph inputs named in ``frozen`` into initializers
holding the given values. :func:`bakeable_params` picks them from a training graph: the
parameter inputs (names in ``weights``) that have no gradient accumulation buffer (they are not
trained) and are not the running statistics a training-mode batch norm (``BatchNormInternal``)
updates. The checkpoint still holds every parameter, so nothing about carrying weights
changes; the constants must equal the values the session starts from (etgraph bakes them from
the very checkpoint the session loads, :func:`etgraph.artifact_weights.bake_frozen`).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError, PreconditionError

__all__ = ["ACCUMULATION_SUFFIX", "BakeFrozenParamsPass", "bakeable_params", "bake_into"]

#: Suffix of the gradient accumulation buffer input ``generate_artifacts`` adds per trainable
#: parameter of the training graph.
ACCUMULATION_SUFFIX = "_grad.accumulation.buffer"

#: Ops whose inputs 3 and 4 are running statistics they update (ORT's training batch norm).
_UPDATING_BN = {("com.microsoft", "BatchNormInternal"), ("", "BatchNormalization")}


def bakeable_params(model: ir.Model | onnx.ModelProto, weights: Collection[str]) -> list[str]:
    """Graph inputs of a training graph that are frozen parameters, in input order: named in
    ``weights``, without ``<name>_grad.accumulation.buffer`` input, and not input 3 or 4
    (running mean / var) of a ``BatchNormInternal`` or ``BatchNormalization`` node. ``model``:
    an onnx_ir model or a ModelProto (:func:`bake_into`)."""
    if isinstance(model, onnx.ModelProto):
        inputs = [i.name for i in model.graph.input]
        nodes = [(n.domain, n.op_type, list(n.input)) for n in model.graph.node]
    else:
        inputs = [v.name for v in model.graph.inputs]
        nodes = [
            (n.domain, n.op_type, [v.name if v else "" for v in n.inputs]) for n in model.graph
        ]
    trained = {n[: -len(ACCUMULATION_SUFFIX)] for n in inputs if n.endswith(ACCUMULATION_SUFFIX)}
    updated = set()
    for domain, op_type, node_inputs in nodes:
        if (domain, op_type) in _UPDATING_BN:
            updated.update(name for name in node_inputs[3:5] if name)
    names = set(weights)
    return [n for n in inputs if n in names and n not in trained and n not in updated]


class BakeFrozenParamsPass(InPlacePass):
    """Graph inputs named in ``frozen`` become initializers holding ``weights[name]``.

    Args:
        weights: name -> array (the value of each frozen parameter: dtype and shape must match
            the graph input's where the graph declares them).
        frozen: names of graph inputs to bake (:func:`bakeable_params` of the training graph;
            the eval graph takes the same names).

    Preconditions: every name in ``frozen`` has a value in ``weights``. Postcondition: none of
    them is a graph input any more. Names not among the graph's inputs are skipped (the eval
    graph takes fewer inputs than the training graph).
    """

    def __init__(self, weights: Mapping[str, np.ndarray], frozen: Collection[str]):
        super().__init__()
        self.weights = weights
        self.frozen = list(frozen)

    def requires(self, model: ir.Model) -> None:
        missing = [n for n in self.frozen if n not in self.weights]
        if missing:
            raise PreconditionError(f"no value for frozen parameters {missing[:5]}")

    def call(self, model: ir.Model) -> PassResult:
        names = set(self.frozen)
        graph = model.graph
        baked = [v for v in graph.inputs if v.name in names]
        for value in baked:
            array = np.ascontiguousarray(self.weights[value.name])
            if value.shape is not None and value.shape.is_static():
                if tuple(value.shape.numpy()) != array.shape:
                    raise PreconditionError(
                        f"{value.name}: value shape {array.shape} != graph input {value.shape}"
                    )
            graph.inputs.remove(value)
            value.const_value = ir.tensor(array, name=value.name)
            graph.register_initializer(value)
        return PassResult(model, modified=bool(baked))

    def ensures(self, model: ir.Model) -> None:
        left = [v.name for v in model.graph.inputs if v.name in set(self.frozen)]
        if left:
            raise PostconditionError(f"frozen parameters still graph inputs: {left[:5]}")


#: Alignment (bytes) of each baked tensor in the raw data file (a page: ORT may map it).
_ALIGN = 4096
#: Tensors smaller than this (bytes) stay inside the graph (as onnx_ir's external-data save).
_INLINE_BYTES = 1024


def bake_into(
    model: onnx.ModelProto,
    weights: Mapping[str, np.ndarray],
    frozen: Collection[str],
    data_path: str | os.PathLike,
    *,
    written: Mapping[str, tuple[int, int]] | None = None,
) -> dict[str, tuple[int, int]]:
    """What :class:`BakeFrozenParamsPass` does, on a ModelProto in place and without an
    onnx_ir round trip (ResNet50's training graph: 0.2-0.5 s to read and write through
    onnx_ir; this is milliseconds plus the bytes): the graph inputs named in ``frozen`` become
    initializers holding ``weights[name]``, written raw to ``data_path`` (created; each tensor
    page-aligned; those under 1 KiB inline) and referenced as ONNX external data by its file
    name (save the model in the same directory).

    Args:
        written: what an earlier call wrote to ``data_path`` (its return value, e.g. the
            training graph's when baking the eval graph): those tensors are referenced where
            they are, not written again; others are appended to the file.

    Returns:
        Where each tensor written or referenced lies in ``data_path``: name -> (offset, length)
        in bytes.

    Raises:
        PreconditionError: a name without a value, or a value whose shape differs from the
            graph input's static shape.
    """
    names = set(frozen)
    missing = [n for n in frozen if n not in weights]
    if missing:
        raise PreconditionError(f"no value for frozen parameters {missing[:5]}")
    data_path = Path(data_path)
    graph = model.graph
    baked = [i for i in graph.input if i.name in names]
    places = dict(written or {})
    offset = max((o + n for o, n in places.values()), default=0)
    with open(data_path, "r+b" if written is not None else "wb") as f:
        for value in baked:
            array = np.ascontiguousarray(weights[value.name])
            dims = value.type.tensor_type.shape.dim
            if dims and all(d.HasField("dim_value") for d in dims):
                if tuple(d.dim_value for d in dims) != array.shape:
                    raise PreconditionError(
                        f"{value.name}: value shape {array.shape} != graph input "
                        f"{[d.dim_value for d in dims]}"
                    )
            tensor = graph.initializer.add()
            tensor.name = value.name
            tensor.data_type = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
            tensor.dims.extend(array.shape)
            if array.nbytes < _INLINE_BYTES:
                tensor.raw_data = array.tobytes()
                continue
            if value.name not in places:
                offset = -(-offset // _ALIGN) * _ALIGN
                f.seek(offset)
                f.write(memoryview(array).cast("B"))
                places[value.name] = (offset, array.nbytes)
                offset += array.nbytes
            start, length = places[value.name]
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, field in (
                ("location", data_path.name),
                ("offset", str(start)),
                ("length", str(length)),
            ):
                tensor.external_data.add(key=key, value=field)
    for i in reversed(range(len(graph.input))):
        if graph.input[i].name in names:
            del graph.input[i]
    return places
