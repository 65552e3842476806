"""A selection's training graph derived from the all-trainable one (etgraph.derive, issue 31):
the same ops as onnxblock generates for the selection, the same training steps, and the cache
deriving instead of generating."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest

import etgraph.artifacts as artifacts_module
from etgraph.artifacts import ArtifactCache, generate
from etgraph.checkpoint import CarriedState, write_checkpoint
from etgraph.derive import derive_training_graph
from etgraph.errors import ConfigError
from etgraph.sessions import TrainingSession

BATCH = 4


def _static(model) -> tuple[int, dict]:
    return BATCH, model.input_shapes(None)


def _masks(n: int) -> list[np.ndarray]:
    """A random selection, the last tensors with one early one, one tensor in the middle."""
    rng = np.random.default_rng(3)
    scattered = rng.random(n) < 0.4
    scattered[-1] = True
    tail = np.zeros(n, dtype=bool)
    tail[-3:] = True
    tail[n // 3] = True
    middle = np.zeros(n, dtype=bool)
    middle[n // 2] = True
    return [scattered, tail, middle]


def _ops(model: onnx.ModelProto) -> collections.Counter:
    """Op types with their number of computed outputs (Identity aside: ORT removes them)."""
    return collections.Counter(
        (n.domain, n.op_type, sum(1 for o in n.output if o))
        for n in model.graph.node
        if n.op_type != "Identity"
    )


@pytest.fixture(scope="module")
def full_artifacts(tmp_path_factory, default_model):
    model = default_model
    out = tmp_path_factory.mktemp("full")
    paths = generate(
        model.proto, model.names, list(model.running_stats), out / "full",
        static_batch=_static(model),
    )  # fmt: skip
    return paths, onnx.load(str(paths.training_model))


@pytest.mark.parametrize("frozen_bn", ["inference", "train"])
def test_derived_graph_computes_what_onnxblock_generates(
    tmp_path, default_model, full_artifacts, frozen_bn
):
    """Same ops and outputs per op as onnxblock's graph of the selection: the frozen kernels'
    ConvGrad computes dX only, the earliest selected layer's no dX, frozen batch norms are
    affine maps (inference) or keep their full backward (train)."""
    model = default_model
    _, full = full_artifacts
    for k, mask in enumerate(_masks(len(model.names))):
        trainable, frozen = model.split(mask)
        generated = generate(
            model.proto, trainable, frozen, tmp_path / f"g{k}", frozen_bn=frozen_bn,
            static_batch=_static(model), checkpoint=False,
        )  # fmt: skip
        derived = derive_training_graph(full, trainable, inference_bn=frozen_bn == "inference")
        assert _ops(derived) == _ops(onnx.load(str(generated.training_model)))
        onnx.checker.check_model(derived)
        outputs = {o.name for o in derived.graph.output}
        for name in model.names:
            assert (f"{name}_grad.accumulation.out" in outputs) == (name in trainable)


@pytest.mark.slow
@pytest.mark.parametrize("frozen_bn", ["inference", "train"])
def test_derived_artifacts_train_exactly_like_generated_ones(
    tmp_path, default_model, full_artifacts, frozen_bn
):
    """Losses, updated weights, running statistics and validation of three steps agree."""
    model = default_model
    source, _ = full_artifacts
    weights = model.initial_weights()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, *model.input_shapes(None)["input"])).astype(np.float32)
    y = rng.integers(0, 5, BATCH).astype(np.int64)
    mask = _masks(len(model.names))[0]
    trainable, frozen = model.split(mask)
    generated = generate(
        model.proto, trainable, frozen, tmp_path / "generated", frozen_bn=frozen_bn,
        static_batch=_static(model), checkpoint=False,
    ).directory  # fmt: skip
    cache = ArtifactCache(tmp_path / "cache", static_batch=_static(model))
    derived, hit = cache.get(
        model.proto, trainable, frozen, frozen_bn=frozen_bn, checkpoint=False, source=source
    )
    assert not hit
    results = []
    for directory in (generated, derived.directory):
        ckpt = tmp_path / "start.ckpt"
        write_checkpoint(ckpt, CarriedState(dict(weights)), trainable)
        session = TrainingSession(directory, ckpt, 1, input_names=model.input_names)
        losses = [session.train_step(x, y, 1e-3)[0] for _ in range(3)]
        results.append((losses, session.weights(), session.evaluate([(x, y)], BATCH)))
    (l0, w0, e0), (l1, w1, e1) = results
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for name in w0:
        np.testing.assert_allclose(w1[name], w0[name], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(e1, e0, rtol=1e-5)


def test_cache_derives_from_the_source_without_onnxblock(
    tmp_path, default_model, full_artifacts, monkeypatch
):
    model = default_model
    source, _ = full_artifacts
    trainable, frozen = model.split(_masks(len(model.names))[1])

    def no_onnxblock(*args, **kwargs):
        raise AssertionError("generate_artifacts called")

    monkeypatch.setattr(artifacts_module.ort_artifacts, "generate_artifacts", no_onnxblock)
    cache = ArtifactCache(tmp_path / "cache", static_batch=_static(model))
    paths, hit = cache.get(
        model.proto, trainable, frozen, frozen_bn="inference", checkpoint=False, source=source
    )
    assert not hit and paths.exists(checkpoint=False)
    again, hit = cache.get(
        model.proto, trainable, frozen, frozen_bn="inference", checkpoint=False, source=source
    )
    assert hit and again == paths
    with pytest.raises(ConfigError, match="select at least one"):
        artifacts_module.derive(
            onnx.load(str(source.training_model)), source, [], "inference", tmp_path / "x"
        )


def test_no_derivation_without_the_rank_of_a_frozen_batch_norm(default_model, full_artifacts):
    """A frozen batch norm whose input rank the graph does not record cannot be written as
    its affine map: None (the cache then generates), in inference mode only."""
    _, full = full_artifacts
    bare = onnx.ModelProto()
    bare.CopyFrom(full)
    bare.graph.ClearField("value_info")
    last = default_model.names[-2:]
    assert derive_training_graph(bare, last, inference_bn=True) is None
    assert derive_training_graph(bare, last, inference_bn=False) is not None
    with pytest.raises(ValueError, match="not trainable"):
        derive_training_graph(full, ["no such tensor"], inference_bn=False)
