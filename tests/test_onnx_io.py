"""Import, validation and legalisation of ONNX models (etgraph.onnx_io, passes.onnx).

The first part loads files through :func:`etgraph.onnx_io.load_model` (the whole pipeline, as
the CLI does); the second runs each legalisation pass alone on a tiny ``onnx_ir`` model; the
last checks that what onnx_ir writes loads in ORT 1.19.2 and that legalisation is idempotent.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import make_model, random_initializer, save_model
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes import PostconditionError, PreconditionError

from etgraph.artifacts import generate
from etgraph.errors import ConfigError, ModelError, UnsupportedOpError
from etgraph.graph import build_tensor_graph
from etgraph.io_specs import (
    exported_batch,
    exported_batch_hint,
    input_shapes,
    parse_input_shapes,
)
from etgraph.model import LoadedModel
from etgraph.onnx_io import legalize, load_model, model_hash, restore_exported
from etgraph.ops import data_path_values, node_reads
from etgraph.sessions import TrainingSession, evaluate_onnx
from passes.base import describe_pipeline, run_passes
from passes.onnx import (
    MAX_IR_VERSION,
    MAX_OPSET,
    AddOptionalOutputsPass,
    ConvertOpsetPass,
    ExpandSumPass,
    LowerIrVersionPass,
    MaterializeWeightsPass,
    NameNodesPass,
    RefuseNoGradOpsPass,
    RewriteActivationsPass,
    SelectOutputPass,
    TrimEvalBatchNormPass,
    eval_model_pipeline,
    legalization_pipeline,
    training_model_pipeline,
)
from passes.onnx.node_names import check_node_names


def conv_head(act_nodes, act_out: str):
    """x -> Conv(w, b) -> <act_nodes reading 'c', writing act_out> -> GAP -> Flatten -> Gemm."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        *act_nodes,
        helper.make_node("GlobalAveragePool", [act_out], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1),
    ]
    inits = [
        random_initializer("w", (6, 3, 3, 3), scale=1.0),
        random_initializer("b", (6,), scale=1.0),
        random_initializer("fw", (4, 6), scale=1.0),
        random_initializer("fb", (4,), scale=1.0),
    ]
    return make_model(nodes, inits)


def test_load_valid_model_keeps_input_and_output_names(tmp_path):
    model = load_model(
        save_model(conv_head([helper.make_node("Relu", ["c"], ["r"], name="relu")], "r"), tmp_path)
    )
    assert [i.name for i in model.graph.input] == ["x"]
    assert [o.name for o in model.graph.output] == ["y"]
    assert model.graph.node[0].input[0] == "x"
    assert model.graph.node[-1].output[0] == "y"
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
        LoadedModel.load(save_model(make_model(nodes, [], out_shape=(1, 3)), tmp_path))


def test_two_inputs_each_have_a_shape(tmp_path):
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
    model = make_model(nodes, [random_initializer("w", (4, 3, 3, 3), scale=1.0)], inputs=inputs)
    with pytest.raises(ConfigError, match=r"names no input, and the model has 2 inputs"):
        LoadedModel.load(save_model(model, tmp_path)).input_shapes("3x8x8")
    shapes = LoadedModel.load(save_model(model, tmp_path)).input_shapes()
    assert shapes == {"x": (3, 8, 8), "x2": (3, 8, 8)}


def test_unsupported_op_names_node_and_suggests(tmp_path):
    model = conv_head([helper.make_node("Softplus", ["c"], ["s"], name="my_softplus")], "s")
    with pytest.raises(UnsupportedOpError, match="'my_softplus'.*Softplus.*log\\(1 \\+ exp"):
        load_model(save_model(model, tmp_path))


def test_global_max_pool_of_unknown_spatial_size_refused(tmp_path):
    """Rewritten as MaxPool over the whole window when the spatial dims are static
    (tests/test_rewrite_windows.py); at symbolic ones it stays and is refused."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("GlobalMaxPool", ["c"], ["p"], name="gmp"),
        helper.make_node("Flatten", ["p"], ["y"], name="flat"),
    ]
    model = make_model(
        nodes, [random_initializer("w", (4, 3, 3, 3), scale=1.0)], in_shape=("N", 3, "H", "W")
    )
    with pytest.raises(UnsupportedOpError, match="'gmp'.*GlobalMaxPool.*static spatial dims"):
        load_model(save_model(model, tmp_path))


@pytest.mark.parametrize("op", ["HardSwish", "HardSigmoid"])
def test_hard_activations_rewritten_with_same_outputs(tmp_path, op):
    original = conv_head([helper.make_node(op, ["c"], ["h"], name="hact")], "h")
    path = save_model(original, tmp_path)
    legal = load_model(path)
    assert op not in {n.op_type for n in legal.graph.node}
    # the rewrite adds Constant nodes, not initializers: no new "trainable" tensors
    assert {i.name for i in legal.graph.initializer} == {"w", "b", "fw", "fb"}
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32) * 3
    want = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    got = ort.InferenceSession(legal.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_variadic_sum_rewritten_as_adds(tmp_path):
    nodes = [
        helper.make_node("Relu", ["c"], ["r1"], name="r1"),
        helper.make_node("Sigmoid", ["c"], ["r2"], name="r2"),
        helper.make_node("Sum", ["c", "r1", "r2"], ["s"], name="sum3"),
    ]
    legal = load_model(save_model(conv_head(nodes, "s"), tmp_path))
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
    inits = [
        random_initializer("w", (6, 3, 3, 3), scale=1.0),
        random_initializer("g", (6,), scale=1.0),
        random_initializer("be", (6,), scale=1.0),
        random_initializer("fw", (4, 6), scale=1.0),
    ]
    legal = load_model(save_model(make_model(nodes, inits), tmp_path))
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
    legal = load_model(
        save_model(make_model(nodes, [random_initializer("w", (4, 3, 3, 3), scale=1.0)]), tmp_path)
    )
    names = [n.name for n in legal.graph.node]
    assert all(names) and len(set(names)) == len(names)


def test_opset_above_21_is_converted_or_refused(tmp_path):
    model = conv_head([helper.make_node("Relu", ["c"], ["r"], name="relu")], "r")
    model.opset_import[0].version = 22
    model.ir_version = 10
    legal = load_model(save_model(model, tmp_path))
    assert legal.opset_import[0].version <= 21


@pytest.mark.parametrize(
    "outputs", [["n"], ["n", "mean_out", "var_out", "saved_mean", "saved_var"]]
)
def test_opset_13_batch_norm_is_upgraded_and_generates_artifacts(tmp_path, outputs):
    """paddle2onnx writes opset 13, whose BatchNormalization has no training form (3 outputs
    are refused by ORT's opset-9 schema): such a model is converted to opset 17 first. A torch
    TRAINING export at opset 11-13 names all 5 outputs; the two opset 14 removed go first."""
    bn = helper.make_node("BatchNormalization", ["c", "g", "be", "mu", "var"], outputs, name="bn")
    model = conv_head([bn], "n")
    model.graph.initializer.extend(
        numpy_helper.from_array(np.full(6, v, np.float32), name)
        for name, v in (("g", 1.0), ("be", 0.0), ("mu", 0.0), ("var", 1.0))
    )
    model.opset_import[0].version = 13
    loaded = LoadedModel.load(save_model(model, tmp_path))
    assert loaded.proto.opset_import[0].version == 17
    trainable, frozen = loaded.split(np.ones(len(loaded.tensors), bool))
    assert generate(loaded.proto, trainable, frozen, tmp_path / "art").exists()


def test_input_read_by_batch_norm_and_concat_trains(tmp_path):
    """x -> BatchNormalization and x -> Concat: ORT's BatchNormalizationGrad names its input
    gradient x_grad, Concat's gradient too ("Duplicate definition of name (x_grad)"); behind an
    Identity the model generates artifacts and computes the same."""
    nodes = [
        helper.make_node("BatchNormalization", ["x", "g", "be", "mu", "var"], ["n"], name="bn"),
        helper.make_node("Concat", ["n", "x"], ["cat"], name="cat", axis=1),
        helper.make_node("Conv", ["cat", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["y"], name="flat"),
    ]
    inits = [random_initializer("w", (4, 6, 3, 3), 1), random_initializer("b", (4,), 2)]
    inits += [
        numpy_helper.from_array(np.full(3, v, np.float32), name)
        for name, v in (("g", 1.5), ("be", 0.1), ("mu", 0.2), ("var", 2.0))
    ]
    original = make_model(nodes, inits)
    loaded = LoadedModel.load(save_model(original, tmp_path))
    bn = next(n for n in loaded.proto.graph.node if n.op_type == "BatchNormalization")
    assert bn.input[0] == "bn/input"
    trainable, frozen = loaded.split(np.ones(len(loaded.tensors), bool))
    assert generate(loaded.proto, trainable, frozen, tmp_path / "art").exists()
    assert run_passes(legalization_pipeline(), ir.from_proto(loaded.proto)).modified is False


@pytest.mark.parametrize("tied", [False, True])
def test_shared_weights_warn_when_tied(tmp_path, caplog, tied):
    """A shared constant-valued bias is an exporter's deduplication (untied at info); shared
    arbitrary values are tied weights: untied with a warning that says the tie is gone."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c1", "w2", "b"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c2"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["y"], name="flat"),
    ]
    b = (
        random_initializer("b", (6,), 3)
        if tied
        else numpy_helper.from_array(np.zeros(6, np.float32), "b")
    )
    inits = [
        random_initializer("w1", (6, 3, 3, 3), 1),
        random_initializer("w2", (6, 6, 3, 3), 2),
        b,
    ]
    with caplog.at_level(logging.INFO, logger="passes.onnx.weights"):
        load_model(save_model(make_model(nodes, inits, out_shape=(1, 6)), tmp_path))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == (
        ["tensor 'b' 6 is read by 2 layers (tied weights): etgraph trains one copy per layer, so "
         "the trained model no longer ties them"] if tied else []
    )  # fmt: skip
    assert any("untied" in r.getMessage() for r in caplog.records) != tied


def test_shared_and_aliased_weights_get_one_tensor_per_layer(tmp_path):
    """An eval-mode torch export deduplicates identical folded biases: one initializer read by
    several convolutions, directly or through Identity. Each layer gets its own tensor, and the
    model computes the same."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Identity", ["b"], ["b_alias"], name="alias"),
        helper.make_node("Conv", ["c1", "w2", "b_alias"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c2", "w3", "b"], ["c3"], name="conv3", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c3"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["y"], name="flat"),
    ]
    shapes = {"w1": (6, 3, 3, 3), "w2": (6, 6, 3, 3), "w3": (6, 6, 3, 3), "b": (6,)}
    inits = [random_initializer(n, s, i) for i, (n, s) in enumerate(shapes.items())]
    original = make_model(nodes, inits, out_shape=(1, 6))
    legal = load_model(save_model(original, tmp_path))
    tensors = LoadedModel.from_proto(legal, source="m").tensors
    biases = [t.name for t in tensors if t.kind == "bias"]
    assert len(biases) == 3 and len(set(biases)) == 3
    assert "Identity" not in {n.op_type for n in legal.graph.node}
    x = sample()
    np.testing.assert_allclose(ort_run(legal, x), ort_run(original, x), rtol=1e-5, atol=1e-6)
    assert run_passes(legalization_pipeline(), ir.from_proto(legal)).modified is False


def test_ir_version_above_10_is_lowered(tmp_path):
    model = conv_head([helper.make_node("Relu", ["c"], ["r"], name="relu")], "r")
    model.ir_version = 11
    assert load_model(save_model(model, tmp_path)).ir_version == 10


def test_input_shape_static_symbolic_and_override():
    model = conv_head([], "c")
    assert input_shapes(model) == {"x": (3, 8, 8)}
    assert input_shapes(model, "3x16x16") == {"x": (3, 16, 16)}
    assert input_shapes(model, "x=1x3x16x16") == {"x": (3, 16, 16)}  # batch dim given: dropped
    with pytest.raises(ConfigError, match="channels"):
        input_shapes(model, (1, 16, 16))
    sym = conv_head([], "c")
    for d in sym.graph.input[0].type.tensor_type.shape.dim:
        d.dim_param = "n"
    with pytest.raises(ConfigError, match="symbolic"):
        input_shapes(sym)
    assert input_shapes(sym, "3x32x32") == {"x": (3, 32, 32)}
    with pytest.raises(ConfigError, match="does not fit input 'x' of rank 4: use CxHxW"):
        input_shapes(sym, "3x32")


@pytest.mark.parametrize("text", ["axbxc", "3x0x4", "", "=3x2", "x=3x", "3x2;2"])
def test_parse_input_shape_malformed(text):
    with pytest.raises(ConfigError, match="use CxHxW"):
        parse_input_shapes(text)


def test_parse_input_shape():
    assert parse_input_shapes("3x224x224") == {None: (3, 224, 224)}
    assert parse_input_shapes(" 1,28,28 ") == {None: (1, 28, 28)}
    assert parse_input_shapes(["input_ids=1x128", "mask=128"]) == {
        "input_ids": (1, 128),
        "mask": (128,),
    }
    with pytest.raises(ConfigError, match="gives input 'a' twice"):
        parse_input_shapes(["a=3", "a=4"])


def test_model_hash_ignores_weights_not_structure():
    a = conv_head([], "c")
    b = conv_head([], "c")
    b.graph.initializer[0].CopyFrom(random_initializer("w", (6, 3, 3, 3), seed=5, scale=1.0))
    c = conv_head([helper.make_node("Relu", ["c"], ["r"], name="relu")], "r")
    assert model_hash(a) == model_hash(b)
    assert model_hash(a) != model_hash(c)
    assert len(model_hash(a)) == 16
    b.graph.value_info.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 6, 8, 8]))
    assert model_hash(b) == model_hash(a)  # shape annotations are not structure


# ---- each legalisation pass alone, on a tiny onnx_ir model ----------------------------------


def run_pass(pass_, model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """Run one pass on ``model`` (as an onnx_ir model); returns (the result as a proto,
    modified)."""
    result = pass_(ir.from_proto(model))
    return ir.to_proto(result.model), result.modified


def ort_run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def sample(shape=(1, 3, 8, 8), seed: int = 1) -> np.ndarray:
    """A float32 batch spread over the kinks of the hard activations (-3, 0, 3)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3


def nodes_by_name(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {n.name: n for n in model.graph.node}


def relu_head():
    return conv_head([helper.make_node("Relu", ["c"], ["r"], name="relu")], "r")


def test_convert_opset_pass_converts_above_21_only():
    model = relu_head()
    model.opset_import[0].version = 22
    model.ir_version = 10
    out, modified = run_pass(ConvertOpsetPass("m.onnx"), model)
    assert modified and [(o.domain, o.version) for o in out.opset_import] == [("", MAX_OPSET)]
    assert ort_run(out, sample()).shape == (1, 4)  # ORT 1.19.2 loads the converted model
    assert run_pass(ConvertOpsetPass("m.onnx"), out)[1] is False
    assert run_pass(ConvertOpsetPass("m.onnx"), relu_head())[1] is False


def test_convert_opset_pass_refuses_what_it_cannot_convert():
    model = relu_head()
    model.opset_import[0].version = 99
    with pytest.raises(ModelError, match=r"^m.onnx: opset 99 is newer than .* re-export with"):
        ConvertOpsetPass("m.onnx")(ir.from_proto(model))


def test_lower_ir_version_pass():
    model = relu_head()
    model.ir_version = 11
    out, modified = run_pass(LowerIrVersionPass(), model)
    assert modified and out.ir_version == MAX_IR_VERSION
    model.ir_version = 8
    out, modified = run_pass(LowerIrVersionPass(), model)
    assert not modified and out.ir_version == 8


def test_select_output_pass_keeps_the_only_output_and_names():
    out, modified = run_pass(SelectOutputPass(), relu_head())
    assert not modified
    assert [i.name for i in out.graph.input] == ["x"]
    assert [o.name for o in out.graph.output] == ["y"]


def test_select_output_pass_picks_one_of_several_outputs():
    model = relu_head()
    model.graph.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    with pytest.raises(ConfigError, match=r"^m.onnx has 2 outputs \['y', 'r'\]: .* --output NAME"):
        SelectOutputPass("m.onnx")(ir.from_proto(model))
    with pytest.raises(ConfigError, match=r"m.onnx has no output 'z': choose --output from"):
        SelectOutputPass("m.onnx", "z")(ir.from_proto(model))
    out, modified = run_pass(SelectOutputPass("m.onnx", "r"), model)
    assert modified and [o.name for o in out.graph.output] == ["r"]
    assert "fc" not in nodes_by_name(out)  # the nodes only the dropped output used are gone
    assert run_pass(SelectOutputPass("m.onnx", "r"), out)[1] is False


def test_name_nodes_pass_names_unnamed_and_duplicate_nodes():
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Relu", ["c"], ["r"], name="dup"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="dup"),
        helper.make_node("Flatten", ["p"], ["y"]),
    ]
    model = make_model(nodes, [random_initializer("w", (4, 3, 3, 3), scale=1.0)])
    out, modified = run_pass(NameNodesPass(), model)
    assert modified and [n.name for n in out.graph.node] == ["Conv_0", "dup", "dup_1", "Flatten_3"]
    assert run_pass(NameNodesPass(), out)[1] is False


def test_node_names_postcondition_is_checked_by_code():
    graph = ir.from_proto(conv_head([helper.make_node("Relu", ["c"], ["r"], name="conv")], "r"))
    with pytest.raises(PostconditionError, match="1 duplicate name"):
        check_node_names(graph.graph)
    graph.graph.node(0).name = ""
    with pytest.raises(PostconditionError, match="1 unnamed node"):
        check_node_names(graph.graph)


def test_left_out_optional_outputs_stay_left_out(tmp_path):
    """An empty output name means "not computed" (MaxPool's Indices here): legalisation and
    the rewrites (onnxscript's driver would name every unnamed value) leave it empty."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("MaxPool", ["c"], ["m", ""], kernel_shape=[2, 2]),
        helper.make_node("HardSwish", ["m"], ["h"]),
        helper.make_node("Sum", ["h", "h"], ["s"]),
        helper.make_node("GlobalAveragePool", ["s"], ["p"]),
        helper.make_node("Flatten", ["p"], ["y"]),
    ]
    model = make_model(nodes, [random_initializer("w", (4, 3, 3, 3), scale=1.0)])
    legal = load_model(save_model(model, tmp_path))
    (maxpool,) = [list(n.output) for n in legal.graph.node if n.op_type == "MaxPool"]
    assert maxpool in (["m"], ["m", ""])  # onnx_ir writes no trailing empty output names
    x = sample()
    np.testing.assert_allclose(ort_run(legal, x), ort_run(model, x), rtol=1e-5, atol=1e-5)


def test_add_optional_outputs_pass():
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Identity", ["f"], ["ln/mean"], name="taken"),
        helper.make_node("LayerNormalization", ["ln/mean", "g", "be"], ["n"], name="ln"),
        helper.make_node("LayerNormalization", ["n", "g", "be"], ["n2", "", ""], name="ln2"),
        helper.make_node("Dropout", ["n2"], ["d"], name="drop"),
        helper.make_node("Gemm", ["d", "fw"], ["y"], name="fc", transB=1),
    ]
    inits = [
        random_initializer("w", (6, 3, 3, 3), scale=1.0),
        random_initializer("g", (6,), scale=1.0),
        random_initializer("be", (6,), scale=1.0),
        random_initializer("fw", (4, 6), scale=1.0),
    ]
    model = make_model(nodes, inits)
    out, modified = run_pass(AddOptionalOutputsPass(), model)
    names = nodes_by_name(out)
    assert modified
    assert list(names["ln"].output) == ["n", "ln/mean_1", "ln/inv_std_dev"]  # no name clash
    assert list(names["ln2"].output) == ["n2", "ln2/mean", "ln2/inv_std_dev"]
    assert list(names["drop"].output) == ["d", "drop/mask"]
    onnx.checker.check_model(out)
    assert run_pass(AddOptionalOutputsPass(), out)[1] is False
    model.graph.node[0].name = ""
    with pytest.raises(PreconditionError, match="nodes must be named first"):
        AddOptionalOutputsPass()(ir.from_proto(model))


@pytest.mark.parametrize(
    ("op", "attrs"),
    [("HardSwish", {}), ("HardSigmoid", {}), ("HardSigmoid", {"alpha": 0.3, "beta": 0.4})],
)
@pytest.mark.parametrize("at_output", [False, True])
def test_rewrite_hard_activations_pass_computes_the_same(op, attrs, at_output):
    if at_output:  # the activation produces the graph output itself
        fc = helper.make_node("Gemm", ["f", "fw", "fb"], ["z"], name="fc", transB=1)
        nodes = [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
            helper.make_node("Flatten", ["p"], ["f"], name="flat"),
            fc,
            helper.make_node(op, ["z"], ["y"], name="hact", **attrs),
        ]
        inits = [
            random_initializer("w", (6, 3, 3, 3), scale=1.0),
            random_initializer("b", (6,), scale=1.0),
            random_initializer("fw", (4, 6), scale=1.0),
            random_initializer("fb", (4,), scale=1.0),
        ]
        model = make_model(nodes, inits)
    else:
        model = conv_head([helper.make_node(op, ["c"], ["h"], name="hact", **attrs)], "h")
    out, modified = run_pass(RewriteActivationsPass(), model)
    assert modified and op not in {n.op_type for n in out.graph.node}
    assert {n.name for n in out.graph.node if n.name.startswith("hact/")} >= {"hact/Clip"}
    assert [i.name for i in out.graph.initializer] == [i.name for i in model.graph.initializer]
    assert [o.name for o in out.graph.output] == ["y"]
    onnx.checker.check_model(out)
    x = sample()
    np.testing.assert_allclose(ort_run(out, x), ort_run(model, x), rtol=1e-5, atol=1e-5)
    assert run_pass(RewriteActivationsPass(), out)[1] is False


@pytest.mark.parametrize(
    ("op", "attrs"),
    [
        ("Elu", {}),
        ("Elu", {"alpha": 0.5}),
        ("Selu", {}),
        ("Selu", {"alpha": 1.2, "gamma": 0.9}),
        ("Celu", {}),
        ("Celu", {"alpha": 2.0}),
        ("PRelu", {}),
    ],
)
def test_rewrite_exponential_activations_and_prelu_compute_the_same(op, attrs):
    inputs = ["c", "slope"] if op == "PRelu" else ["c"]
    model = conv_head([helper.make_node(op, inputs, ["h"], name="act", **attrs)], "h")
    if op == "PRelu":  # one slope per channel, negative ones included
        model.graph.initializer.append(random_initializer("slope", (6, 1, 1), seed=5, scale=1.0))
    out, modified = run_pass(RewriteActivationsPass(), model)
    assert modified and op not in {n.op_type for n in out.graph.node}
    assert {n.op_type for n in out.graph.node} >= {"Relu", "Neg"}
    onnx.checker.check_model(out)
    for seed in (1, 2):  # the conv output has both signs
        x = sample(seed=seed)
        np.testing.assert_allclose(ort_run(out, x), ort_run(model, x), rtol=1e-5, atol=1e-5)
    # a trainable slope is read by a Mul now: frozen, as the module docstring says
    assert [i.name for i in out.graph.initializer] == [i.name for i in model.graph.initializer]


@pytest.mark.parametrize("terms", [1, 2, 3])
def test_expand_sum_pass_computes_the_same(terms):
    nodes = [
        helper.make_node("Relu", ["c"], ["r1"], name="r1"),
        helper.make_node("Sigmoid", ["c"], ["r2"], name="r2"),
        helper.make_node("Sum", ["c", "r1", "r2"][:terms], ["s"], name="sum"),
    ]
    model = conv_head(nodes, "s")
    out, modified = run_pass(ExpandSumPass(), model)
    ops = [n.op_type for n in out.graph.node]
    assert modified and "Sum" not in ops
    assert ops.count("Add") == terms - 1 and ops.count("Identity") == (terms == 1)
    x = sample()
    np.testing.assert_allclose(ort_run(out, x), ort_run(model, x), rtol=1e-5, atol=1e-5)
    assert run_pass(ExpandSumPass(), out)[1] is False


def test_control_flow_reading_the_data_is_refused():
    """An If whose branches read the data from the outer scope (torch's export of
    ``.squeeze(dim)`` on a symbolic dim): its only input is the condition, yet it is on the data
    path (:func:`etgraph.ops.node_reads`) and refused, not left to abort ORT's session."""
    branch = {
        name: helper.make_graph(
            [helper.make_node(op, ["c"], [f"{name}_out"], name=f"{name}_op")],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)],
        )
        for name, op in (("then", "Identity"), ("else", "Relu"))
    }
    nodes = [
        helper.make_node("Constant", [], ["cond"], name="cond", value=numpy_helper.from_array(
            np.array(True))),
        helper.make_node("If", ["cond"], ["s"], name="branchy", then_branch=branch["then"],
                         else_branch=branch["else"]),
    ]  # fmt: skip
    model = conv_head(nodes, "s")
    assert node_reads(model.graph.node[2]) == ["cond", "c"]
    assert "s" in data_path_values(model.graph)
    model.producer_name = "pytorch"  # the torch hint, for a torch export only
    with pytest.raises(UnsupportedOpError, match=r"node 'branchy' uses op If, .* \.flatten\(1\)"):
        RefuseNoGradOpsPass("m.onnx")(ir.from_proto(model))
    model.producer_name = "tf2onnx"
    with pytest.raises(UnsupportedOpError) as refused:
        RefuseNoGradOpsPass("m.onnx")(ir.from_proto(model))
    assert "squeeze" not in str(refused.value)
    assert str(refused.value).endswith(
        "export without data-dependent control flow in the TensorFlow/Keras (or JAX through "
        "jax2tf) model and convert it again with tf2onnx"
    )


def test_refuse_no_grad_ops_pass_on_and_off_the_data_path():
    softplus = helper.make_node("Softplus", ["c"], ["s"], name="sp")
    with pytest.raises(
        UnsupportedOpError,
        match=r"^m.onnx: node 'sp' uses op Softplus, which has no gradient in "
        r"onnxruntime-training 1.19.2; rewrite as log\(1 \+ exp\(x\)\) and re-export$",
    ):
        RefuseNoGradOpsPass("m.onnx")(ir.from_proto(conv_head([softplus], "s")))
    # off the data path (a constant's branch), the same op is harmless
    off_path = [
        helper.make_node("Constant", [], ["k"], name="k", value=numpy_helper.from_array(
            np.ones((1, 6, 1, 1), np.float32))),
        helper.make_node("Softplus", ["k"], ["ks"], name="sp"),
        helper.make_node("Add", ["c", "ks"], ["a"], name="add"),
    ]  # fmt: skip
    out, modified = run_pass(RefuseNoGradOpsPass("m.onnx"), conv_head(off_path, "a"))
    assert not modified and "Softplus" in {n.op_type for n in out.graph.node}


def test_refuse_no_grad_ops_pass_requires_sorted_nodes():
    model = relu_head()
    nodes = list(model.graph.node)[::-1]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    with pytest.raises(PreconditionError, match="precedes its input"):
        RefuseNoGradOpsPass()(ir.from_proto(model))


def batch_norm_model(outputs: list[str], graph_outputs: tuple[str, ...] = ()) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "g", "b", "mu", "var"], outputs, name="bn"),
        helper.make_node("GlobalAveragePool", ["n"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["y"], name="flat"),
    ]
    inits = [
        random_initializer("w", (4, 3, 3, 3), scale=1.0),
        random_initializer("g", (4,), scale=1.0),
        random_initializer("b", (4,), scale=1.0),
        random_initializer("mu", (4,), scale=1.0),
    ]
    inits.append(numpy_helper.from_array(np.ones(4, np.float32), "var"))
    model = make_model(nodes, inits)
    for name in graph_outputs:
        model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    return model


def test_trim_eval_batchnorm_pass():
    model = batch_norm_model(["n", "rm", "rv"])
    out, modified = run_pass(TrimEvalBatchNormPass(), model)
    assert modified and list(nodes_by_name(out)["bn"].output) == ["n"]
    assert ort_run(out, sample()).shape == (1, 4)  # loads as the inference op it now is
    assert run_pass(TrimEvalBatchNormPass(), out)[1] is False
    used = batch_norm_model(["n", "rm", "rv"], graph_outputs=("rm",))
    with pytest.raises(PreconditionError, match=r"uses BatchNormalization outputs \['rm'\]"):
        TrimEvalBatchNormPass()(ir.from_proto(used))


# ---- the pipeline ---------------------------------------------------------------------------


def test_pipeline_order_can_be_printed():
    described = describe_pipeline(legalization_pipeline())
    assert [line.split(":")[0].split(". ")[1] for line in described] == [
        "ConvertOpsetPass",
        "LowerIrVersionPass",
        "RemoveInitializersFromInputsPass",
        "MaterializeWeightsPass",
        "UntieSharedWeightsPass",
        "SelectOutputPass",
        "DropOutputNoOpsPass",
        "RemoveSoftmaxHeadPass",
        "DropOutputNoOpsPass",
        "FlattenClassOutputPass",
        "FreeBatchDimPass",
        "NameNodesPass",
        "AddOptionalOutputsPass",
        "TrainableBatchNormPass",
        "IsolateInputNormPass",
        "RewriteActivationsPass",
        "RewriteAveragePoolPass",
        "RewriteLrnPass",
        "RewriteGlobalMaxPass",
        "RewriteNearestResizePass",
        "ExpandSumPass",
        "CastLikePass",
        "RefuseNoGradOpsPass",
    ]
    assert all(": " in line and "\n" not in line for line in described)
    assert [line.split(":")[0] for line in describe_pipeline(eval_model_pipeline())] == [
        "1. TrimEvalBatchNormPass"
    ]
    assert [line.split(":")[0] for line in describe_pipeline(training_model_pipeline())] == [
        "1. DropUnusedOptionalOutputsPass"
    ]


def test_user_error_in_the_pipeline_reaches_the_caller_as_itself():
    model = ir.from_proto(conv_head([helper.make_node("Atan", ["c"], ["a"], name="atan")], "a"))
    with pytest.raises(UnsupportedOpError, match="^m.onnx: node 'atan' uses op Atan"):
        run_passes(legalization_pipeline("m.onnx"), model)


def test_legalize_leaves_its_argument_alone():
    model = conv_head([helper.make_node("HardSwish", ["c"], ["h"])], "h")
    before = model.SerializeToString()
    legal = legalize(model, source="m")
    assert model.SerializeToString() == before
    assert legal.graph.input[0].name == "x"


def test_opset_22_model_legalised_runs_in_ort(tmp_path):
    model = conv_head([helper.make_node("HardSigmoid", ["c"], ["h"], name="hs")], "h")
    model.opset_import[0].version = 22
    model.ir_version = 10
    legal = load_model(save_model(model, tmp_path))
    assert legal.ir_version <= MAX_IR_VERSION and legal.opset_import[0].version == MAX_OPSET
    assert ort_run(legal, sample()).shape == (1, 4)


@pytest.mark.parametrize(
    "fixture", ["default_model_path", "tiny_cnn_onnx", "resnet18s_onnx", "tiny_vit_onnx"]
)
def test_legalisation_is_idempotent_and_ort_loads_it(fixture, request, tmp_path):
    """``etgraph compile`` writes the legalised model.onnx that train/inspect load again; its
    profile is matched by model_hash, so loading it again must give the same model."""
    path = request.getfixturevalue(fixture)
    legal = load_model(path)
    again = load_model(save_model(legal, tmp_path, "legal.onnx"))
    assert model_hash(again) == model_hash(legal)
    assert again.SerializeToString() == legal.SerializeToString()
    assert run_passes(legalization_pipeline(), ir.from_proto(legal)).modified is False
    assert legal.ir_version <= MAX_IR_VERSION
    assert all(o.version <= MAX_OPSET for o in legal.opset_import if o.domain in ("", "ai.onnx"))
    names = [n.name for n in legal.graph.node]
    assert all(names) and len(set(names)) == len(names)
    # an export that is legal already keeps its hash: profiles measured before stay valid
    assert model_hash(legal) == model_hash(onnx.load(str(path)))
    x = sample((2, 3, 32, 32))
    got = ort_run(legal, x)
    if "Dropout" not in {n.op_type for n in legal.graph.node}:  # else random in training mode
        np.testing.assert_allclose(got, ort_run(onnx.load(str(path)), x), rtol=1e-5, atol=1e-5)


# ---- models from elsewhere: old opsets, IR < 4, weights held in nodes (issue #14) ----------


def zoo_style_model() -> onnx.ModelProto:
    """An opset-9, IR-3 classifier as the Caffe2-era zoo ships them: initializers also listed
    as graph inputs, the conv kernel produced by ConstantOfShape from a shape initializer, the
    dense kernel held in a Constant node, a float scalar and an int64 shape left as they are."""
    rng = np.random.default_rng(3)
    fw = rng.standard_normal((4, 6)).astype(np.float32)
    nodes = [
        helper.make_node("ConstantOfShape", ["w_shape"], ["w"], name="w_fill",
                         value=numpy_helper.from_array(np.array([0.05], np.float32))),
        helper.make_node("Constant", [], ["fw"], name="fw_const",
                         value=numpy_helper.from_array(fw)),
        helper.make_node("Constant", [], ["half"], name="half",
                         value=numpy_helper.from_array(np.array(0.5, np.float32))),
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["c", "half"], ["h"], name="scale"),
        helper.make_node("GlobalAveragePool", ["h"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1),
    ]  # fmt: skip
    inits = [
        numpy_helper.from_array(np.array([6, 3, 3, 3], np.int64), "w_shape"),
        random_initializer("b", (6,), scale=1.0),
        random_initializer("fb", (4,), seed=1, scale=1.0),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])] + [
        helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in inits
    ]
    model = make_model(nodes, inits, inputs=inputs)
    model.opset_import[0].version = 9
    model.ir_version = 3
    return model


def test_zoo_style_model_is_upgraded_and_its_weights_found(tmp_path):
    original = zoo_style_model()
    legal = load_model(save_model(original, tmp_path))
    assert legal.opset_import[0].version == 17 and 8 <= legal.ir_version <= 10
    assert [i.name for i in legal.graph.input] == ["x"]  # initializers are inputs no more
    inits = {i.name for i in legal.graph.initializer}
    assert {"w", "fw", "b"} <= inits and "w_shape" not in inits  # the shape's only use is gone
    ops = [n.op_type for n in legal.graph.node]
    assert "ConstantOfShape" not in ops and ops.count("Constant") == 1  # the scalar stays
    tensors = LoadedModel.from_proto(legal, source="zoo").tensors
    assert [(t.name, t.kind) for t in tensors] == [
        ("w", "kernel"),
        ("b", "bias"),
        ("fw", "kernel"),
        ("fb", "bias"),
    ]
    # exported at batch 1, it now runs at any batch: two samples at once give what each gives
    assert legal.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    x1, x2 = sample(seed=1), sample(seed=2)
    both = ort_run(legal, np.concatenate([x1, x2]))
    np.testing.assert_allclose(both[:1], ort_run(original, x1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(both[1:], ort_run(original, x2), rtol=1e-5, atol=1e-6)
    # the export batch is recorded: an ORT failure at another batch says to use it
    assert exported_batch(legal) == 1
    with pytest.raises(
        ModelError,
        match=r"at batch 4: it was exported at batch 1, .*\(boom\)"
        r": use --batch-size 1, or export it with a dynamic batch dimension",
    ):
        with exported_batch_hint(legal, 4):
            raise ModelError("onnxruntime could not build it") from RuntimeError("boom")
    for batch, error in ((1, ModelError("kept")), (4, UnsupportedOpError("kept"))):
        with pytest.raises(ModelError, match="^kept$"), exported_batch_hint(legal, batch):
            raise error


@pytest.mark.parametrize("held_in", ["initializer", "Constant"])
def test_reshape_to_the_export_batch_copies_the_batch(tmp_path, held_in):
    """x[1, ...] -> Conv -> Reshape(shape [1, -1]) -> Gemm: the shape constant, an initializer
    (zoo models) or a Constant node (torch TRAINING exports), gets a leading 0."""
    shape = numpy_helper.from_array(np.array([1, -1], np.int64), "flat_shape")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["c", "flat_shape"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fw"], ["y"], name="fc", transB=1),
    ]
    inits = [random_initializer("w", (2, 3, 3, 3), scale=1.0)]
    inits.append(random_initializer("fw", (4, 2 * 8 * 8), seed=1, scale=0.1))
    if held_in == "Constant":
        nodes.insert(0, helper.make_node("Constant", [], ["flat_shape"], name="k", value=shape))
    else:
        inits.append(shape)
    original = make_model(nodes, inits)
    legal = load_model(save_model(original, tmp_path))
    x1, x2 = sample(seed=1), sample(seed=2)
    both = ort_run(legal, np.concatenate([x1, x2]))
    np.testing.assert_allclose(both[:1], ort_run(original, x1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(both[1:], ort_run(original, x2), rtol=1e-5, atol=1e-6)


def test_reshape_to_a_concatenated_export_batch_copies_the_batch(tmp_path):
    """torch's export of ``x.view(B, T * D)`` with B known at export (an attention's
    ``[B, T, heads, d]``): the shape is a Concat of Unsqueezed scalar Constants, the batch's
    shared with another shape. The Reshape's batch element becomes a 0 of its own."""
    scalar = {
        n: numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("b", 1), ("td", 24))
    }
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    nodes = [
        helper.make_node("Constant", [], ["b"], name="b", value=scalar["b"]),
        helper.make_node("Constant", [], ["td"], name="td", value=scalar["td"]),
        helper.make_node("Constant", [], ["axes"], name="axes", value=axes),
        helper.make_node("Unsqueeze", ["b", "axes"], ["b1"], name="ub"),
        helper.make_node("Unsqueeze", ["td", "axes"], ["td1"], name="utd"),
        helper.make_node("Concat", ["b1", "td1"], ["shape"], name="cat", axis=0),
        helper.make_node("Concat", ["b1", "b1"], ["other"], name="other_cat", axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fw"], ["y"], name="fc", transB=1),
    ]
    inits = [random_initializer("fw", (4, 24), scale=1.0)]
    original = make_model(nodes, inits, in_shape=(1, 4, 6))
    legal = load_model(save_model(original, tmp_path))
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((3, 1, 4, 6)).astype(np.float32)
    both = ort_run(legal, np.concatenate(list(xs)))
    expected = np.concatenate([ort_run(original, x) for x in xs])
    np.testing.assert_allclose(both, expected, rtol=1e-5, atol=1e-6)


def test_materialize_weights_pass_alone():
    model = ir.from_proto(zoo_style_model())
    result = MaterializeWeightsPass()(model)
    assert result.modified
    assert sorted(n.op_type for n in result.model.graph if n.op_type.startswith("Constant")) == [
        "Constant"
    ]
    assert not MaterializeWeightsPass()(result.model).modified  # nothing left to lift


def test_softmax_head_is_removed_for_the_loss_and_restored_on_export(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["z"], name="fc", transB=1),
        helper.make_node("Softmax", ["z"], ["prob"], name="softmax", axis=1),
    ]
    shapes = {"w": (6, 3, 3, 3), "b": (6,), "fw": (4, 6), "fb": (4,)}
    inits = [random_initializer(n, s, i) for i, (n, s) in enumerate(shapes.items())]
    original = make_model(nodes, inits, y="prob")
    legal = load_model(save_model(original, tmp_path))
    assert legal.graph.node[-1].op_type == "Gemm" and legal.graph.output[0].name == "prob"
    assert LoadedModel.from_proto(legal, source="m").head == "Softmax(axis=1)"
    assert build_tensor_graph(legal).graph["removed_head"] == "Softmax(axis=1)"  # for inspect
    assert load_model(save_model(legal, tmp_path, "again.onnx")).graph.node[-1].op_type == "Gemm"
    x = sample()
    logits = ort_run(legal, x)
    path = save_model(legal, tmp_path, "exported.onnx")
    restore_exported(path, "Softmax(axis=1)")
    restored = onnx.load(str(path))
    assert restored.graph.node[-1].op_type == "Softmax"
    assert restored.graph.output[0].name == "prob"
    np.testing.assert_allclose(ort_run(restored, x), ort_run(original, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ort_run(restored, x).sum(axis=1), 1.0, rtol=1e-5)
    assert not np.allclose(logits.sum(axis=1), 1.0)  # the loss sees logits, not probabilities


@pytest.mark.parametrize("softmax", [False, True])
def test_conv_classifier_output_is_flattened_and_restored_on_export(tmp_path, softmax):
    """SqueezeNet/DenseNet style (opset 9): a 1x1-conv classifier ends in [1, K, 1, 1], with or
    without a Softmax, which onnx's converter turns into Reshape(Softmax(Flatten(x)), Shape(x)).
    The loss gets [B, K] logits; the exported model gives the original output again."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
        helper.make_node("Conv", ["p", "cw", "cb"], ["z"], name="classifier"),
    ]
    if softmax:
        nodes.append(helper.make_node("Softmax", ["z"], ["prob"], name="softmax"))
    shapes = {"w": (6, 3, 3, 3), "b": (6,), "cw": (4, 6, 1, 1), "cb": (4,)}
    inits = [random_initializer(n, s, i, scale=1.0) for i, (n, s) in enumerate(shapes.items())]
    original = make_model(nodes, inits, y="prob" if softmax else "z", out_shape=(1, 4, 1, 1))
    original.opset_import[0].version = 9
    legal = load_model(save_model(original, tmp_path))
    out = legal.graph.output[0]
    assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == ["batch", 4]
    head = LoadedModel.from_proto(legal, source="m").head
    assert head == "Reshape(shape=0,-1,1,1)" + (" -> Softmax(axis=1)" if softmax else "")
    assert not {"Softmax", "Shape"} & {n.op_type for n in legal.graph.node}
    x = sample()
    assert ort_run(legal, x).shape == (1, 4)
    path = save_model(legal, tmp_path, "exported.onnx")
    restore_exported(path, head)
    restored = onnx.load(str(path))
    onnx.checker.check_model(restored, full_check=True)
    assert len({n.name for n in restored.graph.node}) == len(restored.graph.node)
    np.testing.assert_allclose(ort_run(restored, x), ort_run(original, x), rtol=1e-5, atol=1e-6)
    if softmax:
        return
    # the exported [B, K, 1, 1] model is scored as [B, K] logits: the same loss and accuracy
    xs = np.concatenate([sample(seed=s) for s in range(4)])
    logits = ort_run(legal, xs)
    labels = logits.argmax(axis=1)
    batches = [(xs, labels), (xs, (labels + 1) % 4)]  # all right, then all wrong
    scored = evaluate_onnx(path, batches, 4)
    expected = evaluate_onnx(save_model(legal, tmp_path, "legal.onnx"), batches, 4)
    assert scored == pytest.approx(expected) and scored[1] == pytest.approx(0.5)


def test_output_that_is_not_b_by_k_is_one_line(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["y"], name="conv"),
    ]  # [1, 4, 6, 6]: not a classifier ([B, K, 1, 1] is flattened, see above)
    model = make_model(nodes, [random_initializer("w", (4, 3, 3, 3))], out_shape=(1, 4, 6, 6))
    with pytest.raises(ModelError, match=r"output 'y' has shape \['batch', 4, 6, 6\]"):
        LoadedModel.load(save_model(model, tmp_path))


def test_per_token_output_says_it_is_not_supported(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="per_token")]
    model = make_model(nodes, [random_initializer("w", (8, 4))], in_shape=(1, 5, 8),
                       out_shape=(1, 5, 4))  # fmt: skip
    with pytest.raises(ModelError, match=r"\['batch', 5, 4\]: a label per position .* not "
                       "supported; .* pool over the sequence"):  # fmt: skip
        LoadedModel.load(save_model(model, tmp_path))


def test_inference_batch_norm_becomes_trainable(tmp_path):
    """An inference BatchNormalization (one output, training_mode 0) trains like a torch
    TRAINING export's: running statistics are frozen parameters ORT updates in each step."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "be", "mu", "var"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1),
    ]
    inits = [
        random_initializer("w", (6, 3, 3, 3), scale=1.0),
        numpy_helper.from_array(np.ones(6, np.float32), "g"),
        numpy_helper.from_array(np.zeros(6, np.float32), "be"),
        numpy_helper.from_array(np.zeros(6, np.float32), "mu"),
        numpy_helper.from_array(np.ones(6, np.float32), "var"),
        random_initializer("fw", (4, 6), seed=1),
        random_initializer("fb", (4,), seed=2),
    ]
    model = LoadedModel.from_proto(
        load_model(save_model(make_model(nodes, inits, in_shape=("N", 3, 8, 8)), tmp_path)),
        source="m",
    )
    bn = next(n for n in model.proto.graph.node if n.op_type == "BatchNormalization")
    assert len(bn.output) == 3 and all(bn.output)
    assert {a.name: a.i for a in bn.attribute}["training_mode"] == 1
    assert model.running_stats == ("mu", "var")
    trainable, frozen = model.split(np.ones(len(model.tensors), bool))
    paths = generate(model.proto, trainable, frozen, tmp_path / "art")
    session = TrainingSession(paths.directory, paths.checkpoint, threads=1, input_names=["x"])
    loss, _ = session.train_step(sample((2, 3, 8, 8)), np.array([0, 3], np.int64), 1e-3)
    assert np.isfinite(loss)
    assert not np.allclose(session.weights()["mu"], 0.0)  # the running mean was updated
