"""Importance (paper Eq. 2, §4): the formula, and the ORT routine against a hand-computed step."""

from __future__ import annotations

import numpy as np
import pytest

from etgraph.artifacts import ArtifactCache
from etgraph.checkpoint import read_checkpoint
from etgraph.data import load_dataset
from etgraph.errors import ConfigError
from etgraph.importance import ImportanceEvaluator, gradient_chunks, probe_importance
from etgraph.importance_rules import (
    SCRATCH_CHUNK,
    adamw_first_step,
    adamw_step,
    tensor_importance,
    variant_importance,
)
from etgraph.model import LoadedModel
from etgraph.selection import IMPORTANCE_VARIANTS
from etgraph.sessions import TrainingSession

LR = 1e-3
WEIGHT_DECAY = 0.01


def test_tensor_importance_is_minus_sum_of_gradient_times_update():
    g = [np.array([1.0, -2.0]), np.array([[0.5, 0.5], [1.0, 0.0]])]
    d = [np.array([-0.1, 0.3]), np.array([[0.2, -0.2], [-1.0, 7.0]])]
    got = tensor_importance(g, d)
    assert got.dtype == np.float64 and got.shape == (2,)
    np.testing.assert_allclose(got, [-(1 * -0.1 + -2 * 0.3), -(0.1 - 0.1 - 1.0 + 0.0)])
    # additive: the importance of a tensor split in two is the sum of the parts
    parts = tensor_importance([g[1][0], g[1][1]], [d[1][0], d[1][1]])
    assert parts.sum() == pytest.approx(got[1])
    # an SGD step (delta = -lr * g) scores lr * ||g||^2 >= 0
    sgd = tensor_importance(g, [-0.01 * gi for gi in g])
    np.testing.assert_allclose(sgd, [0.01 * np.sum(gi**2) for gi in g])


def test_chunked_importance_equals_the_reference_of_every_variant():
    """The evaluator's chunked float32 form equals tensor_importance of each variant's
    documented update (adamw_step with and without moments, adamw_first_step, an SGD step) —
    across chunk boundaries and with several probe batches."""
    rng = np.random.default_rng(3)
    scratch = np.empty((3, SCRATCH_CHUNK), dtype=np.float32)
    lr, wd = 1e-3, 0.05
    for size, batches in ((7, 1), (SCRATCH_CHUNK + 12345, 2), (2 * SCRATCH_CHUNK, 3)):
        g = (rng.standard_normal(size) * 10.0 ** rng.uniform(-9, -1, size)).astype(np.float32)
        w = rng.standard_normal(size).astype(np.float32)
        moments = {
            "momentum0": (0.3 * g + 1e-4 * rng.standard_normal(size)).astype(np.float32),
            "momentum1": (g.astype(np.float64) ** 2 + 1e-9 * rng.random(size)).astype(np.float32),
        }
        mean = g.astype(np.float64) / batches
        updates = {
            "first-step": (adamw_first_step(mean, w, lr, wd), None, 0),
            "grad-sq": (-lr * (mean + wd * w), None, 0),
            "adam": (adamw_step(mean, w, lr, wd, moments=moments, step=40), moments, 40),
        }
        for variant, (delta, carried, step) in updates.items():
            expected = tensor_importance([mean], [delta])[0]
            got = variant_importance(variant, g, w, lr, wd, batches, scratch, carried, step)
            np.testing.assert_allclose(got, expected, rtol=2e-5, err_msg=variant)
        # no moments at step 0: the optimizer's next step is its first step (up to the
        # lr^2 * wd * step term adamw_first_step leaves out)
        first = adamw_first_step(mean, w, lr, wd)
        np.testing.assert_allclose(adamw_step(mean, w, lr, wd), first, atol=2 * lr * lr * wd)


def test_tensor_importance_rejects_mismatches():
    with pytest.raises(ConfigError, match="1 gradients but 0 weight updates"):
        tensor_importance([np.zeros(2)], [])
    with pytest.raises(ConfigError, match=r"tensor 0: gradient shape \(2,\) differs"):
        tensor_importance([np.zeros(2)], [np.zeros(3)])


@pytest.fixture(scope="module")
def loaded(default_model_path) -> LoadedModel:
    return LoadedModel.load(default_model_path)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> ArtifactCache:
    return ArtifactCache(tmp_path_factory.mktemp("importance-artifacts"))


@pytest.fixture(scope="module")
def setup(loaded, cache):
    """Default model, its tensors, all-trainable artifacts and a probe batch."""
    names = loaded.names
    stats = list(loaded.running_stats)
    weights = loaded.initial_weights()
    evaluator = ImportanceEvaluator(
        loaded.proto, names, stats, cache, weight_decay=WEIGHT_DECAY, input_names=["input"]
    )
    dataset = load_dataset(None, input_shape=loaded.input_shapes()["input"])
    batch = dataset.probe_batch(4, seed=3)
    return evaluator, names, stats, weights, batch


def _hand_computed(evaluator, names, stats, weights, batch):
    """One real ORT AdamW step of all tensors (Module + Optimizer), read back and scored with
    plain numpy."""
    paths = evaluator.paths
    session = TrainingSession(
        paths.directory, paths.checkpoint, threads=None, input_names=["input"]
    )
    state = session.state
    for name in names + stats:
        state.parameters[name].data[...] = weights[name]
    session.module(*batch)
    grads = {n: state.parameters[n].grad.copy() for n in names}
    session.optimizer.set_learning_rate(LR)
    session.optimizer.step()
    after = {n: state.parameters[n].data.copy() for n in names}
    importance = np.array(
        [
            -np.sum(grads[n].astype(np.float64) * (after[n] - weights[n]).astype(np.float64))
            for n in names
        ]
    )
    return importance, grads, after


def test_importance_matches_hand_computed_ort_step(setup):
    evaluator, names, stats, weights, batch = setup
    expected, grads, after = _hand_computed(evaluator, names, stats, weights, batch)
    result = evaluator.evaluate(weights, [batch], LR)
    assert result.importance.shape == (len(names),)
    np.testing.assert_allclose(result.importance, expected, rtol=1e-4, atol=1e-12)
    assert np.isfinite(result.loss) and result.cost_s > 0
    # The documented update rule: ORT AdamW's first step from zero moments (Hugging Face mode:
    # eps added to sqrt(v) before bias correction, so eps_eff = eps / sqrt(1 - beta2)),
    # delta = -lr * (g / (|g| + eps_eff) + wd * w), checked on the largest tensor.
    big = max(names, key=lambda n: weights[n].size)
    g, w = grads[big], weights[big]
    eps_eff = 1e-6 / np.sqrt(1 - 0.999)
    predicted = -LR * (g / (np.abs(g) + eps_eff) + WEIGHT_DECAY * w)
    np.testing.assert_allclose(after[big] - w, predicted, atol=2e-6)
    # Most tensors carry positive importance (a loss-reducing step); the head is informative.
    assert (result.importance > 0).sum() >= len(names) // 2


def test_adam_importance_is_the_next_real_ort_step_with_the_carried_moments(setup, tmp_path):
    """After real AdamW steps, the "adam" importance (moments and step read back from ORT's own
    checkpoint) equals -g . delta_w of the step ORT then takes on the probe batch; the first-step
    rule (importance before issue 30), which ignores the moments, does not."""
    evaluator, names, stats, weights, batch = setup
    paths = evaluator.paths
    session = TrainingSession(
        paths.directory, paths.checkpoint, threads=None, input_names=["input"]
    )
    state = session.state
    for name in names + stats:
        state.parameters[name].data[...] = weights[name]
    dataset = load_dataset(None, input_shape=(3, 32, 32))
    for seed in range(4):
        session.train_step(*dataset.probe_batch(4, seed=10 + seed), LR)
    session.save(tmp_path / "ckpt", {})
    carried, _, _ = read_checkpoint(tmp_path / "ckpt")
    assert carried.step == 4 and set(carried.moments) == set(names)
    now = {n: state.parameters[n].data.copy() for n in names + stats}
    session.module(*batch)  # the next real step, on the probe batch
    grads = {n: state.parameters[n].grad.copy() for n in names}
    session.optimizer.set_learning_rate(LR)
    session.optimizer.step()
    expected = np.array(
        [-np.sum(grads[n].astype(np.float64) * (state.parameters[n].data - now[n])) for n in names]
    )
    args = (carried.weights, [batch], LR)
    adam = ImportanceEvaluator(
        *evaluator_args(evaluator), weight_decay=WEIGHT_DECAY, input_names=["input"],
        variant="adam",
    )  # fmt: skip
    got = adam.evaluate(*args, moments=carried.moments, step=carried.step).importance
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=1e-10)
    first_step = ImportanceEvaluator(
        *evaluator_args(evaluator), weight_decay=WEIGHT_DECAY, input_names=["input"],
        variant="first-step",
    ).evaluate(*args).importance  # fmt: skip
    assert not np.allclose(first_step, expected, rtol=0.1)


def evaluator_args(evaluator):
    return evaluator._model, evaluator.tensor_names, evaluator.frozen_names, evaluator._cache


def test_importance_variants_differ_and_random_needs_no_gradients(setup):
    evaluator, names, stats, weights, batch = setup
    scores = {}
    for variant in IMPORTANCE_VARIANTS:
        other = ImportanceEvaluator(
            *evaluator_args(evaluator), weight_decay=WEIGHT_DECAY, input_names=["input"],
            variant=variant,
        )  # fmt: skip
        scores[variant] = other.evaluate(weights, [batch], LR, seed=7).importance
        assert scores[variant].shape == (len(names),)
    # at the first period (no moments, step 0) the optimizer's next step is its first step
    np.testing.assert_allclose(scores["adam"], scores["first-step"], rtol=1e-3, atol=1e-12)
    assert not np.allclose(scores["grad-sq"], scores["first-step"], rtol=0.1)
    random = scores["random"]
    assert random.min() > 0 and random.max() <= 1
    # the draw is the seed's: another seed, another draw; no session was opened for it
    other = ImportanceEvaluator(
        *evaluator_args(evaluator), input_names=["input"], variant="random"
    )  # fmt: skip
    np.testing.assert_array_equal(other.evaluate(weights, [], LR, seed=7).importance, random)
    assert not np.allclose(other.evaluate(weights, [], LR, seed=8).importance, random)
    assert other._session is None
    with pytest.raises(ConfigError, match="unknown importance 'sgd': choose one of adam"):
        ImportanceEvaluator(*evaluator_args(evaluator), variant="sgd")


def test_importance_leaves_training_state_untouched_and_repeats(setup):
    evaluator, names, stats, weights, batch = setup
    before = {k: v.copy() for k, v in weights.items()}
    first = evaluator.evaluate(weights, [batch], LR).importance
    second = evaluator.evaluate(weights, [batch], LR).importance
    for k in weights:
        np.testing.assert_array_equal(weights[k], before[k])
    # fresh optimizer state each time: the same weights give the same importance
    np.testing.assert_allclose(first, second, rtol=1e-6)
    # different weights give a different importance (the evaluator reads what it is given)
    shifted = dict(weights)
    head = names[-2]
    shifted[head] = weights[head] * 0.5
    third = evaluator.evaluate(shifted, [batch], LR).importance
    assert not np.allclose(first, third)


def test_importance_rejects_missing_weights_and_empty_probe(setup):
    evaluator, names, _, weights, batch = setup
    partial = {k: v for k, v in weights.items() if k != names[0]}
    with pytest.raises(ConfigError, match=f"no current value for tensor '{names[0]}'"):
        evaluator.evaluate(partial, [batch], LR)
    with pytest.raises(ConfigError, match="at least one probe batch"):
        evaluator.evaluate(weights, [], LR)
    with pytest.raises(ConfigError, match="learning rate must be positive"):
        evaluator.evaluate(weights, [batch], 0.0)


def test_probe_importance_of_a_loaded_model(loaded, cache, setup):
    """compile's entry point: the loaded model's initial weights on probe batches seed, seed+1.
    Same artifacts (cache hit), so exactly the evaluator's numbers on the same batches."""
    evaluator = setup[0]
    shape = loaded.input_shapes()["input"]
    got = probe_importance(
        loaded,
        None,
        batch_size=4,
        input_shapes={"input": shape},
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        probe_batches=2,
        seed=5,
        cache_dir=cache.root,
    )
    dataset = load_dataset(None, input_shape=shape)
    batches = [dataset.probe_batch(4, 5), dataset.probe_batch(4, 6)]
    expected = evaluator.evaluate(loaded.initial_weights(), batches, LR).importance
    assert got.shape == (len(loaded.names),) and got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_gradient_chunks_fit_the_budget_and_cover_what_can_be_trained():
    """Chunks are runs from the output back, each the longest that fits; a tensor that does not
    fit alone is in none (no selection under the budget can train it)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 30))
        t = rng.uniform(0, 10, n)
        earliest = rng.uniform(0, 40, n)
        budget = float(rng.uniform(10, 80))

        def peak(mask, t=t, earliest=earliest):
            return 5.0 + t[mask].sum() + earliest[int(np.argmax(mask))]

        chunks = gradient_chunks(peak, n, budget)
        covered = [k for c in chunks for k in c]
        alone = [k for k in range(n) if peak(np.arange(n) == k) <= budget]
        assert sorted(covered) == alone and len(set(covered)) == len(covered)
        for c in chunks:
            mask = np.isin(np.arange(n), c)
            assert peak(mask) <= budget and c == list(range(c[0], c[-1] + 1))
            if c[0] > 0 and (c[0] - 1) in alone:  # maximal: the tensor before does not fit in
                assert peak(mask | (np.arange(n) == c[0] - 1)) > budget
    assert gradient_chunks(lambda m: float(m.sum()), 5, 2.0) == [[3, 4], [1, 2], [0]]


@pytest.mark.slow
def test_chunked_importance_from_a_checkpoint_equals_the_all_trainable_one(
    loaded, cache, setup, tmp_path
):
    """Under a memory budget: weights read from a checkpoint file, one gradient session per
    chunk, from a model whose weights are placeholders; the same importance as one
    all-trainable session (gradients do not depend on what else is trainable)."""
    from etgraph.artifact_weights import placeholder_weights
    from etgraph.checkpoint import CarriedState, write_checkpoint

    evaluator, names, stats, weights, batch = setup
    expected = evaluator.evaluate(weights, [batch], LR)
    ckpt = tmp_path / "state.ckpt"
    write_checkpoint(ckpt, CarriedState(weights), names[:2])
    chunks = [[len(names) - 1], list(range(3, len(names) - 1)), [0, 1]]  # tensor 2 in none
    chunked = ImportanceEvaluator(
        placeholder_weights(loaded.proto, names + stats),
        names,
        stats,
        cache,
        weight_decay=WEIGHT_DECAY,
        input_names=["input"],
        chunks=chunks,
    )
    result = chunked.evaluate_checkpoint(ckpt, [batch], LR, tmp_path / "scratch")
    keep = np.arange(len(names)) != 2
    np.testing.assert_allclose(result.importance[keep], expected.importance[keep], rtol=1e-4)
    assert result.importance[2] == 0.0 and result.loss == pytest.approx(expected.loss)
    assert not list((tmp_path / "scratch").iterdir())  # the chunks' checkpoints are removed
    with pytest.raises(ConfigError, match="has no all-trainable session"):
        chunked.session()
