"""Frozen batch norm: ``--frozen-bn inference`` vs ``train`` on the default task (issue #14).

    python benchmarks/frozen_bn.py [--seeds 0 1 2] [--epochs 12] [--period 3] [--rho 0.5]
                                   [--strategies elastic last-layer]
    python benchmarks/frozen_bn.py --steps-only --model M.onnx [--rho 0.5]   (step ratios only)

For each seed and strategy, the two modes are trained one after the other (same profile, same
data order): with ``inference`` a batch norm whose gamma and beta are both unselected runs in
inference mode (running statistics used and kept); with ``train`` every batch norm uses batch
statistics and updates its running statistics. Each mode selects with its own time model
(``Profile.for_frozen_bn``). Prints per mode the final validation accuracy (mean and per seed),
the exported model's accuracy and the mean measured and predicted step of the runs.

Step times of whole runs on a shared machine are noisy, so the step-time ratio is measured
apart: for every selection the runs made, its training steps in both modes (and full training)
are timed round-robin in one process (20th percentile of ``--rounds``,
:func:`etgraph.measure.robust_time`), next to the time model's predicted ratio. By default
everything runs on one ORT thread and real steps are timed by the thread's CPU time
(``--threads 1 --clock cpu``, :func:`etgraph.measure.step_clock`), which other processes on a
loaded machine do not inflate; ``--threads 2 --clock wall`` measures the wall clock.
Results go to ``benchmarks/results/frozen_bn.json``, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from etgraph import measure, profile, profiler, rundir  # noqa: E402
from etgraph.artifacts import ArtifactCache  # noqa: E402
from etgraph.checkpoint import CarriedState, write_checkpoint  # noqa: E402
from etgraph.config import TrainConfig  # noqa: E402
from etgraph.data import DEFAULT_MODEL_PATH, load_dataset  # noqa: E402
from etgraph.loop import train  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402
from etgraph.sessions import TrainingSession  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODES = ("inference", "train")


def _mean_step_us(log: list[dict], key: str) -> float:
    steps = np.array([e["steps"] for e in log], dtype=np.float64)
    return float(np.average([e[key] for e in log], weights=steps))


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    return "\n".join([line, sep, *body])


def step_ratios(
    model: LoadedModel, prof, selections, rounds: int, work: Path, clock: str
) -> list[dict]:
    """Training step (µs, 20th percentile) of every selection in both modes and of full
    training, timed round-robin (one step each per round, after 5 warm-up rounds) by ``clock``,
    with the time model's predictions."""
    timer = measure.step_clock(clock, prof.threads)
    n = len(model.tensors)
    cache = ArtifactCache(work / "rr")
    data = load_dataset(None, input_shape=tuple(*model.input_shapes().values()))
    x, y = data.probe_batch(4, seed=0)
    initial = CarriedState(model.initial_weights())
    masks = {"full": np.ones(n, dtype=bool)}
    for sel in selections:
        mask = np.zeros(n, dtype=bool)
        mask[list(sel)] = True
        masks[",".join(map(str, sel))] = mask
    sessions = {}
    for key, mask in masks.items():
        for mode in MODES if key != "full" else ("train",):
            trainable, frozen = model.split(mask)
            paths, _ = cache.get(model.proto, trainable, frozen, frozen_bn=mode)
            ckpt = work / f"rr-{len(sessions)}.ckpt"
            write_checkpoint(ckpt, initial, trainable, initial_learning_rate=1e-4)
            sessions[key, mode] = TrainingSession(
                paths.directory, ckpt, prof.threads, input_names=model.input_names
            )
    times = {k: [] for k in sessions}
    for r in range(rounds + 5):
        for k, session in sessions.items():
            t0 = timer()
            session.train_step(x, y, 1e-6)
            if r >= 5:
                times[k].append(timer() - t0)
    full_us = measure.robust_time(times["full", "train"]) * 1e6
    rows = []
    for key, mask in masks.items():
        if key == "full":
            continue
        measured = {m: measure.robust_time(times[key, m]) * 1e6 for m in MODES}
        predicted = {m: prof.for_frozen_bn(m).predicted_step_us(mask) for m in MODES}
        rows.append(
            dict(
                selection=key,
                measured_us=measured,
                predicted_us=predicted,
                full_us=full_us,
                measured_ratio=measured["inference"] / measured["train"],
                predicted_ratio=predicted["inference"] / predicted["train"],
            )
        )
    return rows


def steps_only(path: Path, rho: float, rounds: int, threads: int, clock: str) -> dict:
    """The round-robin step ratios of one model: the DP selection at ``rho`` of each mode's
    time model (data-free importance: speed does not depend on which tensors score high) and
    the last layer."""
    from etgraph.pipeline import data_free_importance
    from etgraph.selection import select_for_rho

    model = LoadedModel.load(path)
    prof = profiler.profile_model(
        model, batch_size=4, threads=threads, clock=clock, cache_dir=profile.default_cache_dir()
    )
    importance = data_free_importance(list(model.tensors))
    n = len(model.tensors)
    selections = {(n - 2, n - 1)}
    for mode in MODES:
        mask = select_for_rho(prof.for_frozen_bn(mode), rho, importance).mask
        selections.add(tuple(int(i) for i in np.flatnonzero(mask)))
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        steps = step_ratios(model, prof, sorted(selections), rounds, Path(tmp), clock)
    load.append(os.getloadavg())
    return dict(
        model=str(path),
        rho=rho,
        threads=threads,
        clock=clock,
        measured_full_step_us=prof.measured_full_step_us,
        bn_inference_check=prof.checks.get("bn_inference"),
        load_average=load,
        steps=steps,
    )


def run(
    seeds, epochs: int, period: int, rho: float, strategies, rounds: int, threads: int, clock: str
) -> dict:
    model = LoadedModel.load(DEFAULT_MODEL_PATH)
    prof = profiler.profile_model(
        model,
        batch_size=4,
        threads=threads,
        clock=clock,
        cache_dir=profile.default_cache_dir(),
    )
    runs = []
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in strategies:
            for seed in seeds:
                for mode in MODES:
                    config = TrainConfig(
                        epochs=epochs,
                        period=period,
                        rho=rho,
                        strategy=strategy,
                        seed=seed,
                        frozen_bn=mode,
                        threads=threads,
                    )
                    out = Path(tmp) / f"{strategy}-{seed}-{mode}"
                    result = train(
                        model,
                        prof,
                        config,
                        out,
                        artifacts_root=Path(tmp) / f"cache-{mode}",
                        progress=False,
                    )
                    log = rundir.read_log(out)
                    runs.append(
                        dict(
                            strategy=strategy,
                            seed=seed,
                            frozen_bn=mode,
                            val_acc=result.final_val_acc,
                            inference_val_acc=result.inference_val_acc,
                            val_curve=[e["val_acc"] for e in log],
                            val_loss_curve=[e["val_loss"] for e in log],
                            train_loss_curve=[e["train_loss"] for e in log],
                            measured_step_us=_mean_step_us(log, "measured_step_us"),
                            predicted_step_us=_mean_step_us(log, "predicted_step_us"),
                            selections=[e["selection"] for e in log],
                            wall_time_s=result.wall_time_s,
                        )
                    )
                    print(
                        f"{strategy} seed {seed} {mode}: val acc {result.final_val_acc:.4f}, "
                        f"step {runs[-1]['measured_step_us']:.0f} us",
                        file=sys.stderr,
                    )
                    load.append(os.getloadavg())
        selections = sorted({tuple(s) for r in runs for s in r["selections"]})
        steps = step_ratios(model, prof, selections, rounds, Path(tmp), clock)
        load.append(os.getloadavg())
    return dict(
        epochs=epochs,
        period=period,
        rho=rho,
        seeds=list(seeds),
        threads=threads,
        clock=clock,
        t_full_us=prof.t_full_us,
        measured_full_step_us=prof.measured_full_step_us,
        load_average=load,
        runs=runs,
        steps=steps,
    )


def _step_rows(results: dict) -> list[list]:
    return [
        [
            r["selection"]
            if len(r["selection"]) <= 40
            else f"{len(r['selection'].split(','))} tensors from {r['selection'].split(',')[0]}",
            f"{r['measured_us']['inference'] / 1e3:.2f}",
            f"{r['measured_us']['train'] / 1e3:.2f}",
            f"{r['measured_ratio']:.3f}",
            f"{r['predicted_ratio']:.3f}",
            f"{r['measured_us']['inference'] / r['full_us']:.3f}",
            f"{r['measured_us']['train'] / r['full_us']:.3f}",
        ]
        for r in results["steps"]
    ]


_STEP_HEADERS = [
    "selection",
    "inference ms",
    "train ms",
    "inference / train",
    "predicted",
    "inference / full",
    "train / full",
]


def summarize(results: dict) -> str:
    if "runs" not in results:  # --steps-only
        load = np.array(results["load_average"])
        return (
            _table(_STEP_HEADERS, _step_rows(results))
            + f"\n{results['model']}, rho {results['rho']}, {results['threads']} thread(s), "
            f"{results['clock']} clock, round robin (20th percentile); 1-min load average "
            f"{load[:, 0].min():.2f}-{load[:, 0].max():.2f}"
        )
    rows = []
    strategies = dict.fromkeys(r["strategy"] for r in results["runs"])
    for strategy in strategies:
        by_mode = {
            m: [r for r in results["runs"] if r["strategy"] == strategy and r["frozen_bn"] == m]
            for m in MODES
        }
        train_step = np.mean([r["measured_step_us"] for r in by_mode["train"]])
        for mode, rs in by_mode.items():
            acc = [r["val_acc"] for r in rs]
            step = np.mean([r["measured_step_us"] for r in rs])
            rows.append(
                [
                    strategy,
                    mode,
                    f"{100 * np.mean(acc):.2f}%",
                    " / ".join(f"{100 * a:.2f}" for a in acc),
                    f"{100 * np.mean([r['inference_val_acc'] for r in rs]):.2f}%",
                    f"{step / 1e3:.2f}",
                    f"{np.mean([r['predicted_step_us'] for r in rs]) / 1e3:.2f}",
                    f"{step / train_step:.3f}",
                ]
            )
    steps = _step_rows(results)
    load = np.array(results["load_average"])
    return (
        _table(
            [
                "strategy",
                "--frozen-bn",
                "val acc (mean)",
                "per seed",
                "exported acc",
                "step ms",
                "predicted ms",
                "step / train-mode step",
            ],
            rows,
        )
        + "\n\nsteps of each selection, round robin (20th percentile):\n"
        + _table(_STEP_HEADERS, steps)
        + f"\n{results['epochs']} epochs, period {results['period']}, rho {results['rho']}, "
        f"seeds {results['seeds']}, {results['threads']} thread(s), {results['clock']} clock "
        f"for the round robin; full step {results['measured_full_step_us'] / 1e3:.2f} ms "
        f"(profile); 1-min load average {load[:, 0].min():.2f}-{load[:, 0].max():.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--period", type=int, default=3)
    parser.add_argument("--rho", type=float, default=0.5)
    parser.add_argument("--strategies", nargs="+", default=["elastic", "last-layer"])
    parser.add_argument("--rounds", type=int, default=60, help="Round-robin step rounds.")
    parser.add_argument("--threads", type=int, default=1, help="ORT intra-op threads.")
    parser.add_argument("--clock", choices=["cpu", "wall"], default=None, help="[cpu if 1 thread]")
    parser.add_argument("--output", type=Path, default=RESULTS / "frozen_bn.json")
    parser.add_argument("--table", action="store_true", help="Print the table of --output.")
    parser.add_argument("--steps-only", action="store_true", help="Only the step ratios.")
    parser.add_argument("--model", type=Path, default=None, help="ONNX model [the default].")
    args = parser.parse_args()
    if args.table:
        print(summarize(json.loads(args.output.read_text())))
        return
    clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    if args.steps_only:
        model = args.model or DEFAULT_MODEL_PATH
        results = steps_only(model, args.rho, args.rounds, args.threads, clock)
        output = args.output
        if output == RESULTS / "frozen_bn.json":
            output = RESULTS / f"frozen_bn_steps_{Path(model).stem}.json"
        output.write_text(json.dumps(results, indent=2))
        print(summarize(results))
        return
    results = run(
        args.seeds,
        args.epochs,
        args.period,
        args.rho,
        args.strategies,
        args.rounds,
        args.threads,
        clock,
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(summarize(results))


if __name__ == "__main__":
    main()
