"""Fuzzing over exporter families (issue 27): small graphs written the way torch's dynamo
exporter, tf2onnx, skl2onnx and paddle2onnx write them, mutated as in ``test_fuzz.py`` and run in
its crash-isolated worker — each compiles or raises :class:`~etgraph.errors.EtgraphError`, never
another exception, never a native crash (a dead worker names the model that killed it)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import random_initializer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from test_fuzz import Worker, _check, mutate_model, mutation_lists
from test_wild import skl_mlp

MAX_EXAMPLES = 24
FULL_COMPILE_EVERY = 6


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("fuzz-exporters") / "worker-stderr.log")
    yield w
    w.close()


def _model(nodes, inits, inputs, outputs, producer: str, opset: int = 17, ml: bool = False):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("ai.onnx.ml", 1)] * ml)
    model = helper.make_model(graph, opset_imports=opsets, producer_name=producer)
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def torch_dynamo() -> onnx.ModelProto:
    """As torch's dynamo exporter writes a conv net with ``optimize=False``: a zero conv bias
    made by CastLike + Expand, inference BatchNormalization, ReduceMean over space, a Reshape
    to the export batch (Concat of ``value_ints`` Constants, ``allowzero=1``), opset 18."""
    ints = lambda name, v: helper.make_node("Constant", [], [name], value_ints=v)  # noqa: E731
    nodes = [
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0.0))),
        helper.make_node("CastLike", ["zero", "x"], ["zero_f"]),
        ints("bias_shape", [6]),
        helper.make_node("Expand", ["zero_f", "bias_shape"], ["bias"]),
        helper.make_node("Conv", ["x", "w", "bias"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], ["n"]),
        helper.make_node("Relu", ["n"], ["r"]),
        ints("axes", [-1, -2]),
        helper.make_node("ReduceMean", ["r", "axes"], ["m"], keepdims=1),
        ints("b", [1]),
        ints("k", [6]),
        helper.make_node("Concat", ["b", "k"], ["shape"], axis=0),
        helper.make_node("Reshape", ["m", "shape"], ["flat"], allowzero=1),
        helper.make_node("Gemm", ["flat", "fw", "fb"], ["y"], transB=1),
    ]
    for i, node in enumerate(nodes):
        node.name = f"node_{node.op_type}_{i}"
    inits = [
        random_initializer("w", (6, 3, 3, 3), 0),
        numpy_helper.from_array(np.ones(6, np.float32), "g"),
        random_initializer("beta", (6,), 1),
        random_initializer("mean", (6,), 2),
        numpy_helper.from_array(np.ones(6, np.float32), "var"),
        random_initializer("fw", (4, 6), 3),
        random_initializer("fb", (4,), 4),
    ]
    return _model(
        nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], "pytorch", opset=18,
    )  # fmt: skip


def tf2onnx_keras() -> onnx.ModelProto:
    """As tf2onnx writes a Keras conv net: a channels-last input transposed for the Conv,
    GlobalMaxPool, Squeeze, MatMul + Add and a Softmax output."""
    nodes = [
        helper.make_node("Transpose", ["input"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalMaxPool", ["r"], ["p"]),
        helper.make_node("Squeeze", ["p", "axes"], ["s"]),
        helper.make_node("MatMul", ["s", "fw"], ["mm"]),
        helper.make_node("Add", ["mm", "fb"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["dense"], axis=-1),
    ]
    for i, node in enumerate(nodes):
        node.name = f"sequential/{node.op_type}_{i}"
    inits = [
        random_initializer("w", (6, 3, 3, 3), 0),
        random_initializer("b", (6,), 1),
        numpy_helper.from_array(np.array([2, 3], np.int64), "axes"),
        random_initializer("fw", (6, 3), 2),
        random_initializer("fb", (3,), 3),
    ]
    return _model(
        nodes, inits, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 8, 8, 3])],
        [helper.make_tensor_value_info("dense", TensorProto.FLOAT, ["N", 3])], "tf2onnx",
    )  # fmt: skip


def paddle2onnx() -> onnx.ModelProto:
    """As paddle2onnx writes a classifier: symbolic batch and spatial dims (``--input-shape``
    needed), inference BatchNormalization, GlobalAveragePool, Flatten, MatMul + Add, Softmax."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], ["n"]),
        helper.make_node("Relu", ["n"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("MatMul", ["f", "fw"], ["mm"]),
        helper.make_node("Add", ["mm", "fb"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["save_infer_model/scale_0.tmp_0"], axis=1),
    ]
    for i, node in enumerate(nodes):
        node.name = f"p2o.{node.op_type}.{i}"
    inits = [
        random_initializer("w", (6, 3, 3, 3), 0),
        numpy_helper.from_array(np.ones(6, np.float32), "g"),
        random_initializer("beta", (6,), 1),
        random_initializer("mean", (6,), 2),
        numpy_helper.from_array(np.ones(6, np.float32), "var"),
        random_initializer("fw", (6, 4), 3),
        random_initializer("fb", (4,), 4),
    ]
    out = "save_infer_model/scale_0.tmp_0"
    return _model(
        nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, "h", "w"])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, [-1, 4])], "PaddlePaddle",
    )  # fmt: skip


EXPORTER_BASES = {
    "torch_dynamo": torch_dynamo,
    "tf2onnx_keras": tf2onnx_keras,
    "skl2onnx_mlp": lambda: skl_mlp(zipmap=False),
    "skl2onnx_zipmap": lambda: skl_mlp(zipmap=True),
    "paddle2onnx": paddle2onnx,
}
#: The input shape each base compiles at unmutated (paddle2onnx's spatial dims are symbolic).
SHAPES = {"paddle2onnx": "3x8x8"}


def test_exporter_bases_compile(worker, tmp_path):
    """The bases as exported (so mutations, not the bases, cause the errors)."""
    for name, make in EXPORTER_BASES.items():
        reply = _check(worker, tmp_path, make(), full=False, shape=SHAPES.get(name), label=name)
        assert reply["status"] == "ok", (name, reply)


@pytest.mark.slow  # every FULL_COMPILE_EVERY-th example profiles and compiles end to end
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    base=st.sampled_from(sorted(EXPORTER_BASES)),
    mutations=mutation_lists,
    shape=st.sampled_from([None, "3x8x8", "8x8x3", "3x5x7"]),
    example=st.integers(0, FULL_COMPILE_EVERY - 1),
)
def test_mutated_exporter_models_compile_or_raise_etgraph_error(
    worker, tmp_path_factory, base, mutations, shape, example
):
    model = mutate_model(EXPORTER_BASES[base](), mutations)
    label = f"{base}+" + "+".join(f"{m}({s})" for m, s in mutations) + f"@{shape}"
    tmp_path = tmp_path_factory.mktemp("fuzz")
    _check(worker, tmp_path, model, full=example == 0, shape=shape, label=label)
