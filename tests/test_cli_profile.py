"""``etgraph profile``: writes profile.json, uses the cache, one-line errors."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli_in_process

from etgraph import onnx_io
from etgraph.model import LoadedModel


def cache_at(path) -> dict[str, str]:
    return {"ETGRAPH_CACHE": str(path)}


@pytest.mark.slow
def test_profile_writes_json_and_hits_the_cache(tiny_cnn_onnx, tmp_path):
    out = tmp_path / "profile.json"
    args = ("profile", str(tiny_cnn_onnx), "--repeats", "3", "--threads", "1", "-o", str(out))
    first = run_cli_in_process(*args, "--batch-size", "2", env=cache_at(tmp_path / "cache"))
    assert first.returncode == 0, first.stderr
    assert "tensors, batch 2, input 3x32x32, 1 threads" in first.stdout
    assert "level fast" in first.stdout  # the default
    assert "full step" in first.stdout and "ms measured" in first.stdout
    assert "wrote" in first.stdout
    data = json.loads(out.read_text())
    model = onnx_io.load_model(tiny_cnn_onnx)
    names = LoadedModel.load(tiny_cnn_onnx).names
    assert [r["name"] for r in data["tensor_timings"]] == names
    assert all(r["t_dw_us"] >= 0 and r["t_dy_us"] >= 0 for r in data["tensor_timings"])
    assert data["batch_size"] == 2 and data["input_shapes"] == {"input": [3, 32, 32]}
    assert data["threads"] == 1 and data["model_hash"] == onnx_io.model_hash(model)
    assert data["format_version"] == 6 and data["level"] == "fast"
    assert data["measured_full_step_us"] > 0 and data["forward_us"] > 0
    assert f"full step {data['measured_full_step_us'] / 1e3:.1f} ms measured" in first.stdout
    assert data["ort_version"] and data["host"]
    cached = list((tmp_path / "cache" / "profiles").glob("*.json"))
    if "profile not cached" in first.stderr:  # by design on a machine too busy for two
        assert data["reproduced"] is False and not cached  # rounds to agree (test_profiler.py)
        return
    assert len(cached) == 1

    second = run_cli_in_process(*args, "--batch-size", "2", env=cache_at(tmp_path / "cache"))
    assert second.returncode == 0, second.stderr
    again = json.loads(out.read_text())
    assert again["tensor_timings"] == data["tensor_timings"]
    assert again["profiling_s"] == data["profiling_s"]  # not re-measured

    # The thorough level is its own cache entry.
    third = run_cli_in_process(
        *args, "--batch-size", "2", "--profile-level", "thorough", env=cache_at(tmp_path / "cache")
    )
    assert third.returncode == 0, third.stderr
    assert "level thorough" in third.stdout
    assert json.loads(out.read_text())["level"] == "thorough"
    assert len(list((tmp_path / "cache" / "profiles").glob("*.json"))) == 2


def test_profile_errors_are_one_line(tiny_cnn_onnx, tmp_path):
    missing = run_cli_in_process("profile", str(tmp_path / "nope.onnx"), env=cache_at(tmp_path))
    assert missing.returncode == 1
    assert missing.stderr.startswith("etgraph: error:")
    assert len(missing.stderr.strip().splitlines()) == 1
    bad_shape = run_cli_in_process(
        "profile", str(tiny_cnn_onnx), "--input-shape", "3xx32", env=cache_at(tmp_path)
    )
    assert bad_shape.returncode == 1
    assert "input shape" in bad_shape.stderr
    bad_level = run_cli_in_process(
        "profile", str(tmp_path / "nope.onnx"), "--profile-level", "quick", env=cache_at(tmp_path)
    )
    assert bad_level.returncode == 2  # click's usage error names the choices
    assert "'quick' is not one of 'fast', 'thorough'" in bad_level.stderr
