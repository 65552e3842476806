"""Which ONNX Runtime session options make each of etgraph's sessions fastest on this machine.

Every candidate configuration (:class:`etgraph.ort_options.OrtConfig` + intra-op threads) is
measured in each session role etgraph has (:data:`etgraph.ort_options.ROLES`):

* ``train`` — the training loop: one ``TrainingSession`` (Module + AdamW + grad reset) stepped
  back to back, on the full artifacts and on an elastic selection (the last half of the tensors);
* ``rr`` — the profiler's situation: three ``TrainingSession`` s (full, elastic, last tensor)
  and a per-node profiled ``InferenceSession`` of the full training graph stepped round robin,
  one run each per round. Reported: the full step in round robin / the same step alone under
  the ``train`` winner — 1.00 means the profile measures what training runs;
* ``probe`` — importance's ``GradientSession``: forward + backward of one probe batch;
* ``eval`` — an ``InferenceSession`` of the forward model (scoring the exported model).

Configurations are measured in blocks (``--block`` consecutive steps; a block's first two are
warm-up) and the blocks of all configurations alternate round robin, ``--rounds`` times, so
load changes hit them alike, while a configuration's spinning threads never overlap another's
steps within a block. Figures are medians of per-step times (ms) and, beside them, the ratio
to the first configuration (``off``: etgraph's previous setting, spinning off everywhere).

Usage::

    python benchmarks/ort_config.py                      # embedded default model
    python benchmarks/ort_config.py --model m.onnx --input-shape 3x96x96 --json out.json
"""

from __future__ import annotations

import json
import os
import statistics
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
from etgraph.data import DEFAULT_MODEL_PATH  # noqa: E402
from etgraph.measure import _training_feeds, random_batch  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402
from etgraph.ort_options import OrtConfig, session_options  # noqa: E402
from etgraph.profile import format_shapes  # noqa: E402
from etgraph.sessions import GradientSession, TrainingSession, inference_session  # noqa: E402

#: (label, options, intra-op threads); the first row is the reference of the ratios.
CONFIGS = [
    ("off", OrtConfig(spinning=False, stop_spinning=False), 2),
    ("on", OrtConfig(spinning=True, stop_spinning=False), 2),
    ("on+stop", OrtConfig(spinning=True, stop_spinning=True), 2),
    ("1 thread", OrtConfig(spinning=False, stop_spinning=False), 1),
    ("off extended", OrtConfig(spinning=False, optimization="extended"), 2),
    ("off basic", OrtConfig(spinning=False, optimization="basic"), 2),
    ("off no arena", OrtConfig(spinning=False, arena=False), 2),
    ("off no mem-pattern", OrtConfig(spinning=False, mem_pattern=False), 2),
]


def _load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Role:
    """One role's sessions under one configuration; :meth:`block` times ``n`` steps (s)."""

    def __init__(self, name, step):
        self.name, self.step, self.times = name, step, []

    def block(self, n: int) -> None:
        for i in range(n):
            t0 = time.perf_counter()
            self.step()
            dt = time.perf_counter() - t0
            if i >= 2:
                self.times.append(dt)


def build(model, dirs, batch, cfg, threads, work):
    """The role runners of one configuration."""
    x, y = batch.inputs, batch.labels
    full = TrainingSession(dirs["full"], dirs["full"] / "checkpoint", threads, config=cfg)
    elastic = TrainingSession(dirs["elastic"], dirs["elastic"] / "checkpoint", threads, config=cfg)
    rr_sessions = [
        TrainingSession(dirs[k], dirs[k] / "checkpoint", threads, config=cfg)
        for k in ("full", "elastic", "last")
    ]
    profiled = inference_session(
        dirs["full"] / "training_model.onnx",
        session_options(threads, str(Path(work) / "trace"), config=cfg),
    )
    weights = model.initial_weights()
    feeds = _training_feeds(profiled, weights, batch)
    rr_times: list[float] = []

    def rr_step():  # one round: the full step is timed, the others run around it
        profiled.run(None, feeds)
        t0 = time.perf_counter()
        rr_sessions[0].step(x, y)
        rr_times.append(time.perf_counter() - t0)
        rr_sessions[1].step(x, y)
        rr_sessions[2].step(x, y)

    probe = GradientSession(dirs["full"], threads, config=cfg)
    infer = inference_session(
        model.with_batch(len(y), {k: v.shape[1:] for k, v in x.items()}).SerializeToString(),
        session_options(threads, config=cfg),
    )
    roles = {
        "train full": Role("train full", lambda: full.step(x, y)),
        "train elastic": Role("train elastic", lambda: elastic.step(x, y)),
        "rr round": Role("rr round", rr_step),
        "probe": Role("probe", lambda: probe.accumulate([(x, y)])),
        "eval": Role("eval", lambda: infer.run(None, x)),
    }
    return roles, rr_times, profiled


@click.command()
@click.option("--model", "model_path", default=None, help="ONNX model [embedded default].")
@click.option("--input-shape", default=None, help="CxHxW [the model's].")
@click.option("--batch-size", default=4, show_default=True)
@click.option("--rounds", default=8, show_default=True, help="Round-robin rounds of blocks.")
@click.option("--block", default=25, show_default=True, help="Steps per block (2 warm-up).")
@click.option("--configs", default=None, help="Comma-separated config labels [all].")
@click.option("--json", "json_path", default=None, help="Write the results here.")
def main(model_path, input_shape, batch_size, rounds, block, configs, json_path):
    model = LoadedModel.load(model_path or DEFAULT_MODEL_PATH)
    shapes = model.input_shapes(input_shape or None)
    batch = random_batch(batch_size, model.inputs, shapes, model.task)
    n = len(model.tensors)
    masks = {
        "full": np.ones(n, bool),
        "elastic": np.arange(n) >= n // 2,
        "last": np.arange(n) == n - 1,
    }
    load_start = _load_avg()
    with tempfile.TemporaryDirectory(prefix="etgraph-ortcfg-") as work:
        model_b = model.with_batch(batch_size, shapes)
        dirs = {
            k: artifacts.generate(model_b, *model.split(m), Path(work) / k).directory
            for k, m in masks.items()
        }
        runs = []
        chosen = [c for c in CONFIGS if configs is None or c[0] in configs.split(",")]
        for label, cfg, threads in chosen:
            roles, rr_times, profiled = build(model, dirs, batch, cfg, threads, work)
            runs.append((label, cfg, threads, roles, rr_times, profiled))
        for _ in range(rounds):
            for *_, roles, _, _ in runs:
                for role in roles.values():
                    role.block(block)
        for *_, profiled in runs:
            Path(profiled.end_profiling()).unlink(missing_ok=True)
    load_end = _load_avg()

    rows = []
    for label, cfg, threads, roles, rr_times, _ in runs:
        med = {k: statistics.median(r.times) * 1e3 for k, r in roles.items()}
        med["rr full"] = statistics.median(rr_times[2:]) * 1e3
        rows.append({"config": label, "threads": threads, **cfg.__dict__, "ms": med})
    ref = rows[0]["ms"]
    best_train = min(r["ms"]["train full"] for r in rows)
    cols = ["train full", "train elastic", "rr full", "probe", "eval"]
    print(
        f"model {model.source.name} {format_shapes(shapes)} batch {batch_size}; "
        f"{rounds} rounds x {block}-step blocks; load average {load_start} -> {load_end}"
    )
    print(f"{'config':<24}" + "".join(f"{c + ' ms':>19}" for c in cols) + f"{'rr/alone*':>11}")
    for r in rows:
        cells = "".join(f"{r['ms'][c]:>10.2f} ({r['ms'][c] / ref[c]:.2f}x)" for c in cols)
        print(f"{r['config']:<24}{cells}{r['ms']['rr full'] / best_train:>11.2f}")
    print("ratios: to 'off'; rr/alone*: full step in round robin / the fastest full step alone")
    if json_path:
        out = {
            "model": str(model.source),
            "input_shapes": {k: list(v) for k, v in shapes.items()},
            "batch_size": batch_size,
            "rounds": rounds,
            "block": block,
            "load_average": [load_start, load_end],
            "rows": rows,
        }
        Path(json_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
