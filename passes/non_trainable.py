"""Non-trainable layers (paper §5.3) and everything else: the D-rule, accumulators, loss, forward.

Activations, pooling, dropout, reshapes, attention's MatMul/Softmax, residual Adds and the
gradient sums of branches have no tensor of their own but still pass the gradient. Their
backward op ``o`` goes to ``t_dy[max D(o)]`` — the closest tensor on their input side whose
gradient needs them — so it is counted exactly when the gradient passes there (paper Fig. 6:
"added to t_dy of Bias in the previous convolutional layer"). An op serving one tensor only
(D(o) = {k}, e.g. the ReduceSum behind an embedding's Expand) is that tensor's ``t_dw``.
The loss gradient and anything after the last tensor have ``max D = N-1``. Backward ops with an
empty D (dead helpers) also go to ``t_dy[N-1]``: they run whenever anything trains.
"""

from __future__ import annotations

import networkx as nx

from . import PassResult, set_charge, tensor_name_at, uncharged


class NonTrainablePass:
    """Charge every op that no earlier pass charged.

    Requires: :class:`passes.linearize.LinearizePass` output; op nodes with ``role`` and
    ``inputs``; ``kind="grad"`` edges (``values`` = [gradient value name]) to tensor nodes.

    Ensures: every op node has a ``charge``: ``forward`` (role forward), ``loss`` (role loss),
    ``dw`` of the parameter whose gradient an accumulator consumes (role accumulate),
    and for role backward ``dw`` when D = {k}, else ``dy`` on ``max D`` (``N-1`` when D is empty).
    """

    name = "non_trainable"

    def __call__(self, graph: nx.DiGraph) -> PassResult:
        grad_value_tensor = {
            value: graph.nodes[t]["name"]
            for _, t, attrs in graph.edges(data=True)
            if attrs.get("kind") == "grad"
            for value in attrs.get("values", [])
        }
        order = graph.graph["tensor_order"]
        modified = False
        for op in uncharged(graph):
            attrs = graph.nodes[op]
            role = attrs.get("role")
            modified = True
            if role == "forward":
                set_charge(graph, op, "forward", self.name)
            elif role == "loss":
                set_charge(graph, op, "loss", self.name)
            elif role == "accumulate":
                params = [
                    grad_value_tensor[v] for v in attrs.get("inputs", []) if v in grad_value_tensor
                ]
                if params:
                    set_charge(graph, op, "dw", self.name, params[0])
                else:
                    set_charge(graph, op, "dy", self.name, order[-1])
            elif attrs.get("d_max") is None:
                set_charge(graph, op, "dy", self.name, order[-1])
            elif attrs["d_size"] == 1:
                set_charge(graph, op, "dw", self.name, tensor_name_at(graph, attrs["d_max"]))
            else:
                set_charge(graph, op, "dy", self.name, tensor_name_at(graph, attrs["d_max"]))
        return PassResult(graph, modified)
