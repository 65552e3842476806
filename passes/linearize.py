"""Linearisation: one forward order for the tensors and the D(o) sets of every op (paper §5).

**The rule.** Tensors are ordered by forward execution: the position, in the ONNX graph's node
order (which is topological; torch exporters emit modules in execution order), of the node that
brings the tensor into the data path — within one node by input index (kernel before bias, gamma
before beta). Index 0 is nearest the input. For every non-forward op ``o`` of the training graph
D(o) is the set of tensors whose gradient depends on ``o`` (found by propagating bitsets over the
data and gradient edges in reverse topological order). The charging passes then put ``o`` on
``t_dw[k]`` when D(o) = {k} and otherwise on ``t_dy[max D(o)]``, so ``o`` is counted exactly when
the earliest selected tensor ``e`` satisfies ``e <= max D(o)``.

That is exact whenever D(o) is a prefix ``{0, ..., max D(o)}`` (then ``e <= max D(o)`` implies
``e`` is in D(o), so ORT runs ``o``); on a chain every input-gradient op has a prefix D. Branching
models:

* **ResNet shortcuts**: the block's gradient is summed (``Sum``) at the block input; ops of the
  main branch and of an identity shortcut have prefix D sets. With a *projection* shortcut
  (downsample conv + BN) the two branches are parallel: the ops of the branch that comes later
  in forward order have D = {0..block input} plus their own branch's tensors, a gap over the
  other branch. They are charged to their own (later) tensors, so they are counted when ``e``
  falls inside the gap even if nothing in D is selected — a conservative over-estimate, never
  an under-estimate (for suffix selections, what the DP mostly picks, it is exact).
* **MobileNetV2 inverted residuals**: identity shortcuts only; every D is a prefix (exact).
* **ViT attention**: Q, K and V come from one in_proj MatMul (or three parallel ones, ordered
  q, k, v); Softmax/MatMul gradients depend on all of them, so their D covers the in_proj tensors
  and everything before (prefix). With three separate projections the ops of the k/v branches
  skip q's tensors: a gap, again over-counted conservatively.

``d_min``, ``d_size`` and ``d_max`` are kept on every op so the gap is visible in the dumps
(prefix iff ``d_min == 0 and d_size == d_max + 1``). Where D is not a prefix the pass also keeps
``d_gap`` = ``[p, extra]``: D = {0, ..., p-1} plus the tensor indices ``extra`` (all > p), and
``d_out_gap`` per output. The profiler turns these into *branch charges*, with which
:func:`etgraph.timing.backward_us` counts such an op exactly: when ``e < p`` or a tensor of
``extra`` is selected (see :class:`etgraph.timing.BranchCharges`).
"""

from __future__ import annotations

import networkx as nx
from onnx_ir.passes import PassResult, PostconditionError, PreconditionError

from .base import TensorGraphPass
from .layout import D_ATTRIBUTES, linearized_problems, op_nodes, tensor_nodes


class LinearizePass(TensorGraphPass):
    """Fix the tensor order and compute D(o) summaries.

    Requires: tensor nodes with distinct ``index`` 0..N-1 and a ``name``; op nodes with ``role``
    and ``outputs``; ``kind="data"`` edges (attribute ``values``: the value names passed) between
    ops, acyclic among the non-forward ops; ``kind="grad"`` edges op -> tensor (``values``: the
    gradient value name).

    Ensures: graph attribute ``tensor_order`` (names by index); ``kind="chain"`` edges
    tensor k+1 -> tensor k; on every non-forward op ``d_size`` (int), ``d_min``/``d_max``
    (tensor index or None when D is empty) and ``d_out_max`` (list aligned with ``outputs``:
    max index of D of that output value, or None); ``d_gap`` and ``d_out_gap`` (per output):
    None when D is empty or a prefix {0..max}, else ``[p, extra]`` (:func:`gap`).

    ``modified`` is False when all of that was already in place (a second run).
    """

    name = "linearize"

    def requires(self, graph: nx.DiGraph) -> None:
        tensors = tensor_nodes(graph)
        indices = [graph.nodes[t]["index"] for t in tensors]
        if indices != list(range(len(tensors))):
            raise PreconditionError(f"tensor indices must be 0..N-1, got {indices[:10]}...")
        if any("name" not in graph.nodes[t] for t in tensors):
            raise PreconditionError("every tensor node needs a name")
        for n in op_nodes(graph):
            a = graph.nodes[n]
            if "role" not in a or not isinstance(a.get("outputs"), list):
                raise PreconditionError(f"op node {n!r} needs a role and a list of outputs")
        for u, v, a in graph.edges(data=True):
            kind = a.get("kind")
            if kind in ("data", "grad") and not isinstance(a.get("values"), list):
                raise PreconditionError(f"{kind} edge {u!r} -> {v!r} has no list of values")
            if kind == "grad" and graph.nodes[v].get("node_type") != "tensor":
                raise PreconditionError(f"grad edge {u!r} -> {v!r} does not end at a tensor")
        if not nx.is_directed_acyclic_graph(_backward_flow(graph)):
            raise PreconditionError("the data edges among non-forward ops form a cycle")

    def call(self, graph: nx.DiGraph) -> PassResult:
        modified = False
        tensors = tensor_nodes(graph)
        order = [graph.nodes[t]["name"] for t in tensors]
        if graph.graph.get("tensor_order") != order:
            graph.graph["tensor_order"] = order
            modified = True
        for later, earlier in zip(tensors[1:], tensors[:-1], strict=True):
            if graph.get_edge_data(later, earlier, {}).get("kind") != "chain":
                graph.add_edge(later, earlier, kind="chain")
                modified = True

        flow = _backward_flow(graph)
        bits: dict[str, int] = {}
        for op in reversed(list(nx.topological_sort(flow))):
            per_value: dict[str, int] = {}
            for _, succ, attrs in graph.out_edges(op, data=True):
                kind = attrs.get("kind")
                if kind == "grad":
                    b = 1 << graph.nodes[succ]["index"]
                elif kind == "data" and succ in bits:
                    b = bits[succ]
                else:
                    continue
                for value in attrs.get("values", []):
                    per_value[value] = per_value.get(value, 0) | b
            total = 0
            for b in per_value.values():
                total |= b
            bits[op] = total
            attrs = graph.nodes[op]
            outputs = attrs.get("outputs", [])
            summary = {
                "d_size": total.bit_count(),
                "d_max": total.bit_length() - 1 if total else None,
                "d_min": (total & -total).bit_length() - 1 if total else None,
                "d_out_max": [
                    (per_value[v].bit_length() - 1) if per_value.get(v) else None for v in outputs
                ],
                "d_gap": gap(total),
                "d_out_gap": [gap(per_value.get(v, 0)) for v in outputs],
            }
            if any(k not in attrs or attrs[k] != v for k, v in summary.items()):
                attrs.update(summary)
                modified = True
        return PassResult(graph, modified)

    def ensures(self, graph: nx.DiGraph) -> None:
        problems = linearized_problems(graph)
        tensors = tensor_nodes(graph)
        for later, earlier in zip(tensors[1:], tensors[:-1], strict=True):
            if graph.get_edge_data(later, earlier, {}).get("kind") != "chain":
                problems.append(f"no chain edge {later!r} -> {earlier!r}")
                break
        for n in op_nodes(graph):
            a = graph.nodes[n]
            if a["role"] == "forward":
                continue
            missing = [k for k in D_ATTRIBUTES if k not in a]
            if missing:
                problems.append(f"op {n!r} has no {', '.join(missing)}")
            elif len(a["d_out_max"]) != len(a["outputs"]):
                problems.append(f"op {n!r}: d_out_max is not aligned with its outputs")
            if problems:
                break
        if problems:
            raise PostconditionError(f"pass {self.name}: " + "; ".join(problems))


def _backward_flow(graph: nx.DiGraph) -> nx.DiGraph:
    """The non-forward ops and the ``data`` edges among them."""
    backward = [n for n in op_nodes(graph) if graph.nodes[n].get("role") != "forward"]
    flow = nx.DiGraph()
    flow.add_nodes_from(backward)
    flow.add_edges_from(
        (u, v)
        for u, v, kind in graph.edges(data="kind")
        if kind == "data" and u in flow and v in flow
    )
    return flow


def gap(bits: int) -> list | None:
    """``[p, extra]`` for a D(o) bitset (bit k = tensor k) that is not a prefix: D = {0..p-1}
    plus the sorted indices ``extra`` (all > p). None for an empty D or a prefix {0..max}."""
    if bits == 0 or bits & (bits + 1) == 0:
        return None
    p = (bits ^ (bits + 1)).bit_length() - 1  # number of trailing ones
    rest = bits >> p
    extra = [p + i for i in range(rest.bit_length()) if rest >> i & 1]
    return [p, extra]
