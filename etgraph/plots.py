"""Plots of a training run (matplotlib, PNG): learning curves and the selection heat map.

- :func:`plot_curves`: validation accuracy and training/validation loss vs training wall time
  (validation excluded from the time axis, as in the paper's Fig. "Testing accuracy and training
  loss over time").
- :func:`plot_selection`: the selection mask over epochs as a heat map (paper Fig. "Elastic
  tensor selections in different training epochs"): x = tensor index in forward order (0 nearest
  the input), y = epoch, dark = selected.

Both take the records of ``log.jsonl`` (:class:`etgraph.rundir.EpochRecord`);
:func:`plot_run` reads them from a run directory (:func:`etgraph.rundir.read_log`).

Figures are drawn with matplotlib's object-oriented API (``Figure`` + the Agg canvas it picks
for PNG), without pyplot: no global backend switch, no figure registry to leak. matplotlib is
imported when the first figure is drawn, not with this module: the training loop imports this
module, and matplotlib resident during training adds ~14 MiB to every period's peak RSS
(default model, measured), a figure that ``log.jsonl`` reports.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .files import atomic_target
from .rundir import CURVES_FILE, SELECTION_FILE, read_log

__all__ = ["plot_curves", "plot_run", "plot_selection"]


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
    ax_acc.plot(t[1:], [100 * r["val_acc"] for r in records], "o-", label="validation")
    ax_acc.plot(t[1:], [100 * r["train_acc"] for r in records], "s--", label="training")
    ax_acc.set_xlabel("training wall time (s)")
    ax_acc.set_ylabel("accuracy (%)")
    ax_acc.grid(alpha=0.3)
    ax_acc.legend()
    ax_loss.plot(t[1:], [r["train_loss"] for r in records], "s--", label="training")
    ax_loss.plot(t[1:], [r["val_loss"] for r in records], "o-", label="validation")
    ax_loss.set_xlabel("training wall time (s)")
    ax_loss.set_ylabel("cross-entropy loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    with atomic_target(out) as tmp:  # a user never picks up half a picture
        fig.savefig(tmp, dpi=110, format="png")
    return out


def plot_selection(records: Sequence[dict], out_png: str | os.PathLike, *, title: str = "") -> Path:
    """Heat map of the selection mask per epoch (rows: epochs, columns: tensors, forward order).

    Args:
        records: epoch records with ``epoch``, ``selection`` (selected indices) and
            ``n_tensors``.
        out_png: output path (PNG).
        title: figure title.

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
    ax.set_xlabel("tensor index (forward order: 0 = nearest the input)")
    ax.set_ylabel("epoch")
    ax.set_yticks(range(len(records)))
    ax.set_yticklabels([str(r["epoch"]) for r in records])
    ax.set_title(title or "selected tensors per epoch (dark = trained)")
    fig.tight_layout()
    out = Path(out_png)
    with atomic_target(out) as tmp:  # a user never picks up half a picture
        fig.savefig(tmp, dpi=110, format="png")
    return out


def plot_run(run_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``curves.png`` and ``selection.png`` for the run in ``run_dir`` from its log."""
    run_dir = Path(run_dir)
    records = read_log(run_dir)
    return (
        plot_curves(records, run_dir / CURVES_FILE),
        plot_selection(records, run_dir / SELECTION_FILE),
    )
