"""Plots of a training run (matplotlib, PNG): learning curves and the selection heat map.

- :func:`plot_curves`: validation accuracy and training/validation loss vs training wall time
  (validation excluded from the time axis, as in the paper's Fig. "Testing accuracy and training
  loss over time").
- :func:`plot_selection`: the selection mask over epochs as a heat map (paper Fig. "Elastic
  tensor selections in different training epochs"): x = tensors in forward order (0 nearest
  the input; named, or their layer groups on a large model), y = epoch, dark = selected.
- :func:`plot_tensor_chain`: the tensor chain of a compiled model: ``t_dw`` and ``t_dy`` per
  tensor in forward order, selected tensors marked (``etgraph inspect --render`` without
  Graphviz).

One colour per series in every panel: validation blue, training orange.

Both take the records of ``log.jsonl`` (:class:`etgraph.rundir.EpochRecord`);
:func:`plot_run` reads them from a run directory (:func:`etgraph.rundir.read_log`).

Figures are drawn with matplotlib's object-oriented API (``Figure`` + the Agg canvas it picks
for PNG), without pyplot: no global backend switch, no figure registry to leak. matplotlib is
imported when the first figure is drawn, not with this module: the training loop imports this
module, and matplotlib resident during training adds ~14 MiB to every period's peak RSS
(default model, measured), a figure that ``log.jsonl`` reports.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .files import atomic_target
from .rundir import CURVES_FILE, PROFILE_FILE, SELECTION_FILE, read_log

__all__ = ["plot_curves", "plot_run", "plot_selection", "plot_tensor_chain"]

#: One colour per series across panels (matplotlib's first two).
VALIDATION, TRAINING = "C0", "C1"
#: Tensors named on an axis up to this many; above it their layer groups are.
MAX_NAMED = 60


#: Inches per character of a tensor name on the x axis (6 pt, written upwards).
LABEL_CHAR_IN = 0.05


def _figure(figsize: tuple[float, float]):
    """A new ``matplotlib.figure.Figure`` (matplotlib imported here: see the module docstring)."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def plot_curves(records: Sequence[dict], out_png: str | os.PathLike, *, title: str = "") -> Path:
    """Accuracy and loss vs cumulative training wall time (s); writes ``out_png``.

    Args:
        records: epoch records with ``cumulative_wall_time_s``, ``val_acc``, ``train_acc``,
            ``train_loss``, ``val_loss``.
        out_png: output path (PNG).
        title: figure title.

    Returns:
        The path written.
    """
    t = [0.0] + [r["cumulative_wall_time_s"] for r in records]
    fig = _figure((10, 4))
    ax_acc, ax_loss = fig.subplots(1, 2)
    ax_acc.plot(
        t[1:], [100 * r["val_acc"] for r in records], "o-", c=VALIDATION, label="validation"
    )
    ax_acc.plot(t[1:], [100 * r["train_acc"] for r in records], "s--", c=TRAINING, label="training")
    ax_acc.set_xlabel("training wall time (s)")
    ax_acc.set_ylabel("accuracy (%)")
    ax_acc.grid(alpha=0.3)
    ax_acc.legend()
    ax_loss.plot(t[1:], [r["val_loss"] for r in records], "o-", c=VALIDATION, label="validation")
    ax_loss.plot(t[1:], [r["train_loss"] for r in records], "s--", c=TRAINING, label="training")
    ax_loss.set_xlabel("training wall time (s)")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    with atomic_target(out) as tmp:  # a user never picks up half a picture
        fig.savefig(tmp, dpi=110, format="png")
    return out


def plot_selection(
    records: Sequence[dict],
    out_png: str | os.PathLike,
    *,
    title: str = "",
    names: Sequence[str] = (),
) -> Path:
    """Heat map of the selection mask per epoch (rows: epochs, columns: tensors, forward order).

    Args:
        records: epoch records with ``epoch``, ``selection`` (selected indices) and
            ``n_tensors``.
        out_png: output path (PNG).
        title: figure title.
        names: the tensors' names in forward order, for the x axis (:func:`_name_ticks`).

    Returns:
        The path written.
    """
    n = max((r["n_tensors"] for r in records), default=0)
    grid = np.zeros((len(records), max(n, 1)), dtype=np.float32)
    for row, r in enumerate(records):
        grid[row, r["selection"]] = 1.0
    fig = _figure((max(6.0, min(16.0, 0.12 * n + 3)), 0.3 * len(records) + 1.8))
    ax = fig.subplots()
    ax.imshow(grid, aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xlabel("tensors in forward order (left = nearest the input)")
    _name_ticks(ax, names, n)
    ax.set_ylabel("epoch")
    ax.set_yticks(range(len(records)))
    ax.set_yticklabels([str(r["epoch"]) for r in records])
    ax.set_title(title or "selected tensors per epoch (dark = trained)")
    fig.tight_layout()
    out = Path(out_png)
    with atomic_target(out) as tmp:  # a user never picks up half a picture
        fig.savefig(tmp, dpi=110, format="png")
    return out


def _name_ticks(ax, names: Sequence[str], n: int) -> None:
    """Name the x axis's ``n`` tensors: each by name up to :data:`MAX_NAMED`, else each layer
    group (the name up to its last ``.`` or ``/``) at its first tensor; indices without names.
    The figure grows by the height of the longest name, written upwards (a figure of two epochs
    had no room for a transformer's tensor names: matplotlib could not lay it out)."""
    if not names or len(names) != n:
        return
    if n <= MAX_NAMED:
        ticks, labels = range(n), list(names)
    else:
        groups = [_group(name) for name in names]
        ticks = [i for i in range(n) if i == 0 or groups[i] != groups[i - 1]]
        step = max(1, len(ticks) // MAX_NAMED)
        ticks = ticks[::step]
        labels = [groups[i] for i in ticks]
    ax.set_xticks(list(ticks))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    fig = ax.get_figure()
    longest = max(map(len, labels), default=0)
    fig.set_figheight(fig.get_figheight() + LABEL_CHAR_IN * longest)


def _group(name: str) -> str:
    """A tensor's layer group: its name up to the last ``.`` or ``/`` (``layer1.0.conv1``)."""
    cut = max(name.rfind("."), name.rfind("/"))
    return name[:cut] if cut > 0 else name


def plot_tensor_chain(rows: Sequence[dict], out_png: str | os.PathLike, *, title: str = "") -> Path:
    """Bars of ``t_dw_us`` (update) and ``t_dy_us`` (passing the error back) per tensor in
    forward order, the selected tensors' bars dark and marked: the chain of paper Fig. 4 with
    the profile's timings. Writes ``out_png``.

    Args:
        rows: :func:`etgraph.graph.tensor_table` rows (``name``, ``t_dw_us``, ``t_dy_us``,
            ``selected``; timings None before profiling are drawn as 0).
        out_png: output path (PNG). title: figure title.

    Returns:
        The path written.
    """
    n = len(rows)
    dw = np.array([r.get("t_dw_us") or 0.0 for r in rows]) / 1e3
    dy = np.array([r.get("t_dy_us") or 0.0 for r in rows]) / 1e3
    chosen = np.array([bool(r.get("selected")) for r in rows])
    fig = _figure((max(6.0, min(18.0, 0.14 * n + 3)), 4.5))
    ax = fig.subplots()
    x = np.arange(n)
    alpha = np.where(chosen, 1.0, 0.35)
    for i in range(n):
        ax.bar(x[i], dw[i], color=TRAINING, alpha=alpha[i], width=0.8)
        ax.bar(x[i], dy[i], bottom=dw[i], color=VALIDATION, alpha=alpha[i], width=0.8)
    ax.bar([], [], color=TRAINING, label="t_dw: compute the tensor's update")
    ax.bar([], [], color=VALIDATION, label="t_dy: pass the error gradient through it")
    if chosen.any():
        top = (dw + dy).max() * 1.04
        ax.plot(x[chosen], np.full(chosen.sum(), top), "v", c="k", ms=4, label="selected")
    ax.set_xlabel("tensors in forward order (left = nearest the input; faint = not selected)")
    ax.set_ylabel("backward time (ms)")
    _name_ticks(ax, [r["name"] for r in rows], n)
    ax.legend(fontsize=8)
    ax.set_title(title or "tensor chain: backward time per tensor")
    fig.tight_layout()
    out = Path(out_png)
    with atomic_target(out) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return out


def plot_run(run_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``curves.png`` and ``selection.png`` for the run in ``run_dir`` from its log (the
    tensor names from the run's ``profile.json``)."""
    run_dir = Path(run_dir)
    records = read_log(run_dir)
    names: list[str] = []
    with contextlib.suppress(OSError, ValueError, KeyError):
        timings = json.loads((run_dir / PROFILE_FILE).read_text())["tensor_timings"]
        names = [t["name"] for t in timings]
    return (
        plot_curves(records, run_dir / CURVES_FILE),
        plot_selection(records, run_dir / SELECTION_FILE, names=names),
    )
