"""Frozen parameters baked into a session's graphs as constants (issue #16): the pass on a
hand-built training graph, and training steps of baked vs unbaked artifacts from the same
checkpoint giving the same losses, weights and running statistics."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes import PreconditionError

from etgraph.artifact_weights import bake_frozen
from etgraph.artifacts import generate
from etgraph.checkpoint import CarriedState, write_checkpoint
from etgraph.data import load_dataset
from etgraph.sessions import TrainingSession
from passes.base import run_passes
from passes.onnx import (
    BakeFrozenParamsPass,
    DropUnusedOptionalOutputsPass,
    bakeable_params,
    training_model_pipeline,
)


def _training_like_graph() -> ir.Model:
    """x -> Conv(w frozen, b trainable) -> BatchNormInternal(gamma, beta, mean, var); ``b``
    has its gradient accumulation buffer as ORT's training graphs do."""
    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("x", f, [1, 2, 3, 3]),
        helper.make_tensor_value_info("w", f, [2, 2, 1, 1]),
        helper.make_tensor_value_info("b", f, [2]),
        helper.make_tensor_value_info("b_grad.accumulation.buffer", f, [2]),
        helper.make_tensor_value_info("gamma", f, [2]),
        helper.make_tensor_value_info("beta", f, [2]),
        helper.make_tensor_value_info("mean", f, [2]),
        helper.make_tensor_value_info("var", f, [2]),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
        helper.make_node(
            "BatchNormInternal",
            ["c", "gamma", "beta", "mean", "var"],
            ["y", "m_out", "v_out", "sm", "sv"],
            name="bn",
            domain="com.microsoft",
        ),
    ]
    outputs = [helper.make_tensor_value_info("y", f, None)]
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    return ir.from_proto(model)


def test_bakeable_params_are_the_frozen_parameters_only():
    model = _training_like_graph()
    weights = {n: np.ones(s, np.float32) for n, s in [("w", (2, 2, 1, 1)), ("b", (2,))]}
    weights.update({n: np.ones(2, np.float32) for n in ("gamma", "beta", "mean", "var")})
    # b is trained (accumulation buffer); mean/var are updated by the batch norm; x is data
    assert bakeable_params(model, weights) == ["w", "gamma", "beta"]
    assert run_passes(BakeFrozenParamsPass(weights, ["w", "gamma", "beta"]), model).modified
    assert [v.name for v in model.graph.inputs] == [
        "x",
        "b",
        "b_grad.accumulation.buffer",
        "mean",
        "var",
    ]
    assert sorted(model.graph.initializers) == ["beta", "gamma", "w"]
    np.testing.assert_array_equal(model.graph.initializers["w"].const_value.numpy(), weights["w"])
    assert bakeable_params(model, weights) == []
    assert not run_passes(BakeFrozenParamsPass(weights, []), model).modified


def test_bake_needs_every_value():
    with pytest.raises(PreconditionError, match=r"no value for frozen parameters \['w'\]"):
        run_passes(BakeFrozenParamsPass({}, ["w"]), _training_like_graph())


def test_bake_refuses_a_value_of_another_shape():
    weights = {"w": np.ones((3, 2, 1, 1), np.float32)}
    with pytest.raises(PreconditionError, match=r"w: value shape \(3, 2, 1, 1\) != graph input"):
        run_passes(BakeFrozenParamsPass(weights, ["w"]), _training_like_graph())


@pytest.mark.slow
@pytest.mark.parametrize("frozen_bn", ["inference", "train"])
def test_baked_session_trains_exactly_like_the_generated_artifacts(
    tmp_path, default_model, frozen_bn
):
    model = default_model
    n = len(model.tensors)
    mask = np.zeros(n, dtype=bool)
    mask[9:] = True  # batch norms 0-2 frozen, 3-4 trained
    trainable, frozen = model.split(mask)
    initial = model.initial_weights()
    paths = generate(model.proto, trainable, frozen, tmp_path / "a", frozen_bn=frozen_bn)
    data = load_dataset(None, input_shape=tuple(*model.input_shapes().values()))
    batches = list(data.train_batches(4, seed=1))[:3]
    results = {}
    for bake in (False, True):
        ckpt = tmp_path / f"{bake}.ckpt"
        write_checkpoint(ckpt, CarriedState(dict(initial)), trainable, initial_learning_rate=1e-3)
        session = TrainingSession(
            paths.directory, ckpt, threads=1, input_names=["input"], bake=bake
        )
        losses = [session.train_step(*batches[0], 1e-3)[0]]
        # the first step's gradients (the reset is lazy: they stay until the next step)
        grads = {t: session.state.parameters[t].grad.copy() for t in trainable}
        losses += [session.train_step(x, y, 1e-3)[0] for x, y in batches[1:]]
        results[bake] = losses, grads, session.weights()
    (loss0, g0, w0), (loss1, g1, w1) = results[False], results[True]
    # Conv + BN folded into the constants reassociates float sums: equal to float rounding
    np.testing.assert_allclose(loss1, loss0, rtol=1e-4)
    for name in trainable:
        scale = float(np.abs(g0[name]).max())
        np.testing.assert_allclose(g1[name], g0[name], rtol=1e-4, atol=1e-5 * scale, err_msg=name)
    assert sorted(w1) == sorted(w0)  # the checkpoint still holds every parameter
    for name in w0:  # AdamW's first steps move a weight by about lr whatever |g| is
        np.testing.assert_allclose(w1[name], w0[name], atol=3e-3, err_msg=name)
    for name in frozen:
        if name not in model.running_stats:
            np.testing.assert_array_equal(w1[name], initial[name])
    moved = {s for s in model.running_stats if not np.array_equal(w1[s], initial[s])}
    assert moved == {s for s in model.running_stats if not np.array_equal(w0[s], initial[s])}
    assert moved  # the trained layers' statistics move in both


@pytest.mark.slow
def test_bake_frozen_writes_constants_and_skips_all_trainable(tmp_path, default_model):
    model = default_model
    mask = np.zeros(len(model.tensors), dtype=bool)
    mask[-2:] = True
    trainable, frozen = model.split(mask)
    paths = generate(model.proto, trainable, frozen, tmp_path / "a", frozen_bn="inference")
    weights = model.initial_weights()
    out = bake_frozen(paths.directory, weights, tmp_path / "baked")
    assert out == tmp_path / "baked"
    for name in ("training_model.onnx", "eval_model.onnx"):
        baked = ir.load(out / name)
        inputs = {v.name for v in baked.graph.inputs}
        assert not inputs & set(frozen)  # every frozen parameter, statistics included
        assert set(trainable) <= inputs
        values = {
            t.name: numpy_helper.to_array(t, base_dir=str(out))
            for t in onnx.load(str(out / name)).graph.initializer
            if t.name in weights
        }
        assert values and all(np.array_equal(v, weights[n]) for n, v in values.items())
    # one raw file, each frozen tensor once: the eval graph references the training graph's
    assert {p.name for p in out.iterdir()} == {
        "training_model.onnx", "training_model.onnx.data", "eval_model.onnx",
        "optimizer_model.onnx",
    }  # fmt: skip
    large = [weights[n].nbytes for n in frozen if weights[n].nbytes >= 1024]
    size = (out / "training_model.onnx.data").stat().st_size
    assert sum(large) <= size < sum(large) + 4096 * len(large)
    full, none = model.split(np.ones(len(model.tensors), dtype=bool))
    everything = generate(model.proto, full, none, tmp_path / "full")
    assert bake_frozen(everything.directory, weights, tmp_path / "b2") == everything.directory
    assert not (tmp_path / "b2").exists()


def _maxpool_graph(indices_used: bool) -> ir.Model:
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("MaxPool", ["x"], ["p", "p_mask"], name="pool", kernel_shape=[2, 2]),
        helper.make_node("Relu", ["p"], ["y"], name="relu"),
    ]
    outputs = [helper.make_tensor_value_info("y", f, None)]
    if indices_used:
        nodes.append(helper.make_node("Cast", ["p_mask"], ["i"], name="cast", to=f))
        outputs.append(helper.make_tensor_value_info("i", f, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", f, [1, 1, 4, 4])], outputs
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_unused_maxpool_indices_are_dropped():
    model = _maxpool_graph(indices_used=False)
    assert run_passes(training_model_pipeline(), model).modified
    pool = next(n for n in model.graph if n.op_type == "MaxPool")
    assert [v.name for v in pool.outputs] == ["p"]
    assert not run_passes(training_model_pipeline(), model).modified
    used = _maxpool_graph(indices_used=True)
    assert not run_passes(DropUnusedOptionalOutputsPass(), used).modified
    assert len(next(n for n in used.graph if n.op_type == "MaxPool").outputs) == 2


@pytest.mark.slow
def test_training_graph_keeps_maxpool_indices_only_where_the_gradient_needs_them(tmp_path):
    """A frozen MaxPool's Indices (added by generate_artifacts) are dropped; a MaxPool the
    gradient passes keeps them for MaxPoolGrad."""
    f = TensorProto.FLOAT
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 1, (4, 3, 3, 3)).astype(np.float32), "w0"),
        numpy_helper.from_array(rng.normal(0, 1, (5, 4 * 4 * 4)).astype(np.float32), "w1"),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "w0"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("MaxPool", ["c"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "w1"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", f, ["B", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", f, ["B", 5])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    for trainable, frozen, outputs in ((["w1"], ["w0"], 1), (["w0", "w1"], [], 2)):
        paths = generate(proto, trainable, frozen, tmp_path / str(outputs))
        training = ir.load(paths.training_model)
        pool = next(n for n in training.graph if n.op_type == "MaxPool")
        assert len(pool.outputs) == outputs
