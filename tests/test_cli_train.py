"""`etgraph train`: out of the box, from a compiled directory, and its one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import assert_user_error, run_cli

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
    assert list((tmp_path / "cache" / "profiles").glob("*.json"))  # the profile was cached
    for name in ("checkpoint", "model_trained.onnx", "curves.png", "selection.png"):
        assert (out / name).is_file(), name


@pytest.mark.slow
def test_train_compiled_directory_and_strategy(tmp_path, default_model_path, profile_json):
    compiled = tmp_path / "compiled"
    compiled.mkdir()
    shutil.copy(default_model_path, compiled / "model.onnx")
    shutil.copy(profile_json, compiled / "profile.json")
    out = tmp_path / "run"
    done = run_cli("train", str(compiled), "--epochs", "1", "--out", str(out), *QUICK)
    assert_user_error(done, "unfinished compile (no plan.json)", "etgraph compile MODEL -o")
    (compiled / "plan.json").write_text(json.dumps({"rho": 0.7, "batch_size": 4}))
    done = run_cli("train", str(compiled), "--strategy", "bn-bias", "--epochs", "1",
                   "--out", str(out), *QUICK)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bn-bias" in done.stdout and _epochs(out) == [1]
    # training into the compiled directory would overwrite its profile and artifacts
    done = run_cli("train", str(compiled), "--epochs", "1", "--out", str(compiled), *QUICK)
    assert_user_error(done, "is a compiled directory", "another --out")
    # nor can a compile overwrite the run
    done = run_cli("compile", "-o", str(out))
    assert_user_error(done, "holds a training run", "another -o")
    # rho and batch size default to the compiled plan's, not to the option defaults
    out = tmp_path / "run_planned"
    done = run_cli("train", str(compiled), "--epochs", "1", "--out", str(out), *QUICK)
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((out / "run.json").read_text())["config"]
    assert (config["rho"], config["batch_size"]) == (0.7, 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--rho", "0"], "rho"),
        (["--rho", "1.5"], "rho"),
        (["--period", "0"], "period"),
        (["--batch-size", "0"], "batch size"),
        (["--rho", "0.0001"], "rho"),  # below the forward-pass floor: gives the smallest rho
    ],
)
def test_train_bad_settings_are_one_line_errors(tmp_path, profile_json, args, fragment):
    done = run_cli("train", "--profile", str(profile_json), "--out", str(tmp_path / "o"),
                   "--epochs", "1", *args, *QUICK)  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("etgraph: error:"), done.stderr
    assert fragment in lines[0]


def test_train_usage_errors(tmp_path):
    """Refused before any profile or model is read (so the profile need not exist)."""
    missing_out = run_cli("train", "--profile", str(tmp_path / "profile.json"))
    assert missing_out.returncode == 1 and "--out" in missing_out.stderr
    no_model = run_cli("train", str(tmp_path / "nope.onnx"), "--out", str(tmp_path / "o"))
    assert no_model.returncode == 1 and "does not exist" in no_model.stderr
    no_run = run_cli("train", "--resume", str(tmp_path / "nowhere"))
    assert no_run.returncode == 1 and "not a run directory (it does not exist)" in no_run.stderr
    (tmp_path / "empty").mkdir()
    no_run = run_cli("train", "--resume", str(tmp_path / "empty"))
    assert no_run.returncode == 1 and "no training run" in no_run.stderr
    bad_strategy = run_cli("train", "--strategy", "random", "--out", str(tmp_path / "o"))
    assert bad_strategy.returncode == 2


def test_train_data_errors_come_before_profiling(tmp_path):
    """A missing dataset is reported before the model is profiled (empty profile cache)."""
    cache = tmp_path / "cache"
    done = run_cli("train", "--data", str(tmp_path / "no_images"), "--out", str(tmp_path / "o"),
                   *QUICK, env={"ETGRAPH_CACHE": str(cache)})  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no_images" in lines[0], done.stderr
    assert not list(cache.glob("profiles/*.json")), "profiled before reading the data"
