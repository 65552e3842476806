"""`etgraph train`: out of the box, from a compiled directory, and its one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import assert_user_error, run_cli, run_cli_in_process

QUICK = ["--max-steps-per-epoch", "4", "--max-val-batches", "4", "--quiet"]


@pytest.fixture(scope="module")
def profile_json(default_profile):
    return default_profile[1]


def _epochs(out) -> list[int]:
    return [json.loads(line)["epoch"] for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_train_out_of_the_box_profiles_with_the_cache(tmp_path):
    """No model, no profile: the embedded model and data, profiled on the fly into the cache.

    rho 0.9: the forward-pass floor measured on a loaded shared machine can exceed 0.5."""
    out = tmp_path / "run"
    env = {"ETGRAPH_CACHE": str(tmp_path / "cache")}
    done = run_cli("train", "--epochs", "2", "--period", "1", "--rho", "0.9", "--out", str(out),
                   *QUICK, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    for word in ("val accuracy", "speedup", "rho", "requested 0.90"):
        assert word in done.stdout
    assert _epochs(out) == [1, 2]
    cached = list((tmp_path / "cache" / "profiles").glob("*.json"))
    # cached, unless the machine was too busy for two profiling rounds to agree (by design)
    assert cached or "profile not cached" in done.stderr
    for name in ("checkpoint", "model_trained.onnx", "curves.png", "selection.png"):
        assert (out / name).is_file(), name


@pytest.mark.slow
def test_train_compiled_directory_and_strategy(tmp_path, default_model_path, profile_json):
    compiled = tmp_path / "compiled"
    compiled.mkdir()
    shutil.copy(default_model_path, compiled / "model.onnx")
    shutil.copy(profile_json, compiled / "profile.json")
    out = tmp_path / "run"
    done = run_cli_in_process("train", str(compiled), "--epochs", "1", "--out", str(out), *QUICK)
    assert_user_error(done, "unfinished compile (no plan.json)", "etgraph compile MODEL -o")
    (compiled / "plan.json").write_text(json.dumps({"rho": 0.7, "batch_size": 4}))
    done = run_cli_in_process("train", str(compiled), "--strategy", "bn-bias", "--epochs", "1",
                              "--out", str(out), *QUICK)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bn-bias" in done.stdout and _epochs(out) == [1]
    # training into the compiled directory would overwrite its profile and artifacts
    done = run_cli_in_process(
        "train", str(compiled), "--epochs", "1", "--out", str(compiled), *QUICK
    )
    assert_user_error(done, "is a compiled directory", "another --out")
    # nor can a compile overwrite the run
    done = run_cli_in_process("compile", "-o", str(out))
    assert_user_error(done, "holds a training run", "another -o")
    # rho and batch size default to the compiled plan's, not to the option defaults
    out = tmp_path / "run_planned"
    done = run_cli_in_process("train", str(compiled), "--epochs", "1", "--out", str(out), *QUICK)
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((out / "run.json").read_text())["config"]
    assert (config["rho"], config["batch_size"]) == (0.7, 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, fragment, code",
    [
        (["--rho", "0"], "'--rho'", 2),  # out of the option's range: click's usage error
        (["--rho", "1.5"], "'--rho'", 2),
        (["--period", "0"], "'--period'", 2),
        (["--batch-size", "0"], "'--batch-size'", 2),
        (["--rho", "0.0001"], "rho", 1),  # below the forward-pass floor: gives the smallest rho
    ],
)
def test_train_bad_settings_are_one_line_errors(tmp_path, profile_json, args, fragment, code):
    done = run_cli_in_process("train", "--profile", str(profile_json),
                              "--out", str(tmp_path / "o"), "--epochs", "1", *args,
                              *QUICK)  # fmt: skip
    assert done.returncode == code
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("etgraph: error:"), done.stderr
    assert fragment in lines[0]


def test_train_usage_errors(tmp_path):
    """Refused before any profile or model is read (so the profile need not exist)."""
    missing_out = run_cli_in_process("train", "--profile", str(tmp_path / "profile.json"))
    assert missing_out.returncode == 1 and "--out" in missing_out.stderr
    no_model = run_cli_in_process(
        "train", str(tmp_path / "nope.onnx"), "--out", str(tmp_path / "o")
    )
    assert_user_error(no_model, "nope.onnx: no such model file or compiled directory")
    no_run = run_cli_in_process("train", "--resume", str(tmp_path / "nowhere"))
    assert no_run.returncode == 1 and "not a run directory (it does not exist)" in no_run.stderr
    (tmp_path / "empty").mkdir()
    no_run = run_cli_in_process("train", "--resume", str(tmp_path / "empty"))
    assert no_run.returncode == 1 and "no training run" in no_run.stderr
    bad_strategy = run_cli_in_process("train", "--strategy", "random", "--out", str(tmp_path / "o"))
    assert bad_strategy.returncode == 2


def test_train_data_errors_come_before_profiling(tmp_path):
    """A missing dataset is reported before the model is profiled (empty profile cache)."""
    cache = tmp_path / "cache"
    done = run_cli_in_process("train", "--data", str(tmp_path / "no_images"),
                              "--out", str(tmp_path / "o"), *QUICK,
                              env={"ETGRAPH_CACHE": str(cache)})  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no_images" in lines[0], done.stderr
    assert not list(cache.glob("profiles/*.json")), "profiled before reading the data"


def _image_folder(root, classes: int = 5, per_class: int = 8):
    """A folder of ``classes`` sub-folders of small random RGB PNGs."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for k in range(classes):
        (root / f"class{k}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class{k}" / f"{i}.png")
    return root


@pytest.mark.slow
def test_compile_shows_progress_and_train_dir_uses_the_compiled_data(tmp_path, cache_env):
    """`compile --data DIR -o RUN` then the printed `etgraph train RUN` trains on DIR (not the
    digits: a 5-class folder for the 5-class default model here); compile says what it is doing
    on stderr (at a terminal or with -v; nothing with -q); `train --resume D --epochs N` extends
    a finished run."""
    images = _image_folder(tmp_path / "my images")
    compiled = tmp_path / "compiled"
    done = run_cli_in_process(
        "compile", "-v", "--data", images, "-o", compiled, "--rho", "0.9", env=cache_env
    )  # fmt: skip (progress lines: at a terminal, or with -v)
    assert done.returncode == 0, done.stderr[-2000:]
    for stage in ("building the tensor graph", "profiling", "importance on a probe batch",
                  "selecting tensors", "writing the artifacts"):  # fmt: skip
        assert stage in done.stderr, stage
    assert json.loads((compiled / "plan.json").read_text())["data"] == str(images.resolve())
    quiet = run_cli_in_process(
        "compile", "-q", "--data", images, "-o", compiled, "--rho", "0.9", env=cache_env
    )
    # nothing but the profiler's warnings of a loaded machine (it profiles again when a
    # profile measured under load did not reproduce: load-dependent)
    noise = [line for line in quiet.stderr.splitlines() if not line.startswith("WARNING")]
    assert quiet.returncode == 0 and noise == [], quiet.stderr[-2000:]
    out = tmp_path / "run"
    done = run_cli_in_process("train", compiled, "--epochs", "1", "--period", "1", "-o", out,
                              *QUICK, env=cache_env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "was compiled with" in done.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["data"] == str(images.resolve())
    assert json.loads((out / "classes.json").read_text())["class_names"] == [
        f"class{k}" for k in range(5)
    ]
    # a finished run is extended, not refused; fewer epochs are refused
    done = run_cli_in_process("train", "--resume", out, "--epochs", "2", "--quiet", env=cache_env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _epochs(out) == [1, 2]
    assert json.loads((out / "summary.json").read_text())["epochs"] == 2
    done = run_cli_in_process("train", "--resume", out, "--epochs", "1", env=cache_env)
    assert_user_error(done, "extends a run", "more than its 2 epochs")
    done = run_cli_in_process("train", "--resume", out, "--lr", "1", env=cache_env)
    assert_user_error(done, "drop --lr")


@pytest.mark.slow
def test_full_strategy_summary_does_not_compare_full_training_with_itself(tmp_path, profile_json):
    out = tmp_path / "run"
    done = run_cli_in_process("train", "--strategy", "full", "--epochs", "1",
                              "--profile", profile_json, "-o", out, *QUICK)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "speedup" not in done.stdout and "rho " not in done.stdout
    assert "full step" in done.stdout


def test_a_failed_compile_leaves_nothing_behind(tmp_path, monkeypatch):
    """The default -o (etgraph-out) is created only to be removed again when the compile fails."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.onnx").write_bytes(b"not a model")
    done = run_cli_in_process("compile", "model.onnx")
    assert_user_error(done, "not a readable ONNX model")
    (tmp_path / "model.onnx").unlink()
    assert list(tmp_path.iterdir()) == []
