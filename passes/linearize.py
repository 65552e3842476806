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

from . import PassResult, op_nodes, tensor_nodes


class LinearizePass:
    """Fix the tensor order and compute D(o) summaries.

    Requires: tensor nodes with distinct ``index`` 0..N-1; op nodes with ``role`` and ``outputs``;
    ``kind="data"`` edges (attribute ``values``: the value names passed) between ops;
    ``kind="grad"`` edges op -> tensor (``values``: the gradient value name).

    Ensures: graph attribute ``tensor_order`` (names by index); ``kind="chain"`` edges
    tensor k+1 -> tensor k; on every non-forward op ``d_size`` (int), ``d_min``/``d_max``
    (tensor index or None when D is empty) and ``d_out_max`` (list aligned with ``outputs``:
    max index of D of that output value, or None); ``d_gap`` and ``d_out_gap`` (per output):
    None when D is empty or a prefix {0..max}, else ``[p, extra]`` (:func:`gap`).
    """

    name = "linearize"

    def __call__(self, graph: nx.DiGraph) -> PassResult:
        tensors = tensor_nodes(graph)
        indices = [graph.nodes[t]["index"] for t in tensors]
        if indices != list(range(len(tensors))):
            raise ValueError(f"tensor indices must be 0..N-1, got {indices[:10]}...")
        order = [graph.nodes[t]["name"] for t in tensors]
        graph.graph["tensor_order"] = order
        for later, earlier in zip(tensors[1:], tensors[:-1], strict=True):
            graph.add_edge(later, earlier, kind="chain")

        backward = [n for n in op_nodes(graph) if graph.nodes[n].get("role") != "forward"]
        flow = nx.DiGraph()
        flow.add_nodes_from(backward)
        flow.add_edges_from(
            (u, v)
            for u, v, kind in graph.edges(data="kind")
            if kind == "data" and u in flow and v in flow
        )
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
            attrs["d_size"] = total.bit_count()
            attrs["d_max"] = total.bit_length() - 1 if total else None
            attrs["d_min"] = (total & -total).bit_length() - 1 if total else None
            attrs["d_out_max"] = [
                (per_value[v].bit_length() - 1) if per_value.get(v) else None
                for v in attrs.get("outputs", [])
            ]
            attrs["d_gap"] = gap(total)
            attrs["d_out_gap"] = [gap(per_value.get(v, 0)) for v in attrs.get("outputs", [])]
        return PassResult(graph, True)


def gap(bits: int) -> list | None:
    """``[p, extra]`` for a D(o) bitset (bit k = tensor k) that is not a prefix: D = {0..p-1}
    plus the sorted indices ``extra`` (all > p). None for an empty D or a prefix {0..max}."""
    if bits == 0 or bits & (bits + 1) == 0:
        return None
    p = (bits ^ (bits + 1)).bit_length() - 1  # number of trailing ones
    rest = bits >> p
    extra = [p + i for i in range(rest.bit_length()) if rest >> i & 1]
    return [p, extra]
