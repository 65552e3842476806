"""Tensor timing profiler on real ONNX Runtime runs (small models; threads=1 so the shared
2-core machine's load disturbs the measurements as little as possible): etgraph.profile,
etgraph.measure, etgraph.fold, etgraph.profiler."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time

import numpy as np
import onnx
import pytest
from helpers import make_model, random_initializer, save_model
from onnx import TensorProto, helper

from etgraph import artifact_weights, artifacts, graph, onnx_io, profiler, timing
from etgraph.artifacts import ArtifactCache
from etgraph.errors import ConfigError, ProfileMismatchError
from etgraph.fold import (
    OptimizerFit,
    fit_optimizer,
    forward_us_by_anchor,
    fused_grad_parts,
    optimizer_subsets,
    saved_forward_fraction,
    split_by_measurement,
)
from etgraph.io_specs import random_batch
from etgraph.measure import (
    ProfiledGraph,
    _kernel_events,
    measure_selection_steps_us,
    reproduced,
    robust_time,
    round_robin,
    run_spans_s,
    traced_node,
)
from etgraph.model import LoadedModel
from etgraph.profile import PROFILE_FORMAT_VERSION, Profile, profile_key
from etgraph.profiler import profile_model

REPEATS = 5
WARMUP = 2
THREADS = 1
#: Real steps are timed by CPU time of the (single) ORT thread: the test machine is shared.
CLOCK = "cpu"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def tiny_cnn_model(tiny_cnn_onnx) -> LoadedModel:
    return LoadedModel.load(tiny_cnn_onnx)


@pytest.fixture(scope="module")
def resnet18s_model(resnet18s_onnx) -> LoadedModel:
    return LoadedModel.load(resnet18s_onnx)


@pytest.fixture(scope="module")
def tiny_cnn_profile(tiny_cnn_model, cache_dir) -> Profile:
    return profile_model(
        tiny_cnn_model,
        level="thorough",
        repeats=REPEATS,
        warmup=WARMUP,
        threads=THREADS,
        cache_dir=cache_dir,
        clock=CLOCK,
    )


@pytest.fixture(scope="module")
def resnet18s_profile(resnet18s_model, cache_dir) -> Profile:
    return profile_model(
        resnet18s_model,
        level="thorough",
        repeats=REPEATS,
        warmup=WARMUP,
        threads=THREADS,
        cache_dir=cache_dir,
        clock=CLOCK,
    )


@pytest.fixture(scope="module")
def resnet18s_fast_profile(resnet18s_model, cache_dir) -> Profile:
    return profile_model(resnet18s_model, threads=THREADS, cache_dir=cache_dir, clock=CLOCK)


# ---- pure helpers ----


def test_split_by_measurement_recovers_parts_from_differences():
    # full computes dX+dW+dB = 100, kernels frozen dX+dB = 40, first-only dX = 30.
    obs = [
        (frozenset({"dx", "dw", "db"}), 100.0),
        (frozenset({"dx", "db"}), 40.0),
        (frozenset({"dx"}), 30.0),
    ]
    parts = split_by_measurement(obs)
    assert parts == pytest.approx({"dx": 30.0, "dw": 60.0, "db": 10.0})


def test_split_by_measurement_first_conv_and_noise():
    # First conv: no dX. Noisy, inconsistent observations still give parts >= 0 that sum to the
    # full configuration's time.
    obs = [(frozenset({"dw", "db"}), 50.0), (frozenset({"db"}), 8.0), (frozenset({"dw"}), 45.0)]
    parts = split_by_measurement(obs)
    assert set(parts) == {"dw", "db"}
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(50.0)
    assert parts["dw"] > parts["db"]


def test_split_by_measurement_unobserved_part_gets_the_rest():
    obs = [(frozenset({"dx", "dw"}), 90.0), (frozenset({"dx"}), 30.0)]
    assert split_by_measurement(obs) == pytest.approx({"dx": 30.0, "dw": 60.0})
    # Nothing tells dX and dW apart: they share the time.
    assert split_by_measurement([(frozenset({"dx", "dw"}), 90.0)]) == pytest.approx(
        {"dx": 45.0, "dw": 45.0}
    )


def test_fused_grad_parts_reads_non_empty_outputs():
    assert fused_grad_parts("ConvGrad", ["", "w_grad", "b_grad"]) == {"dw", "db"}
    assert fused_grad_parts("ConvGrad", ["x_grad", "", ""]) == {"dx"}
    assert fused_grad_parts("ConvGrad", ["x_grad", "w_grad"]) == {"dx", "dw"}
    assert fused_grad_parts("ConvTransposeGrad", ["x_grad", "", "b_grad"]) == {"dx", "db"}
    assert fused_grad_parts("MatMul", ["y"]) == frozenset()  # not a fused gradient kernel


def test_fit_optimizer_recovers_linear_costs():
    truth = OptimizerFit(fixed_us=20.0, per_tensor_us=3.0, per_element_us=0.004)
    obs = [
        (c, e, truth.fixed_us + truth.per_tensor_us * c + truth.per_element_us * e)
        for c, e in [
            (60, 700_000),
            (20, 690_000),
            (40, 10_000),
            (1, 300_000),
            (1, 16),
            (30, 350_000),
        ]
    ]
    fit = fit_optimizer(obs)
    assert fit.fixed_us == pytest.approx(20.0, rel=1e-3)
    assert fit.per_tensor_us == pytest.approx(3.0, rel=1e-3)
    assert fit.per_element_us == pytest.approx(0.004, rel=1e-3)
    assert fit.tensor_us(np.array([0, 1000])) == pytest.approx([3.0, 7.0])


def test_saved_forward_fraction():
    # e=0 configurations leave 500 us unexplained; the last-only step leaves 200 us: the 300 us
    # it saved are 30% of the 1000 us of forward before the last tensor.
    assert saved_forward_fraction(500.0, 200.0, 1000.0) == pytest.approx(0.3)
    assert saved_forward_fraction(500.0, 900.0, 1000.0) == 0.0  # noise: never negative
    assert saved_forward_fraction(500.0, -5000.0, 1000.0) == 1.0
    assert saved_forward_fraction(500.0, 200.0, 0.0) == 0.0


def test_robust_time_is_a_low_quantile():
    assert robust_time([5.0, 1.0, 100.0, 2.0, 3.0, 4.0]) < np.median([5, 1, 100, 2, 3, 4])
    assert robust_time(np.arange(11.0)) == pytest.approx(2.0)  # the 20th percentile


def test_forward_us_by_anchor_follows_replaced_nodes():
    """A forward node's anchor is the latest tensor consumed so far in graph order; a node ORT
    replaced in the training graph (``<name>_BatchNormInternal``) keeps its forward node's."""
    nodes = [
        helper.make_node("Relu", ["input"], ["a"], name="pre"),
        helper.make_node("Conv", ["a", "w"], ["b"], name="conv"),
        helper.make_node("BatchNormalization", ["b", "g", "beta", "m", "v"], ["c"], name="bn"),
        helper.make_node("Relu", ["c"], ["logits"], name="relu"),
    ]
    model = helper.make_model(
        helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 1, 2, 2])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, 2, 2])],
        )
    )
    rows = [
        {"name": "pre", "op": "Relu", "us": 1.0, "charge": "forward"},
        {"name": "conv", "op": "Conv", "us": 10.0, "charge": "forward"},
        {"name": "bn_BatchNormInternal", "op": "BatchNormInternal", "us": 5.0, "charge": "forward"},
        {"name": "relu", "op": "Relu", "us": 2.0, "charge": "forward"},
        {"name": "conv_Grad/ConvGrad_0", "op": "ConvGrad", "us": 99.0, "charge": "split"},
    ]
    out = forward_us_by_anchor(model, rows, ["w", "g", "beta"], node_overhead_us=0.5)
    # "pre" consumes no tensor: never on a gradient path, left out.
    np.testing.assert_allclose(out, [10.5, 0.0, 5.5 + 2.5])


def test_profile_json_formats_5_4_and_3_still_load(tmp_path):
    prof = Profile(
        model_hash="abc",
        tensors=["w", "b"],
        kinds=["kernel", "bias"],
        t_dw_us=[10.0, 1.0],
        t_dy_us=[5.0, 0.5],
        forward_us=100.0,
        measured_full_step_us=120.0,
        batch_size=4,
        input_shapes={"input": (3, 32, 32)},
        threads=1,
        ort_version="1.19.2",
        host="h",
    )
    assert prof.t_full_us == pytest.approx(116.5)  # the time model's T_full, not the measurement
    data = json.loads(prof.save(tmp_path / "p.json").read_text())
    assert data["format_version"] == PROFILE_FORMAT_VERSION == 6
    assert data["level"] == "thorough" and Profile.load(tmp_path / "p.json").level == "thorough"
    # Format 5 had no level: it was measured as the thorough level measures.
    v5 = dict(data, format_version=5)
    for key in ("level", "trace_overhead_us", "load_average"):
        del v5[key]
    (tmp_path / "v5.json").write_text(json.dumps(v5))
    assert Profile.load(tmp_path / "v5.json").level == "thorough"
    (tmp_path / "odd.json").write_text(json.dumps(dict(data, level="sloppy")))
    with pytest.raises(ProfileMismatchError, match="profile level 'sloppy' is not one of"):
        Profile.load(tmp_path / "odd.json")
    assert data["measured_full_step_us"] == 120.0 and "full_step_us" not in data
    assert data["input_shapes"] == {"input": [3, 32, 32]} and data["loss"] == "ce"
    # Format 4 had one input_shape (of the input legalisation named `input`).
    v4 = dict(v5, format_version=4, input_shape=[3, 32, 32])
    del v4["input_shapes"], v4["loss"]
    (tmp_path / "v4.json").write_text(json.dumps(v4))
    assert Profile.load(tmp_path / "v4.json").input_shapes == {"input": (3, 32, 32)}
    # Format 3 named the measured full step "full_step_us": mapped on load.
    old = dict(v4, format_version=3)
    old["full_step_us"] = old.pop("measured_full_step_us")
    (tmp_path / "old.json").write_text(json.dumps(old))
    back = Profile.load(tmp_path / "old.json")
    assert back.measured_full_step_us == 120.0
    np.testing.assert_array_equal(back.t_dw_us, prof.t_dw_us)
    (tmp_path / "v2.json").write_text(json.dumps(dict(data, format_version=2)))
    with pytest.raises(ProfileMismatchError, match="profile format 2 is not 6"):
        Profile.load(tmp_path / "v2.json")
    del data["measured_full_step_us"]
    (tmp_path / "lacks.json").write_text(json.dumps(data))
    with pytest.raises(ProfileMismatchError, match="lacks field"):
        Profile.load(tmp_path / "lacks.json")
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(ProfileMismatchError, match="empty.json is not an etgraph profile"):
        Profile.load(tmp_path / "empty.json")


def test_profile_key_of_thorough_unchanged_fast_differs():
    """The thorough level's key text is the one format 5 used, at the method version (7: the
    kernels of nodes ORT renamed count for their nodes; a profile of an older method misses);
    fast has its own."""
    shapes = {"input": (3, 32, 32)}
    text = "abc|3x32x32|4|1|wall|v7"
    assert profile_key("abc", shapes, 4, 1) == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert profile_key("abc", shapes, 4, 1, level="thorough") == profile_key("abc", shapes, 4, 1)
    assert profile_key("abc", shapes, 4, 1, level="fast") != profile_key("abc", shapes, 4, 1)


def test_robust_time_equals_numpy_quantile():
    rng = np.random.default_rng(0)
    for k in (1, 2, 3, 4, 7, 30):
        values = rng.random(k) * 100
        assert robust_time(values) == pytest.approx(float(np.quantile(values, 0.2)), abs=1e-12)
    with pytest.raises(ValueError, match="robust_time of no values"):
        robust_time([])


def test_round_robin_adds_rounds_until_reproduced():
    class Runner:
        def __init__(self, times):
            self.times, self.wall = list(times), []

        def step(self):
            self.wall.append(self.times.pop(0))

    # the two lowest of the measured runs agree within 3% only at the 5th measured round
    runner = Runner([9.0, 2.0, 1.5, 1.8, 3.0, 1.52, 1.0, 1.0])
    rounds = round_robin(
        [runner], 3, 1, until=lambda: reproduced(runner.wall[1:], 0.03), max_repeats=10
    )
    assert rounds == 5 and len(runner.wall) == 6
    capped = Runner([9.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert round_robin([capped], 3, 1, until=lambda: False, max_repeats=4) == 4
    assert round_robin([Runner([1.0] * 4)], 3, 1) == 3  # no until: exactly the rounds asked
    assert reproduced([1.0, 1.02, 5.0], 0.03) and not reproduced([1.0, 1.05], 0.03)
    assert not reproduced([1.0], 0.03)
    assert robust_time([3.0, 1.0, 2.0], 0.0) == 1.0  # the fast level's statistic: the minimum


def test_run_spans_split_the_trace_into_runs():
    def ev(ts, dur):
        return {"ts": ts, "dur": dur}

    events = [ev(0, 10), ev(15, 5), ev(100, 10), ev(112, 5)]  # two runs of two kernels
    spans = run_spans_s(events, 2)
    assert spans == [pytest.approx((20e-6, 15e-6)), pytest.approx((17e-6, 15e-6))]
    assert run_spans_s(events, 3) == [] and run_spans_s([], 1) == []


def test_kernel_events_reads_ort_trace_lines(tmp_path):
    """The line-by-line reader of ORT's trace finds the kernel events (also a name with an
    escaped quote, parsed as JSON) in time order and deletes the file."""
    lines = [
        '{"cat" : "Session","pid" :1,"tid" :1,"dur" :434,"ts" :13,"ph" : "X",'
        '"name" :"model_loading_array","args" : {}},',
        '{"cat" : "Node","pid" :1,"tid" :1,"dur" :0,"ts" :2709,"ph" : "X",'
        '"name" :"n0_fence_before","args" : {"op_name" : "Neg"}},',
        '{"cat" : "Node","pid" :1,"tid" :1,"dur" :48,"ts" :2712,"ph" : "X",'
        '"name" :"n0_kernel_time","args" : {"op_name" : "Neg"}},',
        '{"cat" : "Node","pid" :1,"tid" :1,"dur" :7,"ts" :2700,"ph" : "X",'
        '"name" :"a\\"b_kernel_time","args" : {"op_name" : "Neg"}},',
        '{"cat" : "Node","pid" :1,"dur" :5,"tid" :1,"ts" :2800,"ph" : "X",'
        '"name" :"odd_kernel_time","args" : {}}',
    ]
    path = tmp_path / "trace.json"
    path.write_text("[\n" + "\n".join(lines) + "\n]\n")
    events = _kernel_events(str(path))
    assert [(e["name"], e["dur"]) for e in events] == [
        ('a"b_kernel_time', 7),
        ("n0_kernel_time", 48),
        ("odd_kernel_time", 5),
    ]
    assert not path.exists()


def test_traced_node_finds_the_node_ort_renamed():
    nodes = {"/l2/dense/MatMul", "/l2/dense/MatMul_Grad/FusedMatMul_0", "/head/Gemm", "a"}
    assert traced_node("/l2/dense/MatMul", nodes) == "/l2/dense/MatMul"
    # MatmulTransposeFusion / GemmTransposeFusion: "<node>/<transformer>/"
    fused = "/l2/dense/MatMul_Grad/FusedMatMul_0/MatmulTransposeFusion/"
    assert traced_node(fused, nodes) == "/l2/dense/MatMul_Grad/FusedMatMul_0"
    assert traced_node("/l2/dense/MatMul/MatmulTransposeFusion/", nodes) == "/l2/dense/MatMul"
    assert traced_node("fused /head/Gemm", nodes) == "/head/Gemm"  # FusedGemm
    composed = "fused /l2/dense/MatMul/MatMulAddFusion//GemmTransposeFusion/"
    assert traced_node(composed, nodes) == "/l2/dense/MatMul"
    assert traced_node("BiasGelu_token_4", nodes) is None  # a name of ORT's own
    assert traced_node("/l2/other/MatMul/X/", nodes) is None  # no node of that path
    assert traced_node("a/Fusion/", nodes) == "a"


def test_fused_kernels_count_for_the_nodes_ort_renamed(tmp_path):
    """A dense layer exported as MatMul(x, Transpose(W)) + b (as torch exports BERT's): ORT
    fuses the Transpose into the MatMul and into its gradient's MatMuls under new names
    ("<node>/MatmulTransposeFusion/"). Their kernels are the layers' work: every kernel's time
    reaches a node of the graph (until session 22 the renamed ones reached none, and on
    all-MiniLM-L6-v2 60% of the step fell into the fixed per-step cost: every selection's
    ratio predicted 24% high on average)."""
    d, h, k = 64, 128, 10
    nodes = [
        helper.make_node("Transpose", ["w1"], ["w1t"], name="/l1/Transpose", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w1t"], ["m1"], name="/l1/MatMul"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], name="/l1/Add"),
        helper.make_node("Relu", ["a1"], ["r1"], name="/l1/Relu"),
        helper.make_node("Transpose", ["w2"], ["w2t"], name="/l2/Transpose", perm=[1, 0]),
        helper.make_node("MatMul", ["r1", "w2t"], ["y"], name="/l2/MatMul"),
    ]
    inits = [
        random_initializer("w1", (h, d), seed=1),
        random_initializer("b1", (h,), seed=2),
        random_initializer("w2", (k, h), seed=3),
    ]
    path = save_model(make_model(nodes, inits, in_shape=(8, d), out_shape=(8, k)), tmp_path)
    model = LoadedModel.load(path)
    n = len(model.tensors)
    shapes = model.input_shapes(None)
    batch = random_batch(8, model.inputs, shapes, model.task)
    training_model, _ = artifacts.training_graphs(
        model.with_batch(8, shapes), *model.split(np.ones(n, dtype=bool)), loss=model.task.loss
    )
    weights = model.initial_weights()
    graph = ProfiledGraph(training_model, weights, batch, threads=THREADS, work_dir=tmp_path)
    for _ in range(3):
        graph.step()
    timings = graph.result(warmup=1)
    renamed = {t for t in graph.traced_names if t not in timings}
    assert any("TransposeFusion" in t for t in renamed), renamed  # ORT did rename
    assert sum(t.us for t in timings.values()) == pytest.approx(graph.kernel_us, rel=1e-9)


def test_fast_optimizer_subsets_identify_the_fit():
    params = {
        "w1": np.zeros((64, 3, 3, 3), np.float32),
        "b1": np.zeros(64, np.float32),
        "w2": np.zeros((10, 64), np.float32),
        "b2": np.zeros(10, np.float32),
    }
    fast = optimizer_subsets(params, fast=True)
    assert fast == [["w1", "b1", "w2", "b2"], ["b1", "b2"], ["w1"], ["b2"]]
    assert len(optimizer_subsets(params)) == 7  # thorough: unchanged
    # fixed + per_tensor * count + per_element * elements is recovered from the fast subsets
    truth = OptimizerFit(30.0, 2.0, 0.001)
    obs = []
    for subset in fast:
        count, elements = len(subset), sum(params[n].size for n in subset)
        obs.append((count, elements, truth.fixed_us + 2.0 * count + 0.001 * elements))
    fit = fit_optimizer(obs)
    assert (fit.fixed_us, fit.per_tensor_us, fit.per_element_us) == pytest.approx(
        (30.0, 2.0, 0.001), rel=1e-6
    )


# ---- real profiles ----


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny_cnn", "resnet18s"])
def test_profile_has_one_timing_per_trainable_tensor(which, request):
    prof: Profile = request.getfixturevalue(f"{which}_profile")
    loaded: LoadedModel = request.getfixturevalue(f"{which}_model")
    model = onnx_io.load_model(request.getfixturevalue(f"{which}_onnx"))
    tensors = loaded.tensors
    assert prof.tensors == [t.name for t in tensors]
    assert prof.kinds == [t.kind for t in tensors]
    n = len(tensors)
    assert prof.t_dw_us.shape == (n,) and prof.t_dw_us.dtype == np.float64
    assert prof.t_dy_us.shape == (n,)
    assert np.all(prof.t_dw_us >= 0) and np.all(prof.t_dy_us >= 0)
    kernels = np.array([k == "kernel" for k in prof.kinds])
    assert np.all(prof.t_dw_us[kernels] > 0)
    assert prof.t_dy_us.sum() > 0
    assert prof.forward_us > 0 and prof.measured_full_step_us > 0
    assert prof.batch_size == 4 and prof.input_shapes == loaded.input_shapes()
    assert prof.threads == THREADS and prof.ort_version.startswith("1.19")
    assert prof.model_hash == onnx_io.model_hash(model)


@pytest.mark.slow
def test_charged_node_times_account_for_the_profiled_graph(resnet18s_model, resnet18s_profile):
    prof = resnet18s_profile
    # Every node of the full training graph is charged exactly once: the node times (kernel +
    # per-node overhead) add up to forward pass + t_dw (less the optimizer's per-tensor part)
    # + t_dy.
    total_nodes = 0.0
    for row in prof.nodes:
        assert row["charge"] in {"dw", "dy", "split", "forward", "loss"}
        total_nodes += row["us"] + prof.node_overhead_us
        if row["charge"] == "split":
            assert sum(p["us"] for p in row["parts"].values()) == pytest.approx(row["us"])
            assert len(row["observations"]) >= 2  # measured in more than one configuration
    params = np.array([t.params for t in resnet18s_model.tensors])
    optimizer_part = (prof.optimizer_per_tensor_us + prof.optimizer_per_element_us * params).sum()
    charged = prof.forward_pass_us + prof.t_dw_us.sum() - optimizer_part + prof.t_dy_us.sum()
    assert charged == pytest.approx(total_nodes, rel=1e-9)
    ops = {r["op"] for r in prof.nodes}
    assert {"ConvGrad", "BatchNormalizationGrad", "InPlaceAccumulatorV2"} <= ops
    # The backward pass costs more than the forward pass (paper §2.2).
    assert prof.t_dw_us.sum() + prof.t_dy_us.sum() > prof.forward_pass_us


@pytest.mark.slow
def test_conv_grad_is_split_by_measurement(resnet18s_profile):
    prof = resnet18s_profile
    splits = [r for r in prof.nodes if r["charge"] == "split"]
    assert splits
    for row in splits:
        parts = row["parts"]
        assert "dw" in parts and parts["dw"]["charge"] == "dw"
        seen = [frozenset(s) for s, _ in row["observations"]]
        # When the full configuration computes several parts, another configuration (kernels
        # frozen / only the first tensor trainable) computed fewer: the split is measured.
        if len(seen[0]) > 1:
            assert any(s < seen[0] for s in seen[1:]), row["name"]
    # Later layers' dX parts were measured alone (first_only configuration) and go to t_dy.
    dx = [r for r in splits if "dx" in r["parts"]]
    assert dx and all(r["parts"]["dx"]["charge"] == "dy" for r in dx)


@pytest.mark.slow
def test_branch_work_is_recorded_inside_t_dy(resnet18s_profile):
    """resnet18s has projection shortcuts: main-branch backward work is recorded as branch
    charges (already inside t_dy), and a mask training only a downsample kernel of a block
    is predicted cheaper than the chain rule's count."""
    prof = resnet18s_profile
    assert prof.branches
    per_tensor = np.zeros(len(prof.tensors))
    for b in prof.branches:
        assert b["prefix"] < b["tensor"] and b["us"] >= 0
        per_tensor[b["tensor"]] += b["us"]
    assert np.all(per_tensor <= prof.t_dy_us + 1e-6)
    k = max(i for i, n in enumerate(prof.tensors) if "downsample" in n and n.endswith("weight"))
    mask = np.zeros(len(prof.tensors), dtype=bool)
    mask[[k, -1]] = True
    chain = timing.step_us(mask, prof.t_dw_us, prof.t_dy_us, prof.forward_us)
    assert prof.predicted_step_us(mask) < chain


@pytest.mark.slow
def test_optimizer_cost_is_measured_and_folded_into_t_dw(resnet18s_profile):
    prof = resnet18s_profile
    assert prof.optimizer_per_element_us > 0
    # A big kernel pays more optimizer time than a small bias: t_dw grows with numel.
    assert prof.optimizer_per_tensor_us + prof.optimizer_per_element_us * 1e5 > 0


@pytest.mark.slow
def test_profile_checks_predict_profiled_configurations(resnet18s_profile):
    assert set(resnet18s_profile.checks) == {
        "full",
        "no_kernels",
        "first_only",
        "last_only",
        "bn_inference",  # every batch norm in inference mode, predicted by for_frozen_bn
        "last_only_inference",  # last_only with batch norms in inference mode (baked: fused)
        "first_only_inference",  # first_only likewise: frozen layers the gradient passes
    }
    assert 0.0 <= resnet18s_profile.forward_saved_fraction <= 1.0
    moved = np.asarray(resnet18s_profile.inference_forward_moved_us)
    assert moved.shape == (len(resnet18s_profile.tensors),)
    inference = resnet18s_profile.for_frozen_bn("inference")
    assert inference.t_full_us == pytest.approx(resnet18s_profile.t_full_us)
    for name, check in resnet18s_profile.checks.items():
        assert check["predicted_us"] == pytest.approx(check["measured_us"], rel=0.25), name


@pytest.mark.slow
def test_save_load_round_trip(tiny_cnn_profile, tmp_path):
    path = tiny_cnn_profile.save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    row = data["tensor_timings"][0]
    assert set(row) >= {"name", "kind", "t_dw_us", "t_dy_us"}
    for key in ("forward_us", "measured_full_step_us", "batch_size", "input_shapes", "threads"):
        assert key in data
    for key in ("ort_version", "host", "model_hash"):
        assert data[key]
    back = Profile.load(path)
    assert back.tensors == tiny_cnn_profile.tensors
    np.testing.assert_array_equal(back.t_dw_us, tiny_cnn_profile.t_dw_us)
    np.testing.assert_array_equal(back.t_dy_us, tiny_cnn_profile.t_dy_us)
    assert back.input_shapes == tiny_cnn_profile.input_shapes
    assert back.forward_us == tiny_cnn_profile.forward_us


@pytest.mark.slow
def test_cache_hits_on_second_call(tiny_cnn_model, tiny_cnn_profile, cache_dir):
    start = time.perf_counter()
    again = profile_model(
        tiny_cnn_model,
        level="thorough",
        repeats=REPEATS,
        warmup=WARMUP,
        threads=THREADS,
        cache_dir=cache_dir,
        clock=CLOCK,
    )
    assert time.perf_counter() - start < 2.0
    np.testing.assert_array_equal(again.t_dw_us, tiny_cnn_profile.t_dw_us)
    assert again.profiling_s == tiny_cnn_profile.profiling_s


@pytest.mark.slow
def test_profile_reuses_the_callers_graph_and_artifacts(tiny_cnn_model, tmp_path, monkeypatch):
    """On a profile-cache miss the tensor graph is built at most once, and the all-trainable
    artifacts a caller generated through the same ArtifactCache are a hit."""
    model = tiny_cnn_model
    model_b = model.with_batch(4, model.input_shapes())
    cache = ArtifactCache(tmp_path / "artifacts")
    full, hit = cache.get(model_b, *model.split(np.ones(len(model.tensors), dtype=bool)))
    assert not hit
    tensor_graph = graph.build_tensor_graph(model_b, training_model=full.training_model)

    hits = []
    get = cache.get

    def counting_get(*args, **kwargs):
        paths, was_hit = get(*args, **kwargs)
        hits.append((paths.directory, was_hit))
        return paths, was_hit

    monkeypatch.setattr(cache, "get", counting_get)
    builds = []
    build = graph.build_tensor_graph

    def counting_build(*args, **kwargs):
        builds.append(kwargs.get("training_model"))
        return build(*args, **kwargs)

    monkeypatch.setattr(graph, "build_tensor_graph", counting_build)
    # the isolation check's own two selections (once per process and model) are not counted
    monkeypatch.setattr(profiler, "check_sessions", lambda *args, **kwargs: None)
    kwargs = dict(level="thorough", repeats=2, warmup=1, threads=THREADS, clock=CLOCK)
    prof = profile_model(model, tensor_graph=tensor_graph, artifact_cache=cache, **kwargs)
    assert builds == []  # the caller's graph is used
    assert (full.directory, True) in hits  # the full configuration's artifacts are reused
    # full, no_kernels, first_only, last_only, bn_inference, last_only_inference,
    # first_only_inference
    assert len(hits) == len(prof.checks) == 7
    assert prof.tensors == model.names

    # Without them: artifacts in a temporary cache, the graph built once from the full
    # configuration's training model.
    again = profile_model(model, **kwargs)
    assert len(builds) == 1 and str(builds[0]).endswith("training_model.onnx")
    assert [r["op"] for r in again.nodes] == [r["op"] for r in prof.nodes]
    # A graph of another generation of the training model (ORT numbers the loss node per
    # process, so its node names differ) is not trusted: built once from the profiled one.
    other = profile_model(model, tensor_graph=tensor_graph, **kwargs)
    assert len(builds) == 2 and builds[1] != full.training_model
    assert [r["op"] for r in other.nodes] == [r["op"] for r in prof.nodes]


@pytest.mark.slow
def test_cached_profile_of_another_model_raises(tiny_cnn_model, tiny_cnn_profile, tmp_path):
    model = onnx_io.load_model(tiny_cnn_model.source)
    key = profile_key(tiny_cnn_profile.model_hash, tiny_cnn_profile.input_shapes, 4, THREADS, CLOCK)
    stale = Profile.from_dict(tiny_cnn_profile.to_dict())
    stale.model_hash = "0" * 16
    stale.save(tmp_path / f"{key}.json")
    with pytest.raises(ProfileMismatchError, match="model"):
        profile_model(
            tiny_cnn_model, level="thorough", threads=THREADS, cache_dir=tmp_path, clock=CLOCK
        )
    prof = tiny_cnn_profile
    prof.check_matches(onnx_io.model_hash(model), batch_size=4, input_shapes=prof.input_shapes)
    with pytest.raises(ProfileMismatchError, match="batch size"):
        prof.check_matches(prof.model_hash, batch_size=8)
    with pytest.raises(ProfileMismatchError, match="input shape"):
        prof.check_matches(prof.model_hash, input_shapes={"input": (3, 64, 64)})
    with pytest.raises(ProfileMismatchError, match="threads"):
        prof.check_matches(prof.model_hash, threads=THREADS + 1)
    with pytest.raises(ProfileMismatchError, match="clock"):
        prof.check_matches(prof.model_hash, clock="wall")
    with pytest.raises(ProfileMismatchError, match="--profile-level fast"):
        prof.check_matches(prof.model_hash, level="fast")


def test_bad_arguments_raise_config_error(tiny_cnn_model, tmp_path):
    with pytest.raises(ConfigError, match="batch size must be a positive integer"):
        profile_model(tiny_cnn_model, batch_size=0)
    with pytest.raises(ConfigError, match="repeats must be >= 1"):
        profile_model(tiny_cnn_model, repeats=0)
    with pytest.raises(ConfigError, match="unknown profile level 'quick'"):
        profile_model(tiny_cnn_model, level="quick")
    with pytest.raises(ConfigError, match="threads must be >= 1"):
        profile_model(tiny_cnn_model, threads=0)
    with pytest.raises(ConfigError, match="threads 1"):
        profile_model(tiny_cnn_model, threads=2, clock="cpu")
    with pytest.raises(ConfigError, match="clock must be one of"):
        profile_model(tiny_cnn_model, threads=1, clock="sundial")
    with pytest.raises(ConfigError, match="malformed"):
        profile_model(tiny_cnn_model, input_shapes=["3x"])
    with pytest.raises(ConfigError, match="does not exist"):
        Profile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        Profile.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="non-empty bool rows of length"):
        measure_selection_steps_us(tiny_cnn_model, np.zeros((1, len(tiny_cnn_model.tensors))))


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["resnet18s_profile", "resnet18s_fast_profile"])
def test_step_us_predicts_measured_steps_of_other_selections(resnet18s_model, profile, request):
    """The real check: artifacts generated for masks the profiler never ran, real steps; both
    profiling levels."""
    prof = request.getfixturevalue(profile)
    n = len(prof.tensors)
    masks = np.zeros((3, n), dtype=bool)
    masks[0, n - 12 :] = True  # the last layers
    masks[1, n // 3 :: 3] = True  # a sparse selection from a third of the way in
    masks[2, n // 2] = True  # one tensor in the middle: t_dy of everything after it
    masks[2, -1] = True
    measured, full = measure_selection_steps_us(
        resnet18s_model, masks, threads=THREADS, repeats=10, warmup=WARMUP, clock=CLOCK, group=3
    )
    predicted = np.array(
        [timing.step_us(m, prof.t_dw_us, prof.t_dy_us, prof.forward_us) for m in masks]
    )
    # The masks are measured round-robin with full training, all in one round (one round per
    # mask, 5 repeats each: one full step measured at 12.8 ms beside 5.7 and 7.1, quiet
    # machine, made mask 2 miss by 119%), and the prediction is compared at the machine speed
    # of that round.
    speed = full / prof.measured_full_step_us
    rel = predicted * speed / measured - 1.0
    # Training sessions bake their frozen parameters (artifact_weights.bake_frozen), so a frozen
    # layer the gradient still passes through runs faster than the profile's per-node times, which
    # are of unbaked graphs: on this 1.5 ms model the first_only step baked is 0.78x unbaked
    # (MobileNetV2 at 128 px: 0.99x with batch norms in training mode, as here; 0.865x in
    # inference mode, docs/results.md "Frozen parameters become constants"), and the time model
    # over-predicts the mask with the most such layers, mask 2: by 30-33% (fast level, 3
    # profiles) and once 45% (CI) until session 11; 48-53% at the fast level and 23-26% at the
    # thorough one in session 12 (4 quiet runs), mask 1 by 31-38% (fast) and 11-21%
    # (thorough), mask 0 within 10%; session 15: mask 1 by 37-41% (fast, 5 local runs) and once
    # 55% in CI. Known gap (docs/results.md): that saving belongs to t_dw of the layer's weights
    # (paid when selected); the closed loop re-fits the scale and an offset, not that.
    assert abs(rel[0]) < 0.5 and abs(rel[1]) < 0.7, (predicted, measured, full)
    assert -0.1 < rel[2] < 0.75, (predicted, measured, full)
    # Sanity: these selective steps are faster than full ones, measured and predicted.
    assert np.all(measured < full)
    assert np.all(predicted < prof.measured_full_step_us)


def test_sessions_do_not_spin():
    """Every ORT session etgraph opens turns thread-pool spinning off: with it on, an idle
    session's threads busy-wait and slow whichever session runs next (README, "Thread-pool
    spinning"), and profiles stop predicting training."""
    from etgraph.ort_options import session_options

    for threads, prefix in ((None, None), (2, "trace")):
        so = session_options(threads, prefix)
        assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert session_options(2).intra_op_num_threads == 2
    assert session_options(None, "trace").enable_profiling


# ---- the fast level ----


@pytest.mark.slow
def test_fast_profile_measures_three_graphs_and_both_batch_norm_modes(
    resnet18s_model, resnet18s_fast_profile, resnet18s_profile
):
    fast = resnet18s_fast_profile
    assert fast.level == "fast" and resnet18s_profile.level == "thorough"
    assert 3 <= fast.repeats <= 10 and fast.warmup == 1  # more rounds when runs disagree
    # full, first_only (batch norms in inference mode, baked), last_only, and last_only baked
    # with batch norms in inference mode; no_kernels only splits a conv's bias gradient, and
    # these convs have none
    assert set(fast.checks) == {"full", "first_only", "last_only", "last_only_inference"}
    for c in ("first_only", "last_only_inference"):
        assert fast.checks[c]["frozen_bn"] == "inference"
    assert len(fast.inference_forward_moved_us) == len(fast.tensors)
    assert len(fast.inference_path_moved_us) == len(fast.tensors)
    # every batch norm but one of tensor 0 has both modes measured
    bn_tensors = {r["gamma"] for r in resnet18s_profile.batch_norms}
    assert {r["gamma"] for r in fast.batch_norms} == bn_tensors - {0}
    assert all(r["inference_dy_us"] > 0 for r in fast.batch_norms)
    # ConvGrad split by measurement with the first_only graph
    split = [r for r in fast.nodes if "parts" in r]
    assert split and all(len(r["observations"]) >= 2 for r in split)
    assert fast.trace_overhead_us >= 0 and fast.load_average is not None
    for name, check in fast.checks.items():
        # for_frozen_bn over-predicts batch-norm inference steps (the thorough level's
        # bn_inference check too, by 2-16% on the paper models); on first_only's short
        # backward that is a larger share
        rel = 0.4 if check.get("frozen_bn") else 0.25
        assert check["predicted_us"] == pytest.approx(check["measured_us"], rel=rel), name
    # the two levels agree on the shape of the time model
    for a, b in (
        (fast.t_dw_us, resnet18s_profile.t_dw_us),
        (fast.t_dy_us, resnet18s_profile.t_dy_us),
    ):
        assert np.corrcoef(a, b)[0, 1] > 0.8


@pytest.mark.slow
@pytest.mark.parametrize("frozen_bn", ["train", "inference"])
def test_training_graphs_are_the_generated_ones(resnet18s_model, tmp_path, frozen_bn):
    """The in-memory graphs of the fast level are what generate() writes (node names equal up
    to ORT's per-process numbering of the loss values), built from a copy without weights."""
    model = resnet18s_model
    model_b = model.with_batch(4, model.input_shapes())
    mask = np.zeros(len(model.tensors), dtype=bool)
    mask[[0, 5, -1]] = True
    paths = artifacts.generate(model_b, *model.split(mask), tmp_path / "a", frozen_bn=frozen_bn)
    training, optimizer = artifacts.training_graphs(
        model_b, *model.split(mask), frozen_bn=frozen_bn
    )

    def nodes(m):
        return [
            re.sub(r"::\d+", "::#", str((n.op_type, list(n.input), list(n.output), n.domain)))
            for n in m.graph.node
        ]

    assert nodes(training) == nodes(onnx.load(str(paths.training_model)))
    assert nodes(optimizer) == nodes(onnx.load(str(paths.optimizer_model)))
    big = [i for i in model_b.graph.initializer if len(i.raw_data) > 4096]
    light = artifact_weights.placeholder_weights(model_b, [i.name for i in big])
    assert big and all(
        len(i.raw_data) == 4 for i in light.graph.initializer if i.name in {b.name for b in big}
    )
    assert [list(i.dims) for i in light.graph.initializer] == [
        list(i.dims) for i in model_b.graph.initializer
    ]


@pytest.mark.slow
def test_fast_profile_uses_the_callers_full_artifacts(tiny_cnn_model, tmp_path, monkeypatch):
    """With the caller's all-trainable artifacts in its cache, the fast level profiles their
    training graph (so the caller's tensor graph fits) and generates no artifacts."""
    model = tiny_cnn_model
    model_b = model.with_batch(4, model.input_shapes())
    cache = ArtifactCache(tmp_path / "artifacts")
    full, _ = cache.get(model_b, *model.split(np.ones(len(model.tensors), dtype=bool)))
    tensor_graph = graph.build_tensor_graph(model_b, training_model=full.training_model)
    calls = []
    monkeypatch.setattr(artifacts, "generate", lambda *a, **k: calls.append(a))
    builds = []
    build = graph.build_tensor_graph
    monkeypatch.setattr(
        graph, "build_tensor_graph", lambda *a, **k: builds.append(k) or build(*a, **k)
    )
    prof = profile_model(
        model, tensor_graph=tensor_graph, artifact_cache=cache, threads=THREADS, clock=CLOCK
    )
    assert calls == [] and builds == []
    assert prof.level == "fast" and prof.tensors == model.names
    assert sorted(p.name for p in cache.root.iterdir()) == [full.directory.name]


def test_a_profile_measured_while_other_work_filled_the_cores_says_so(
    default_model, monkeypatch, caplog
):
    """The load average at the end of profiling is recorded, and when other work alone filled
    the cores (the profiler's own threads taken off) the user is told to profile again."""
    from etgraph import profiler

    monkeypatch.setattr(profiler, "_load_average", lambda: 0.5)
    with caplog.at_level("WARNING", logger="etgraph.profiler"):
        quiet = profile_model(default_model, batch_size=4, threads=1)
    assert quiet.load_average == 0.5 and "profile again" not in caplog.text
    monkeypatch.setattr(profiler, "_load_average", lambda: 40.0)
    with caplog.at_level("WARNING", logger="etgraph.profiler"):
        busy = profile_model(default_model, batch_size=4, threads=1)
    assert busy.load_average == 40.0 and "profiled at load average 40.0" in caplog.text


def test_conv_grad_of_a_computed_kernel_or_shared_bias_is_charged(tmp_path):
    """A kernel computed from initializers (weight norm: w = v * g, exported unfolded) and a
    bias read by the Conv and by an Add: ORT names the ConvGrad's dW output after the Mul's
    output (``<mul>_grad``) and the dB output ``b_grad_0``. Both are charged to the tensors
    that carry them (an internal error before)."""
    nodes = [
        helper.make_node("Mul", ["v", "g"], ["w"], name="weight_norm"),
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["b", "b_shape"], ["b4"], name="b_as_4d"),
        helper.make_node("Add", ["c", "b4"], ["cb"], name="add_bias_again"),
        helper.make_node("Relu", ["cb"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1),
    ]
    inits = [
        random_initializer("v", (6, 3, 3, 3)),
        random_initializer("g", (6, 1, 1, 1), 1),
        random_initializer("b", (6,), 2),
        onnx.numpy_helper.from_array(np.array([1, 6, 1, 1], np.int64), "b_shape"),
        random_initializer("fw", (4, 6), 3),
        random_initializer("fb", (4,), 4),
    ]
    model = make_model(nodes, inits, in_shape=("N", 3, 8, 8), out_shape=("N", 4))
    loaded = LoadedModel.load(save_model(model, tmp_path))
    prof = profile_model(loaded, threads=THREADS, cache_dir=tmp_path / "cache", clock=CLOCK)
    split = next(r for r in prof.nodes if r["charge"] == "split")
    # the computed kernel's dW goes to one of the tensors it is computed from (the layer's
    # kernel by the conv_dense pass's D(o) rule), the bias's dB to the bias
    assert split["parts"]["dw"]["tensor"] in {"v", "g"}
    assert split["parts"]["db"]["tensor"] == "b"
    kinds = dict(zip(prof.tensors, prof.kinds, strict=True))
    assert kinds["b"] == "bias" and {kinds["v"], kinds["g"]} == {"kernel"}
    assert all(prof.t_dw_us > 0)


# ---- frozen layers on the gradient path (issue 30) ----


@pytest.fixture(scope="module")
def tiny_depthwise_model(tmp_path_factory) -> LoadedModel:
    """A MobileNetV2-style net small enough for tests: conv-BN-ReLU6, three inverted residual
    blocks (1x1 expand, 3x3 depthwise, 1x1 project, BN), pool, linear head (3x32x32 -> 10)."""
    import torch
    from torch import nn

    from models.export import export_onnx
    from models.zoo import InvertedResidual, conv_bn_relu6

    torch.manual_seed(0)
    net = nn.Sequential(
        conv_bn_relu6(3, 16, 3, 2),
        InvertedResidual(16, 16, 1, 4),
        InvertedResidual(16, 24, 2, 4),
        InvertedResidual(24, 24, 1, 4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(24, 10),
    )
    path = tmp_path_factory.mktemp("depthwise") / "depthwise.onnx"
    return LoadedModel.load(export_onnx(net, path, input_shape=(3, 32, 32)))


@pytest.mark.slow
def test_frozen_layers_the_gradient_passes_are_charged_as_training_runs_them(
    tiny_depthwise_model,
):
    """Issue 30: training sessions bake frozen parameters, so a frozen layer the gradient passes
    runs fused (Conv + BN + ReLU6, blocked depthwise convs) and cheaper than the profile's
    unbaked nodes. The fast level times the first_only selection baked and charges the saving
    to the layers' tensors (``inference_path_moved_us``): selections with many frozen layers
    after their earliest tensor are then predicted as they run, in the loop's batch-norm mode."""
    model = tiny_depthwise_model
    n = len(model.tensors)
    prof = profile_model(model, batch_size=16, threads=THREADS, clock=CLOCK)
    assert prof.checks["first_only"]["frozen_bn"] == "inference"  # timed baked
    assert len(prof.inference_path_moved_us) == n and sum(prof.inference_path_moved_us) > 0
    masks = np.zeros((3, n), dtype=bool)
    masks[0, [0, n - 2, n - 1]] = True  # the first kernel and the head: every layer passed
    masks[1, ::3] = True  # scattered, as top-k selects
    masks[2, n // 2 :] = True  # a prefix of the backward pass: nothing frozen after it
    # the median of three measurements: one noisy measurement of mask 0 (ratio error 0.13 with
    # the charge against 0.08 without it, where 0.01-0.09 against 0.17-0.25 is usual) inverted
    # the comparison on a loaded machine
    rounds = [
        np.divide(
            *measure_selection_steps_us(
                model,
                masks,
                batch_size=16,
                threads=THREADS,
                repeats=10,
                warmup=WARMUP,
                clock=CLOCK,
                group=3,
                frozen_bn="inference",
            )
        )
        for _ in range(3)
    ]
    ratio = np.median(rounds, axis=0)

    def errors(p: Profile) -> np.ndarray:
        predicted = np.array([p.predicted_step_us(m) for m in masks]) / p.t_full_us
        return predicted / ratio - 1.0

    now = errors(prof.for_frozen_bn("inference"))
    before = errors(
        dataclasses.replace(prof, inference_path_moved_us=[]).for_frozen_bn("inference")
    )
    print("ratio error now", now, "without the baked path", before)
    # within 30%: single masks of this tiny net measured up to 19% off on a loaded machine
    assert np.abs(now).max() < 0.3
    assert np.abs(now[:2]).mean() < np.abs(before[:2]).mean()


@pytest.mark.slow
def test_profile_whose_rounds_never_agree_on_a_busy_machine_is_not_cached(
    tiny_cnn_model, tmp_path, monkeypatch, caplog
):
    """Issue 30: a fast profile measured while other work stretched every round (load 6 on 2
    cores: MobileNetV2's late kernels got 15x their t_dw) served the cache for later runs on a
    quiet machine, whose selections then ran at 0.31-0.68 of the full step for rho 0.5. Rounds
    that never reproduce (stood in for here: the check always fails) while other work fills
    the cores are used, not cached. On a quiet machine whose rounds still vary (MobileNetV2 128
    px at load 0.6 here) a new profile would be no sharper: it is cached, later runs select
    alike instead of profiling again each time."""
    from etgraph import profile_levels, profiler

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(profile_levels, "reproduced", lambda times, tolerance: False)
    monkeypatch.setattr(profiler, "_load_average", lambda: float(THREADS + cores))
    prof = profile_model(tiny_cnn_model, threads=THREADS, clock=CLOCK, cache_dir=tmp_path)
    assert prof.reproduced is False and prof.repeats == profile_levels.FAST_MAX_REPEATS
    assert not list(tmp_path.glob("*.json"))
    assert "profile not cached" in caplog.text and "profiled at load average" in caplog.text
    monkeypatch.setattr(profiler, "_load_average", lambda: float(THREADS + cores) - 0.5)
    prof = profile_model(tiny_cnn_model, threads=THREADS, clock=CLOCK, cache_dir=tmp_path)
    assert prof.reproduced is False and len(list(tmp_path.glob("*.json"))) == 1
    again = profile_model(tiny_cnn_model, threads=THREADS, clock=CLOCK, cache_dir=tmp_path)
    assert again.cached_from and np.array_equal(again.t_dw_us, prof.t_dw_us)


def test_paired_ratio_cancels_the_machines_speed_between_rounds():
    """Issue 30: a shared machine's speed changed by 1.5x between rounds; the ratio of two
    runners stepped round robin is taken round by round, so a slow round slows both."""
    from etgraph.measure import paired_ratio

    speed = np.array([1.0, 1.0, 1.5, 1.0, 1.6, 1.4])  # per round; round 0 is warm-up
    mask, full = 0.4 * speed, 1.0 * speed
    mask[3] *= 1.2  # one disturbed step of the mask
    assert paired_ratio(mask, full, warmup=1) == pytest.approx(0.4)
    # the full steps' fast rounds disturbed: separate low quantiles put the mask at 0.31
    full[[1, 3]] *= 1.5
    assert robust_time(mask[1:]) / robust_time(full[1:]) < 0.35
    assert paired_ratio(mask, full, warmup=1) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0], warmup=1)
