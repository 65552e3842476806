"""Elastic training: checkpoint format (etgraph.checkpoint), the run directory (etgraph.rundir),
state carried across re-selection, strategies, an end-to-end run of the period loop
(etgraph.loop) on a subsample of the default task, determinism, and resume after SIGKILL."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from etgraph import rundir
from etgraph.artifacts import ArtifactCache
from etgraph.checkpoint import CarriedState, read_checkpoint, write_checkpoint
from etgraph.config import TrainConfig
from etgraph.errors import (
    CheckpointError,
    ConfigError,
    InfeasibleBudgetError,
    TrainingDivergedError,
)
from etgraph.loop import resume, train
from etgraph.model import LoadedModel
from etgraph.rundir import RUN_PROPERTY
from etgraph.selection import strategy_mask
from etgraph.sessions import TrainingSession, evaluate_onnx
from etgraph.steps import cosine_learning_rate

QUICK = dict(max_steps_per_epoch=8, max_val_batches=12)


@pytest.fixture(scope="module")
def rho(default_profile):
    """A rho that leaves room for a real selection whatever this (noisy, shared) machine
    measured: 0.6, or 0.1 above the forward-pass floor if that is higher."""
    from etgraph.timing import min_feasible_rho

    prof, _ = default_profile
    floor = min_feasible_rho(prof.t_dw_us, prof.t_dy_us, prof.forward_us, prof.t_full_us)
    return round(min(0.95, max(0.6, floor + 0.1)), 3)


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

    # views into the file's buffer, rewritten with another trainable set and no optimizer state
    views, _, _ = read_checkpoint(path, copy=False, moments=False)
    assert not views.moments and views.step == 7 and not views.weights["a"].flags.writeable
    write_checkpoint(tmp_path / "ck2", views, ["c"], optimizer_state=False)
    again, requires_grad, _ = read_checkpoint(tmp_path / "ck2")
    assert requires_grad == ["c"] and not again.moments and again.step == 0
    for name, value in weights.items():
        np.testing.assert_array_equal(again.weights[name], value)

    data = path.read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) // 3])
    (tmp_path / "junk").write_bytes(b"not a checkpoint at all")
    for bad, message in (
        ("cut", "is corrupt"),
        ("junk", "not an onnxruntime training checkpoint"),
        ("missing", "cannot read checkpoint"),
    ):
        with pytest.raises(CheckpointError, match=message):
            read_checkpoint(tmp_path / bad)
    with pytest.raises(ConfigError, match="no weight for trainable tensors"):
        write_checkpoint(path, CarriedState(weights), ["nope"])


def test_checkpoint_written_from_the_arrays_survives_the_builder_growing(tmp_path, monkeypatch):
    """The tensors' bytes are written from the arrays at places recorded while building; a
    builder that outgrows its first buffer moves what it built, and the file must not move."""
    import etgraph.checkpoint as checkpoint

    rng = np.random.default_rng(1)
    weights = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in
               enumerate([(3, 5), (7,), (), (64, 3, 3, 3), (1000,)])}  # fmt: skip
    moments = {"t0": {"momentum0": np.ones((3, 5), np.float32),
                      "momentum1": np.full((3, 5), 2.0, np.float32)}}  # fmt: skip
    state = CarriedState(weights, moments, step=3)
    write_checkpoint(tmp_path / "sized", state, ["t0", "t3"], properties={"k": "v"})
    real = checkpoint._builder
    monkeypatch.setattr(checkpoint, "_builder", lambda size: real(64))  # grows many times
    write_checkpoint(tmp_path / "grown", state, ["t0", "t3"], properties={"k": "v"})
    assert (tmp_path / "grown").read_bytes() == (tmp_path / "sized").read_bytes()
    again, requires_grad, _ = read_checkpoint(tmp_path / "grown")
    assert sorted(requires_grad) == ["t0", "t3"]
    for name, value in weights.items():
        np.testing.assert_array_equal(again.weights[name], value)
    np.testing.assert_array_equal(again.moments["t0"]["momentum1"], moments["t0"]["momentum1"])


# ---- carrying state across a re-selection -----------------------------------------------------


def _session(model: LoadedModel, selected, state, cache, ckpt, optimizer_state=True):
    mask = np.isin(np.arange(len(model.tensors)), selected)
    trainable, frozen = model.split(mask)
    paths, _ = cache.get(model.proto, trainable, frozen)
    write_checkpoint(ckpt, state, trainable, optimizer_state=optimizer_state)
    # one thread: the steps are bit-reproducible
    return TrainingSession(paths.directory, ckpt, threads=1, input_names=["input"]), trainable


@pytest.mark.slow
def test_state_carried_exactly_across_reselection(tmp_path, default_model):
    from etgraph.data import load_dataset

    model = default_model
    stats = list(model.running_stats)
    initial = model.initial_weights()
    n = len(model.tensors)
    cache = ArtifactCache(tmp_path / "artifacts")
    data = load_dataset(None, input_shape=model.input_shapes()["input"])
    sel_a = list(range(n - 6, n))  # the last 6 tensors
    sel_b = [0, 1] + list(range(n - 3, n))  # 2 new at the input, 3 kept at the output
    session_a, train_a = _session(
        model, sel_a, CarriedState(dict(initial)), cache, tmp_path / "a.ckpt"
    )
    # A state without moments or steps needs no optimizer group: ORT's Optimizer starts from
    # zero moments at step 0 itself, from a file a third of the size when every tensor trains.
    assert not CarriedState(dict(initial)).optimizer_state
    lean, _ = _session(
        model, sel_a, CarriedState(dict(initial)), cache, tmp_path / "lean.ckpt", False
    )
    assert (tmp_path / "lean.ckpt").stat().st_size < (tmp_path / "a.ckpt").stat().st_size
    for x, y in list(data.train_batches(4, seed=1))[:3]:
        loss, _ = session_a.train_step(x, y, 1e-3)
        assert np.isfinite(loss)
        assert lean.train_step(x, y, 1e-3)[0] == loss
    for name, value in lean.weights().items():
        np.testing.assert_array_equal(value, session_a.weights()[name])
    del lean
    session_a.save(tmp_path / "after_a", {RUN_PROPERTY: "{}"})
    carried, requires_grad, _ = read_checkpoint(tmp_path / "after_a")
    assert sorted(requires_grad) == sorted(train_a) and carried.step == 3
    assert carried.optimizer_state

    for name in model.names:
        changed = not np.array_equal(carried.weights[name], initial[name])
        assert changed == (name in train_a), name  # trained tensors move, frozen ones do not
    assert any(not np.array_equal(carried.weights[s], initial[s]) for s in stats)  # BN stats run

    session_b, train_b = _session(model, sel_b, carried, cache, tmp_path / "b.ckpt")
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


# ---- the run directory ------------------------------------------------------------------------


def test_run_file_round_trip_and_errors(tmp_path):
    config = TrainConfig(epochs=2, rho=0.7, seed=3)
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(CheckpointError, match="holds no training run"):
        rundir.read_run_file(out, TrainConfig.from_json)
    rundir.write_run_file(
        out,
        model=tmp_path / "m.onnx",
        config=config.to_json(),
        config_hash=config.digest(),
        artifacts_root=None,
    )
    model, again, root = rundir.read_run_file(out, TrainConfig.from_json)
    assert (model, again, root) == (tmp_path / "m.onnx", config, None)
    info = json.loads((out / "run.json").read_text())
    assert list(info) == ["model", "config", "config_hash", "artifacts_root", "task",
                          "earlier_config_hashes", "data_in_memory"]  # fmt: skip
    assert info["data_in_memory"] == []  # nothing given in memory: a CLI run

    (out / "run.json").write_text(json.dumps({**info, "config": {**info["config"], "rho": 0.5}}))
    with pytest.raises(CheckpointError, match="config hash differs"):
        rundir.read_run_file(out, TrainConfig.from_json)
    for broken in ("{not json", json.dumps({"config": info["config"]}), json.dumps([1])):
        (out / "run.json").write_text(broken)
        with pytest.raises(CheckpointError, match="is corrupt"):
            rundir.read_run_file(out, TrainConfig.from_json)


def test_config_digest_survives_fields_added_later():
    @dataclasses.dataclass(frozen=True)
    class Later(TrainConfig):  # the same settings, from code that added an option since
        new_option: int = 0

    config = TrainConfig(epochs=2, rho=0.7, seed=3, memory_mb=600.0)
    assert Later(epochs=2, rho=0.7, seed=3, memory_mb=600.0).digest() == config.digest()
    assert Later(epochs=2, rho=0.7, seed=3, memory_mb=600.0, new_option=1).digest() != (
        config.digest()
    )
    assert TrainConfig(epochs=2, rho=0.7, seed=4, memory_mb=600.0).digest() != config.digest()
    assert TrainConfig(epochs=2, rho=0.7, seed=3).digest() != config.digest()


def test_new_run_directory_checks(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="is not writable"):
        rundir.prepare_run_dir(blocker / "run")
    out = rundir.prepare_run_dir(tmp_path / "run")
    (out / "checkpoint").write_bytes(b"")
    with pytest.raises(ConfigError, match="already holds a training run"):
        rundir.prepare_run_dir(out)


def test_log_truncation_and_temporaries(tmp_path):
    out = tmp_path
    rundir.start_log(out)
    for epoch in (1, 2, 3):
        rundir.append_log(out, {"epoch": epoch, "val_loss": 1.0 / epoch})
    with open(out / "log.jsonl", "a") as f:
        f.write('{"epoch": 4, "val_lo')  # a line cut by a kill
    assert [r["epoch"] for r in rundir.read_log(out)] == [1, 2, 3]
    assert [r["epoch"] for r in rundir.truncate_log(out, 2)] == [1, 2]
    assert [json.loads(line)["epoch"] for line in (out / "log.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]
    # a line damaged in the middle costs that line only (it cost every record after it)
    lines = (out / "log.jsonl").read_text().splitlines()
    (out / "log.jsonl").write_text("\n".join([lines[0], "{garbage", lines[1]]) + "\n")
    assert [r["epoch"] for r in rundir.read_log(out)] == [1, 2]
    left = [".checkpoint.x1y2", ".log.jsonl.abc", ".model_trained.onnx.tmp", ".summary.json.q"]
    kept = [".other.file", "checkpoint"]
    for name in left + kept:
        (out / name).write_text("")
    rundir.remove_temporaries(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(["log.jsonl", *kept])


def test_resume_checks_of_the_checkpoint(tmp_path, default_model):
    model = default_model
    weights = model.initial_weights()
    mask = np.zeros(len(model.tensors), dtype=bool)
    mask[-2:] = True
    trainable, _ = model.split(mask)
    props = rundir.checkpoint_properties(
        epoch=3, global_step=24, mask=mask, config_hash="abc", seed=1
    )
    state = json.loads(props[RUN_PROPERTY])
    assert state["selection"] == list(np.flatnonzero(mask)) and state["global_step"] == 24
    ckpt = tmp_path / "checkpoint"
    write_checkpoint(ckpt, CarriedState(weights, step=24), trainable, properties=props)
    carried, epoch = rundir.read_run_checkpoint(tmp_path, model, "abc")
    assert epoch == 3 and carried.step == 24 and set(carried.weights) == set(weights)
    with pytest.raises(CheckpointError, match="belongs to another configuration"):
        rundir.read_run_checkpoint(tmp_path, model, "other")

    name = model.names[0]
    for change, message in (
        (lambda w: w.pop(name), "lacks tensors"),
        (lambda w: w.update({name: w[name].astype(np.float64)}), "float64"),
        (lambda w: w.update({name: np.zeros((1, *w[name].shape), w[name].dtype)}), "holds"),
    ):
        bad = dict(weights)
        change(bad)
        write_checkpoint(ckpt, CarriedState(bad), trainable, properties=props)
        with pytest.raises(CheckpointError, match=message):
            rundir.read_run_checkpoint(tmp_path, model, "abc")
    write_checkpoint(ckpt, CarriedState(weights), trainable)
    with pytest.raises(CheckpointError, match="has no run state"):
        rundir.read_run_checkpoint(tmp_path, model, "abc")


def test_summary_of_records(tmp_path):
    """Speed figures come from the loop's own measurements, elastic and full steps measured
    alike per epoch; the profile's measured full step (taken under profiling) is not used."""

    def record(epoch, period, reference_us, **kw):
        return dict(
            epoch=epoch,
            period=period,
            steps=10,
            wall_time_s=2.0,
            reselection_s=0.5,
            measured_step_us=110_000.0,
            median_step_us=100_000.0,
            reference_step_us=reference_us,
            reference_s=0.02,
            predicted_step_us=80_000.0,
            peak_rss_mb=100.0 + epoch,
            val_acc=0.5,
            val_loss=1.0,
            **kw,
        )

    # the machine slows down in epoch 2: both steps measured alike slow down with it; epoch 4's
    # one reference step was delayed by a burst of load (10x): medians over epochs ignore it
    # options chosen twice: the summary names the last choice and its reason
    records = [
        record(1, 0, 200_000.0, ort_config="on+stop", ort_note="quiet"),
        record(2, 0, 300_000.0, ort_config="on+stop", ort_note=""),
        record(3, 1, float("nan"), ort_config="off", ort_note="2.0x slower"),
        record(4, 1, 2_000_000.0, ort_config="off", ort_note=""),
    ]
    records[1]["median_step_us"] = 150_000.0
    profile = SimpleNamespace(measured_full_step_us=1.0, t_full_us=160_000.0)
    result = rundir.summarize(
        tmp_path,
        records,
        strategy="elastic",
        rho=0.5,
        profile=profile,
        inference_acc=0.5,
        trained_model=tmp_path / "m.onnx",
    )
    assert result.epochs == 4 and result.wall_time_s == 8.0
    # the median reference 0.3 s for all 40 steps
    assert result.full_step_us == pytest.approx(300_000.0)
    assert result.full_time_s == pytest.approx(12.0)
    assert result.speedup == pytest.approx(12.0 / 8.0)
    assert result.rho_predicted == pytest.approx(0.5)
    assert result.rho_achieved == pytest.approx(0.5)  # median of 0.5, 0.5, 0.05
    assert result.reference_overhead_pct == pytest.approx(100 * 0.08 / 8.0)
    assert result.first_selection_s == 1.0 and result.reselection_overhead_pct == 25.0
    assert (result.peak_rss_mb_first_period, result.peak_rss_mb_last_period) == (102.0, 104.0)
    assert (result.ort_config, result.ort_note) == ("off", "2.0x slower")
    rundir.write_summary(tmp_path, result)
    assert json.loads((tmp_path / "summary.json").read_text())["epochs"] == 4
    text = rundir.format_summary(result)
    for fragment in ("strategy            elastic", "speedup 1.50x", "requested 0.50"):
        assert fragment in text


def test_cosine_learning_rate():
    assert cosine_learning_rate(1.0, 0, 100) == 1.0
    assert cosine_learning_rate(1.0, 50, 100) == pytest.approx(0.5)
    assert cosine_learning_rate(1.0, 100, 100) == pytest.approx(0.0)
    assert cosine_learning_rate(1.0, 200, 100) == pytest.approx(0.0)  # clamped
    assert cosine_learning_rate(1e-3, 5, 0) == 1e-3


# ---- strategies -------------------------------------------------------------------------------


@pytest.mark.slow
def test_strategy_masks(default_profile, default_model, rho):
    prof, _ = default_profile
    tensors = list(default_model.tensors)
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
    with pytest.raises(InfeasibleBudgetError, match="raise rho to at least"):
        strategy_mask("elastic", tensors, prof, 0.5 * prof.forward_us / prof.t_full_us, importance)


def test_config_validation():
    for bad, message in (
        (dict(rho=0.0), "rho must be in"),
        (dict(rho=1.5), "rho must be in"),
        (dict(period=0), "period must be a positive integer"),
        (dict(epochs=0), "epochs must be a positive integer"),
        (dict(batch_size=0), "batch size must be a positive integer"),
        (dict(probe_batch_size=0), "probe batch size must be a positive integer"),
        (dict(strategy="random"), "unknown strategy 'random'"),
        (dict(importance="sgd"), "unknown importance 'sgd': choose one of adam, first-step"),
        (dict(learning_rate=-1.0), "learning rate must be positive"),
        (dict(seed=-1), "seed must be a non-negative integer, got -1"),
    ):
        with pytest.raises(ConfigError, match=message):
            TrainConfig(**bad).validate()


# ---- end to end -------------------------------------------------------------------------------


def _losses(out_dir):
    return [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_elastic_run_outputs_export_and_determinism(tmp_path, default_profile, default_model, rho):
    from PIL import Image

    import etgraph.period

    prof, _ = default_profile
    config = TrainConfig(epochs=3, period=1, rho=rho, seed=1, closed_loop=False, **QUICK)
    written = []  # (step, optimizer group written) of each selection's session checkpoint

    def write_checkpoint_seen(path, state, *args, **kwargs):
        written.append((state.step, kwargs.get("optimizer_state", True)))
        return write_checkpoint(path, state, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(etgraph.period, "write_checkpoint", write_checkpoint_seen)
        result = train(default_model, prof, config, tmp_path / "run", progress=False)
    # the first session starts without an optimizer group, later ones carry the moments
    assert written[0] == (0, False) and all(group for step, group in written[1:])
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

    data = load_dataset(None, input_shape=prof.input_shapes["input"], seed=1)
    batches = list(data.val_batches(4))[: QUICK["max_val_batches"]]
    loss, acc = evaluate_onnx(out / "model_trained.onnx", batches, 4)
    assert acc == pytest.approx(records[-1]["val_acc"], abs=1e-9)
    assert loss == pytest.approx(records[-1]["val_loss"], rel=1e-4)
    assert result.inference_val_acc == pytest.approx(records[-1]["val_acc"], abs=1e-9)
    # trained at the run's fixed batch size, exported with a symbolic one: any batch runs, and
    # each example's output does not depend on the batch it is in (batch norms in inference)
    graph_files = list((out / "artifacts").glob("*/training_model.onnx"))
    assert graph_files
    for graph_file in graph_files:
        data_input = onnx.load(str(graph_file), load_external_data=False).graph.input[0]
        assert data_input.type.tensor_type.shape.dim[0].dim_value == 4  # static, as profiled
    exported = onnx.load(str(out / "model_trained.onnx"))
    assert exported.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    session = ort.InferenceSession(str(out / "model_trained.onnx"))
    x = np.concatenate([b[0] for b in batches])[:7]
    one_batch = session.run(None, {"input": x})[0]
    assert one_batch.shape[0] == 7
    np.testing.assert_allclose(one_batch[:1], session.run(None, {"input": x[:1]})[0], rtol=1e-4)
    # determinism: the same seed and data give the same selections and losses (open loop: the
    # closed loop selects from measured times)
    train(default_model, prof, config, tmp_path / "again", progress=False)
    again = _losses(tmp_path / "again")
    assert [r["selection"] for r in again] == [r["selection"] for r in records]
    for key in ("train_loss", "val_loss", "val_acc"):
        np.testing.assert_allclose([r[key] for r in again], [r[key] for r in records], rtol=1e-5)
    # an existing run is not overwritten
    with pytest.raises(ConfigError, match="already holds a training run"):
        train(default_model, prof, config, tmp_path / "run", progress=False)


@pytest.mark.slow
def test_resume_after_sigkill(tmp_path, default_profile, default_model_path, default_model, rho):
    prof, profile_json = default_profile
    out = tmp_path / "killed"
    args = [
        sys.executable, "-m", "etgraph", "train", str(default_model_path),
        "--profile", str(profile_json), "--epochs", "4", "--period", "1", "--rho", str(rho),
        "--max-steps-per-epoch", "25", "--max-val-batches", "5", "--out", str(out), "--quiet",
        "--open-loop",
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
    saved_epoch = json.loads(props[RUN_PROPERTY])["epoch"]
    assert saved_epoch >= 1

    done = subprocess.run(  # not --quiet: it says where it continues from
        [sys.executable, "-m", "etgraph", "train", "--resume", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resuming {out} after epoch {saved_epoch} of 4 (its last checkpoint)" in done.stdout
    assert "val accuracy" in done.stdout
    records = _losses(out)
    assert [r["epoch"] for r in records] == [1, 2, 3, 4]
    assert (out / "model_trained.onnx").is_file()
    # the resumed run continues exactly like an uninterrupted one
    config = TrainConfig(
        epochs=4, period=1, rho=rho, max_steps_per_epoch=25, max_val_batches=5, closed_loop=False
    )
    train(default_model, prof, config, tmp_path / "straight", progress=False)
    straight = _losses(tmp_path / "straight")
    assert [r["selection"] for r in straight] == [r["selection"] for r in records]
    np.testing.assert_allclose(
        [r["val_loss"] for r in records], [r["val_loss"] for r in straight], rtol=1e-5
    )


@pytest.mark.slow
def test_resume_errors(tmp_path, default_profile, default_model, rho):
    with pytest.raises(CheckpointError, match=r"is not a run directory \(it does not exist\)"):
        resume(tmp_path / "nothing-here", progress=False)
    prof, _ = default_profile
    config = TrainConfig(epochs=1, period=1, rho=rho, **QUICK)
    out = tmp_path / "run"
    train(default_model, prof, config, out, progress=False)
    (out / "checkpoint").write_bytes((out / "checkpoint").read_bytes()[:200])
    with pytest.raises(CheckpointError, match="is damaged: its sha256 differs"):
        resume(out, progress=False)
    (out / "checkpoint.sha256").unlink()  # no digest recorded (a hand-made run): the reader's
    with pytest.raises(CheckpointError, match="is corrupt"):
        resume(out, progress=False)


@pytest.mark.slow
def test_divergence_stops_at_the_first_non_finite_loss(tmp_path, default_profile, default_model):
    """--lr 1e4 (issue #14): the run stops at the first NaN/inf loss with one line that names
    epoch and step and suggests a lower --lr (here in the first epoch: no checkpoint yet)."""
    prof, _ = default_profile
    # full training: at lr 1e4 the optimizer's own next step (importance "adam") would raise
    # every tensor's loss (AdamW's decay then flips the weights), and the DP would train one
    config = TrainConfig(epochs=4, strategy="full", learning_rate=1e4, **QUICK)
    out = tmp_path / "run"
    with pytest.raises(TrainingDivergedError, match=r"^training diverged: the loss is") as info:
        train(default_model, prof, config, out, progress=False)
    err = info.value
    assert f"at epoch {err.epoch}, step {err.step} " in str(err) and "lower --lr" in str(err)
    assert [r["epoch"] for r in rundir.read_log(out)] == list(range(1, err.epoch))


@pytest.mark.slow
def test_divergence_keeps_the_last_good_checkpoint(
    tmp_path, default_profile, default_model, monkeypatch
):
    """A loss that turns NaN at step 3 of epoch 2: epoch 1's checkpoint and log stay, and the
    message says where they are."""
    real_step = TrainingSession.train_step
    calls = []

    def step(self, x, y, learning_rate, **kwargs):
        if learning_rate > 0:  # the run's steps (its full reference steps run at rate 0)
            calls.append(1)
        loss, right = real_step(self, x, y, learning_rate, **kwargs)
        diverged = len(calls) == QUICK["max_steps_per_epoch"] + 3  # epoch 2, step 3
        return (float("nan") if diverged else loss), right

    monkeypatch.setattr(TrainingSession, "train_step", step)
    out = tmp_path / "run"
    config = TrainConfig(epochs=3, period=1, rho=1.0, **QUICK)
    with pytest.raises(TrainingDivergedError, match="at epoch 2, step 3 ") as info:
        train(default_model, default_profile[0], config, out, progress=False)
    assert f"the last good checkpoint, after epoch 1, is kept in {out / 'checkpoint'}" in str(
        info.value
    )
    assert [r["epoch"] for r in rundir.read_log(out)] == [1]
    state, _, _ = read_checkpoint(out / "checkpoint")  # epoch 1's state, complete
    assert set(default_model.names) <= set(state.weights)
