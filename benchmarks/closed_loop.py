"""Does the training loop achieve the rho it is asked for? The closed loop against the open one.

For each requested ``--rho``, two runs of ``etgraph train`` (:func:`etgraph.loop.train`,
embedded default model and digits, ``--epochs`` epochs, one period per epoch) alternate: the
closed loop (default: the time model re-fitted to the measured steps every period) and the
open loop (the profile's time model as is). Every epoch measures its steps and interleaved
full reference steps alike (:mod:`etgraph.loop`), so its achieved ratio is
``rho_measured = elastic step / full step`` measured in the same conditions; the table gives
``rho_measured / rho`` per period (target: within ±5% from the second period on) and the
overheads of the closed loop (reference steps, fitting) as a share of the wall time.

``--hog``: a bounded CPU hog (``--hog-procs`` busy processes of this benchmark, killed at the
end) starts at the beginning of epoch ``--hog-epoch`` of the closed-loop run (it is started
from the run's own log: when epoch ``hog_epoch - 1`` is written), and the table shows whether
the ratio comes back within ±5% one period after.

``--model`` (a 5-class classifier, e.g. ``python -m models.export mobilenet_v2 -o m.onnx
--input-size 128 --num-classes 5``) trains it on the digits task at its input shape.

Usage::

    python benchmarks/closed_loop.py [--rho 0.5 --rho 0.3] [--epochs 6] [--hog] [--json out.json]
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from etgraph.config import TrainConfig  # noqa: E402
from etgraph.data import DEFAULT_MODEL_PATH  # noqa: E402
from etgraph.loop import train  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402
from etgraph.profile import default_cache_dir  # noqa: E402
from etgraph.profiler import profile_model  # noqa: E402
from etgraph.rundir import read_log  # noqa: E402

HOG = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Hog:
    """Starts ``procs`` busy processes (at most ``seconds`` long) once ``out/log.jsonl`` has
    ``after`` records; :meth:`stop` kills them."""

    def __init__(self, out: Path, after: int, procs: int, seconds: float):
        self.out, self.after, self.procs, self.seconds = out, after, procs, seconds
        self.children: list[subprocess.Popen] = []
        self.started_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self):
        log = self.out / "log.jsonl"
        while not self._stop.is_set():
            if log.exists() and len(log.read_text().splitlines()) >= self.after:
                code = HOG.format(seconds=self.seconds)
                self.children = [
                    subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.procs)
                ]
                self.started_at = time.time()
                return
            time.sleep(0.01)

    def stop(self):
        self._stop.set()
        self._thread.join()
        for child in self.children:
            child.kill()
            child.wait()


def run(model, prof, rho, epochs, closed, out, steps, budget, hog=None):
    cfg = TrainConfig(
        reference_budget=budget,
        epochs=epochs,
        period=1,
        rho=rho,
        max_steps_per_epoch=steps,
        max_val_batches=4,
        closed_loop=closed,
        threads=prof.threads,
    )
    watcher = Hog(out, **hog) if hog else None
    try:
        result = train(model, prof, cfg, out, progress=False)
    finally:
        if watcher:
            watcher.stop()
    return result, read_log(out)


def report(results: list[dict], hog: bool) -> None:
    """Print the per-period tables and the summary of ``results`` (as saved by ``--json``)."""
    # Against the requested rho (the target) and against the rho the DP's (fitted) time model
    # predicted for the selection it made: the model's own error. They differ where no
    # selection fills the budget (coarse models: the DP's budget is an upper bound).
    tables = (
        ("wall", "rho_measured", "rho"),
        ("CPU time", "rho_measured_cpu", "rho"),
        ("wall", "rho_measured", "rho_predicted"),
    )
    r0 = results[0]
    epochs = max(len(r["records"]) for r in results)
    for clock, key, over in tables:
        print(
            f"{key} / {over} per period ({clock}); {r0['model']} "
            f"{r0['input_shape']}, 1 epoch per period, reference budget {r0['reference_budget']}"
        )
        print(f"{'rho':>5} {'loop':<7}" + "".join(f"{'p' + str(e):>8}" for e in range(epochs)))
        for r in results:
            ratios = [rec[key] / (r["rho"] if over == "rho" else rec[over]) for rec in r["records"]]
            marks = "".join(
                f"{x:>7.3f}{'*' if r['hog_epoch'] and i + 1 >= r['hog_epoch'] else ' '}"
                for i, x in enumerate(ratios)
            )
            print(f"{r['rho']:>5.2f} {r['loop']:<7}{marks}")
    if hog:
        print("* = CPU hog running")
    print(
        f"{'rho':>5} {'loop':<7}{'achieved':>9}{'cpu':>7}{'max|err| p1+ wall':>19}{'cpu':>7}"
        f"{'vs pred':>9}{'speedup':>9}{'ref %':>7}{'fit ms':>8}{'sel':>5}  spinning  load average"
    )
    for r in results:
        s = r["summary"]
        later = r["records"][1:]
        errs = {
            k: 100 * max(abs(rec[k] / r["rho"] - 1) for rec in later)
            for k in ("rho_measured", "rho_measured_cpu")
        }
        errs["predicted"] = 100 * max(
            abs(rec["rho_measured"] / rec["rho_predicted"] - 1) for rec in later
        )
        fit_ms = 1e3 * sum(rec["fit_s"] for rec in r["records"])
        distinct = len({tuple(rec["selection"]) for rec in r["records"]})
        print(
            f"{r['rho']:>5.2f} {r['loop']:<7}{s['rho_achieved']:>9.3f}{s['rho_achieved_cpu']:>7.3f}"
            f"{errs['rho_measured']:>18.1f}%{errs['rho_measured_cpu']:>6.1f}%"
            f"{errs['predicted']:>8.1f}%"
            f"{s['speedup']:>8.2f}x{s['reference_overhead_pct']:>6.2f}%{fit_ms:>8.2f}"
            f"{distinct:>5}  {s['ort_config']:<8}  {r['load_average'][0]} -> {r['load_average'][1]}"
        )


@click.command()
@click.option("--rho", "rhos", multiple=True, type=float, default=[0.5], show_default=True)
@click.option("--epochs", default=6, show_default=True)
@click.option("--steps", default=None, type=int, help="Steps per epoch [all: 179].")
@click.option("--hog", is_flag=True, help="Start a CPU hog in the closed-loop run.")
@click.option("--hog-epoch", default=4, show_default=True, help="Epoch (1-based) it starts.")
@click.option("--hog-procs", default=2, show_default=True)
@click.option("--reference-budget", "budget", default=0.01, show_default=True)
@click.option("--model", "model_path", default=None, help="ONNX classifier of 5 classes.")
@click.option("--input-shape", default=None, help="CxHxW [the model's].")
@click.option("--json", "json_path", default=None)
@click.option("--report", "report_path", default=None, help="Only print the tables of a --json.")
def main(
    rhos,
    epochs,
    steps,
    hog,
    hog_epoch,
    hog_procs,
    budget,
    model_path,
    input_shape,
    json_path,
    report_path,
):
    logging.basicConfig(level=logging.WARNING)
    if report_path:
        results = json.loads(Path(report_path).read_text())
        report(results, any(r["hog_epoch"] for r in results))
        return
    model = LoadedModel.load(model_path or DEFAULT_MODEL_PATH)
    shape = tuple(*model.input_shapes(input_shape or None).values())
    prof = profile_model(model, batch_size=4, input_shapes=shape, cache_dir=default_cache_dir())
    results = []
    with tempfile.TemporaryDirectory(prefix="etgraph-closedloop-") as work:
        for rho in rhos:
            for closed in (True, False):
                label = "closed" if closed else "open"
                hog_args = None
                if hog and closed:
                    hog_args = dict(after=hog_epoch - 1, procs=hog_procs, seconds=600)
                load0 = _load()
                out = Path(work) / f"{label}-{rho}"
                t0 = time.perf_counter()
                result, records = run(
                    model, prof, rho, epochs, closed, out, steps, budget, hog_args
                )
                results.append(
                    {
                        "model": model.source.name,
                        "input_shape": "x".join(map(str, shape)),
                        "reference_budget": budget,
                        "rho": rho,
                        "loop": label,
                        "hog_epoch": hog_epoch if hog_args else None,
                        "load_average": [load0, _load()],
                        "run_s": time.perf_counter() - t0,
                        "summary": result.__dict__,
                        "records": records,
                    }
                )
    report(results, hog)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
