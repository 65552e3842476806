"""The memory model of a selection (issue #17): parts, interpolation, JSON, measurement."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest
from helpers import make_model, random_initializer, run_cli_in_process, save_model
from onnx import TensorProto, helper

from etgraph import period as period_module
from etgraph.artifacts import ArtifactCache
from etgraph.config import TrainConfig
from etgraph.data import DEFAULT_MODEL_PATH
from etgraph.errors import ConfigError, InfeasibleMemoryError, ProfileMismatchError
from etgraph.loop import train
from etgraph.memory import (
    MEMORY_FORMAT_VERSION,
    MemoryProfile,
    activation_bytes_after,
    interpolate_earliest_mb,
    memory_key,
)
from etgraph.memory_profiler import (
    fit_memory_profile,
    image_input_shape,
    measure_peaks,
    profile_memory,
)
from etgraph.model import LoadedModel
from etgraph.ort_options import ROLES, OrtConfig, session_options
from etgraph.rundir import format_summary
from etgraph.selection import MemoryCosts
from etgraph.sessions import TrainingSession, inference_session


def _profile(n=4):
    return MemoryProfile(
        model_hash="h",
        tensors=[f"t{i}" for i in range(n)],
        tensor_mb=np.arange(1, n + 1, dtype=float),
        earliest_mb=np.linspace(40.0, 10.0, n),
        base_mb=100.0,
        load_mb=120.0,
        import_mb=80.0,
        weights_mb=5.0,
        bytes_per_param=12.0,
        batch_size=4,
        input_shape=(3, 32, 32),
        threads=2,
    )


def test_parts_and_peak():
    prof = _profile()
    mask = np.array([False, True, False, True])
    parts = prof.parts_mb(mask)
    assert parts["earliest"] == 1
    assert parts["tensors_mb"] == 2.0 + 4.0
    assert parts["workspace_mb"] == 30.0
    assert parts["peak_mb"] == 100.0 + 6.0 + 30.0
    # a small selection peaks at start-up (the floor)
    assert prof.peak_mb(np.array([False, False, False, True])) == 120.0
    masks = np.array([mask, [True, True, True, True], [False, False, False, True]])
    assert np.allclose(prof.peak_mb_many(masks), [prof.peak_mb(m) for m in masks])
    assert prof.full_peak_mb == 100.0 + 10.0 + 40.0
    assert prof.min_feasible_mb() == 120.0
    costs = MemoryCosts.from_profile(prof, 500.0)
    assert all(costs.peak_mb(m) == prof.peak_mb(m) for m in masks)
    with pytest.raises(ConfigError, match="empty selection"):
        prof.peak_mb(np.zeros(4, dtype=bool))
    with pytest.raises(ConfigError, match="expected \\(4,\\)"):
        prof.peak_mb(np.ones(3, dtype=bool))


def test_a_selection_without_the_largest_gradient_needs_less_workspace():
    """earliest_mb is the suffix's workspace, which holds the suffix's largest weight-gradient
    temporary (4 bytes per parameter); a selection without it is predicted that much lower, by
    the DP's costs (an upper bound) it is not."""
    prof = _profile()
    prof.tensor_mb = np.array([1.0, 30.0, 3.0, 6.0])  # 12 B/param: gradients 1/3 of these
    suffix = np.array([False, True, True, True])
    sparse = np.array([False, True, False, True])
    without_big = np.array([False, False, True, True])
    assert prof.parts_mb(suffix)["gradient_slack_mb"] == 0.0
    assert prof.parts_mb(sparse)["gradient_slack_mb"] == 0.0  # the big gradient is selected
    # earliest 2: the suffix from 2 holds gradients of 1 and 2 MiB, the selection the 2: no slack
    assert prof.parts_mb(without_big)["gradient_slack_mb"] == 0.0
    late = np.array([True, False, False, True])  # suffix from 0 holds the 10 MiB gradient
    parts = prof.parts_mb(late)
    assert parts["gradient_slack_mb"] == pytest.approx(10.0 - 2.0)
    assert parts["workspace_mb"] == pytest.approx(40.0 - 8.0)
    assert parts["peak_mb"] == pytest.approx(100.0 + 1.0 + 6.0 + 32.0)
    masks = np.array([suffix, sparse, without_big, late])
    assert np.allclose(prof.peak_mb_many(masks), [prof.peak_mb(m) for m in masks])
    costs = MemoryCosts.from_profile(prof, 500.0)
    assert costs.peak_mb(late) == pytest.approx(prof.peak_mb(late) + 8.0)


def test_json_round_trip_and_version(tmp_path):
    prof = _profile()
    path = prof.save(tmp_path / "memory.json")
    back = MemoryProfile.load(path)
    assert back.tensors == prof.tensors and back.input_shape == (3, 32, 32)
    assert np.array_equal(back.earliest_mb, prof.earliest_mb)
    data = json.loads(path.read_text())
    assert data["format_version"] == MEMORY_FORMAT_VERSION
    data["format_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileMismatchError, match="format 99"):
        MemoryProfile.load(path)
    with pytest.raises(ProfileMismatchError, match="not \\(model"):
        prof.check_matches("other", batch_size=4, input_shape=(3, 32, 32), threads=2)


def test_memory_profile_is_of_one_batch_norm_mode(tmp_path):
    """A profile records the batch-norm mode it was measured in: the cache key differs per mode,
    the JSON keeps it, and check_matches / the training loop refuse the other mode."""
    keys = {memory_key("h", (3, 32, 32), 4, 2, frozen_bn=m) for m in ("inference", "train")}
    assert len(keys) == 2
    assert memory_key("h", (3, 32, 32), 4, 2) == memory_key(
        "h", (3, 32, 32), 4, 2, frozen_bn="inference"
    )
    prof = _profile()
    assert prof.frozen_bn == "inference"  # etgraph train's default
    prof.frozen_bn = "train"
    back = MemoryProfile.load(prof.save(tmp_path / "memory.json"))
    assert back.frozen_bn == "train"
    back.check_matches("h", batch_size=4, input_shape=(3, 32, 32), threads=2, frozen_bn="train")
    back.check_matches("h", batch_size=4, input_shape=(3, 32, 32), threads=2)
    with pytest.raises(ProfileMismatchError, match="of --frozen-bn train, not inference"):
        back.check_matches(
            "h", batch_size=4, input_shape=(3, 32, 32), threads=2, frozen_bn="inference"
        )


def test_every_session_role_allocates_from_the_shared_arena():
    """ORT's per-session arena grows again on the second step (the memory pattern's block does
    not fit the first step's chunks); every etgraph session uses the shared arena instead."""
    for role in ROLES:
        assert (
            session_options(2, role=role).get_session_config_entry("session.use_env_allocators")
            == "1"
        )
    plain = session_options(2, config=OrtConfig())  # ORT's defaults: the session's own arena
    with pytest.raises(RuntimeError, match="does not have configuration with key"):
        plain.get_session_config_entry("session.use_env_allocators")


def test_interpolation_is_exact_at_anchors_and_follows_the_proxy():
    proxy = np.array([100.0, 80.0, 70.0, 40.0, 10.0, 10.0, 0.0])
    out = interpolate_earliest_mb([6, 0, 3], [5.0, 50.0, 20.0], proxy)
    assert out[0] == 50.0 and out[3] == 20.0 and out[6] == 5.0
    # between 0 and 3 the proxy falls 20 of 60: one third of the way from 50 to 20
    assert out[1] == pytest.approx(40.0)
    assert np.all(np.diff(out) <= 0)
    with pytest.raises(ConfigError, match="anchors"):
        interpolate_earliest_mb([7], [1.0], proxy)


def test_activation_bytes_after_default_model():

    model = LoadedModel.load(DEFAULT_MODEL_PATH)
    proxy = activation_bytes_after(
        model.with_batch(4, model.input_shapes()), [t.layer for t in model.tensors]
    )
    assert proxy.shape == (len(model.tensors),)
    assert np.all(np.diff(proxy) <= 0) and proxy[-1] > 0
    # the first conv's output alone: 4 x C x 32 x 32 float32 values at least
    assert proxy[0] >= 4 * 32 * 32 * 4
    with pytest.raises(ConfigError, match="not a node"):
        activation_bytes_after(model.proto, ["nope"])


def test_fit_memory_profile_to_synthetic_anchors():
    """The fit recovers a known model from anchor records (no measurement): base and the
    theoretical 12 B/param for a small model, the start-up floor, the workspaces exact at the
    anchors (the suffix's largest gradient added back after interpolating the rest)."""
    model = LoadedModel.load(DEFAULT_MODEL_PATH)
    n = len(model.tensors)
    params = np.array([t.params for t in model.tensors], dtype=np.float64)
    proxy = activation_bytes_after(
        model.with_batch(4, model.input_shapes()), [t.layer for t in model.tensors]
    )
    points = [n - 1, n // 2, 0]
    workspace = {n - 1: 5.0, n // 2: 20.0, 0: 60.0}

    def record(e):
        session = 300.0 + params[e:].sum() * 12 / 2**20
        return {
            "imported": {"VmRSS": 250.0, "VmHWM": 250.0},
            "loaded": {"VmRSS": 290.0, "VmHWM": 310.0 + e},
            "session": {"VmRSS": session, "VmHWM": 320.0},
            "steps": {"VmRSS": session + workspace[e], "VmHWM": session + workspace[e]},
        }

    prof = fit_memory_profile(
        model,
        proxy,
        points,
        [record(e) for e in points],
        batch_size=4,
        input_shape=(3, 32, 32),
        threads=2,
        frozen_bn="train",
    )
    assert prof.bytes_per_param == 12.0 and prof.base_mb == pytest.approx(300.0)
    assert prof.load_mb == 310.0 + n - 1 and prof.frozen_bn == "train"
    assert prof.import_mb == 250.0
    for e, w in workspace.items():
        assert prof.earliest_mb[e] == pytest.approx(w)
        suffix = np.zeros(n, dtype=bool)
        suffix[e:] = True
        assert prof.peak_mb(suffix) == pytest.approx(max(prof.load_mb, record(e)["steps"]["VmHWM"]))
    assert np.all(np.diff(prof.earliest_mb) <= 1e-9)  # the proxy falls: so does the workspace


@pytest.mark.slow
def test_memory_profile_predicts_measured_peaks(default_model, tmp_path):
    """Measured on the default model: the model predicts fresh processes' peaks within 5% for
    random selections, the cache returns the same profile, and the parts add up."""
    prof = profile_memory(default_model, batch_size=4, threads=2, cache_dir=tmp_path)
    assert prof.anchors[0] == len(prof.tensors) - 1 and 0 in prof.anchors
    # 119k parameters: their buffers (1.4 MiB) are below the RSS noise, the theory is used
    assert prof.bytes_per_param == 12.0
    assert prof.load_mb > prof.import_mb > 0
    again = profile_memory(default_model, batch_size=4, threads=2, cache_dir=tmp_path)
    assert np.array_equal(again.earliest_mb, prof.earliest_mb)

    rng = np.random.default_rng(5)
    n = len(prof.tensors)
    masks = []
    for _ in range(3):
        mask = np.zeros(n, dtype=bool)
        first = int(rng.integers(0, n))
        mask[first] = True
        mask[first + 1 :] = rng.random(n - first - 1) < 0.5
        masks.append(mask)
    model_b = default_model.with_batch(4, default_model.input_shapes())
    cache = ArtifactCache(tmp_path / "artifacts")
    dirs = [
        cache.get(model_b, *default_model.split(m), frozen_bn=prof.frozen_bn)[0].directory
        for m in masks
    ]
    measured = measure_peaks(dirs, batch_size=4, input_shape=(3, 32, 32), threads=2)
    for mask, raw in zip(masks, measured, strict=True):
        predicted = prof.peak_mb(mask)
        assert predicted == pytest.approx(raw["steps"]["VmHWM"], rel=0.05)
    # processes forked after one import measure what fresh processes measure
    forked = measure_peaks(dirs, batch_size=4, input_shape=(3, 32, 32), threads=2, fresh=False)
    for fresh, fork in zip(measured, forked, strict=True):
        for phase in ("loaded", "session", "steps"):
            assert fork[phase]["VmRSS"] == pytest.approx(fresh[phase]["VmRSS"], abs=4.0)


@pytest.mark.slow
def test_compile_memory_budget(cache_env, tmp_path):
    """`etgraph compile --memory-mb`: plan.json has the predicted peak and its parts within the
    budget, inspect shows the memory columns, and an infeasible budget is one line naming the
    smallest feasible --memory-mb, which then compiles."""
    out = tmp_path / "c"
    res = run_cli_in_process(
        "compile", "-o", out, "--memory-mb", "100000", "--repeats", "2", env=cache_env
    )
    assert res.returncode == 0, res.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert plan["memory_mb"] == 100000
    parts = plan["memory_parts_mb"]
    assert plan["predicted_peak_mb"] == parts["peak_mb"] <= 100000
    steady = parts["base_mb"] + parts["tensors_mb"] + parts["workspace_mb"]
    assert parts["peak_mb"] == pytest.approx(max(parts["load_mb"], steady))
    assert all("tensor_mb" in row and "earliest_mb" in row for row in plan["tensors"])
    assert (out / "memory.json").is_file()
    shown = run_cli_in_process("inspect", out, "--format", "json")
    assert shown.returncode == 0 and "tensor_mb" in shown.stdout.splitlines()[0]

    res = run_cli_in_process("compile", "-o", tmp_path / "d", "--memory-mb", "1", env=cache_env)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "pass --memory-mb" in lines[0], res.stderr
    smallest = int(re.search(r"--memory-mb (\d+) or more", lines[0]).group(1))
    res = run_cli_in_process(
        "compile", "-o", tmp_path / "e", "--memory-mb", smallest, env=cache_env
    )
    assert res.returncode == 0, res.stderr
    plan = json.loads((tmp_path / "e" / "plan.json").read_text())
    assert plan["predicted_peak_mb"] <= smallest


@pytest.mark.slow
def test_train_under_memory_budget_logs_predicted_peak(default_model, default_profile, tmp_path):
    """`train` with memory_mb bounds the whole process: a budget below what this process needs
    is a one-line error naming the smallest feasible one (the run's own resident memory is
    part of it, so it is above the memory model's); at that budget every period's selection fits
    by the run's prediction (at least the memory model's), the log records it beside the
    measured peak, and resume reads the run's memory.json."""
    prof, _ = default_profile
    mem = profile_memory(default_model, batch_size=4, threads=prof.threads, cache_dir=tmp_path)
    config = TrainConfig(  # open loop: the closed loop's re-fitted time model (a measurement)
        # could leave only tensors above this budget within the time budget
        epochs=2,
        period=1,
        memory_mb=mem.min_feasible_mb(),
        max_steps_per_epoch=5,
        max_val_batches=2,
        closed_loop=False,
    )
    with pytest.raises(InfeasibleMemoryError, match=r"pass --memory-mb \d+ or more") as info:
        train(default_model, prof, config, tmp_path / "low", progress=False, memory_profile=mem)
    floor = info.value.min_memory_mb
    assert floor >= mem.min_feasible_mb()
    budget = floor + 0.5 * (mem.full_peak_mb - mem.min_feasible_mb()) + 5.0
    config = dataclasses.replace(config, memory_mb=budget)
    out = tmp_path / "run"
    result = train(default_model, prof, config, out, progress=False, memory_profile=mem)
    assert "full training       not measured: a run under --memory-mb" in format_summary(result)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        mask = np.zeros(len(mem.tensors), dtype=bool)
        mask[r["selection"]] = True
        assert mem.peak_mb(mask) <= r["predicted_peak_mb"] <= budget and r["peak_rss_mb"] > 0
        assert math.isnan(r["rho_measured"])  # no full reference step fits a budget
    assert (out / "memory.json").is_file() and (out / "model_trained.onnx").is_file()
    with pytest.raises(ConfigError, match="needs the model's memory profile"):
        train(default_model, prof, config, tmp_path / "other", progress=False)
    other_mode = dataclasses.replace(config, frozen_bn="train")
    with pytest.raises(ProfileMismatchError, match="of --frozen-bn inference, not train"):
        train(
            default_model, prof, other_mode, tmp_path / "mode", progress=False, memory_profile=mem
        )
    with pytest.raises(ConfigError, match="elastic strategy"):
        TrainConfig(memory_mb=500.0, strategy="topk").validate()


def test_memory_model_scope_is_image_classifiers(tmp_path):
    """The measuring process feeds one float image batch and class-index labels: a model with
    other inputs, or trained with --loss mse, is a one-line error before anything is measured."""
    assert image_input_shape(LoadedModel.load(DEFAULT_MODEL_PATH)) == (3, 32, 32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["y"], name="flat"),
    ]
    path = save_model(make_model(nodes, [random_initializer("w", (4, 3, 3, 3))]), tmp_path)
    with pytest.raises(ConfigError, match=r"measures classifiers \(--loss ce\), not --loss mse"):
        image_input_shape(LoadedModel.load(path, loss="mse"))
    two = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8]),
        helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4]),
    ]
    nodes.append(helper.make_node("Add", ["y", "z"], ["out"], name="add"))
    model = make_model(nodes, [random_initializer("w", (4, 3, 3, 3))], y="out", inputs=two)
    with pytest.raises(ConfigError, match=r"one float image input .* inputs \['x', 'z'\]"):
        image_input_shape(LoadedModel.load(save_model(model, tmp_path, "two.onnx")))


@pytest.mark.slow
def test_budgeted_run_carries_state_exactly_as_an_unbounded_one(
    default_model, default_profile, tmp_path, monkeypatch
):
    """Under a budget that does not bind, the run takes the same selections and ends with the
    same weights and AdamW moments as without one (state through checkpoint files every period,
    the session rebuilt from them even when the selection stays, chunked importance, the
    streamed export); resuming after the last period exports the same model."""
    from etgraph.checkpoint import read_checkpoint
    from etgraph.loop import resume
    from etgraph.timing import min_feasible_rho

    prof, _ = default_profile
    mem = profile_memory(default_model, batch_size=4, threads=prof.threads, cache_dir=tmp_path)
    floor = min_feasible_rho(prof.t_dw_us, prof.t_dy_us, prof.forward_us, prof.t_full_us)
    rho = round(min(0.95, max(0.6, floor + 0.1)), 3)  # feasible on a short fixture profile
    base = TrainConfig(  # the DP resolution a budget uses by default, for both runs
        epochs=3, period=1, max_steps_per_epoch=4, max_val_batches=2, rho=rho, resolution=1000
    )
    base = dataclasses.replace(base, closed_loop=False)

    # The bounded run's sessions do not bake the frozen weights; the unbounded run's would (ORT
    # folds batch norms into convs: float sums reassociated, test_bake.py), and AdamW's
    # normalised step turns those 1e-9 differences of near-zero gradients into up to lr of
    # weight (measured: 1.3e-5 on single elements, depending on the selection). Unbaked, both
    # runs compute alike: the same weights and moments, bit for bit.
    def unbaked(*args, **kwargs) -> TrainingSession:
        return TrainingSession(*args, **{**kwargs, "bake": False})

    monkeypatch.setattr(period_module, "TrainingSession", unbaked)
    runs = {}
    for name, budget in (("free", None), ("bounded", 4 * mem.full_peak_mb)):
        config = dataclasses.replace(base, memory_mb=budget)
        train(default_model, prof, config, tmp_path / name, progress=False, memory_profile=mem)
        runs[name] = [
            json.loads(r) for r in (tmp_path / name / "log.jsonl").read_text().splitlines()
        ]
    assert [r["selection"] for r in runs["free"]] == [r["selection"] for r in runs["bounded"]]
    free, _, _ = read_checkpoint(tmp_path / "free" / "checkpoint")
    bounded, _, _ = read_checkpoint(tmp_path / "bounded" / "checkpoint")
    assert free.step == bounded.step == 12
    for name, value in free.weights.items():
        np.testing.assert_array_equal(bounded.weights[name], value, err_msg=name)
    for name, moments in free.moments.items():
        for key, value in moments.items():
            np.testing.assert_array_equal(bounded.moments[name][key], value, err_msg=name)
    x = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    outputs = [
        inference_session(str(tmp_path / n / "model_trained.onnx")).run(None, {"input": x})[0]
        for n in ("free", "bounded")
    ]
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)
    exported = (tmp_path / "bounded" / "model_trained.onnx").read_bytes()
    resume(tmp_path / "bounded", progress=False)  # after the last period: export again
    assert (tmp_path / "bounded" / "model_trained.onnx").read_bytes() == exported
