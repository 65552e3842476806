"""The op registry: what etgraph knows about each ONNX op type, in one table.

For every op type, :data:`OP_RULES` says

* how its backward work is charged (``family``, ``weight_slots``, ``fused_grad``, ``norm_grad``;
  the charging passes in :mod:`passes` read nothing else), which inputs carry no gradient
  (``nondiff_slots``) and where running statistics sit (``stat_slots``);
* whether onnxruntime-training 1.19.2 can differentiate it (``gradient``): ``True``;
  ``"rewrite"`` — no gradient builder, but the legalisation pipeline rewrites it into ops that
  have one (:mod:`passes.onnx.rewrite_no_grad_ops`); or ``False`` — refused on the data path with
  ``fix`` in the one-line error.

Unknown op types get :data:`DEFAULT_RULE`: a non-trainable layer (paper §5.3) whose inputs all
carry a gradient, differentiable by ORT. Lookups are by op type, never by node or layer names.

:func:`data_path_values` (which values of an ONNX graph can carry a gradient) is the one
registry-driven analysis of an ONNX graph; the importer and the legalisation passes share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import onnx

__all__ = [
    "DEFAULT_RULE",
    "FLOAT_TYPES",
    "OP_RULES",
    "OpRule",
    "data_path_values",
    "is_default_domain",
    "node_reads",
    "no_gradient_ops",
    "op_rule",
]

#: ONNX tensor element types that hold trainable weights.
FLOAT_TYPES = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.BFLOAT16,
    }
)


@dataclass(frozen=True)
class OpRule:
    """What etgraph knows about one ONNX op type.

    Attributes:
        family: ``"conv_dense"`` (§5.1 layers), ``"norm"`` (§5.2/§5.4 layers), ``"non_trainable"``
            (§5.3), ``"accumulate"`` (ORT gradient accumulators), ``"loss"``.
        weight_slots: input index -> tensor kind for initializers found at that input
            (e.g. Conv ``{1: "kernel", 2: "bias"}``).
        stat_slots: input indices holding running statistics (BN mean/var; frozen, not trained).
        nondiff_slots: input indices that carry no gradient (shapes, axes, indices, ratios).
        differentiable: False for ops none of whose outputs carry a gradient (Shape, Equal, ...).
        fused_grad: for backward op types: output index -> part of a fused multi-output gradient
            kernel (``"dx"``, ``"dw"``, ``"db"``), split by measurement (ConvGrad).
        norm_grad: True for a normalisation layer's backward op (charged whole to beta's t_dy).
        gradient: whether onnxruntime-training 1.19.2 has a gradient builder for the op:
            True, ``"rewrite"`` (none, but rewritten by the legalisation pipeline) or False.
        fix: for ``gradient`` False or ``"rewrite"``: what to do about the op, as said in errors.
        why: for ``gradient`` False: what is wrong with its gradient in onnxruntime-training
            1.19.2, as said in errors.
        torch_fix: how a torch user makes ``fix`` (said only for models torch exported:
            :func:`etgraph.exporters.remedy`).
        index_slots: input indices that select from the op's data (Gather's indices): they carry
            no gradient, but an output selected by values computed from the model's inputs
            (token ids) is on the data path (:func:`data_path_values`).
        embedding_grad: for backward op types: computes an embedding table's gradient
            (GatherGrad's scatter-add); charged whole to that table's ``t_dw`` (an embedding
            has no ``t_dy`` beyond it: nothing upstream of a lookup needs a gradient).
    """

    family: str = "non_trainable"
    weight_slots: Mapping[int, str] = field(default_factory=dict)
    stat_slots: tuple[int, ...] = ()
    nondiff_slots: tuple[int, ...] = ()
    differentiable: bool = True
    fused_grad: Mapping[int, str] = field(default_factory=dict)
    norm_grad: bool = False
    gradient: bool | str = True
    fix: str = ""
    index_slots: tuple[int, ...] = ()
    embedding_grad: bool = False
    why: str = "has no gradient"
    torch_fix: str = ""


DEFAULT_RULE = OpRule()

_CONV = OpRule("conv_dense", {1: "kernel", 2: "bias"})
_NO_GRAD = OpRule(differentiable=False)
_REDUCE = OpRule(nondiff_slots=(1,))
_NO_CPU_KERNEL = "has no CPU gradient kernel"

OP_RULES: dict[str, OpRule] = {
    # forward layers with trainable tensors
    "Conv": _CONV,
    # ConvTransposeGrad has no CPU kernel in 1.19.2: refused on the data path
    "ConvTranspose": OpRule(
        "conv_dense",
        {1: "kernel", 2: "bias"},
        gradient=False,
        fix="upsample with Unsqueeze + Expand + Reshape (nearest) followed by a Conv",
        why=_NO_CPU_KERNEL,
    ),
    "Gemm": OpRule("conv_dense", {0: "kernel", 1: "kernel", 2: "bias"}),
    "MatMul": OpRule("conv_dense", {0: "kernel", 1: "kernel"}),
    "BatchNormalization": OpRule("norm", {1: "gamma", 2: "beta"}, stat_slots=(3, 4)),
    "BatchNormInternal": OpRule("norm", {1: "gamma", 2: "beta"}, stat_slots=(3, 4)),
    "LayerNormalization": OpRule("norm", {1: "gamma", 2: "beta"}),
    "SimplifiedLayerNormalization": OpRule("norm", {1: "gamma"}),
    # No gradient builder in ORT 1.19.2: refused on the data path. Their charging rule stays so
    # a model that uses them off the data path (or a later backend) still builds a graph.
    "GroupNormalization": OpRule(
        "norm",
        {1: "gamma", 2: "beta"},
        gradient=False,
        fix="decompose it into Reshape + ReduceMean/Sub/Mul/Sqrt/Div + Mul/Add",
    ),
    "InstanceNormalization": OpRule(
        "norm",
        {1: "gamma", 2: "beta"},
        gradient=False,
        fix="decompose it into ReduceMean/Sub/Mul/Sqrt/Div",
    ),
    "Gather": OpRule(weight_slots={0: "embedding"}, nondiff_slots=(1,), index_slots=(1,)),
    # backward ops of onnxruntime-training (com.microsoft) that need a rule
    "ConvGrad": OpRule("conv_dense", fused_grad={0: "dx", 1: "dw", 2: "db"}),
    "ConvTransposeGrad": OpRule("conv_dense", fused_grad={0: "dx", 1: "dw", 2: "db"}),
    "BatchNormalizationGrad": OpRule("norm", norm_grad=True),
    "LayerNormalizationGrad": OpRule("norm", norm_grad=True),
    "SimplifiedLayerNormalizationGrad": OpRule("norm", norm_grad=True),
    "InvertibleLayerNormalizationGrad": OpRule("norm", norm_grad=True),
    "GatherGrad": OpRule(embedding_grad=True),
    "InPlaceAccumulatorV2": OpRule("accumulate"),
    "InPlaceAccumulator": OpRule("accumulate"),
    "SoftmaxCrossEntropyLoss": OpRule("loss", nondiff_slots=(1, 2)),
    # inputs that carry no gradient
    "Reshape": OpRule(nondiff_slots=(1,)),
    "Expand": OpRule(nondiff_slots=(1,)),
    "Tile": OpRule(nondiff_slots=(1,)),
    "Slice": OpRule(nondiff_slots=(1, 2, 3, 4)),
    "GatherElements": OpRule(nondiff_slots=(1,), index_slots=(1,)),
    "GatherND": OpRule(nondiff_slots=(1,), index_slots=(1,)),
    "ScatterND": OpRule(nondiff_slots=(1,)),
    "ScatterElements": OpRule(nondiff_slots=(1,)),
    "Pad": OpRule(nondiff_slots=(1, 2, 3)),
    "Split": OpRule(nondiff_slots=(1,)),
    "Squeeze": OpRule(nondiff_slots=(1,)),
    "Unsqueeze": OpRule(nondiff_slots=(1,)),
    "ReduceMean": _REDUCE,
    "ReduceSum": _REDUCE,
    "ReduceMax": OpRule(
        nondiff_slots=(1,),
        gradient="rewrite",
        fix="reduce over the spatial axes of a static-shape value (etgraph then rewrites it as "
        "MaxPool over the whole window), or avoid it on the trained path",
    ),
    "ReduceMin": _REDUCE,
    "ReduceProd": _REDUCE,
    "ReduceL2": _REDUCE,
    "ReduceLogSumExp": _REDUCE,
    "Clip": OpRule(nondiff_slots=(1, 2)),
    "Dropout": OpRule(nondiff_slots=(1, 2)),
    "Where": OpRule(nondiff_slots=(0,)),
    "TopK": OpRule(nondiff_slots=(1,)),
    # control flow: no gradient builder in ORT 1.19.2 (If's aborts the process at session
    # creation, measured); torch exports .squeeze(dim) of a symbolic dim as an If, and
    # nn.EmbeddingBag as a Loop
    **{
        op: OpRule(
            gradient=False,
            fix="export without data-dependent control flow",
            torch_fix=".squeeze(dim) of a symbolic dim exports an If, use .flatten(1) or "
            ".reshape; nn.EmbeddingBag a Loop, use nn.Embedding and a mean",
        )
        for op in ("If", "Loop", "Scan")
    },
    "CumSum": OpRule(
        nondiff_slots=(1,),
        gradient=False,
        fix="replace it by a MatMul with a triangular constant",
    ),
    "Trilu": OpRule(nondiff_slots=(1,)),
    "Pow": OpRule(nondiff_slots=(1,)),
    # no gradient builder in ORT 1.19.2, rewritten by the legalisation pipeline
    "HardSwish": OpRule(gradient="rewrite", fix="rewrite as x * clip(x + 3, 0, 6) / 6"),
    "HardSigmoid": OpRule(gradient="rewrite", fix="rewrite as clip(alpha*x + beta, 0, 1)"),
    "Sum": OpRule(gradient="rewrite", fix="replace it by a chain of Add"),
    "CastLike": OpRule(
        nondiff_slots=(1,), gradient="rewrite", fix="replace it by Cast to the type it takes"
    ),
    "Elu": OpRule(gradient="rewrite", fix="rewrite as relu(x) + alpha * (exp(min(x, 0)) - 1)"),
    "Selu": OpRule(gradient="rewrite", fix="rewrite as gamma * elu(x; alpha)"),
    "Celu": OpRule(
        gradient="rewrite", fix="rewrite as relu(x) + alpha * (exp(min(x, 0) / alpha) - 1)"
    ),
    "PRelu": OpRule(gradient="rewrite", fix="rewrite as relu(x) + slope * min(x, 0)"),
    # no gradient builder in ORT 1.19.2, refused on the data path
    "GlobalMaxPool": OpRule(
        gradient="rewrite",
        fix="give it static spatial dims (etgraph then rewrites it as MaxPool over the whole "
        "window: pass --input-shape, or export at a fixed input size)",
    ),
    "Softplus": OpRule(gradient=False, fix="rewrite as log(1 + exp(x))"),
    "Atan": OpRule(gradient=False, fix="remove it from the trained path"),
    "Einsum": OpRule(gradient=False, fix="write it as Transpose/Reshape + MatMul"),
    "DepthToSpace": OpRule(gradient=False, fix="write it as Reshape + Transpose + Reshape"),
    "SpaceToDepth": OpRule(gradient=False, fix="write it as Reshape + Transpose + Reshape"),
    # a gradient builder, but its kernel is CUDA-only in 1.19.2 (no CPU ResizeGrad)
    "Resize": OpRule(
        nondiff_slots=(1, 2, 3),
        gradient="rewrite",
        fix="upsample by integer factors in nearest mode (etgraph then rewrites it exactly as "
        "Reshape + Expand + Reshape)",
        why=_NO_CPU_KERNEL,
    ),
    "Upsample": OpRule(
        nondiff_slots=(1,),
        gradient="rewrite",
        fix="upsample by integer factors in nearest mode (etgraph then rewrites it exactly as "
        "Reshape + Expand + Reshape)",
        why=_NO_CPU_KERNEL,
    ),
    # recurrent layers: LSTMGrad/GRUGrad crash the process (SIGSEGV) unless both W and R get a
    # gradient whenever the backward pass reaches the layer, which a tensor-level selection
    # does not guarantee; RNN (and a bidirectional LSTM) have no CPU gradient at all
    **{
        op: OpRule(
            gradient=False,
            fix="unroll it into MatMul/Add/Sigmoid/Tanh per time step (a cell loop in the "
            "exporting framework)",
            why=why,
        )
        for op, why in (
            ("LSTM", "has a gradient kernel that crashes the process (unless W and R both train)"),
            ("GRU", "has a gradient kernel that crashes the process (unless W and R both train)"),
            ("RNN", "has no gradient"),
        )
    },
    "LRN": OpRule(
        gradient="rewrite",
        fix="rewrite it as x / (bias + alpha / size * (sum of x^2 over size channels))^beta "
        "(Mul, a channel-window Conv, Pow, Div)",
    ),
    # has a gradient builder, but AveragePoolGrad allocates the batch recorded at session
    # creation: 0 at a symbolic batch (a failed step or SIGFPE); rewritten
    "AveragePool": OpRule(
        gradient="rewrite",
        fix="replace it by a depthwise Conv with the constant kernel 1/prod(kernel_shape)",
    ),
    # ops whose outputs carry no gradient at all
    **{
        op: _NO_GRAD
        for op in (
            "Shape",
            "Size",
            "ConstantOfShape",
            "Constant",
            "Range",
            "NonZero",
            "ArgMax",
            "ArgMin",
            "Equal",
            "Less",
            "Greater",
            "LessOrEqual",
            "GreaterOrEqual",
            "Not",
            "And",
            "Or",
            "Xor",
            "IsNaN",
            "IsInf",
            "Floor",
            "Ceil",
            "Round",
            "Sign",
            "Mod",
            "OneHot",
            "EyeLike",
            "RandomNormal",
            "RandomUniform",
            "RandomNormalLike",
            "RandomUniformLike",
            "Bernoulli",
            "Multinomial",
        )
    },
}


def op_rule(op_type: str) -> OpRule:
    """The registry entry for ``op_type`` (:data:`DEFAULT_RULE` when unknown)."""
    return OP_RULES.get(op_type, DEFAULT_RULE)


def no_gradient_ops() -> dict[str, OpRule]:
    """Op types without a gradient builder in ORT 1.19.2 (``gradient`` False or ``"rewrite"``)."""
    return {op: rule for op, rule in OP_RULES.items() if rule.gradient is not True}


def is_default_domain(node: onnx.NodeProto) -> bool:
    """True for a node of the default ONNX domain (``""`` or ``"ai.onnx"``)."""
    return node.domain in ("", "ai.onnx")


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The values ``node`` reads: its inputs, then the outer-scope values its subgraphs
    (If branches, Loop and Scan bodies) read without producing them, sorted."""
    captured: set[str] = set()
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            local = {i.name for i in sub.input} | {i.name for i in sub.initializer}
            for inner in sub.node:
                captured.update(v for v in node_reads(inner) if v and v not in local)
                local.update(inner.output)
    return [*node.input, *sorted(captured - set(node.input))]


def data_path_values(graph: onnx.GraphProto, *, from_initializers: bool = True) -> set[str]:
    """Values that can carry a gradient in ``graph`` (node order must be topological).

    The data path may start at any graph input that is not an initializer:

    * a float input (an image batch) carries a gradient from the start;
    * a non-float input (token ids, an attention mask) carries none, but what it selects does:
      the output of an op whose index input (registry ``index_slots``: Gather's indices) is
      computed from such an input, and whose data input is a float initializer or on the data
      path, is on the data path (the rows an embedding lookup picks); so is a Cast to a float
      type of a value computed from such an input (a mask turned into an additive bias).

    From there a value carries a gradient when it is reachable through the differentiable inputs
    of differentiable ops (:data:`OP_RULES`); a Cast to a non-float type stops it. With
    ``from_initializers`` every float initializer is a seed too. The float seeds themselves are
    included; non-float inputs are not (no gradient flows into token ids or a mask, so an op
    without a gradient that reads them, e.g. a CumSum of the mask for position ids, is fine).

    Returns:
        The set of value names.
    """
    init_names = {x.name for x in graph.initializer}
    float_inits = {i.name for i in graph.initializer if i.data_type in FLOAT_TYPES}
    inputs = [i for i in graph.input if i.name not in init_names]
    carrying = {  # float inputs, and inputs of unknown type (elem_type 0) to be safe
        i.name for i in inputs if i.type.tensor_type.elem_type in FLOAT_TYPES | {0}
    }
    # values computed from a non-float graph input (ids, masks): no gradient, but they select
    indexing = {i.name for i in inputs} - carrying
    if from_initializers:
        carrying |= float_inits
    for node in graph.node:
        rule = op_rule(node.op_type)
        outputs = [o for o in node.output if o]
        if any(v in indexing for v in node.input):
            indexing.update(outputs)
        if not rule.differentiable:
            continue
        if node.op_type == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), onnx.TensorProto.FLOAT)
            if to not in FLOAT_TYPES:
                continue
            if any(v in indexing for v in node.input):
                carrying.update(outputs)
                continue
        # what a subgraph reads from outside counts as an input (an If of the data, a Loop)
        diff = [v for i, v in enumerate(node_reads(node)) if v and i not in rule.nondiff_slots]
        if any(v in carrying for v in diff):
            carrying.update(outputs)
        elif any(
            i < len(node.input) and node.input[i] in indexing for i in rule.index_slots
        ) and any(v in carrying or v in float_inits for v in diff):
            carrying.update(outputs)
    return carrying
