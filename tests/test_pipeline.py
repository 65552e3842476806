"""etgraph compile end to end on a small model: every output exists, agrees with the others,
and the artifacts train in onnxruntime-training as they are."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from etgraph import dumps, timing
from etgraph.errors import ConfigError, InfeasibleBudgetError
from etgraph.model import LoadedModel
from etgraph.pipeline import compile_model
from etgraph.profile import Profile


def feasible_rho_range(out) -> tuple[float, float]:
    """(smallest feasible rho, 1.0) from a compiled directory's profile, in the time model of
    its plan's batch-norm mode: rho is relative to the time model's own full step, so rho = 1
    admits every tensor."""
    frozen_bn = json.loads((out / "plan.json").read_text())["frozen_bn"]
    prof = Profile.load(out / "profile.json").for_frozen_bn(frozen_bn)
    t_dw, t_dy, forward_us = prof.t_dw_us, prof.t_dy_us, prof.forward_us
    t_full_us = timing.step_us(np.ones(len(t_dw), bool), t_dw, t_dy, forward_us)
    return timing.min_feasible_rho(t_dw, t_dy, forward_us, t_full_us), 1.0


@pytest.fixture(scope="module")
def compiled(tiny_cnn_onnx, tmp_path_factory):
    """Compile once at rho=1 (every tensor) to learn the profile (cached), then halfway between
    the smallest feasible rho and 1, where the selection is a strict subset."""
    cache = tmp_path_factory.mktemp("profile-cache")
    full = tmp_path_factory.mktemp("compiled-full")
    compile_model(tiny_cnn_onnx, full, rho=1.0, repeats=3, cache_dir=cache)
    low, high = feasible_rho_range(full)
    out = tmp_path_factory.mktemp("compiled")
    result = compile_model(tiny_cnn_onnx, out, rho=(low + high) / 2, repeats=3, cache_dir=cache)
    return result, out, cache


def test_plan_agrees_with_profile_graph_and_artifacts(compiled, tiny_cnn_onnx):
    result, out, _ = compiled
    plan = json.loads((out / "plan.json").read_text())
    model = LoadedModel.load(out / "model.onnx")
    tensors = model.tensors
    assert [t["name"] for t in plan["tensors"]] == [t.name for t in tensors]
    assert [t["index"] for t in plan["tensors"]] == list(range(len(tensors)))

    mask = np.array([t["selected"] for t in plan["tensors"]])
    assert mask.any() and not mask.all() and result.n_selected == int(mask.sum())
    assert plan["trainable_params"] == [t.name for t, s in zip(tensors, mask, strict=True) if s]
    assert set(plan["trainable_params"]).isdisjoint(plan["frozen_params"])
    assert set(model.running_stats) <= set(plan["frozen_params"])

    # The plan's prediction is the time model of its own mask, and it honours the budget.
    t_dw = np.array([t["t_dw_us"] for t in plan["tensors"]])
    t_dy = np.array([t["t_dy_us"] for t in plan["tensors"]])
    predicted = timing.step_us(mask, t_dw, t_dy, plan["forward_us"])
    assert predicted == pytest.approx(plan["predicted_step_us"])
    assert plan["predicted_step_us"] <= plan["rho"] * plan["t_full_us"] + 1e-6

    profile = json.loads((out / "profile.json").read_text())
    assert profile["measured_full_step_us"] == pytest.approx(plan["measured_full_step_us"])
    assert timing.step_us(np.ones_like(mask), t_dw, t_dy, plan["forward_us"]) == pytest.approx(
        plan["t_full_us"]
    )  # T_full is the time model's full step

    dumped = dumps.read_graph(out / "graph.json")
    selected = {
        data["name"]
        for _, data in dumped.nodes(data=True)
        if data.get("node_type") == "tensor" and data.get("selected")
    }
    assert selected == set(plan["trainable_params"])
    for fmt in ("graphml", "dot"):
        assert (out / f"graph.{fmt}").stat().st_size > 0


def test_compile_writes_only_the_documented_files(compiled):
    _, out, _ = compiled
    top = {p.name for p in out.iterdir()}
    assert top == {
        "model.onnx",
        "graph.json",
        "graph.graphml",
        "graph.dot",
        "profile.json",
        "plan.json",
        "artifacts",
    }
    assert {p.name for p in (out / "artifacts").iterdir()} == {
        "training_model.onnx",
        "training_model.onnx.data",  # the eval graph's constants are in it too
        "eval_model.onnx",
        "optimizer_model.onnx",
        "checkpoint",
    }


def test_artifacts_are_the_baked_form_etgraph_steps(compiled):
    """The frozen parameters are constants of the emitted graphs (what etgraph's loop runs and
    its profile measures, issue 31), valued as the checkpoint holds them; plan.json says so."""
    import onnx
    from onnx import numpy_helper

    from etgraph.checkpoint import read_checkpoint

    _, out, _ = compiled
    plan = json.loads((out / "plan.json").read_text())
    assert plan["artifacts_form"] == "baked"
    art = out / "artifacts"
    state, trainable, _ = read_checkpoint(art / "checkpoint")
    assert sorted(trainable) == sorted(plan["trainable_params"])
    for name in ("training_model.onnx", "eval_model.onnx"):
        graph = onnx.load(str(art / name)).graph  # external data loaded from beside it
        inputs = {i.name for i in graph.input}
        assert set(plan["trainable_params"]) <= inputs
        constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
        baked = [n for n in plan["frozen_params"] if n in constants]
        assert baked and not inputs & set(baked)
        for n in baked:
            np.testing.assert_array_equal(constants[n], state.weights[n])


def test_artifacts_train_as_they_are(compiled):
    from onnxruntime.training import api

    _, out, _ = compiled
    plan = json.loads((out / "plan.json").read_text())
    art = out / "artifacts"
    state = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = api.Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    optimizer = api.Optimizer(str(art / "optimizer_model.onnx"), module)
    trainable = set(plan["trainable_params"])
    frozen_name = next(t["name"] for t in plan["tensors"] if not t["selected"])
    before = {n: state.parameters[n].data.copy() for n in (*trainable, frozen_name)}

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, *plan["input_shapes"]["input"])).astype(np.float32)
    y = rng.integers(0, 10, size=4).astype(np.int64)
    module.train()
    loss = module(x, y)
    loss = loss[0] if isinstance(loss, list | tuple) else loss
    assert np.isfinite(loss)
    optimizer.step()
    for name in trainable:
        assert not np.array_equal(state.parameters[name].data, before[name]), name
    np.testing.assert_array_equal(state.parameters[frozen_name].data, before[frozen_name])


def test_profile_cache_makes_recompile_cheap(compiled, tiny_cnn_onnx, tmp_path):
    _, out, cache = compiled
    first = json.loads((out / "profile.json").read_text())
    compile_model(tiny_cnn_onnx, tmp_path, rho=1.0, repeats=3, cache_dir=cache)
    again = json.loads((tmp_path / "profile.json").read_text())
    # measured once: a cache hit, not a re-measurement
    assert again["measured_full_step_us"] == first["measured_full_step_us"]


def test_impossible_rho_names_the_smallest_feasible(compiled, tiny_cnn_onnx, tmp_path):
    _, out, cache = compiled
    low, _ = feasible_rho_range(out)
    with pytest.raises(InfeasibleBudgetError, match="raise rho to at least") as err:
        compile_model(tiny_cnn_onnx, tmp_path, rho=low / 2, repeats=3, cache_dir=cache)
    assert err.value.min_rho == pytest.approx(low)
    assert "rho" in str(err.value)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ConfigError, match=r"rho must be in \(0, 1\]"):
            compile_model(tiny_cnn_onnx, tmp_path, rho=bad, cache_dir=cache)


def test_cli_compile_reports_user_errors_in_one_line(tmp_path):
    missing = tmp_path / "nope.onnx"
    run = subprocess.run(
        [sys.executable, "-m", "etgraph", "compile", str(missing), "-o", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert run.stderr.startswith("etgraph: error:") and "nope.onnx" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_the_guides_ort_loop_trains_the_compiled_artifacts(compiled, tmp_path):
    """docs/guide.md's plain onnxruntime-training loop, run as written on a compiled
    directory's artifacts (no etgraph in the loop): the selected tensors move, the frozen ones
    stay (a trained batch norm's running statistics may move), the loss falls, and the checkpoint
    it saves reloads with the trained values."""
    import re
    from pathlib import Path

    from onnxruntime.training import api

    from etgraph.io_specs import random_batch

    _, out, _ = compiled
    guide = (Path(__file__).parents[1] / "docs" / "guide.md").read_text()
    code = re.search(r"<!-- ort-loop -->\n```python\n(.*?)```", guide, re.S).group(1)
    assert '"C/artifacts/"' in code and '"trained.ckpt"' in code
    saved = tmp_path / "trained.ckpt"
    code = code.replace('"C/artifacts/"', repr(f"{out / 'artifacts'}/"))
    code = code.replace('"trained.ckpt"', repr(str(saved)))
    plan = json.loads((out / "plan.json").read_text())
    model = LoadedModel.load(out / "model.onnx")
    batch = random_batch(plan["batch_size"], model.inputs, model.input_shapes(None), model.task)
    (x,) = batch.inputs.values()
    before = api.CheckpointState.load_checkpoint(str(out / "artifacts" / "checkpoint"))
    start = {name: p.data.copy() for name, p in before.parameters}
    trainable = {name for name, p in before.parameters if p.requires_grad}
    assert trainable == set(plan["trainable_params"])
    losses = []

    class Batches:  # the same batch 30 times, each step's loss kept
        def __iter__(self):
            for _ in range(30):
                yield x, batch.labels
                losses.append(float(namespace["loss"]))

    namespace = {"batches": Batches()}
    exec(compile(code, "docs/guide.md (ort-loop)", "exec"), namespace)  # noqa: S102
    assert losses[-1] < losses[0]
    after = dict(api.CheckpointState.load_checkpoint(str(saved)).parameters)
    running = set(model.running_stats)  # a trained batch norm's statistics may move too
    for name, value in start.items():
        moved = not np.array_equal(after[name].data, value)
        assert moved == (name in trainable) or name in running, name
