"""Validate the memory model (issue #17, :mod:`etgraph.memory`) against measured peak RSS.

For each model: export it (plain-torch zoo, ``models/export.py``; ``default`` = the embedded
default CNN at its own 3x32x32), measure its memory profile
(:func:`etgraph.memory_profiler.profile_memory`: the anchor selections in one process), then for
20 random selection masks plus the DP's selections under memory budgets 10-90% of the way from
the smallest feasible to the predicted full-training peak, generate training artifacts for
exactly that selection, run a fresh process that trains it for 3 steps
(:func:`etgraph.memory_profiler.measure_peaks`: the libraries ``etgraph train`` imports,
checkpoint, Module + AdamW Optimizer, steps) and compare its peak RSS (``VmHWM``) with
:meth:`etgraph.memory.MemoryProfile.peak_mb`.

Random masks: the earliest selected index is drawn uniformly, then each later tensor is selected
with a probability drawn uniformly per mask (as ``benchmarks/time_model.py``). DP masks use the
data-free importance prior (each tensor's share of the parameters) and no time budget (the
memory constraint alone), :func:`etgraph.selection.select_tensors` with
:class:`etgraph.selection.MemoryCosts`.

Batch norms run in the mode ``--frozen-bn`` says (default ``inference``, as ``etgraph train``):
the memory profile is measured in that mode and every mask's artifacts are generated in it.

Peak RSS does not depend on CPU load, but memory is shared: run big models one at a time. A
measurement whose process starts with far fewer library pages resident than the profile's (page
cache shrunk by other processes) is repeated (:data:`COLD_FRACTION`).

Usage::

    python benchmarks/memory_model.py --models default --models resnet50
    python benchmarks/memory_model.py --models vgg16 --json benchmarks/results/memory_vgg16.json
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the models/ package lives beside etgraph/

from etgraph.artifacts import ArtifactCache  # noqa: E402
from etgraph.data import DEFAULT_MODEL_PATH  # noqa: E402
from etgraph.errors import InfeasibleBudgetError  # noqa: E402
from etgraph.memory import MemoryProfile, activation_bytes_after  # noqa: E402
from etgraph.memory_profiler import (  # noqa: E402
    fit_memory_profile,
    measure_peaks,
    profile_memory,
)
from etgraph.model import LoadedModel  # noqa: E402
from etgraph.selection import MemoryCosts, select_tensors  # noqa: E402
from passes.onnx import DEFAULT_FROZEN_BN, FROZEN_BN_MODES  # noqa: E402

log = logging.getLogger("memory_model")

MODELS = ("default", "resnet50", "vgg16", "mobilenet_v2", "vit_b16")
#: A measuring process whose RSS after the imports is below this fraction of the profile's
#: started with library pages evicted from the page cache by other processes (its RSS counts
#: fewer mapped pages: 251 instead of 327 MiB once on the default model); it is measured again,
#: up to RETRIES times, and the cold start is kept in the row.
COLD_FRACTION = 0.9
RETRIES = 2
FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)


def random_masks(n: int, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` random non-empty masks: earliest index uniform, then p ~ U(0, 1) per mask."""
    masks = []
    for _ in range(count):
        first = int(rng.integers(0, n))
        mask = np.zeros(n, dtype=bool)
        mask[first] = True
        mask[first + 1 :] = rng.random(n - first - 1) < rng.random()
        masks.append(mask)
    return masks


def dp_masks(prof, params: np.ndarray) -> list[tuple[float, np.ndarray]]:
    """The DP's selections under memory budgets at :data:`FRACTIONS` of the way from the
    smallest feasible peak to the full-training peak (both predicted)."""
    n = len(prof.tensors)
    out = []
    low, full = prof.min_feasible_mb(), prof.full_peak_mb
    for frac in FRACTIONS:
        memory = MemoryCosts.from_profile(prof, low + frac * (full - low))
        try:
            chosen = select_tensors(
                np.zeros(n), np.zeros(n), params / params.sum(), 0.0, memory=memory
            )
        except InfeasibleBudgetError:
            log.info("memory budget %.0f%% of the full peak is infeasible", frac * 100)
            continue
        out.append((frac, np.asarray(chosen.mask)))
    return out


def export(name: str, size: int, work: Path) -> tuple[Path, tuple[int, int, int]]:
    if name == "default":
        return Path(DEFAULT_MODEL_PATH), (3, 32, 32)
    from models.export import export_onnx

    path = work / f"{name}_{size}.onnx"
    export_onnx(name, path, input_shape=(3, size, size), num_classes=200)
    return path, (3, size, size)


def run_model(
    name: str, size: int, count: int, batch: int, threads: int, seed: int, frozen_bn: str
) -> dict:
    with tempfile.TemporaryDirectory(prefix="etgraph-memval-") as tmp:
        work = Path(tmp)
        path, shape = export(name, size, work)
        model = LoadedModel.load(path)
        n = len(model.tensors)
        params = np.array([t.params for t in model.tensors], dtype=np.float64)
        cache = ArtifactCache(work / "artifacts")
        t0 = time.perf_counter()
        prof = profile_memory(
            model,
            batch_size=batch,
            input_shapes=shape,
            threads=threads,
            artifact_cache=cache,
            frozen_bn=frozen_bn,
        )
        profiling_s = time.perf_counter() - t0
        rng = np.random.default_rng(seed)
        cases = [("random", float("nan"), m) for m in random_masks(n, count, rng)]
        cases += [("dp", frac, m) for frac, m in dp_masks(prof, params)]
        model_b = model.with_batch(batch, {model.inputs[0].name: shape})
        rows = []
        for kind, frac, mask in cases:
            paths, _ = cache.get(model_b, *model.split(mask), frozen_bn=frozen_bn)
            cold = []
            for _ in range(1 + RETRIES):
                (raw,) = measure_peaks(
                    [paths.directory], batch_size=batch, input_shape=shape, threads=threads
                )
                if raw["imported"]["VmRSS"] >= COLD_FRACTION * prof.import_mb:
                    break
                log.warning(
                    "%s: %.0f MiB resident after the imports, not ~%.0f: library pages were "
                    "evicted (memory pressure); measuring again",
                    name,
                    raw["imported"]["VmRSS"],
                    prof.import_mb,
                )
                cold.append(raw)
            measured = raw["steps"]["VmHWM"]
            parts = prof.parts_mb(mask)
            rows.append(
                {
                    "kind": kind,
                    "budget_fraction": frac,
                    "selected": int(mask.sum()),
                    "earliest": int(np.argmax(mask)),
                    "mask": np.flatnonzero(mask).tolist(),
                    "predicted_mb": parts["peak_mb"],
                    "measured_mb": measured,
                    "error": parts["peak_mb"] / measured - 1.0,
                    "parts": parts,
                    "rss": raw,
                    "cold_starts": cold,
                }
            )
            log.info(
                "%s %s: %d tensors, predicted %.0f, measured %.0f MiB (%+.1f%%)",
                name,
                kind,
                rows[-1]["selected"],
                parts["peak_mb"],
                measured,
                100 * rows[-1]["error"],
            )
            shutil.rmtree(paths.directory, ignore_errors=True)  # bounded disk use
    result = {
        "model": name,
        "input_size": shape[1],
        "batch_size": batch,
        "seed": seed,
        "frozen_bn": frozen_bn,
        "tensors": n,
        "profile": prof.to_dict(),
        "profiling_s": profiling_s,
        "full_predicted_mb": prof.full_peak_mb,
    }
    return _summary(result, rows)


def _summary(result: dict, rows: list[dict]) -> dict:
    errors = np.abs([r["error"] for r in rows])
    return {
        **result,
        "rows": rows,
        "mean_abs_error": float(errors.mean()),
        "max_abs_error": float(errors.max()),
    }


def rescore(result: dict) -> dict:
    """``result`` (a :func:`run_model` record) with the model re-fitted by the current code to
    the same anchor measurements and every row re-predicted: nothing is measured again. Rows
    without mask indices (older records) get theirs back from the seed (random masks) and the
    recorded profile (the DP's masks)."""
    with tempfile.TemporaryDirectory(prefix="etgraph-rescore-") as tmp:
        size = result["input_size"]
        path, shape = export(result["model"], size, Path(tmp))
        model = LoadedModel.load(path)
    old = result["profile"]
    n = len(model.tensors)
    params = np.array([t.params for t in model.tensors], dtype=np.float64)
    model_b = model.with_batch(result["batch_size"], {model.inputs[0].name: shape})
    proxy = activation_bytes_after(model_b, [t.layer for t in model.tensors])
    points = [m["mask_from"] for m in old["measurements"]]
    raw = [m["rss"] for m in old["measurements"]]
    prof = fit_memory_profile(
        model,
        proxy,
        points,
        raw,
        batch_size=result["batch_size"],
        input_shape=shape,
        threads=old["threads"],
        frozen_bn=old.get("frozen_bn", "train"),
    )
    prof.profiling_s = old["profiling_s"]
    randoms = iter(
        random_masks(
            n,
            sum(r["kind"] == "random" for r in result["rows"]),
            np.random.default_rng(result.get("seed", 0)),
        )
    )
    dps = dict(dp_masks(MemoryProfile.from_dict(old), params))
    rows = []
    for row in result["rows"]:
        if "mask" in row:
            mask = np.zeros(n, dtype=bool)
            mask[row["mask"]] = True
        elif row["kind"] == "random":
            mask = next(randoms)
        else:
            mask = dps[row["budget_fraction"]]
        assert int(mask.sum()) == row["selected"] and int(np.argmax(mask)) == row["earliest"]
        parts = prof.parts_mb(mask)
        rows.append(
            {
                **row,
                "mask": np.flatnonzero(mask).tolist(),
                "predicted_mb": parts["peak_mb"],
                "error": parts["peak_mb"] / row["measured_mb"] - 1.0,
                "parts": parts,
            }
        )
    out = _summary(result, rows)
    out["profile"] = prof.to_dict()
    out["full_predicted_mb"] = prof.full_peak_mb
    return out


def print_table(results: list[dict]) -> None:
    print(
        "| model | masks | mean \\|error\\| | max \\|error\\| | DP masks max \\|error\\| | "
        "full peak MiB (pred) | load floor MiB | base MiB | B/param | anchors | BN | profiling s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        dp = [abs(x["error"]) for x in r["rows"] if x["kind"] == "dp"]
        p = r["profile"]
        print(
            f"| {r['model']} ({r['input_size']} px) | {len(r['rows'])} | "
            f"{100 * r['mean_abs_error']:.1f}% | {100 * r['max_abs_error']:.1f}% | "
            f"{100 * max(dp) if dp else float('nan'):.1f}% | {r['full_predicted_mb']:.0f} | "
            f"{p['load_mb']:.0f} | {p['base_mb']:.0f} | {p['bytes_per_param']:.1f} | "
            f"{len(p['anchors'])} | {p.get('frozen_bn', 'train')} | {r['profiling_s']:.0f} |"
        )


@click.command()
@click.option("--models", "names", multiple=True, type=click.Choice(MODELS))
@click.option("--input-size", default=128, show_default=True)
@click.option("--count", default=20, show_default=True, help="Random masks per model.")
@click.option("--batch-size", default=4, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--frozen-bn", type=click.Choice(FROZEN_BN_MODES), default=DEFAULT_FROZEN_BN, show_default=True
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option(
    "--rescore",
    "rescore_paths",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Re-fit the model to the anchors of these results and re-predict their rows "
    "(nothing measured); with --json, write the rescored results there.",
)
def main(
    names, input_size, count, batch_size, threads, seed, frozen_bn, json_path, rescore_paths
) -> None:
    """Predicted vs measured peak RSS of random and DP selections."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)
    if rescore_paths:
        results = [rescore(r) for p in rescore_paths for r in json.loads(Path(p).read_text())]
        if json_path:
            Path(json_path).write_text(json.dumps(results, indent=1))
        print_table(results)
        return
    results = []
    for name in names or MODELS:
        results.append(run_model(name, input_size, count, batch_size, threads, seed, frozen_bn))
        if json_path:
            Path(json_path).write_text(json.dumps(results, indent=1))
        print_table(results[-1:])
    print()
    print_table(results)


if __name__ == "__main__":
    main()
