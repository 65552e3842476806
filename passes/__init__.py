"""Compiler passes over the tensor-level backward graph (paper section 5).

The graph these passes work on is built by :func:`etgraph.graph.build_tensor_graph`: a
``networkx.DiGraph`` with

* **tensor nodes** (``node_type="tensor"``; id ``"t:<name>"``): one per trainable tensor, attributes
  ``name, kind, layer, op_type, shape, params, index`` (forward order, 0 nearest the input);
* **op nodes** (``node_type="op"``; id ``"op:<node name>"``): one per node of ORT's training graph
  (built with *all* tensors trainable), attributes ``name, op_type, domain, role`` (``forward``,
  ``loss``, ``backward``, ``accumulate``), ``inputs``, ``outputs`` (value names, ``""`` for an
  absent optional output);
* **edges**: ``kind="data"`` op -> op for the values a non-forward op passes on (attribute
  ``values``, a list of value names), ``kind="forward"`` op -> op among forward ops,
  ``kind="grad"`` op -> tensor from the op that produces the tensor's gradient ``<name>_grad``
  (ORT names the gradient of ``X`` ``X_grad``). Edges from forward to non-forward ops (saved
  activations) are left out: they carry no gradient and would clutter the dumps.

The passes then add, in this order (:data:`DEFAULT_PASSES`):

1. :mod:`passes.linearize` — the tensor order (graph attribute ``tensor_order``), chain edges
   tensor k+1 -> tensor k, and on every non-forward op the D(o) summary ``d_size``, ``d_min``,
   ``d_max`` and per output ``d_out_max`` (D(o) = tensors whose gradient depends on op o);
2. :mod:`passes.conv_dense` — §5.1: fused ConvGrad split, kernel/bias gradient ops -> ``t_dw``,
   input-gradient ops of conv/dense layers -> ``t_dy`` of the closest earlier tensor;
3. :mod:`passes.batch_norm` — §5.2/§5.4: a norm layer's whole backward -> its beta's ``t_dy``;
4. :mod:`passes.non_trainable` — §5.3: every other op by the D-rule, accumulators, loss, forward.

A charged op carries ``charge`` (``dw``, ``dy``, ``split``, ``forward``, ``loss``),
``charge_tensor`` (tensor name for ``dw``/``dy``), ``charge_dy_tensor`` and ``charge_dw_tensors``
(for ``split``) and ``rule`` (the pass that decided); op -> tensor edges with attribute ``charge``
(``dw`` or ``dy``) make the folding visible in the dumps (``kind="charge"``, or ``kind="grad"``
when the op also produces that tensor's gradient).

Per-op knowledge lives in one registry, :data:`OP_RULES`, keyed by ONNX op type — never by node
names. Unknown op types get :data:`DEFAULT_RULE` (a non-trainable layer, all inputs differentiable).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import networkx as nx

log = logging.getLogger(__name__)

# ---- node id helpers (shared by etgraph.graph and every pass) ----


def tensor_id(name: str) -> str:
    """Node id of the tensor node for trainable tensor ``name``."""
    return f"t:{name}"


def op_id(name: str) -> str:
    """Node id of the op node for training-graph node ``name``."""
    return f"op:{name}"


def tensor_nodes(graph: nx.DiGraph) -> list[str]:
    """Ids of the tensor nodes sorted by their ``index`` (forward order)."""
    ids = [n for n, a in graph.nodes(data=True) if a.get("node_type") == "tensor"]
    return sorted(ids, key=lambda n: graph.nodes[n]["index"])


def op_nodes(graph: nx.DiGraph, role: str | None = None) -> list[str]:
    """Ids of op nodes (optionally only those with ``role``) in insertion (graph) order."""
    return [
        n
        for n, a in graph.nodes(data=True)
        if a.get("node_type") == "op" and (role is None or a.get("role") == role)
    ]


# ---- the op-type registry ----


@dataclass(frozen=True)
class OpRule:
    """What the compiler knows about one ONNX op type.

    Attributes:
        family: ``"conv_dense"`` (§5.1 layers), ``"norm"`` (§5.2/§5.4 layers), ``"non_trainable"``
            (§5.3), ``"accumulate"`` (ORT gradient accumulators), ``"loss"``.
        weight_slots: input index -> tensor kind for initializers found at that input
            (e.g. Conv ``{1: "kernel", 2: "bias"}``).
        stat_slots: input indices holding running statistics (BN mean/var; frozen, not trained).
        nondiff_slots: input indices that carry no gradient (shapes, axes, indices, ratios).
        differentiable: False for ops none of whose outputs carry a gradient (Shape, Equal, ...).
        fused_grad: for backward op types: output index -> part of a fused multi-output gradient
            kernel (``"dx"``, ``"dw"``, ``"db"``), split by measurement (ConvGrad).
        norm_grad: True for a normalisation layer's backward op (charged whole to beta's t_dy).
    """

    family: str = "non_trainable"
    weight_slots: Mapping[int, str] = field(default_factory=dict)
    stat_slots: tuple[int, ...] = ()
    nondiff_slots: tuple[int, ...] = ()
    differentiable: bool = True
    fused_grad: Mapping[int, str] = field(default_factory=dict)
    norm_grad: bool = False


DEFAULT_RULE = OpRule()

_CONV = OpRule("conv_dense", {1: "kernel", 2: "bias"})
_NORM = OpRule("norm", {1: "gamma", 2: "beta"})
_NO_GRAD = OpRule(differentiable=False)
_REDUCE = OpRule(nondiff_slots=(1,))

OP_RULES: dict[str, OpRule] = {
    # forward layers with trainable tensors
    "Conv": _CONV,
    "ConvTranspose": _CONV,
    "Gemm": OpRule("conv_dense", {0: "kernel", 1: "kernel", 2: "bias"}),
    "MatMul": OpRule("conv_dense", {0: "kernel", 1: "kernel"}),
    "BatchNormalization": OpRule("norm", {1: "gamma", 2: "beta"}, stat_slots=(3, 4)),
    "BatchNormInternal": OpRule("norm", {1: "gamma", 2: "beta"}, stat_slots=(3, 4)),
    "LayerNormalization": _NORM,
    "SimplifiedLayerNormalization": OpRule("norm", {1: "gamma"}),
    "GroupNormalization": _NORM,
    "InstanceNormalization": _NORM,
    "Gather": OpRule(weight_slots={0: "embedding"}, nondiff_slots=(1,)),
    # backward ops of onnxruntime-training (com.microsoft) that need a rule
    "ConvGrad": OpRule("conv_dense", fused_grad={0: "dx", 1: "dw", 2: "db"}),
    "ConvTransposeGrad": OpRule("conv_dense", fused_grad={0: "dx", 1: "dw", 2: "db"}),
    "BatchNormalizationGrad": OpRule("norm", norm_grad=True),
    "LayerNormalizationGrad": OpRule("norm", norm_grad=True),
    "SimplifiedLayerNormalizationGrad": OpRule("norm", norm_grad=True),
    "InvertibleLayerNormalizationGrad": OpRule("norm", norm_grad=True),
    "InPlaceAccumulatorV2": OpRule("accumulate"),
    "InPlaceAccumulator": OpRule("accumulate"),
    "SoftmaxCrossEntropyLoss": OpRule("loss", nondiff_slots=(1, 2)),
    # inputs that carry no gradient
    "Reshape": OpRule(nondiff_slots=(1,)),
    "Expand": OpRule(nondiff_slots=(1,)),
    "Tile": OpRule(nondiff_slots=(1,)),
    "Slice": OpRule(nondiff_slots=(1, 2, 3, 4)),
    "GatherElements": OpRule(nondiff_slots=(1,)),
    "GatherND": OpRule(nondiff_slots=(1,)),
    "ScatterND": OpRule(nondiff_slots=(1,)),
    "ScatterElements": OpRule(nondiff_slots=(1,)),
    "Pad": OpRule(nondiff_slots=(1, 2, 3)),
    "Resize": OpRule(nondiff_slots=(1, 2, 3)),
    "Upsample": OpRule(nondiff_slots=(1,)),
    "Split": OpRule(nondiff_slots=(1,)),
    "Squeeze": OpRule(nondiff_slots=(1,)),
    "Unsqueeze": OpRule(nondiff_slots=(1,)),
    "ReduceMean": _REDUCE,
    "ReduceSum": _REDUCE,
    "ReduceMax": _REDUCE,
    "ReduceMin": _REDUCE,
    "ReduceProd": _REDUCE,
    "ReduceL2": _REDUCE,
    "ReduceLogSumExp": _REDUCE,
    "Clip": OpRule(nondiff_slots=(1, 2)),
    "Dropout": OpRule(nondiff_slots=(1, 2)),
    "Where": OpRule(nondiff_slots=(0,)),
    "TopK": OpRule(nondiff_slots=(1,)),
    "CumSum": OpRule(nondiff_slots=(1,)),
    "Trilu": OpRule(nondiff_slots=(1,)),
    "Pow": OpRule(nondiff_slots=(1,)),
    # ops whose outputs carry no gradient at all
    **{
        op: _NO_GRAD
        for op in (
            "Shape",
            "Size",
            "ConstantOfShape",
            "Constant",
            "Range",
            "NonZero",
            "ArgMax",
            "ArgMin",
            "Equal",
            "Less",
            "Greater",
            "LessOrEqual",
            "GreaterOrEqual",
            "Not",
            "And",
            "Or",
            "Xor",
            "IsNaN",
            "IsInf",
            "Floor",
            "Ceil",
            "Round",
            "Sign",
            "Mod",
            "OneHot",
            "EyeLike",
            "RandomNormal",
            "RandomUniform",
            "RandomNormalLike",
            "RandomUniformLike",
            "Bernoulli",
            "Multinomial",
        )
    },
}


def op_rule(op_type: str) -> OpRule:
    """The registry entry for ``op_type`` (:data:`DEFAULT_RULE` when unknown)."""
    return OP_RULES.get(op_type, DEFAULT_RULE)


# ---- the pass contract ----


@dataclass
class PassResult:
    """What a pass returns: the (possibly same, mutated) graph and whether it changed anything."""

    graph: nx.DiGraph
    modified: bool


class Pass(Protocol):
    """A compiler pass: ``__call__(graph) -> PassResult``.

    Every pass documents in its class docstring what it ``requires`` of the input graph and what
    it ``ensures`` of the output graph, does one thing, and never re-charges an op that an earlier
    pass already charged (``charge`` attribute set).
    """

    name: str

    def __call__(self, graph: nx.DiGraph) -> PassResult: ...


class PassManager:
    """Run passes in order; logs each pass's wall time and whether it modified the graph."""

    def __init__(self, passes: Iterable[Pass]):
        self.passes = list(passes)

    def run(self, graph: nx.DiGraph) -> PassResult:
        """Run every pass on ``graph``; returns the final graph and whether any pass modified it."""
        modified = False
        for p in self.passes:
            start_s = time.perf_counter()
            result = p(graph)
            graph = result.graph
            modified |= result.modified
            log.debug(
                "pass %s: modified=%s in %.3f s",
                p.name,
                result.modified,
                time.perf_counter() - start_s,
            )
        return PassResult(graph, modified)


# ---- helpers shared by the charging passes ----


def set_charge(
    graph: nx.DiGraph,
    op: str,
    kind: str,
    rule: str,
    tensor: str | None = None,
    *,
    dy_tensor: str | None = None,
    dw_tensors: Iterable[str] = (),
) -> None:
    """Charge op node ``op``: set its ``charge*``/``rule`` attributes and add charge edges.

    ``tensor`` (a tensor *name*) receives the whole op for ``kind`` ``dw``/``dy``; for ``split``
    ``dy_tensor`` receives the input-gradient part and ``dw_tensors`` the weight/bias parts.
    """
    attrs = graph.nodes[op]
    dw_tensors = list(dw_tensors)
    attrs.update(
        charge=kind,
        charge_tensor=tensor,
        charge_dy_tensor=dy_tensor,
        charge_dw_tensors=dw_tensors,
        rule=rule,
    )
    if kind in ("dw", "dy") and tensor is not None:
        _charge_edge(graph, op, tensor, kind)
    if kind == "split":
        if dy_tensor is not None:
            _charge_edge(graph, op, dy_tensor, "dy")
        for name in dw_tensors:
            _charge_edge(graph, op, name, "dw")


def _charge_edge(graph: nx.DiGraph, op: str, tensor: str, part: str) -> None:
    """Mark op -> tensor as a charge edge (attribute ``charge`` = part); an existing ``grad``
    edge keeps its kind and gains the attribute."""
    t = tensor_id(tensor)
    if graph.has_edge(op, t):
        graph.edges[op, t]["charge"] = part
    else:
        graph.add_edge(op, t, kind="charge", charge=part)


def uncharged(graph: nx.DiGraph) -> list[str]:
    """Op node ids without a ``charge`` yet, in graph order."""
    return [n for n in op_nodes(graph) if graph.nodes[n].get("charge") is None]


def tensor_name_at(graph: nx.DiGraph, index: int) -> str:
    """Name of the tensor with forward index ``index`` (uses graph attribute ``tensor_order``)."""
    return graph.graph["tensor_order"][index]


from .batch_norm import BatchNormPass  # noqa: E402
from .conv_dense import ConvDensePass  # noqa: E402
from .linearize import LinearizePass  # noqa: E402
from .non_trainable import NonTrainablePass  # noqa: E402

DEFAULT_PASSES = (LinearizePass, ConvDensePass, BatchNormPass, NonTrainablePass)


def default_pass_manager() -> PassManager:
    """The pass pipeline of :func:`etgraph.graph.build_tensor_graph`: linearize, conv_dense,
    batch_norm, non_trainable."""
    return PassManager(cls() for cls in DEFAULT_PASSES)


__all__ = [
    "DEFAULT_PASSES",
    "DEFAULT_RULE",
    "OP_RULES",
    "BatchNormPass",
    "ConvDensePass",
    "LinearizePass",
    "NonTrainablePass",
    "OpRule",
    "Pass",
    "PassManager",
    "PassResult",
    "default_pass_manager",
    "op_id",
    "op_nodes",
    "op_rule",
    "set_charge",
    "tensor_id",
    "tensor_name_at",
    "tensor_nodes",
    "uncharged",
]
