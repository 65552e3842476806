"""Convolutional and dense layers (paper §5.1): kernel and bias.

In the backward pass a conv/dense layer runs three computations: the kernel gradient (T3 ->
kernel ``t_dw``), the bias gradient (T2 -> bias ``t_dw``; the bias passes no gradient, so its
own ``t_dy`` gets nothing from this layer) and the input gradient (T1). Under the shared
charging rule T1 lands on the ``t_dy`` of the closest tensor *before* the layer
(``max D(o)``), so it is counted exactly when an earlier tensor trains, i.e. when the gradient
must pass through this layer.

ONNX Runtime fuses Conv's three computations into one ``ConvGrad`` kernel (also grouped and
depthwise conv; ``ConvTransposeGrad`` likewise): it is charged as a ``split`` — the profiler
separates dX, dW and dB by measurement. Gemm and MatMul(+Add bias) layers get separate backward
ops (Gemm/MatMul/ReduceSum/Transpose), charged one by one.
"""

from __future__ import annotations

import networkx as nx

from . import PassResult, op_rule, set_charge, tensor_name_at, uncharged

_KINDS = ("kernel", "bias")


class ConvDensePass:
    """Charge conv/dense backward ops.

    Requires: the output of :class:`passes.linearize.LinearizePass` (``d_*`` attributes,
    ``tensor_order``); tensor nodes with ``kind`` and ``values`` (the value names that carry the
    tensor into its layer: its own name and any weight-preprocessing outputs such as Transpose(W)).

    Ensures: (a) every fused gradient op (registry ``fused_grad``: ConvGrad, ConvTransposeGrad) is
    charged ``split`` — ``charge_dy_tensor`` = ``max D(dX)`` (None for the first layer, whose dX
    ORT does not compute) and ``charge_dw_tensors`` = the kernel and bias it produces gradients
    for; (b) every backward op whose D is a single kernel or bias is charged ``dw`` to it;
    (c) every backward op that reads a kernel (the input-gradient op: e.g. Gemm/MatMul of dY and W)
    and serves earlier tensors is charged ``dy`` to ``max D``. Already charged ops are skipped.
    """

    name = "conv_dense"

    def __call__(self, graph: nx.DiGraph) -> PassResult:
        kinds = {a["name"]: a["kind"] for _, a in _tensors(graph)}
        kernel_values = {
            v for _, a in _tensors(graph) if a["kind"] == "kernel" for v in a.get("values", [])
        }
        modified = False
        for op in uncharged(graph):
            attrs = graph.nodes[op]
            if attrs.get("role") != "backward" or attrs.get("d_max") is None:
                continue
            rule = op_rule(attrs["op_type"])
            if rule.fused_grad:
                d_out = attrs.get("d_out_max", [])
                dy_tensor, dw_tensors = None, []
                for i, part in sorted(rule.fused_grad.items()):
                    if i >= len(d_out) or d_out[i] is None:
                        continue
                    name = tensor_name_at(graph, d_out[i])
                    if part == "dx":
                        dy_tensor = name
                    else:
                        dw_tensors.append(name)
                set_charge(
                    graph, op, "split", self.name, dy_tensor=dy_tensor, dw_tensors=dw_tensors
                )
                modified = True
                continue
            top = tensor_name_at(graph, attrs["d_max"])
            if attrs["d_size"] == 1 and kinds.get(top) in _KINDS:
                set_charge(graph, op, "dw", self.name, top)
                modified = True
            elif attrs["d_size"] > 1 and kernel_values.intersection(attrs.get("inputs", [])):
                set_charge(graph, op, "dy", self.name, top)
                modified = True
        return PassResult(graph, modified)


def _tensors(graph: nx.DiGraph):
    return ((n, a) for n, a in graph.nodes(data=True) if a.get("node_type") == "tensor")
