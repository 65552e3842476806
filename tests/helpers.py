"""Helpers shared by the tests (fixtures are in ``conftest.py``): the CLI in a subprocess, the
one-line user-error check, and small ONNX models built with ``onnx.helper``."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def run_cli(
    *args: str | os.PathLike, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python -m etgraph ARGS`` in a subprocess (text output captured); ``env`` entries are
    added to this process's environment (e.g. ``ETGRAPH_CACHE``)."""
    return subprocess.run(
        [sys.executable, "-m", "etgraph", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def run_cli_in_process(
    *args: str | os.PathLike, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``etgraph.cli.main(ARGS)`` in this process, returned as :func:`run_cli` returns it (exit
    code, stdout, stderr), without a new interpreter's seconds of imports. stderr holds what
    Python writes (log records as the CLI configures them), then what native code (ORT, onnx)
    wrote to file descriptor 2; native crashes, signals and locks held by this process need
    :func:`run_cli`. ``env`` entries are set for the call and restored after it, and the root
    logger's handlers and level too."""
    from etgraph.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    # the CLI's logging.basicConfig takes effect only on a root logger without handlers (as in
    # a new process), pytest's are put back after the call, and the level -v sets
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    code = 0
    try:
        with (
            _native_stderr() as native,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    stderr = err.getvalue() + "".join(native)
    return subprocess.CompletedProcess(["etgraph", *argv], code, out.getvalue(), stderr)


@contextlib.contextmanager
def _native_stderr() -> Iterator[list[str]]:
    """File descriptor 2 into a temporary file for the block: the list it yields holds, after
    the block, what native code wrote there (Python's ``sys.stderr`` is not fd 2 under
    pytest's capture)."""
    written: list[str] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield written
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            written.append(tmp.read().decode(errors="replace"))


def assert_user_error(done: subprocess.CompletedProcess, *fragments: str, code: int = 1) -> str:
    """Exit ``code`` (1; click's 2 for usage errors), one stderr line ``etgraph: error: ...``
    containing every fragment, no traceback; returns the line."""
    assert done.returncode == code, (done.returncode, done.stderr[-3000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("etgraph: error: "), lines[0]
    assert "Traceback" not in done.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def random_initializer(
    name: str, shape: Sequence[int], seed: int = 0, scale: float = 0.1
) -> onnx.TensorProto:
    """A float32 initializer of normal(0, ``scale``) values."""
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array((scale * rng.standard_normal(shape)).astype(np.float32), name)


def make_model(
    nodes: Sequence[onnx.NodeProto],
    initializers: Sequence[onnx.TensorProto],
    *,
    x: str = "x",
    y: str = "y",
    in_shape: Sequence[int | str] = (1, 3, 8, 8),
    out_shape: Sequence[int | str] = (1, 4),
    inputs: Sequence[onnx.ValueInfoProto] | None = None,
    check: bool = False,
) -> onnx.ModelProto:
    """A small opset-17, IR-8 model: float input ``x`` -> ``nodes`` -> float output ``y``
    (``inputs`` replaces the single input); ``check`` runs ``onnx.checker`` (full check)."""
    graph = helper.make_graph(
        list(nodes),
        "g",
        list(inputs) if inputs else [helper.make_tensor_value_info(x, TensorProto.FLOAT, in_shape)],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, list(out_shape))],
        initializer=list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def save_model(model: onnx.ModelProto, directory: Path, name: str = "m.onnx") -> Path:
    """Save ``model`` as ``directory/name``; returns the path."""
    path = Path(directory) / name
    onnx.save(model, str(path))
    return path
