"""The run directory of ``etgraph federate`` (issue 29).

* ``run.json`` — the run's :class:`etgraph.federated.config.FederateConfig`;
* ``log.jsonl`` — one record per round (:func:`round_record`): ``round``, ``virtual_time_s``
  (cumulative), ``round_time_s``, ``val_acc``/``val_loss`` of the global model on the server's
  test set, ``clients`` (one entry each: ``client``, ``speed``, ``deadline_s``,
  ``round_time_s`` in its own virtual clock, ``n_tensors``, ``upload_bytes``, ``status`` ok,
  late or failed, and what it reported), ``coverage`` (per tensor, the share of the round's
  examples whose client trained it);
* ``global.npz`` + ``server.json`` — the global model and the server's state after the last
  round (the checkpoint a killed run resumes from, written after the round's log record);
* ``summary.json``, ``model_trained.onnx`` (the global model), ``accuracy.png`` (accuracy
  against virtual time) and ``tensors.png`` (the tensors each client trained per round) at
  the end.

Every file is written atomically (:mod:`etgraph.files`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np

from .. import files
from ..errors import CheckpointError, ConfigError
from .config import FederateConfig

__all__ = [
    "LOG_FILE",
    "RUN_FILE",
    "SUMMARY_FILE",
    "failure_reason",
    "read_checkpoint",
    "read_config",
    "summarize",
    "write_checkpoint",
]

RUN_FILE = "run.json"
LOG_FILE = "log.jsonl"
WEIGHTS_FILE = "global.npz"
STATE_FILE = "server.json"
SUMMARY_FILE = "summary.json"
MODEL_FILE = "model_trained.onnx"
ACCURACY_PLOT = "accuracy.png"
TENSORS_PLOT = "tensors.png"
#: A round's deadline is met within this share (the server waits ``(1 + LATE_TOLERANCE)`` x
#: the deadline before it drops a client as late).
LATE_TOLERANCE = 0.05


def prepare(out: Path, config: FederateConfig) -> None:
    """Create the run directory ``out`` for a new run and write ``run.json``.

    Raises:
        ConfigError: ``out`` is not writable, or holds a run already (resume it instead).
    """
    files.ensure_writable_dir(out, "--out")
    if (out / RUN_FILE).exists():
        raise ConfigError(
            f"{out} holds a federated run already: continue it with etgraph federate --resume "
            f"{out}, or choose another --out"
        )
    files.write_json_atomic(out / RUN_FILE, {"federate": config.to_json()})


#: Terminal colour codes (Ray colours the actor's name in its error texts).
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: A line that names an exception and its message (``RuntimeError: ...``).
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception)\b[^:]*: \S")


def failure_reason(text: str, limit: int = 300) -> str:
    """A failed client's own error out of the reason of its error reply (the log's
    ``reason``): Flower and Ray wrap it in an actor's repr and two tracebacks, whose first
    line names neither the error nor the client. The message Flower's ``ClientAppException``
    carries (``Message: ...``), else the last line that names an exception, else the first
    line; at most ``limit`` characters, colour codes removed."""
    lines = [line.strip() for line in _ANSI.sub("", text).splitlines() if line.strip()]
    for line in reversed(lines):
        if "Message: " in line:  # Flower quotes it: <class ...>:<'... Message: M'>
            return line.split("Message: ", 1)[1].removesuffix("'>")[:limit]
    for line in reversed(lines):
        if _ERROR_LINE.match(line):
            return line[:limit]
    return lines[0][:limit] if lines else "unknown"


def read_config(out: Path) -> FederateConfig:
    """The configuration of the run in ``out``.

    Raises:
        ConfigError: no run there, or an unreadable ``run.json``.
    """
    data = files.read_json(
        out / RUN_FILE,
        what="run file",
        if_missing=f"{out} is not a federated run directory: start one with etgraph federate",
        if_unreadable="the run cannot be resumed: start a new one",
    )
    return FederateConfig.from_json(data.get("federate", {}))


def write_checkpoint(out: Path, weights: dict, state: dict) -> None:
    """Save the global model and the server's state (the round just finished) atomically:
    the weights first, then ``server.json`` naming their digest."""
    with files.atomic_target(out / WEIGHTS_FILE) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **weights)
    digest = _sha256(out / WEIGHTS_FILE)
    files.write_json_atomic(out / STATE_FILE, {**state, "weights_sha256": digest})


def read_checkpoint(out: Path) -> tuple[dict[str, np.ndarray], dict] | None:
    """``(weights, state)`` of the last finished round, or None before the first.

    Raises:
        CheckpointError: the weights do not match the state's digest (a damaged file).
    """
    if not (out / STATE_FILE).exists():
        return None
    state = json.loads((out / STATE_FILE).read_text())
    path = out / WEIGHTS_FILE
    if not path.exists() or _sha256(path) != state.get("weights_sha256"):
        raise CheckpointError(
            f"{path} does not match {out / STATE_FILE}: the checkpoint is damaged; start a new run"
        )
    with np.load(path) as data:
        return {k: data[k] for k in data.files}, state


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_log(out: Path) -> list[dict]:
    return files.read_jsonl(out / LOG_FILE)


def truncate_log(out: Path, last_round: int) -> list[dict]:
    """Keep the records of rounds ``<= last_round`` (a kill after a record, before its
    checkpoint, leaves one more); return them."""
    records = [r for r in read_log(out) if r.get("round", 0) <= last_round]
    files.write_atomic(out / LOG_FILE, "".join(json.dumps(r) + "\n" for r in records))
    return records


def append_log(out: Path, record: dict) -> None:
    files.append_jsonl(out / LOG_FILE, record)


def summarize(records: list[dict], config: FederateConfig) -> dict:
    """``summary.json``: the run's outcome from its round records.

    Keys: ``strategy``, ``rounds``, ``final_val_acc``, ``best_val_acc``, ``virtual_time_s``
    (cumulative, virtual), ``mean_round_time_s``, ``upload_bytes`` (total) and
    ``upload_bytes_per_round``, ``deadline_s``, ``worst_deadline_ratio`` (the largest client
    round time over the deadline, replies received), ``within_deadline`` (the share of client
    rounds that replied within the deadline + :data:`LATE_TOLERANCE`), ``status_counts``,
    ``coverage`` (per tensor, mean over rounds), ``clock`` and ``times``: what the times are.
    """
    deadline = config.deadline_s or config.round_deadline_s
    entries = [c for r in records for c in r["clients"]]
    replied = [c for c in entries if math.isfinite(c.get("round_time_s", math.nan))]
    ratios = [c["round_time_s"] / deadline for c in replied] if deadline else []
    counts: dict[str, int] = {}
    for c in entries:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    cover = np.array([r["coverage"] for r in records]) if records else np.zeros((0, 0))
    upload = sum(c.get("upload_bytes", 0) for c in entries)
    return {
        "strategy": config.strategy,
        "rounds": len(records),
        "final_val_acc": records[-1]["val_acc"] if records else math.nan,
        "best_val_acc": max((r["val_acc"] for r in records), default=math.nan),
        "virtual_time_s": records[-1]["virtual_time_s"] if records else 0.0,
        "mean_round_time_s": float(np.mean([r["round_time_s"] for r in records]))
        if records
        else math.nan,
        "upload_bytes": int(upload),
        "upload_bytes_per_round": upload / max(len(records), 1),
        "deadline_s": deadline,
        "worst_deadline_ratio": max(ratios) if ratios else math.nan,
        "within_deadline": float(np.mean([x <= 1 + LATE_TOLERANCE for x in ratios]))
        if ratios
        else math.nan,
        "status_counts": counts,
        "coverage": cover.mean(axis=0).tolist() if cover.size else [],
        "clock": config.clock,
        "times": f"virtual: each client's speed factor x its measured {config.clock} time; "
        "a round lasts as long as its slowest client the server waited for",
    }
