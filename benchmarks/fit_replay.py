"""How well does the closed loop's fit predict the next period? Replayed on logged runs.

For every closed- and open-loop run kept by ``benchmarks/closed_loop.py --json`` (default:
``benchmarks/results/closed_loop*.json``) and every period ``p >= 1``: the fit from the epochs
before it (the clock and epochs the loop fits, :func:`etgraph.clock.fit_rows`) predicts the
ratio elastic / full of the selection period ``p`` ran, ``(model step + c) / (T_full + c)``,
against the ratio measured alike in that period. Variants of the fit, side by side on the
same periods:

* ``median+vote`` — :func:`etgraph.timing.fit_step_times`, the rule in use: the median of the
  per-epoch offsets with the open loop's ``c = 0`` as one more vote (dropped when every epoch
  puts the open loop off by more than 10% in the same direction);
* ``median`` — the median without that vote;
* ``last 3`` / ``last 2`` — ``median`` over the latest epochs only.

The selections were chosen by whichever rule the run used, so this scores predictions of the
selections actually run, not what another rule would have selected next (a full-way
correction from one noisy epoch also changes the selection: see the README, "Closed loop").
Prints mean, mean |error| and the share within ±5%, per group (period 1 / later; quiet runs /
runs at load >= 4 at their start).

Usage::

    python benchmarks/fit_replay.py [LOG.json ...]
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from etgraph.clock import fit_rows, spins  # noqa: E402
from etgraph.timing import fit_step_times  # noqa: E402

#: name -> (the open loop's vote, which of the earlier epochs the fit sees)
VARIANTS = {
    "median+vote": (True, lambda rows: rows),
    "median": (False, lambda rows: rows),
    "last 3": (False, lambda rows: rows[-3:]),
    "last 2": (False, lambda rows: rows[-2:]),
}


def _errors(records: list[dict]) -> list[tuple[str, int, float]]:
    """(variant, period, measured / predicted - 1) for every period >= 1 of one run."""
    first = records[0]
    if first.get("fit_scale") != 1.0 or first.get("fit_fixed_us") != 0.0:
        return []  # resumed or otherwise not starting from the profile
    t_full = first["predicted_step_us"] / first["rho_predicted"]
    out = []
    for p in range(1, len(records)):
        cur = records[p]
        clock, past = fit_rows(records[:p], spins(cur.get("ort_config", "off")))
        measured = cur[f"median_step{clock}_us"] / cur[f"reference_step{clock}_us"]
        if not past or not np.isfinite(measured):
            continue
        for name, (vote, window) in VARIANTS.items():
            rows = window(past)
            fit = fit_step_times(
                [r["predicted_step_us"] for r in rows],
                [r[f"median_step{clock}_us"] for r in rows],
                [r[f"reference_step{clock}_us"] for r in rows],
                t_full,
                prior_vote=vote,
            )
            out.append((name, p, measured / fit.rho(cur["predicted_step_us"], t_full) - 1.0))
    return out


def _start_load(logged) -> float:
    """The 1-minute load average at the run's start: the logs keep ``"a b c"`` or ``["a b c",
    "d e f"]`` (start, end); 0 when not logged."""
    if isinstance(logged, list):
        logged = logged[0] if logged else ""
    fields = str(logged or "0").split()
    return float(fields[0]) if fields else 0.0


@click.command()
@click.argument("logs", nargs=-1, type=click.Path(exists=True, dir_okay=False))
def main(logs) -> None:
    paths = logs or sorted(glob.glob(str(ROOT / "benchmarks/results/closed_loop*.json")))
    groups: dict[tuple[str, str, str], list[float]] = {}
    runs = 0
    for path in paths:
        data = json.loads(Path(path).read_text())
        for run in data if isinstance(data, list) else []:
            records = run.get("records", [])
            if len(records) < 2:
                continue
            runs += 1
            load = "loaded" if _start_load(run.get("load_average")) >= 4 else "quiet"
            for name, p, err in _errors(records):
                groups.setdefault((name, "p1" if p == 1 else "p2+", load), []).append(err)
    print(f"{runs} runs from {len(paths)} logs: measured / predicted ratio - 1 of each period")
    print("| fit | periods | machine | n | mean | mean abs | within 5% |")
    print("|---|---|---|---|---|---|---|")
    for (name, period, load), errs in sorted(groups.items(), key=lambda kv: kv[0][1:] + kv[0][:1]):
        e = np.array(errs)
        print(
            f"| {name} | {period} | {load} | {e.size} | {e.mean() * 100:+.2f}% "
            f"| {np.abs(e).mean() * 100:.2f}% | {np.mean(np.abs(e) < 0.05) * 100:.0f}% |"
        )


if __name__ == "__main__":
    main()
