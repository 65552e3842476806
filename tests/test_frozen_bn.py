"""Frozen batch norm (``--frozen-bn``, issue #14): the inference-mode rewrite checked against
ONNX's own inference BatchNormalization, the artifacts cache key, running statistics of a
training step in both modes, and their exact carry across re-selection."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes import PreconditionError

from etgraph.artifacts import (
    ArtifactCache,
    generate,
    inference_batch_norms,
    selection_key,
)
from etgraph.checkpoint import CarriedState, read_checkpoint, write_checkpoint
from etgraph.config import TrainConfig
from etgraph.data import load_dataset
from etgraph.errors import ConfigError
from etgraph.loop import train
from etgraph.sessions import TrainingSession
from passes.base import run_passes
from passes.onnx import InferenceBatchNormPass, frozen_batch_norms


def _bn_model(shape, *, training_mode=1, seed=0):
    """input [shape] -> BatchNormalization (channels shape[1]) -> Relu -> output."""
    rng = np.random.default_rng(seed)
    c = shape[1]
    inits = [
        numpy_helper.from_array(rng.uniform(0.5, 2, c).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.normal(0, 1, c).astype(np.float32), "beta"),
        numpy_helper.from_array(rng.normal(0, 1, c).astype(np.float32), "mean"),
        numpy_helper.from_array(rng.uniform(0.1, 3, c).astype(np.float32), "var"),
    ]
    outputs = ["bn", "bn_mean", "bn_var"] if training_mode else ["bn"]
    nodes = [
        helper.make_node(
            "BatchNormalization",
            ["input", "gamma", "beta", "mean", "var"],
            outputs,
            name="BN",
            epsilon=1e-3,
            training_mode=training_mode,
        ),
        helper.make_node("Relu", ["bn"], ["logits"], name="Relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, list(shape))],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString()).run(None, {"input": x})[0]


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 6), (2, 3, 7)])
def test_inference_rewrite_equals_inference_batch_norm(shape):
    x = np.random.default_rng(1).normal(0, 2, shape).astype(np.float32)
    reference = _run(_bn_model(shape, training_mode=0), x)
    model = ir.from_proto(_bn_model(shape))
    assert frozen_batch_norms(model, ["gamma"]) == []  # gamma selected: stays in training mode
    assert frozen_batch_norms(model, ["other"]) == ["BN"]
    assert run_passes(InferenceBatchNormPass(["BN"]), model).modified
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    assert "BatchNormalization" not in {n.op_type for n in proto.graph.node}
    assert all(n.name.startswith("BN/inference/") for n in proto.graph.node if n.name != "Relu")
    np.testing.assert_allclose(_run(proto, x), reference, rtol=1e-5, atol=1e-5)
    assert not run_passes(InferenceBatchNormPass([]), model).modified


def test_inference_rewrite_preconditions():
    model = ir.from_proto(_bn_model((2, 3, 4, 4)))
    with pytest.raises(PreconditionError, match="no BatchNormalization nodes named"):
        run_passes(InferenceBatchNormPass(["nope"]), model)


def test_unknown_rank_keeps_training_mode(caplog):
    proto = _bn_model((2, 3, 4, 4))
    proto.graph.input[0].type.tensor_type.ClearField("shape")  # rank unknown
    model = ir.from_proto(proto)
    inference = InferenceBatchNormPass(["BN"])
    with caplog.at_level("WARNING"):
        assert not run_passes(inference, model).modified
    assert inference.skipped == ["BN"] and "they stay in training mode" in caplog.text
    assert "BatchNormalization" in {n.op_type for n in model.graph}


def test_cache_key_depends_on_the_batch_norm_mode(default_model):
    proto, names = default_model.proto, default_model.names
    last = names[-2:]  # the classifier only: every batch norm unselected
    assert len(inference_batch_norms(proto, last, "inference")) == 5
    assert inference_batch_norms(proto, last, "train") == []
    assert selection_key(proto, last, frozen_bn="inference") != selection_key(
        proto, last, frozen_bn="train"
    )
    # every gamma and beta selected: no batch norm is frozen, the artifacts are the same
    assert inference_batch_norms(proto, names, "inference") == []
    assert selection_key(proto, names, frozen_bn="inference") == selection_key(
        proto, names, frozen_bn="train"
    )
    # a layer with only its gamma selected trains its batch norm
    gamma0 = next(t.name for t in default_model.tensors if t.kind == "gamma")
    assert len(inference_batch_norms(proto, [gamma0], "inference")) == 4
    with pytest.raises(ConfigError, match="unknown frozen batch-norm mode 'eval'"):
        selection_key(proto, last, frozen_bn="eval")


def _bn_of(model, stat: str) -> set[str]:
    """Names of the gamma and beta of the batch norm whose running statistic is ``stat``."""
    node = next(n for n in model.proto.graph.node if stat in n.input)
    return set(node.input[1:3])


@pytest.mark.slow
def test_training_step_moves_only_the_statistics_it_should(tmp_path, default_model):
    model = default_model
    n = len(model.tensors)
    selected = list(range(9, n))  # batch norms 0-2 unselected, 3-4 selected
    mask = np.zeros(n, dtype=bool)
    mask[selected] = True
    trainable, frozen = model.split(mask)
    initial = model.initial_weights()
    data = load_dataset(None, input_shape=tuple(*model.input_shapes().values()))
    batches = list(data.train_batches(4, seed=1))[:2]
    moved = {}
    for mode in ("inference", "train"):
        paths = generate(model.proto, trainable, frozen, tmp_path / mode, frozen_bn=mode)
        ckpt = tmp_path / f"{mode}.ckpt"
        write_checkpoint(ckpt, CarriedState(dict(initial)), trainable, initial_learning_rate=1e-3)
        session = TrainingSession(paths.directory, ckpt, threads=1, input_names=["input"])
        for x, y in batches:
            assert np.isfinite(session.train_step(x, y, 1e-3)[0])
        after = session.weights()
        moved[mode] = {s for s in model.running_stats if not np.array_equal(after[s], initial[s])}
        # carried exactly through a checkpoint, as the loop does across re-selection
        session.save(tmp_path / f"{mode}.after", {})
        carried, _, _ = read_checkpoint(tmp_path / f"{mode}.after")
        for s in model.running_stats:
            np.testing.assert_array_equal(carried.weights[s], after[s])
    selected_stats = {s for s in model.running_stats if _bn_of(model, s) & set(trainable)}
    assert len(selected_stats) == 4
    assert moved["inference"] == selected_stats  # frozen layers keep their statistics
    assert moved["train"] == set(model.running_stats)  # every layer drifts in train mode


@pytest.mark.slow
def test_frozen_statistics_carry_exactly_through_the_loop(tmp_path, default_profile, default_model):
    prof, _ = default_profile
    initial = default_model.initial_weights()
    finals = {}
    for mode in ("inference", "train"):
        config = TrainConfig(
            epochs=2,
            period=1,
            strategy="last-layer",
            frozen_bn=mode,
            max_steps_per_epoch=4,
            max_val_batches=2,
        )
        train(default_model, prof, config, tmp_path / mode, progress=False)
        finals[mode], _, _ = read_checkpoint(tmp_path / mode / "checkpoint")
    for s in default_model.running_stats:  # two periods, two sessions: not one bit moved
        np.testing.assert_array_equal(finals["inference"].weights[s], initial[s])
    assert all(
        not np.array_equal(finals["train"].weights[s], initial[s])
        for s in default_model.running_stats
    )


@pytest.mark.slow
def test_artifact_cache_keeps_the_modes_apart(tmp_path, default_model):
    model = default_model
    mask = np.zeros(len(model.tensors), dtype=bool)
    mask[-2:] = True
    trainable, frozen = model.split(mask)
    cache = ArtifactCache(tmp_path)
    a, hit_a = cache.get(model.proto, trainable, frozen, frozen_bn="inference")
    b, hit_b = cache.get(model.proto, trainable, frozen, frozen_bn="train")
    assert not hit_a and not hit_b and a.directory != b.directory
    ops = {
        d: {n.op_type for n in onnx.load(p.training_model).graph.node}
        for d, p in (("inference", a), ("train", b))
    }
    assert "BatchNormInternal" not in ops["inference"] and "BatchNormInternal" in ops["train"]
    assert cache.get(model.proto, trainable, frozen, frozen_bn="inference") == (a, True)


def _profile(batch_norms):
    from etgraph.profile import Profile

    return Profile(
        model_hash="h",
        tensors=[f"t{i}" for i in range(5)],
        kinds=["kernel", "gamma", "beta", "kernel", "bias"],
        t_dw_us=[10.0, 1.0, 1.0, 20.0, 2.0],
        t_dy_us=[5.0, 0.0, 40.0, 30.0, 3.0],
        forward_us=100.0,
        measured_full_step_us=212.0,
        batch_size=4,
        input_shapes={"input": (3, 8, 8)},
        threads=1,
        ort_version="x",
        host="y",
        batch_norms=batch_norms,
    )


@pytest.mark.parametrize("d_fwd", [10.0, -16.0])
def test_time_model_of_inference_mode(d_fwd):
    """The batch norm (gamma 1, beta 2): training backward 30 µs -> inference 12 (d_dy 18);
    forward 25 -> 25 - d_fwd. Each mask's prediction is what that mask's graph runs."""
    row = {
        "node": "bn",
        "gamma": 1,
        "beta": 2,
        "train_dy_us": 30.0,
        "inference_dy_us": 12.0,
        "train_forward_us": 25.0,
        "inference_forward_us": 25.0 - d_fwd,
        "gap": None,
    }
    train = _profile([row])
    inference = train.for_frozen_bn("inference")
    assert train.for_frozen_bn("train") is train and inference.batch_norms == []
    assert inference.t_full_us == pytest.approx(train.t_full_us)  # same budget in both modes

    def both(*selected):
        mask = np.zeros(5, dtype=bool)
        mask[list(selected)] = True
        return train.predicted_step_us(mask), inference.predicted_step_us(mask)

    t, i = both(3, 4)  # frozen, no gradient through it: the inference forward only
    assert i == pytest.approx(t - d_fwd)
    t, i = both(0, 4)  # frozen, the gradient passes it: inference forward and backward
    assert i == pytest.approx(t - d_fwd - 18.0)
    t, i = both(1, 2, 4)  # selected: training mode, as profiled
    assert i == pytest.approx(t)
    t, i = both(0, 1, 2)
    assert i == pytest.approx(t)
    t, i = both(2, 4)  # one of the two: off by half the mode difference (documented)
    assert i == pytest.approx(t - (18.0 + d_fwd) / 2)
    with pytest.raises(ConfigError, match="unknown frozen batch-norm mode 'x'"):
        train.for_frozen_bn("x")
    assert _profile([]).for_frozen_bn("inference").t_dw_us.tolist() == train.t_dw_us.tolist()


def test_time_model_of_inference_mode_keeps_t_full_when_it_clamps():
    """An inference rewrite far dearer than BatchNormInternal (d_dy + d_fwd = -42 µs) would make
    gamma's and beta's t_dw negative: they are clamped at 0 and T_full, so the budget, stays
    the profile's (the clamped 38 µs come off the forward time)."""
    row = {
        "node": "bn",
        "gamma": 1,
        "beta": 2,
        "train_dy_us": 30.0,
        "inference_dy_us": 12.0,
        "train_forward_us": 25.0,
        "inference_forward_us": 85.0,
        "gap": None,
    }
    train = _profile([row])
    inference = train.for_frozen_bn("inference")
    assert inference.t_dw_us.min() >= 0 and inference.t_dy_us.min() >= 0
    assert inference.t_full_us == pytest.approx(train.t_full_us)


def test_time_model_of_inference_mode_charges_a_frozen_layers_saving_to_its_tensor(tmp_path):
    """A frozen layer the gradient passes runs baked (Conv + BN + activation fused), so in
    inference mode its forward costs its training-mode time only when its tensor trains: the
    measured saving (``inference_path_moved_us``, 6 µs on the kernel t3) moves from ``t_dy`` to
    ``t_dw`` of that tensor. Issue 30: without it, selections with many frozen layers after their
    earliest tensor (the DP's, top-k's) were over-predicted by up to 30% on MobileNetV2."""
    from etgraph.profile import Profile

    row = {"node": "bn", "gamma": 1, "beta": 2, "train_dy_us": 30.0, "inference_dy_us": 12.0}
    row |= {"train_forward_us": 25.0, "inference_forward_us": 15.0, "gap": None}
    before = _profile([row])
    prof = dataclasses.replace(before, inference_path_moved_us=[0.0, 0.0, 0.0, 6.0, 0.0])
    inference, plain = prof.for_frozen_bn("inference"), before.for_frozen_bn("inference")
    assert inference.t_full_us == pytest.approx(plain.t_full_us)  # the budget is unchanged

    def step(model, *selected):
        mask = np.zeros(5, dtype=bool)
        mask[list(selected)] = True
        return model.predicted_step_us(mask)

    assert step(inference, 0, 4) == pytest.approx(step(plain, 0, 4) - 6.0)  # t3 frozen, passed
    assert step(inference, 0, 3) == pytest.approx(step(plain, 0, 3))  # t3 trains
    assert step(inference, 4) == pytest.approx(step(plain, 4))  # no gradient reaches t3
    assert prof.for_frozen_bn("train") is prof  # training mode: as profiled
    back = Profile.load(prof.save(tmp_path / "p.json"))
    assert back.inference_path_moved_us == [0.0, 0.0, 0.0, 6.0, 0.0]


def test_profile_json_round_trips_batch_norm_rows(tmp_path):
    from etgraph.profile import Profile

    row = {"node": "bn", "gamma": 1, "beta": 2, "train_dy_us": 3.0, "inference_dy_us": 1.0}
    row |= {"train_forward_us": 2.0, "inference_forward_us": 2.5, "gap": [0, [3]]}
    prof = _profile([row])
    assert Profile.load(prof.save(tmp_path / "p.json")).batch_norms == [row]


@pytest.mark.slow
def test_eval_model_of_frozen_artifacts_is_the_original_inference(tmp_path, default_model):
    """Validation in inference mode computes what the original model computes in inference:
    the frozen batch norms' affine map and the trimmed eval batch norms agree with ONNX's own
    inference BatchNormalization."""
    model = default_model
    mask = np.zeros(len(model.tensors), dtype=bool)
    mask[9:] = True  # batch norms 0-2 frozen (affine map), 3-4 trained (eval BatchNormalization)
    trainable, frozen = model.split(mask)
    paths = generate(model.proto, trainable, frozen, tmp_path / "a", frozen_bn="inference")
    ckpt = tmp_path / "c.ckpt"
    write_checkpoint(
        ckpt, CarriedState(model.initial_weights()), trainable, initial_learning_rate=1e-4
    )
    session = TrainingSession(paths.directory, ckpt, threads=1, input_names=["input"])
    data = load_dataset(None, input_shape=tuple(*model.input_shapes().values()))
    x, y = data.probe_batch(4, seed=3)
    session.module.eval()
    _, logits = session.module(x, y)
    reference = onnx.ModelProto()
    reference.CopyFrom(model.proto)
    for node in reference.graph.node:
        if node.op_type == "BatchNormalization":
            del node.output[1:]
            for attr in node.attribute:
                if attr.name == "training_mode":
                    attr.i = 0
    np.testing.assert_allclose(logits, _run(reference, x), rtol=1e-4, atol=1e-5)
