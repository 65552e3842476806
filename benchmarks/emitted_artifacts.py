"""The compile-time time model against the artifacts `etgraph compile` emits, stepped by ORT's
documented loop with its default options (issue 31).

    python benchmarks/emitted_artifacts.py [--model mobilenet_v2] [--input-size 128]
                                           [--rhos 0.3,0.4,0.5,0.6,0.7] [--rounds 5] [--steps 5]

The model (a zoo name exported at --input-size with 5 classes, or an .onnx file) is compiled
(``etgraph.pipeline.compile_model``, profile cached) at rho 1 (every tensor: the full step) and
at each of ``--rhos``. Each compiled directory's ``artifacts/`` (frozen parameters baked in,
``plan.json`` ``artifacts_form``) is stepped as a user's own loop would: ``CheckpointState``,
``Module`` and ``Optimizer`` with ORT's default ``SessionOptions``, ``module(x, y)``,
``optimizer.step()``, ``lazy_reset_grad()`` — round robin with the full artifacts, one session
alive at a time (opened, two untimed steps, ``--steps`` timed, released), ``--rounds`` rounds.
The measured ratio to the full step (medians) is compared with the plan's predicted ratio
(``predicted_step_us / t_full_us``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.training import api

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from etgraph.pipeline import compile_model  # noqa: E402


class _Loop:
    """ORT's documented training loop on one artifacts directory, ORT's default options."""

    def __init__(self, directory: Path):
        self.state = api.CheckpointState.load_checkpoint(str(directory / "checkpoint"))
        self.module = api.Module(
            str(directory / "training_model.onnx"),
            self.state,
            str(directory / "eval_model.onnx"),
            session_options=ort.SessionOptions(),
        )
        self.optimizer = api.Optimizer(str(directory / "optimizer_model.onnx"), self.module)
        self.module.train()

    def step(self, x, y) -> float:
        t0 = time.perf_counter()
        self.module(x, y)
        self.optimizer.step()
        self.module.lazy_reset_grad()
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--input-size", type=int, default=128)
    ap.add_argument("--rhos", default="0.3,0.4,0.5,0.6,0.7")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    rhos = [float(r) for r in args.rhos.split(",")]
    size = args.input_size
    with tempfile.TemporaryDirectory(prefix="emitted-") as tmp:
        work = Path(tmp)
        if args.model.endswith(".onnx"):
            path = Path(args.model)
        else:
            from models.export import export_onnx

            path = export_onnx(args.model, work / "m.onnx", input_shape=(3, size, size),
                               num_classes=5)  # fmt: skip
        plans, dirs = {}, {}
        for rho in [1.0, *rhos]:
            out = work / f"rho{rho}"
            compile_model(path, out, rho=rho, cache_dir=work / "cache")
            plans[rho] = json.loads((out / "plan.json").read_text())
            dirs[rho] = out / "artifacts"
        rng = np.random.default_rng(0)
        x = rng.standard_normal((4, 3, size, size)).astype(np.float32)
        y = rng.integers(0, 5, 4).astype(np.int64)
        times: dict[float, list[float]] = {rho: [] for rho in dirs}
        for r in range(args.rounds):
            order = list(dirs) if r % 2 == 0 else list(dirs)[::-1]
            for rho in order:
                # one session alive at a time, as in a user's loop: an idle session's spinning
                # pool (ORT's default) takes the cores from the one stepping
                loop = _Loop(dirs[rho])
                loop.step(x, y)
                loop.step(x, y)  # the first steps allocate
                times[rho] += [loop.step(x, y) for _ in range(args.steps)]
                del loop
    full_ms = float(np.median(times[1.0])) * 1e3
    print(f"\n{Path(args.model).stem} {size} px, load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores; full step {full_ms:.1f} ms (ORT defaults)")  # fmt: skip
    print("| rho | form | tensors | step ms | measured ratio | predicted ratio | error |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    for rho in rhos:
        plan = plans[rho]
        step_ms = float(np.median(times[rho])) * 1e3
        measured = step_ms / full_ms
        predicted = plan["predicted_step_us"] / plan["t_full_us"]
        errors.append(abs(measured / predicted - 1.0))
        selected = sum(t["selected"] for t in plan["tensors"])
        print(f"| {rho} | {plan.get('artifacts_form', 'inputs')} | {selected}/"
              f"{len(plan['tensors'])} | {step_ms:.1f} | {measured:.3f} | {predicted:.3f} | "
              f"{100 * errors[-1]:.1f}% |")  # fmt: skip
    print(f"error of the ratio: mean {100 * np.mean(errors):.1f}%, max {100 * np.max(errors):.1f}%")


if __name__ == "__main__":
    main()
