"""Elastic training runtime: checkpoint format, state carried across re-selection, strategies,
an end-to-end run on a subsample of the default task, determinism, and resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from onnx import numpy_helper

from etgraph import graph, onnx_io
from etgraph import model as model_spec
from etgraph.artifacts import ArtifactCache
from etgraph.errors import CheckpointError, ConfigError, InfeasibleBudgetError
from etgraph.runtime import (
    RUN_PROPERTY,
    CarriedState,
    TrainConfig,
    TrainingSession,
    evaluate_onnx,
    read_checkpoint,
    resume,
    train,
    write_checkpoint,
)
from etgraph.selection import strategy_mask

QUICK = dict(max_steps_per_epoch=8, max_val_batches=12)


@pytest.fixture(scope="module")
def default_profile(tmp_path_factory, default_model_path):
    """A real (short) profile of the default model at batch 4, saved as JSON too."""
    from etgraph.profiler import profile_model

    root = tmp_path_factory.mktemp("profile")
    prof = profile_model(
        default_model_path, batch_size=4, repeats=2, warmup=1, cache_dir=root / "cache"
    )
    prof.save(root / "profile.json")
    return prof, root / "profile.json"


@pytest.fixture(scope="module")
def rho(default_profile):
    """A rho that leaves room for a real selection whatever this (noisy, shared) machine
    measured: 0.6, or 0.1 above the forward-pass floor if that is higher."""
    from etgraph.timing import min_feasible_rho

    prof, _ = default_profile
    floor = min_feasible_rho(prof.t_dw_us, prof.t_dy_us, prof.forward_us, prof.t_full_us)
    return round(min(0.95, max(0.6, floor + 0.1)), 3)


@pytest.fixture(scope="module")
def default_model(default_model_path):
    model = onnx_io.load_model(default_model_path)
    tensors = graph.trainable_tensors(model)
    stats = list(graph.running_statistics(model))
    weights = {
        i.name: numpy_helper.to_array(i).copy()
        for i in model.graph.initializer
        if i.name in {t.name for t in tensors} | set(stats)
    }
    return model, tensors, stats, weights


# ---- checkpoint format ------------------------------------------------------------------------


def test_checkpoint_round_trip_and_corruption(tmp_path):
    rng = np.random.default_rng(0)
    weights = {
        "a": rng.standard_normal((3, 2)).astype(np.float32),
        "b": rng.standard_normal(4).astype(np.float32),
        "c": rng.standard_normal(()).astype(np.float32),
    }
    moments = {
        "a": {
            "momentum0": np.ones((3, 2), np.float32),
            "momentum1": np.full((3, 2), 2.0, np.float32),
        }
    }
    path = tmp_path / "ck"
    write_checkpoint(
        path, CarriedState(weights, moments, step=7), ["a", "b"], properties={"k": "v"}
    )
    state, requires_grad, props = read_checkpoint(path)
    assert sorted(requires_grad) == ["a", "b"] and props == {"k": "v"} and state.step == 7
    for name, value in weights.items():
        np.testing.assert_array_equal(state.weights[name], value)
        assert state.weights[name].dtype == value.dtype
    np.testing.assert_array_equal(state.moments["a"]["momentum1"], moments["a"]["momentum1"])
    assert not state.moments["b"]["momentum0"].any()  # a newly trainable tensor starts at zero
    assert "c" not in state.moments  # frozen tensors have no moments

    data = path.read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) // 3])
    (tmp_path / "junk").write_bytes(b"not a checkpoint at all")
    for bad in ("cut", "junk", "missing"):
        with pytest.raises(CheckpointError):
            read_checkpoint(tmp_path / bad)
    with pytest.raises(ConfigError):
        write_checkpoint(path, CarriedState(weights), ["nope"])


# ---- carrying state across a re-selection -----------------------------------------------------


def _session(model, tensors, stats, selected, state, cache, ckpt):
    names = [t.name for t in tensors]
    trainable = [names[i] for i in selected]
    frozen = [n for n in names if n not in trainable] + stats
    paths, _ = cache.get(model, trainable, frozen)
    write_checkpoint(ckpt, state, trainable)
    return TrainingSession(paths, ckpt, threads=None), trainable


def test_state_carried_exactly_across_reselection(tmp_path, default_model):
    from etgraph.data import load_dataset

    model, tensors, stats, initial = default_model
    n = len(tensors)
    cache = ArtifactCache(tmp_path / "artifacts")
    data = load_dataset(None, input_shape=model_spec.input_shape(model))
    sel_a = list(range(n - 6, n))  # the last 6 tensors
    sel_b = [0, 1] + list(range(n - 3, n))  # 2 new at the input, 3 kept at the output
    session_a, train_a = _session(
        model, tensors, stats, sel_a, CarriedState(dict(initial)), cache, tmp_path / "a.ckpt"
    )
    for x, y in list(data.train_batches(4, seed=1))[:3]:
        loss, _ = session_a.train_step(x, y, 1e-3)
        assert np.isfinite(loss)
    session_a.save(tmp_path / "after_a", {RUN_PROPERTY: "{}"})
    carried, requires_grad, _ = read_checkpoint(tmp_path / "after_a")
    assert sorted(requires_grad) == sorted(train_a) and carried.step == 3

    names = [t.name for t in tensors]
    for name in names:
        changed = not np.array_equal(carried.weights[name], initial[name])
        assert changed == (name in train_a), name  # trained tensors move, frozen ones do not
    assert any(not np.array_equal(carried.weights[s], initial[s]) for s in stats)  # BN stats run

    session_b, train_b = _session(model, tensors, stats, sel_b, carried, cache, tmp_path / "b.ckpt")
    live = session_b.weights()
    assert set(live) == set(carried.weights)
    for name, value in carried.weights.items():
        np.testing.assert_array_equal(live[name], value)  # every weight carried bit-exactly
    session_b.save(tmp_path / "start_b", {})
    state_b, _, _ = read_checkpoint(tmp_path / "start_b")
    assert state_b.step == 3
    for name in train_b:
        for moment in ("momentum0", "momentum1"):
            got = state_b.moments[name][moment]
            if name in train_a:
                np.testing.assert_array_equal(got, carried.moments[name][moment])
                assert got.any()
            else:
                assert not got.any()
    x, y = data.probe_batch(4, seed=5)
    loss, _ = session_b.train_step(x, y, 1e-3)
    assert np.isfinite(loss)


# ---- strategies -------------------------------------------------------------------------------


def test_strategy_masks(default_profile, default_model, rho):
    prof, _ = default_profile
    _, tensors, _, _ = default_model
    n = len(tensors)
    importance = np.linspace(1.0, 2.0, n)
    assert strategy_mask("full", tensors, prof, 0.5, None).all()
    last = strategy_mask("last-layer", tensors, prof, 0.5, None)
    assert last[-1] and last.sum() == sum(t.layer == tensors[-1].layer for t in tensors)
    bn_bias = strategy_mask("bn-bias", tensors, prof, 0.5, None)
    for t, s in zip(tensors, bn_bias, strict=True):
        assert s == (t.kind in ("gamma", "beta", "bias") or t.layer == tensors[-1].layer)
    budget = rho * prof.t_full_us  # rho is relative to the time model's own full step
    for strategy in ("elastic", "topk", "prefix"):
        mask = strategy_mask(strategy, tensors, prof, rho, importance)
        assert mask.any() and prof.predicted_step_us(mask) <= budget + 1e-6, strategy
    prefix = strategy_mask("prefix", tensors, prof, rho, None)
    first = int(np.flatnonzero(prefix)[0])
    assert prefix[first:].all()
    with pytest.raises(InfeasibleBudgetError):
        strategy_mask("elastic", tensors, prof, 0.5 * prof.forward_us / prof.t_full_us, importance)


def test_config_validation():
    for bad in (
        dict(rho=0.0),
        dict(rho=1.5),
        dict(period=0),
        dict(epochs=0),
        dict(batch_size=0),
        dict(strategy="random"),
        dict(learning_rate=-1.0),
    ):
        with pytest.raises(ConfigError):
            TrainConfig(**bad).validate()


# ---- end to end -------------------------------------------------------------------------------


def _losses(out_dir):
    return [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]


def test_elastic_run_outputs_export_and_determinism(
    tmp_path, default_profile, default_model_path, rho
):
    from PIL import Image

    prof, _ = default_profile
    config = TrainConfig(epochs=3, period=1, rho=rho, seed=1, **QUICK)
    result = train(default_model_path, prof, config, tmp_path / "run", progress=False)
    out = tmp_path / "run"
    records = _losses(out)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["selection"] and r["steps"] == QUICK["max_steps_per_epoch"]
        assert r["predicted_step_us"] <= rho * prof.t_full_us + 1e-6
        assert r["measured_step_us"] > 0 and r["wall_time_s"] > 0 and r["peak_rss_mb"] > 0
        assert r["reselection_s"] > 0 and np.isfinite(r["train_loss"] + r["val_loss"])
    _, _, props = read_checkpoint(out / "checkpoint")
    assert json.loads(props[RUN_PROPERTY])["epoch"] == 3
    for png in ("curves.png", "selection.png"):
        with Image.open(out / png) as img:
            assert img.size[0] > 100
    assert json.loads((out / "summary.json").read_text())["epochs"] == 3
    # the exported inference model reproduces the final validation accuracy
    from etgraph.data import load_dataset

    data = load_dataset(None, input_shape=prof.input_shape, seed=1)
    batches = list(data.val_batches(4))[: QUICK["max_val_batches"]]
    loss, acc = evaluate_onnx(out / "model_trained.onnx", batches, 4)
    assert acc == pytest.approx(records[-1]["val_acc"], abs=1e-9)
    assert loss == pytest.approx(records[-1]["val_loss"], rel=1e-4)
    assert result.inference_val_acc == pytest.approx(records[-1]["val_acc"], abs=1e-9)
    # determinism: the same seed and data give the same selections and losses
    train(default_model_path, prof, config, tmp_path / "again", progress=False)
    again = _losses(tmp_path / "again")
    assert [r["selection"] for r in again] == [r["selection"] for r in records]
    for key in ("train_loss", "val_loss", "val_acc"):
        np.testing.assert_allclose([r[key] for r in again], [r[key] for r in records], rtol=1e-5)
    # an existing run is not overwritten
    with pytest.raises(ConfigError):
        train(default_model_path, prof, config, tmp_path / "run", progress=False)


def test_resume_after_sigkill(tmp_path, default_profile, default_model_path, rho):
    prof, profile_json = default_profile
    out = tmp_path / "killed"
    args = [
        sys.executable, "-m", "etgraph", "train", str(default_model_path),
        "--profile", str(profile_json), "--epochs", "4", "--period", "1", "--rho", str(rho),
        "--max-steps-per-epoch", "25", "--max-val-batches", "5", "--out", str(out), "--quiet",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (out / "checkpoint").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    killed_at = len(_losses(out))
    assert killed_at < 4, "the run finished before it could be killed"
    _, _, props = read_checkpoint(out / "checkpoint")  # the last good checkpoint loads
    assert json.loads(props[RUN_PROPERTY])["epoch"] >= 1

    done = subprocess.run(
        [sys.executable, "-m", "etgraph", "train", "--resume", str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "val accuracy" in done.stdout
    records = _losses(out)
    assert [r["epoch"] for r in records] == [1, 2, 3, 4]
    assert (out / "model_trained.onnx").is_file()
    # the resumed run continues exactly like an uninterrupted one
    config = TrainConfig(epochs=4, period=1, rho=rho, max_steps_per_epoch=25, max_val_batches=5)
    train(default_model_path, prof, config, tmp_path / "straight", progress=False)
    straight = _losses(tmp_path / "straight")
    assert [r["selection"] for r in straight] == [r["selection"] for r in records]
    np.testing.assert_allclose(
        [r["val_loss"] for r in records], [r["val_loss"] for r in straight], rtol=1e-5
    )


def test_resume_errors(tmp_path, default_profile, default_model_path, rho):
    with pytest.raises(CheckpointError):
        resume(tmp_path / "nothing-here", progress=False)
    prof, _ = default_profile
    config = TrainConfig(epochs=1, period=1, rho=rho, **QUICK)
    out = tmp_path / "run"
    train(default_model_path, prof, config, out, progress=False)
    (out / "checkpoint").write_bytes((out / "checkpoint").read_bytes()[:200])
    with pytest.raises(CheckpointError):
        resume(out, progress=False)
