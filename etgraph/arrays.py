"""Datasets of arrays, one per model input, for models of any inputs: ``--data FILE.npz``
(:func:`load_npz_dataset`), arrays in memory (:func:`arrays_dataset`) and text tokenized into
token arrays (``--data FILE.csv|FILE.jsonl --tokenizer``, :func:`load_text_dataset`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError
from .io_specs import InputSpec, Task
from .labels import MAX_CLASS_INDEX
from .splits import Split, check_batch_size, random_split, stratified_split
from .text import check_text_options, load_text_data

log = logging.getLogger(__name__)


@dataclass
class ArrayDataset(Split):
    """A dataset of arrays, one per model input, for any model (``--data FILE.npz``, or text
    tokenized into token arrays).

    Same interface as :class:`Dataset`; batches are ``(x, y)`` with ``x`` a dict input name ->
    array ``[B, ...]`` (the input's dtype) and ``y`` int64 ``[B]`` class indices (loss ce) or
    float32 ``[B, D]`` targets (loss mse). No augmentation. Build one with
    :func:`load_npz_dataset` or :func:`load_text_dataset`.

    Attributes:
        name: the file path.
        arrays: input name -> array ``[N, ...]``.
        labels: int64 [N] (ce) or float32 [N, D] (mse).
        class_names: label of each output index for ce (npz: ``"0" .. "K-1"``; text: the
            file's labels, :func:`etgraph.labels.map_labels`); empty for mse.
    """

    name: str
    arrays: dict[str, np.ndarray]
    labels: np.ndarray
    train_index: np.ndarray
    val_index: np.ndarray
    class_names: list[str]

    def _batch(self, index: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        x = {k: np.ascontiguousarray(v[index]) for k, v in self.arrays.items()}
        return x, self.labels[index]

    def train_batches(self, batch_size: int, *, seed: int, drop_last: bool = True) -> Iterator:
        """One epoch of shuffled training batches (as :meth:`Dataset.train_batches`).

        Raises:
            DataError: ``batch_size`` exceeds the training set with ``drop_last``.
        """
        check_batch_size(batch_size)
        if drop_last and batch_size > self.n_train:
            raise DataError(
                f"dataset {self.name} has {self.n_train} training examples, fewer than the "
                f"batch size {batch_size}: use a smaller --batch-size or add examples"
            )
        order = np.random.default_rng(seed).permutation(self.train_index)
        stop = self.steps_per_epoch(batch_size, drop_last=drop_last) * batch_size
        for start in range(0, min(stop, order.size), batch_size):
            yield self._batch(order[start : start + batch_size])

    def val_batches(self, batch_size: int) -> Iterator:
        """The validation set in a fixed order; the last batch may be short."""
        check_batch_size(batch_size)
        for start in range(0, self.n_val, batch_size):
            yield self._batch(self.val_index[start : start + batch_size])

    def probe_batch(self, batch_size: int, seed: int):
        """A reproducible random training batch (without replacement), for importance."""
        check_batch_size(batch_size)
        rng = np.random.default_rng(seed)
        index = rng.choice(self.train_index, size=min(batch_size, self.n_train), replace=False)
        return self._batch(np.sort(index))


_NPZ_FIX = "save one with numpy.savez(FILE, <input name>=array, ..., labels=array)"


def load_npz_dataset(
    path: str | os.PathLike,
    *,
    inputs: Sequence[InputSpec],
    shapes: Mapping[str, Sequence[int]],
    task: Task,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> ArrayDataset:
    """Load ``--data FILE.npz``: one array per model input (keyed by input name, ``[N, ...]``)
    plus ``labels`` (int class indices ``[N]`` for loss ce, float ``[N, D]`` for mse).

    The validation split is stratified per class for ce (as for images), random for mse; both
    fixed by ``seed``. Integer arrays are cast to the input's integer dtype, float arrays to its
    float dtype; extra arrays in the file are ignored.

    Args:
        path: the ``.npz`` file.
        inputs: the model's inputs (:attr:`etgraph.model.LoadedModel.inputs`).
        shapes: per-sample shape of each input (:meth:`etgraph.model.LoadedModel.input_shapes`).
        task: the output and loss (:class:`etgraph.io_specs.Task`).
        val_fraction: fraction held out for validation, in [0, 1).
        seed: split seed.

    Raises:
        DataError: one line naming the problem and the fix: the file is missing or not an npz;
            an input's array is missing, of the wrong dtype kind (float vs integer) or shape,
            holds NaN or infinite values, or holds ids beyond the input's embedding table; the
            arrays differ in length; ``labels`` is missing, not integer class indices inside
            the head's ``K`` classes (ce), or not finite ``[N, D]`` floats of the output's
            width (mse).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist: {_NPZ_FIX}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            stored = {k: npz[k] for k in npz.files}
    except Exception as exc:
        raise DataError(f"{path} is not a readable .npz file ({exc}): {_NPZ_FIX}") from exc
    return arrays_dataset(
        path, stored, inputs=inputs, shapes=shapes, task=task, val_fraction=val_fraction, seed=seed
    )


def arrays_dataset(
    name: str | os.PathLike,
    stored: Mapping[str, np.ndarray],
    *,
    inputs: Sequence[InputSpec],
    shapes: Mapping[str, Sequence[int]],
    task: Task,
    val_fraction: float = 0.2,
    seed: int = 0,
    n_val: int | None = None,
) -> ArrayDataset:
    """A dataset of arrays held in memory: one per model input (keyed by input name,
    ``[N, ...]``) plus ``labels``, checked as :func:`load_npz_dataset` checks a file's.

    Args:
        name: what messages call the data (a file path, or e.g. ``"arrays"``).
        stored: input name -> array, and ``labels``.
        n_val: the last ``n_val`` rows are the validation set (data given as separate training
            and validation arrays); None: ``val_fraction`` held out (stratified per class for
            ce, random for mse, fixed by ``seed``).

    Raises:
        DataError: as :func:`load_npz_dataset`.
    """
    path = name
    arrays = {}
    for spec in inputs:
        if spec.name not in stored:
            raise DataError(
                f"{path} has no array {spec.name!r} for the model input {spec.name!r} (it holds "
                f"{sorted(stored)[:8]}): add one array per model input, keyed by input name"
            )
        arr = stored[spec.name]
        want = np.dtype(spec.dtype)
        if arr.dtype.kind != want.kind and not (arr.dtype.kind in "iu" and want.kind in "iub"):
            raise DataError(
                f"{path}: array {spec.name!r} is {arr.dtype}, the model input takes {want}: save "
                f"it as {want}"
            )
        expected = tuple(int(d) for d in shapes[spec.name])
        if arr.ndim != len(expected) + 1 or tuple(arr.shape[1:]) != expected:
            raise DataError(
                f"{path}: array {spec.name!r} has shape {list(arr.shape)}, the model input takes "
                f"[N, {', '.join(map(str, expected))}]: reshape it (or pass --input-shape "
                f"{spec.name}=DIMS)"
            )
        if spec.index_rows is not None and arr.size and int(arr.min()) < 0:
            raise DataError(
                f"{path}: array {spec.name!r} holds negative ids (down to {int(arr.min())}): "
                "pad with the tokenizer's pad id (ONNX Gather reads -1 as the last row)"
            )
        if spec.index_rows is not None and arr.size and int(arr.max()) >= spec.index_rows:
            raise DataError(
                f"{path}: array {spec.name!r} holds ids up to {int(arr.max())}, but the model's "
                f"embedding table has {spec.index_rows} rows: encode the data with the model's "
                "own tokenizer (ids below the vocabulary size)"
            )
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            bad = int(np.count_nonzero(~np.isfinite(arr)))
            raise DataError(
                f"{path}: array {spec.name!r} holds {bad} NaN or infinite values: clean or drop "
                "those examples"
            )
        arrays[spec.name] = arr.astype(want, copy=False)
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise DataError(f"{path}: the input arrays differ in length {lengths}: give N rows each")
    n = next(iter(lengths.values()))
    if n == 0:
        raise DataError(f"{path} holds 0 examples: {_NPZ_FIX} with N >= 1 rows")
    if "labels" not in stored:
        raise DataError(
            f"{path} has no 'labels' array: add labels (int class indices [N] for --loss ce, "
            "float targets [N, D] for --loss mse)"
        )
    labels = _checked_labels(path, stored["labels"], n, task)
    if n_val is not None:
        train, val = np.arange(n - n_val), np.arange(n - n_val, n)
    elif task.loss == "ce":
        train, val = stratified_split(labels, val_fraction, seed)
    else:
        train, val = random_split(n, val_fraction, seed)
    class_names = []
    if task.loss == "ce":
        class_names = [str(i) for i in range(task.width or int(labels.max()) + 1)]
    log.info("%s: %d examples (%d train, %d val)", path, n, train.size, val.size)
    return ArrayDataset(str(path), arrays, labels, train, val, class_names)


def _checked_labels(path, labels: np.ndarray, n: int, task: Task) -> np.ndarray:
    """``labels`` as int64 [N] (ce) or float32 [N, D] (mse), or a DataError naming the fix."""
    if len(labels) != n:
        raise DataError(f"{path}: 'labels' has {len(labels)} rows, the inputs {n}: give N each")
    if task.loss == "ce":
        if labels.dtype.kind not in "iu" or labels.ndim != 1:
            raise DataError(
                f"{path}: 'labels' is {labels.dtype} {list(labels.shape)}; --loss ce takes int "
                "class indices [N] (use --loss mse for float targets [N, D])"
            )
        k = task.width  # None: symbolic; class indices then go up to MAX_CLASS_INDEX
        top = MAX_CLASS_INDEX if k is None else k - 1
        if labels.size and (labels.min() < 0 or labels.max() > top):
            classes = f"has {k} classes" if k else f"takes class indices up to {top}"
            raise DataError(
                f"{path}: labels range over {int(labels.min())}..{int(labels.max())}, but the "
                f"model's output {task.output!r} {classes}: use labels 0..{top} (or a model "
                "with a wider output layer)"
            )
        return labels.astype(np.int64)
    if labels.dtype.kind != "f":
        raise DataError(
            f"{path}: 'labels' is {labels.dtype}; --loss mse takes float targets [N, D] (use "
            "--loss ce for class indices)"
        )
    if labels.ndim == 1 and task.width == 1:
        labels = labels[:, None]
    if labels.ndim != 2 or (task.width is not None and labels.shape[1] != task.width):
        raise DataError(
            f"{path}: 'labels' has shape {list(labels.shape)}, but the model's output "
            f"{task.output!r} is [B, {task.width}]: give targets [N, {task.width}]"
        )
    if not np.all(np.isfinite(labels)):
        raise DataError(
            f"{path}: 'labels' holds {int(np.count_nonzero(~np.isfinite(labels)))} NaN or "
            "infinite targets: clean or drop those examples"
        )
    return labels.astype(np.float32)


def load_text_dataset(
    path: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None,
    inputs: Sequence[InputSpec],
    shapes: Mapping[str, Sequence[int]],
    task: Task,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> ArrayDataset:
    """Load ``--data FILE.csv|FILE.jsonl --tokenizer tokenizer.json`` for a token model
    (:func:`etgraph.text.load_text_data`): one ``[N, T]`` array per token input in that
    input's dtype (ids and masks are tokenized as int64, then cast: a float or bool mask, int32
    ids), labels mapped to the head's classes (``class_names`` from the data, or the model's
    own when every label is one of them: :func:`etgraph.labels.known_class_names`), split
    stratified per class.

    Raises:
        DataError: as :func:`etgraph.text.check_text_options`; a loss other than ce; token
            inputs of different or multi-dimensional per-sample shapes; one label only; and as
            :func:`etgraph.text.load_text_data`.
    """
    check_text_options(path, tokenizer)
    if task.loss != "ce":
        raise DataError(
            f"text data {path} has class labels; --loss {task.loss} needs --data FILE.npz with "
            "float targets"
        )
    lengths = {spec.name: tuple(shapes[spec.name]) for spec in inputs}
    if len(set(lengths.values())) != 1 or len(next(iter(lengths.values()))) != 1:
        raise DataError(
            f"text data feeds token inputs [B, T] of one length T; the model's inputs are "
            f"{ {k: list(v) for k, v in lengths.items()} }: give --input-shape NAME=T per input"
        )
    ids = next((spec for spec in inputs if spec.name == "input_ids"), None)
    text = load_text_data(
        path,
        tokenizer,
        input_names=[spec.name for spec in inputs],
        seq_len=next(iter(lengths.values()))[0],
        vocab_rows=ids.index_rows if ids is not None else None,
        num_classes=task.width,
        known_names=task.class_names,
    )
    if np.unique(text.labels).size < 2:  # as an image folder of one class
        raise DataError(
            f"text data {path} has one label ({text.class_names[text.labels[0]]!r}): a "
            "classifier learns nothing from one; give rows of two labels or more"
        )
    # each input in its own dtype: a float or bool attention mask, int32 ids
    arrays = {spec.name: text.inputs[spec.name].astype(spec.dtype, copy=False) for spec in inputs}
    train, val = stratified_split(text.labels, val_fraction, seed)
    log.info("%s: %d texts (%d train, %d val)", path, text.labels.size, train.size, val.size)
    return ArrayDataset(str(path), arrays, text.labels, train, val, text.class_names)
