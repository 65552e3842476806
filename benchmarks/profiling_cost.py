"""What up-front profiling costs, per profiling level, measured side by side (issue #16).

For each model, ``--rounds`` rounds; each round profiles the model once at every level in
``--levels`` (the order alternates round to round, so a load change hits the levels alike),
each time from scratch (no profile cache; :func:`etgraph.profiler.profile_model`, batch 4,
the machine's physical cores as threads). Printed per model and level: the median profiling
wall time (``Profile.profiling_s``, s) and the process's CPU time over it (all threads; what
a busy machine does not inflate as much), the measured rounds the fast level needed (it adds
rounds until its runs reproduce), the profile's measured full step and ``T_full``, and the
median over rounds of the per-round ratio of each level's time to the first level's — the
figure to trust on a loaded machine. The 1-minute load average before and after is printed.

Models: ``default`` (the embedded model, 3x32x32) and any zoo model at ``--input-size``
(``models/export.py``; ``--onnx-dir`` holds ``<model>_<size>.onnx`` exports to reuse).

Usage::

    python benchmarks/profiling_cost.py --models default,mobilenet_v2,resnet50 --rounds 3 \\
        --json benchmarks/results/profiling_cost.json
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from etgraph.data import DEFAULT_MODEL_PATH  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402
from etgraph.profiler import profile_model  # noqa: E402


def _load() -> float:
    return os.getloadavg()[0]


def _model_path(name: str, input_size: int, onnx_dir: Path | None, work: Path) -> Path:
    if name == "default":
        return Path(DEFAULT_MODEL_PATH)
    if onnx_dir is not None and (onnx_dir / f"{name}_{input_size}.onnx").is_file():
        return onnx_dir / f"{name}_{input_size}.onnx"
    from models.export import export_onnx

    shape = (3, input_size, input_size)
    return export_onnx(name, work / f"{name}.onnx", input_shape=shape, num_classes=10, seed=0)


def run_model(name: str, path: Path, levels: list[str], rounds: int) -> list[dict]:
    """``rounds`` side-by-side rounds of profiling ``path`` at each level; one row per level."""
    model = LoadedModel.load(path)
    runs: dict[str, list[dict]] = {level: [] for level in levels}
    for r in range(rounds):
        order = levels if r % 2 == 0 else levels[::-1]
        for level in order:
            before = _load()
            cpu = time.process_time()
            prof = profile_model(model, batch_size=4, level=level)
            runs[level].append(
                {
                    "profiling_s": prof.profiling_s,
                    "cpu_s": time.process_time() - cpu,
                    "repeats": prof.repeats,
                    "measured_full_step_ms": prof.measured_full_step_us / 1e3,
                    "t_full_ms": prof.t_full_us / 1e3,
                    "load_before": before,
                    "load_after": _load(),
                }
            )
            logging.info("%s %s round %d: %.2f s", name, level, r, prof.profiling_s)
    base = runs[levels[0]]
    rows = []
    for level in levels:
        rs = runs[level]
        rows.append(
            {
                "model": name,
                "level": level,
                "tensors": len(model.tensors),
                "rounds": rounds,
                "profiling_s_median": statistics.median(x["profiling_s"] for x in rs),
                "profiling_s": [x["profiling_s"] for x in rs],
                "cpu_s_median": statistics.median(x["cpu_s"] for x in rs),
                "ratio_to_first_median": statistics.median(
                    x["profiling_s"] / b["profiling_s"] for x, b in zip(rs, base, strict=True)
                ),
                "repeats": [x["repeats"] for x in rs],
                "measured_full_step_ms_median": statistics.median(
                    x["measured_full_step_ms"] for x in rs
                ),
                "t_full_ms_median": statistics.median(x["t_full_ms"] for x in rs),
                "load_min": min(x["load_before"] for x in rs),
                "load_max": max(x["load_after"] for x in rs),
                "runs": rs,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'model':<13} {'level':<9} {'profile s':>9} {'CPU s':>7} {'ratio':>6} {'repeats':>9} "
        f"{'full ms':>8} {'T_full ms':>9} {'load':>9}"
    )
    click.echo(head)
    click.echo("-" * len(head))
    for r in rows:
        reps = f"{min(r['repeats'])}-{max(r['repeats'])}"
        click.echo(
            f"{r['model']:<13} {r['level']:<9} {r['profiling_s_median']:>9.2f} "
            f"{r['cpu_s_median']:>7.2f} "
            f"{r['ratio_to_first_median']:>6.2f} {reps:>9} "
            f"{r['measured_full_step_ms_median']:>8.1f} {r['t_full_ms_median']:>9.1f} "
            f"{r['load_min']:>4.1f}-{r['load_max']:<4.1f}"
        )


@click.command()
@click.option("--models", default="default,mobilenet_v2,resnet50", show_default=True)
@click.option("--levels", default="fast,thorough", show_default=True)
@click.option("--rounds", default=3, show_default=True, type=int)
@click.option("--input-size", default=128, show_default=True, help="H = W of zoo models.")
@click.option("--onnx-dir", default=None, type=click.Path(file_okay=False))
@click.option("--json", "json_out", default=None, help="Also write the rows here.")
def main(models, levels, rounds, input_size, onnx_dir, json_out):
    """Print profiling seconds per model and level, measured side by side."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger(__name__).setLevel(logging.INFO)
    level_list = [lv.strip() for lv in levels.split(",")]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="etgraph-profiling-cost-") as tmp:
        for name in models.split(","):
            path = _model_path(
                name.strip(), input_size, Path(onnx_dir) if onnx_dir else None, Path(tmp)
            )
            new = run_model(name.strip(), path, level_list, rounds)
            rows += new
            print_table(new)
            if json_out:
                Path(json_out).write_text(json.dumps(rows, indent=1))
    click.echo("")
    print_table(rows)


if __name__ == "__main__":
    sys.exit(main())
