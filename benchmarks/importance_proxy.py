"""How far each importance proxy is from the loss change it predicts, per tensor (issue 30).

    python benchmarks/importance_proxy.py [--task vision|text] [--warm-steps 20] [--sample 24]
                                          [--suffix _62steps]

The model of :mod:`benchmarks.quality_ablation` (dropout set to 0, so a loss is a deterministic
function of the weights and the batch; batch norms in training mode as trained) is first
trained ``--warm-steps`` steps with the ``prefix`` selection at rho 0.5 through
``etgraph.loop.train``, so the run's state has AdamW moments for some tensors (those it trained)
and none for the others, and a step count. From that state, on one probe batch:

* **actual**: the real next ORT AdamW step of all tensors (a Module + Optimizer on the
  all-trainable artifacts, loaded from the run's state: moments carried, zero for the untrained
  tensors, the run's step count), then per sampled tensor ``k`` the loss drop
  ``L(w) - L(w + delta_w_k)`` with only tensor ``k`` moved by its real step — on the probe batch
  (what the first-order proxy approximates) and on another training batch (what it is for:
  progress beyond the probe batch);
* **proxies**: :class:`etgraph.importance.ImportanceEvaluator` with each variant at the same
  weights, moments and step (``adam``, ``first-step``, ``grad-sq``; ``random`` correlates with
  nothing by construction).

Prints a per-tensor table (actual drop, each proxy, proxy / actual) and per variant the rank
correlation (Spearman) with the actual drop over the sampled tensors, on the probe batch and on
the other batch, and the summed proxy against the loss drop of the whole step. Results:
benchmarks/results/importance_proxy_<task>.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.quality_ablation import TASKS, _missing_packages  # noqa: E402
from etgraph import profile, profiler  # noqa: E402
from etgraph.artifacts import ArtifactCache  # noqa: E402
from etgraph.checkpoint import read_checkpoint, write_checkpoint  # noqa: E402
from etgraph.importance import ImportanceEvaluator  # noqa: E402
from etgraph.loop import TrainConfig, load_run_data, train  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402
from etgraph.sessions import GradientSession, TrainingSession  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
VARIANTS = ("adam", "first-step", "grad-sq")


def _export(task: str, work: Path) -> dict:
    """The task's model with every dropout at 0, and its data."""
    import torch

    from models import pretrained_vision, text

    def no_dropout(module):
        for m in module.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        return module

    if task == "vision":
        data = pretrained_vision.write_animal_folder(work / "animals", per_class=250, seed=0)
        module = no_dropout(pretrained_vision.pretrained_mobilenet_v2(10, seed=0))
        from models.export import export_onnx

        path = export_onnx(module, work / "model.onnx", input_shape=(3, 96, 96))
        return dict(model=path, data=str(data), tokenizer=None)
    from benchmarks.text_quality import bbc_rows, write_csv

    csv_path = write_csv(work / "bbc.csv", bbc_rows())
    tok = work / "tokenizer.json"
    shutil.copyfile(text.minilm_dir() / "tokenizer.json", tok)
    module = no_dropout(text.pretrained_minilm(5, seed=0))
    path = text.export_text_onnx(module, work / "model.onnx", n_inputs=2, seq_len=16)
    return dict(model=path, data=str(csv_path), tokenizer=str(tok))


def _spearman(a, b) -> float:
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def measure(args) -> dict:
    missing = _missing_packages(args.task)
    if missing:
        sys.exit(f"error: {missing}")
    work = Path(tempfile.mkdtemp(prefix="etgraph-proxy-"))
    try:
        spec = _export(args.task, work)
        model = LoadedModel.load(spec["model"])
        bs, lr = TASKS[args.task]["batch_size"], TASKS[args.task]["learning_rate"]
        prof = profiler.profile_model(model, batch_size=bs, cache_dir=profile.default_cache_dir())
        config = TrainConfig(
            epochs=1,
            batch_size=bs,
            learning_rate=lr,
            strategy="prefix",
            rho=0.5,
            max_steps_per_epoch=args.warm_steps,
            max_val_batches=1,
            data=spec["data"],
            tokenizer=spec["tokenizer"],
        )
        train(model, prof, config, work / "warm", progress=False)
        carried, _, _ = read_checkpoint(work / "warm" / "checkpoint")
        names, stats = model.names, list(model.running_stats)
        dataset = load_run_data(config, model, model.input_shapes(prof.input_shapes))
        probe, other = dataset.probe_batch(bs, 12345), dataset.probe_batch(bs, 54321)

        cache = ArtifactCache(
            work / "cache", static_batch=(bs, model.input_shapes(prof.input_shapes))
        )
        paths, _ = cache.get(model.proto, names, stats, weight_decay=config.weight_decay)
        # the real next step: all tensors trainable, the run's moments (zero for the untrained)
        write_checkpoint(work / "all.ckpt", carried, names, initial_learning_rate=lr)
        session = TrainingSession(
            paths.directory, work / "all.ckpt", None, input_names=model.input_names
        )
        session.optimizer.set_learning_rate(lr)
        session.step(*probe)
        stepped = session.weights()
        del session
        delta = {n: stepped[n].astype(np.float64) - carried.weights[n] for n in names}

        grads = GradientSession(paths.directory, None, input_names=model.input_names)

        def loss_at(weights, batch) -> float:
            grads.set_parameters(weights, names + stats)
            return float(grads.accumulate([batch])[0])

        base = {n: carried.weights[n] for n in names + stats}
        l0_probe, l0_other = loss_at(base, probe), loss_at(base, other)
        whole = {**base, **{n: stepped[n] for n in names}}
        whole_drop = (l0_probe - loss_at(whole, probe), l0_other - loss_at(whole, other))

        proxies = {}
        for variant in VARIANTS:
            evaluator = ImportanceEvaluator(
                model.proto,
                names,
                stats,
                cache,
                weight_decay=config.weight_decay,
                input_names=model.input_names,
                variant=variant,
            )
            result = evaluator.evaluate(
                base, [probe], lr, moments=carried.moments, step=carried.step
            )
            proxies[variant] = result.importance

        sample = sorted(set(np.linspace(0, len(names) - 1, args.sample).round().astype(int)))
        rows = []
        for k in sample:
            n = names[k]
            moved = dict(base)
            moved[n] = (carried.weights[n] + delta[n]).astype(carried.weights[n].dtype)
            rows.append(
                dict(
                    index=int(k),
                    name=n,
                    params=int(carried.weights[n].size),
                    trained=n in carried.moments,
                    actual_probe=l0_probe - loss_at(moved, probe),
                    actual_other=l0_other - loss_at(moved, other),
                    **{v: float(proxies[v][k]) for v in VARIANTS},
                )
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    probe_drop = np.array([r["actual_probe"] for r in rows])
    other_drop = np.array([r["actual_other"] for r in rows])
    summary = {
        v: dict(
            spearman_probe=_spearman([r[v] for r in rows], probe_drop),
            spearman_other=_spearman([r[v] for r in rows], other_drop),
            sum_all=float(proxies[v].sum()),
            non_positive=int((proxies[v] <= 0).sum()),
            non_positive_trained=int(
                sum(proxies[v][k] <= 0 for k, n in enumerate(names) if n in carried.moments)
            ),
        )
        for v in VARIANTS
    }
    adam = np.array([r["adam"] for r in rows])
    rel = np.abs(adam - probe_drop) / np.maximum(np.abs(probe_drop), 1e-12)
    out = dict(
        settings=dict(vars(args), batch_size=bs, learning_rate=lr, step=carried.step),
        tensors=len(names),
        trained_tensors=len(carried.moments),
        whole_step_drop_probe=whole_drop[0],
        whole_step_drop_other=whole_drop[1],
        adam_median_rel_error_probe=float(np.median(rel)),
        summary=summary,
        rows=rows,
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"importance_proxy_{args.task}{args.suffix}.json"
    (RESULTS / name).write_text(json.dumps(out, indent=2))

    header = ("k", "tensor", "params", "moments", "actual probe", "actual other", "adam",
              "adam/act", "first-step", "grad-sq")  # fmt: skip
    widths = (4, -44, 8, 7, 13, 13, 10, 8, 10, 10)
    cells = zip(header, widths, strict=True)
    print(" ".join(f"{h:<{-w}}" if w < 0 else f"{h:>{w}}" for h, w in cells))
    for r in rows:
        ratio = r["adam"] / r["actual_probe"] if r["actual_probe"] else float("nan")
        print(
            f"{r['index']:>4} {r['name'][:44]:44} {r['params']:>8} {str(r['trained']):>7} "
            f"{r['actual_probe']:>13.3e} {r['actual_other']:>13.3e} {r['adam']:>10.3e} "
            f"{ratio:>8.2f} {r['first-step']:>10.3e} {r['grad-sq']:>10.3e}"
        )
    print(
        f"\n{args.task}: {len(names)} tensors ({len(carried.moments)} with moments after "
        f"{carried.step} steps), lr {lr}; the whole step drops the probe loss by "
        f"{whole_drop[0]:.3e} (sum of adam proxies {summary['adam']['sum_all']:.3e}), the other "
        f"batch's by {whole_drop[1]:.3e}; adam proxy vs actual per tensor: median relative "
        f"error {out['adam_median_rel_error_probe']:.2f}"
    )
    for v, s in summary.items():
        print(
            f"  {v:10}: Spearman with the actual drop {s['spearman_probe']:+.2f} (probe batch), "
            f"{s['spearman_other']:+.2f} (other batch); {s['non_positive']} of {len(names)} "
            f"tensors score <= 0 ({s['non_positive_trained']} of the {len(carried.moments)} "
            "with moments)"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--task", choices=["vision", "text"], default="vision")
    ap.add_argument("--warm-steps", type=int, default=20)
    ap.add_argument("--sample", type=int, default=24)
    ap.add_argument("--suffix", default="", help="results file suffix")
    measure(ap.parse_args())


if __name__ == "__main__":
    main()
