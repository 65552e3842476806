"""Plots of federated runs (matplotlib, Agg): accuracy against virtual time per strategy, and
the tensors each client trained per round."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..files import atomic_target

__all__ = ["plot_accuracy", "plot_tensors"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(runs: Mapping[str, list[list[dict]]], path: Path) -> Path:
    """Global-model accuracy against cumulative virtual time: one colour per strategy
    (``runs``: strategy -> the round records of each of its runs, e.g. one per seed)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, (name, seeds) in enumerate(runs.items()):
        for j, records in enumerate(seeds):
            t = [0.0] + [r["virtual_time_s"] for r in records]
            acc = [records[0].get("initial_val_acc", np.nan) if records else np.nan]
            acc += [r["val_acc"] for r in records]
            ax.plot(t, acc, color=f"C{i}", alpha=0.8, label=name if j == 0 else None)
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("global model accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_target(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path


def plot_tensors(records: list[dict], n_tensors: int, path: Path) -> Path:
    """One panel per client: which tensors (rows, forward order, the input end at the bottom)
    it trained in each round (columns); a failed or late round is left blank."""
    plt = _pyplot()
    clients = sorted({c["client"] for r in records for c in r["clients"]}, key=str)
    cols = min(4, max(1, len(clients)))
    rows = -(-len(clients) // cols) if clients else 1
    fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols, 2.4 * rows), squeeze=False)
    for ax, client in zip(axes.flat, clients, strict=False):
        grid = np.zeros((n_tensors, len(records)))
        speed = ""
        for j, r in enumerate(records):
            for c in r["clients"]:
                if c["client"] == client and c["status"] == "ok":
                    grid[c.get("selected", []), j] = 1
                    speed = f", s={c.get('speed', ''):g}"
        ax.imshow(grid, aspect="auto", origin="lower", cmap="Greens", vmin=0, vmax=1)
        ax.set_title(f"client {client}{speed}", fontsize=9)
        ax.set_xlabel("round", fontsize=8)
        ax.set_ylabel("tensor", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(clients) :]:
        ax.axis("off")
    fig.tight_layout()
    with atomic_target(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return path
