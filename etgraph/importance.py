"""Tensor importance evaluated in ORT sessions (paper §3.1 Eq. 2 and §4).

The importance of tensor ``k`` is the first-order estimate of the loss drop of one update of its
weights, ``I_k = -sum_i g_i * delta_w_i``; the formula and the update each ``variant`` takes
for ``delta_w`` (AdamW's next step with the run's moments by default) are
:mod:`etgraph.importance_rules`. This module computes the gradients ``g`` of all tensors on
probe batches in an ORT session of its own and scores every tensor
(:class:`ImportanceEvaluator`; :func:`probe_importance` for ``etgraph compile``).

**Cost.** The gradients come from a real ORT backward pass of all tensors; ``delta_w`` is the
closed form (:func:`etgraph.importance_rules.adamw_step`, checked against real ORT optimizer
steps in the tests),
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
from .importance_rules import SCRATCH_CHUNK, check_importance_variant, variant_importance
from .model import LoadedModel
from .ort_options import OrtConfig
from .sessions import GradientSession, as_inputs, padded_batch

log = logging.getLogger(__name__)

#: MiB an :class:`ImportanceEvaluator` holds for its life (three float32 scratch buffers of
#: :data:`etgraph.importance_rules.SCRATCH_CHUNK` elements, :func:`variant_importance`'s).
SCRATCH_MB = 3 * SCRATCH_CHUNK * 4 / float(1 << 20)

__all__ = [
    "gradient_chunks",
    "ImportanceResult",
    "ImportanceEvaluator",
    "SCRATCH_MB",
    "probe_importance",
]


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
        loss: the loss (``"ce"`` or ``"mse"``; :attr:`etgraph.io_specs.Task.loss`).
        input_names: the model's input names, graph order (to feed single-array batches).
        chunks: None: one all-trainable session, kept between evaluations. Else runs of
            tensor indices (:func:`gradient_chunks`) evaluated one session at a time, from a
            checkpoint file (:meth:`evaluate_checkpoint`; module docstring); ``model`` may then
            hold placeholders for its weights
            (:func:`etgraph.artifact_weights.placeholder_weights`).
        config: its session's options (the run's training options, so the reference steps
            timed on it are measured alike); default the "probe" role's.
        variant: which update defines delta_w, one of :data:`IMPORTANCE_VARIANTS`
            (:mod:`etgraph.importance_rules`).

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
        self._scratch = np.empty((3, SCRATCH_CHUNK), dtype=np.float32)  # see variant_importance
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
        :func:`etgraph.config_choice.choose_train_config`) instead of opening one.

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
        and averaged; ``delta_w`` is the evaluator's ``variant``
        (:mod:`etgraph.importance_rules`). Nothing outside this evaluator's own ORT session
        changes.

        Args:
            weights: name -> array for every tensor in ``tensor_names`` and ``frozen_names``
                (the current training weights, including BatchNorm running statistics).
            batches: probe batches ``(x, y)``: ``x`` the inputs by name (or one array for a
                single-input model), ``y`` the targets; at least one.
            learning_rate: the run's learning rate (> 0); scales all ``I_k`` equally.
            moments: ``"adam"``: name -> ``{"momentum0", "momentum1"}`` of the tensors that
                trained (:attr:`etgraph.checkpoint.CarriedState.moments`); others start from
                zero moments. step: the run's AdamW step count (``CarriedState.step``).
            seed: the period's probe seed: the pass's Dropout masks
                (:func:`etgraph.sessions.seed_random`), and ``"random"``'s draw.

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
        self._require_weights(weights)
        t0 = time.perf_counter()
        session = self.session()
        session.set_parameters(weights, self.tensor_names + self.frozen_names)
        session_s = time.perf_counter() - t0

        losses = session.accumulate(batches, seed=seed)
        if not losses:
            raise ConfigError("importance needs at least one probe batch")
        importance = self._score(session, weights, learning_rate, len(losses), moments, step)
        cost_s = time.perf_counter() - t0
        return ImportanceResult(importance, float(np.mean(losses)), cost_s, session_s)

    def evaluate_held(
        self,
        weights: Mapping[str, np.ndarray],
        learning_rate: float,
        *,
        moments: Mapping[str, Mapping[str, np.ndarray]] | None = None,
        step: int = 0,
    ) -> ImportanceResult:
        """Importance from the gradients the evaluator's session holds: those of the last
        full step the training loop took on it at ``weights`` (one batch; the period-end
        step, :func:`etgraph.steps.train_steps` ``carry_after``), as :meth:`evaluate` would
        compute them on that batch, without a forward or backward pass. The caller checks
        that nothing used the session since (:attr:`etgraph.sessions.GradientSession.uses`).

        Returns:
            An :class:`ImportanceResult` (loss NaN: the step's loss is the training loop's).

        Raises:
            ConfigError: a missing weight, a non-positive learning rate, or no session open.
        """
        if not learning_rate > 0:
            raise ConfigError(f"learning rate must be positive, got {learning_rate}")
        if self._session is None:
            raise ConfigError("the importance evaluator holds no gradients: no session is open")
        self._require_weights(weights)
        t0 = time.perf_counter()
        importance = self._score(self._session, weights, learning_rate, 1, moments or {}, step)
        return ImportanceResult(importance, float("nan"), time.perf_counter() - t0, 0.0)

    def _score(
        self,
        session: GradientSession,
        weights: Mapping[str, np.ndarray],
        learning_rate: float,
        batches: int,
        moments: Mapping[str, Mapping[str, np.ndarray]],
        step: int,
    ) -> np.ndarray:
        """float64 [N]: each tensor's importance from the gradients ``session`` holds, summed
        over ``batches`` batches (:func:`etgraph.importance_rules.variant_importance`)."""
        return np.array(
            [
                variant_importance(
                    self.variant,
                    session.gradient(name),  # a zero-copy view of the accumulated gradient
                    weights[name],
                    learning_rate,
                    self.weight_decay,
                    batches,
                    self._scratch,
                    moments.get(name),
                    step,
                )
                for name in self.tensor_names
            ],
            dtype=np.float64,
        )

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
        if self.chunks is None or self.variant == "random":
            state, _, _ = read_checkpoint(checkpoint, moments=self.variant == "adam")
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
        files, step = self._write_chunk_checkpoints(checkpoint, Path(scratch_dir))
        session_s = time.perf_counter() - t0
        importance = np.zeros(len(self.tensor_names), dtype=np.float64)
        losses: list[float] = []
        try:
            for chunk, path in zip(self.chunks, files, strict=True):
                chunk_losses, open_s = self._evaluate_chunk(
                    chunk, path, checkpoint, batches, learning_rate, step, importance, seed
                )
                session_s += open_s
                losses = losses or chunk_losses  # every chunk computes the same forward pass
                path.unlink()
        finally:
            for path in files:
                path.unlink(missing_ok=True)
        cost_s = time.perf_counter() - t0
        # no chunk fits the budget: nothing evaluated (the selection then names the budget)
        loss = float(np.mean(losses)) if losses else float("nan")
        return ImportanceResult(importance, loss, cost_s, session_s)

    def _write_chunk_checkpoints(
        self, checkpoint: str | os.PathLike, scratch: Path
    ) -> tuple[list[Path], int]:
        """One checkpoint per chunk in ``scratch`` (its tensors trainable, no optimizer state),
        written from a view of ``checkpoint`` that is dropped before returning (no weights are
        held while a session is open). Returns the files, one per chunk, and the AdamW step.

        Raises:
            ConfigError: a tensor missing from the checkpoint.
        """
        scratch.mkdir(parents=True, exist_ok=True)
        state, _, _ = read_checkpoint(checkpoint, copy=False, moments=False)
        step = state.step
        self._require_weights(state.weights)
        files = []
        for j, chunk in enumerate(self.chunks):
            files.append(scratch / f"importance-{j}.ckpt")
            names = [self.tensor_names[k] for k in chunk]
            write_checkpoint(files[-1], state, names, optimizer_state=False)
        del state  # the file's buffer
        gc.collect()
        release_native_memory()
        log.debug(
            "importance chunk checkpoints written: RSS %.0f MiB, peak %.0f MiB",
            rss_mb(),
            peak_rss_mb(),
        )
        return files, step

    def _open_chunk_session(self, names: Sequence[str], path: Path) -> GradientSession:
        """A gradient session training ``names`` (the rest frozen), loaded from the chunk's
        checkpoint ``path``."""
        chosen = set(names)
        frozen = [n for n in self.tensor_names if n not in chosen] + self.frozen_names
        paths, _ = self._cache.get(
            self._model,
            names,
            frozen,
            weight_decay=self.weight_decay,
            loss=self._loss,
            checkpoint=False,
        )
        return GradientSession(
            paths.directory,
            self.threads,
            input_names=self.input_names,
            checkpoint=path,
            config=self.config,
        )

    def _evaluate_chunk(
        self,
        chunk: Sequence[int],
        path: Path,
        checkpoint: str | os.PathLike,
        batches: Sequence[tuple],
        learning_rate: float,
        step: int,
        importance: np.ndarray,
        seed: int,
    ) -> tuple[list[float], float]:
        """Score the tensors of ``chunk`` into ``importance`` (float64 [N]) from a session
        opened on the chunk's checkpoint ``path``, run on ``batches`` (Dropout masks from
        ``seed``, as every chunk's) and released before returning; the moments (``"adam"``)
        are read as views of ``checkpoint``.

        Returns:
            The chunk's probe losses and the seconds spent opening its session.
        """
        names = [self.tensor_names[k] for k in chunk]
        ts = time.perf_counter()
        session = self._open_chunk_session(names, path)
        open_s = time.perf_counter() - ts
        losses = session.accumulate(batches, seed=seed)
        log.debug(
            "importance chunk of %d tensors from %d: RSS %.0f MiB, peak %.0f MiB",
            len(chunk),
            chunk[0],
            rss_mb(),
            peak_rss_mb(),
        )
        params = session.state.parameters
        # the moments as views of the mapped file: only this chunk's pages are read
        adam = self.variant == "adam"
        moments = read_checkpoint(checkpoint, copy=False)[0].moments if adam else {}
        for k, name in zip(chunk, names, strict=True):
            importance[k] = variant_importance(
                self.variant,
                session.gradient(name),
                params[name].data,
                learning_rate,
                self.weight_decay,
                len(losses),
                self._scratch,
                moments.get(name),
                step,
            )
        del session, params, moments
        gc.collect()
        release_native_memory()
        log.debug("importance chunk released: RSS %.0f MiB", rss_mb())
        return losses, open_s

    def _require_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Raises ConfigError naming the first tensor or running statistic not in ``weights``."""
        missing = [n for n in self.tensor_names + self.frozen_names if n not in weights]
        if missing:
            raise ConfigError(f"no current value for tensor {missing[0]!r}")


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
