"""Do a run's measurements support per-tensor corrections of the time model? Leave-one-out.

Reads the epoch records of ``benchmarks/closed_loop.py`` results (``--json`` files; every run in
one file used one profile, so their epochs can be pooled: more selections than any one run has)
and predicts each epoch's measured ratio ``elastic step / full step measured alike`` (process
CPU time, as the closed loop fits) from the *other* epochs with

* ``open`` — the profile as is: ``p / T``;
* ``offset`` — the closed loop's fit (:func:`etgraph.timing.fit_step_times`: a per-step offset
  ``c``, median of the per-epoch offsets): ``(p + c) / (T + c)``;
* ``per-tensor`` — ``c`` plus a correction per tensor for its weight-gradient time (selected)
  and its error-gradient time (``k >= e(M)``), least squares (minimum norm) on the linear form
  ``m T - r p = c (r - m) + sum_k d_k (r x_k - m)`` of ``m / r = (p + c + x.d) / (T + c +
  sum d)``;
* ``per-tensor, ridge`` — the same with a ridge penalty (``--ridge``, relative to the equations'
  scale), shrinking the corrections towards zero.

``p`` is the epoch's model step, ``T`` the profile's full step (recovered from the record's
``rho_predicted``, ``fit_scale`` and ``fit_fixed_us``), ``m`` / ``r`` the measured elastic and
full steps. The table gives the root-mean-square error of the leave-one-out ratio, % of the
measured ratio, with the epochs and distinct selections available. A method whose error is
above ``offset``'s over-fits: the data do not support it.

Usage::

    python benchmarks/per_tensor_fit.py benchmarks/results/closed_loop_hog.json [...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from etgraph.timing import fit_step_times  # noqa: E402


def _epochs(runs: list[dict]):
    """(features [K, 2N], p [K], m [K], r [K], T, selections) of every usable epoch."""
    rows, p, m, r, t_full, selections = [], [], [], [], [], []
    for run in runs:
        for rec in run["records"]:
            mi, ri = rec["median_step_cpu_us"], rec["reference_step_cpu_us"]
            if not (rec.get("reference_steps") and np.isfinite(mi) and np.isfinite(ri)):
                continue
            n = rec["n_tensors"]
            sel = np.zeros(n, bool)
            sel[rec["selection"]] = True
            chain = np.zeros(n, bool)
            if sel.any():
                chain[np.flatnonzero(sel)[0] :] = True
            pi = rec["predicted_step_us"]
            c = rec["fit_fixed_us"] / rec["fit_scale"]  # the model offset this epoch used
            t_full.append((pi + c) / rec["rho_predicted"] - c)
            rows.append(np.concatenate([sel, chain]).astype(np.float64))
            p.append(pi)
            m.append(mi)
            r.append(ri)
            selections.append(tuple(rec["selection"]))
    return (
        np.array(rows),
        np.array(p),
        np.array(m),
        np.array(r),
        float(np.median(t_full)),
        selections,
    )


def _per_tensor(x, p, m, r, t_full, ridge):
    """(c, d [2N]) by least squares on the linear form; ridge relative to the column scale."""
    a = np.column_stack([r - m, r[:, None] * x - m[:, None]])
    b = m * t_full - r * p
    if ridge > 0:
        lam = ridge * float(np.mean(a**2)) * len(b)
        a = np.vstack([a, np.sqrt(lam) * np.eye(a.shape[1])[1:]])  # c is not penalised
        b = np.concatenate([b, np.zeros(a.shape[1] - 1)])
    sol = np.linalg.lstsq(a, b, rcond=None)[0]
    return sol[0], sol[1:]


def _loo(x, p, m, r, t_full, ridge):
    err = {"open": [], "offset": [], "offset, lstsq": [], "per-tensor": [], "per-tensor, ridge": []}
    np.seterr(all="ignore")  # a minimum-norm fit may predict a zero or negative full step
    for i in range(len(p)):
        keep = np.arange(len(p)) != i
        actual = m[i] / r[i]
        err["open"].append(p[i] / t_full / actual - 1)
        fit = fit_step_times(p[keep], m[keep], r[keep], t_full)
        c = fit.offset_us
        err["offset"].append((p[i] + c) / (t_full + c) / actual - 1)
        a, b = (r - m)[keep], (m * t_full - r * p)[keep]
        c = float(a @ b / (a @ a)) if a @ a > 0 else 0.0
        err["offset, lstsq"].append((p[i] + c) / (t_full + c) / actual - 1)
        for label, lam in (("per-tensor", 0.0), ("per-tensor, ridge", ridge)):
            c, d = _per_tensor(x[keep], p[keep], m[keep], r[keep], t_full, lam)
            pred = (p[i] + c + x[i] @ d) / (
                t_full + c + d[: len(d) // 2].sum() + d[len(d) // 2 :].sum()
            )
            err[label].append(pred / actual - 1)
    return {k: 100 * float(np.sqrt(np.mean(np.square(v)))) for k, v in err.items()}


def _pct(x: float) -> str:
    return f"{x:>8.1f}" if np.isfinite(x) and x < 1000 else f"{'>999':>8}"


@click.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--ridge", default=1.0, show_default=True, help="Ridge penalty (relative).")
def main(paths, ridge):
    print(
        f"{'results':<40}{'epochs':>7}{'sel':>5}{'tensors':>8}"
        f"{'open':>8}{'offset':>8}{'lstsq':>8}{'per-t':>8}{'ridge':>8}"
        "   LOO RMS error of the ratio, %"
    )
    for path in paths:
        runs = json.loads(Path(path).read_text())
        x, p, m, r, t_full, selections = _epochs(runs)
        if len(p) < 3:
            continue
        e = _loo(x, p, m, r, t_full, ridge)
        print(
            f"{Path(path).name:<40}{len(p):>7}{len(set(selections)):>5}{x.shape[1] // 2:>8}"
            + "".join(_pct(e[k]) for k in e)
        )


if __name__ == "__main__":
    main()
