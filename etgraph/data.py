"""Datasets: the embedded digits transfer task, image folders, and the one place that picks the
loader of a run's data (:func:`load_task_data`, :func:`as_dataset`; DESIGN: data). Pictures and
their normalisation are :mod:`etgraph.images`; arrays, ``.npz`` files and text are
:mod:`etgraph.arrays`; the train/validation split :mod:`etgraph.splits`.

Two image sources, one :class:`Dataset` interface:

- **digits** (default, no download, no scikit-learn at run time): scikit-learn's bundled
  handwritten digits (1797 grey 8x8 images, values 0-16), stored once in
  ``etgraph/assets/digits.npz`` by ``models/pretrain_default.py``. The embedded default model is
  pretrained on classes 0-4; the transfer task here is classes **5-9 relabelled 0-4**, so
  fine-tuning is genuine transfer learning (the paper's setup, §8: pretrained model, new task,
  new output layer). Images are upsampled bilinearly to the model's H x W, scaled to [0, 1],
  grey replicated to C channels and normalised with the digits' own mean/std. **No random
  flip**: a mirrored digit is a different glyph (or none), so flipping would corrupt the labels.
- **image folders**: a directory with one sub-folder per class (the layout CUB-200,
  Oxford-IIIT Pet and Stanford Dogs unpack to). Images are decoded with Pillow at batch time
  (the paper counts on-device pre-processing as training time, §8), converted to RGB (or grey)
  from any mode Pillow opens (:func:`etgraph.images.pixels`: 16-bit and float pictures scaled
  to 0-255, alpha dropped), resized to H x W (bilinear) and normalised as the model expects
  (:class:`etgraph.images.Preprocess`: a preset — ``imagenet`` by default, ``caffe``,
  ``paddle``, ``none`` — with per-field overrides of mean, std, scale and channel order);
  training batches are randomly flipped left-right (paper §8: "random flipping").

The train/validation split is stratified per class and fixed by ``seed``.

For models of any inputs, **arrays** (``--data FILE.npz``,
:func:`etgraph.arrays.load_npz_dataset`): one array per model input keyed by input name plus
``labels`` (class indices for cross-entropy, float targets for MSE); for token models, **text**
(``--data FILE.csv|FILE.jsonl --tokenizer tokenizer.json``,
:func:`etgraph.arrays.load_text_dataset`). :func:`load_task_data` picks the loader for a model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from .arrays import ArrayDataset, arrays_dataset, load_npz_dataset, load_text_dataset
from .errors import DataError
from .host import available_memory_bytes
from .images import (
    ASSETS_DIR,
    DEFAULT_PREPROCESS,
    IMAGE_ERRORS,
    Preprocess,
    decode_image,
    digits_images,
    image_layout,
    load_digits_arrays,
    scan_image_folder,
)
from .io_specs import InputSpec, Task
from .labels import known_class_names
from .splits import Batch, Split, check_batch_size, check_num_classes, stratified_split
from .text import check_text_options, is_text_file

log = logging.getLogger(__name__)

#: The embedded pretrained default model (small CNN, 3x32x32 -> 5 classes, digits 5-9 task).
DEFAULT_MODEL_PATH = ASSETS_DIR / "default_model.onnx"
#: Metadata of the default model: input_shape, num_classes, dataset, pretrain accuracy, seed.
DEFAULT_MODEL_INFO_PATH = ASSETS_DIR / "default_model.json"

#: Digit classes the default model is pretrained on, and the transfer task's classes.
DIGITS_PRETRAIN_CLASSES = (0, 1, 2, 3, 4)
DIGITS_TRANSFER_CLASSES = (5, 6, 7, 8, 9)


@dataclass
class Dataset(Split):
    """A labelled image dataset split into train and validation parts.

    Batches are ``(x, y)`` with ``x`` float32 ``[B, C, H, W]`` (normalised) and ``y`` int64
    ``[B]`` in ``[0, num_classes)``. Build one with :func:`load_dataset`.

    Attributes:
        name: ``"digits"`` or the image folder path.
        num_classes: number of classes in the data.
        class_names: one name per label index.
        input_shape: ``(C, H, W)`` of one image (decoded, resized, normalised).
        augment_flip: whether training batches are randomly flipped left-right.
        channels_last: batches are fed ``[B, H, W, C]`` (a channels-last model: Keras through
            tf2onnx, :func:`image_layout`) instead of ``[B, C, H, W]``.
    """

    name: str
    class_names: list[str]
    input_shape: tuple[int, int, int]
    labels: np.ndarray  # int64 [N], all examples
    train_index: np.ndarray  # int64 [n_train], indices into labels
    val_index: np.ndarray  # int64 [n_val]
    augment_flip: bool
    _load: object = field(repr=False)  # callable(indices int64 [n]) -> float32 [n, C, H, W]
    channels_last: bool = False

    def _batch(self, index: np.ndarray, rng: np.random.Generator | None) -> Batch:
        x = self._load(index)
        if rng is not None and self.augment_flip:
            flip = rng.random(index.size) < 0.5
            x[flip] = x[flip, :, :, ::-1]
        if self.channels_last:
            x = x.transpose(0, 2, 3, 1)
        return np.ascontiguousarray(x, dtype=np.float32), self.labels[index].astype(np.int64)

    def train_batches(
        self, batch_size: int, *, seed: int, drop_last: bool = True
    ) -> Iterator[Batch]:
        """Yield one epoch of shuffled training batches.

        Args:
            batch_size: examples per batch (paper §8: 4).
            seed: shuffling (and flipping) seed; pass a different value each epoch, e.g.
                ``run_seed * 1000 + epoch``, for a fresh order that is still reproducible.
            drop_last: drop the final incomplete batch (keeps the step shape fixed).

        Yields:
            ``(x float32 [B, C, H, W], y int64 [B])``; random left-right flip if
            :attr:`augment_flip`.

        Raises:
            DataError: ``batch_size`` exceeds the training set with ``drop_last``, or an image
                cannot be decoded (the file is named).
        """
        check_batch_size(batch_size)
        if drop_last and batch_size > self.n_train:
            raise DataError(
                f"dataset {self.name} has {self.n_train} training images, fewer than the batch "
                f"size {batch_size}: use a smaller --batch-size or add images"
            )
        rng = np.random.default_rng(seed)
        order = rng.permutation(self.train_index)
        stop = self.steps_per_epoch(batch_size, drop_last=drop_last) * batch_size
        for start in range(0, min(stop, order.size), batch_size):
            yield self._batch(order[start : start + batch_size], rng)

    def val_batches(self, batch_size: int) -> Iterator[Batch]:
        """Yield the validation set in a fixed order, unaugmented; the last batch may be short.

        Yields:
            ``(x float32 [b, C, H, W], y int64 [b])`` with ``b <= batch_size``.
        """
        check_batch_size(batch_size)
        for start in range(0, self.n_val, batch_size):
            yield self._batch(self.val_index[start : start + batch_size], None)

    def probe_batch(self, batch_size: int, seed: int) -> Batch:
        """A reproducible random training batch (without replacement), pre-processed like a
        training batch; used to evaluate tensor importance (paper §4).

        Returns:
            ``(x float32 [b, C, H, W], y int64 [b])`` with ``b = min(batch_size, n_train)``.
        """
        check_batch_size(batch_size)
        rng = np.random.default_rng(seed)
        index = rng.choice(self.train_index, size=min(batch_size, self.n_train), replace=False)
        return self._batch(index, rng)


def _check_input_shape(input_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    shape = tuple(int(v) for v in input_shape)
    if len(shape) != 3 or shape[0] not in (1, 3) or min(shape[1:]) < 1:
        raise DataError(f"input shape must be (C, H, W) with C 1 or 3, got {input_shape}")
    return shape  # type: ignore[return-value]


# ----------------------------------------------------------------------------- digits


def load_digits_task(
    classes: tuple[int, ...] = DIGITS_TRANSFER_CLASSES,
    *,
    input_shape: tuple[int, int, int],
    val_fraction: float = 0.2,
    seed: int = 0,
) -> Dataset:
    """The digits restricted to ``classes``, relabelled ``0..len(classes)-1`` in that order.

    Normalisation uses the mean/std of the upsampled pixels of the selected classes; there is
    no flip augmentation (mirrored digits are different glyphs). ``models/pretrain_default.py``
    uses ``DIGITS_PRETRAIN_CLASSES``; :func:`load_dataset` uses ``DIGITS_TRANSFER_CLASSES``.

    Raises:
        DataError: bad input shape or classes, or the embedded file is missing.
    """
    c, h, w = _check_input_shape(input_shape)
    images, labels = load_digits_arrays()
    if not classes or any(k not in range(10) for k in classes) or len(set(classes)) != len(classes):
        raise DataError(f"digit classes must be distinct values in 0-9, got {classes}")
    keep = np.isin(labels, classes)
    need = 2 * int(keep.sum()) * h * w * 4  # the upsampled pixels, then normalised
    if need > available_memory_bytes():
        raise DataError(
            f"the digits at {h}x{w} take {need / 2**30:.1f} GiB, more than this process can "
            f"allocate ({available_memory_bytes() / 2**30:.1f} GiB): use a smaller --input-shape"
        )
    relabel = {k: i for i, k in enumerate(classes)}
    task_labels = np.array([relabel[int(k)] for k in labels[keep]], dtype=np.int64)
    pixels = digits_images(images[keep], (h, w))
    mean, std = float(pixels.mean()), float(pixels.std())
    pixels = (pixels - mean) / std

    def load(index: np.ndarray) -> np.ndarray:
        return np.repeat(pixels[index][:, None], c, axis=1)

    train, val = stratified_split(task_labels, val_fraction, seed)
    return Dataset(
        name="digits",
        class_names=[str(k) for k in classes],
        input_shape=(c, h, w),
        labels=task_labels,
        train_index=train,
        val_index=val,
        augment_flip=False,
        _load=load,
    )


# ----------------------------------------------------------------------------- preprocessing


# ----------------------------------------------------------------------------- image folders

#: MiB of decoded, resized images an image-folder dataset keeps (:func:`load_image_folder`):
#: 1,700 pictures at 224 px, 9,700 at 96 px; beyond it, images are decoded per batch.
IMAGE_CACHE_MB = 256.0


def load_image_folder(
    root: str | os.PathLike,
    *,
    input_shape: tuple[int, int, int],
    val_fraction: float = 0.2,
    seed: int = 0,
    check_images: bool = True,
    preprocess: Preprocess | None = None,
    known_names: Sequence[str] = (),
    cache_mb: float = IMAGE_CACHE_MB,
) -> Dataset:
    """An image-folder dataset: ``root/<class>/<image>``; labels follow sorted folder names.

    Images are decoded when a batch needs them (:func:`etgraph.images.decode_image`) and kept,
    decoded and resized, up to ``cache_mb`` MiB in all (:data:`IMAGE_CACHE_MB`): a small
    on-device dataset is decoded once per run, not once per epoch (issue 31: a 12 MP phone
    photo took 150-200 ms to decode, every epoch, against a 50-110 ms ResNet-18 step on four
    of them at 64 px; ``benchmarks/image_loading.py``).

    Args:
        root: dataset directory.
        input_shape: ``(C, H, W)``; C = 3 (RGB or BGR, see ``preprocess``) or 1 (grey).
        val_fraction: fraction of each class held out for validation.
        seed: split seed.
        check_images: open every file's header now, so an unreadable file fails at load time
            rather than mid-training (decoding happens per batch).
        preprocess: the model's input normalisation (None: ImageNet mean/std, RGB).
        known_names: the class names the model's head was trained with: when every folder is
            one of them, labels are their indices there (and ``class_names`` these names), not
            the folders' sorted order (:func:`etgraph.labels.known_class_names`).
        cache_mb: MiB of decoded images kept (0: none; under a memory budget the run's
            data must not hold memory the budget does not count).

    Raises:
        DataError: directory missing, empty, without class sub-folders, a class without images,
            or an unreadable image (the file is named).
    """
    c, h, w = _check_input_shape(input_shape)
    root = Path(root)
    class_names, files, labels = scan_image_folder(root)
    known = known_class_names(class_names, known_names)
    if known is not None:  # the head's own indices (a model etgraph trained, fine-tuned again)
        index = np.array([known.index(name) for name in class_names], dtype=np.int64)
        class_names, labels = known, index[labels]
    if check_images:
        for p in files:
            try:
                with Image.open(p) as img:
                    img.verify()
            except IMAGE_ERRORS as exc:
                raise DataError(
                    f"cannot read image {p}: {exc}; remove or replace the file"
                ) from exc
    mode = "RGB" if c == 3 else "L"
    preprocess = DEFAULT_PREPROCESS if preprocess is None else preprocess

    cache: dict[int, np.ndarray] = {}
    room = cache_mb * 2**20  # bytes the cache may still take

    def decoded(i: int) -> np.ndarray:
        nonlocal room
        arr = cache.get(i)
        if arr is None:
            arr = decode_image(files[i], (h, w), mode)
            if arr.nbytes <= room:
                cache[i], room = arr, room - arr.nbytes
        return arr

    def load(index: np.ndarray) -> np.ndarray:
        return preprocess.apply(np.stack([decoded(int(i)) for i in index]))

    train, val = stratified_split(labels, val_fraction, seed)
    log.info(
        "image folder %s: %d classes, %d train, %d val; preprocessing %s",
        root,
        len(class_names),
        train.size,
        val.size,
        preprocess.describe(),
    )
    return Dataset(
        name=str(root),
        class_names=class_names,
        input_shape=(c, h, w),
        labels=labels,
        train_index=train,
        val_index=val,
        augment_flip=True,
        _load=load,
    )


def load_dataset(
    spec: str | os.PathLike | None,
    *,
    input_shape: tuple[int, int, int],
    num_classes: int | None = None,
    val_fraction: float = 0.2,
    seed: int = 0,
    preprocess: Preprocess | None = None,
    known_names: Sequence[str] = (),
    cache_mb: float = IMAGE_CACHE_MB,
) -> Dataset:
    """Load the dataset named by ``spec`` for a model with the given input shape.

    Args:
        spec: ``None`` or ``"digits"`` for the embedded transfer task (digits 5-9 as labels
            0-4); otherwise an image-folder directory (one sub-folder per class).
        input_shape: the model's ``(C, H, W)``; images are resized to H x W.
        num_classes: the model's output width; the data may not have more classes.
        val_fraction: fraction of each class held out for validation, in [0, 1).
        seed: train/validation split seed.
        preprocess: the model's input normalisation for image folders (None: ImageNet); the
            embedded digits keep their own (their mean/std), whatever it says.
        known_names: for an image folder, the class names the model's head was trained with
            (:func:`load_image_folder`).
        cache_mb: for an image folder, MiB of decoded images kept (:func:`load_image_folder`).

    Returns:
        A :class:`Dataset`.

    Raises:
        DataError: see :func:`load_image_folder`; or the data has one class only, or more
            classes than ``num_classes``.
    """
    if spec is None or str(spec) == "digits":
        if preprocess is not None and preprocess != DEFAULT_PREPROCESS:
            log.info("the embedded digits keep their own normalisation: preprocessing ignored")
        ds = load_digits_task(input_shape=input_shape, val_fraction=val_fraction, seed=seed)
    else:
        ds = load_image_folder(
            spec,
            input_shape=input_shape,
            val_fraction=val_fraction,
            seed=seed,
            preprocess=preprocess,
            known_names=known_names,
            cache_mb=cache_mb,
        )
    check_num_classes(ds.name, int(np.unique(ds.labels).size), num_classes)
    return ds


# ----------------------------------------------------------------------------- arrays (.npz)


# ----------------------------------------------------------------------------- text


def recorded_spec(spec: str | os.PathLike | None) -> str | None:
    """A data or tokenizer spec as a plan or a run records it: a path made absolute (a
    compiled directory is trained, a run resumed, from any working directory), ``digits`` and
    None as they are."""
    if spec is None:
        return None
    if str(spec) == "digits" or not Path(spec).exists():
        return str(spec)
    return str(Path(spec).resolve())


def reloadable(data, spec: str | os.PathLike | None) -> bool:
    """Whether the data spec ``spec`` (None: the embedded digits) loads ``data`` (as
    :func:`as_dataset` takes it) again: a run's recorded spec serves its resume. False for
    arrays or batches in memory, and for a loaded dataset of another source."""
    if data is None:
        return True
    if isinstance(data, (Dataset, ArrayDataset)):
        return recorded_spec(data.name) == (recorded_spec(spec) or "digits")
    return False


def load_task_data(
    spec: str | os.PathLike | None,
    *,
    inputs: Sequence[InputSpec],
    shapes: Mapping[str, Sequence[int]],
    task: Task,
    tokenizer: str | os.PathLike | None = None,
    val_fraction: float = 0.2,
    seed: int = 0,
    preprocess: Preprocess | None = None,
    cache_mb: float = IMAGE_CACHE_MB,
) -> Dataset | ArrayDataset:
    """The dataset named by ``spec`` for a model: a ``.npz`` file (:func:`load_npz_dataset`,
    any model), a ``.csv``/``.jsonl`` text file tokenized with ``tokenizer``
    (:func:`load_text_dataset`, token models), else the digits task or an image folder
    (:func:`load_dataset`, normalised by ``preprocess``) for a model with one float image input
    ``[B, C, H, W]``, or ``[B, H, W, C]`` (:func:`image_layout`: fed channels last), trained
    with cross-entropy (keeping ``cache_mb`` MiB of decoded images: :func:`load_image_folder`).

    Raises:
        DataError: as the loaders; image data for a model that is not a single-input image
            classifier (the fix: ``--data FILE.npz``); a ``tokenizer`` without text data.
    """
    check_text_options(spec, tokenizer)
    if is_text_file(spec):
        return load_text_dataset(
            spec,  # type: ignore[arg-type]
            tokenizer=tokenizer,
            inputs=inputs,
            shapes=shapes,
            task=task,
            val_fraction=val_fraction,
            seed=seed,
        )
    if spec is not None and str(spec).endswith(".npz"):
        return load_npz_dataset(
            spec, inputs=inputs, shapes=shapes, task=task, val_fraction=val_fraction, seed=seed
        )
    names = [i.name for i in inputs]
    if len(inputs) != 1 or inputs[0].rank != 4 or not inputs[0].is_float:
        raise DataError(
            f"image data ({spec or 'digits'}) feeds models with one float image input "
            f"[B, C, H, W] or [B, H, W, C]; this model has inputs {names[:8]}: pass --data "
            "FILE.npz with one array per input"
        )
    if task.loss != "ce":
        raise DataError(
            f"image data ({spec or 'digits'}) has class labels; --loss {task.loss} needs "
            "--data FILE.npz with float targets"
        )
    dims = tuple(int(d) for d in shapes[names[0]])
    channels_last = image_layout(dims) == "NHWC"
    dataset = load_dataset(
        spec,
        input_shape=(dims[2], dims[0], dims[1]) if channels_last else dims,  # type: ignore
        num_classes=task.width,
        val_fraction=val_fraction,
        seed=seed,
        preprocess=preprocess,
        known_names=task.class_names,
        cache_mb=cache_mb,
    )
    if channels_last:
        log.info("input %s is channels-last %s: images fed [B, H, W, C]", names[0], list(dims))
        dataset.channels_last = True
    return dataset


def as_dataset(
    data,
    *,
    inputs: Sequence[InputSpec],
    shapes: Mapping[str, Sequence[int]],
    task: Task,
    spec: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
    val_fraction: float = 0.2,
    seed: int = 0,
    preprocess: Preprocess | None = None,
    val_data=None,
    all_val: bool = False,
    cache_mb: float = IMAGE_CACHE_MB,
) -> Dataset | ArrayDataset:
    """The dataset of any form a program may hand over.

    Args:
        data: None (``spec`` is loaded: :func:`load_task_data`), a :class:`Dataset` or
            :class:`ArrayDataset` (as is), ``(inputs, labels)`` in memory — ``inputs`` one
            array ``[N, ...]`` for a one-input model or input name -> array ``[N, ...]``,
            ``labels`` int class indices ``[N]`` (loss ce) or float targets ``[N, D]`` (mse) —
            or an iterable of such ``(inputs, labels)`` batches (concatenated: held in memory,
            shuffled per example as any dataset).
        val_data: validation data in memory, as ``data`` (not with a spec or a dataset);
            default: ``val_fraction`` of ``data`` held out, stratified per class.
        all_val: in-memory ``data`` is all validation (for evaluating on it).
        Others: as :func:`load_task_data`.

    Raises:
        DataError: the data does not fit the model (:func:`arrays_dataset`), or is of no form
            above.
    """
    if data is None:
        if val_data is not None:
            raise DataError("val_data needs data in memory (give both as arrays or batches)")
        return load_task_data(
            spec,
            inputs=inputs,
            shapes=shapes,
            task=task,
            tokenizer=tokenizer,
            val_fraction=val_fraction,
            seed=seed,
            preprocess=preprocess,
            cache_mb=cache_mb,
        )
    if isinstance(data, (Dataset, ArrayDataset)):
        if val_data is not None:
            raise DataError("val_data needs data in memory, not a loaded dataset")
        return data
    stored = _in_memory(data, inputs)
    n_val = len(stored["labels"]) if all_val else None
    if val_data is not None:
        held_out = _in_memory(val_data, inputs)
        n_val = len(held_out["labels"])
        stored = {k: np.concatenate([stored[k], held_out[k]]) for k in stored}
    return arrays_dataset(
        "arrays",
        stored,
        inputs=inputs,
        shapes=shapes,
        task=task,
        val_fraction=val_fraction,
        seed=seed,
        n_val=n_val,
    )


def _in_memory(data, inputs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    """``{input name: array, "labels": array}`` of ``(inputs, labels)`` or of an iterable of
    such batches (concatenated)."""
    names = [spec.name for spec in inputs]

    def named(x) -> dict[str, np.ndarray]:
        if isinstance(x, Mapping):
            return {k: np.asarray(v) for k, v in x.items()}
        if len(names) != 1:
            raise DataError(
                f"the model has inputs {names[:8]}: give the inputs as a dict keyed by input name"
            )
        return {names[0]: np.asarray(x)}

    if isinstance(data, tuple) and len(data) == 2 and not isinstance(data[1], tuple):
        stored = named(data[0])
        stored["labels"] = np.asarray(data[1])
        return stored
    try:
        batches = [(named(x), np.asarray(y)) for x, y in data]
    except (TypeError, ValueError) as exc:
        raise DataError(
            "data in memory is (inputs, labels) arrays or an iterable of (inputs, labels) "
            f"batches ({exc})"
        ) from exc
    if not batches:
        raise DataError("the data holds no batch: give at least one (inputs, labels) batch")
    keys = batches[0][0].keys()
    stored = {k: np.concatenate([x[k] for x, _ in batches]) for k in keys}
    stored["labels"] = np.concatenate([y for _, y in batches])
    return stored
