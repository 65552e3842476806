"""AveragePool and LRN rewritten into convolutions with constant kernels (issue #14):
checked against ORT's own kernels forward, and against torch's gradients through a training
graph at a symbolic batch (where ORT's AveragePoolGrad fails)."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from helpers import make_model, random_initializer, save_model
from onnx import helper

from etgraph.artifacts import ArtifactCache
from etgraph.errors import UnsupportedOpError
from etgraph.model import LoadedModel
from etgraph.onnx_io import load_model
from etgraph.sessions import GradientSession
from passes.base import run_passes
from passes.onnx import (
    RewriteAveragePoolPass,
    RewriteGlobalMaxPass,
    RewriteLrnPass,
    RewriteNearestResizePass,
    legalization_pipeline,
)


def window_model(op: str, image_size: int = 8, channels: int = 6, **attrs) -> onnx.ModelProto:
    """x [1, 3, image_size, image_size] -> Conv -> <op> -> GlobalAveragePool -> Flatten -> Gemm."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node(op, ["c"], ["o"], name="win", **attrs),
        helper.make_node("GlobalAveragePool", ["o"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1),
    ]
    inits = [
        random_initializer("w", (channels, 3, 3, 3), scale=1.0),
        random_initializer("b", (channels,), scale=1.0),
        random_initializer("fw", (4, channels), scale=1.0),
        random_initializer("fb", (4,), scale=1.0),
    ]
    return make_model(nodes, inits, in_shape=(1, 3, image_size, image_size))


def window_output(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The value right after the window op (``o``), run in ORT."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.output.append(helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["o"], {"x": x})[0]


def rewrite(pass_, model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    result = pass_(ir.from_proto(model))
    return ir.to_proto(result.model), result.modified


AVERAGE_POOLS = [
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1},
    {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [0, 1, 1, 0]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
    {"kernel_shape": [8, 8]},  # global, as the Caffe2 zoo's 7x7 final pool
]


@pytest.mark.parametrize("attrs", AVERAGE_POOLS)
def test_average_pool_rewrite_computes_the_same(attrs):
    model = window_model("AveragePool", **attrs)
    out, modified = rewrite(RewriteAveragePoolPass(), model)
    assert modified and "AveragePool" not in {n.op_type for n in out.graph.node}
    assert [i.name for i in out.graph.initializer] == [i.name for i in model.graph.initializer]
    onnx.checker.check_model(out)
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(window_output(out, x), window_output(model, x), rtol=1e-5, atol=1e-5)
    assert rewrite(RewriteAveragePoolPass(), out)[1] is False


CEIL_POOLS = [  # (image size, attributes): ceil_mode=1 where it changes nothing, and where
    # the last window runs past the end (ORT divides it by the elements it covers)
    (8, {"kernel_shape": [2, 2], "strides": [2, 2]}),  # 8 -> 4 either way (timm's "d" ResNets)
    (8, {"kernel_shape": [3, 3], "strides": [2, 2]}),  # 3 vs 4
    (7, {"kernel_shape": [2, 2], "strides": [2, 2]}),  # 3 vs 4
    (8, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    (8, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    (9, {"kernel_shape": [3, 2], "strides": [2, 3], "pads": [0, 1, 1, 0], "count_include_pad": 1}),
]


@pytest.mark.parametrize(("size", "attrs"), CEIL_POOLS)
def test_average_pool_with_ceil_mode_computes_the_same(size, attrs):
    model = window_model("AveragePool", image_size=size, ceil_mode=1, **attrs)
    out, modified = rewrite(RewriteAveragePoolPass(), model)
    assert modified and "AveragePool" not in {n.op_type for n in out.graph.node}
    onnx.checker.check_model(out)
    x = np.random.default_rng(0).standard_normal((1, 3, size, size)).astype(np.float32)
    want = window_output(model, x)
    np.testing.assert_allclose(window_output(out, x), want, rtol=1e-5, atol=1e-6)
    floor = window_output(window_model("AveragePool", image_size=size, **attrs), x)
    padded = floor.shape != want.shape or bool(attrs.get("pads"))
    divides = any(n.op_type == "Div" for n in out.graph.node)
    assert divides == (padded and not attrs.get("count_include_pad"))


def test_average_pool_with_ceil_mode_at_an_unknown_size_is_refused_in_one_line():
    model = window_model("AveragePool", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"
    with pytest.raises(
        UnsupportedOpError,
        match=r"^m.onnx: node 'win' \(AveragePool\) uses ceil_mode=1 on an input",
    ):
        RewriteAveragePoolPass("m.onnx")(ir.from_proto(model))


def lrn_spec(x, size, alpha=1e-4, beta=0.75, bias=1.0):
    """LRN as the ONNX operator spec writes it, in numpy (onnx 1.17's reference evaluator and
    the spec disagree; ORT's kernel agrees with the spec but takes odd sizes only)."""
    square_sum = np.zeros_like(x)
    for c in range(x.shape[1]):
        lo = max(0, c - (size - 1) // 2)
        hi = min(x.shape[1] - 1, c + math.ceil((size - 1) / 2))
        square_sum[:, c] = (x[:, lo : hi + 1] ** 2).sum(axis=1)
    return x / (bias + alpha / size * square_sum) ** beta


@pytest.mark.parametrize(
    "attrs",
    [
        {"size": 3},
        {"size": 4, "alpha": 1e-3, "beta": 0.5, "bias": 2.0},  # even size: asymmetric window
        {"size": 5, "alpha": 1e-4, "beta": 0.75},  # AlexNet's
    ],
)
@pytest.mark.parametrize("opset", [12, 17])
def test_lrn_rewrite_computes_the_same(attrs, opset):
    model = window_model("LRN", **attrs)
    model.opset_import[0].version = opset
    out, modified = rewrite(RewriteLrnPass(), model)
    assert modified and "LRN" not in {n.op_type for n in out.graph.node}
    assert [i.name for i in out.graph.initializer] == [i.name for i in model.graph.initializer]
    onnx.checker.check_model(out)
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32) * 3
    got = window_output(out, x)
    conv = window_output(window_model("Identity"), x)  # the LRN's input
    np.testing.assert_allclose(got, lrn_spec(conv, **attrs), rtol=1e-5, atol=1e-5)
    if attrs["size"] % 2:
        np.testing.assert_allclose(got, window_output(model, x), rtol=1e-5, atol=1e-5)
    assert rewrite(RewriteLrnPass(), out)[1] is False


def test_rewritten_windows_are_idempotent_and_add_no_trainable_tensor(tmp_path):
    model = window_model("AveragePool", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    legal = load_model(save_model(model, tmp_path))
    assert LoadedModel.from_proto(legal, source="m").names == ["w", "b", "fw", "fb"]
    assert run_passes(legalization_pipeline(), ir.from_proto(legal)).modified is False


class _Net(torch.nn.Module):
    """Conv -> ReLU -> AvgPool(3, 1, 1, count_include_pad=False) [-> LRN(5)] -> Conv -> Linear.

    torch exports LocalResponseNorm as Pad/AveragePool/If, so the ONNX model gets an LRN node
    put in by hand; torch's LRN and ONNX's agree for odd sizes."""

    def __init__(self, lrn: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lrn = lrn
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.pool = torch.nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        self.conv2 = torch.nn.Conv2d(8, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 8 * 8, 3)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        if self.lrn:
            x = torch.nn.functional.local_response_norm(x, 5, alpha=1e-2, beta=0.75, k=1.0)
        return self.fc(torch.flatten(self.conv2(x), 1))


def test_gradients_through_rewritten_windows_match_torch_at_a_symbolic_batch(tmp_path):
    """ORT's AveragePoolGrad allocates a batch of 0 at a symbolic batch (SIGFPE or a failed
    Sum); after the rewrites a batch-4 backward pass gives torch's gradients for every tensor,
    the ones before the pool and the LRN included."""
    path = tmp_path / "net.onnx"
    torch.onnx.export(
        _Net(lrn=False).eval(),
        torch.zeros(1, 3, 8, 8),
        str(path),
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    proto = onnx.load(str(path))
    (pool,) = [n for n in proto.graph.node if n.op_type == "AveragePool"]
    for node in proto.graph.node:
        node.input[:] = ["lrn_out" if i == pool.output[0] else i for i in node.input]
    index = list(proto.graph.node).index(pool) + 1
    lrn = helper.make_node("LRN", [pool.output[0]], ["lrn_out"], size=5, alpha=1e-2, beta=0.75)
    proto.graph.node.insert(index, lrn)
    model = LoadedModel.load(save_model(proto, tmp_path, "with_lrn.onnx"))
    ops = {n.op_type for n in model.proto.graph.node}
    assert "AveragePool" not in ops and "LRN" not in ops
    trainable, frozen = model.split(np.ones(len(model.names), dtype=bool))
    paths, _ = ArtifactCache(tmp_path / "artifacts").get(
        model.proto, trainable, frozen, weight_decay=0.0
    )
    session = GradientSession(paths.directory, threads=1, input_names=model.input_names)
    session.set_parameters(model.initial_weights(), model.names)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    y = np.array([0, 1, 2, 1], dtype=np.int64)
    session.accumulate([(x, y)])
    net = _Net(lrn=True).eval()
    loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    params = dict(net.named_parameters())
    assert len(model.names) == len(params) == 6
    for name, (torch_name, param) in zip(model.names, params.items(), strict=True):
        np.testing.assert_allclose(
            session.gradient(name), param.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=torch_name
        )


# ---- GlobalMaxPool / spatial ReduceMax -> MaxPool; nearest Resize -> Expand (issue 27) -----


def _reduce_max_model(axes, keepdims, channels_last=False) -> onnx.ModelProto:
    """x -> Conv -> [Transpose to NHWC] -> ReduceMax(axes, keepdims) [-> Flatten] -> Gemm."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1])]
    value = "c"
    if channels_last:
        nodes.append(helper.make_node("Transpose", ["c"], ["t"], name="nhwc", perm=[0, 2, 3, 1]))
        value = "t"
    nodes.append(helper.make_node("ReduceMax", [value], ["o"], name="win", axes=axes,
                                  keepdims=keepdims))  # fmt: skip
    flat = "o"
    if keepdims:
        nodes.append(helper.make_node("Flatten", ["o"], ["f"], name="flat"))
        flat = "f"
    nodes.append(helper.make_node("Gemm", [flat, "fw", "fb"], ["y"], name="fc", transB=1))
    inits = [
        random_initializer("w", (6, 3, 3, 3), scale=1.0),
        random_initializer("b", (6,), scale=1.0),
        random_initializer("fw", (4, 6), scale=1.0),
        random_initializer("fb", (4,), scale=1.0),
    ]
    model = make_model(nodes, inits, in_shape=(1, 3, 8, 8))
    model.opset_import[0].version = 17  # ReduceMax takes axes as an attribute until opset 18
    return model


@pytest.mark.parametrize(
    "model",
    [
        window_model("GlobalMaxPool"),
        _reduce_max_model([2, 3], 1),
        _reduce_max_model([-2, -1], 0),
        _reduce_max_model([1, 2], 1, channels_last=True),
        _reduce_max_model([1, 2], 0, channels_last=True),
    ],
    ids=["global", "reduce_keep", "reduce_flat", "reduce_nhwc_keep", "reduce_nhwc_flat"],
)
def test_spatial_max_becomes_max_pool_and_computes_the_same(model):
    out, modified = rewrite(RewriteGlobalMaxPass(), model)
    ops = {n.op_type for n in out.graph.node}
    assert modified and "MaxPool" in ops and not ops & {"GlobalMaxPool", "ReduceMax"}
    onnx.checker.check_model(out)
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(window_output(out, x), window_output(model, x))


def test_channel_max_is_not_rewritten():
    model = _reduce_max_model([1], 1)
    assert rewrite(RewriteGlobalMaxPass(), model)[1] is False


def _resize_model(scales, **attrs) -> onnx.ModelProto:
    """x -> Conv -> Resize(scales, nearest) -> GlobalAveragePool -> Flatten -> Gemm."""
    model = window_model("Identity")
    node = next(n for n in model.graph.node if n.name == "win")
    node.op_type = "Resize"
    node.input[:] = ["c", "", "scales"]
    node.attribute.extend(
        helper.make_attribute(k, v) for k, v in {"mode": "nearest", **attrs}.items()
    )
    model.graph.initializer.append(
        onnx.numpy_helper.from_array(np.array(scales, np.float32), "scales")
    )
    return model


RESIZES = [
    ([1, 1, 2, 2], {}),  # half_pixel, round_prefer_floor: ONNX's defaults
    ([1, 1, 2, 2], {"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}),
    ([1, 1, 3, 2], {"coordinate_transformation_mode": "pytorch_half_pixel"}),
]


@pytest.mark.parametrize(("scales", "attrs"), RESIZES)
def test_nearest_resize_by_integer_scales_becomes_expand(scales, attrs):
    model = _resize_model(scales, **attrs)
    out, modified = rewrite(RewriteNearestResizePass(), model)
    ops = {n.op_type for n in out.graph.node}
    assert modified and "Resize" not in ops and "Expand" in ops
    onnx.checker.check_model(out)
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(window_output(out, x), window_output(model, x))


@pytest.mark.parametrize(
    ("scales", "attrs"),
    [
        ([1, 1, 2, 2], {"coordinate_transformation_mode": "asymmetric"}),  # rounds, not floor
        ([1, 1, 1.5, 1.5], {}),
        ([1, 1, 2, 2], {"mode": "linear"}),
    ],
)
def test_other_resizes_are_left_alone(scales, attrs):
    assert rewrite(RewriteNearestResizePass(), _resize_model(scales, **attrs))[1] is False


class _MaxUpNet(torch.nn.Module):
    """Conv -> ReLU -> nearest Upsample x2 -> Conv -> max over the spatial axes -> Linear (a
    decoder's upsampling and a global max pool, exported as Resize and ReduceMax)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.up = torch.nn.Upsample(scale_factor=2, mode="nearest")
        self.conv2 = torch.nn.Conv2d(8, 6, 3, padding=1)
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x):
        x = self.conv2(self.up(torch.relu(self.conv1(x))))
        return self.fc(x.amax(dim=(2, 3)))


def test_gradients_through_max_pool_and_upsample_rewrites_match_torch(tmp_path):
    path = tmp_path / "net.onnx"
    torch.onnx.export(
        _MaxUpNet().eval(), torch.zeros(1, 3, 8, 8), str(path), input_names=["input"],
        output_names=["logits"], dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17, dynamo=False,
    )  # fmt: skip
    exported = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"Resize", "ReduceMax"} <= exported
    model = LoadedModel.load(path)
    ops = {n.op_type for n in model.proto.graph.node}
    assert not ops & {"Resize", "ReduceMax"}
    trainable, frozen = model.split(np.ones(len(model.names), dtype=bool))
    paths, _ = ArtifactCache(tmp_path / "artifacts", static_batch=(4, model.input_shapes())).get(
        model.proto, trainable, frozen, weight_decay=0.0
    )
    session = GradientSession(paths.directory, threads=1, input_names=model.input_names)
    session.set_parameters(model.initial_weights(), model.names)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    y = np.array([0, 1, 2, 1], dtype=np.int64)
    session.accumulate([(x, y)])
    net = _MaxUpNet().eval()
    torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    params = dict(net.named_parameters())
    assert len(model.names) == len(params) == 6
    for name, (torch_name, param) in zip(model.names, params.items(), strict=True):
        np.testing.assert_allclose(
            session.gradient(name), param.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=torch_name
        )


@pytest.mark.parametrize("size", [8, 7])
def test_timm_avg_down_with_ceil_mode_loads_and_computes_torchs_output(tmp_path, size):
    """timm's "d" ResNets downsample with ``AvgPool2d(2, 2, ceil_mode=True,
    count_include_pad=False)``: at an even size it is floor mode; at an odd one the last
    window covers one row, divided by its real count as torch does."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * ((size + 1) // 2) ** 2, 3),
    ).eval()
    path = tmp_path / "avg_down.onnx"
    torch.onnx.export(net, torch.zeros(1, 3, size, size), str(path), dynamo=False,
                      opset_version=17, input_names=["input"], output_names=["logits"])  # fmt: skip
    model = LoadedModel.load(path)
    assert "AveragePool" not in {n.op_type for n in model.proto.graph.node}
    x = np.random.default_rng(0).standard_normal((1, 3, size, size)).astype(np.float32)
    session = ort.InferenceSession(
        model.proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (got,) = session.run(None, {"input": x})
    np.testing.assert_allclose(got, net(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_global_max_pool_sized_through_shape_arithmetic_is_rewritten():
    """tf2onnx's UpSampling2D leaves spatial dims that only data propagation finds (a Reshape
    to Concat(Shape(x)[:2], [8, 8])): they are found, and the pool rewritten."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Shape", ["c"], ["s"], name="shape", end=2),
        helper.make_node("Concat", ["s", "hw"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["c", "target"], ["r"], name="reshape"),
        helper.make_node("GlobalMaxPool", ["r"], ["o"], name="win"),
        helper.make_node("Flatten", ["o"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1),
    ]
    inits = [
        random_initializer("w", (6, 3, 3, 3), scale=1.0),
        random_initializer("b", (6,), scale=1.0),
        onnx.numpy_helper.from_array(np.array([8, 8], np.int64), "hw"),
        random_initializer("fw", (4, 6), scale=1.0),
        random_initializer("fb", (4,), scale=1.0),
    ]
    model = make_model(nodes, inits, in_shape=("N", 3, 8, 8))
    out, modified = rewrite(RewriteGlobalMaxPass(), model)
    assert modified and "GlobalMaxPool" not in {n.op_type for n in out.graph.node}
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(window_output(out, x), window_output(model, x))
