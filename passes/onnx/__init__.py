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
7. :class:`DropOutputNoOpsPass` — ops that change nothing at the end of the output (Identity,
   a Cast to its own type, a reshape keeping ``[B, K]``) taken off, so a head before them is
   seen;
8. :class:`RemoveSoftmaxHeadPass` — a trailing Softmax/LogSoftmax taken off (the loss needs
   logits), recorded in the metadata and restored on export (:class:`RestoreHeadPass`);
9. :class:`DropOutputNoOpsPass` again, for no-ops before the head (paddle2onnx's Identity), so
   a legalised model legalises to itself;
10. :class:`FlattenClassOutputPass` — an output ``[B, K, 1, 1]`` (1x1-conv classifiers) flattened
   to ``[B, K]``, recorded and restored likewise;
11. :class:`FreeBatchDimPass` — a batch dimension fixed at export becomes symbolic;
12. :class:`NameNodesPass` — every node a unique non-empty name;
13. :class:`AddOptionalOutputsPass` — LayerNormalization Mean/InvStdDev, Dropout mask;
14. :class:`TrainableBatchNormPass` — inference BatchNormalization in training mode, with its
    running mean/var outputs;
15. :class:`IsolateInputNormPass` — a graph input read by a normalisation layer and other
    nodes reaches the normalisation layer through an Identity (ORT's BatchNormalizationGrad
    would define ``<input>_grad`` twice);
16. :class:`RewriteActivationsPass` — HardSwish, HardSigmoid, Elu, Selu, Celu, PRelu -> ops
    with gradients (Add/Sub/Mul/Div/Clip/Relu/Neg/Exp);
17. :class:`RewriteAveragePoolPass` — AveragePool -> depthwise Conv with a constant kernel
    (ORT's AveragePoolGrad fails at a symbolic batch);
18. :class:`RewriteLrnPass` — LRN -> Mul, channel-window Conv, Add, Pow, Div;
19. :class:`RewriteGlobalMaxPass` — GlobalMaxPool, spatial ReduceMax -> MaxPool over the whole
    spatial window;
20. :class:`RewriteNearestResizePass` — nearest Resize/Upsample by integer scales -> Reshape,
    Expand, Reshape;
21. :class:`ExpandSumPass` — variadic Sum -> chain of Add;
22. :class:`CastLikePass` — CastLike -> Cast to the type it takes from its second input;
23. :class:`RefuseNoGradOpsPass` — any other op without a gradient on the data path refused;
24. with ``--head-lr-scale S`` (issue #30): :class:`ScaleHeadLrPass` — the head layer's kernel
    and bias stored divided by ``S``, its output multiplied by ``S`` (the head trains at ``S``
    times the learning rate), recorded in the metadata and folded back on export
    (:class:`FoldHeadLrScalePass`).

:func:`eval_model_pipeline` fixes the eval model ORT generates (:class:`TrimEvalBatchNormPass`);
:func:`training_model_pipeline` removes work ORT's training graph keeps needlessly
(:class:`DropUnusedOptionalOutputsPass`: e.g. a frozen MaxPool's Indices).

:class:`InferenceBatchNormPass` is applied per selection by :mod:`etgraph.artifacts`
(``--frozen-bn inference``): the batch norms whose gamma and beta are both unselected
(:func:`frozen_batch_norms`) run as their inference affine map.

:class:`BakeFrozenParamsPass` is applied per session (:func:`etgraph.artifact_weights.bake_frozen`):
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
from .head import (
    HEAD_KEY,
    DropOutputNoOpsPass,
    FlattenClassOutputPass,
    RemoveSoftmaxHeadPass,
    RestoreHeadPass,
)
from .head_lr import (
    HEAD_LR_KEY,
    FoldHeadLrScalePass,
    HeadLrScale,
    ScaleHeadLrPass,
    check_head_lr_scale,
    head_lr_of,
)
from .input_norm import IsolateInputNormPass
from .io_names import OUTPUTS_KEY, SOURCE_KEY, SelectOutputPass, unzip_map_outputs
from .node_names import NameNodesPass
from .optional_outputs import AddOptionalOutputsPass
from .refuse_no_grad_ops import RefuseNoGradOpsPass
from .rewrite_no_grad_ops import CastLikePass, ExpandSumPass, RewriteActivationsPass
from .rewrite_windows import (
    RewriteAveragePoolPass,
    RewriteGlobalMaxPass,
    RewriteLrnPass,
    RewriteNearestResizePass,
)
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
    "CastLikePass",
    "ConvertOpsetPass",
    "DropOutputNoOpsPass",
    "DropUnusedOptionalOutputsPass",
    "HEAD_KEY",
    "HEAD_LR_KEY",
    "FoldHeadLrScalePass",
    "HeadLrScale",
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
    "ScaleHeadLrPass",
    "RewriteGlobalMaxPass",
    "RewriteActivationsPass",
    "RewriteLrnPass",
    "RewriteNearestResizePass",
    "SelectOutputPass",
    "TrainableBatchNormPass",
    "TrimEvalBatchNormPass",
    "UntieSharedWeightsPass",
    "bake_into",
    "bakeable_params",
    "check_head_lr_scale",
    "eval_model_pipeline",
    "frozen_batch_norms",
    "head_lr_of",
    "legalization_pipeline",
    "training_model_pipeline",
    "unzip_map_outputs",
]


def legalization_pipeline(
    source: str = "model", output: str | None = None, head_lr_scale: float | None = None
) -> PassManager:
    """The legalisation passes in order, as one ``PassManager`` run once.

    Args:
        source: what the model is called in user errors (its file path).
        output: the graph output to train on (None: the model's only output).
        head_lr_scale: the head's learning-rate factor ``S`` (:class:`ScaleHeadLrPass`, last);
            None: the model's own (a compiled model records it; others have none).
    """
    scale = [] if head_lr_scale is None else [ScaleHeadLrPass(head_lr_scale)]
    return PassManager(
        [
            ConvertOpsetPass(source),
            LowerIrVersionPass(source),
            RemoveInitializersFromInputsPass(),
            MaterializeWeightsPass(),
            UntieSharedWeightsPass(),
            SelectOutputPass(source, output),
            DropOutputNoOpsPass(),
            RemoveSoftmaxHeadPass(),
            DropOutputNoOpsPass(),  # those before the head (paddle2onnx: Identity -> Softmax)
            FlattenClassOutputPass(),
            FreeBatchDimPass(),
            NameNodesPass(),
            AddOptionalOutputsPass(),
            TrainableBatchNormPass(),
            IsolateInputNormPass(),
            RewriteActivationsPass(source),
            RewriteAveragePoolPass(source),
            RewriteLrnPass(source),
            RewriteGlobalMaxPass(source),
            RewriteNearestResizePass(source),
            ExpandSumPass(source),
            CastLikePass(source),
            RefuseNoGradOpsPass(source),
            *scale,
        ],
        steps=1,
    )


def eval_model_pipeline() -> PassManager:
    """The passes applied to ``eval_model.onnx`` after ``generate_artifacts``."""
    return PassManager([TrimEvalBatchNormPass()], steps=1)


def training_model_pipeline() -> PassManager:
    """The passes applied to ``training_model.onnx`` after ``generate_artifacts``."""
    return PassManager([DropUnusedOptionalOutputsPass()], steps=1)
