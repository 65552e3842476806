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
the very checkpoint the session loads, :func:`etgraph.artifacts.bake_frozen`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError, PreconditionError

__all__ = ["ACCUMULATION_SUFFIX", "BakeFrozenParamsPass", "bakeable_params"]

#: Suffix of the gradient accumulation buffer input ``generate_artifacts`` adds per trainable
#: parameter of the training graph.
ACCUMULATION_SUFFIX = "_grad.accumulation.buffer"

#: Ops whose inputs 3 and 4 are running statistics they update (ORT's training batch norm).
_UPDATING_BN = {("com.microsoft", "BatchNormInternal"), ("", "BatchNormalization")}


def bakeable_params(model: ir.Model, weights: Collection[str]) -> list[str]:
    """Graph inputs of a training graph that are frozen parameters, in input order: named in
    ``weights``, without ``<name>_grad.accumulation.buffer`` input, and not input 3 or 4
    (running mean / var) of a ``BatchNormInternal`` or ``BatchNormalization`` node."""
    inputs = [v.name for v in model.graph.inputs]
    trained = {n[: -len(ACCUMULATION_SUFFIX)] for n in inputs if n.endswith(ACCUMULATION_SUFFIX)}
    updated = set()
    for node in model.graph:
        if (node.domain, node.op_type) in _UPDATING_BN:
            updated.update(v.name for v in node.inputs[3:5] if v is not None)
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
