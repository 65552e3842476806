"""A selection's training graph derived from the all-trainable one, without onnxblock (issue 31).

``generate_artifacts`` re-derives the gradient graph and shape-infers the whole model for every
selection (ResNet-18 at 64 px: 0.2 s warm, 1.5 s the first time in a process, plus etgraph's
pre- and post-passes around it). Yet for a selection, ORT's training graph is the all-trainable
one with the work the selection does not need left out — observed on onnxruntime-training
1.19.2, and checked per selection by the tests (losses and updated weights of both graphs):

* the frozen parameters' ``GradientAccumulator`` nodes, their ``<p>_grad.accumulation.buffer``
  inputs and ``<p>_grad.accumulation.out`` outputs are absent;
* every node nothing needs any more is absent (the backward of the layers before the earliest
  selected one, the weight gradients of frozen kernels);
* optional outputs nothing reads are omitted: ConvGrad computes only the gradients wanted (a
  frozen kernel's dX alone: about half the work; the earliest selected layer's dW alone), as
  are MaxPool's indices, Dropout's mask and LayerNormalization's statistics
  (:data:`passes.onnx.DROPPABLE_OUTPUTS`);
* node names are the same, but for the loss node's per-process name and the numbering of the
  accumulators and of a few gradient values (no effect on what is computed).

So :func:`derive_training_graph` prunes the all-trainable graph (protobuf, no onnx_ir round
trip: milliseconds on ResNet50) and the optimizer graph (one AdamW node over sequences,
independent of the selection) and the eval graph (the forward pass and the loss) are the
all-trainable artifacts' own.

**Frozen batch norms in inference mode** (``--frozen-bn inference``, the default): such a
selection's forward graph differs — :class:`passes.onnx.InferenceBatchNormPass` writes each batch
norm whose gamma and beta are both unselected as its inference affine map. The derivation does
the same to the training graph's ``BatchNormInternal`` node (the same nodes, in the same order,
so the same rounding), and its ``BatchNormalizationGrad`` becomes the affine map's backward, one
``Mul`` of dy by the reshaped scale — what onnxblock's gradient of that map is (an Identity on
either side, which ORT removes). A batch norm whose input rank the graph does not record gives
up the derivation (None): :func:`etgraph.artifacts.generate` then runs onnxblock as before. In
the eval graph batch norms already run in inference mode.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import onnx
from onnx import helper, numpy_helper

from passes.onnx.bake import ACCUMULATION_SUFFIX
from passes.onnx.training_model import DROPPABLE_OUTPUTS

__all__ = ["ACCUMULATION_OUT_SUFFIX", "OPTIONAL_OUTPUTS", "derive_training_graph"]

#: Suffix of the accumulated gradient output per trainable parameter of the training graph.
ACCUMULATION_OUT_SUFFIX = "_grad.accumulation.out"

#: (domain, op type) -> indices of outputs that may be omitted (empty name or cut off the end)
#: without changing the others: ORT's gradient ops onnxblock emits with fewer outputs for a
#: selection, and the default-domain ops of :data:`passes.onnx.DROPPABLE_OUTPUTS`.
OPTIONAL_OUTPUTS: dict[tuple[str, str], tuple[int, ...]] = {
    ("com.microsoft", "ConvGrad"): (0, 1, 2),  # dX, dW, dB
    **{("", op): outputs for op, outputs in DROPPABLE_OUTPUTS.items()},
}

_BN = ("com.microsoft", "BatchNormInternal")
_BN_GRAD = ("com.microsoft", "BatchNormalizationGrad")


def _key(node: onnx.NodeProto) -> tuple[str, str]:
    return ("" if node.domain == "ai.onnx" else node.domain, node.op_type)


def _types(graph: onnx.GraphProto) -> dict[str, onnx.TypeProto.Tensor]:
    """The tensor type of every value the graph records (value_info, inputs, outputs)."""
    return {i.name: i.type.tensor_type for i in (*graph.value_info, *graph.input, *graph.output)}


def _inference_bn(
    types: dict[str, onnx.TypeProto.Tensor], bn: onnx.NodeProto, grad: onnx.NodeProto | None
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], list[onnx.NodeProto]] | None:
    """The nodes and initializers of ``bn`` (``BatchNormInternal``) as inference batch norm,
    and the node replacing its gradient ``grad`` (None: no backward reaches it). None when the
    rank of its input or gamma's shape is not recorded (``types``: :func:`_types`). The nodes
    are :class:`passes.onnx.InferenceBatchNormPass`'s, named after the forward
    BatchNormalization (``<bn>/inference/<Op>_<i>``)."""
    x, gamma, beta, mean, var = bn.input[:5]
    if x not in types or gamma not in types or not types[x].HasField("shape"):
        return None
    rank = len(types[x].shape.dim)
    gamma_dims = types[gamma].shape.dim
    channels = gamma_dims[0].dim_value if len(gamma_dims) == 1 else 0
    if rank > 2 and channels <= 0:
        return None
    dtype = helper.tensor_dtype_to_np_dtype(types[gamma].elem_type)
    eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
    forward_name = bn.name.removesuffix("_BatchNormInternal")
    prefix = f"{forward_name}/inference"
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def op(op_type: str, *inputs: str, output: str | None = None) -> str:
        out = output or f"{prefix}/{op_type}_{len(nodes) + len(inits)}"
        nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"{prefix}/{op_type}"))
        return out

    def const(array: np.ndarray) -> str:
        name = f"{prefix}/Constant_{len(nodes) + len(inits)}"
        inits.append(numpy_helper.from_array(array, name))
        return name

    scale = op("Div", gamma, op("Sqrt", op("Add", var, const(np.array(eps, dtype=dtype)))))
    shift = op("Sub", beta, op("Mul", mean, scale))
    if rank > 2:
        shape = const(np.array([channels] + [1] * (rank - 2), dtype=np.int64))
        scale, shift = op("Reshape", scale, shape), op("Reshape", shift, shape)
    op("Add", op("Mul", x, scale), shift, output=bn.output[0])
    for i, node in enumerate(nodes):  # unique node names, as the pass gives them
        node.name = f"{node.name}_{i}"
    backward = []
    if grad is not None and grad.output[0]:
        backward.append(
            helper.make_node(
                "Mul", [grad.input[0], scale], [grad.output[0]], name=f"{prefix}/Mul_Grad/Mul_0"
            )
        )
    return nodes, inits, backward


def derive_training_graph(
    full: onnx.ModelProto,
    requires_grad: Collection[str],
    *,
    inference_bn: bool,
) -> onnx.ModelProto | None:
    """The training graph of the selection ``requires_grad``, pruned from the all-trainable
    training graph ``full`` (module docstring).

    Args:
        full: ``training_model.onnx`` of the all-trainable artifacts (every tensor in
            ``requires_grad``, batch norms in training mode), as :func:`etgraph.artifacts.
            generate` writes it; not modified.
        requires_grad: the selected tensors (a non-empty subset of ``full``'s trainable
            parameters).
        inference_bn: batch norms whose gamma and beta are both unselected run in inference
            mode (``frozen_bn="inference"``; :func:`passes.onnx.frozen_batch_norms`).

    Returns:
        The training graph (parameters as graph inputs, as generated), or None when it cannot
        be derived (a frozen batch norm in inference mode whose input rank is not recorded):
        generate it instead.

    Raises:
        ValueError: a name in ``requires_grad`` is not a trainable parameter of ``full``.
    """
    graph = full.graph
    inputs = [i.name for i in graph.input]
    trainable = {n[: -len(ACCUMULATION_SUFFIX)] for n in inputs if n.endswith(ACCUMULATION_SUFFIX)}
    selected = set(requires_grad)
    unknown = selected - trainable
    if unknown:
        raise ValueError(f"not trainable in the all-trainable graph: {sorted(unknown)[:3]}")
    nodes = list(graph.node)
    extra_inits: list[onnx.TensorProto] = []
    if inference_bn:
        params = set(inputs)
        types = _types(graph)
        grads = {n.input[3]: n for n in nodes if _key(n) == _BN_GRAD and len(n.input) > 3}
        replaced: dict[int, list[onnx.NodeProto]] = {}
        for bn in nodes:
            if _key(bn) != _BN or not all(p in params for p in bn.input[1:5]):
                continue
            if selected & set(bn.input[1:3]):
                continue
            grad = grads.get(bn.output[3]) if len(bn.output) > 3 else None
            rewritten = _inference_bn(types, bn, grad)
            if rewritten is None:
                return None
            forward, inits, backward = rewritten
            replaced[id(bn)] = forward
            extra_inits += inits
            if grad is not None:
                replaced[id(grad)] = backward
        nodes = [new for n in nodes for new in replaced.get(id(n), [n])]

    dropped = trainable - selected
    outputs = [o for o in graph.output if o.name[: -len(ACCUMULATION_OUT_SUFFIX)] not in dropped]
    live = {o.name for o in outputs}
    kept: list[onnx.NodeProto] = []
    for node in reversed(nodes):
        if not any(o in live for o in node.output if o):
            continue
        unused = [i for i, o in enumerate(node.output) if o and o not in live]
        optional = set(OPTIONAL_OUTPUTS.get(_key(node), ()))
        if any(i in optional for i in unused):
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            names = [
                ("" if i in optional and i in unused else o) for i, o in enumerate(node.output)
            ]
            while names and not names[-1]:
                names.pop()
            del copy.output[:]
            copy.output.extend(names)
            node = copy
        kept.append(node)
        live.update(i for i in node.input if i)
    kept.reverse()

    out = onnx.ModelProto()
    out.CopyFrom(full)  # C++ copy of a graph without weights: about a millisecond
    g = out.graph
    for name in ("node", "input", "output", "initializer", "value_info"):
        g.ClearField(name)
    g.node.extend(kept)
    g.input.extend(i for i in graph.input if i.name in live)
    g.output.extend(outputs)
    g.initializer.extend(i for i in (*graph.initializer, *extra_inits) if i.name in live)
    g.value_info.extend(v for v in graph.value_info if v.name in live)
    return out
