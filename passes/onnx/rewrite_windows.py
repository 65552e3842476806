"""Rewrite window ops whose ORT 1.19.2 gradient fails into convolutions with constant kernels.

* **AveragePool** (``ceil_mode=1`` too: where ceil and floor give the same windows at the
  model's static input size it changes nothing; where they differ the last windows are padded
  at the end — divided by their real element counts, or with ``count_include_pad=1`` by the
  whole kernel, as ORT 1.19.2 computes them):
  ORT's ``AveragePoolGrad`` kernel takes its output shape from the shape
  recorded in the graph at session creation, so at a symbolic batch it allocates a batch of 0
  and the step dies (``Can broadcast 0 by 0 or 1``, or SIGFPE inside the kernel — measured on
  Caffe2-era zoo graphs and on a torch ``nn.AvgPool2d``). It becomes a depthwise ``Conv`` with
  the constant kernel ``1 / prod(kernel_shape)`` (group = channels; strides, pads, auto_pad and
  dilations unchanged). With ``count_include_pad=0`` and padding, the kernel is 1 and the sum
  is divided by the number of real (unpadded) elements of each window: the same ``Conv`` of
  ones over a ``[1, 1, *spatial]`` plane of ones. ``ConvGrad`` handles a symbolic batch.
* **LRN** (no gradient builder in ORT 1.19.2; AlexNet, ZFNet, GoogLeNet):
  ``y = x / (bias + alpha / size * S)^beta`` with ``S`` the sum of ``x^2`` over ``size``
  neighbouring channels (ONNX spec: ``floor((size-1)/2)`` before, ``ceil((size-1)/2)`` after),
  computed as a ``Conv`` over the channel axis of ``Unsqueeze(x^2, 1)`` with a ones kernel
  ``[1, 1, size, 1, ...]``.

* **GlobalMaxPool** and a **ReduceMax over the spatial axes** (no gradient builder in ORT
  1.19.2; Keras' GlobalMaxPooling2D through tf2onnx): a ``MaxPool`` whose window is the whole
  spatial extent (``kernel_shape`` = the spatial dims, static at the model's input shape) has a
  gradient and computes the same maximum; a ReduceMax over the axes ``[1, ..., r-2]`` of a
  channels-last value is transposed to channels first around it; ``keepdims=0`` flattens.
* **Resize / Upsample** in ``nearest`` mode by integer scales (ORT 1.19.2 has no CPU
  ``ResizeGrad``; Keras' UpSampling2D, torch's ``nn.Upsample``): each element repeated ``s``
  times per axis, as ``Reshape`` to ``[..., d, 1, ...]``, ``Expand`` by ``s`` and ``Reshape`` to
  ``[..., d * s, ...]`` — exact where nearest picks ``floor(i / s)``: coordinate transformation
  ``half_pixel``/``pytorch_half_pixel`` (any rounding), ``asymmetric`` or
  ``tf_half_pixel_for_nn`` with ``nearest_mode=floor``.

Kernels are ``Expand`` of scalar ``Constant`` nodes (ORT folds them at session creation), never
initializers, so they do not become trainable tensors (nor are lifted by
:class:`passes.onnx.weights.MaterializeWeightsPass` on a second run). New nodes and values are
named ``<node>/<part>``. Both rewrites are exact up to float rounding (tests check them against
ORT's own kernels).
"""

from __future__ import annotations

import contextlib
import logging
import math

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import replace_nodes_and_values
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError
from onnx_ir.passes.common import ShapeInferencePass

from etgraph.errors import UnsupportedOpError

__all__ = [
    "RewriteAveragePoolPass",
    "RewriteGlobalMaxPass",
    "RewriteLrnPass",
    "RewriteNearestResizePass",
]

log = logging.getLogger(__name__)


def _remaining(model: ir.Model, op_type: str) -> list[str]:
    return [n.name for n in model.graph if n.domain in ("", "ai.onnx") and n.op_type == op_type]


def _ints(node: ir.Node, name: str, default: list[int] | None = None) -> list[int] | None:
    attr = node.attributes.get(name)
    return list(attr.as_ints()) if attr is not None else default


def _int(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return attr.as_int() if attr is not None else default


def _float(node: ir.Node, name: str, default: float) -> float:
    attr = node.attributes.get(name)
    return attr.as_float() if attr is not None else default


def _string(node: ir.Node, name: str, default: str) -> str:
    attr = node.attributes.get(name)
    return attr.as_string() if attr is not None else default


class _Builder:
    """Nodes named ``<prefix>/<part>`` in the order they are made."""

    def __init__(self, prefix: str, dtype: ir.DataType):
        self.prefix, self.dtype, self.nodes = prefix, dtype, []

    def node(self, op_type: str, inputs, part: str, **attributes) -> ir.Value:
        out = ir.Value(name=f"{self.prefix}/{part}")
        attrs = [
            ir.AttrInt64s(k, v) if isinstance(v, list) else ir.Attr(k, _attr_type(v), v)
            for k, v in attributes.items()
        ]
        self.nodes.append(
            ir.Node(
                "",
                op_type,
                inputs,
                attributes=attrs,
                outputs=[out],
                name=f"{self.prefix}/{op_type}_{part}",
            )
        )
        return out

    def constant(self, part: str, array: np.ndarray) -> ir.Value:
        return self.node("Constant", [], part, value=ir.tensor(array, name=f"{self.prefix}/{part}"))

    def scalar(self, part: str, value: float) -> ir.Value:
        return self.constant(part, np.array(value, dtype=self.dtype.numpy()))

    def filled(self, part: str, value: float, shape: ir.Value) -> ir.Value:
        """``Expand(value, shape)``: a constant tensor without an initializer."""
        return self.node("Expand", [self.scalar(f"{part}_value", value), shape], part)


def _attr_type(value) -> ir.AttributeType:
    if isinstance(value, bool | int):
        return ir.AttributeType.INT
    if isinstance(value, float):
        return ir.AttributeType.FLOAT
    if isinstance(value, str):
        return ir.AttributeType.STRING
    return ir.AttributeType.TENSOR


def _float_dtype(value: ir.Value) -> ir.DataType:
    dtype = value.dtype
    return dtype if dtype is not None and dtype.is_floating_point() else ir.DataType.FLOAT


class RewriteAveragePoolPass(InPlacePass):
    """Rewrite AveragePool into a depthwise Conv with a constant kernel (module docstring).

    Raises (from ``call``):
        UnsupportedOpError: ``ceil_mode=1`` at a spatial size that is not static, or the
            channel count of the pooled value cannot be inferred.
    """

    def __init__(self, source: str = "model"):
        super().__init__()
        self.source = source

    def call(self, model: ir.Model) -> PassResult:
        pools = [
            n for n in model.graph if n.domain in ("", "ai.onnx") and n.op_type == "AveragePool"
        ]
        if not pools:
            return PassResult(model, modified=False)
        ceil = any(_int(n, "ceil_mode", 0) for n in pools)
        if any(_channels(n) is None for n in pools) or ceil:
            ShapeInferencePass()(model)
        for node in pools:
            self._rewrite(model.graph, node)
            log.info(
                "%s: rewrote AveragePool node %r into a depthwise Conv", self.source, node.name
            )
        return PassResult(model, modified=True)

    def _rewrite(self, graph: ir.Graph, node: ir.Node) -> None:
        where = f"{self.source}: node {node.name!r} (AveragePool)"
        channels = _channels(node)
        if channels is None:
            raise UnsupportedOpError(
                f"{where}: the channel count of its input is unknown; re-export with static "
                "channel dimensions"
            )
        x = node.inputs[0]
        kernel = _ints(node, "kernel_shape")
        rank = len(kernel)
        auto_pad = _string(node, "auto_pad", "NOTSET")
        pads = _ints(node, "pads", [0] * (2 * rank))
        strides = _ints(node, "strides", [1] * rank)
        dilations = _ints(node, "dilations")
        extra = [0] * rank  # end padding that makes floor mode give ceil mode's windows
        if _int(node, "ceil_mode", 0) and not auto_pad.startswith("SAME"):
            extra = _ceil_extra(x, kernel, strides, pads, dilations)
            if extra is None:
                raise UnsupportedOpError(
                    f"{where} uses ceil_mode=1 on an input whose spatial size is not static: "
                    "export the model at a fixed input size (or with ceil_mode=False)"
                )
        window = {"kernel_shape": kernel, "strides": strides}
        if auto_pad != "NOTSET":
            window["auto_pad"] = auto_pad
        else:
            window["pads"] = pads
        if any(extra):  # the last windows run past the end: pad there, divide by real counts
            window["pads"] = pads[:rank] + [p + e for p, e in zip(pads[rank:], extra, strict=True)]
            window.pop("auto_pad", None)
        if dilations is not None:
            window["dilations"] = dilations
        padded = auto_pad.startswith("SAME") or any(pads) or any(extra)
        # ORT 1.19.2 divides by the whole kernel with count_include_pad=1, even a last window
        # of ceil mode that runs past the end padding; by the real elements without it
        exclude_pad = padded and not _int(node, "count_include_pad", 0)

        b = _Builder(node.name, _float_dtype(x))
        shape = b.constant("kernel_shape", np.array([channels, 1, *kernel], np.int64))
        weight = b.filled("kernel", 1.0 if exclude_pad else 1.0 / math.prod(kernel), shape)
        summed = b.node("Conv", [x, weight], "window", group=channels, **window)
        if exclude_pad:
            spatial = b.node(
                "Slice",
                [
                    b.node("Shape", [x], "shape"),
                    b.constant("two", np.array([2], np.int64)),
                    b.constant("end", np.array([np.iinfo(np.int64).max], np.int64)),
                ],
                "spatial",
            )
            plane_shape = b.node(
                "Concat",
                [b.constant("one_one", np.ones(2, np.int64)), spatial],
                "plane_shape",
                axis=0,
            )
            plane = b.filled("plane", 1.0, plane_shape)
            ones_shape = b.constant("count_kernel_shape", np.array([1, 1, *kernel], np.int64))
            counts = b.node(
                "Conv", [plane, b.filled("count_kernel", 1.0, ones_shape)], "counts", **window
            )
            b.node("Div", [summed, counts], "mean")
        replace_nodes_and_values(
            graph, node, [node], b.nodes, node.outputs[:1], b.nodes[-1].outputs
        )

    def ensures(self, model: ir.Model) -> None:
        left = _remaining(model, "AveragePool")
        if left:
            raise PostconditionError(f"nodes not rewritten: {left[:5]}")


def _ceil_extra(
    x: ir.Value,
    kernel: list[int],
    strides: list[int],
    pads: list[int],
    dilations: list[int] | None,
) -> list[int] | None:
    """Per spatial axis, the end padding a floor-mode window needs to give the output a
    ``ceil_mode=1`` pool gives at ``x``'s static spatial size (0 where the two agree: an even
    map halved, as in timm's "d" ResNets); None when the size is not static. A last window that
    would start past the input and its begin padding is not counted (ORT, torch)."""
    if x.shape is None or len(x.shape) != len(kernel) + 2:
        return None
    dims = list(x.shape[2:])
    if not all(isinstance(d, int) for d in dims):
        return None
    rank = len(kernel)
    extra = []
    for i, d in enumerate(dims):
        k = (kernel[i] - 1) * (dilations[i] if dilations else 1) + 1
        total = d + pads[i] + pads[rank + i]
        floor_out = (total - k) // strides[i] + 1
        ceil_out = -(-(total - k) // strides[i]) + 1
        if (ceil_out - 1) * strides[i] >= d + pads[i]:
            ceil_out -= 1
        extra.append(max(0, (ceil_out - 1) * strides[i] + k - total) if ceil_out > floor_out else 0)
    return extra


def _channels(node: ir.Node) -> int | None:
    shape = node.inputs[0].shape
    if shape is None or len(shape) < 2 or not isinstance(shape[1], int):
        return None
    return shape[1]


class RewriteLrnPass(InPlacePass):
    """Rewrite LRN into Mul, a channel-window Conv of ones, Add, Pow and Div (module docstring)."""

    def __init__(self, source: str = "model"):
        super().__init__()
        self.source = source

    def call(self, model: ir.Model) -> PassResult:
        nodes = [n for n in model.graph if n.domain in ("", "ai.onnx") and n.op_type == "LRN"]
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 17))
        for node in nodes:
            self._rewrite(model.graph, node, opset)
            log.info("%s: rewrote LRN node %r into ops with gradients", self.source, node.name)
        return PassResult(model, modified=bool(nodes))

    def _rewrite(self, graph: ir.Graph, node: ir.Node, opset: int) -> None:
        x = node.inputs[0]
        size = _int(node, "size", 0)
        alpha, beta = _float(node, "alpha", 1e-4), _float(node, "beta", 0.75)
        bias = _float(node, "bias", 1.0)
        rank = len(x.shape) if x.shape is not None else 4  # unknown: [N, C, H, W], as in every
        # zoo model with LRN (AlexNet, ZFNet, GoogLeNet)
        b = _Builder(node.name, _float_dtype(x))
        square = b.node("Mul", [x, x], "square")
        if opset >= 13:
            axes = b.constant("axes", np.array([1], np.int64))
            lifted = b.node("Unsqueeze", [square, axes], "lifted")
        else:
            lifted = b.node("Unsqueeze", [square], "lifted", axes=[1])
        # the channel axis is the first spatial axis of the lifted value [N, 1, C, ...]
        kernel = [size] + [1] * (rank - 2)
        before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
        pads = [before] + [0] * (rank - 2) + [after] + [0] * (rank - 2)
        shape = b.constant("kernel_shape", np.array([1, 1, *kernel], np.int64))
        window = b.node(
            "Conv",
            [lifted, b.filled("kernel", 1.0, shape)],
            "window",
            kernel_shape=kernel,
            pads=pads,
        )
        if opset >= 13:
            summed = b.node("Squeeze", [window, axes], "sum")
        else:
            summed = b.node("Squeeze", [window], "sum", axes=[1])
        scaled = b.node("Mul", [summed, b.scalar("alpha", alpha / size)], "scaled")
        base = b.node("Add", [scaled, b.scalar("bias", bias)], "base")
        denominator = b.node("Pow", [base, b.scalar("beta", beta)], "denominator")
        b.node("Div", [x, denominator], "normalized")
        replace_nodes_and_values(
            graph, node, [node], b.nodes, node.outputs[:1], b.nodes[-1].outputs
        )

    def ensures(self, model: ir.Model) -> None:
        left = _remaining(model, "LRN")
        if left:
            raise PostconditionError(f"nodes not rewritten: {left[:5]}")


def _spatial_max(node: ir.Node) -> tuple[list[int], bool, int] | None:
    """For a GlobalMaxPool, or a ReduceMax over all spatial axes of its input (channels first
    ``[2, ..., r-1]`` or channels last ``[1, ..., r-2]``), ``(spatial dims, channels_last,
    keepdims)`` when the spatial dims are static; else None."""
    x = node.inputs[0] if node.inputs else None
    if x is None or x.shape is None or len(x.shape) < 3:
        return None
    rank = len(x.shape)
    if node.op_type == "GlobalMaxPool":
        axes, keepdims = list(range(2, rank)), 1
    else:
        keepdims = _int(node, "keepdims", 1)
        if len(node.inputs) > 1 and node.inputs[1] is not None:  # opset 18: axes as an input
            const = node.inputs[1].const_value
            producer = node.inputs[1].producer()
            if const is None and producer is not None and producer.op_type == "Constant":
                const = producer.attributes["value"].as_tensor()
            if const is None:
                return None
            axes = [int(a) for a in const.numpy().reshape(-1)]
        else:
            axes = _ints(node, "axes", []) or []
        axes = sorted(a % rank for a in axes)
    if axes == list(range(2, rank)):
        spatial, channels_last = list(x.shape[2:]), False
    elif axes == list(range(1, rank - 1)):
        spatial, channels_last = list(x.shape[1 : rank - 1]), True
    else:
        return None
    if not all(isinstance(d, int) and d > 0 for d in spatial):
        return None
    return spatial, channels_last, keepdims


class RewriteGlobalMaxPass(InPlacePass):
    """Rewrite GlobalMaxPool and a spatial ReduceMax into a MaxPool over the whole spatial
    window (module docstring); nodes whose spatial dims are not static stay (and are refused
    by :class:`passes.onnx.RefuseNoGradOpsPass` where a gradient must pass)."""

    def __init__(self, source: str = "model"):
        super().__init__()
        self.source = source

    def call(self, model: ir.Model) -> PassResult:
        nodes = [
            n
            for n in model.graph
            if n.domain in ("", "ai.onnx") and n.op_type in ("GlobalMaxPool", "ReduceMax")
        ]
        if not nodes:
            return PassResult(model, modified=False)
        for options in ({"data_prop": False}, {"strict_mode": False}):  # then through the
            # shape arithmetic (tf2onnx's UpSampling2D): dims > 0 are checked by _spatial_max
            if all(_spatial_max(n) is not None for n in nodes):
                break
            with contextlib.suppress(Exception):  # shapes as far as they can be inferred
                ShapeInferencePass(**options)(model)
        count = 0
        for node in nodes:
            found = _spatial_max(node)
            if found is None:
                continue
            self._rewrite(model.graph, node, *found)
            count += 1
            log.info("%s: rewrote %s node %r into MaxPool", self.source, node.op_type, node.name)
        return PassResult(model, modified=count > 0)

    def _rewrite(
        self, graph: ir.Graph, node: ir.Node, spatial: list[int], channels_last: bool, keep: int
    ) -> None:
        rank = len(spatial) + 2
        b = _Builder(node.name, _float_dtype(node.inputs[0]))
        x = node.inputs[0]
        if channels_last:
            x = b.node("Transpose", [x], "channels_first", perm=[0, rank - 1, *range(1, rank - 1)])
        pooled = b.node("MaxPool", [x], "max", kernel_shape=spatial)
        if not keep:
            b.node("Flatten", [pooled], "flat", axis=1)
        elif channels_last:
            b.node("Transpose", [pooled], "channels_last", perm=[0, *range(2, rank), 1])
        replace_nodes_and_values(
            graph, node, [node], b.nodes, node.outputs[:1], b.nodes[-1].outputs
        )


def _resize_factors(node: ir.Node) -> list[int] | None:
    """The integer scale per axis of a nearest Resize/Upsample that repeats elements exactly
    (module docstring), from its constant ``scales`` (or ``sizes`` over a static input);
    None when it is not one."""
    if _string(node, "mode", "nearest") != "nearest":
        return None
    transform = _string(node, "coordinate_transformation_mode", "half_pixel")
    floor = _string(node, "nearest_mode", "round_prefer_floor") == "floor"
    if node.op_type == "Resize" and not (
        transform in ("half_pixel", "pytorch_half_pixel")
        or (transform in ("asymmetric", "tf_half_pixel_for_nn") and floor)
    ):
        return None
    x = node.inputs[0]
    slots = (1,) if node.op_type == "Upsample" else (2, 3)
    for slot in slots:
        value = node.inputs[slot] if len(node.inputs) > slot else None
        if value is None:
            continue
        const = value.const_value
        producer = value.producer()
        if const is None and producer is not None and producer.op_type == "Constant":
            const = producer.attributes["value"].as_tensor()
        if const is None or const.numpy().size == 0:
            continue
        numbers = const.numpy().reshape(-1)
        if slot == 3:  # sizes: over the input's static dims
            if x.shape is None or not all(isinstance(d, int) and d > 0 for d in x.shape):
                return None
            dims = list(x.shape)
            if len(numbers) != len(dims) or any(n % d for n, d in zip(numbers, dims, strict=True)):
                return None
            numbers = [n // d for n, d in zip(numbers, dims, strict=True)]
        factors = [int(round(float(f))) for f in numbers]
        if any(f < 1 or abs(f - float(n)) > 1e-6 for f, n in zip(factors, numbers, strict=True)):
            return None
        return factors
    return None


class RewriteNearestResizePass(InPlacePass):
    """Rewrite a nearest Resize/Upsample by integer scales into Reshape, Expand and Reshape
    (module docstring); others stay (refused where a gradient must pass)."""

    def __init__(self, source: str = "model"):
        super().__init__()
        self.source = source

    def call(self, model: ir.Model) -> PassResult:
        count = 0
        for node in list(model.graph):
            if node.domain not in ("", "ai.onnx") or node.op_type not in ("Resize", "Upsample"):
                continue
            factors = _resize_factors(node)
            if factors is None and node.inputs[0].shape is None:
                with contextlib.suppress(Exception):
                    ShapeInferencePass(data_prop=False)(model)
                factors = _resize_factors(node)
            if factors is None:
                continue
            self._rewrite(model.graph, node, factors)
            count += 1
            log.info("%s: rewrote %s node %r into Expand", self.source, node.op_type, node.name)
        return PassResult(model, modified=count > 0)

    def _rewrite(self, graph: ir.Graph, node: ir.Node, factors: list[int]) -> None:
        rank = len(factors)
        x = node.inputs[0]
        b = _Builder(node.name, _float_dtype(x))
        # [d0, d1, ...] -> [d0, 1, d1, 1, ...] -> [d0, f0, d1, f1, ...] -> [d0 * f0, d1 * f1, ...]
        shape = b.node("Shape", [x], "shape")
        dims = b.node("Unsqueeze", [shape, b.constant("axis", np.array([1], np.int64))], "dims")
        ones = b.constant("ones", np.ones((rank, 1), np.int64))
        pairs = b.node("Concat", [dims, ones], "pairs", axis=1)
        flat = b.constant("flat", np.array([-1], np.int64))
        lifted = b.node("Reshape", [x, b.node("Reshape", [pairs, flat], "lifted_shape")], "lifted")
        times = np.ones(2 * rank, np.int64)
        times[1::2] = factors
        grown = b.node("Expand", [lifted, b.constant("times", times)], "repeated")
        size = b.node("Mul", [shape, b.constant("factors", np.array(factors, np.int64))], "size")
        b.node("Reshape", [grown, size], "upsampled")
        replace_nodes_and_values(
            graph, node, [node], b.nodes, node.outputs[:1], b.nodes[-1].outputs
        )
