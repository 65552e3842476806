"""The paper's evaluation on this machine: speed, quality and overheads (issue 7).

    python benchmarks/evaluate.py speed   [--models resnet50 vgg16 mobilenet_v2 vit_b16]
                                          [--input-size 128] [--rhos 0.4 0.5 0.6 0.7]
    python benchmarks/evaluate.py quality [--epochs 12] [--rho 0.5] [--period 3]
                                          [--model M.onnx|ZOO_NAME --data DIR]
    python benchmarks/evaluate.py all     (both, with defaults)
    python benchmarks/evaluate.py plot-speed   (redraw speed.png from speed.json)

speed    For each model and rho: the DP selection (importance from one probe batch of random
         data — speed does not depend on which tensors score high), then the requested,
         predicted and MEASURED step-time ratio to full training. Every selection's steps are
         measured round-robin with full-training steps in one run (same machine load), so the
         measured ratio is a ratio of side-by-side measurements.
quality  Elastic vs full vs last-layer vs BN+Bias (and the DP-free selectors) on the default
         transfer task (digits 5-9 on the CNN pretrained on digits 0-4), or on an image-folder
         dataset: same epochs, same seed, same runtime. Prints final accuracy, training wall
         time (validation excluded, as in the paper), speedup over full, time to reach 95% of
         full training's final accuracy, the mean measured step relative to full training's
         (the speed target in wall clock), selection overheads and peak RSS; plots accuracy vs
         wall time. --model takes a zoo name (exported at --input-size) as well as a file.

Results go to benchmarks/results/ (JSON and PNG); the tables are printed.
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
sys.path.insert(0, str(ROOT))

from etgraph import measure, profile, profiler, rundir, selection  # noqa: E402
from etgraph.artifacts import ArtifactCache  # noqa: E402
from etgraph.config import TrainConfig  # noqa: E402
from etgraph.data import DEFAULT_MODEL_PATH  # noqa: E402
from etgraph.importance import ImportanceEvaluator  # noqa: E402
from etgraph.loop import train  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
EXPORTS = ROOT / "models" / "exported"
PAPER_MODELS = ("resnet50", "vgg16", "mobilenet_v2", "vit_b16")


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    return "\n".join([line, sep, *body])


def _export(name: str, input_size: int) -> Path:
    from models.export import export_onnx

    path = EXPORTS / f"{name}_{input_size}.onnx"
    if not path.exists():
        export_onnx(name, path, input_shape=(3, input_size, input_size), num_classes=10)
    return path


def _probe_importance(model: LoadedModel, shape, batch_size: int) -> np.ndarray:
    """First-order importance (paper Eq. 2) on one probe batch of random data."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch_size, *shape)).astype(np.float32)  # one image input
    y = rng.integers(0, 10, size=batch_size).astype(np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        evaluator = ImportanceEvaluator(
            model.proto,
            model.names,
            model.running_stats,
            ArtifactCache(tmp),
            input_names=model.input_names,
        )
        return evaluator.evaluate(model.initial_weights(), [(x, y)], 1e-4).importance


def speed(models, input_size: int, rhos, batch_size: int, repeats: int) -> list[dict]:
    rows = []
    for name in models:
        path = Path(name) if name.endswith(".onnx") else _export(name, input_size)
        model = LoadedModel.load(path)
        shape = (3, input_size, input_size)
        t0 = time.perf_counter()
        prof = profiler.profile_model(
            model,
            batch_size=batch_size,
            input_shapes=shape,
            repeats=repeats,
            cache_dir=profile.default_cache_dir(),
        )
        profile_s = time.perf_counter() - t0
        importance = _probe_importance(model, shape, batch_size)
        masks, predicted, solve_ms = [], [], []
        for rho in rhos:
            t0 = time.perf_counter()
            chosen = selection.select_for_rho(prof, rho, importance)
            solve_ms.append((time.perf_counter() - t0) * 1e3)
            masks.append(chosen.mask)
            predicted.append(prof.predicted_step_us(chosen.mask))
        mask_us, full_us = measure.measure_selection_steps_us(
            model,
            np.array(masks),
            batch_size=batch_size,
            input_shapes=shape,
            repeats=repeats,
            group=len(masks),
        )
        for rho, mask, pred, meas, full, ms in zip(
            rhos, masks, predicted, mask_us, full_us, solve_ms, strict=True
        ):
            rows.append(
                dict(
                    model=path.stem,
                    rho=rho,
                    selected=int(mask.sum()),
                    n=len(mask),
                    predicted_ratio=pred / prof.t_full_us,
                    measured_ratio=meas / full,
                    measured_step_ms=meas / 1e3,
                    measured_full_ms=full / 1e3,
                    dp_ms=ms,
                    profile_s=profile_s,
                )
            )
        print(f"{path.stem}: done", file=sys.stderr)
    print(
        _table(
            ["model", "rho", "selected", "predicted", "measured", "error", "step ms", "full ms"],
            [
                [
                    r["model"],
                    f"{r['rho']:.2f}",
                    f"{r['selected']}/{r['n']}",
                    f"{r['predicted_ratio']:.3f}",
                    f"{r['measured_ratio']:.3f}",
                    f"{(r['measured_ratio'] / r['predicted_ratio'] - 1) * 100:+.1f}%",
                    f"{r['measured_step_ms']:.1f}",
                    f"{r['measured_full_ms']:.1f}",
                ]
                for r in rows
            ],
        )
    )
    return rows


QUALITY_STRATEGIES = ("full", "elastic", "last-layer", "bn-bias", "topk", "prefix")


def quality(
    model: Path, data, epochs: int, rho: float, period: int, batch_size: int, seed: int, strategies
) -> list[dict]:
    model = LoadedModel.load(model)
    shapes = model.input_shapes()
    results = RESULTS / f"quality_{model.source.stem}"
    prof = profiler.profile_model(
        model, batch_size=batch_size, input_shapes=shapes, cache_dir=profile.default_cache_dir()
    )
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in strategies:
            config = TrainConfig(
                epochs=epochs,
                batch_size=batch_size,
                rho=rho,
                period=period,
                strategy=strategy,
                seed=seed,
                data=data,
            )
            out = Path(tmp) / strategy
            result = train(
                model, prof, config, out, artifacts_root=Path(tmp) / "cache", progress=False
            )
            log = rundir.read_log(out)
            runs.append(dict(strategy=strategy, result=result.__dict__, log=log))
            print(
                f"{strategy}: val acc {result.final_val_acc:.4f} in {result.wall_time_s:.1f} s",
                file=sys.stderr,
            )
    full = next((r for r in runs if r["strategy"] == "full"), runs[0])
    target = 0.95 * full["result"]["final_val_acc"]
    full_step = _mean_step_us(full["log"])
    rows = []
    for r in runs:
        reached = next(
            (e["cumulative_wall_time_s"] for e in r["log"] if e["val_acc"] >= target), None
        )
        res = r["result"]
        rows.append(
            [
                r["strategy"],
                f"{res['final_val_acc']:.4f}",
                f"{res['wall_time_s']:.1f}",
                f"{full['result']['wall_time_s'] / res['wall_time_s']:.2f}x",
                "never" if reached is None else f"{reached:.1f}",
                f"{_mean_step_us(r['log']) / full_step:.2f}",
                f"{res['first_selection_s']:.2f}",
                f"{res['reselection_overhead_pct']:.2f}%",
                f"{res['peak_rss_mb_last_period']:.0f}",
            ]
        )
    print(
        _table(
            [
                "strategy",
                "val acc",
                "train s",
                "speedup vs full",
                f"s to {target:.3f} acc",
                "step / full step",
                "first selection s",
                "re-selections",
                "peak RSS MB",
            ],
            rows,
        )
    )
    full_s = full["result"]["wall_time_s"]
    dp_s = sum(e["selection_s"] for r in runs if r["strategy"] == "elastic" for e in r["log"])
    print(
        f"profiling {prof.profiling_s:.1f} s = {100 * prof.profiling_s / full_s:.1f}% of full "
        f"training's {full_s:.1f} s; elastic DP solves {dp_s * 1e3:.1f} ms in all"
    )
    _plot(runs, results.with_suffix(".png"), f"{model.source.stem}, rho={rho}, period={period}")
    results.with_suffix(".json").write_text(json.dumps(runs, indent=2, default=str))
    return runs


def _plot_speed(rows: list[dict], path: Path) -> None:
    """Requested rho vs predicted and measured step ratio per model (one panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    ax.plot([0.3, 0.8], [0.3, 0.8], color="grey", lw=1, ls=":", label="requested")
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        rho = [r["rho"] for r in mine]
        (line,) = ax.plot(rho, [r["measured_ratio"] for r in mine], marker="o", label=model)
        ax.plot(rho, [r["predicted_ratio"] for r in mine], ls="--", color=line.get_color())
    ax.set(
        xlabel="requested rho",
        ylabel="step time / full step time",
        title="measured (solid) vs predicted (dashed)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean_step_us(log: list[dict]) -> float:
    """Mean measured training step (µs) of a run, weighted by steps per epoch."""
    steps = np.array([e["steps"] for e in log], dtype=np.float64)
    return float(np.average([e["measured_step_us"] for e in log], weights=steps))


def _plot(runs, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, loss) = plt.subplots(1, 2, figsize=(10, 4))
    for r in runs:
        t = [0.0] + [e["cumulative_wall_time_s"] for e in r["log"]]
        acc.plot(t[1:], [e["val_acc"] for e in r["log"]], marker="o", ms=3, label=r["strategy"])
        loss.plot(t[1:], [e["train_loss"] for e in r["log"]], marker="o", ms=3, label=r["strategy"])
    acc.set(xlabel="training wall time (s)", ylabel="validation accuracy", title=title)
    loss.set(xlabel="training wall time (s)", ylabel="training loss")
    acc.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("what", choices=["speed", "quality", "all", "plot-speed"])
    ap.add_argument("--models", nargs="+", default=list(PAPER_MODELS))
    ap.add_argument("--input-size", type=int, default=128)
    ap.add_argument("--rhos", nargs="+", type=float, default=[0.4, 0.5, 0.6, 0.7])
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_PATH))
    ap.add_argument("--data", default=None)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--rho", type=float, default=0.5)
    ap.add_argument("--period", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategies", nargs="+", default=list(QUALITY_STRATEGIES))
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.what in ("speed", "all"):
        rows = speed(args.models, args.input_size, args.rhos, args.batch_size, args.repeats)
        (RESULTS / "speed.json").write_text(json.dumps(rows, indent=2))
    if args.what in ("speed", "all", "plot-speed"):
        _plot_speed(json.loads((RESULTS / "speed.json").read_text()), RESULTS / "speed.png")
    if args.what in ("quality", "all"):
        model = Path(args.model)
        if not args.model.endswith(".onnx"):  # a zoo name: export at --input-size
            model = _export(args.model, args.input_size)
        quality(
            model,
            args.data,
            args.epochs,
            args.rho,
            args.period,
            args.batch_size,
            args.seed,
            args.strategies,
        )


if __name__ == "__main__":
    main()
