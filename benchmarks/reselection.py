"""What a changed selection costs before its first step, part by part (issue 31).

    python benchmarks/reselection.py [--model resnet50] [--input-size 128] [--selections 3]

The model (a zoo name, exported at --input-size with 5 classes) gets its all-trainable
artifacts once (as a run holds them for importance and the reference steps); then for each of
``--selections`` selections (the last tensors from a varying start, plus three earlier ones; the
first as a run's first selection, without moments, the others carrying the moments of the later
half) the parts a period start pays when the selection changed: ``derive`` (the selection's
graphs from the all-trainable ones, :func:`etgraph.artifacts.derive`), ``generate`` (the same with
onnxblock, for comparison: what a re-selection cost before), ``checkpoint`` (the carried state
with the new trainable set and the moments of the later half, written where a run writes it,
:func:`etgraph.files.transient_file`, and removed), ``session``
(:class:`etgraph.sessions.TrainingSession`: frozen weights baked, ORT's checkpoint load, Module
and Optimizer) and the session's first step. Wall seconds, with the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from etgraph.artifacts import ArtifactCache, generate  # noqa: E402
from etgraph.checkpoint import CarriedState, checkpoint_bytes, write_checkpoint  # noqa: E402
from etgraph.files import transient_file  # noqa: E402
from etgraph.host import freeze_gc  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402
from etgraph.sessions import TrainingSession  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--input-size", type=int, default=128)
    ap.add_argument("--selections", type=int, default=3)
    args = ap.parse_args()
    from models.export import export_onnx

    with tempfile.TemporaryDirectory(prefix="reselection-") as tmp:
        work = Path(tmp)
        size = args.input_size
        path = export_onnx(args.model, work / "m.onnx", input_shape=(3, size, size), num_classes=5)
        model = LoadedModel.load(path)
        freeze_gc()  # as a run does: collections skip the libraries' objects
        static = (4, {model.input_names[0]: [3, size, size]})
        cache = ArtifactCache(work / "cache", static_batch=static)
        running = list(model.running_stats)
        full, _ = cache.get(model.proto, model.names, running, frozen_bn="inference")
        weights = model.initial_weights()
        rng = np.random.default_rng(0)
        x = rng.standard_normal((4, 3, size, size)).astype(np.float32)
        y = rng.integers(0, 5, 4).astype(np.int64)
        n = len(model.names)
        # the moments a run carries: those of the later half, trained in earlier periods
        moments = {
            name: {"momentum0": np.zeros_like(weights[name]), "momentum1": weights[name] ** 2}
            for name in model.names[n // 2 :]
        }
        rows = []
        for k in range(args.selections):
            mask = np.zeros(n, dtype=bool)
            start = n // 3 + (k * n) // (6 * max(args.selections, 1))
            mask[start:] = True
            mask[rng.choice(start, 3, replace=False)] = True
            trainable, frozen = model.split(mask)
            t: dict[str, float] = {}
            t0 = time.perf_counter()
            paths, _ = cache.get(
                model.proto, trainable, frozen, frozen_bn="inference", checkpoint=False, source=full
            )
            t["derive"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            generate(
                model.proto, trainable, frozen, work / f"generated{k}", frozen_bn="inference",
                checkpoint=False, static_batch=static,
            )  # fmt: skip
            t["generate"] = time.perf_counter() - t0
            # the first: a run's first selection (no moments, step 0), the others carry moments
            state = CarriedState(weights) if k == 0 else CarriedState(weights, moments, step=10)
            group = state.optimizer_state
            nbytes = checkpoint_bytes(weights, trainable, optimizer_state=group)
            t0 = time.perf_counter()
            with transient_file("session.ckpt", nbytes, work) as ckpt:  # as a run: in RAM if room
                write_checkpoint(ckpt, state, trainable, optimizer_state=group, durable=False)
                t["checkpoint"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                session = TrainingSession(
                    paths.directory, ckpt, None, input_names=model.input_names, weights=weights
                )
                t["session"] = time.perf_counter() - t0
            t["checkpoint"] += time.perf_counter() - t0 - t["session"]  # its removal
            t0 = time.perf_counter()
            session.train_step(x, y, 1e-4)
            t["first step"] = time.perf_counter() - t0
            del session
            t["changed selection"] = t["derive"] + t["checkpoint"] + t["session"]
            rows.append((f"{int(mask.sum())}/{n}" + ("" if group else ", first"), t))
    print(f"\n{args.model} {size} px, {n} tensors, load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores (s)")  # fmt: skip
    cols = list(rows[0][1])
    print("| selected | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for selected, t in rows:
        print(f"| {selected} | " + " | ".join(f"{t[c]:.3f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
