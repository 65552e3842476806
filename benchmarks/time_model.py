"""Validate the time model (paper §2.2, Eq. 3) against measured training steps.

For each model: export it (plain-torch zoo, ``models/export.py``), profile it
(:func:`etgraph.profiler.profile_model`), then for 20 random selection masks plus the DP masks at
rho = 0.3 ... 0.8 generate training artifacts for exactly that selection, measure the real step
(``onnxruntime.training.api``: Module step + AdamW step + lazy_reset_grad) and compare with
:func:`etgraph.timing.step_us`.

Random masks: the earliest selected index is drawn uniformly, then each later tensor is selected
with a probability drawn uniformly per mask (uniform Bernoulli masks would all start near 0 and
all cost about a full backward pass). DP masks use a data-free importance prior (each tensor's
share of the parameters, as ``etgraph compile`` does without data).

Defaults: batch 4, input 3x128x128 (the four models take ~8 minutes in all on 2 cores;
224 px is ~3x slower), 10 classes, 5 measured + 2 warm-up steps per mask.

The machine may be shared: masks are measured in groups round-robin with full training (one
step each per round), so each mask has a full step measured under the same load. Two errors are
reported: ``abs`` compares ``step_us(M)`` with the measured step as is; ``at speed`` first
rescales the prediction by ``measured full step / profiled full step`` of that group (what the
error would be if the machine ran at the speed it had while profiling). Masks are measured with
:func:`etgraph.measure.measure_selection_steps_us`.

Profiling levels (``--profile-level``, default ``fast,thorough``): the model is profiled once
per level, each with that level's own repeats (:data:`etgraph.profiler.LEVELS`; before the
levels existed this benchmark profiled with its own 5 measured + 2 warm-up rounds), and every
level's time model is scored against the same measured masks: the random ones and its own DP
masks. The table has one row per model and level, with the profiling time and the load average.

Usage::

    python benchmarks/time_model.py                       # all four models
    python benchmarks/time_model.py --models resnet50 --threads 1 --json out.json
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the models/ package lives beside etgraph/

from etgraph import selection, timing  # noqa: E402
from etgraph.errors import InfeasibleBudgetError  # noqa: E402
from etgraph.measure import measure_selection_steps_us  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402
from etgraph.profile import Profile  # noqa: E402
from etgraph.profiler import profile_model  # noqa: E402

log = logging.getLogger("time_model")

MODELS = ("resnet50", "vgg16", "mobilenet_v2", "vit_b16")
RHOS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def random_masks(n: int, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` random non-empty masks over ``n`` tensors: earliest selected index uniform in
    [0, n), then each later tensor selected with probability p ~ U(0, 1) (one p per mask)."""
    masks = []
    for _ in range(count):
        first = int(rng.integers(0, n))
        mask = np.zeros(n, dtype=bool)
        mask[first] = True
        mask[first + 1 :] = rng.random(n - first - 1) < rng.random()
        masks.append(mask)
    return masks


def dp_masks(prof: Profile, importance: np.ndarray) -> list[tuple[float, np.ndarray]]:
    """DP selections (:func:`etgraph.selection.select_tensors`) at each rho in :data:`RHOS`,
    budgets relative to the MEASURED full step (``measured_full_step_us``)."""
    out = []
    for rho in RHOS:
        budget = timing.budget_us(rho, prof.forward_us, prof.measured_full_step_us)
        try:
            chosen = selection.select_tensors(
                prof.t_dw_us,
                prof.t_dy_us,
                importance,
                budget,
                resolution=2000,
                forward_us=prof.forward_us,
                t_full_us=prof.measured_full_step_us,
            )
        except InfeasibleBudgetError:
            log.info("rho %.1f infeasible", rho)
            continue
        out.append((rho, np.asarray(chosen.mask, dtype=bool)))
    return out


#: Selection shapes scored with ``--families`` (besides ``random`` and ``dp``): the selectors of
#: the quality ablation under the time model of the run's ``--frozen-bn`` mode, at each rho of
#: ``--rhos``: ``elastic`` with every tensor equally important (the DP then packs as many
#: tensors as fit: the ~130-of-158 shape of issue 30's vision runs), ``topk`` by the
#: parameter-share prior (large kernels scattered over the network) and ``prefix`` (the
#: tensors nearest the output).
FAMILIES = ("random", "dp", "elastic", "topk", "prefix")


def family_masks(
    family: str, prof: Profile, tensors, importance: np.ndarray, rhos
) -> list[tuple[float, np.ndarray]]:
    """Masks of ``family`` (``elastic``, ``topk`` or ``prefix``,
    :func:`etgraph.selection.strategy_mask`) at each rho the time model ``prof`` affords."""
    out = []
    imp = np.ones(len(tensors)) if family == "elastic" else importance
    for rho in rhos:
        try:
            mask = selection.strategy_mask(family, tensors, prof, rho, imp, resolution=2000)
        except InfeasibleBudgetError:
            log.info("%s rho %.1f infeasible", family, rho)
            continue
        out.append((rho, np.asarray(mask, dtype=bool)))
    return out


def profiling_overhead(prof: Profile, input_shape) -> float:
    """Profiling wall time as a fraction of one training epoch of the default dataset (digits
    5-9 transfer task) at the profile's batch size and measured full step time."""
    from etgraph.data import load_dataset

    ds = load_dataset(None, input_shape=tuple(input_shape))
    epoch_s = ds.steps_per_epoch(prof.batch_size) * prof.measured_full_step_us * 1e-6
    return prof.profiling_s / epoch_s


def run_model(
    name: str,
    *,
    batch_size: int,
    input_size: int,
    num_masks: int,
    repeats: int,
    warmup: int,
    threads: int | None,
    group: int,
    seed: int,
    work: Path,
    clock: str = "wall",
    levels: tuple[str, ...] = ("fast",),
    onnx_dir: Path | None = None,
    frozen_bn: str = "train",
    families: tuple[str, ...] = ("random", "dp"),
    rhos: tuple[float, ...] = RHOS,
) -> list[dict]:
    """Export (or load, for a path ending in ``.onnx``), profile (once per profiling level, in
    the order given) and validate one model; returns one result row (and per-mask data) per
    level.

    The masks are measured once for all levels: the random masks, and each level's masks of
    the other ``families``; each level is scored on the random masks and its own. With
    ``frozen_bn="inference"`` (the training loop's default) the masks' frozen batch norms run in
    inference mode and each level's time model is ``Profile.for_frozen_bn("inference")``."""
    from models.export import export_onnx

    shape = (3, input_size, input_size)
    if name.endswith(".onnx"):
        path = Path(name)
        name = path.stem
    else:
        path = onnx_dir / f"{name}_{input_size}.onnx" if onnx_dir is not None else None
        if path is None or not path.is_file():
            path = export_onnx(
                name, work / f"{name}.onnx", input_shape=shape, num_classes=10, seed=0
            )
    model = LoadedModel.load(path)
    tensors = model.tensors
    profiles = {}
    loads = {}
    for level in levels:
        loads[level] = os.getloadavg()[0]
        profiled = profile_model(
            model, batch_size=batch_size, threads=threads, clock=clock, level=level
        )
        profiles[level] = (profiled, profiled.for_frozen_bn(frozen_bn))
        log.info(
            "%s: %d tensors, profiled (%s) in %.1f s, full step %.0f ms",
            name,
            len(tensors),
            level,
            profiled.profiling_s,
            profiled.measured_full_step_us / 1e3,
        )
    rng = np.random.default_rng(seed)
    params = np.array([t.params for t in tensors], dtype=np.float64)
    prior = params / params.sum()
    labelled = []
    if "random" in families:
        labelled += [("random", None, m) for m in random_masks(len(tensors), num_masks, rng)]
    for level, (_, prof) in profiles.items():
        if "dp" in families:
            labelled += [(f"dp rho={rho:.1f}", level, m) for rho, m in dp_masks(prof, prior)]
        for family in families:
            if family in ("random", "dp"):
                continue
            labelled += [
                (f"{family} rho={rho:.1f}", level, m)
                for rho, m in family_masks(family, prof, tensors, prior, rhos)
            ]
    masks = np.array([m for _, _, m in labelled])
    first = profiles[levels[0]][0]
    measured, full = measure_selection_steps_us(
        model,
        masks,
        batch_size=first.batch_size,
        input_shapes=first.input_shapes,
        threads=first.threads,
        repeats=repeats,
        warmup=warmup,
        work_dir=work,
        clock=first.clock,
        group=group,
        frozen_bn=frozen_bn,
    )
    load_measured = os.getloadavg()[0]
    results = []
    for level, (profiled, prof) in profiles.items():
        keep = np.array([lv in (None, level) for _, lv, _ in labelled])
        predicted = np.array([prof.predicted_step_us(m) for m in masks])
        err_abs = 100.0 * (predicted / measured - 1.0)
        err_speed = 100.0 * (predicted * (full / profiled.measured_full_step_us) / measured - 1.0)
        # The ratio to the full step, predicted (the model's own T_full, as the DP budgets) and
        # measured (the full step of the mask's round-robin group).
        ratio_predicted = predicted / prof.t_full_us
        ratio_measured = measured / full
        err_ratio = 100.0 * (ratio_predicted / ratio_measured - 1.0)
        rows = [
            {
                "label": label,
                "selected": int(m.sum()),
                "earliest": int(np.argmax(m)),
                "mask": np.flatnonzero(m).tolist(),
                "measured_us": float(a),
                "predicted_us": float(p),
                "full_measured_us": float(f),
                "ratio_measured": float(rm),
                "ratio_predicted": float(rp),
                "error_pct": float(e),
                "error_at_speed_pct": float(s),
                "ratio_error_pct": float(r),
            }
            for (label, _, m), a, p, f, rm, rp, e, s, r, k in zip(
                labelled,
                measured,
                predicted,
                full,
                ratio_measured,
                ratio_predicted,
                err_abs,
                err_speed,
                err_ratio,
                keep,
                strict=True,
            )
            if k
        ]
        families_err = {}
        for family in families:
            sel = keep & np.array([lab.split(" ")[0] == family for lab, _, _ in labelled])
            if sel.any():
                families_err[family] = {
                    "masks": int(sel.sum()),
                    "mean_ratio_error_pct": float(np.mean(err_ratio[sel])),
                    "mean_abs_ratio_error_pct": float(np.mean(np.abs(err_ratio[sel]))),
                    "max_abs_ratio_error_pct": float(np.max(np.abs(err_ratio[sel]))),
                }
        results.append(
            {
                "model": name,
                "level": level,
                "frozen_bn": frozen_bn,
                "batch_size": batch_size,
                "tensors": len(tensors),
                "masks": int(keep.sum()),
                "mean_abs_error_pct": float(np.mean(np.abs(err_abs[keep]))),
                "max_abs_error_pct": float(np.max(np.abs(err_abs[keep]))),
                "mean_abs_error_at_speed_pct": float(np.mean(np.abs(err_speed[keep]))),
                "max_abs_error_at_speed_pct": float(np.max(np.abs(err_speed[keep]))),
                "mean_abs_ratio_error_pct": float(np.mean(np.abs(err_ratio[keep]))),
                "max_abs_ratio_error_pct": float(np.max(np.abs(err_ratio[keep]))),
                "families": families_err,
                "measured_full_step_ms": profiled.measured_full_step_us / 1e3,
                "full_step_measured_alike_ms": float(np.median(full)) / 1e3,
                "profiling_s": profiled.profiling_s,
                "profiling_epoch_fraction": profiling_overhead(profiled, shape),
                "load_average_before": loads[level],
                "load_average_after": profiled.load_average,
                "load_average_measured": load_measured,
                "threads": profiled.threads,
                "clock": profiled.clock,
                "checks": profiled.checks,
                "per_mask": rows,
                "profile": profiled.to_dict(),  # to score other time models on these masks
            }
        )
    return results


def print_table(results: list[dict]) -> None:
    head = (
        f"{'model':<13} {'level':<9} {'masks':>5} {'mean|err|%':>10} {'max|err|%':>9} "
        f"{'mean@speed%':>11} {'max@speed%':>10} {'ratio mean%':>11} {'ratio max%':>10} "
        f"{'full ms':>8} {'profile s':>9} {'%epoch':>7} {'load':>5}"
    )
    click.echo(head)
    click.echo("-" * len(head))
    for r in results:
        click.echo(
            f"{r['model']:<13} {r.get('level', 'thorough'):<9} {r['masks']:>5} "
            f"{r['mean_abs_error_pct']:>10.1f} "
            f"{r['max_abs_error_pct']:>9.1f} {r['mean_abs_error_at_speed_pct']:>11.1f} "
            f"{r['max_abs_error_at_speed_pct']:>10.1f} "
            f"{r.get('mean_abs_ratio_error_pct', float('nan')):>11.1f} "
            f"{r.get('max_abs_ratio_error_pct', float('nan')):>10.1f} "
            f"{r['measured_full_step_ms']:>8.0f} "
            f"{r['profiling_s']:>9.1f} {100 * r['profiling_epoch_fraction']:>7.1f} "
            f"{r.get('load_average_after') or 0:>5.1f}"
        )
        for family, f in r.get("families", {}).items():
            click.echo(
                f"    {family:<9} {f['masks']:>3} masks: ratio error mean "
                f"{f['mean_ratio_error_pct']:+.1f}%, mean |.| "
                f"{f['mean_abs_ratio_error_pct']:.1f}%, max |.| {f['max_abs_ratio_error_pct']:.1f}%"
            )


@click.command()
@click.option(
    "--models",
    default=",".join(MODELS),
    show_default=True,
    help="Zoo names or .onnx files (e.g. issue 30's animals export, "
    "`python -m models.pretrained_vision -o DIR`), comma-separated.",
)
@click.option("--batch-size", default=4, show_default=True)
@click.option("--input-size", default=128, show_default=True, help="H = W in pixels.")
@click.option("--masks", "num_masks", default=20, show_default=True, help="Random masks.")
@click.option("--repeats", default=5, show_default=True)
@click.option("--warmup", default=2, show_default=True)
@click.option("--threads", default=None, type=int, help="Intra-op threads [physical cores].")
@click.option(
    "--clock",
    type=click.Choice(["wall", "cpu"]),
    default="wall",
    show_default=True,
    help="cpu = thread CPU time (needs --threads 1): immune to other processes' load.",
)
@click.option("--group", default=4, show_default=True, help="Masks per round-robin group.")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--profile-level",
    "levels",
    default="fast,thorough",
    show_default=True,
    help="Profiling levels to validate, comma-separated, profiled in this order; the masks are "
    "measured once for all.",
)
@click.option(
    "--onnx-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Use <dir>/<model>_<input-size>.onnx where it exists instead of exporting.",
)
@click.option(
    "--frozen-bn",
    type=click.Choice(["train", "inference"]),
    default="train",
    show_default=True,
    help="How the masks' frozen batch norms run (the training loop's default: inference).",
)
@click.option(
    "--families",
    default="random,dp",
    show_default=True,
    help=f"Mask families, comma-separated, of {', '.join(FAMILIES)} (FAMILIES).",
)
@click.option(
    "--rhos",
    default="0.3,0.4,0.5,0.6,0.7",
    show_default=True,
    help="rho values of the elastic, topk and prefix families.",
)
@click.option("--json", "json_out", default=None, help="Also write all results here.")
@click.option("--work-dir", default=None, help="Where models and artifacts go [tmp].")
def main(
    models,
    batch_size,
    input_size,
    num_masks,
    repeats,
    warmup,
    threads,
    clock,
    group,
    seed,
    levels,
    onnx_dir,
    frozen_bn,
    families,
    rhos,
    json_out,
    work_dir,
):
    """Print model, masks, mean/max |error| % of step_us against measured steps."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    results = []
    with tempfile.TemporaryDirectory(prefix="etgraph-time-model-", dir=work_dir) as tmp:
        for name in models.split(","):
            rows = run_model(
                name.strip(),
                batch_size=batch_size,
                input_size=input_size,
                num_masks=num_masks,
                repeats=repeats,
                warmup=warmup,
                threads=threads,
                group=group,
                seed=seed,
                work=Path(tmp),
                clock=clock,
                levels=tuple(lv.strip() for lv in levels.split(",")),
                onnx_dir=Path(onnx_dir) if onnx_dir else None,
                frozen_bn=frozen_bn,
                families=tuple(f.strip() for f in families.split(",")),
                rhos=tuple(float(r) for r in rhos.split(",")),
            )
            results += rows
            print_table(rows)
            if json_out:
                Path(json_out).write_text(json.dumps(results, indent=1))
    click.echo("")
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
