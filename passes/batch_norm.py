"""Normalisation layers (paper §5.2 batch norm; §5.4 layer norm and group norm): gamma and beta.

Frameworks implement the normalisation backward differently, so the paper treats the layer as a
black box: as soon as any tensor at or before the layer trains, *all* of its backward ops run.
Their whole time therefore goes to the ``t_dy`` of the layer's beta (gamma if the layer has no
beta), which is counted exactly when the gradient passes the layer (``e <= index(beta)``).
In ORT 1.19.2 this is one fused op (BatchNormalizationGrad, LayerNormalizationGrad, ...) that
computes dX, dGamma and dBeta together; any helper op serving only gamma's or beta's gradient
joins it.
"""

from __future__ import annotations

import networkx as nx

from . import PassResult, op_rule, set_charge, tensor_name_at, uncharged

_KINDS = ("gamma", "beta")


class BatchNormPass:
    """Charge normalisation backward ops to beta's ``t_dy``.

    Requires: :class:`passes.linearize.LinearizePass` output; tensor nodes with ``kind`` and
    ``layer``.

    Ensures: every uncharged backward op that is a norm gradient in the registry (``norm_grad``)
    and produces a gradient of a gamma/beta is charged ``dy`` to the latest of the layer's
    gamma/beta (beta when present); every uncharged backward op whose D is a single gamma or beta
    is charged ``dy`` to the beta of that layer.
    """

    name = "batch_norm"

    def __call__(self, graph: nx.DiGraph) -> PassResult:
        tensors = {
            a["name"]: a for _, a in graph.nodes(data=True) if a.get("node_type") == "tensor"
        }
        beta_of_layer: dict[str, str] = {}
        for name, a in sorted(tensors.items(), key=lambda item: item[1]["index"]):
            if a["kind"] in _KINDS:
                beta_of_layer[a["layer"]] = name  # the later one (beta) wins
        modified = False
        for op in uncharged(graph):
            attrs = graph.nodes[op]
            if attrs.get("role") != "backward" or attrs.get("d_max") is None:
                continue
            target = None
            if op_rule(attrs["op_type"]).norm_grad:
                own = [
                    tensor_name_at(graph, k)
                    for k in attrs.get("d_out_max", [])[1:]
                    if k is not None
                ]
                own = [t for t in own if tensors[t]["kind"] in _KINDS]
                if own:
                    target = beta_of_layer[tensors[own[-1]]["layer"]]
            elif attrs["d_size"] == 1:
                name = tensor_name_at(graph, attrs["d_max"])
                if tensors[name]["kind"] in _KINDS:
                    target = beta_of_layer[tensors[name]["layer"]]
            if target is not None:
                set_charge(graph, op, "dy", self.name, target)
                modified = True
        return PassResult(graph, modified)
