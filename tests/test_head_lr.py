"""``--head-lr-scale`` (issue #30): the head trained at S times the learning rate by an exact ONNX
reparametrisation (:mod:`passes.onnx.head_lr`) — the pass and its inverse alone on hand-built
models, legalisation, compile and train agreeing, the weights API and the exported model in the
original parametrisation, the CLI's one-line errors, and a real run where the head moves about S
times as far."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import etgraph
from etgraph.config import TrainConfig, check_run_inputs
from etgraph.errors import ConfigError, HeadLrScaleError
from etgraph.model import LoadedModel
from etgraph.onnx_io import legalize, model_hash
from etgraph.selection import strategy_mask
from passes.base import run_passes
from passes.onnx import (
    HEAD_LR_KEY,
    FoldHeadLrScalePass,
    ScaleHeadLrPass,
    head_lr_of,
)
from tests.helpers import assert_user_error, make_model, random_initializer, run_cli_in_process

X_SHAPE = (2, 6)


def gemm_head(bias: bool = True, trans_b: int = 1) -> onnx.ModelProto:
    """x [2, 6] -> Relu -> Gemm(W [4, 6] or [6, 4], b [4]) -> y [2, 4]."""
    w_shape = (4, 6) if trans_b else (6, 4)
    inits = [random_initializer("W", w_shape, seed=1, scale=0.7)]
    inputs = ["r", "W"]
    if bias:
        inits.append(random_initializer("b", (4,), seed=2, scale=0.3))
        inputs.append("b")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Gemm", inputs, ["y"], name="head", transB=trans_b, alpha=0.5, beta=2.0),
    ]
    return make_model(nodes, inits, in_shape=X_SHAPE, out_shape=(2, 4), check=True)


def matmul_add_head(bias_first: bool = False, bias: bool = True) -> onnx.ModelProto:
    """x [2, 6] -> Relu -> MatMul(W [6, 4]) [-> Add(b [4])] -> y [2, 4] (tf2onnx's dense)."""
    inits = [random_initializer("W", (6, 4), seed=3, scale=0.7)]
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")]
    if bias:
        inits.append(random_initializer("b", (4,), seed=4, scale=0.3))
        nodes.append(helper.make_node("MatMul", ["r", "W"], ["m"], name="dense"))
        add_in = ["b", "m"] if bias_first else ["m", "b"]
        nodes.append(helper.make_node("Add", add_in, ["y"], name="dense_bias"))
    else:
        nodes.append(helper.make_node("MatMul", ["r", "W"], ["y"], name="dense"))
    return make_model(nodes, inits, in_shape=X_SHAPE, out_shape=(2, 4), check=True)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def apply(pass_, model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    result = run_passes(pass_, ir.from_proto(model))
    return ir.to_proto(result.model), result.modified


X = np.random.default_rng(0).standard_normal(X_SHAPE).astype(np.float32)


# ---- the pass and its inverse, alone ------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "kernel", "bias"),
    [
        (gemm_head, "W", "b"),
        (lambda: gemm_head(trans_b=0), "W", "b"),
        (lambda: gemm_head(bias=False), "W", None),
        (matmul_add_head, "W", "b"),
        (lambda: matmul_add_head(bias_first=True), "W", "b"),
        (lambda: matmul_add_head(bias=False), "W", None),
    ],
    ids=["gemm", "gemm-transB0", "gemm-no-bias", "matmul-add", "add-bias-first", "matmul"],
)
def test_scale_keeps_the_function_and_fold_restores_the_weights(build, kernel, bias):
    original = build()
    before = run(original, X)
    scaled, modified = apply(ScaleHeadLrPass(10.0), original)
    assert modified
    record = head_lr_of(scaled)
    assert record is not None and record.scale == 10.0
    assert record.tensors == ((kernel,) if bias is None else (kernel, bias))
    out = scaled.graph.output[0]
    producer = next(n for n in scaled.graph.node if out.name in n.output)
    assert out.name == "y" and producer.op_type == "Mul" and producer.name == record.node
    w0, w1 = initializers(original), initializers(scaled)
    for name in record.tensors:  # stored divided by S
        np.testing.assert_allclose(w1[name], w0[name] / 10.0, rtol=1e-6)
    np.testing.assert_allclose(run(scaled, X), before, rtol=1e-5, atol=1e-6)

    folded, modified = apply(FoldHeadLrScalePass(), scaled)
    assert modified and head_lr_of(folded) is None
    assert HEAD_LR_KEY not in {p.key for p in folded.metadata_props}
    assert [n.op_type for n in folded.graph.node] == [n.op_type for n in original.graph.node]
    assert set(initializers(folded)) == set(w0)  # the scale's constant is gone
    assert model_hash(folded) == model_hash(original)  # the original architecture
    for name, value in initializers(folded).items():
        np.testing.assert_array_max_ulp(value, w0[name], maxulp=1)
    np.testing.assert_allclose(run(folded, X), before, rtol=1e-5, atol=1e-6)


def test_fold_takes_the_record_of_a_model_that_lost_its_metadata():
    """A model whose metadata is gone is folded by the record of the model it came from."""
    scaled, _ = apply(ScaleHeadLrPass(4.0), gemm_head())
    record = head_lr_of(scaled)
    stripped = onnx.ModelProto()
    stripped.CopyFrom(scaled)
    del stripped.metadata_props[:]
    assert apply(FoldHeadLrScalePass(), stripped)[1] is False  # no record: nothing to fold
    folded, modified = apply(FoldHeadLrScalePass(record), stripped)
    assert modified and "Mul" not in [n.op_type for n in folded.graph.node]
    np.testing.assert_allclose(run(folded, X), run(gemm_head(), X), rtol=1e-5, atol=1e-6)


def test_scale_one_and_the_same_scale_again_change_nothing():
    original = gemm_head()
    same, modified = apply(ScaleHeadLrPass(1.0), original)
    assert not modified and head_lr_of(same) is None
    assert same.SerializeToString() == ir.to_proto(ir.from_proto(original)).SerializeToString()
    scaled, _ = apply(ScaleHeadLrPass(10.0), original)
    again, modified = apply(ScaleHeadLrPass(10.0), scaled)
    assert not modified
    assert initializers(again)["W"].tobytes() == initializers(scaled)["W"].tobytes()


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), "ten", None])
def test_a_bad_scale_is_a_one_line_error(scale):
    with pytest.raises(HeadLrScaleError, match="positive, finite") as info:
        ScaleHeadLrPass(scale)
    assert "\n" not in str(info.value)
    with pytest.raises(HeadLrScaleError):
        TrainConfig(head_lr_scale=scale).validate()


def unsupported_heads() -> dict[str, onnx.ModelProto]:
    w = random_initializer("W", (4, 6), seed=1)
    relu_out = make_model(
        [
            helper.make_node("Gemm", ["x", "W"], ["g"], name="head", transB=1),
            helper.make_node("Relu", ["g"], ["y"], name="relu"),
        ],
        [w],
        in_shape=X_SHAPE,
        out_shape=(2, 4),
    )
    data_bias = make_model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Slice", ["r", "s", "e"], ["c"], name="slice"),
            helper.make_node("Gemm", ["x", "W", "c"], ["y"], name="head", transB=1),
        ],
        [
            w,
            numpy_helper.from_array(np.array([0], np.int64), "s"),
            numpy_helper.from_array(np.array([4], np.int64), "e"),
        ],
        in_shape=X_SHAPE,
        out_shape=(2, 4),
    )
    shared = make_model(  # the kernel also read by another node
        [
            helper.make_node("Gemm", ["x", "W"], ["g"], name="head", transB=1),
            helper.make_node("ReduceSum", ["W"], ["s"], name="sum", keepdims=0),
            helper.make_node("Add", ["g", "s"], ["y"], name="plus"),
        ],
        [w],
        in_shape=X_SHAPE,
        out_shape=(2, 4),
    )
    no_kernel = make_model(
        [helper.make_node("MatMul", ["x", "x2"], ["y"], name="mm")],
        [],
        inputs=[
            helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 6]),
            helper.make_tensor_value_info("x2", onnx.TensorProto.FLOAT, [6, 4]),
        ],
        out_shape=(2, 4),
    )
    return {"relu": relu_out, "data-bias": data_bias, "shared": shared, "no-kernel": no_kernel}


@pytest.mark.parametrize("case", list(unsupported_heads()))
def test_an_unsupported_head_is_a_one_line_error(case):
    model = unsupported_heads()[case]
    with pytest.raises(HeadLrScaleError, match="--head-lr-scale needs the output 'y'") as info:
        apply(ScaleHeadLrPass(10.0), model)
    assert "\n" not in str(info.value) and "train without --head-lr-scale" in str(info.value)


def test_another_scale_on_a_scaled_model_is_refused():
    scaled, _ = apply(ScaleHeadLrPass(10.0), gemm_head())
    with pytest.raises(HeadLrScaleError, match="scaled by 10 already"):
        apply(ScaleHeadLrPass(3.0), scaled)


# ---- legalisation and the loaded model ----------------------------------------------------


def test_legalisation_scales_the_last_layer_and_is_idempotent(default_model_path, tmp_path):
    plain = LoadedModel.load(default_model_path)
    scaled = LoadedModel.load(default_model_path, head_lr_scale=10)
    assert plain.head_lr is None and plain.head_lr_scale == 1.0
    assert scaled.head_lr_scale == 10.0 and scaled.names == plain.names  # the same tensors
    # the head is the layer the last-layer strategy trains (one notion of "the head")
    last = strategy_mask("last-layer", list(plain.tensors), None, 1.0, None)
    assert set(scaled.head_lr.tensors) == {n for n, s in zip(plain.names, last, strict=True) if s}
    stored, original = scaled.initial_weights(), plain.initial_weights()
    for name in original:
        factor = 10.0 if name in scaled.head_lr.tensors else 1.0
        np.testing.assert_allclose(stored[name] * factor, original[name], rtol=1e-6)
        np.testing.assert_array_max_ulp(
            scaled.head_lr.original(stored)[name], original[name], maxulp=1
        )
    assert scaled.hash != plain.hash  # one Mul more: profiled on its own
    # a saved scaled model (a compiled model.onnx) legalises to itself, at its scale
    path = tmp_path / "model.onnx"
    onnx.save(scaled.proto, str(path))
    again = LoadedModel.load(path)
    assert again.hash == scaled.hash and again.head_lr == scaled.head_lr
    assert legalize(scaled.proto).SerializeToString() == scaled.proto.SerializeToString()
    assert LoadedModel.load(path, head_lr_scale=10).hash == scaled.hash
    with pytest.raises(HeadLrScaleError, match="already"):
        LoadedModel.load(path, head_lr_scale=1)
    x = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    same = [
        ort.InferenceSession(m.proto.SerializeToString()).run(None, {"input": x})[0]
        for m in (plain, scaled)
    ]
    np.testing.assert_allclose(same[1], same[0], rtol=1e-5, atol=1e-6)


def test_a_run_must_load_the_model_at_its_scale(default_model, default_profile):
    prof, _ = default_profile
    shapes = default_model.input_shapes(prof.input_shapes)
    config = TrainConfig(head_lr_scale=10.0).validate()
    with pytest.raises(ConfigError, match="loaded with 1") as info:
        check_run_inputs(config, default_model, prof, shapes)
    assert "\n" not in str(info.value)
    check_run_inputs(TrainConfig(), default_model, prof, shapes)  # 1 and 1 agree


def test_a_conv_head_is_refused_at_load(tiny_cnn_onnx):
    """tiny_cnn ends in a Gemm: it scales; a model ending in a Conv (flattened) is refused."""
    assert LoadedModel.load(tiny_cnn_onnx, head_lr_scale=10).head_lr.layer
    w = random_initializer("w", (4, 3, 8, 8), seed=0)
    conv = make_model(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")],
        [w],
        out_shape=(1, 4, 1, 1),
    )
    with pytest.raises(HeadLrScaleError, match="Flatten"):
        etgraph.load_model(conv, head_lr_scale=10)


# ---- the command line ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "value", "fragment", "code"),
    [
        ("compile", "-1", "is not in the range x>0.0", 2),  # the option's range (click)
        ("compile", "0", "is not in the range x>0.0", 2),
        ("train", "nan", "positive, finite", 1),  # no range holds these two
        ("train", "inf", "positive, finite", 1),
    ],
)
def test_cli_bad_scale_is_a_one_line_error(tmp_path, command, value, fragment, code):
    done = run_cli_in_process(command, "-o", tmp_path / "out", "--head-lr-scale", value)
    assert_user_error(done, "--head-lr-scale", fragment, code=code)
    assert not (tmp_path / "out").exists()  # refused before any work


def test_cli_unsupported_head_is_a_one_line_error(tmp_path):
    conv = make_model(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")],
        [random_initializer("w", (4, 3, 8, 8), seed=0)],
        out_shape=(1, 4, 1, 1),
    )
    onnx.save(conv, str(tmp_path / "conv.onnx"))
    done = run_cli_in_process(
        "compile", tmp_path / "conv.onnx", "-o", tmp_path / "out", "--head-lr-scale", "10"
    )
    assert_user_error(done, "--head-lr-scale needs the output 'y'", "Flatten")


def test_cli_options_share_one_help():
    for command in ("compile", "train"):
        done = run_cli_in_process(command, "--help")
        text = " ".join(done.stdout.split())
        assert "--head-lr-scale S" in text and "10 is the measured useful value" in text


# ---- compile and train agree; real training ------------------------------------------------


@pytest.mark.slow
def test_compile_records_the_scale_and_train_dir_keeps_it(tmp_path, cache_env):
    out = tmp_path / "c10"
    done = run_cli_in_process("compile", "-o", out, "--head-lr-scale", "10", env=cache_env)
    assert done.returncode == 0, done.stderr
    assert "trains at 10x the learning rate" in done.stdout
    plan = json.loads((out / "plan.json").read_text())
    assert plan["head_lr_scale"] == 10.0
    assert plan["head_lr"]["tensors"] == ["fc.weight", "fc.bias"]
    assert "divided by 10" in plan["head_lr"]["note"]
    loaded = etgraph.Plan.load(out)
    assert loaded.model.head_lr_scale == 10.0 and loaded.train_config().head_lr_scale == 10.0
    inspected = run_cli_in_process("inspect", out)
    assert "trains at 10x the learning rate" in inspected.stdout
    if importlib.util.find_spec("flwr") is not None:  # federate DIR: clients train at its scale
        from etgraph.federated.config import FederateConfig
        from etgraph.federated.task import load_task

        task = load_task(FederateConfig(model=str(out), clients=2, strategy="fedavg-full"))
        assert task.train_config.head_lr_scale == 10.0 and task.model.head_lr_scale == 10.0
    done = run_cli_in_process(
        "train", out, "-o", tmp_path / "run", "--head-lr-scale", "3", env=cache_env
    )
    assert_user_error(done, "compiled with --head-lr-scale 10, not 3", "compile again")
    done = run_cli_in_process("compile", "-o", tmp_path / "c1", env=cache_env)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "c1" / "plan.json").read_text())["head_lr"] is None
    done = run_cli_in_process(
        "train", tmp_path / "c1", "-o", tmp_path / "run", "--head-lr-scale", "10", env=cache_env
    )
    assert_user_error(done, "compiled with --head-lr-scale 1, not 10")
    assert not (tmp_path / "run").exists()


def head_run(model: LoadedModel, profile, scale: float, x, y, steps: int = 6):
    """A last-layer run of ``steps`` steps at lr 1e-3 on ``model`` loaded at ``scale``: the
    trainer (open), its weights before, and after."""
    config = TrainConfig(
        epochs=1,
        strategy="last-layer",
        learning_rate=1e-3,
        max_steps_per_epoch=steps,
        head_lr_scale=scale,
        spinning="off",
        closed_loop=False,
    ).validate()
    trainer = etgraph.ElasticTrainer(
        model, profile, config, data=(x[:96], y[:96]), val_data=(x[96:], y[96:])
    )
    before = trainer.get_weights()
    trainer.begin_period()
    trainer.train_epoch()
    return trainer, before, trainer.get_weights()


@pytest.mark.slow
def test_the_head_moves_s_times_as_far_and_exports_in_the_original_form(
    tmp_path, default_model_path, default_model, default_profile
):
    """The same run at S = 1 and S = 10 (same lr, data, seed): the head's kernel moves ~S times
    as far (AdamW steps ~lr per stored parameter); the backbone is untouched by a last-layer
    run; the weights API speaks the original parametrisation; the exported model has no Mul,
    the original initializers, the weights ``get_weights`` gives, and scores as the session."""
    from etgraph.sessions import evaluate_onnx
    from tests.test_api import digits_arrays

    x, y = digits_arrays(128)
    scaled = LoadedModel.load(default_model_path, head_lr_scale=10)
    scaled_profile = etgraph.profile_model(scaled, batch_size=4, cache=False)
    moved = {}
    for scale, model, prof in (
        (1.0, default_model, default_profile[0]),
        (10.0, scaled, scaled_profile),
    ):
        trainer, before, after = head_run(model, prof, scale, x, y)
        # get_weights: the original parametrisation, from the same starting values
        for name, value in default_model.initial_weights().items():
            np.testing.assert_array_max_ulp(before[name], value, maxulp=1)
        moved[scale] = float(np.abs(after["fc.weight"] - before["fc.weight"]).mean())
        if scale == 10.0:
            stored = trainer._state().weights
            np.testing.assert_allclose(after["fc.weight"], 10.0 * stored["fc.weight"], rtol=1e-6)
            path = trainer.export(tmp_path / "trained.onnx")
            exported = onnx.load(str(path))
            assert "Mul" not in {n.op_type for n in exported.graph.node}
            assert HEAD_LR_KEY not in {p.key for p in exported.metadata_props}
            original = onnx.load(str(default_model_path))  # the original architecture
            ops = [n.op_type for n in exported.graph.node]
            assert ops == [n.op_type for n in original.graph.node]
            assert set(initializers(exported)) == set(initializers(original))
            for name, value in initializers(exported).items():
                if name in after:
                    np.testing.assert_array_equal(value, after[name], err_msg=name)
            loss, acc = trainer.evaluate()
            e_loss, e_acc = evaluate_onnx(path, trainer.val_batches(), 4)
            assert e_loss == pytest.approx(loss, rel=1e-5) and e_acc == pytest.approx(acc)
            # set_weights takes the original form: setting what get_weights gave changes nothing
            trainer.set_weights(after)
            np.testing.assert_array_max_ulp(
                trainer._state().weights["fc.weight"], stored["fc.weight"], maxulp=1
            )
            np.testing.assert_array_max_ulp(
                trainer.get_weights()["fc.weight"], after["fc.weight"], maxulp=1
            )
        trainer.close()
    ratio = moved[10.0] / moved[1.0]
    print(f"head kernel mean |change|: S=1 {moved[1.0]:.3g}, S=10 {moved[10.0]:.3g}, x{ratio:.2f}")
    assert ratio > 5.0


@pytest.mark.slow
def test_a_run_from_a_model_file_resumes_at_its_scale(tmp_path, default_model_path, cache_env):
    """``etgraph train MODEL.onnx --head-lr-scale 10`` then ``--resume``: the model file is
    scaled again on resume (else its profile and checkpoint would not match)."""
    run = tmp_path / "run"
    args = ("--period", "1", "--max-steps-per-epoch", "4", "--max-val-batches", "2", "-q")
    done = run_cli_in_process(
        "train",
        default_model_path,
        "-o",
        run,
        "--head-lr-scale",
        "10",
        "--epochs",
        "2",
        *args,
        env=cache_env,
    )
    assert done.returncode == 0, done.stderr
    assert "(2 epochs, the head at 10x the lr)" in done.stdout
    assert json.loads((run / "run.json").read_text())["config"]["head_lr_scale"] == 10.0
    done = run_cli_in_process("train", "--resume", run, "--epochs", "3", "-q", env=cache_env)
    assert done.returncode == 0, done.stderr
    assert "(3 epochs, the head at 10x the lr)" in done.stdout
    exported = onnx.load(str(run / "model_trained.onnx"))
    assert "Mul" not in {n.op_type for n in exported.graph.node}


def test_the_federated_global_model_starts_in_the_original_parametrisation(default_model_path):
    """The server's first global model is what clients' ``get_weights`` speak: the head's
    stored values times S (a compiled directory keeps the head scaled)."""
    pytest.importorskip("flwr")
    from etgraph.federated.server import _initial_weights

    plain = LoadedModel.load(default_model_path)
    scaled = LoadedModel.load(default_model_path, head_lr_scale=10)
    got, want = _initial_weights(scaled), plain.initial_weights()
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_max_ulp(got[name], value, maxulp=1)
