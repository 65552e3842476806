"""A model's first training steps in a forked child process (issue 27): a native crash in ORT
(a bug in a kernel, triggered by the model's graph) ends the child, not the command.

* :func:`run_isolated` — run a function in a forked child process and report how it ended
  (:class:`Isolated`).
* :func:`first_steps` — one training step and one evaluation of each artifact directory, as a
  training run opens them.
* :func:`check_sessions` — a model's first steps run that way: a crash becomes a one-line
  :class:`etgraph.errors.NativeCrashError`, a classifier whose output is probabilities rather
  than logits a :class:`etgraph.errors.ModelError` (:func:`looks_like_probabilities`);
  recorded per model, so it is paid once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from .artifacts import ArtifactCache
from .errors import ModelError, NativeCrashError
from .files import write_atomic
from .io_specs import random_batch
from .model import LoadedModel
from .sessions import TrainingSession, class_logits

log = logging.getLogger(__name__)

__all__ = [
    "ISOLATION_TIMEOUT_S",
    "Isolated",
    "check_sessions",
    "first_steps",
    "looks_like_probabilities",
    "producers",
    "run_isolated",
]


#: Seconds the isolated first steps may take; past it the child is stopped and the command goes
#: on in-process (a hang is not a crash; nothing is recorded).
ISOLATION_TIMEOUT_S = 900.0


#: Signals a process raises on itself when native code fails (a crash, not a kill from outside).
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}


@dataclass(frozen=True)
class Isolated:
    """How a function run by :func:`run_isolated` ended.

    Attributes:
        status: ``"ok"`` (it returned), ``"error"`` (it raised: the caller meets the same error
            again in-process, with its usual message), ``"crashed"`` (the child raised SIGSEGV,
            SIGABRT, SIGBUS, SIGFPE or SIGILL), ``"killed"`` (another signal: the OOM killer, a
            user) or ``"timeout"``.
        value: what the function returned (``"ok"``), through JSON.
        detail: for ``"crashed"``, the signal's name and the last line native code wrote to
            stderr (e.g. ``SIGABRT: free(): invalid next size (normal)``); the exception's last
            line for ``"error"``.
    """

    status: str
    detail: str = ""
    value: object = None


def run_isolated(fn: Callable[[], object], *, timeout_s: float = ISOLATION_TIMEOUT_S) -> Isolated:
    """Run ``fn()`` in a forked child process and report how it ended (:class:`Isolated`).

    The child shares the parent's memory as it was at the fork (no imports, no copies: a fork
    costs milliseconds) and writes its stderr to a private file, so ORT's native messages never
    reach the user's terminal; it exits with ``os._exit`` (nothing of the parent's is flushed or
    finalised twice). Call it while the process holds no running ORT session: a fork copies
    only the calling thread.

    Args:
        fn: the work, e.g. opening a session and running one step; returns something JSON can
            carry (or None).
        timeout_s: the child is killed after this many seconds (status ``"timeout"``).
    """
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as result:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 0
            try:
                os.dup2(err.fileno(), 2)
                result.write(json.dumps(fn()).encode())
                result.flush()
            except BaseException:  # noqa: BLE001  (reported through the exit code)
                os.write(2, traceback.format_exc().encode())
                code = 1
            finally:
                os._exit(code)
        status = None
        deadline = time.monotonic() + timeout_s
        try:
            while status is None:
                done, wait_status = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = wait_status
                elif time.monotonic() > deadline:
                    break
                else:
                    time.sleep(0.01)
        finally:
            if status is None:  # timed out, or the parent was interrupted
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        err.seek(0)
        lines = [line.strip() for line in err.read().decode(errors="replace").splitlines()]
        result.seek(0)
        value = result.read()
    last = next((line for line in reversed(lines) if line), "")[:300]
    if status is None:
        return Isolated("timeout", f"no answer in {timeout_s:g} s")
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        name = signal.Signals(number).name
        if number not in _CRASH_SIGNALS:  # killed from outside (the OOM killer, a user)
            return Isolated("killed", name)
        return Isolated("crashed", f"{name}: {last}" if last else name)
    if os.WEXITSTATUS(status) != 0:
        return Isolated("error", last)
    return Isolated("ok", value=json.loads(value))


def first_steps(
    directories: Sequence[str | os.PathLike],
    batch: tuple,
    threads: int | None,
    *,
    loss: str = "ce",
    input_names: Sequence[str] = (),
) -> np.ndarray:
    """One training step and one evaluation of each artifact directory, as a training run
    opens them (:class:`etgraph.sessions.TrainingSession`, frozen parameters baked): the
    graphs etgraph's sessions run on a model (the profiler's and the importance probe's are the
    all-trainable training graph), each run once (:func:`check_sessions` runs this in a child
    process).

    Args:
        directories: artifact directories with their checkpoints (the first all-trainable).
        batch: ``(x, y)``, one full batch at the artifacts' static shape.

    Returns:
        The model's output on the batch in the first directory's training step.

    Raises:
        whatever ORT raises.
    """
    x, y = batch
    first = None
    for d in directories:
        session = TrainingSession(
            d, Path(d) / "checkpoint", threads, loss=loss, input_names=input_names
        )
        _, outputs = session.step(x, y)
        first = np.asarray(outputs) if first is None else first
        session.evaluate([(x, y)], len(y))
        del session
    return first


def check_sessions(
    model: LoadedModel,
    batch_size: int,
    shapes: Mapping[str, Sequence[int]],
    *,
    threads: int | None,
    frozen_bn: str = "inference",
    cache: ArtifactCache | None = None,
    record_dir: str | os.PathLike | None = None,
    timeout_s: float = ISOLATION_TIMEOUT_S,
) -> None:
    """Run the first steps of ``model``'s sessions in a child process (:func:`first_steps`,
    :func:`run_isolated`): all tensors trainable, and the last tensor alone (every other
    parameter baked in, batch norms frozen as ``frozen_bn``), on a random batch at the run's
    static shape. A native crash in ORT (a bug in a kernel, triggered by this graph) then ends
    the child, not the command: :class:`NativeCrashError`, one line. Once per model, batch shape,
    loss, batch-norm mode and ORT version in this process, and in ``record_dir`` (a file per
    model that passed) across processes; the command then opens its sessions as usual (a Python
    error of the child is met again there, with its usual message).

    Cost: generating the two sets of artifacts (the all-trainable one usually cached already),
    a fork, and two sessions' first steps — paid once per model (ResNet50 at 128 px, batch 4:
    18 s at load average 10 on 2 cores; a tiny DistilBERT 0.6 s).

    Args:
        model: the loaded model. batch_size, shapes: the run's static batch shape
            (:meth:`LoadedModel.input_shapes`). threads: ORT intra-op threads.
        frozen_bn: the batch-norm mode of the run's artifacts.
        cache: artifact cache to generate through (default: a temporary one).
        record_dir: where models that passed are recorded (None: this process only).

    Raises:
        NativeCrashError: ORT crashed; names the signal and ORT's last message.
        ModelError, ConfigError: the artifacts cannot be generated.
    """
    key_text = json.dumps(
        [
            model.hash,
            model.task.loss,
            int(batch_size),
            {k: list(map(int, v)) for k, v in sorted(shapes.items())},
            frozen_bn,
            ort.__version__,
        ]
    )
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    record = Path(record_dir) / "checked" / key if record_dir is not None else None
    if key in _CHECKED or (record is not None and record.is_file()):
        return
    n = len(model.tensors)
    selections = [np.ones(n, dtype=bool)]
    if n > 1:
        selections.append(np.arange(n) == n - 1)
    with tempfile.TemporaryDirectory(prefix="etgraph-check-") as tmp:
        if cache is None:
            cache = ArtifactCache(tmp, static_batch=(batch_size, shapes))
        proto = model.proto if cache.static_batch else model.with_batch(batch_size, shapes)
        directories = [
            cache.get(proto, *model.split(m), loss=model.task.loss, frozen_bn=frozen_bn)[
                0
            ].directory
            for m in selections
        ]
        b = random_batch(batch_size, model.inputs, shapes, model.task)

        def work() -> bool:
            """The first steps; returns whether the output looks like probabilities."""
            outputs = first_steps(
                directories,
                (b.inputs, b.labels),
                threads,
                loss=model.task.loss,
                input_names=model.input_names,
            )
            return model.task.loss == "ce" and looks_like_probabilities(outputs)

        t0 = time.perf_counter()
        outcome = run_isolated(work, timeout_s=timeout_s)
    log.debug("first steps in a child process: %s in %.2f s", outcome, time.perf_counter() - t0)
    if outcome.status == "crashed":
        raise NativeCrashError(
            f"{model.source}: ONNX Runtime {ort.__version__} crashed ({outcome.detail}) in the "
            f"first training step of this model at batch {batch_size} (caught in a child "
            "process): a bug in ORT's training kernels on this graph, not in your data; sizes "
            "computed from the data rather than the input shape are a known trigger: export "
            "without them, or report it to onnxruntime with the model"
        )
    if outcome.status == "ok" and outcome.value:
        raise ModelError(
            f"{model.source}: output {model.task.output!r} holds probabilities, not logits "
            f"(non-negative, every row sums to 1; made by {producers(model.proto)}): "
            "cross-entropy on it would train the wrong loss. Export the model without the "
            "layers that normalise its logits (etgraph takes a final Softmax off and puts it "
            "back on the trained model itself)"
        )
    if outcome.status != "ok":  # met again in-process, or a hang: not recorded
        return
    _CHECKED.add(key)
    if record is not None:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(record, key_text.encode())


_CHECKED: set[str] = set()  # check_sessions keys that passed in this process


def looks_like_probabilities(outputs: np.ndarray, tolerance: float = 1e-4) -> bool:
    """Whether a classifier's output ``[B, K]`` (or ``[B, K, 1, ...]``) is probabilities rather
    than logits: K >= 2, every entry non-negative and every row summing to 1 within
    ``tolerance`` (what a Softmax makes, whatever its input; logits almost never do)."""
    try:
        p = class_logits(np.asarray(outputs)).astype(np.float64)
    except ValueError:
        return False
    if p.ndim != 2 or p.shape[1] < 2 or not np.isfinite(p).all():
        return False
    return bool((p >= 0).all() and np.abs(p.sum(axis=1) - 1.0).max() <= tolerance)


def producers(model: onnx.ModelProto, depth: int = 4) -> str:
    """The ops that make the first output, nearest first, e.g. ``"Mul <- Softmax <- Gemm"``
    (at most ``depth``; following each node's first input)."""
    made_by = {v: n for n in model.graph.node for v in n.output}
    chain, value = [], model.graph.output[0].name
    while value in made_by and len(chain) < depth:
        node = made_by[value]
        chain.append(node.op_type)
        value = node.input[0] if node.input else ""
    return " <- ".join(chain) or "a graph input"
