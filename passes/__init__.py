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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import networkx as nx

from etgraph.ops import DEFAULT_RULE, OP_RULES, OpRule, op_rule

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
