"""Inference BatchNormalization becomes a trainable batch norm (issue #14).

An inference export (model zoos, tf2onnx, paddle2onnx, torch in EVAL mode without folding) has
BatchNormalization with ``training_mode=0`` and one output; ORT's gradient graph of it is not
the training batch norm etgraph profiles and carries (light_resnet50's first training step
failed inside ORT with it). The pass gives such a node what a torch TRAINING export has:
``training_mode=1`` and the running mean/var outputs, so the running statistics are inputs ORT
updates in training (frozen parameters, carried like today's) and the eval model's fix-up
(:class:`passes.onnx.TrimEvalBatchNormPass`) applies as usual.

**Frozen batch norm** (``--frozen-bn inference``, issue #14): :class:`InferenceBatchNormPass`
puts named batch norms into inference mode in the training graph of one selection, as Keras does
for a BN layer with ``trainable=False``. ORT 1.19.2 cannot do this with the op itself: its
training graph turns every BatchNormalization into ``BatchNormInternal`` in training mode,
whatever ``training_mode`` says (observed: running statistics of ``training_mode=0`` nodes moved
after one step). So the node is written out as the per-channel affine map inference BN computes,
``y = x * scale + shift`` with ``scale = gamma / sqrt(var + eps)`` and
``shift = beta - mean * scale`` (computed in the graph from the four frozen initializers, so the
checkpoint keeps them and the running statistics never move); its backward is one ``Mul`` of
``dy`` by ``scale``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError, PreconditionError
from onnx_ir.passes.common import ShapeInferencePass

from .optional_outputs import NamedOutputsPass, name_outputs, value_names

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_FROZEN_BN",
    "FROZEN_BN_MODES",
    "InferenceBatchNormPass",
    "TrainableBatchNormPass",
    "frozen_batch_norms",
]

#: How a batch norm whose gamma and beta are both unselected runs in a selection's training
#: graph: ``inference`` (running statistics used and kept, Keras' ``trainable=False``) or
#: ``train`` (batch statistics, running statistics updated, as every BN before issue #14).
FROZEN_BN_MODES = ("inference", "train")
#: The default, chosen by measurement (benchmarks/frozen_bn.py, docs/results.md).
DEFAULT_FROZEN_BN = "inference"

_STATS = ("running_mean", "running_var")


def _inference_bn(node: ir.Node) -> bool:
    if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
        return False
    if len(node.inputs) < 5 or not all(v is not None for v in node.inputs[3:5]):
        return False
    training = node.attributes.get_int("training_mode", 0)
    return not training or len(node.outputs) < 3 or not all(v.name for v in node.outputs[1:3])


class TrainableBatchNormPass(NamedOutputsPass):
    """Give inference BatchNormalization `training_mode=1` and its running mean/var outputs,
    named `<node>/running_mean`, `<node>/running_var` (as a torch TRAINING export has)."""

    def call(self, model: ir.Model) -> PassResult:
        taken = value_names(model.graph)
        changed = 0
        for node in model.graph:
            if not _inference_bn(node):
                continue
            node.attributes["training_mode"] = ir.AttrInt64("training_mode", 1)
            name_outputs(node, _STATS, taken)
            changed += 1
        if changed:
            log.info("%d inference BatchNormalization nodes made trainable", changed)
        return PassResult(model, modified=changed > 0)

    def ensures(self, model: ir.Model) -> None:
        left = [node.name for node in model.graph if _inference_bn(node)]
        if left:
            raise PostconditionError(f"BatchNormalization still in inference mode: {left[:3]}")


def _training_bn(node: ir.Node) -> bool:
    return (
        node.op_type == "BatchNormalization"
        and node.domain in ("", "ai.onnx")
        and len(node.inputs) >= 5
        and all(v is not None for v in node.inputs[:5])
    )


def frozen_batch_norms(model: ir.Model, requires_grad: Collection[str]) -> list[str]:
    """Names of the BatchNormalization nodes of ``model`` whose gamma, beta, running mean and
    running var are initializers and whose gamma and beta are both not in ``requires_grad``
    (those :class:`InferenceBatchNormPass` may put in inference mode), in graph order."""
    selected = set(requires_grad)
    inits = model.graph.initializers
    names = []
    for node in model.graph:
        if not _training_bn(node):
            continue
        params = [v.name for v in node.inputs[1:5]]
        if all(p in inits for p in params) and not selected & set(params[:2]):
            names.append(node.name)
    return names


class InferenceBatchNormPass(InPlacePass):
    """Write the named BatchNormalization nodes as inference batch norm: ``y = x * scale +
    shift`` over the channel axis (axis 1), with ``scale = gamma / sqrt(var + eps)`` and
    ``shift = beta - mean * scale`` computed by nodes named ``<bn>/inference/<Op>`` from the
    node's four initializers. Their training outputs (running mean/var) must be unused. A node
    whose input rank shape inference cannot tell stays in training mode (a warning; listed in
    ``skipped``).

    Args:
        nodes: names of the BatchNormalization nodes to rewrite (see
            :func:`frozen_batch_norms`); a name not in the graph is a precondition failure.
    """

    def __init__(self, nodes: Collection[str]):
        super().__init__()
        self.nodes = frozenset(nodes)
        self.skipped: list[str] = []  # nodes left in training mode (input rank unknown)

    def requires(self, model: ir.Model) -> None:
        found = {node.name: node for node in model.graph if _training_bn(node)}
        missing = sorted(self.nodes - set(found))
        if missing:
            raise PreconditionError(f"no BatchNormalization nodes named {missing[:3]}")
        for name in self.nodes:
            used = [v.name for v in found[name].outputs[1:] if v.uses() or v.is_graph_output()]
            if used:
                raise PreconditionError(f"BatchNormalization {name!r} outputs {used} are used")

    def call(self, model: ir.Model) -> PassResult:
        if not self.nodes:
            return PassResult(model, modified=False)
        graph = model.graph
        todo = [node for node in graph if node.name in self.nodes]
        if any(node.inputs[0].shape is None for node in todo):
            ShapeInferencePass(data_prop=False)(model)  # rank only (onnx's data
            # propagation reads a Reshape shape [0, K] built by Concat as a literal 0)
        self.skipped = [node.name for node in todo if node.inputs[0].shape is None]
        if self.skipped:  # no rank to broadcast over: the layer keeps training mode
            log.warning(
                "rank of the input of %d BatchNormalization nodes unknown (%s): they stay in "
                "training mode",
                len(self.skipped),
                self.skipped[0],
            )
        for node in todo:
            if node.name not in self.skipped:
                _rewrite(graph, node)
        log.info("%d BatchNormalization nodes in inference mode", len(todo) - len(self.skipped))
        return PassResult(model, modified=len(todo) > len(self.skipped))

    def ensures(self, model: ir.Model) -> None:
        left = [n.name for n in model.graph if n.name in self.nodes and n.name not in self.skipped]
        if left:
            raise PostconditionError(f"BatchNormalization still in the graph: {left[:3]}")


def _rewrite(graph: ir.Graph, bn: ir.Node) -> None:
    """Replace ``bn`` by the affine nodes of inference batch norm (before ``bn`` in order)."""
    x, gamma, beta, mean, var = bn.inputs[:5]
    rank = len(x.shape)
    channels = graph.initializers[gamma.name].const_value.shape[0]
    dtype = graph.initializers[gamma.name].const_value.dtype.numpy()
    eps = bn.attributes.get_float("epsilon", 1e-5)
    prefix = f"{bn.name}/inference"
    new: list[ir.Node] = []

    def op(op_type: str, *inputs: ir.Value, **attributes) -> ir.Value:
        node = ir.node(op_type, list(inputs), attributes=attributes, name=f"{prefix}/{op_type}")
        node.outputs[0].name = f"{prefix}/{op_type}_{len(new)}"
        new.append(node)
        return node.outputs[0]

    def const(array: np.ndarray) -> ir.Value:
        return op("Constant", value=ir.tensor(array))

    scale = op("Div", gamma, op("Sqrt", op("Add", var, const(np.array(eps, dtype=dtype)))))
    shift = op("Sub", beta, op("Mul", mean, scale))
    if rank > 2:  # [C] -> [C, 1, ..., 1] to broadcast over [N, C, D1, ...]
        shape = const(np.array([channels] + [1] * (rank - 2), dtype=np.int64))
        scale, shift = op("Reshape", scale, shape), op("Reshape", shift, shape)
    y = op("Add", op("Mul", x, scale), shift)
    for i, node in enumerate(new):  # unique node names: ``<bn>/inference/<Op>_<i>``
        node.name = f"{node.name}_{i}"
    graph.insert_before(bn, new)
    y.shape, y.type = bn.outputs[0].shape, bn.outputs[0].type
    ir.convenience.replace_all_uses_with(bn.outputs[0], y)
    for i, out in enumerate(graph.outputs):
        if out is bn.outputs[0]:
            graph.outputs[i] = y
    name = bn.outputs[0].name
    graph.remove(bn, safe=True)
    y.name = name  # keep the value name the rest of the model (and its dumps) know
