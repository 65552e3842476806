"""Selections under a memory budget, measured (issue #17): what a budget costs and whether the
selection's training process stays within it.

For a compiled directory (``etgraph compile ... --memory-mb M``: ``plan.json``, ``profile.json``,
``memory.json``, ``model.onnx``) and a rho: the time-only DP selection, then the DP under each
memory budget (fractions of the predicted full-training peak, or MiB), each trained for 3 steps in
a fresh process (:func:`etgraph.memory_profiler.measure_peaks`: the libraries ``etgraph train``
imports, checkpoint, Module + AdamW, steps). Prints tensors selected, importance kept (vs the
time-only selection, same importance as the plan), predicted step ratio, predicted and measured
peak (``VmHWM``), and whether the measured peak is within the budget (+2% tolerance).

That table measures the selection's training process. ``--runs DATA`` measures whole
``etgraph train`` runs instead (subprocesses, as a user runs them; ``VmHWM`` of the process
polled every 10 ms, and the log's per-period peaks): full training, the time-only elastic
selection, and elastic under each budget (fractions of the full run's measured peak, or MiB);
a budget below the run's smallest feasible one is reported and the run repeated at that one
+ 5%. Each run: 2 epochs of ``--steps`` steps, re-selection every epoch, open loop, on an image
folder ``DATA``. Importance kept compares the first period's selections (same weights, same
probe batch) under the importance measured at the initial weights.

Usage::

    etgraph compile resnet50_128.onnx --input-shape 3x128x128 --memory-mb 600 -o r50
    python benchmarks/memory_budget.py r50 --rho 0.5 --budget 0.6 --budget 0.62 --budget 0.65
    python benchmarks/memory_budget.py r50 --runs images/ --budget 0.6 --json out.json
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from etgraph import artifacts  # noqa: E402
from etgraph.errors import InfeasibleBudgetError  # noqa: E402
from etgraph.memory import MemoryProfile  # noqa: E402
from etgraph.memory_profiler import measure_peaks  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402
from etgraph.profile import Profile  # noqa: E402
from etgraph.selection import MemoryCosts, select_for_rho  # noqa: E402


@click.command()
@click.argument("compiled", type=click.Path(exists=True, file_okay=False))
@click.option("--rho", default=0.5, show_default=True)
@click.option(
    "--budget",
    "budgets",
    multiple=True,
    type=float,
    help="Budget: a fraction (<= 1) of the predicted full-training peak, or MiB (> 1).",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option(
    "--runs",
    "runs_data",
    type=click.Path(exists=True),
    default=None,
    help="Measure whole `etgraph train` runs on this image folder instead.",
)
@click.option("--steps", default=3, show_default=True, help="Steps per epoch of each run.")
def main(compiled, rho, budgets, json_path, runs_data, steps) -> None:
    if runs_data is not None:
        # absolute: the runs are subprocesses started in the repository's root
        whole_runs(
            Path(compiled).resolve(),
            rho,
            budgets or (0.6,),
            Path(runs_data).resolve(),
            steps,
            json_path,
        )
        return
    d = Path(compiled)
    plan = json.loads((d / "plan.json").read_text())
    prof = Profile.load(d / "profile.json")
    mem = MemoryProfile.load(d / "memory.json")
    model = LoadedModel.load(d / "model.onnx")
    shapes = {k: tuple(v) for k, v in plan["input_shapes"].items()}
    (shape,) = shapes.values()  # the memory model measures one-image-input models
    model_b = model.with_batch(plan["batch_size"], shapes)
    importance = np.array([r["importance"] for r in plan["tensors"]])
    full = mem.full_peak_mb
    time_only = select_for_rho(prof, rho, importance)
    cases = [("time only", None, time_only)]
    for b in budgets or (0.6, 0.65, 0.7):
        budget_mb = b * full if b <= 1 else b
        try:
            memory = MemoryCosts.from_profile(mem, budget_mb)
            cases.append(
                (
                    f"{budget_mb:.0f}",
                    budget_mb,
                    select_for_rho(prof, rho, importance, memory=memory),
                )
            )
        except InfeasibleBudgetError as exc:
            print(f"budget {budget_mb:.0f} MiB: {exc}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="etgraph-membudget-") as tmp:
        dirs = [
            artifacts.generate(model_b, *model.split(s.mask), Path(tmp) / f"m{i}").directory
            for i, (_, _, s) in enumerate(cases)
        ]
        measured = measure_peaks(
            dirs,
            batch_size=plan["batch_size"],
            input_shape=shape,
            threads=mem.threads,
        )
    for (_, budget_mb, s), raw in zip(cases, measured, strict=True):
        peak = raw["steps"]["VmHWM"]
        rows.append(
            {
                "budget_mb": budget_mb,
                "budget_fraction": None if budget_mb is None else budget_mb / full,
                "tensors": s.count,
                "importance_kept": s.objective / time_only.objective,
                "step_ratio_predicted": prof.predicted_step_us(s.mask) / prof.t_full_us,
                "predicted_mb": mem.peak_mb(s.mask),
                "measured_mb": peak,
                "within_budget": None if budget_mb is None else bool(peak <= 1.02 * budget_mb),
            }
        )
    print(
        f"full-training peak (predicted) {full:.0f} MiB, smallest feasible "
        f"{mem.min_feasible_mb():.0f} MiB, rho {rho}"
    )
    print(
        "| budget MiB (of full) | tensors | importance kept | step ratio (pred) | "
        "predicted MiB | measured MiB | within budget +2% |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        budget = (
            "time only"
            if r["budget_mb"] is None
            else (f"{r['budget_mb']:.0f} ({100 * r['budget_fraction']:.0f}%)")
        )
        within = "" if r["within_budget"] is None else ("yes" if r["within_budget"] else "NO")
        print(
            f"| {budget} | {r['tensors']} | {100 * r['importance_kept']:.0f}% | "
            f"{r['step_ratio_predicted']:.3f} | {r['predicted_mb']:.0f} | "
            f"{r['measured_mb']:.0f} | {within} |"
        )
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))


def _polled_run(cmd: list[str]) -> tuple[int, float, str]:
    """Run ``cmd``; return (exit code, max VmHWM polled every 10 ms in MiB, stderr)."""
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
        peak = 0.0
        while proc.poll() is None:
            try:
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]) / 1024.0)
            except OSError:
                pass
            time.sleep(0.01)
        err.seek(0)
        return proc.returncode, peak, err.read()


def _train(compiled: Path, out: Path, data: Path, steps: int, extra: list[str]) -> dict:
    """One `etgraph train` run; its measured peak (polled VmHWM and the log's per-period peaks,
    which include what happens between polls) and log records."""
    cmd = [sys.executable, "-m", "etgraph", "train", str(compiled), "--data", str(data)]
    cmd += ["--epochs", "2", "--period", "1", "--max-steps-per-epoch", str(steps)]
    cmd += ["--max-val-batches", "2", "--open-loop", "--quiet", "--out", str(out), *extra]
    t0 = time.perf_counter()
    code, polled, err = _polled_run(cmd)
    wall = time.perf_counter() - t0
    if code != 0:
        return {"error": [ln for ln in err.splitlines() if ln.strip()][-1], "wall_s": wall}
    records = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    logged = max(r["peak_rss_mb"] for r in records)
    return {"records": records, "polled_mb": polled, "peak_mb": max(polled, logged), "wall_s": wall}


def whole_runs(compiled: Path, rho: float, budgets, data: Path, steps: int, json_path) -> None:
    """The real-run table (module docstring)."""
    from etgraph.importance import probe_importance

    plan = json.loads((compiled / "plan.json").read_text())
    mem = MemoryProfile.load(compiled / "memory.json")
    model = LoadedModel.load(compiled / "model.onnx")
    importance = probe_importance(
        model,
        str(data),
        batch_size=plan["batch_size"],
        input_shapes={k: tuple(v) for k, v in plan["input_shapes"].items()},
        seed=100_000,  # the run's first probe batch (seed 0, period 0)
    )
    del model
    rows = []
    with tempfile.TemporaryDirectory(prefix="etgraph-runs-") as tmp:
        full = _train(compiled, Path(tmp) / "full", data, steps, ["--strategy", "full"])
        timed = _train(compiled, Path(tmp) / "time", data, steps, ["--rho", str(rho)])
        base = {"full": full, "time_only": timed}
        cases = []
        for b in budgets:
            budget = b * full["peak_mb"] if b <= 1 else b
            out = Path(tmp) / f"b{len(cases)}"
            run = _train(
                compiled, out, data, steps, ["--rho", str(rho), "--memory-mb", f"{budget:.0f}"]
            )
            infeasible = None
            if "error" in run:
                found = re.search(r"pass --memory-mb (\d+) or more", run["error"])
                if not found:
                    raise SystemExit(f"budget {budget:.0f} MiB: {run['error']}")
                infeasible = run["error"]
                budget = 1.05 * float(found.group(1))
                run = _train(compiled, Path(tmp) / f"b{len(cases)}x", data, steps,
                             ["--rho", str(rho), "--memory-mb", f"{budget:.0f}"])  # fmt: skip
            cases.append((b, round(budget), infeasible, run))

    def first_selection(run):
        m = np.zeros(len(importance), dtype=bool)
        m[run["records"][0]["selection"]] = True
        return m

    t_mask = first_selection(timed)
    full_step = float(np.median([r["median_step_us"] for r in full["records"]]))
    for b, budget, infeasible, run in cases:
        if "error" in run:
            print(f"| {compiled.name} | budget {budget} MiB | failed: {run['error']} |")
            rows.append({"model": compiled.name, "budget_mb": budget, "error": run["error"]})
            continue
        recs = run["records"]
        mask = first_selection(run)
        rows.append(
            {
                "model": compiled.name,
                "full_run_peak_mb": full["peak_mb"],
                "full_session_peak_predicted_mb": mem.full_peak_mb,
                "time_only_run_peak_mb": timed["peak_mb"],
                "requested": b,
                "budget_mb": budget,
                "infeasible": infeasible,
                "tensors": [len(r["selection"]) for r in recs],
                "importance_kept": float(importance[mask].sum() / importance[t_mask].sum()),
                "predicted_peak_mb": [r["predicted_peak_mb"] for r in recs],
                "period_peak_mb": [r["peak_rss_mb"] for r in recs],
                "measured_peak_mb": run["peak_mb"],
                "polled_peak_mb": run["polled_mb"],
                "within_budget": bool(run["peak_mb"] <= 1.02 * budget),
                "step_ratio_predicted": [r["rho_predicted"] for r in recs],
                "step_ratio_measured": float(
                    np.median([r["median_step_us"] for r in recs]) / full_step
                ),
                "wall_s": {
                    "full": full["wall_s"],
                    "time_only": timed["wall_s"],
                    "budget": run["wall_s"],
                },
            }
        )
    print(
        "| model | full run peak MiB | budget MiB | tensors (per period) | importance kept vs "
        "time-only | predicted MiB | measured MiB | vs budget | step ratio pred / measured |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            continue
        asked = r["requested"]
        asked = f"{100 * asked:.0f}% of full" if asked <= 1 else f"{asked:.0f} MiB"
        note = f"{r['budget_mb']}" + (
            f" ({asked} infeasible: smallest + 5%)" if r["infeasible"] else f" ({asked})"
        )
        print(
            f"| {r['model']} | {r['full_run_peak_mb']:.0f} | {note} | "
            f"{'/'.join(map(str, r['tensors']))} | {100 * r['importance_kept']:.0f}% | "
            f"{max(r['predicted_peak_mb']):.0f} | {r['measured_peak_mb']:.0f} | "
            f"{100 * (r['measured_peak_mb'] / r['budget_mb'] - 1):+.1f}% | "
            f"{np.mean(r['step_ratio_predicted']):.2f} / {r['step_ratio_measured']:.2f} |"
        )
    if json_path:
        Path(json_path).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "base": {
                        k: {kk: vv for kk, vv in v.items() if kk != "records"}
                        for k, v in base.items()
                    },
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
