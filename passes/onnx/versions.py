"""IR version and opset: what onnxruntime-training 1.19.2 reads (IR <= 10, opset <= 21).

Two passes: :class:`ConvertOpsetPass` (onnx's version converter: a default-domain opset newer
than 21 is converted down to 21; one older than 14 up to 17, the opset etgraph's own exports
use: ORT's training loss SoftmaxCrossEntropyLoss exists from opset 12, BatchNormalization's
training form — ``training_mode`` with running mean/var outputs, what
:class:`passes.onnx.TrainableBatchNormPass` makes of an inference BatchNormalization — from 14;
paddle2onnx writes opset 13) and
:class:`LowerIrVersionPass`. onnx >= 1.18 would write IR 11,
which ORT 1.19.2 refuses ("Unsupported model IR version"); the opsets of IR 11 (22+) are
converted down first, so lowering the IR version number is then all that is left to do.
"""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir
from onnx import helper, version_converter
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from etgraph.errors import ModelError, first_line
from etgraph.ops import is_default_domain

log = logging.getLogger(__name__)

__all__ = [
    "MAX_IR_VERSION",
    "MAX_OPSET",
    "MIN_OPSET",
    "UPGRADE_OPSET",
    "ConvertOpsetPass",
    "LowerIrVersionPass",
]

#: Highest IR version onnxruntime(-training) 1.19.2 loads.
MAX_IR_VERSION = 10
#: Highest default-domain opset onnxruntime(-training) 1.19.2 implements.
MAX_OPSET = 21
#: Oldest default-domain opset trained as it is: SoftmaxCrossEntropyLoss, the loss ORT's
#: generate_artifacts adds, exists from opset 12 on; BatchNormalization's training form from 14.
MIN_OPSET = 14
#: The opset older models are converted to (what etgraph's torch exports use).
UPGRADE_OPSET = 17


def default_opset(model: ir.Model) -> int:
    """The model's default-domain (``""``/``ai.onnx``) opset version, 0 when it imports none."""
    return model.opset_imports.get("", 0)


def _drop_saved_batch_statistics(graph: onnx.GraphProto) -> None:
    """Drop the unused ``saved_mean`` / ``saved_var`` outputs (4th and 5th) of opset < 14
    BatchNormalization nodes: a torch TRAINING export names them, nothing reads them, and onnx's
    13 -> 14 adapter refuses any node that has them (opset 14 removed them)."""
    read = {v for node in graph.node for v in node.input} | {o.name for o in graph.output}
    for node in graph.node:
        if node.op_type != "BatchNormalization" or not is_default_domain(node):
            continue
        while len(node.output) > 3 and node.output[-1] not in read:
            node.output.pop()


class ConvertOpsetPass(InPlacePass):
    """Convert a default-domain opset above 21 down to 21, or below 14 up to 17 (onnx's version
    converter; the IR version is raised to what the new opset needs).

    Raises (from ``call``):
        ModelError: the converter fails (an op it cannot convert, an opset it does not know);
            the message names ``source``, the opset and the converter's first line.
    """

    def __init__(
        self,
        source: str = "model",
        max_opset: int = MAX_OPSET,
        min_opset: int = MIN_OPSET,
        upgrade_opset: int = UPGRADE_OPSET,
    ):
        super().__init__()
        self.source = source
        self.max_opset = max_opset
        self.min_opset = min_opset
        self.upgrade_opset = upgrade_opset

    def call(self, model: ir.Model) -> PassResult:
        opset = default_opset(model)
        if self.min_opset <= opset <= self.max_opset or opset == 0:
            return PassResult(model, modified=False)
        target = self.max_opset if opset > self.max_opset else self.upgrade_opset
        proto = ir.to_proto(model)
        if opset < 14 <= target:
            _drop_saved_batch_statistics(proto.graph)
        try:
            converted = version_converter.convert_version(proto, target)
        except Exception as exc:  # onnx raises RuntimeError, ConvertError, InferenceError
            newer = opset > self.max_opset
            raise ModelError(
                f"{self.source}: opset {opset} is {'newer' if newer else 'older'} than "
                f"onnxruntime-training 1.19.2 trains ({self.min_opset}-{self.max_opset}) and "
                f"conversion to {target} failed ({first_line(exc)}); re-export with opset 17"
            ) from exc
        # in place, as onnxscript's ConvertVersionPass does: the model takes the new graph
        model.graph = ir.from_proto(converted).graph
        needed = helper.find_min_ir_version_for([helper.make_opsetid("", target)])
        model.ir_version = max(model.ir_version, needed)
        log.info("%s: converted opset %d to %d", self.source, opset, target)
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        opset = default_opset(model)
        if opset and not self.min_opset <= opset <= self.max_opset:
            raise PostconditionError(
                f"default opset {opset} is outside {self.min_opset}-{self.max_opset}"
            )


class LowerIrVersionPass(InPlacePass):
    """Lower the IR version to 10 (ORT 1.19.2 refuses newer ones; IR 11 adds nothing needed)."""

    def __init__(self, source: str = "model", max_ir_version: int = MAX_IR_VERSION):
        super().__init__()
        self.source = source
        self.max_ir_version = max_ir_version

    def call(self, model: ir.Model) -> PassResult:
        if model.ir_version <= self.max_ir_version:
            return PassResult(model, modified=False)
        log.info(
            "%s: IR version %d lowered to %d", self.source, model.ir_version, self.max_ir_version
        )
        model.ir_version = self.max_ir_version
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        if model.ir_version > self.max_ir_version:
            raise PostconditionError(f"IR version {model.ir_version} > {self.max_ir_version}")
