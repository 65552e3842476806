"""Every user error, through the real CLI: exit status 1, ONE line on stderr that starts with
``etgraph: error:``, names the file/node/op concerned and says what to do; no traceback, no
native crash (issue 8). ``--debug`` still shows tracebacks.

Commands run through the CLI's entry point in this process (exit code, stdout, stderr as a
subprocess would see them from Python), with ``ETGRAPH_CACHE`` pointing at a private cache, so
after the first compile every profile is a cache hit; where ORT fails natively, or a traceback
is printed, a real ``python -m etgraph`` subprocess runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import (
    assert_user_error,
    make_model,
    random_initializer,
    run_cli,
    run_cli_in_process,
)
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

QUICK_COMPILE = ["--repeats", "1"]
QUICK_TRAIN = ["--epochs", "1", "--max-steps-per-epoch", "1", "--max-val-batches", "1", "--quiet"]


@pytest.fixture(scope="module")
def cli(cache_env):
    """The CLI's entry point run in this process (:func:`helpers.run_cli_in_process`) with the
    session's private profile cache: after the first compile every profile is a cache hit.
    Tests where ORT runs natively or that need a real process use :func:`helpers.run_cli`."""

    def run(*args: str | os.PathLike) -> subprocess.CompletedProcess:
        return run_cli_in_process(*args, env=cache_env)

    return run


@pytest.fixture(scope="module")
def profile_json(default_profile) -> Path:
    """A quick profile of the embedded default model (for train without re-profiling)."""
    return default_profile[1]


# ---- small models built with onnx.helper ---------------------------------------------------


def lstm_classifier() -> onnx.ModelProto:
    """x[N, 3, 8, 8] -> Conv -> Reshape [N, 48, 8] -> Transpose [48, N, 8] -> LSTM (hidden 4,
    W, R, B initializers) -> last hidden state [1, N, 4] -> Squeeze -> y[N, 4]."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["c", "seq_shape"], ["s"], name="to_sequence"),
        helper.make_node("Transpose", ["s"], ["t"], name="time_major", perm=[1, 0, 2]),
        helper.make_node(
            "LSTM", ["t", "lw", "lr", "lb"], ["", "h"], name="recurrent", hidden_size=4
        ),
        helper.make_node("Squeeze", ["h", "axis0"], ["y"], name="last_state"),
    ]
    inits = [
        random_initializer("w", (6, 3, 3, 3)),
        random_initializer("b", (6,), 1),
        numpy_helper.from_array(np.array([0, 48, 8], np.int64), "seq_shape"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        random_initializer("lw", (1, 16, 8), 2),
        random_initializer("lr", (1, 16, 4), 3),
        random_initializer("lb", (1, 32), 4),
    ]
    model = make_model(nodes, inits, in_shape=("N", 3, 8, 8), out_shape=("N", 4))
    onnx.checker.check_model(model, full_check=True)
    return model


def half_precision(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its float32 weights, input and output in float16 (a valid model)."""
    for i, init in enumerate(model.graph.initializer):
        if init.data_type == TensorProto.FLOAT:
            half = numpy_helper.to_array(init).astype(np.float16)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(half, init.name))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    onnx.checker.check_model(model, full_check=True)
    return model


def conv_classifier(
    middle: list[onnx.NodeProto] | None = None,
    middle_out: str = "c",
    *,
    in_dims=("N", 3, 8, 8),
    classes: int = 4,
    trainable: bool = True,
) -> onnx.ModelProto:
    """x[N,3,8,8] -> Conv(w, b) -> <middle: 'c' -> middle_out> -> GAP -> Flatten -> Gemm -> y.

    ``trainable=False`` replaces the learned layers by parameter-free ones (no initializer)."""
    if trainable:
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1])]
    else:
        nodes = [helper.make_node("Relu", ["x"], ["c"], name="relu")]
    nodes += middle or []
    nodes += [
        helper.make_node("GlobalAveragePool", [middle_out], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["y" if not trainable else "f"], name="flat"),
    ]
    inits = []
    if trainable:
        nodes.append(helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1))
        inits = [
            random_initializer("w", (6, 3, 3, 3)),
            random_initializer("b", (6,), 1),
            random_initializer("fw", (classes, 6), 2),
            random_initializer("fb", (classes,), 3),
        ]
    model = make_model(nodes, inits, in_shape=in_dims, out_shape=("N", classes if trainable else 3))
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, tiny_cnn_onnx) -> dict[str, Path]:
    """Bad model files by case name."""
    root = tmp_path_factory.mktemp("bad-models")
    good = tiny_cnn_onnx.read_bytes()
    files = {
        "missing": root / "does_not_exist.onnx",
        "text": root / "notes.onnx",
        "empty": root / "empty.onnx",
        "truncated": root / "truncated.onnx",
        "corrupt": root / "corrupt.onnx",
    }
    files["text"].write_text("this is not an ONNX model\n")
    files["empty"].write_bytes(b"")
    files["truncated"].write_bytes(good[: len(good) // 3])
    rng = np.random.default_rng(0)
    corrupt = bytearray(good)
    for pos in rng.integers(0, 400, size=40):  # the header region: graph structure, not weights
        corrupt[int(pos)] = int(rng.integers(0, 256))
    files["corrupt"].write_bytes(bytes(corrupt))

    models = {
        "no_trainable": conv_classifier(trainable=False),
        "no_gradient_op": conv_classifier(
            [helper.make_node("Softplus", ["c"], ["m"], name="soft_plus")], "m"
        ),
        "cumsum": conv_classifier(
            [
                helper.make_node(
                    "Constant",
                    [],
                    ["axis"],
                    name="axis_const",
                    value=helper.make_tensor("axis", TensorProto.INT64, [], [1]),
                ),
                helper.make_node("CumSum", ["c", "axis"], ["m"], name="running_total"),
            ],
            "m",
        ),
        "lstm": lstm_classifier(),
        "float16": half_precision(conv_classifier()),
        "dynamic": conv_classifier(in_dims=("N", 3, "H", "W")),
        "dynamic_channels": conv_classifier(in_dims=("N", "C", "H", "W")),
    }
    for name, model in models.items():
        files[name] = root / f"{name}.onnx"
        onnx.save(model, str(files[name]))
    return files


# ---- compile: bad models -------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, fragments",
    [
        ("missing", ["does_not_exist.onnx", "no such model file"]),
        ("text", ["notes.onnx", "not a readable ONNX model"]),
        ("empty", ["empty.onnx", "empty or truncated"]),
        ("truncated", ["truncated.onnx", "ONNX"]),
        ("corrupt", ["corrupt.onnx", "ONNX"]),
        ("no_trainable", ["no_trainable.onnx", "trainable"]),
        ("no_gradient_op", ["'soft_plus'", "Softplus", "no gradient", "log(1 + exp(x))"]),
        ("cumsum", ["'running_total'", "CumSum", "no gradient", "MatMul"]),
        # onnxruntime-training's LSTMGrad crashes the process unless W and R both train
        ("lstm", ["'recurrent'", "LSTM", "crashes", "unroll"]),
        ("float16", ["output 'y' is float16", "float32", "convert it to float32"]),
        ("dynamic", ["symbolic", "--input-shape"]),
    ],
)
def test_compile_bad_model(cli, bad_files, tmp_path, case, fragments):
    done = cli("compile", bad_files[case], "-o", tmp_path / "out", *QUICK_COMPILE)
    assert_user_error(done, *fragments)
    assert not (tmp_path / "out" / "artifacts").exists()


def test_dynamic_model_compiles_with_input_shape(cli, bad_files, tmp_path):
    """The fix the dynamic-shape error suggests works."""
    out = tmp_path / "out"
    done = cli(
        "compile", bad_files["dynamic"], "-o", out, "--input-shape", "3x8x8", "--rho", "1",
        *QUICK_COMPILE,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "plan.json").read_text())["input_shapes"] == {"x": [3, 8, 8]}


def test_input_shape_the_model_cannot_run(cache_env, bad_files, tmp_path):
    """Symbolic channels, so only running the model shows that 1 channel does not fit. A real
    process: ORT fails natively here, and its native log must not reach the terminal."""
    done = run_cli("compile", bad_files["dynamic_channels"], "-o", tmp_path / "out",
                   "--input-shape", "1x8x8", *QUICK_COMPILE, env=cache_env)  # fmt: skip
    assert_user_error(done, "input shape 1x8x8", "'conv'", "--input-shape")


# ---- compile: bad settings -----------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(cli, cache_env, tiny_cnn_onnx, tmp_path_factory) -> Path:
    """tiny_cnn compiled at rho=1 through the CLI (its profile lands in the module cache)."""
    out = tmp_path_factory.mktemp("compiled") / "tiny_cnn"
    for _ in range(3):  # a 1-repeat profile on a loaded machine can make even rho=1 infeasible
        done = cli("compile", tiny_cnn_onnx, "-o", out, "--rho", "1", *QUICK_COMPILE)
        if done.returncode == 0 or "re-profile" not in done.stderr:
            break
        shutil.rmtree(Path(cache_env["ETGRAPH_CACHE"]) / "profiles")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


#: What click refuses while parsing (exit 2): a value out of its option's range.
OUT_OF_RANGE = 2


@pytest.mark.parametrize(
    "args, fragments, code",
    [
        (["--input-shape", "3x32"], ["'3x32'", "CxHxW"], 1),
        (["--input-shape", "three"], ["'three'", "CxHxW"], 1),
        (["--input-shape", "0x32x32"], ["zero", "CxHxW"], 1),
        (["--input-shape", "3x32x32x1"], ["CxHxW"], 1),
        (["--input-shape", "1x32x32"], ["1 channels", "expects 3"], 1),
        (["--rho", "0"], ["'--rho'", "0.0<x<=1.0"], OUT_OF_RANGE),
        (["--rho", "-0.5"], ["'--rho'", "0.0<x<=1.0"], OUT_OF_RANGE),
        (["--rho", "1.5"], ["'--rho'", "0.0<x<=1.0"], OUT_OF_RANGE),
        (["--rho", "nan"], ["rho", "(0, 1]"], 1),  # no range holds NaN: refused by the check
        (["--batch-size", "0"], ["'--batch-size'", "x>=1"], OUT_OF_RANGE),
        (["--batch-size", "-3"], ["'--batch-size'", "x>=1"], OUT_OF_RANGE),
        (["--repeats", "0"], ["'--repeats'"], OUT_OF_RANGE),
        (["--memory-mb", "inf"], ["--memory-mb", "positive number of MiB"], 1),
        (["--memory-mb", "0"], ["'--memory-mb'", "x>0.0"], OUT_OF_RANGE),
    ],
)
def test_compile_bad_settings(cli, tiny_cnn_onnx, tmp_path, args, fragments, code):
    done = cli("compile", tiny_cnn_onnx, "-o", tmp_path / "o", *args)
    assert_user_error(done, *fragments, code=code)


def test_rho_below_forward_floor_gives_a_feasible_rho(cli, compiled, tiny_cnn_onnx, tmp_path):
    line = assert_user_error(
        cli("compile", tiny_cnn_onnx, "-o", tmp_path / "low", "--rho", "0.0001", *QUICK_COMPILE),
        "rho",
        "at least",
    )
    min_rho = float(line.rsplit("at least", 1)[1].split()[0].rstrip(".;:"))
    assert 0.0001 < min_rho <= 1.0
    # The rho the message names is feasible (same cached profile).
    done = cli("compile", tiny_cnn_onnx, "-o", tmp_path / "ok", "--rho", str(min_rho),
               *QUICK_COMPILE)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_output_directory_not_writable(cli, tiny_cnn_onnx, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    done = cli("compile", tiny_cnn_onnx, "-o", blocker / "out", *QUICK_COMPILE)
    assert_user_error(done, str(blocker / "out"), "not writable", "-o")
    done = cli("compile", tiny_cnn_onnx, "-o", blocker, *QUICK_COMPILE)  # a usage error
    assert_user_error(done, str(blocker), "-o", "is a file", code=2)


def test_bad_output_and_cache_paths_are_refused_before_measuring(cli, tiny_cnn_onnx, tmp_path):
    """A directory where the profile file goes, a file where a directory goes: one line each,
    before anything is profiled (they were internal errors after profiling)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    done = cli("profile", tiny_cnn_onnx, "-o", tmp_path, "--no-cache")
    assert_user_error(done, str(tmp_path), "is a directory", "-o")
    done = cli("profile", tiny_cnn_onnx, "-o", blocker / "p.json", "--no-cache")
    assert_user_error(done, str(blocker), "not writable", "-o")
    done = cli("profile", tiny_cnn_onnx, "-o", tmp_path / "p.json", "--cache-dir", blocker)
    assert_user_error(done, str(blocker), "not writable", "--cache-dir")
    done = cli("train", "--resume", blocker)
    assert_user_error(done, str(blocker), "not a run directory", "--out")
    done = cli("train", "--memory-mb", "inf", "--out", tmp_path / "run", *QUICK_TRAIN)
    assert_user_error(done, "--memory-mb must be positive")
    assert not (tmp_path / "run").exists() and not (tmp_path / "p.json").exists()


# ---- datasets, for compile --data and train --data -----------------------------------------


def _image_folder(root: Path, classes: int, per_class: int = 3) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(12, 12, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class_{c}" / f"img_{i}.png")
    return root


@pytest.fixture(scope="module")
def bad_datasets(tmp_path_factory) -> dict[str, tuple[Path, list[str]]]:
    """Bad dataset directories by case: (path, fragments the error must contain)."""
    root = tmp_path_factory.mktemp("bad-data")
    empty = root / "empty"
    empty.mkdir()
    unreadable = _image_folder(root / "unreadable", 3)
    (unreadable / "class_1" / "broken.png").write_bytes(b"\x89PNG not really")
    too_many = _image_folder(root / "too_many", 12)  # tiny_cnn has 10 outputs, default 5
    return {
        "missing": (root / "nowhere", ["nowhere", "does not exist"]),
        "empty": (empty, [str(empty)]),
        "unreadable": (unreadable, ["broken.png"]),
        "too_many": (too_many, ["12 classes"]),
    }


@pytest.mark.parametrize("case", ["missing", "empty", "unreadable", "too_many"])
def test_compile_bad_dataset(cli, compiled, tiny_cnn_onnx, bad_datasets, tmp_path, case):
    path, fragments = bad_datasets[case]
    done = cli("compile", tiny_cnn_onnx, "-o", tmp_path / "o", "--rho", "1", "--data", path,
               *QUICK_COMPILE)  # fmt: skip
    assert_user_error(done, *fragments)


@pytest.mark.parametrize("case", ["missing", "empty", "unreadable", "too_many"])
def test_train_bad_dataset(cli, profile_json, bad_datasets, tmp_path, case):
    path, fragments = bad_datasets[case]
    done = cli("train", "--profile", profile_json, "--rho", "1", "--data", path,
               "--out", tmp_path / "run", *QUICK_TRAIN)  # fmt: skip
    assert_user_error(done, *fragments)


def test_rho_with_a_deadline_is_refused(cli, profile_json, tmp_path):
    """--deadline picks rho each period: a --rho beside it was ignored silently (the summary
    said "requested 1.00")."""
    done = cli("train", "--profile", profile_json, "--rho", "0.4", "--deadline", "10m",
               "--out", tmp_path / "run", *QUICK_TRAIN)  # fmt: skip
    assert_user_error(done, "--rho and --deadline", "give one of them")
    assert not (tmp_path / "run").exists()


def test_rho_of_the_run_needs_a_budgeted_strategy_and_no_deadline(cli, profile_json, tmp_path):
    done = cli("train", "--profile", profile_json, "--rho-scope", "run", "--strategy", "full",
               "--out", tmp_path / "run", *QUICK_TRAIN)  # fmt: skip
    assert_user_error(done, "--rho-scope run plans rho per period", "'full' ignores")
    done = cli("train", "--profile", profile_json, "--rho-scope", "run", "--deadline", "10m",
               "--out", tmp_path / "run", *QUICK_TRAIN)  # fmt: skip
    assert_user_error(done, "--deadline and --rho-scope run both plan", "give one of them")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("profiled", [True, False])
def test_train_output_directory_not_writable(cli, profile_json, tmp_path, profiled, monkeypatch):
    """Refused before any work: without a profile, before the model is profiled."""
    from etgraph import profiler

    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled before the output directory was checked")

    monkeypatch.setattr(profiler, "profile_model", no_profiling)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    profile = ("--profile", profile_json) if profiled else ()
    for out in (blocker / "run", blocker):  # inside a file, or a file itself
        done = cli("train", *profile, "--out", out, *QUICK_TRAIN)
        assert_user_error(done, str(out), "not writable", f"{blocker} is a file")


# ---- profiles and plans that belong to another model or setting ----------------------------


def test_profile_of_another_model_is_refused(cli, compiled, profile_json, tmp_path):
    # tiny_cnn's profile with the default model: caught by the model hash.
    done = cli("train", "--profile", compiled / "profile.json", "--out", tmp_path / "run",
               *QUICK_TRAIN)  # fmt: skip
    assert_user_error(done, "profile", "model", "etgraph profile")


def test_compiled_directory_with_a_swapped_model_is_refused(
    cli, compiled, default_model_path, tmp_path
):
    swapped = tmp_path / "compiled"
    shutil.copytree(compiled, swapped)
    shutil.copy(default_model_path, swapped / "model.onnx")  # plan/profile stay tiny_cnn's
    done = cli("train", swapped, "--out", tmp_path / "run", *QUICK_TRAIN)
    assert_user_error(done, "profile", "model")


def test_profile_of_another_batch_size_is_refused(cli, compiled, tmp_path):
    done = cli("train", compiled, "--batch-size", "2", "--out", tmp_path / "run", *QUICK_TRAIN)
    assert_user_error(done, "batch size 4", "not 2")


def test_profile_of_another_input_shape_is_refused(cli, bad_files, tmp_path):
    """A symbolic-shape model profiled at 3x8x8 and trained at 3x16x16 with that profile."""
    prof = tmp_path / "profile.json"
    done = cli("profile", bad_files["dynamic"], "--input-shape", "3x8x8", "--repeats", "1",
               "--warmup", "0", "-o", prof)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    done = cli("train", bad_files["dynamic"], "--profile", prof, "--input-shape", "3x16x16",
               "--out", tmp_path / "run", *QUICK_TRAIN)  # fmt: skip
    assert_user_error(done, "3x8x8", "3x16x16")


def test_tampered_profile_cache_entry_is_not_reused(cli, compiled, tiny_cnn_onnx, cache_env):
    """A cache file whose content is another model's profile is detected by hash."""
    cache = Path(cache_env["ETGRAPH_CACHE"]) / "profiles"
    entry = json.loads((compiled / "profile.json").read_text())
    victims = []
    for path in cache.glob("*.json"):
        if json.loads(path.read_text())["model_hash"] == entry["model_hash"]:
            victims.append((path, path.read_text()))
            path.write_text(json.dumps({**entry, "model_hash": "0123456789abcdef"}))
    assert victims
    try:
        out = compiled.parent / "tampered"
        done = cli("compile", tiny_cnn_onnx, "-o", out, "--rho", "1", *QUICK_COMPILE)
        if done.returncode == 0:  # re-measured: the tampered entry was not used
            assert (
                json.loads((out / "profile.json").read_text())["model_hash"] != "0123456789abcdef"
            )
        else:
            assert_user_error(done, "profile")
    finally:
        for path, text in victims:
            path.write_text(text)


# ---- corrupt checkpoints on train --resume -------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(cli, profile_json, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "run"
    done = cli("train", "--profile", profile_json, "--rho", "1", "--out", out, *QUICK_TRAIN)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _corrupt_truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _corrupt_garbage(data: bytes) -> bytes:
    rng = np.random.default_rng(1)
    return data[:8] + rng.integers(0, 256, size=len(data) - 8, dtype=np.uint8).tobytes()


def _corrupt_zeros(data: bytes) -> bytes:
    return bytes(len(data))


def _corrupt_not_a_checkpoint(data: bytes) -> bytes:
    return b"{}"


@pytest.mark.parametrize(
    "corrupt",
    [_corrupt_truncated, _corrupt_garbage, _corrupt_zeros, _corrupt_not_a_checkpoint],
    ids=lambda f: f.__name__.removeprefix("_corrupt_"),
)
def test_resume_with_corrupt_checkpoint(cli, finished_run, tmp_path, corrupt):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    ckpt = run / "checkpoint"
    ckpt.write_bytes(corrupt(ckpt.read_bytes()))
    assert_user_error(cli("train", "--resume", run), "checkpoint", str(ckpt))


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_resume_with_checkpoint_of_wrong_shapes(cli, finished_run, tmp_path, change):
    """A well-formed checkpoint whose tensors do not fit the model (ORT would raise inside
    Module creation or the first step)."""
    from etgraph.checkpoint import read_checkpoint, write_checkpoint

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    state, requires_grad, properties = read_checkpoint(run / "checkpoint")
    name = requires_grad[0]
    w = state.weights[name]
    if change == "shape":
        state.weights[name] = np.zeros((w.shape[0] + 1, *w.shape[1:]), w.dtype)
    else:
        state.weights[name] = w.astype(np.float64)
    state.moments.pop(name, None)
    write_checkpoint(run / "checkpoint", state, requires_grad, properties=properties)
    (run / "checkpoint.sha256").unlink()  # as written by hand: no digest to check first
    assert_user_error(cli("train", "--resume", run), "checkpoint", name)


def test_resume_after_the_model_file_was_replaced(cli, profile_json, tmp_path):
    """A run's model file replaced by another graph since the run started: the resume says so
    and what to do (before: the profile's "profile this model", which cannot help a run)."""
    import onnx
    from onnx import helper

    from etgraph.data import DEFAULT_MODEL_PATH

    model_file = tmp_path / "model.onnx"
    shutil.copyfile(DEFAULT_MODEL_PATH, model_file)
    run = tmp_path / "run"
    done = cli("train", model_file, "--profile", profile_json, "--out", run, *QUICK_TRAIN)
    assert done.returncode == 0, done.stderr[-3000:]
    other = onnx.load(model_file)  # the same weights, a ReLU made a sigmoid: another graph
    relu = next(n for n in other.graph.node if n.op_type == "Relu")
    relu.CopyFrom(helper.make_node("Sigmoid", list(relu.input), list(relu.output), relu.name))
    onnx.save(other, model_file)
    again = cli("train", "--resume", run, "--epochs", "2")
    assert_user_error(again, f"{model_file} is no longer the model the run", "put that model back")


# ---- --debug -------------------------------------------------------------------------------


def test_debug_shows_tracebacks(cache_env, bad_files, tmp_path):
    done = run_cli("--debug", "compile", bad_files["text"], "-o", tmp_path / "o", env=cache_env)
    assert done.returncode != 0 and "Traceback" in done.stderr
    assert "ModelError" in done.stderr


def test_unexpected_error_is_one_line_without_debug_and_a_traceback_with(
    monkeypatch, capsys, tmp_path
):
    """An internal bug (not an EtgraphError) still ends in one line naming --debug; with
    --debug the traceback is shown."""
    from etgraph import cli as cli_module
    from etgraph import graph

    def broken(*args, **kwargs):
        raise RuntimeError("simulated internal failure")

    monkeypatch.setattr(graph, "load_tensor_graph", broken)
    model = tmp_path / "x.onnx"
    model.write_bytes(b"")  # never read: the graph build above fails first
    with pytest.raises(SystemExit, match="3") as exit_info:
        cli_module.main(["inspect", str(model)])
    assert exit_info.value.code == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("etgraph: internal error:"), err
    assert "simulated internal failure" in err[0] and "--debug" in err[0]
    with pytest.raises(RuntimeError, match="simulated internal failure"):
        cli_module.main(["--debug", "inspect", str(model)])
