"""The time model with and without the kernels of nodes ORT renamed (session 22).

ORT's graph optimisations rewrite some nodes of a training graph under new names
(``"<node>/MatmulTransposeFusion/"``, ``"fused <node>/MatMulAddFusion/"``, ...). The profiler
counts such a kernel for the node whose name it carries (:func:`etgraph.measure.traced_node`);
until session 22 it counted for none, and calibration put its time into the fixed per-step
cost. This benchmark profiles each model once (fast level) and folds the SAME measurements both
ways (``exact``: kernels under a graph node's own name only, the rule until session 22;
``renamed``: the rule in use), then scores both time models on the same masks trained for real
(:func:`etgraph.measure.measure_selection_steps_us`: 16 random masks and each model's DP masks
at rho 0.3-0.8, stepped round robin with full training): the error of the predicted ratio to
the full step against the ratio measured beside each mask.

Models: ``text`` (all-MiniLM-L6-v2 with a 5-class head at --head-lr-scale 10, T = 16, batch 8:
the quality issue's text task, torch's export with a Transpose before every dense MatMul) and
zoo names at ``--input-size`` (batch 4).

    python benchmarks/fused_kernels.py [--models text,resnet18] [--input-size 64]
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from time_model import dp_masks, random_masks  # noqa: E402

from etgraph import measure, profiler  # noqa: E402
from etgraph.measure import ProfiledGraph, measure_selection_steps_us  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


class _BothRules:
    """Patches the profiler so one profiling run yields the profile of each rule: the trace's
    events are kept, each graph's node times are also computed by exact names, and ``fold``
    runs once per rule on the same measurements."""

    def __init__(self):
        self.exact_times: dict[int, dict] = {}
        self.exact_profiles = []
        self._events: list[dict] = []

    def __enter__(self):
        self._saved = (measure._kernel_events, ProfiledGraph.result, profiler.fold)
        kernel_events, result, fold = self._saved

        def events(trace_path):
            self._events = kernel_events(trace_path)
            return self._events

        def both(graph, warmup, quantile=measure.TIME_QUANTILE):
            renamed = result(graph, warmup, quantile)
            durations = defaultdict(list)
            for ev in self._events:
                durations[ev["name"][: -len("_kernel_time")]].append(float(ev["dur"]))
            times = {
                node: measure.robust_time(d[warmup:] if len(d) > warmup else d, quantile)
                for node, d in durations.items()
            }
            self.exact_times[id(renamed)] = {
                name: measure.NodeTiming(op, outputs, times[name])
                for name, op, outputs in graph.nodes
                if name in times
            }
            return renamed

        def fold_both(model, model_b, measured, *args, **kwargs):
            exact = {c: self.exact_times[id(t)] for c, t in measured.node_times.items()}
            exact_measured = dataclasses.replace(measured, node_times=exact)
            self.exact_profiles.append(fold(model, model_b, exact_measured, *args, **kwargs))
            return fold(model, model_b, measured, *args, **kwargs)

        measure._kernel_events = events
        ProfiledGraph.result = both
        profiler.fold = fold_both
        return self

    def __exit__(self, *exc):
        measure._kernel_events, ProfiledGraph.result, profiler.fold = self._saved


def _model(name: str, input_size: int, work: Path) -> tuple[Path, int]:
    """(ONNX path, batch size) of a model of this benchmark."""
    if name == "text":
        from quality_ablation import _prepare

        return Path(_prepare("text", work, 10.0)["model"]), 8
    from models.export import export_onnx

    shape = (3, input_size, input_size)
    return export_onnx(name, work / f"{name}.onnx", input_shape=shape, num_classes=10), 4


def run(name: str, input_size: int, work: Path) -> dict:
    path, batch = _model(name, input_size, work)
    model = LoadedModel.load(path)
    with _BothRules() as rules:
        renamed = profiler.profile_model(model, batch_size=batch, level="fast")
    exact = rules.exact_profiles[-1]
    params = np.array([t.params for t in model.tensors], dtype=np.float64)
    prior = params / params.sum()
    rng = np.random.default_rng(0)
    masks = random_masks(len(model.tensors), 16, rng)
    masks += [m for _, m in dp_masks(renamed, prior)] + [m for _, m in dp_masks(exact, prior)]
    steps, full = measure_selection_steps_us(
        model, np.array(masks), batch_size=batch, repeats=6, warmup=2, group=4
    )
    row = dict(model=name, masks=len(masks), full_ms=float(np.median(full)) / 1e3)
    row["load"] = os.getloadavg()[0]
    for label, prof in (("exact", exact), ("renamed", renamed)):
        predicted = np.array([prof.predicted_step_us(m) / prof.t_full_us for m in masks])
        err = steps / full / predicted - 1.0
        row[label] = dict(
            mean_abs=float(np.abs(err).mean()),
            max_abs=float(np.abs(err).max()),
            bias=float(err.mean()),
            step_overhead_ms=prof.step_overhead_us / 1e3,
            forward_ms=prof.forward_us / 1e3,
            errors=err.tolist(),
        )
    return row


@click.command()
@click.option("--models", default="text,resnet18", show_default=True, help="text and zoo names.")
@click.option("--input-size", default=64, show_default=True, help="Zoo models' H = W.")
@click.option("--json", "json_out", default=str(RESULTS / "fused_kernels.json"), show_default=True)
def main(models: str, input_size: int, json_out: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="etgraph-fused-"))
    try:
        rows = [run(name, input_size, work) for name in models.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| model | masks | full step ms | rule | mean / max \\|error\\| | bias | fixed cost ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for label in ("exact", "renamed"):
            e = r[label]
            print(
                f"| {r['model']} | {r['masks']} | {r['full_ms']:.0f} | {label} | "
                f"{100 * e['mean_abs']:.1f}% / {100 * e['max_abs']:.1f}% | "
                f"{100 * e['bias']:+.1f}% | {e['forward_ms']:.1f} |"
            )
    Path(json_out).write_text(json.dumps(dict(input_size=input_size, rows=rows), indent=2))


if __name__ == "__main__":
    main()
