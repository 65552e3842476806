"""Import, validation and legalisation of ONNX models (etgraph.onnx_io)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from etgraph.errors import ConfigError, ModelError, UnsupportedOpError
from etgraph.model import LoadedModel, input_shape, parse_input_shape
from etgraph.onnx_io import load_model, model_hash


def _init(name: str, shape, seed: int = 0) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)


def make_model(nodes, inits, *, x="x", y="y", in_shape=(1, 3, 8, 8), out_shape=(1, 4), inputs=None):
    """A small opset-17 model: input ``x`` -> nodes -> output ``y``."""
    graph = helper.make_graph(
        nodes,
        "g",
        inputs or [helper.make_tensor_value_info(x, TensorProto.FLOAT, list(in_shape))],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, list(out_shape))],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def conv_head(act_nodes, act_out: str):
    """x -> Conv(w, b) -> <act_nodes reading 'c', writing act_out> -> GAP -> Flatten -> Gemm."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        *act_nodes,
        helper.make_node("GlobalAveragePool", [act_out], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1),
    ]
    inits = [_init("w", (6, 3, 3, 3)), _init("b", (6,)), _init("fw", (4, 6)), _init("fb", (4,))]
    return make_model(nodes, inits)


def save(model, tmp_path, name="m.onnx"):
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def test_load_valid_model_renames_input_and_output(tmp_path):
    model = load_model(
        save(conv_head([helper.make_node("Relu", ["c"], ["r"], name="relu")], "r"), tmp_path)
    )
    assert [i.name for i in model.graph.input] == ["input"]
    assert [o.name for o in model.graph.output] == ["logits"]
    assert model.graph.node[0].input[0] == "input"
    assert model.graph.node[-1].output[0] == "logits"
    assert model.ir_version <= 10


def test_missing_file(tmp_path):
    with pytest.raises(ModelError, match="nope.onnx: no such model file"):
        load_model(tmp_path / "nope.onnx")


def test_non_onnx_bytes(tmp_path):
    path = tmp_path / "junk.onnx"
    path.write_bytes(b"\xff\xfe this is not a protobuf \x00\x01\x02" * 10)
    with pytest.raises(ModelError, match="junk.onnx") as info:
        load_model(path)
    assert "\n" not in str(info.value)


def test_truncated_file(tmp_path):
    data = conv_head([], "c").SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="cut.onnx") as info:
        load_model(path)
    assert "\n" not in str(info.value)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(ModelError, match="empty.onnx"):
        load_model(path)


def test_no_trainable_initializers(tmp_path):
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["y"], name="flat"),
    ]
    with pytest.raises(ModelError, match="no trainable tensors"):
        LoadedModel.load(save(make_model(nodes, [], out_shape=(1, 3)), tmp_path))


def test_two_inputs_refused(tmp_path):
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8]),
        helper.make_tensor_value_info("x2", TensorProto.FLOAT, [1, 3, 8, 8]),
    ]
    nodes = [
        helper.make_node("Add", ["x", "x2"], ["s"], name="add"),
        helper.make_node("Conv", ["s", "w"], ["c"], name="conv"),
        helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["y"], name="flat"),
    ]
    model = make_model(nodes, [_init("w", (4, 3, 3, 3))], inputs=inputs)
    with pytest.raises(ModelError, match="exactly one graph input"):
        load_model(save(model, tmp_path))


def test_unsupported_op_names_node_and_suggests(tmp_path):
    model = conv_head([helper.make_node("Softplus", ["c"], ["s"], name="my_softplus")], "s")
    with pytest.raises(UnsupportedOpError, match="'my_softplus'.*Softplus.*log\\(1 \\+ exp"):
        load_model(save(model, tmp_path))


def test_global_max_pool_refused(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("GlobalMaxPool", ["c"], ["p"], name="gmp"),
        helper.make_node("Flatten", ["p"], ["y"], name="flat"),
    ]
    with pytest.raises(UnsupportedOpError, match="'gmp'.*GlobalMaxPool"):
        load_model(save(make_model(nodes, [_init("w", (4, 3, 3, 3))]), tmp_path))


@pytest.mark.parametrize("op", ["HardSwish", "HardSigmoid"])
def test_hard_activations_rewritten_with_same_outputs(tmp_path, op):
    original = conv_head([helper.make_node(op, ["c"], ["h"], name="hact")], "h")
    path = save(original, tmp_path)
    legal = load_model(path)
    assert op not in {n.op_type for n in legal.graph.node}
    # the rewrite adds Constant nodes, not initializers: no new "trainable" tensors
    assert {i.name for i in legal.graph.initializer} == {"w", "b", "fw", "fb"}
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32) * 3
    want = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    got = ort.InferenceSession(legal.SerializeToString()).run(None, {"input": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_variadic_sum_rewritten_as_adds(tmp_path):
    nodes = [
        helper.make_node("Relu", ["c"], ["r1"], name="r1"),
        helper.make_node("Sigmoid", ["c"], ["r2"], name="r2"),
        helper.make_node("Sum", ["c", "r1", "r2"], ["s"], name="sum3"),
    ]
    legal = load_model(save(conv_head(nodes, "s"), tmp_path))
    ops = [n.op_type for n in legal.graph.node]
    assert "Sum" not in ops and ops.count("Add") == 2


def test_layernorm_and_dropout_get_optional_outputs(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("LayerNormalization", ["f", "g", "be"], ["n"], name="ln", axis=-1),
        helper.make_node("Dropout", ["n"], ["d"], name="drop"),
        helper.make_node("Gemm", ["d", "fw"], ["y"], name="fc", transB=1),
    ]
    inits = [_init("w", (6, 3, 3, 3)), _init("g", (6,)), _init("be", (6,)), _init("fw", (4, 6))]
    legal = load_model(save(make_model(nodes, inits), tmp_path))
    by_name = {n.name: n for n in legal.graph.node}
    assert len(by_name["ln"].output) == 3 and all(by_name["ln"].output)
    assert len(by_name["drop"].output) == 2 and all(by_name["drop"].output)
    onnx.checker.check_model(legal)


def test_unnamed_and_duplicate_nodes_get_unique_names(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Relu", ["c"], ["r"], name="dup"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="dup"),
        helper.make_node("Flatten", ["p"], ["y"]),
    ]
    legal = load_model(save(make_model(nodes, [_init("w", (4, 3, 3, 3))]), tmp_path))
    names = [n.name for n in legal.graph.node]
    assert all(names) and len(set(names)) == len(names)


def test_opset_above_21_is_converted_or_refused(tmp_path):
    model = conv_head([helper.make_node("Relu", ["c"], ["r"], name="relu")], "r")
    model.opset_import[0].version = 22
    model.ir_version = 10
    legal = load_model(save(model, tmp_path))
    assert legal.opset_import[0].version <= 21


def test_ir_version_above_10_is_lowered(tmp_path):
    model = conv_head([helper.make_node("Relu", ["c"], ["r"], name="relu")], "r")
    model.ir_version = 11
    assert load_model(save(model, tmp_path)).ir_version == 10


def test_input_shape_static_symbolic_and_override():
    model = conv_head([], "c")
    assert input_shape(model) == (3, 8, 8)
    assert input_shape(model, "3x16x16") == (3, 16, 16)
    with pytest.raises(ConfigError, match="channels"):
        input_shape(model, (1, 16, 16))
    sym = conv_head([], "c")
    for d in sym.graph.input[0].type.tensor_type.shape.dim:
        d.dim_param = "n"
    with pytest.raises(ConfigError, match="symbolic"):
        input_shape(sym)
    assert input_shape(sym, "3x32x32") == (3, 32, 32)
    with pytest.raises(ConfigError, match="malformed"):
        input_shape(sym, "3x32")


@pytest.mark.parametrize("text", ["3x224", "axbxc", "3x0x4", "", "3x2x2x2"])
def test_parse_input_shape_malformed(text):
    with pytest.raises(ConfigError):
        parse_input_shape(text)


def test_parse_input_shape():
    assert parse_input_shape("3x224x224") == (3, 224, 224)
    assert parse_input_shape(" 1,28,28 ") == (1, 28, 28)


def test_model_hash_ignores_weights_not_structure():
    a = conv_head([], "c")
    b = conv_head([], "c")
    b.graph.initializer[0].CopyFrom(_init("w", (6, 3, 3, 3), seed=5))
    c = conv_head([helper.make_node("Relu", ["c"], ["r"], name="relu")], "r")
    assert model_hash(a) == model_hash(b)
    assert model_hash(a) != model_hash(c)
    assert len(model_hash(a)) == 16
