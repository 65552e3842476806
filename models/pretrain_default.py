"""Build the embedded default: digits data file and the pretrained default model.

The paper (§8) fine-tunes ImageNet-pretrained models on new datasets with a new output layer.
The embedded default reproduces that setup offline and small:

1. scikit-learn's bundled handwritten digits are written once to ``etgraph/assets/digits.npz``
   (images uint8 [1797, 8, 8] with values 0-16, labels int64 [1797]) so etgraph needs no
   scikit-learn at run time.
2. ``default_cnn`` (``models.zoo.DefaultCNN``: five conv-BN-ReLU blocks, global average pool,
   linear head; input 3x32x32 — digits upsampled bilinearly, grey replicated to 3 channels,
   normalised with the digits' mean/std, exactly as ``etgraph.data.load_digits_task`` does) is
   **pretrained in torch on digits 0-4**.
3. Its head is replaced by a freshly initialised 5-class head (the new output layer for the
   new task: digits 5-9, relabelled 0-4), and the model is exported for training to
   ``etgraph/assets/default_model.onnx`` with ``default_model.json`` (input_shape,
   num_classes, dataset, pretrain accuracy, seed).

Deterministic for a given seed on a given machine (seeded torch RNG, deterministic algorithms,
one thread). Run from the repository root::

    python -m models.pretrain_default            # writes etgraph/assets/*
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import click
import numpy as np
import torch
from torch import nn

from etgraph import data
from models import zoo
from models.export import export_onnx

log = logging.getLogger(__name__)

INPUT_SHAPE = (3, 32, 32)


def write_digits(path: Path = data.DIGITS_PATH) -> Path:
    """Write scikit-learn's digits to ``path`` as ``images`` uint8 [1797, 8, 8] (0-16) and
    ``labels`` int64 [1797] (needs scikit-learn; only this script does)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.rint(bunch.images).astype(np.uint8)
    labels = bunch.target.astype(np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, images=images, labels=labels)
    log.info("wrote %s (%d images)", path, len(labels))
    return path


def _accuracy(model: nn.Module, ds: data.Dataset) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in ds.val_batches(256):
            correct += int((model(torch.from_numpy(x)).argmax(1).numpy() == y).sum())
    model.train()
    return correct / ds.n_val


def pretrain(
    *, epochs: int = 15, batch_size: int = 32, lr: float = 2e-3, seed: int = 0
) -> tuple[nn.Module, float, data.Dataset]:
    """Pretrain ``default_cnn`` on digits 0-4 with Adam and cosine decay.

    Returns:
        ``(model, val_accuracy, dataset)``: the trained module (5-class head for digits 0-4),
        its accuracy on the held-out 20 % of digits 0-4 (fraction in [0, 1]), and the dataset.
    """
    ds = data.load_digits_task(data.DIGITS_PRETRAIN_CLASSES, input_shape=INPUT_SHAPE, seed=seed)
    model = zoo.build(zoo.DEFAULT_MODEL, len(data.DIGITS_PRETRAIN_CLASSES), seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * ds.steps_per_epoch(batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        total, n = 0.0, 0
        for x, y in ds.train_batches(batch_size, seed=seed * 1000 + epoch):
            loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total, n = total + loss.item(), n + 1
        log.info("epoch %d: train loss %.4f, val acc %.4f", epoch, total / n, _accuracy(model, ds))
    return model, _accuracy(model, ds), ds


def build_default(*, seed: int = 0, epochs: int = 15, out_dir: Path = data.ASSETS_DIR) -> dict:
    """Write digits.npz (if missing), pretrain, replace the head, export the default model.

    Returns:
        The metadata written to ``default_model.json``.
    """
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if not data.DIGITS_PATH.is_file():
        write_digits()
    t0 = time.perf_counter()
    model, acc, ds = pretrain(epochs=epochs, seed=seed)
    pretrain_s = time.perf_counter() - t0
    # New output layer for the new task (digits 5-9), freshly initialised (paper §8 setup).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model.fc = nn.Linear(model.fc.in_features, len(data.DIGITS_TRANSFER_CLASSES))
    onnx_path = export_onnx(model, out_dir / data.DEFAULT_MODEL_PATH.name, input_shape=INPUT_SHAPE)
    info = {
        "architecture": zoo.DEFAULT_MODEL,
        "input_shape": list(INPUT_SHAPE),
        "num_classes": len(data.DIGITS_TRANSFER_CLASSES),
        "dataset": "digits",
        "transfer_classes": list(data.DIGITS_TRANSFER_CLASSES),
        "pretrain_classes": list(data.DIGITS_PRETRAIN_CLASSES),
        "pretrain_val_accuracy": round(acc, 4),
        "pretrain_n_train": ds.n_train,
        "pretrain_n_val": ds.n_val,
        "pretrain_epochs": epochs,
        "params": zoo.count_params(model),
        "seed": seed,
        "head": "fresh 5-class linear layer (digits 5-9 relabelled 0-4)",
    }
    (out_dir / data.DEFAULT_MODEL_INFO_PATH.name).write_text(json.dumps(info, indent=2) + "\n")
    log.info("default model %s: pretrain accuracy %.4f (%.0f s)", onnx_path, acc, pretrain_s)
    return info


@click.command()
@click.option("--seed", default=0, show_default=True)
@click.option("--epochs", default=15, show_default=True)
@click.option("--refresh-digits", is_flag=True, help="Rewrite digits.npz from scikit-learn.")
def main(seed: int, epochs: int, refresh_digits: bool) -> None:
    """Write etgraph/assets/{digits.npz, default_model.onnx, default_model.json}."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if refresh_digits:
        write_digits()
    info = build_default(seed=seed, epochs=epochs)
    click.echo(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
