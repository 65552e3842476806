"""The measuring process of :mod:`etgraph.memory_profiler` (run as
``python -c "from etgraph.memory_child import main; main()" B CxHxW THREADS STEPS DIR...``).

What it imports is what it measures, so this module imports only the standard library and numpy
at its top; :func:`main` imports :mod:`etgraph.loop` (what ``etgraph train`` holds) and the ORT
training API after recording the interpreter's own resident memory — the one place outside
``cli.py`` where imports are not at the top, for the same reason.

Each artifact directory is measured in a process forked after the imports (no ORT session exists
yet), so it holds nothing of an earlier selection's arena (every etgraph session allocates from
one shared arena that never returns memory: :func:`etgraph.ort_options.shared_arena`) and pays the
imports once. A forked process does not map the parent's file-backed pages (library code) until
it touches them — its ``VmRSS`` starts ~85 MiB below the parent's — so it first reads one byte
of every page the parent had resident in its readable file mappings (``/proc/self/pagemap``,
~26k pages, ~40 ms): then its ``VmRSS`` and ``VmHWM`` start where its parent's (a fresh
process after the same imports) stand, within 0.2 MiB, and every phase measures within ~2 MiB of
a fresh process's (four ResNet50 selections).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np

__all__ = ["main"]


def _status_mb() -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` of this process, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) / 1024.0
    return out


def _resident_file_pages() -> np.ndarray:
    """Addresses (uint64) of this process's resident pages in readable file mappings (library
    code and data; not devices), from ``/proc/self/pagemap`` (bit 63: present)."""
    page = os.sysconf("SC_PAGE_SIZE")
    found = []
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or "r" not in fields[1] or not fields[5].startswith("/"):
                continue
            if fields[5].startswith("/dev/"):
                continue
            start, end = (int(v, 16) for v in fields[0].split("-"))
            pagemap.seek(start // page * 8)
            entries = np.frombuffer(pagemap.read((end - start) // page * 8), dtype=np.uint64)
            present = np.flatnonzero(entries >> np.uint64(63)).astype(np.uint64)
            found.append(np.uint64(start) + present * np.uint64(page))
    return np.concatenate(found) if found else np.zeros(0, dtype=np.uint64)


def _forked(measure, pages: np.ndarray) -> dict:
    """``measure()`` (a JSON-ready dict) run in a forked process that first touches ``pages``
    (:func:`_resident_file_pages` of the parent); its result, or ``{"error": ...}`` if it
    raised or died."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the measuring process
        os.close(read_fd)
        code = 0
        try:
            for address in pages.tolist():
                ctypes.string_at(address, 1)
            out = measure()
        except BaseException as exc:  # noqa: BLE001  (reported to the parent, then exit)
            out = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
            code = 1
        with os.fdopen(write_fd, "w") as f:
            f.write(json.dumps(out))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    if not text:
        return {"error": f"measuring process died (wait status {status})"}
    return json.loads(text)


def _measure(api, session_options, d: Path, threads: int, x, y, steps: int) -> dict:
    before = _status_mb()
    state = api.CheckpointState.load_checkpoint(str(d / "checkpoint"))
    loaded = _status_mb()
    module = api.Module(
        str(d / "training_model.onnx"),
        state,
        str(d / "eval_model.onnx"),
        session_options=session_options(threads),
    )
    optimizer = api.Optimizer(str(d / "optimizer_model.onnx"), module)
    module.train()
    built = _status_mb()
    for _ in range(steps):
        optimizer.set_learning_rate(1e-4)
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
    return {"before": before, "loaded": loaded, "session": built, "steps": _status_mb()}


def main() -> None:
    """Entry of a measuring process: ``argv = [batch, CxHxW, threads, steps, dir, ...]``.

    Imports what ``etgraph train`` imports (:mod:`etgraph.loop`), then for each artifact
    directory builds the session as :class:`etgraph.sessions.TrainingSession` does
    (checkpoint, Module, Optimizer; the phases measured apart) and steps it as the training
    loop does, in a process forked for that directory (module docstring). Prints one JSON line
    ``{"start", "imported", "runs": [{"before", "loaded", "session", "steps"}]}`` (each phase
    ``{"VmRSS", "VmHWM"}``, MiB), then exits 1 if a measurement failed (its error on stderr).
    """
    batch, shape, threads, steps, *dirs = sys.argv[1:]
    start = _status_mb()
    import etgraph.loop  # noqa: F401  (the training process's libraries)
    from etgraph.ort_options import session_options
    from etgraph.sessions import api

    imported = _status_mb()
    pages = _resident_file_pages()
    dims = tuple(int(v) for v in shape.split("x"))
    x = np.random.default_rng(0).standard_normal((int(batch), *dims)).astype(np.float32)
    y = np.zeros(int(batch), dtype=np.int64)
    runs = []
    for directory in dirs:
        runs.append(
            _forked(
                lambda d=Path(directory): _measure(
                    api, session_options, d, int(threads), x, y, int(steps)
                ),
                pages,
            )
        )
        if "error" in runs[-1]:
            print(f"measuring {directory}: {runs[-1]['error']}", file=sys.stderr)
            sys.exit(1)
    print(json.dumps({"start": start, "imported": imported, "runs": runs}))
