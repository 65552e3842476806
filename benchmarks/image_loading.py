"""Reading an image folder of phone photos, per epoch (issue 31: a small on-device dataset is
a person's photos, and decoding them must not eat the speedup).

    python benchmarks/image_loading.py [--photos 24] [--size 224] [--epochs 3] [--repeats 3]

Writes --photos JPEGs of 4032x3024 (12 MP, quality 90, photo-like: gradients and noise, 4-5
MB each) in two class folders, then reads --epochs epochs of training batches (batch 4) at
--size px three ways, side by side in one process, alternating the order per repeat:

* ``full decode`` — every file decoded at full size every epoch, then resized (etgraph before
  session 19, reproduced here with Pillow as it did it);
* ``draft`` — etgraph's loader without its cache (``cache_mb=0``): JPEGs decoded at the
  smallest DCT scale still at least --size (Pillow's ``draft``);
* ``draft + cache`` — etgraph's loader as a run uses it: decoded images kept (256 MiB).

Prints seconds per epoch (mean ± std over repeats) and the first/later epoch split.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from etgraph import data  # noqa: E402
from etgraph.data import load_dataset  # noqa: E402


def write_photos(root: Path, n: int) -> None:
    """``n`` photo-like 12 MP JPEGs in two class folders."""
    rng = np.random.default_rng(0)
    h, w = 3024, 4032
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x / w * 255, y / h * 255, (x + y) % 256], -1)
    for i in range(n):
        d = root / ("a" if i % 2 else "b")
        d.mkdir(parents=True, exist_ok=True)
        img = (base + rng.normal(0, 12, base.shape)).clip(0, 255).astype(np.uint8)
        Image.fromarray(img).save(d / f"IMG_{i:04d}.jpg", quality=90)


def full_decode(path: Path, size: tuple[int, int], mode: str) -> np.ndarray:
    """etgraph's decode before session 19: the whole picture, then resized."""
    h, w = size
    with Image.open(path) as img:
        arr = np.asarray(img.convert(mode).resize((w, h), Image.BILINEAR), dtype=np.float32)
    return arr[:, :, None] if arr.ndim == 2 else arr


def epochs_s(root: Path, size: int, epochs: int, way: str) -> list[float]:
    """Seconds of each epoch's training batches (batch 4) read ``way``."""
    real = data.decode_image
    if way == "full decode":
        data.decode_image = full_decode
    try:
        cache = 0.0 if way != "draft + cache" else data.IMAGE_CACHE_MB
        ds = load_dataset(root, input_shape=(3, size, size), val_fraction=0, cache_mb=cache)
        times = []
        for epoch in range(epochs):
            t0 = time.perf_counter()
            for _ in ds.train_batches(4, seed=epoch):
                pass
            times.append(time.perf_counter() - t0)
        return times
    finally:
        data.decode_image = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--photos", type=int, default=24)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ways = ["full decode", "draft", "draft + cache"]
    with tempfile.TemporaryDirectory(prefix="image-loading-") as tmp:
        root = Path(tmp) / "photos"
        write_photos(root, args.photos)
        runs: dict[str, list[list[float]]] = {w: [] for w in ways}
        for r in range(args.repeats):
            for way in ways if r % 2 == 0 else ways[::-1]:
                runs[way].append(epochs_s(root, args.size, args.epochs, way))
    print(
        f"\n{args.photos} photos of 12 MP (JPEG), {args.size} px, batch 4, {args.epochs} epochs, "
        f"{args.repeats} repeats (mean ± std)\n"
    )
    print("| reading | first epoch s | later epochs s (each) | whole run s | vs full decode |")
    print("|---|---|---|---|---|")
    whole = {w: [sum(t) for t in runs[w]] for w in ways}
    for way in ways:
        first = [t[0] for t in runs[way]]
        later = [np.mean(t[1:]) for t in runs[way]] if args.epochs > 1 else [float("nan")]
        ratio = np.array(whole["full decode"]) / np.array(whole[way])
        print(
            f"| {way} | {np.mean(first):.2f} ± {np.std(first):.2f} | {np.mean(later):.2f} ± "
            f"{np.std(later):.2f} | {np.mean(whole[way]):.2f} ± {np.std(whole[way]):.2f} | "
            f"{ratio.mean():.1f} ± {ratio.std():.1f}x less |"
        )


if __name__ == "__main__":
    main()
