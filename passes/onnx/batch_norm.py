"""Inference BatchNormalization becomes a trainable batch norm (issue #14).

An inference export (model zoos, tf2onnx, paddle2onnx, torch in EVAL mode without folding) has
BatchNormalization with ``training_mode=0`` and one output; ORT's gradient graph of it is not
the training batch norm etgraph profiles and carries (light_resnet50's first training step
failed inside ORT with it). The pass gives such a node what a torch TRAINING export has:
``training_mode=1`` and the running mean/var outputs, so the running statistics are inputs ORT
updates in training (frozen parameters, carried like today's) and the eval model's fix-up
(:class:`passes.onnx.TrimEvalBatchNormPass`) applies as usual.

Left for issue #14's ``--frozen-bn``: a layer that is never selected still updates its running
statistics in training mode, as every batch norm of etgraph's own exports does today.
"""

from __future__ import annotations

import logging

import onnx_ir as ir
from onnx_ir.passes import PassResult, PostconditionError

from .optional_outputs import NamedOutputsPass, name_outputs, value_names

log = logging.getLogger(__name__)

__all__ = ["TrainableBatchNormPass"]

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
