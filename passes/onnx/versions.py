"""IR version and opset: what onnxruntime-training 1.19.2 reads (IR <= 10, opset <= 21).

Two passes: :class:`ConvertOpsetPass` (onnx's version converter, for models exported with a
newer default-domain opset) and :class:`LowerIrVersionPass`. onnx >= 1.18 would write IR 11,
which ORT 1.19.2 refuses ("Unsupported model IR version"); the opsets of IR 11 (22+) are
converted down first, so lowering the IR version number is then all that is left to do.
"""

from __future__ import annotations

import logging

import onnx_ir as ir
from onnx import version_converter
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from etgraph.errors import ModelError, first_line

log = logging.getLogger(__name__)

__all__ = ["MAX_IR_VERSION", "MAX_OPSET", "ConvertOpsetPass", "LowerIrVersionPass"]

#: Highest IR version onnxruntime(-training) 1.19.2 loads.
MAX_IR_VERSION = 10
#: Highest default-domain opset onnxruntime(-training) 1.19.2 implements.
MAX_OPSET = 21


def default_opset(model: ir.Model) -> int:
    """The model's default-domain (``""``/``ai.onnx``) opset version, 0 when it imports none."""
    return model.opset_imports.get("", 0)


class ConvertOpsetPass(InPlacePass):
    """Convert a default-domain opset above 21 down to 21 (onnx's version converter).

    Raises (from ``call``):
        ModelError: the converter fails (an op it cannot convert, an opset it does not know);
            the message names ``source``, the opset and the converter's first line.
    """

    def __init__(self, source: str = "model", max_opset: int = MAX_OPSET):
        super().__init__()
        self.source = source
        self.max_opset = max_opset

    def call(self, model: ir.Model) -> PassResult:
        opset = default_opset(model)
        if opset <= self.max_opset:
            return PassResult(model, modified=False)
        try:
            converted = version_converter.convert_version(ir.to_proto(model), self.max_opset)
        except Exception as exc:  # onnx raises RuntimeError, ConvertError, InferenceError
            raise ModelError(
                f"{self.source}: opset {opset} is newer than onnxruntime-training 1.19.2 "
                f"supports ({self.max_opset}) and conversion failed ({first_line(exc)}); "
                "re-export with opset <= 17"
            ) from exc
        # in place, as onnxscript's ConvertVersionPass does: the model takes the new graph
        model.graph = ir.from_proto(converted).graph
        log.info("%s: converted opset %d to %d", self.source, opset, self.max_opset)
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        if default_opset(model) > self.max_opset:
            raise PostconditionError(
                f"default opset {default_opset(model)} is still above {self.max_opset}"
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
