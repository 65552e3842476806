"""Rewrite ops that have no gradient builder in ORT 1.19.2 into ops that have one.

The registry (:mod:`etgraph.ops`) marks them ``gradient="rewrite"``:

* HardSwish ``y = x * clip(x + 3, 0, 6) / 6`` and HardSigmoid ``y = clip(alpha * x + beta, 0,
  1)``: onnxscript pattern-rewrite rules (:class:`HardSwishRule`, :class:`HardSigmoidRule`),
  the inverse of onnxscript's own HardSwish fusion;
* Elu ``y = relu(x) + alpha * (exp(-relu(-x)) - 1)``, Selu ``y = gamma * elu(x; alpha)``, Celu
  ``y = relu(x) + alpha * (exp(-relu(-x) / alpha) - 1)`` and PRelu ``y = relu(x) + slope *
  min(x, 0)`` (:class:`EluRule`, :class:`SeluRule`, :class:`CeluRule`, :class:`PReluRule`): exact
  for every x; a PRelu slope is then read by a Mul, so it stays frozen (not a trainable tensor);
* variadic Sum ``Sum(a, b, c)`` -> ``Add(Add(a, b), c)``: built with onnx_ir nodes (a pattern
  has a fixed number of inputs);
* ``CastLike(x, like)`` -> ``Cast(x, to=dtype(like))`` (:class:`CastLikePass`; torch's dynamo
  exporter makes a convolution's zero bias with it, from the image input).

New nodes and values are named ``<node>/<part>``; the constants are ``Constant`` nodes, not
initializers, so they never become trainable tensors. The rules are applied by the passes
themselves (``RewriteRule.try_rewrite`` + ``onnx_ir.convenience.replace_nodes_and_values``)
rather than by ``RewriteRuleSet.apply_to_model``, which would also run onnx_ir's
``NameFixPass`` (naming every unnamed value, i.e. turning left-out optional outputs into real
ones) and propagate constants through the whole graph.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import replace_nodes_and_values
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError
from onnxscript.rewriter import pattern

__all__ = [
    "CastLikePass",
    "CeluRule",
    "EluRule",
    "ExpandSumPass",
    "HardSigmoidRule",
    "HardSwishRule",
    "PReluRule",
    "RewriteActivationsPass",
    "SeluRule",
]

log = logging.getLogger(__name__)


def _constant(op, prefix: str, part: str, value: float, like: ir.Value) -> ir.Value:
    """A scalar ``Constant`` node named ``<prefix>/<part>`` of ``like``'s float type."""
    dtype = like.dtype if like.dtype is not None and like.dtype.is_floating_point() else None
    array = np.array(value, dtype=(dtype or ir.DataType.FLOAT).numpy())
    name = f"{prefix}/{part}"
    return op.Constant(value=ir.tensor(array, name=name), _name=name, _outputs=[name])


class HardSwishRule(pattern.RewriteRuleClassBase):
    """HardSwish(x) -> Div(Mul(x, Clip(Add(x, 3), 0, 6)), 6)."""

    def pattern(self, op, x):
        return op.HardSwish(x, _outputs=["y"])

    def rewrite(self, op, x: ir.Value, y: ir.Value):
        p = y.producer().name
        three = _constant(op, p, "three", 3.0, x)
        zero = _constant(op, p, "zero", 0.0, x)
        six = _constant(op, p, "six", 6.0, x)
        x3 = op.Add(x, three, _name=f"{p}/Add", _outputs=[f"{p}/x3"])
        relu6 = op.Clip(x3, zero, six, _name=f"{p}/Clip", _outputs=[f"{p}/relu6"])
        xr = op.Mul(x, relu6, _name=f"{p}/Mul", _outputs=[f"{p}/xr"])
        return op.Div(xr, six, _name=f"{p}/Div")


class HardSigmoidRule(pattern.RewriteRuleClassBase):
    """HardSigmoid(x; alpha, beta) -> Clip(Add(Mul(x, alpha), beta), 0, 1)."""

    def pattern(self, op, x):
        return op.HardSigmoid(x, _allow_other_attributes=True, _outputs=["y"])

    def rewrite(self, op, x: ir.Value, y: ir.Value):
        node = y.producer()
        p = node.name
        alpha = _constant(op, p, "alpha", node.attributes.get_float("alpha", 0.2), x)
        beta = _constant(op, p, "beta", node.attributes.get_float("beta", 0.5), x)
        zero = _constant(op, p, "zero", 0.0, x)
        one = _constant(op, p, "one", 1.0, x)
        ax = op.Mul(x, alpha, _name=f"{p}/Mul", _outputs=[f"{p}/ax"])
        axb = op.Add(ax, beta, _name=f"{p}/Add", _outputs=[f"{p}/axb"])
        return op.Clip(axb, zero, one, _name=f"{p}/Clip")


def _negative_part(op, p: str, x: ir.Value) -> ir.Value:
    """``min(x, 0)`` as ``-relu(-x)`` (Neg and Relu have gradients; Min's is not needed)."""
    neg = op.Neg(x, _name=f"{p}/Neg", _outputs=[f"{p}/neg_x"])
    relu_neg = op.Relu(neg, _name=f"{p}/ReluNeg", _outputs=[f"{p}/relu_neg_x"])
    return op.Neg(relu_neg, _name=f"{p}/NegRelu", _outputs=[f"{p}/min_x_0"])


def _elu(op, p: str, x: ir.Value, alpha: float, scale: float = 1.0, **output) -> ir.Value:
    """``relu(x) + alpha * (exp(min(x, 0) / scale) - 1)``: Elu (scale 1) and Celu (scale
    alpha); exact, since exp(0) - 1 = 0 where x >= 0. ``output``: the final Add's ``_outputs``
    when it is not the rewrite's own output."""
    m = _negative_part(op, p, x)
    if scale != 1.0:
        m = op.Div(m, _constant(op, p, "scale", scale, x), _name=f"{p}/Div", _outputs=[f"{p}/m"])
    e = op.Exp(m, _name=f"{p}/Exp", _outputs=[f"{p}/exp_m"])
    em1 = op.Sub(e, _constant(op, p, "one", 1.0, x), _name=f"{p}/Sub", _outputs=[f"{p}/expm1"])
    neg = op.Mul(em1, _constant(op, p, "alpha", alpha, x), _name=f"{p}/Mul", _outputs=[f"{p}/n"])
    pos = op.Relu(x, _name=f"{p}/Relu", _outputs=[f"{p}/relu_x"])
    return op.Add(pos, neg, _name=f"{p}/Add", **output)


class EluRule(pattern.RewriteRuleClassBase):
    """Elu(x; alpha) -> Add(Relu(x), Mul(Sub(Exp(-Relu(-x)), 1), alpha))."""

    def pattern(self, op, x):
        return op.Elu(x, _allow_other_attributes=True, _outputs=["y"])

    def rewrite(self, op, x: ir.Value, y: ir.Value):
        node = y.producer()
        p = node.name
        return _elu(op, p, x, node.attributes.get_float("alpha", 1.0))


class CeluRule(pattern.RewriteRuleClassBase):
    """Celu(x; alpha) -> Add(Relu(x), Mul(Sub(Exp(-Relu(-x) / alpha), 1), alpha))."""

    def pattern(self, op, x):
        return op.Celu(x, _allow_other_attributes=True, _outputs=["y"])

    def rewrite(self, op, x: ir.Value, y: ir.Value):
        node = y.producer()
        p = node.name
        alpha = node.attributes.get_float("alpha", 1.0)
        return _elu(op, p, x, alpha, scale=alpha)


class SeluRule(pattern.RewriteRuleClassBase):
    """Selu(x; alpha, gamma) -> Mul(Elu(x; alpha), gamma), Elu as in :class:`EluRule`."""

    def pattern(self, op, x):
        return op.Selu(x, _allow_other_attributes=True, _outputs=["y"])

    def rewrite(self, op, x: ir.Value, y: ir.Value):
        node = y.producer()
        p = node.name
        alpha = node.attributes.get_float("alpha", 1.67326319217681884765625)  # ONNX defaults
        gamma = node.attributes.get_float("gamma", 1.05070102214813232421875)
        elu = _elu(op, p, x, alpha, _outputs=[f"{p}/elu"])
        return op.Mul(elu, _constant(op, p, "gamma", gamma, x), _name=f"{p}/MulGamma")


class PReluRule(pattern.RewriteRuleClassBase):
    """PRelu(x, slope) -> Add(Relu(x), Mul(slope, -Relu(-x)))."""

    def pattern(self, op, x, slope):
        return op.PRelu(x, slope, _outputs=["y"])

    def rewrite(self, op, x: ir.Value, slope: ir.Value, y: ir.Value):
        p = y.producer().name
        pos = op.Relu(x, _name=f"{p}/Relu", _outputs=[f"{p}/relu_x"])
        neg = op.Mul(slope, _negative_part(op, p, x), _name=f"{p}/Mul", _outputs=[f"{p}/neg"])
        return op.Add(pos, neg, _name=f"{p}/Add")


def _remaining(model: ir.Model, op_types: tuple[str, ...]) -> list[str]:
    return [n.name for n in model.graph if n.domain == "" and n.op_type in op_types]


class RewriteActivationsPass(InPlacePass):
    """Rewrite HardSwish, HardSigmoid, Elu, Selu, Celu and PRelu into ops with gradients
    (Add/Sub/Mul/Div/Clip/Relu/Neg/Exp with Constant nodes; onnxscript rewrite rules)."""

    OP_TYPES = ("HardSwish", "HardSigmoid", "Elu", "Selu", "Celu", "PRelu")

    def __init__(self, source: str = "model"):
        super().__init__()
        self.source = source
        self.rules = tuple(
            rule.rule()
            for rule in (HardSwishRule, HardSigmoidRule, EluRule, SeluRule, CeluRule, PReluRule)
        )

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        count = 0
        for node in list(graph):
            if node.domain != "" or node.op_type not in self.OP_TYPES:
                continue
            for rule in self.rules:
                delta = rule.try_rewrite(model, graph, node)
                if delta is None:
                    continue
                replace_nodes_and_values(
                    graph,
                    node,
                    delta.match.nodes,
                    delta.new_nodes,
                    delta.match.outputs,
                    delta.new_outputs,
                )
                log.info(
                    "%s: rewrote %s node %r into ops with gradients",
                    self.source,
                    node.op_type,
                    node.name,
                )
                count += 1
                break
        return PassResult(model, modified=count > 0)

    def ensures(self, model: ir.Model) -> None:
        left = _remaining(model, self.OP_TYPES)
        if left:
            raise PostconditionError(f"nodes not rewritten: {left[:5]}")


class ExpandSumPass(InPlacePass):
    """Rewrite variadic Sum into a chain of Add (Identity for a single input)."""

    def __init__(self, source: str = "model"):
        super().__init__()
        self.source = source

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.domain != "" or node.op_type != "Sum":
                continue
            p, terms = node.name, list(node.inputs)
            if len(terms) == 1:
                new_nodes = [ir.Node("", "Identity", terms, name=f"{p}/Identity")]
            else:
                new_nodes, acc = [], terms[0]
                for i, term in enumerate(terms[1:], start=1):
                    out = ir.Value(name=f"{p}/partial_{i}")
                    new_nodes.append(
                        ir.Node("", "Add", [acc, term], outputs=[out], name=f"{p}/Add_{i}")
                    )
                    acc = out
            # the last new output takes the Sum's output name, uses and graph-output slot
            replace_nodes_and_values(
                graph, node, [node], new_nodes, node.outputs[:1], new_nodes[-1].outputs
            )
            log.info("%s: rewrote Sum node %r into ops with gradients", self.source, p)
            modified = True
        return PassResult(model, modified=modified)

    def ensures(self, model: ir.Model) -> None:
        left = _remaining(model, ("Sum",))
        if left:
            raise PostconditionError(f"nodes not rewritten: {left[:5]}")


class CastLikePass(InPlacePass):
    """Rewrite ``CastLike(x, like)`` into ``Cast(x, to=<like's element type>)`` where that type
    is known (ORT 1.19.2 has no gradient builder for CastLike; the two are the same op once the
    type is fixed)."""

    def __init__(self, source: str = "model"):
        super().__init__()
        self.source = source

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        count = 0
        for node in list(graph):
            if node.domain != "" or node.op_type != "CastLike" or len(node.inputs) < 2:
                continue
            like = node.inputs[1]
            if like is None or like.dtype is None:
                continue
            cast = ir.Node(
                "",
                "Cast",
                [node.inputs[0]],
                attributes=[ir.AttrInt64("to", int(like.dtype))],
                name=f"{node.name}/Cast",
            )
            replace_nodes_and_values(graph, node, [node], [cast], node.outputs, cast.outputs)
            count += 1
        if count:
            log.info("%s: rewrote %d CastLike nodes into Cast", self.source, count)
        return PassResult(model, modified=count > 0)
