"""Datasets: the embedded digits transfer task and image-folder directories (DESIGN: data).

Two sources, one :class:`Dataset` interface:

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
  from any mode Pillow opens (:func:`pixels`: 16-bit and float pictures scaled to 0-255,
  alpha dropped), resized to H x W (bilinear) and normalised as the model expects
  (:class:`Preprocess`: a preset — ``imagenet`` by default, ``caffe``, ``paddle``, ``none`` —
  with per-field overrides of mean, std, scale and channel order); training batches are
  randomly flipped left-right (paper §8: "random flipping").

The train/validation split is stratified per class and fixed by ``seed``.

For models of any inputs, **arrays** (``--data FILE.npz``, :func:`load_npz_dataset`): one array
per model input keyed by input name plus ``labels`` (class indices for cross-entropy, float
targets for MSE); for token models, **text** (``--data FILE.csv|FILE.jsonl --tokenizer
tokenizer.json``, :func:`load_text_dataset`, :mod:`etgraph.text`). :func:`load_task_data` picks
the loader for a model.
"""

from __future__ import annotations

import logging
import math
import os
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from .errors import ConfigError, DataError
from .host import available_memory_bytes
from .labels import MAX_CLASS_INDEX
from .model import InputSpec, Task
from .text import check_text_options, is_text_file, load_text_data

log = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
#: The embedded pretrained default model (small CNN, 3x32x32 -> 5 classes, digits 5-9 task).
DEFAULT_MODEL_PATH = ASSETS_DIR / "default_model.onnx"
#: Metadata of the default model: input_shape, num_classes, dataset, pretrain accuracy, seed.
DEFAULT_MODEL_INFO_PATH = ASSETS_DIR / "default_model.json"
#: scikit-learn's digits as ``images`` uint8 [1797, 8, 8] (values 0-16) and ``labels`` int64.
DIGITS_PATH = ASSETS_DIR / "digits.npz"

#: Digit classes the default model is pretrained on, and the transfer task's classes.
DIGITS_PRETRAIN_CLASSES = (0, 1, 2, 3, 4)
DIGITS_TRANSFER_CLASSES = (5, 6, 7, 8, 9)

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"})

Batch = tuple[np.ndarray, np.ndarray]


class _Split:
    """What :class:`Dataset` and :class:`ArrayDataset` share: class names and the
    train/validation index split (``class_names``, ``train_index``, ``val_index`` fields)."""

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def n_train(self) -> int:
        return int(self.train_index.size)

    def check_probe_batches(self, batch_size: int, probe_batches: int) -> None:
        """Refuse more importance probe batches than the training set has batches (they are
        drawn from it and held in memory together: 100000 of them took 5 GB and minutes).

        Raises:
            ConfigError: ``probe_batches`` exceeds the training set's batches of
                ``batch_size`` (the message gives the largest count).
        """
        most = max(1, self.n_train // batch_size)
        if probe_batches > most:
            raise ConfigError(
                f"--probe-batches {probe_batches} is more than the {most} batches of "
                f"{batch_size} in the training set of {self.name} ({self.n_train} examples): "
                f"pass at most {most}"
            )

    @property
    def n_val(self) -> int:
        return int(self.val_index.size)

    def steps_per_epoch(self, batch_size: int, *, drop_last: bool = True) -> int:
        """Number of training batches :meth:`train_batches` yields per epoch."""
        _check_batch_size(batch_size)
        full, rest = divmod(self.n_train, batch_size)
        return full if drop_last else full + (rest > 0)


@dataclass
class Dataset(_Split):
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
        _check_batch_size(batch_size)
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
        _check_batch_size(batch_size)
        for start in range(0, self.n_val, batch_size):
            yield self._batch(self.val_index[start : start + batch_size], None)

    def probe_batch(self, batch_size: int, seed: int) -> Batch:
        """A reproducible random training batch (without replacement), pre-processed like a
        training batch; used to evaluate tensor importance (paper §4).

        Returns:
            ``(x float32 [b, C, H, W], y int64 [b])`` with ``b = min(batch_size, n_train)``.
        """
        _check_batch_size(batch_size)
        rng = np.random.default_rng(seed)
        index = rng.choice(self.train_index, size=min(batch_size, self.n_train), replace=False)
        return self._batch(index, rng)


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise DataError(f"batch size must be >= 1, got {batch_size}")


def _stratified_split(
    labels: np.ndarray, val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split indices per class: ``round(val_fraction * n_c)`` of class c go to validation
    (at least one when the class has >= 2 examples and ``val_fraction > 0``).

    Returns ``(train, val)``: train sorted; val interleaved class by class (one example of
    each class, then the next of each, ...), so the first batches of a capped validation
    (``--max-val-batches``) cover every class rather than the first classes only.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"validation fraction must be in [0, 1), got {val_fraction}")
    rng = np.random.default_rng(seed)
    train, val, rank = [], [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_val = int(round(val_fraction * idx.size))
        if val_fraction > 0 and idx.size >= 2:
            n_val = min(max(n_val, 1), idx.size - 1)
        val.append(np.sort(idx[:n_val]))
        rank.append(np.arange(n_val))
        train.append(idx[n_val:])
    val_index, val_rank = np.concatenate(val), np.concatenate(rank)
    interleaved = val_index[np.lexsort((val_index, val_rank))]
    return np.sort(np.concatenate(train)), interleaved


def _check_num_classes(name: str, n_data: int, num_classes: int | None) -> None:
    if n_data < 2:
        raise DataError(
            f"dataset {name} has {n_data} class: a classifier learns nothing from one; give one "
            "sub-directory of images per class, two or more"
        )
    if num_classes is not None and n_data > num_classes:
        raise DataError(
            f"dataset {name} has {n_data} classes but the model outputs {num_classes}: "
            "use a model with a wider output layer or fewer class folders"
        )


def image_layout(dims: Sequence[int]) -> str:
    """``"NCHW"`` or ``"NHWC"``: the layout of an image input whose dims after the batch are
    ``dims``. Channels last when the last dim is 1 or 3 and the first is not (Keras through
    tf2onnx: ``[B, 96, 96, 3]``); channels first otherwise (torch, Paddle, Caffe2)."""
    dims = [int(d) for d in dims]
    if len(dims) == 3 and dims[2] in (1, 3) and dims[0] not in (1, 3):
        return "NHWC"
    return "NCHW"


def _check_input_shape(input_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    shape = tuple(int(v) for v in input_shape)
    if len(shape) != 3 or shape[0] not in (1, 3) or min(shape[1:]) < 1:
        raise DataError(f"input shape must be (C, H, W) with C 1 or 3, got {input_shape}")
    return shape  # type: ignore[return-value]


# ----------------------------------------------------------------------------- digits


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The embedded digits: images uint8 ``[1797, 8, 8]`` (0-16) and labels int64 ``[1797]``.

    Raises:
        DataError: ``etgraph/assets/digits.npz`` is missing (reinstall etgraph).
    """
    if not DIGITS_PATH.is_file():
        raise DataError(
            f"{DIGITS_PATH} is missing: reinstall etgraph or run models/pretrain_default.py"
        )
    with np.load(DIGITS_PATH) as npz:
        return npz["images"], npz["labels"].astype(np.int64)


def digits_images(images: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Upsample 8x8 digits (0-16) bilinearly to ``size = (H, W)`` and scale to [0, 1].

    Returns:
        float32 ``[N, H, W]``.
    """
    h, w = size
    out = np.empty((images.shape[0], h, w), dtype=np.float32)
    for i, img in enumerate(images.astype(np.float32) / 16.0):
        out[i] = np.asarray(Image.fromarray(img).resize((w, h), Image.BILINEAR))
    return out


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

    train, val = _stratified_split(task_labels, val_fraction, seed)
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

CHANNEL_ORDERS = ("rgb", "bgr")


@dataclass(frozen=True)
class Preprocess:
    """How an image's pixels become the model's input (the model's own preprocessing).

    For a pixel value ``p`` in 0-255 of channel ``c`` (channels in the model's order, after
    ``channel_order``)::

        x = (p / scale - mean[c]) / std[c]

    Attributes:
        mean: 1 value (every channel) or 3 (one per channel, in the model's channel order).
        std: as ``mean``; every value > 0.
        scale: pixels are divided by it first (255: [0, 1]; 1: 0-255), > 0.
        channel_order: ``"rgb"`` or ``"bgr"`` (the order of the model's input channels; grey
            models ignore it).
        preset: the preset these values started from (:data:`PREPROCESS_PRESETS`), or None.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: float
    channel_order: str
    preset: str | None = None

    def __post_init__(self):
        _check_channels(self.mean, "--mean", positive=False)
        _check_channels(self.std, "--std", positive=True)
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ConfigError(
                f"--scale must be a positive number, got {self.scale}: 255 maps pixels to [0, 1]"
            )
        if self.channel_order not in CHANNEL_ORDERS:
            raise ConfigError(f"unknown --channel-order {self.channel_order!r}: choose rgb or bgr")

    def arrays(self, channels: int) -> tuple[np.ndarray, np.ndarray]:
        """``(mean, std)`` as float32 ``[channels]``: one value is repeated, three values on a
        grey model (``channels == 1``) are averaged (a grey image is a mix of R, G and B)."""

        def expand(values: tuple[float, ...]) -> np.ndarray:
            a = np.asarray(values, dtype=np.float32)
            if a.size == channels:
                return a
            if a.size == 1:
                return np.repeat(a, channels)
            return a.mean(keepdims=True)  # 3 values, grey model

        return expand(self.mean), expand(self.std)

    def apply(self, pixels: np.ndarray) -> np.ndarray:
        """Normalise decoded images.

        Args:
            pixels: ``[N, H, W, C]`` pixel values in 0-255 (any real dtype), channels in RGB
                order (or one grey channel).

        Returns:
            float32 ``[N, C, H, W]`` in the model's channel order.
        """
        x = np.asarray(pixels, dtype=np.float32)
        channels = x.shape[-1]
        if channels == 3 and self.channel_order == "bgr":
            x = x[..., ::-1]
        mean, std = self.arrays(channels)
        x = (x / np.float32(self.scale) - mean) / std
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32)

    def describe(self) -> str:
        """One line: ``imagenet: rgb, x = (p/255 - [0.485, ...]) / [0.229, ...]``."""

        def fmt(values: tuple[float, ...]) -> str:
            return "[" + ", ".join(f"{v:g}" for v in values) + "]"

        name = f"{self.preset}: " if self.preset else ""
        return (
            f"{name}{self.channel_order}, x = (p/{self.scale:g} - {fmt(self.mean)}) / "
            f"{fmt(self.std)}"
        )

    def to_json(self) -> dict:
        """JSON-ready dict (``plan.json``, ``run.json``); :meth:`from_json` inverts it."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Preprocess:
        """Inverse of :meth:`to_json`.

        Raises:
            ConfigError: a field is missing or out of range.
        """
        try:
            return cls(
                mean=tuple(float(v) for v in data["mean"]),
                std=tuple(float(v) for v in data["std"]),
                scale=float(data["scale"]),
                channel_order=str(data["channel_order"]),
                preset=data.get("preset"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"preprocessing record {data!r} is malformed ({exc})") from exc


def _check_channels(values: tuple[float, ...], option: str, *, positive: bool) -> None:
    if len(values) not in (1, 3):
        raise ConfigError(
            f"{option} has {len(values)} values: give 1 (every channel) or 3 (one per channel, "
            "in the model's channel order)"
        )
    for i, v in enumerate(values):
        if not math.isfinite(v) or (positive and v <= 0):
            what = "positive" if positive else "finite"
            raise ConfigError(f"{option} value {i + 1} is {v}: every value must be {what}")


#: Preprocessing presets: ``imagenet`` (torchvision; Keras ``mode="torch"``; the default),
#: ``caffe`` (Caffe/Caffe2-era zoo models: BGR, 0-255 minus the per-channel ImageNet mean;
#: Keras ``mode="caffe"``), ``paddle`` ((x/255 - 0.5) / 0.5 = [-1, 1]; Keras ``mode="tf"``),
#: ``none`` (pixels scaled to [0, 1], nothing else).
PREPROCESS_PRESETS: dict[str, Preprocess] = {
    "imagenet": Preprocess((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 255.0, "rgb", "imagenet"),
    "caffe": Preprocess((103.939, 116.779, 123.68), (1.0,), 1.0, "bgr", "caffe"),
    "paddle": Preprocess((0.5,), (0.5,), 255.0, "rgb", "paddle"),
    "none": Preprocess((0.0,), (1.0,), 255.0, "rgb", "none"),
}
DEFAULT_PREPROCESS = PREPROCESS_PRESETS["imagenet"]
#: torchvision's ImageNet normalisation (of pixels in [0, 1], RGB): the default preprocessing.
IMAGENET_MEAN = np.array(DEFAULT_PREPROCESS.mean, dtype=np.float32)
IMAGENET_STD = np.array(DEFAULT_PREPROCESS.std, dtype=np.float32)

_NUMBER = r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*"


def parse_channel_values(text: str, option: str) -> tuple[float, ...]:
    """Parse ``"0.485,0.456,0.406"`` (or one number) into floats.

    Raises:
        ConfigError: malformed text (the option is named).
    """
    parts = str(text).split(",")
    if not all(re.fullmatch(_NUMBER, p) for p in parts):
        raise ConfigError(
            f"{option} {text!r} is malformed: give 1 or 3 comma-separated numbers, e.g. "
            "0.485,0.456,0.406"
        )
    return tuple(float(p) for p in parts)


def make_preprocess(
    preset: str | Preprocess | None = None,
    *,
    mean: str | Sequence[float] | None = None,
    std: str | Sequence[float] | None = None,
    scale: float | None = None,
    channel_order: str | None = None,
) -> Preprocess:
    """A :class:`Preprocess` from a preset (or a recorded one) with per-field overrides.

    Args:
        preset: a name in :data:`PREPROCESS_PRESETS`, a :class:`Preprocess` to start from, or
            None (``imagenet``).
        mean, std: ``"a,b,c"`` text or numbers; None keeps the preset's.
        scale, channel_order: None keeps the preset's.

    Returns:
        The preprocessing; its ``preset`` is kept only when nothing was overridden.

    Raises:
        ConfigError: unknown preset or channel order; malformed values; a count other than 1 or
            3; a std or scale that is not positive.
    """
    if preset is None:
        base = DEFAULT_PREPROCESS
    elif isinstance(preset, Preprocess):
        base = preset
    elif preset in PREPROCESS_PRESETS:
        base = PREPROCESS_PRESETS[preset]
    else:
        raise ConfigError(
            f"unknown --preprocess {preset!r}: choose one of {', '.join(PREPROCESS_PRESETS)}"
        )
    changes: dict = {}
    if mean is not None:
        changes["mean"] = (
            parse_channel_values(mean, "--mean")
            if isinstance(mean, str)
            else tuple(float(v) for v in mean)
        )
    if std is not None:
        changes["std"] = (
            parse_channel_values(std, "--std")
            if isinstance(std, str)
            else tuple(float(v) for v in std)
        )
    if scale is not None:
        changes["scale"] = float(scale)
    if channel_order is not None:
        changes["channel_order"] = str(channel_order).lower()
    changes = {k: v for k, v in changes.items() if getattr(base, k) != v}
    if not changes:
        return base
    return replace(base, preset=None, **changes)


# ----------------------------------------------------------------------------- image folders


def _scan_image_folder(root: Path) -> tuple[list[str], list[Path], np.ndarray]:
    """Class names (sorted sub-folder names), image files and their labels under ``root``."""
    if not root.exists():
        raise DataError(
            f"dataset directory {root} does not exist: pass --data an existing directory"
        )
    if not root.is_dir():
        raise DataError(
            f"dataset {root} is not a directory: pass a folder with one sub-folder per class"
        )
    subdirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not subdirs:
        if any(p.is_file() for p in root.iterdir()):
            raise DataError(
                f"dataset directory {root} has no class sub-folders: put each class's images "
                "in its own sub-folder (root/<class>/<image>)"
            )
        raise DataError(
            f"dataset directory {root} is empty: add one sub-folder of images per class"
        )
    files: list[Path] = []
    labels: list[int] = []
    for label, d in enumerate(subdirs):
        named = [
            p
            for p in d.rglob("*")
            if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")
        ]
        broken = [p for p in named if p.is_symlink() and not p.exists()]
        if broken:
            raise DataError(
                f"image {broken[0]} is a broken link ({len(broken)} in {d}): fix or remove it"
            )
        imgs = sorted(p for p in named if p.is_file())
        if not imgs:
            raise DataError(
                f"class folder {d} has no images ({', '.join(sorted(IMAGE_EXTENSIONS))}): "
                "add images or remove the folder"
            )
        files += imgs
        labels += [label] * len(imgs)
    return [d.name for d in subdirs], files, np.array(labels, dtype=np.int64)


#: What :func:`pixels` reads as 16-bit samples (0-65535): Pillow's 16-bit grey modes, and its
#: 32-bit integer mode, which is how some 16-bit files open.
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
#: The errors Pillow raises for a file it cannot read or a picture too large to decode.
IMAGE_ERRORS = (
    OSError,
    UnidentifiedImageError,
    ValueError,
    SyntaxError,
    Image.DecompressionBombError,
)


def pixels(img: Image.Image, mode: str) -> Image.Image:
    """``img`` as an 8-bit ``"RGB"`` or ``"L"`` picture (``mode``), or as an ``"F"`` picture of
    one grey channel holding 0-255 floats, from any mode Pillow opens:

    * 16-bit grey (``I;16*``, and ``I`` holding 0-65535): value / 65535 * 255;
    * float (``F``): values in [0, 1] are scaled by 255, values in [0, 255] kept;
    * alpha (``RGBA``, ``LA``, ``PA``, a palette with transparency): dropped, the colour stored
      under a transparent pixel is used (as torchvision's ``ImageFolder`` loader does);
    * palette, bilevel, CMYK, YCbCr, LAB, HSV: Pillow's conversion.

    Raises:
        ValueError: a 32-bit integer picture outside 0-65535, or a float one outside [0, 255]
            or not finite (the caller names the file).
    """
    if img.mode in _SIXTEEN_BIT_MODES or img.mode == "F":
        values = np.asarray(img, dtype=np.float32)  # exact for 16-bit samples
        low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
        if img.mode == "F":
            if not (np.isfinite(values).all() and low >= 0 and high <= 255):
                raise ValueError(
                    f"a float picture with values {low:g}..{high:g}, outside 0-1 and 0-255: "
                    "save it scaled to one of them, or as an 8- or 16-bit picture"
                )
            scale = 255.0 if high <= 1.0 else 1.0
        else:
            if low < 0 or high > 65535:
                raise ValueError(
                    f"a 32-bit integer picture with values {low:g}..{high:g}, beyond 16 bits: "
                    "save it as an 8- or 16-bit picture"
                )
            scale = 255.0 / 65535.0
        return Image.fromarray(values * np.float32(scale), "F")
    with warnings.catch_warnings():  # "Palette images with Transparency ...": alpha is dropped
        warnings.simplefilter("ignore", UserWarning)
        return img.convert(mode)


def _decode(path: Path, size: tuple[int, int], mode: str) -> np.ndarray:
    """Decode one image to float32 ``[H, W, C]`` in 0-255 (RGB or grey; :func:`pixels`),
    resized bilinearly."""
    h, w = size
    try:
        with Image.open(path) as img:
            img = pixels(img, mode).resize((w, h), Image.BILINEAR)
            arr = np.asarray(img, dtype=np.float32)
    except IMAGE_ERRORS as exc:
        raise DataError(f"cannot read image {path}: {exc}; remove or replace the file") from exc
    arr = arr[:, :, None] if arr.ndim == 2 else arr
    return np.repeat(arr, 3, axis=2) if mode == "RGB" and arr.shape[2] == 1 else arr


def load_image_folder(
    root: str | os.PathLike,
    *,
    input_shape: tuple[int, int, int],
    val_fraction: float = 0.2,
    seed: int = 0,
    check_images: bool = True,
    preprocess: Preprocess | None = None,
) -> Dataset:
    """An image-folder dataset: ``root/<class>/<image>``; labels follow sorted folder names.

    Args:
        root: dataset directory.
        input_shape: ``(C, H, W)``; C = 3 (RGB or BGR, see ``preprocess``) or 1 (grey).
        val_fraction: fraction of each class held out for validation.
        seed: split seed.
        check_images: open every file's header now, so an unreadable file fails at load time
            rather than mid-training (decoding happens per batch).
        preprocess: the model's input normalisation (None: ImageNet mean/std, RGB).

    Raises:
        DataError: directory missing, empty, without class sub-folders, a class without images,
            or an unreadable image (the file is named).
    """
    c, h, w = _check_input_shape(input_shape)
    root = Path(root)
    class_names, files, labels = _scan_image_folder(root)
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

    def load(index: np.ndarray) -> np.ndarray:
        return preprocess.apply(np.stack([_decode(files[i], (h, w), mode) for i in index]))

    train, val = _stratified_split(labels, val_fraction, seed)
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
        )
    _check_num_classes(ds.name, ds.num_classes, num_classes)
    return ds


# ----------------------------------------------------------------------------- arrays (.npz)


@dataclass
class ArrayDataset(_Split):
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
        _check_batch_size(batch_size)
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
        _check_batch_size(batch_size)
        for start in range(0, self.n_val, batch_size):
            yield self._batch(self.val_index[start : start + batch_size])

    def probe_batch(self, batch_size: int, seed: int):
        """A reproducible random training batch (without replacement), for importance."""
        _check_batch_size(batch_size)
        rng = np.random.default_rng(seed)
        index = rng.choice(self.train_index, size=min(batch_size, self.n_train), replace=False)
        return self._batch(np.sort(index))


def _random_split(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(n)`` at random: ``round(val_fraction * n)`` to validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"validation fraction must be in [0, 1), got {val_fraction}")
    order = np.random.default_rng(seed).permutation(n)
    n_val = min(int(round(val_fraction * n)), max(n - 1, 0))
    return np.sort(order[n_val:]), np.sort(order[:n_val])


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
        task: the output and loss (:class:`etgraph.model.Task`).
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
        train, val = _stratified_split(labels, val_fraction, seed)
    else:
        train, val = _random_split(n, val_fraction, seed)
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


# ----------------------------------------------------------------------------- text


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
    ids), labels mapped to the head's classes (``class_names`` from the data), split
    stratified per class.

    Raises:
        DataError: as :func:`etgraph.text.check_text_options`; a loss other than ce; token
            inputs of different or multi-dimensional per-sample shapes; and as
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
    )
    # each input in its own dtype: a float or bool attention mask, int32 ids
    arrays = {spec.name: text.inputs[spec.name].astype(spec.dtype, copy=False) for spec in inputs}
    train, val = _stratified_split(text.labels, val_fraction, seed)
    log.info("%s: %d texts (%d train, %d val)", path, text.labels.size, train.size, val.size)
    return ArrayDataset(str(path), arrays, text.labels, train, val, text.class_names)


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
) -> Dataset | ArrayDataset:
    """The dataset named by ``spec`` for a model: a ``.npz`` file (:func:`load_npz_dataset`,
    any model), a ``.csv``/``.jsonl`` text file tokenized with ``tokenizer``
    (:func:`load_text_dataset`, token models), else the digits task or an image folder
    (:func:`load_dataset`, normalised by ``preprocess``) for a model with one float image input
    ``[B, C, H, W]``, or ``[B, H, W, C]`` (:func:`image_layout`: fed channels last), trained
    with cross-entropy.

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
