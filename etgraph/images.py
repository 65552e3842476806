"""Images: pictures decoded from any mode Pillow opens, the model's input normalisation
(:class:`Preprocess` and its presets), image folders scanned, and the embedded digits.

Pure functions and values over numpy and Pillow; the datasets built from them are
:mod:`etgraph.data`'s (:class:`etgraph.data.Dataset`).
"""

from __future__ import annotations

import logging
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import ConfigError, DataError

log = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
#: scikit-learn's digits as ``images`` uint8 [1797, 8, 8] (values 0-16) and ``labels`` int64.
DIGITS_PATH = ASSETS_DIR / "digits.npz"


def image_layout(dims: Sequence[int]) -> str:
    """``"NCHW"`` or ``"NHWC"``: the layout of an image input whose dims after the batch are
    ``dims``. Channels last when the last dim is 1 or 3 and the first is not (Keras through
    tf2onnx: ``[B, 96, 96, 3]``); channels first otherwise (torch, Paddle, Caffe2)."""
    dims = [int(d) for d in dims]
    if len(dims) == 3 and dims[2] in (1, 3) and dims[0] not in (1, 3):
        return "NHWC"
    return "NCHW"


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


IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
    | ({".avif"} & set(Image.registered_extensions()))  # Pillow >= 11.3 opens AVIF
)

#: Photo formats Pillow cannot open (HEIC/HEIF, a phone's default; JPEG XL; camera raw): the
#: files of a class folder in them are named, never left out without a word.
PHOTO_EXTENSIONS_UNREAD = (
    frozenset(".heic .heif .avif .jxl .dng .cr2 .cr3 .nef .arw .orf .rw2 .raf".split())
    - IMAGE_EXTENSIONS
)


def _counts(paths: Sequence[Path]) -> str:
    """``"12 .heic, 3 .dng"``: how many of ``paths`` have each suffix."""
    suffixes = [p.suffix.lower() for p in paths]
    return ", ".join(f"{suffixes.count(s)} {s}" for s in sorted(set(suffixes)))


def scan_image_folder(root: Path) -> tuple[list[str], list[Path], np.ndarray]:
    """Class names (sorted sub-folder names), image files (at any depth under a class folder)
    and their labels under ``root``; hidden files and folders (``.DS_Store``, ``.thumbnails/``)
    are skipped."""
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
    unread: list[Path] = []
    for label, d in enumerate(subdirs):
        visible = [  # hidden files and folders skipped at any depth, as hidden classes are
            p
            for p in d.rglob("*")
            if not any(part.startswith(".") for part in p.relative_to(d).parts)
        ]
        named = [p for p in visible if p.suffix.lower() in IMAGE_EXTENSIONS]
        photos = [p for p in visible if p.suffix.lower() in PHOTO_EXTENSIONS_UNREAD]
        broken = [p for p in named if p.is_symlink() and not p.exists()]
        if broken:
            raise DataError(
                f"image {broken[0]} is a broken link ({len(broken)} in {d}): fix or remove it"
            )
        imgs = sorted(p for p in named if p.is_file())
        if not imgs and photos:
            raise DataError(
                f"class folder {d} has only photos etgraph cannot read ({_counts(photos)}): "
                "convert them to JPEG or PNG"
            )
        if not imgs:
            raise DataError(
                f"class folder {d} has no images ({', '.join(sorted(IMAGE_EXTENSIONS))}): "
                "add images or remove the folder"
            )
        files += imgs
        labels += [label] * len(imgs)
        unread += photos
    if unread:
        log.warning(
            "%d photos under %s are in formats etgraph cannot read and are left out (%s): "
            "convert them to JPEG or PNG to train on them",
            len(unread),
            root,
            _counts(unread),
        )
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


def upright(img: Image.Image, path: Path) -> Image.Image:
    """``img`` turned as its EXIF ``Orientation`` tag says, in place: a phone stores a photo as
    its sensor saw it and tags how to turn it, and galleries (and Hugging Face ``datasets``
    since 2024) show it turned; without this a portrait photo trained lying on its side. A tag
    that cannot be read leaves the picture as stored (a warning names the file)."""
    try:
        ImageOps.exif_transpose(img, in_place=True)
    except Exception as exc:  # a malformed EXIF block raises anything (datasets #7668)
        log.warning("%s: its EXIF orientation cannot be read (%s): used as stored", path, exc)
    return img


def decode_image(path: Path, size: tuple[int, int], mode: str) -> np.ndarray:
    """Decode one image to ``[H, W, C]`` in 0-255 (RGB or grey; :func:`pixels`), upright
    (:func:`upright`), resized bilinearly: uint8 for 8-bit pictures (exact), float32 for 16-bit
    and float ones.

    A JPEG is decoded at the smallest of 1/1, 1/2, 1/4 and 1/8 of its size that is still at
    least ``size`` either way up (libjpeg's DCT scaling, Pillow's ``draft``): a 12 MP phone
    photo to 224 px in 50-73 ms instead of 152-202 ms here, pixels within 0.5 of 255 on
    average of the full decode's.
    """
    h, w = size
    try:
        with Image.open(path) as img:
            img.draft(None, (max(h, w), max(h, w)))  # before loading; a no-op but for JPEG
            img = pixels(upright(img, path), mode).resize((w, h), Image.BILINEAR)
            arr = np.asarray(img)
    except IMAGE_ERRORS as exc:
        raise DataError(f"cannot read image {path}: {exc}; remove or replace the file") from exc
    arr = arr[:, :, None] if arr.ndim == 2 else arr
    return np.repeat(arr, 3, axis=2) if mode == "RGB" and arr.shape[2] == 1 else arr
