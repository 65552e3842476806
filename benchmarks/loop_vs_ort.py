"""etgraph's training loop beside a bare ONNX Runtime training loop on the same artifacts.

Per round (``--rounds``, round robin so load changes hit all rows alike), for the full
artifacts and for a selective one (strategy ``prefix`` at ``--rho``: the longest suffix of the
tensors that fits ``rho * T_full``, a selection that does not depend on importance, so the loop
trains exactly the artifacts the bare loop steps, in the run's batch-norm mode, checked):

* ``etgraph loop`` — :func:`etgraph.loop.train` itself, one epoch of ``--steps`` steps on the
  embedded digits task (open loop), with its session options chosen by the run's own probe
  (``spinning="auto"``, :func:`etgraph.config_choice.choose_train_config`; the label chosen is
  printed): the loop's time per step, ``(epoch wall time - re-selection - reference steps -
  probe) / steps`` (data, learning rate, progress bar and the step), and its median step
  (``median_step_us``); the probe's time per run is printed beside;
* ``etgraph session <label>`` — :meth:`etgraph.sessions.TrainingSession.train_step` stepped
  in a plain loop over the same batches with each candidate of
  :data:`etgraph.config_choice.TRAIN_CANDIDATES`;
* ``ORT defaults`` — ``onnxruntime.training.api.Module`` + ``Optimizer`` with ORT's default
  ``SessionOptions`` (``module(x, y)``, ``optimizer.step()``, ``lazy_reset_grad()``, the API's
  documented loop) over the same batches.

Figures: medians over rounds of per-step times (ms); the ratio column is to ``ORT defaults``
(< 1: etgraph faster). The load average is printed with the table.

Usage::

    python benchmarks/loop_vs_ort.py [--rounds 5] [--steps 120] [--json out.json]
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import onnxruntime as ort
from onnxruntime.training import api

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from etgraph.artifacts import ArtifactCache  # noqa: E402
from etgraph.config import TrainConfig  # noqa: E402
from etgraph.config_choice import TRAIN_CANDIDATES  # noqa: E402
from etgraph.data import DEFAULT_MODEL_PATH, load_dataset  # noqa: E402
from etgraph.loop import train  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402
from etgraph.profile import default_cache_dir  # noqa: E402
from etgraph.profiler import profile_model  # noqa: E402
from etgraph.rundir import read_log  # noqa: E402
from etgraph.selection import select_for_rho  # noqa: E402
from etgraph.sessions import TrainingSession  # noqa: E402


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _bare_steps(directory: Path, batches) -> list[float]:
    """Per-step seconds of ORT's documented training loop with default options."""
    state = api.CheckpointState.load_checkpoint(str(directory / "checkpoint"))
    module = api.Module(
        str(directory / "training_model.onnx"),
        state,
        str(directory / "eval_model.onnx"),
        session_options=ort.SessionOptions(),
    )
    optimizer = api.Optimizer(str(directory / "optimizer_model.onnx"), module)
    module.train()
    times = []
    for x, y in batches:
        t0 = time.perf_counter()
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _session_steps(directory: Path, batches, threads, input_names, config) -> list[float]:
    session = TrainingSession(
        directory, directory / "checkpoint", threads, input_names=input_names, config=config
    )
    times = []
    for x, y in batches:
        t0 = time.perf_counter()
        session.train_step(x, y, 1e-4)
        times.append(time.perf_counter() - t0)
    return times[1:]


@click.command()
@click.option("--rounds", default=5, show_default=True)
@click.option("--steps", default=120, show_default=True, help="Steps per measurement.")
@click.option("--rho", default=0.5, show_default=True)
@click.option("--json", "json_path", default=None)
def main(rounds, steps, rho, json_path):
    logging.basicConfig(level=logging.WARNING)
    model = LoadedModel.load(DEFAULT_MODEL_PATH)
    shape = tuple(*model.input_shapes().values())
    prof = profile_model(model, batch_size=4, cache_dir=default_cache_dir())
    n = len(model.tensors)
    frozen_bn = TrainConfig().frozen_bn  # the run's mode: its time model and its artifacts
    masks = {
        "full": np.ones(n, bool),
        "selective": select_for_rho(
            prof.for_frozen_bn(frozen_bn), rho, None, strategy="prefix"
        ).mask,
    }
    data = load_dataset(None, input_shape=shape, num_classes=model.num_classes, seed=0)
    batches = list(data.train_batches(4, seed=0))[:steps]
    load_start = _load()
    times: dict[tuple[str, str], list[float]] = {}
    chosen: dict[str, list[str]] = {}
    probe_s: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="etgraph-loopvsort-") as work:
        cache = ArtifactCache(Path(work) / "artifacts")
        dirs = {
            k: cache.get(model.proto, *model.split(m), frozen_bn=frozen_bn)[0].directory
            for k, m in masks.items()
        }
        for r in range(rounds):
            for kind in masks:
                strategy = "full" if kind == "full" else "prefix"
                cfg = TrainConfig(
                    epochs=1,
                    period=1,
                    rho=rho,
                    strategy=strategy,
                    max_steps_per_epoch=steps,
                    max_val_batches=1,
                    closed_loop=False,
                    threads=prof.threads,
                )
                out = Path(work) / f"run-{kind}-{r}"
                train(
                    model, prof, cfg, out, artifacts_root=Path(work) / "artifacts", progress=False
                )
                rec = read_log(out)[0]
                if rec["selection"] != np.flatnonzero(masks[kind]).tolist():
                    raise SystemExit(f"the loop trained {rec['selection']}, not the {kind} mask")
                loop_s = (rec["wall_time_s"] - rec["reselection_s"] - rec["reference_s"]) - rec[
                    "ort_probe_s"
                ]
                loop_s /= steps
                chosen.setdefault(kind, []).append(rec["ort_config"])
                probe_s.setdefault(kind, []).append(rec["ort_probe_s"])
                times.setdefault((kind, "etgraph loop"), []).append(loop_s)
                times.setdefault((kind, "etgraph loop, median step"), []).append(
                    rec["median_step_us"] * 1e-6
                )
                for label, config in TRAIN_CANDIDATES.items():
                    times.setdefault((kind, f"etgraph session {label}"), []).append(
                        statistics.median(
                            _session_steps(
                                dirs[kind], batches, prof.threads, model.input_names, config
                            )
                        )
                    )
                times.setdefault((kind, "ORT defaults"), []).append(
                    statistics.median(_bare_steps(dirs[kind], batches))
                )
    load_end = _load()
    print(
        f"default model {'x'.join(map(str, shape))}, batch 4, {steps} steps x {rounds} rounds; "
        f"load average {load_start} -> {load_end}"
    )
    print(f"{'artifacts':<10}{'loop':<28}{'ms/step':>9}{'vs ORT defaults':>17}")
    rows = []
    for kind in masks:
        ref = statistics.median(times[(kind, "ORT defaults")])
        for (k, label), values in times.items():
            if k != kind:
                continue
            ms = statistics.median(values) * 1e3
            print(f"{kind:<10}{label:<28}{ms:>9.2f}{ms / (ref * 1e3):>16.2f}x")
            rows.append({"artifacts": kind, "loop": label, "ms": ms, "ratio": ms / (ref * 1e3)})
        print(
            f"{kind:<10}etgraph loop chose {', '.join(chosen[kind])}; probe "
            f"{', '.join(f'{s:.2f}' for s in probe_s[kind])} s per run"
        )
    if json_path:
        Path(json_path).write_text(
            json.dumps(
                {
                    "load_average": [load_start, load_end],
                    "rows": rows,
                    "chosen": chosen,
                    "probe_s": probe_s,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
