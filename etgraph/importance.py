"""First-order tensor importance (paper §3.1 Eq. 2 and §4).

The importance of tensor ``k`` is the first-order Taylor estimate of how much one update of its
weights reduces the training loss::

    I_k = -sum_i g_i * delta_w_i        (g = dL/dw at the current weights, i over tensor k)

``L(w + delta_w) ~= L(w) + sum_i g_i delta_w_i`` (paper Eq. 5), so ``I_k`` is the loss drop
attributed to tensor ``k``; the terms are additive over tensors, which is what lets the DP of
Eq. (3) sum importances of a selection. (The paper writes Eq. 2 without the minus sign and takes
its negative when selecting; here the sign is folded in so that larger = more useful.)

**Which update defines delta_w** (``variant``, :data:`IMPORTANCE_VARIANTS`; the run's
``TrainConfig.importance``). The runtime trains with ORT's AdamW (onnxruntime-training 1.19.2
runs only AdamW and momentum-less SGD; Hugging Face mode, ``adam_mode=1``): at step ``t`` (the
run's global step count + 1; ORT keeps one optimizer group) with the probe gradient ``g``::

    m' = b1 m + (1 - b1) g,   v' = b2 v + (1 - b2) g^2
    w1 = w - lr * sqrt(1 - b2^t) / (1 - b1^t) * m' / (sqrt(v') + eps),   w2 = w1 - lr * wd * w1

* ``"adam"`` (default) — delta_w = ``w2 - w``, the step the run's optimizer takes next
  (:func:`adamw_step`): a tensor that trained in the last period with the moments ``m, v`` the
  run carries (:class:`etgraph.checkpoint.CarriedState`); a tensor that did not with zero
  moments at the run's step count — exactly what the loop starts a newly selected tensor
  from. At the first period (no moments, ``t = 1``) this is ``"first-step"``. A tensor whose
  momentum disagrees with the probe gradient scores low or negative; one whose gradient is
  noisy scores by its signal-to-noise ratio (``|m| / sqrt(v)``), not by its size alone. It
  predicts each tensor's one-step loss drop on the probe batch within 1% (median) and ranks
  the tensors by their drop on another batch best of the variants (issue 30's
  ``benchmarks/importance_proxy.py``, docs/results.md "Quality ablation").
* ``"first-step"`` — AdamW's first step from zero moments at ``t = 1`` for every
  tensor (the rule before issue 30), ``delta_w = -lr * (g / (|g| + eps_eff) + weight_decay *
  w)`` with ``eps_eff = eps / sqrt(1 - b2)`` ~= 3.2e-5, hence ``I_k ~= lr * ||g_k||_1``: every
  weight moves by ``lr`` whatever the run has learned about its gradient, so the score grows
  with the tensor's size. It over-scores the tensors that trained more than the others (4.9x
  vs 2.0x their one-step loss drop on MobileNetV2).
* ``"grad-sq"`` — an SGD step, ``delta_w = -lr * (g + weight_decay * w)``, ``I_k ~= lr *
  ||g_k||^2`` (the loss drop of an optimizer the run does not train with; a baseline).
* ``"random"`` — ``I_k`` uniform in (0, 1], drawn from the period's probe seed, no gradients
  computed: the DP then picks a random selection within the budget (an ablation baseline).

All variants use the run's base learning rate (it scales every ``I_k`` alike, so it does not
change the selection; the base rate keeps delta_w far above float32 rounding late in the
cosine schedule).

**Cost.** The gradients come from a real ORT backward pass of all tensors; ``delta_w`` is the
closed form above (:func:`adamw_step`, checked against real ORT optimizer steps in the tests),
so no optimizer session is needed. The Module is built
once and kept: an evaluation costs about one full training step (a re-selection per period
must stay under 2% of the period, issue #6).

**Without disturbing training.** The evaluation uses its own artifacts (all tensors trainable,
cached once) and its own :class:`etgraph.sessions.GradientSession` (a Module without optimizer);
every evaluation first overwrites all its weights and BatchNorm running statistics with the
given ones, so the training session's weights, moments and statistics are never touched and one
evaluation cannot leak into the next.

**Under a memory budget** (``etgraph train --memory-mb``, issue #17) one all-trainable session
does not fit: its gradient buffers and the workspace of a backward pass to the input are full
training's. The evaluator then takes ``chunks`` (:func:`gradient_chunks`): runs of tensors,
from the output back, each the largest whose training session the memory model predicts within
the budget (a gradient-only session holds less: no moments, no optimizer or eval session, so
the prediction is an upper bound). Each evaluation reads the weights from the run's checkpoint
file, writes one checkpoint per chunk, and opens, uses and releases one chunk's session at a
time; nothing else large is held meanwhile. A tensor whose training alone exceeds the budget is
in no chunk: no selection can train it, and its importance is 0. The gradient of a tensor does
not depend on which others are trainable (every batch norm runs in training mode in every
chunk, as in the all-trainable session), so the importances are the all-trainable session's;
the cost is one forward and one backward pass per chunk instead of one in all.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from .arrays import ArrayDataset
from .artifacts import ArtifactCache, ArtifactPaths
from .checkpoint import read_checkpoint, write_checkpoint
from .data import Dataset, load_task_data
from .errors import ConfigError
from .files import private_temp_dir
from .host import peak_rss_mb, release_native_memory, rss_mb
from .images import Preprocess
from .model import LoadedModel
from .ort_options import OrtConfig
from .selection import IMPORTANCE_VARIANTS
from .sessions import GradientSession, as_inputs, padded_batch

log = logging.getLogger(__name__)

__all__ = [
    "IMPORTANCE_VARIANTS",
    "adamw_first_step",
    "adamw_step",
    "gradient_chunks",
    "tensor_importance",
    "ImportanceResult",
    "ImportanceEvaluator",
    "SCRATCH_MB",
    "probe_importance",
]


def tensor_importance(gradients: Sequence[np.ndarray], deltas: Sequence[np.ndarray]) -> np.ndarray:
    """First-order importance of each tensor, ``I_k = -sum_i g_i * delta_w_i`` (paper Eq. 2, §4).

    Args:
        gradients: per tensor ``k`` (forward order), ``dL/dw`` at the weights before the update,
            float array of the tensor's shape.
        deltas: per tensor ``k``, the weight update ``w_after - w_before``, same shapes.

    Returns:
        float64 [N]: importance per tensor (loss reduction, in loss units; larger = more useful).
        Additive: the importance of a selection is the sum over its tensors.

    Raises:
        ConfigError: the two sequences differ in length, or a pair differs in shape.
    """
    if len(gradients) != len(deltas):
        raise ConfigError(
            f"{len(gradients)} gradients but {len(deltas)} weight updates: pass one per tensor"
        )
    out = np.empty(len(gradients), dtype=np.float64)
    for k, (g, d) in enumerate(zip(gradients, deltas, strict=True)):
        g = np.asarray(g, dtype=np.float64)
        d = np.asarray(d, dtype=np.float64)
        if g.shape != d.shape:
            raise ConfigError(
                f"tensor {k}: gradient shape {g.shape} differs from update shape {d.shape}"
            )
        out[k] = -float(np.sum(g * d))
    return out


#: onnxblock.optim.AdamW defaults, as etgraph.artifacts generates the optimizer.
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-6


def adamw_first_step(
    gradient: np.ndarray,
    weight: np.ndarray,
    learning_rate: float,
    weight_decay: float,
    *,
    betas: tuple[float, float] = ADAMW_BETAS,
    eps: float = ADAMW_EPS,
) -> np.ndarray:
    """The update ORT's AdamW (onnxblock, Hugging Face mode) makes at step 1 from zero moments.

    With ``m = (1 - b1) g``, ``v = (1 - b2) g^2`` and eps added to ``sqrt(v)`` before bias
    correction: ``delta_w = -lr * (g / (|g| + eps / sqrt(1 - b2)) + weight_decay * w)``.

    Args:
        gradient, weight: float arrays of one shape (dL/dw and w before the update).
        learning_rate: > 0. weight_decay: decoupled weight decay, >= 0.

    Returns:
        float64 array of the same shape, ``w_after - w_before``.
    """
    g = np.asarray(gradient, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    eps_eff = eps / np.sqrt(1.0 - betas[1])
    return -learning_rate * (g / (np.abs(g) + eps_eff) + weight_decay * w)


def adamw_step(
    gradient: np.ndarray,
    weight: np.ndarray,
    learning_rate: float,
    weight_decay: float,
    *,
    moments: Mapping[str, np.ndarray] | None = None,
    step: int = 0,
    betas: tuple[float, float] = ADAMW_BETAS,
    eps: float = ADAMW_EPS,
) -> np.ndarray:
    """The update ORT's AdamW (onnxblock, Hugging Face mode) makes next, at step ``step + 1``.

    ``m' = b1 m + (1 - b1) g``, ``v' = b2 v + (1 - b2) g^2``, ``w1 = w - lr * sqrt(1 - b2^t) /
    (1 - b1^t) * m' / (sqrt(v') + eps)``, ``w2 = w1 - lr * weight_decay * w1`` with ``t = step
    + 1`` (ORT's ``AdamWOptimizer`` kernel, ``adam_mode=1``).

    Args:
        gradient, weight: float arrays of one shape (dL/dw and w before the update).
        learning_rate: > 0. weight_decay: decoupled weight decay, >= 0.
        moments: ``{"momentum0": m, "momentum1": v}`` (the tensor's shape), as ORT stores them
            (:class:`etgraph.checkpoint.CarriedState`); None = zero moments.
        step: AdamW steps taken so far (the optimizer group's step count), >= 0.

    Returns:
        float64 array of the same shape, ``w2 - w``. With no moments at ``step`` 0 this is
        :func:`adamw_first_step` (up to its ``lr^2 * weight_decay`` term).
    """
    g = np.asarray(gradient, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    b1, b2 = betas
    m = v = 0.0
    if moments is not None:
        m = np.asarray(moments["momentum0"], dtype=np.float64)
        v = np.asarray(moments["momentum1"], dtype=np.float64)
    m1 = b1 * m + (1.0 - b1) * g
    v1 = b2 * v + (1.0 - b2) * g * g
    t = step + 1
    lr_corrected = learning_rate * np.sqrt(1.0 - b2**t) / (1.0 - b1**t)
    w1 = w - lr_corrected * m1 / (np.sqrt(v1) + eps)
    return w1 - learning_rate * weight_decay * w1 - w


def check_importance_variant(variant: str) -> str:
    """``variant`` if it is one of :data:`IMPORTANCE_VARIANTS`.

    Raises:
        ConfigError: another name (the message lists the variants).
    """
    if variant not in IMPORTANCE_VARIANTS:
        raise ConfigError(
            f"unknown importance {variant!r}: choose one of {', '.join(IMPORTANCE_VARIANTS)}"
        )
    return variant


#: Elements per chunk in :func:`_tensor_importance` (4 MB float32 scratch buffers).
_CHUNK = 1 << 20

#: MiB an :class:`ImportanceEvaluator` holds for its life (three scratch buffers).
SCRATCH_MB = 3 * _CHUNK * 4 / float(1 << 20)


def _tensor_importance(
    variant: str,
    gradient: np.ndarray,
    weight: np.ndarray,
    learning_rate: float,
    weight_decay: float,
    batches: int,
    scratch: np.ndarray,
    moments: Mapping[str, np.ndarray] | None = None,
    step: int = 0,
) -> float:
    """``tensor_importance`` of one tensor under ``variant``'s delta_w (``"adam"``:
    :func:`adamw_step`, ``"first-step"``: :func:`adamw_first_step`, ``"grad-sq"``: an SGD step),
    without materialising the update.

    ``g`` is the accumulated gradient divided by ``batches``. Computed chunk-wise in float32
    with float64 accumulation in three preallocated buffers (``scratch``: float32 [3, _CHUNK]):
    whole-tensor float64 temporaries cost ~0.5 s per evaluation on ResNet50 once freed memory
    has been returned to the OS (page faults on every new array), ten times the arithmetic.
    """
    g = np.asarray(gradient, dtype=np.float32).reshape(-1)
    w = np.asarray(weight, dtype=np.float32).reshape(-1)
    m = v = None
    if variant == "adam" and moments is not None:
        m = np.asarray(moments["momentum0"], dtype=np.float32).reshape(-1)
        v = np.asarray(moments["momentum1"], dtype=np.float32).reshape(-1)
    b1, b2 = ADAMW_BETAS
    t_next = step + 1
    # -sum(g * delta_w) = lr * sum(g * (scale * direction + wd * w)), per variant
    scale = np.sqrt(1.0 - b2**t_next) / (1.0 - b1**t_next) * (1.0 - learning_rate * weight_decay)
    eps_eff = ADAMW_EPS / np.sqrt(1.0 - b2)
    total = 0.0
    for start in range(0, g.size, _CHUNK):
        gs, ws = g[start : start + _CHUNK], w[start : start + _CHUNK]
        n = gs.size
        gm, t, u = scratch[0, :n], scratch[1, :n], scratch[2, :n]
        np.multiply(gs, 1.0 / batches, out=gm)  # mean gradient over the probe batches
        if variant == "grad-sq":
            t[...] = gm
        elif variant == "first-step":
            np.abs(gm, out=t)
            t += eps_eff
            np.divide(gm, t, out=t)  # g / (|g| + eps_eff)
        else:  # adam: m' / (sqrt(v') + eps), scaled
            if v is None:
                u.fill(0.0)
            else:
                np.multiply(v[start : start + n], b2, out=u)
            np.multiply(gm, gm, out=t)
            t *= 1.0 - b2
            u += t  # v'
            np.sqrt(u, out=u)
            u += ADAMW_EPS
            np.multiply(gm, (1.0 - b1) / b1, out=t)
            if m is not None:
                t += m[start : start + n]
            t *= b1  # m'
            t /= u
            t *= scale
        np.multiply(ws, weight_decay, out=u)
        t += u
        t *= gm
        total += float(t.sum(dtype=np.float64))
    return float(learning_rate) * total


def gradient_chunks(
    peak_mb: Callable[[np.ndarray], float], n: int, budget_mb: float
) -> list[list[int]]:
    """Runs of tensors whose gradients are computed together under a memory budget.

    From the last tensor back, each chunk is extended by the tensor before it while
    ``peak_mb(chunk)`` stays within ``budget_mb``; a tensor that does not fit alone is left out
    (no selection under the budget can train it).

    Args:
        peak_mb: predicted peak (MiB) of training a selection (bool [n] mask -> MiB), e.g.
            :meth:`etgraph.selection.MemoryCosts.peak_mb`.
        n: number of tensors. budget_mb: the budget, MiB.

    Returns:
        Chunks of tensor indices, each ascending; together the tensors that fit alone, each
        once. The first chunk holds the last tensors.
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    mask = np.zeros(n, dtype=bool)
    for k in reversed(range(n)):
        mask[k] = True
        if peak_mb(mask) <= budget_mb:
            current.insert(0, k)
            continue
        mask[:] = False
        if current:
            chunks.append(current)
        mask[k] = True
        if peak_mb(mask) <= budget_mb:
            current = [k]
        else:
            current, mask[k] = [], False
    if current:
        chunks.append(current)
    return chunks


@dataclass(frozen=True)
class ImportanceResult:
    """One importance evaluation.

    Attributes:
        importance: float64 [N], forward order (see :func:`tensor_importance`).
        loss: mean training loss over the probe batches at the current weights.
        cost_s: wall time of the whole evaluation (session creation, steps, read-back), seconds.
        session_s: part of ``cost_s`` spent opening the gradient session (first evaluation
            only) and writing the weights into it.
    """

    importance: np.ndarray
    loss: float
    cost_s: float
    session_s: float


class ImportanceEvaluator:
    """Evaluates tensor importance from one update of all tensors on probe batches (§4).

    Args:
        model: the forward ONNX model (legalised for training; :attr:`LoadedModel.proto`).
        tensor_names: trainable tensor names in forward order (:attr:`LoadedModel.names`).
        frozen_names: other parameters to carry (BatchNorm running statistics,
            :attr:`LoadedModel.running_stats`).
        cache: artifact cache; the all-trainable artifacts are generated once and reused.
        weight_decay: AdamW weight decay, the run's value (it enters delta_w).
        threads: ORT intra-op threads (None = ORT's default), the run's setting.
        loss: the loss (``"ce"`` or ``"mse"``; :attr:`etgraph.model.Task.loss`).
        input_names: the model's input names, graph order (to feed single-array batches).
        chunks: None: one all-trainable session, kept between evaluations. Else runs of
            tensor indices (:func:`gradient_chunks`) evaluated one session at a time, from a
            checkpoint file (:meth:`evaluate_checkpoint`; module docstring); ``model`` may then
            hold placeholders for its weights (:func:`etgraph.artifacts.placeholder_weights`).
        config: its session's options (the run's training options, so the reference steps
            timed on it are measured alike); default the "probe" role's.
        variant: which update defines delta_w, one of :data:`IMPORTANCE_VARIANTS` (module
            docstring).

    Raises:
        ModelError: onnxruntime-training cannot build the all-trainable training graph.
        ConfigError: an unknown ``variant``.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        tensor_names: Sequence[str],
        frozen_names: Sequence[str],
        cache: ArtifactCache,
        *,
        weight_decay: float = 0.01,
        threads: int | None = None,
        loss: str = "ce",
        input_names: Sequence[str] = (),
        chunks: Sequence[Sequence[int]] | None = None,
        config: OrtConfig | None = None,
        variant: str = "adam",
    ):
        self.variant = check_importance_variant(variant)
        self.threads = threads
        self.config = config
        self.input_names = list(input_names)
        self.tensor_names = list(tensor_names)
        self.frozen_names = list(frozen_names)
        self.weight_decay = float(weight_decay)
        self.chunks = None if chunks is None else [list(c) for c in chunks]
        self._model, self._cache, self._loss = model, cache, loss
        self._session: GradientSession | None = None  # opened at the first evaluation
        self._scratch = np.empty((3, _CHUNK), dtype=np.float32)  # see _tensor_importance
        t0 = time.perf_counter()
        self.paths: ArtifactPaths | None = None
        if self.chunks is None:
            self.paths, hit = cache.get(
                model, self.tensor_names, self.frozen_names, weight_decay=weight_decay, loss=loss
            )
            log.debug("importance artifacts %s (cache hit: %s)", self.paths.directory, hit)
        self.setup_s = time.perf_counter() - t0

    def session(self) -> GradientSession:
        """The evaluator's all-trainable session, opened at the first use. The training loop
        also times its full reference steps on it (:meth:`GradientSession.train_step` at
        learning rate 0), so one all-trainable session serves both.

        Raises:
            ConfigError: a chunked evaluator has no all-trainable session.
        """
        if self.paths is None:
            raise ConfigError("a chunked importance evaluator has no all-trainable session")
        if self._session is None:
            self._session = GradientSession(
                self.paths.directory, self.threads, input_names=self.input_names, config=self.config
            )
        return self._session

    def adopt(self, session: GradientSession) -> None:
        """Use ``session`` (already open on this evaluator's artifacts, e.g. the winner of
        :func:`etgraph.sessions.choose_train_config`) instead of opening one.

        Raises:
            ValueError: ``session`` is open on other artifacts.
        """
        if Path(session.directory) != Path(self.paths.directory):
            raise ValueError(
                f"session on {session.directory}, the evaluator's artifacts are "
                f"{self.paths.directory}"
            )
        self._session = session

    def close(self) -> None:
        """Release the ORT session (the next evaluation opens it again)."""
        self._session = None

    def evaluate(
        self,
        weights: Mapping[str, np.ndarray],
        batches: Iterable[tuple],
        learning_rate: float,
        *,
        moments: Mapping[str, Mapping[str, np.ndarray]] | None = None,
        step: int = 0,
        seed: int = 0,
    ) -> ImportanceResult:
        """Importance at ``weights`` from one update of all tensors on ``batches``.

        Gradients of all batches are accumulated (ORT accumulates until ``lazy_reset_grad``)
        and averaged; ``delta_w`` is the evaluator's ``variant`` (module docstring). Nothing
        outside this evaluator's own ORT session changes.

        Args:
            weights: name -> array for every tensor in ``tensor_names`` and ``frozen_names``
                (the current training weights, including BatchNorm running statistics).
            batches: probe batches ``(x, y)``: ``x`` the inputs by name (or one array for a
                single-input model), ``y`` the targets; at least one.
            learning_rate: the run's learning rate (> 0); scales all ``I_k`` equally.
            moments: ``"adam"``: name -> ``{"momentum0", "momentum1"}`` of the tensors that
                trained (:attr:`etgraph.checkpoint.CarriedState.moments`); others start from
                zero moments. step: the run's AdamW step count (``CarriedState.step``).
            seed: ``"random"``: the draw's seed (e.g. the period's probe seed).

        Returns:
            An :class:`ImportanceResult` (``"random"``: loss NaN, no session opened).

        Raises:
            ConfigError: no batch, a missing weight, or a non-positive learning rate.
        """
        if not learning_rate > 0:
            raise ConfigError(f"learning rate must be positive, got {learning_rate}")
        if self.variant == "random":
            return self._random(seed)
        moments = moments or {}
        missing = [n for n in self.tensor_names + self.frozen_names if n not in weights]
        if missing:
            raise ConfigError(f"no current value for tensor {missing[0]!r}")
        t0 = time.perf_counter()
        session = self.session()
        session.set_parameters(weights, self.tensor_names + self.frozen_names)
        session_s = time.perf_counter() - t0

        losses = session.accumulate(batches)
        if not losses:
            raise ConfigError("importance needs at least one probe batch")
        importance = np.array(
            [
                _tensor_importance(
                    self.variant,
                    session.gradient(name),  # a zero-copy view of the accumulated gradient
                    weights[name],
                    learning_rate,
                    self.weight_decay,
                    len(losses),
                    self._scratch,
                    moments.get(name),
                    step,
                )
                for name in self.tensor_names
            ],
            dtype=np.float64,
        )
        cost_s = time.perf_counter() - t0
        return ImportanceResult(importance, float(np.mean(losses)), cost_s, session_s)

    def _random(self, seed: int) -> ImportanceResult:
        """The ``"random"`` variant: uniform in (0, 1] per tensor, no gradients."""
        t0 = time.perf_counter()
        importance = 1.0 - np.random.default_rng(seed).random(len(self.tensor_names))
        return ImportanceResult(importance, float("nan"), time.perf_counter() - t0, 0.0)

    def evaluate_checkpoint(
        self,
        checkpoint: str | os.PathLike,
        batches: Sequence[tuple],
        learning_rate: float,
        scratch_dir: str | os.PathLike,
        *,
        seed: int = 0,
    ) -> ImportanceResult:
        """Importance at the weights of ``checkpoint`` (an ORT checkpoint holding every tensor
        and running statistic, e.g. the run's), as :meth:`evaluate` with the checkpoint's
        moments and step.

        Without chunks: the weights are read and :meth:`evaluate` runs. With chunks (module
        docstring): one checkpoint per chunk is written to ``scratch_dir`` from a view of the
        file (memory: the file and one chunk's file at a time), the views are dropped, then
        each chunk's gradient session is opened, run on ``batches``, read and released before
        the next; the chunk files are deleted. Tensors in no chunk get importance 0.

        Raises:
            ConfigError: no batch, a non-positive learning rate, or a tensor missing from the
                checkpoint. CheckpointError: the checkpoint cannot be read.
        """
        adam = self.variant == "adam"
        if self.chunks is None or self.variant == "random":
            state, _, _ = read_checkpoint(checkpoint, moments=adam)
            return self.evaluate(
                state.weights,
                batches,
                learning_rate,
                moments=state.moments,
                step=state.step,
                seed=seed,
            )
        if not learning_rate > 0:
            raise ConfigError(f"learning rate must be positive, got {learning_rate}")
        if not batches:
            raise ConfigError("importance needs at least one probe batch")
        t0 = time.perf_counter()
        scratch = Path(scratch_dir)
        scratch.mkdir(parents=True, exist_ok=True)
        state, _, _ = read_checkpoint(checkpoint, copy=False, moments=False)
        step = state.step
        missing = [n for n in self.tensor_names + self.frozen_names if n not in state.weights]
        if missing:
            raise ConfigError(f"no current value for tensor {missing[0]!r}")
        files = []
        for j, chunk in enumerate(self.chunks):
            files.append(scratch / f"importance-{j}.ckpt")
            names = [self.tensor_names[k] for k in chunk]
            write_checkpoint(files[-1], state, names, optimizer_state=False)
        del state  # the file's buffer: no weights are held while a session is open
        gc.collect()
        release_native_memory()
        log.debug(
            "importance chunk checkpoints written: RSS %.0f MiB, peak %.0f MiB",
            rss_mb(),
            peak_rss_mb(),
        )
        session_s = time.perf_counter() - t0
        importance = np.zeros(len(self.tensor_names), dtype=np.float64)
        losses: list[float] = []
        try:
            for chunk, path in zip(self.chunks, files, strict=True):
                names = [self.tensor_names[k] for k in chunk]
                chosen = set(names)
                frozen = [n for n in self.tensor_names if n not in chosen] + self.frozen_names
                ts = time.perf_counter()
                paths, _ = self._cache.get(
                    self._model,
                    names,
                    frozen,
                    weight_decay=self.weight_decay,
                    loss=self._loss,
                    checkpoint=False,
                )
                session = GradientSession(
                    paths.directory,
                    self.threads,
                    input_names=self.input_names,
                    checkpoint=path,
                    config=self.config,
                )
                session_s += time.perf_counter() - ts
                chunk_losses = session.accumulate(batches)
                log.debug(
                    "importance chunk of %d tensors from %d: RSS %.0f MiB, peak %.0f MiB",
                    len(chunk),
                    chunk[0],
                    rss_mb(),
                    peak_rss_mb(),
                )
                losses = losses or chunk_losses  # every chunk computes the same forward pass
                params = session.state.parameters
                # the moments as views of the mapped file: only this chunk's pages are read
                moments = read_checkpoint(checkpoint, copy=False)[0].moments if adam else {}
                for k, name in zip(chunk, names, strict=True):
                    importance[k] = _tensor_importance(
                        self.variant,
                        session.gradient(name),
                        params[name].data,
                        learning_rate,
                        self.weight_decay,
                        len(chunk_losses),
                        self._scratch,
                        moments.get(name),
                        step,
                    )
                del session, params, moments
                gc.collect()
                release_native_memory()
                log.debug("importance chunk released: RSS %.0f MiB", rss_mb())
                path.unlink()
        finally:
            for path in files:
                path.unlink(missing_ok=True)
        cost_s = time.perf_counter() - t0
        # no chunk fits the budget: nothing evaluated (the selection then names the budget)
        loss = float(np.mean(losses)) if losses else float("nan")
        return ImportanceResult(importance, loss, cost_s, session_s)


def probe_importance(
    model: LoadedModel,
    data: str | None,
    *,
    batch_size: int,
    input_shapes: Mapping[str, Sequence[int]],
    tokenizer: str | None = None,
    learning_rate: float = 1e-4,
    weight_decay: float = 0.01,
    probe_batches: int = 1,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    preprocess: Preprocess | None = None,
    dataset: Dataset | ArrayDataset | None = None,
) -> np.ndarray:
    """Importance of every trainable tensor of ``model`` at its initial weights (paper Eq. 2).

    Convenience for ``etgraph compile``: loads ``data`` (``None`` = embedded default), takes
    ``probe_batches`` probe batches of ``batch_size``, and runs :class:`ImportanceEvaluator` at
    :meth:`LoadedModel.initial_weights`.

    Args:
        model: the loaded model (:class:`etgraph.model.LoadedModel`).
        data: dataset spec (see :func:`etgraph.data.load_task_data`: digits, an image folder
            a ``.npz`` file, or a .csv/.jsonl text file).
        batch_size: probe batch size (> 0).
        input_shapes: per-sample shape of every input (:meth:`LoadedModel.input_shapes`).
        tokenizer: the model's ``tokenizer.json`` for text ``data``.
        learning_rate, weight_decay: of the AdamW step that defines delta_w.
        probe_batches: number of probe batches whose gradients are averaged.
        seed: probe-batch seed (batch ``i`` uses ``seed + i``).
        cache_dir: artifact cache root (default: a temporary directory, removed afterwards).
        preprocess: the model's input normalisation for image folders (None: ImageNet).
        dataset: ``data`` already loaded (:func:`etgraph.data.load_task_data`, e.g. before
            profiling, so a data error comes first); ``data`` and ``tokenizer`` then unused.

    Returns:
        float64 [N], forward order (``model.names``).

    Raises:
        DataError: the dataset cannot be loaded, or its labels exceed the model's classes.
        ModelError: the training graph cannot be built.
    """
    # labels >= the model's outputs must never reach ORT's loss: DataError names the folders
    if dataset is None:
        dataset = load_task_data(
            data,
            inputs=model.inputs,
            shapes=input_shapes,
            task=model.task,
            tokenizer=tokenizer,
            preprocess=preprocess,
        )
    batches = []
    for i in range(probe_batches):  # a dataset smaller than the batch: padded to the batch shape
        x, y = dataset.probe_batch(batch_size, seed + i)
        batches.append(padded_batch(as_inputs(x, model.input_names), y, batch_size))
    with private_temp_dir("importance") as tmp:
        root = Path(cache_dir) if cache_dir is not None else Path(tmp)
        # At the probe's static batch shape, as every other session: ORT's gradient builder
        # takes two different symbolic dims to be equal, so a broadcast it cannot see (a
        # DistilBERT's [1, T] position ids against [B, T] tokens) is not summed, and the
        # gradient kernels write past their buffers (a crash, or heap corruption).
        evaluator = ImportanceEvaluator(
            model.proto,
            model.names,
            model.running_stats,
            ArtifactCache(root, static_batch=(batch_size, input_shapes)),
            weight_decay=weight_decay,
            loss=model.task.loss,
            input_names=model.input_names,
        )
        return evaluator.evaluate(model.initial_weights(), batches, learning_rate).importance
