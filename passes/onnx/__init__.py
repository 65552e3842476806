"""ONNX-level legalisation: passes over an ``onnx_ir.Model`` that make a user's model trainable
by onnxruntime-training 1.19.2 (README: "Your own model").

:func:`legalization_pipeline` lists them in order (print it with
:func:`passes.base.describe_pipeline`):

1. :class:`ConvertOpsetPass` — default-domain opset > 21 converted to 21, < 14 to 17;
2. :class:`LowerIrVersionPass` — IR version <= 10;
3. onnx_ir's ``RemoveInitializersFromInputsPass`` — initializers listed as graph inputs (IR < 4
   exports) are initializers only;
4. :class:`MaterializeWeightsPass` — float weights held in Constant/ConstantOfShape nodes become
   initializers;
5. :class:`UntieSharedWeightsPass` — an initializer several layers read (exporters deduplicate
   identical folded biases) is copied per layer: one tensor, one layer;
6. :class:`SelectOutputPass` — the output trained on (the only one, or ``--output NAME``); the
   others dropped; input and output names kept;
7. :class:`RemoveSoftmaxHeadPass` — a trailing Softmax/LogSoftmax taken off (the loss needs
   logits), recorded in the metadata and restored on export (:class:`RestoreHeadPass`);
8. :class:`FlattenClassOutputPass` — an output ``[B, K, 1, 1]`` (1x1-conv classifiers) flattened
   to ``[B, K]``, recorded and restored likewise;
9. :class:`FreeBatchDimPass` — a batch dimension fixed at export becomes symbolic;
10. :class:`NameNodesPass` — every node a unique non-empty name;
11. :class:`AddOptionalOutputsPass` — LayerNormalization Mean/InvStdDev, Dropout mask;
12. :class:`TrainableBatchNormPass` — inference BatchNormalization in training mode, with its
    running mean/var outputs;
13. :class:`IsolateInputNormPass` — a graph input read by a normalisation layer and other
    nodes reaches the normalisation layer through an Identity (ORT's BatchNormalizationGrad
    would define ``<input>_grad`` twice);
14. :class:`RewriteActivationsPass` — HardSwish, HardSigmoid, Elu, Selu, Celu, PRelu -> ops
    with gradients (Add/Sub/Mul/Div/Clip/Relu/Neg/Exp);
15. :class:`RewriteAveragePoolPass` — AveragePool -> depthwise Conv with a constant kernel
    (ORT's AveragePoolGrad fails at a symbolic batch);
16. :class:`RewriteLrnPass` — LRN -> Mul, channel-window Conv, Add, Pow, Div;
17. :class:`ExpandSumPass` — variadic Sum -> chain of Add;
18. :class:`RefuseNoGradOpsPass` — any other op without a gradient on the data path refused.

:func:`eval_model_pipeline` fixes the eval model ORT generates (:class:`TrimEvalBatchNormPass`);
:func:`training_model_pipeline` removes work ORT's training graph keeps needlessly
(:class:`DropUnusedOptionalOutputsPass`: e.g. a frozen MaxPool's Indices).

:class:`InferenceBatchNormPass` is applied per selection by :mod:`etgraph.artifacts`
(``--frozen-bn inference``): the batch norms whose gamma and beta are both unselected
(:func:`frozen_batch_norms`) run as their inference affine map.

:class:`BakeFrozenParamsPass` is applied per session (:func:`etgraph.artifacts.bake_frozen`):
the frozen parameters of a training and eval graph (:func:`bakeable_params`) become constants
valued from the checkpoint the session starts from, so ORT optimises the frozen part as at
inference.

Every pass follows onnx_ir's contract (:mod:`passes.base`); user errors (ModelError,
UnsupportedOpError) are raised from ``call`` and reach the caller as themselves through
:func:`passes.base.run_passes`.
"""

from __future__ import annotations

from onnx_ir.passes import PassManager
from onnx_ir.passes.common import RemoveInitializersFromInputsPass

from .bake import BakeFrozenParamsPass, bake_into, bakeable_params
from .batch_dim import FreeBatchDimPass
from .batch_norm import (
    DEFAULT_FROZEN_BN,
    FROZEN_BN_MODES,
    InferenceBatchNormPass,
    TrainableBatchNormPass,
    frozen_batch_norms,
)
from .eval_model import TrimEvalBatchNormPass
from .head import HEAD_KEY, FlattenClassOutputPass, RemoveSoftmaxHeadPass, RestoreHeadPass
from .input_norm import IsolateInputNormPass
from .io_names import OUTPUTS_KEY, SOURCE_KEY, SelectOutputPass
from .node_names import NameNodesPass
from .optional_outputs import AddOptionalOutputsPass
from .refuse_no_grad_ops import RefuseNoGradOpsPass
from .rewrite_no_grad_ops import ExpandSumPass, RewriteActivationsPass
from .rewrite_windows import RewriteAveragePoolPass, RewriteLrnPass
from .training_model import DropUnusedOptionalOutputsPass
from .versions import MAX_IR_VERSION, MAX_OPSET, ConvertOpsetPass, LowerIrVersionPass
from .weights import MaterializeWeightsPass, UntieSharedWeightsPass

__all__ = [
    "MAX_IR_VERSION",
    "MAX_OPSET",
    "OUTPUTS_KEY",
    "SOURCE_KEY",
    "DEFAULT_FROZEN_BN",
    "FROZEN_BN_MODES",
    "AddOptionalOutputsPass",
    "BakeFrozenParamsPass",
    "ConvertOpsetPass",
    "DropUnusedOptionalOutputsPass",
    "HEAD_KEY",
    "ExpandSumPass",
    "FlattenClassOutputPass",
    "FreeBatchDimPass",
    "InferenceBatchNormPass",
    "IsolateInputNormPass",
    "LowerIrVersionPass",
    "MaterializeWeightsPass",
    "NameNodesPass",
    "RefuseNoGradOpsPass",
    "RemoveSoftmaxHeadPass",
    "RestoreHeadPass",
    "RewriteAveragePoolPass",
    "RewriteActivationsPass",
    "RewriteLrnPass",
    "SelectOutputPass",
    "TrainableBatchNormPass",
    "TrimEvalBatchNormPass",
    "UntieSharedWeightsPass",
    "bake_into",
    "bakeable_params",
    "eval_model_pipeline",
    "frozen_batch_norms",
    "legalization_pipeline",
    "training_model_pipeline",
]


def legalization_pipeline(source: str = "model", output: str | None = None) -> PassManager:
    """The legalisation passes in order, as one ``PassManager`` run once.

    Args:
        source: what the model is called in user errors (its file path).
        output: the graph output to train on (None: the model's only output).
    """
    return PassManager(
        [
            ConvertOpsetPass(source),
            LowerIrVersionPass(source),
            RemoveInitializersFromInputsPass(),
            MaterializeWeightsPass(),
            UntieSharedWeightsPass(),
            SelectOutputPass(source, output),
            RemoveSoftmaxHeadPass(),
            FlattenClassOutputPass(),
            FreeBatchDimPass(),
            NameNodesPass(),
            AddOptionalOutputsPass(),
            TrainableBatchNormPass(),
            IsolateInputNormPass(),
            RewriteActivationsPass(source),
            RewriteAveragePoolPass(source),
            RewriteLrnPass(source),
            ExpandSumPass(source),
            RefuseNoGradOpsPass(source),
        ],
        steps=1,
    )


def eval_model_pipeline() -> PassManager:
    """The passes applied to ``eval_model.onnx`` after ``generate_artifacts``."""
    return PassManager([TrimEvalBatchNormPass()], steps=1)


def training_model_pipeline() -> PassManager:
    """The passes applied to ``training_model.onnx`` after ``generate_artifacts``."""
    return PassManager([DropUnusedOptionalOutputsPass()], steps=1)
