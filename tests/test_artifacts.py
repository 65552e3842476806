"""Training artifacts (etgraph.artifacts): atomic generation, the eval-model fix, the cache."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from helpers import make_model
from onnx import helper, numpy_helper

from etgraph.artifacts import ARTIFACT_FILES, ArtifactCache, generate, selection_key
from etgraph.errors import ConfigError, UnsupportedOpError
from etgraph.onnx_io import legalize

BATCH = 2


def _init(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def conv_bn_model(
    extra: list[onnx.NodeProto] | None = None, last: str = "r", *, legal: bool = True
) -> onnx.ModelProto:
    """x[N,3,8,8] -> Conv -> BatchNormalization (training mode, 3 outputs, as torch exports in
    TRAINING mode) -> Relu -> <extra> -> GAP -> Flatten -> Gemm -> y[N,4], legalised unless
    ``legal`` is False."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "b", "mu", "var"],
                         ["n", "mu_out", "var_out"], name="bn", training_mode=1),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        *(extra or []),
        helper.make_node("GlobalAveragePool", [last], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1),
    ]  # fmt: skip
    inits = [
        _init("w", 0.3 * rng.standard_normal((6, 3, 3, 3))),
        _init("g", np.ones(6)),
        _init("b", np.zeros(6)),
        _init("mu", np.zeros(6)),
        _init("var", np.ones(6)),
        _init("fw", 0.3 * rng.standard_normal((4, 6))),
        _init("fb", np.zeros(4)),
    ]
    model = make_model(nodes, inits, in_shape=(BATCH, 3, 8, 8), out_shape=(BATCH, 4))
    return legalize(model, source="conv_bn") if legal else model


TRAINABLE = ["w", "g", "b", "fw", "fb"]
FROZEN = ["mu", "var"]


def test_generated_artifacts_train_evaluate_and_export(tmp_path):
    """What onnx_ir wrote (the legalised model, the fixed eval model) loads in ORT 1.19.2."""
    from onnxruntime.training import api

    paths = generate(conv_bn_model(), TRAINABLE, FROZEN, tmp_path / "art")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no temporaries left
    assert sorted(p.name for p in paths.directory.iterdir()) == sorted(ARTIFACT_FILES)
    eval_model = onnx.load(str(paths.eval_model))
    bns = [n for n in eval_model.graph.node if n.op_type == "BatchNormalization"]
    assert bns and all(len(n.output) == 1 for n in bns)  # TrimEvalBatchNormPass ran

    state = api.CheckpointState.load_checkpoint(str(paths.checkpoint))
    module = api.Module(str(paths.training_model), state, str(paths.eval_model))
    optimizer = api.Optimizer(str(paths.optimizer_model), module)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, 3, 8, 8)).astype(np.float32)
    labels = np.array([0, 3], np.int64)
    module.train()
    loss, logits = module(x, labels)
    optimizer.step()
    module.lazy_reset_grad()
    assert np.isfinite(loss) and logits.shape == (BATCH, 4)
    module.eval()
    loss, logits = module(x, labels)
    assert np.isfinite(loss) and logits.shape == (BATCH, 4)
    module.export_model_for_inferencing(str(tmp_path / "inference.onnx"), ["y"])
    assert (tmp_path / "inference.onnx").is_file()


def test_generate_replaces_the_directory_and_a_failure_keeps_the_old_one(tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    (out / "stale").write_text("from an older generation")
    generate(conv_bn_model(), TRAINABLE, FROZEN, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(ARTIFACT_FILES)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    # an op without a gradient that legalisation would have refused: ORT's own failure
    softplus = [helper.make_node("Softplus", ["r"], ["s"], name="softplus")]
    with pytest.raises(
        UnsupportedOpError,
        match="^node 'softplus' uses op Softplus, which has no gradient in onnxruntime-training "
        "1.19.2: replace it on the trained path and re-export$",
    ):
        generate(conv_bn_model(softplus, "s", legal=False), TRAINABLE, FROZEN, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # the temporary is gone


def test_generate_refuses_bad_selections(tmp_path):
    with pytest.raises(ConfigError, match="no tensor is selected for training"):
        generate(conv_bn_model(), [], FROZEN, tmp_path / "art")
    with pytest.raises(ConfigError, match=r"tensors both trainable and frozen: \['mu'\]"):
        generate(conv_bn_model(), TRAINABLE + ["mu"], FROZEN, tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_cache_hits_by_structure_and_selection_and_removes_temporaries(tmp_path):
    model = conv_bn_model()
    cache = ArtifactCache(tmp_path / "cache")
    paths, hit = cache.get(model, TRAINABLE, FROZEN)
    assert not hit and paths.directory.name == selection_key(model, TRAINABLE)
    again, hit = cache.get(model, list(reversed(TRAINABLE)), FROZEN)
    assert hit and again.directory == paths.directory

    retrained = onnx.ModelProto()
    retrained.CopyFrom(model)
    retrained.graph.initializer[0].CopyFrom(_init("w", np.zeros((6, 3, 3, 3))))
    assert selection_key(retrained, TRAINABLE) == selection_key(model, TRAINABLE)
    assert selection_key(model, ["fw", "fb"]) != selection_key(model, TRAINABLE)

    killed = tmp_path / "cache" / f".{paths.directory.name}.k1ll3d"  # as a SIGKILL leaves it
    killed.mkdir()
    (killed / "training_model.onnx").write_bytes(b"half")
    cache.remove_temporaries()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [paths.directory.name]
    assert paths.exists()


def test_graphs_come_from_placeholder_weights(tmp_path):
    """The graphs do not depend on the weights: generating from placeholders gives the same
    files, the checkpoint holds the model's values, and a placeholder model has none to give."""
    from etgraph.artifact_weights import initializer_values, placeholder_weights
    from etgraph.checkpoint import read_checkpoint

    model = conv_bn_model()
    skeleton = placeholder_weights(model, TRAINABLE + FROZEN)
    assert skeleton.ByteSize() < model.ByteSize()
    assert selection_key(skeleton, TRAINABLE) == selection_key(model, TRAINABLE)
    full = generate(model, TRAINABLE, FROZEN, tmp_path / "full", frozen_bn="inference")
    bare = generate(
        skeleton, TRAINABLE[3:], TRAINABLE[:3] + FROZEN, tmp_path / "bare", checkpoint=False
    )
    assert bare.exists(checkpoint=False) and not bare.exists()
    other = generate(model, TRAINABLE[3:], TRAINABLE[:3] + FROZEN, tmp_path / "other")
    for name in ARTIFACT_FILES[:3]:  # equal up to onnxblock's per-process name counter
        texts = [
            re.sub(r"::\d+", "::N", str(onnx.load(str(d / name))))
            for d in (bare.directory, other.directory)
        ]
        assert texts[0] == texts[1]
    state, requires_grad, _ = read_checkpoint(full.checkpoint)
    assert sorted(requires_grad) == sorted(TRAINABLE) and not state.moments
    for name, value in initializer_values(model, TRAINABLE + FROZEN).items():
        np.testing.assert_array_equal(state.weights[name], value)
    with pytest.raises(ConfigError, match="holds a placeholder, not its weights"):
        generate(skeleton, TRAINABLE, FROZEN, tmp_path / "nope")
    cache = ArtifactCache(tmp_path / "cache")
    paths, hit = cache.get(skeleton, TRAINABLE, FROZEN, checkpoint=False)
    assert not hit and not paths.checkpoint.exists()
    assert cache.get(skeleton, TRAINABLE, FROZEN, checkpoint=False)[1]  # graphs suffice
    paths, hit = cache.get(model, TRAINABLE, FROZEN)  # a checkpoint is needed: generated
    assert not hit and paths.exists()


def test_streamed_inference_export_equals_orts(tmp_path):
    """export_inference_model (no session, weights streamed from the checkpoint) writes the
    model ORT's export_model_for_inferencing writes: same inputs, outputs, predictions."""
    from etgraph.artifact_weights import export_inference_model
    from etgraph.checkpoint import read_checkpoint
    from etgraph.sessions import TrainingSession, inference_session

    paths = generate(conv_bn_model(), TRAINABLE[2:], TRAINABLE[:2] + FROZEN, tmp_path / "art")
    session = TrainingSession(  # as generated: ORT's export copies external-data references
        paths.directory, paths.checkpoint, None, input_names=["x"], bake=False
    )
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, 3, 8, 8)).astype(np.float32)
    for _ in range(2):
        session.train_step(x, np.array([0, 3]), 1e-2)  # weights move away from the initial
    session.save(tmp_path / "ck", {})
    session.module.export_model_for_inferencing(str(tmp_path / "ort.onnx"), ["y"])
    export_inference_model(
        paths.eval_model, tmp_path / "ck", tmp_path / "ours.onnx", ["y"], {"k": "v"}
    )
    ours, theirs = onnx.load(str(tmp_path / "ours.onnx")), onnx.load(str(tmp_path / "ort.onnx"))
    onnx.checker.check_model(ours, full_check=True)
    assert [i.name for i in ours.graph.input] == [i.name for i in theirs.graph.input] == ["x"]
    assert [o.name for o in ours.graph.output] == ["y"]
    assert {i.name for i in ours.graph.initializer} == {i.name for i in theirs.graph.initializer}
    assert {p.key: p.value for p in ours.metadata_props}["k"] == "v"
    weights = read_checkpoint(tmp_path / "ck")[0].weights
    for init in ours.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(init), weights[init.name])
    got = inference_session(str(tmp_path / "ours.onnx")).run(None, {"x": x})[0]
    want = inference_session(str(tmp_path / "ort.onnx")).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ConfigError, match="the eval model has no output 'z'"):
        export_inference_model(paths.eval_model, tmp_path / "ck", tmp_path / "z.onnx", ["z"])
