"""One error hierarchy for etgraph.

Every error a user can cause derives from :class:`EtgraphError`. Messages are one line that names
the file, node or op concerned and says what to do; the CLI prints them as
``etgraph: error: <message>`` and exits with status 1 (no traceback unless ``--debug``).
"""

from __future__ import annotations

import errno
import os


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type name when the message is empty): what a
    one-line error quotes of a library's exception."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class EtgraphError(Exception):
    """Base class of every error etgraph raises on purpose (bad input, impossible request)."""


class ModelError(EtgraphError):
    """The ONNX model is missing, malformed, or cannot be trained as it is."""


class UnsupportedOpError(ModelError):
    """An op in the model has no gradient in onnxruntime-training 1.19.2."""


class NativeCrashError(ModelError):
    """ONNX Runtime crashed (a signal, not an exception) running a session of the model, in the
    child process :func:`etgraph.isolation.check_sessions` runs its first steps in."""


class ConfigError(EtgraphError):
    """A setting is out of range or malformed (rho, batch size, input shape, paths)."""


class HeadLrScaleError(ConfigError):
    """``--head-lr-scale`` cannot be applied: not a positive finite number, or the model's
    output is not made by a dense head of a supported form (:mod:`passes.onnx.head_lr`), or the
    model is already scaled by another factor."""


class InfeasibleBudgetError(ConfigError):
    """``rho`` is below what the forward pass alone costs, so no tensor can be trained.

    Attributes:
        min_rho: the smallest feasible ``rho`` (float in (0, 1]), for the message and callers.
    """

    def __init__(self, message: str, min_rho: float):
        super().__init__(message)
        self.min_rho = min_rho


class InfeasibleMemoryError(InfeasibleBudgetError):
    """The memory budget is below the smallest peak any selection reaches (issue #17).

    Attributes:
        min_memory_mb: the smallest feasible budget, MiB (rounded up to a whole MiB), for the
            message (``--memory-mb``) and callers; ``min_rho`` is NaN.
    """

    def __init__(self, message: str, min_memory_mb: float):
        super().__init__(message, min_rho=float("nan"))
        self.min_memory_mb = min_memory_mb


class DataError(EtgraphError):
    """The dataset is missing, empty, unreadable or does not fit the model."""


class ProfileMismatchError(EtgraphError):
    """A cached profile or plan belongs to another model, input shape or batch size."""


class CheckpointError(EtgraphError):
    """A checkpoint or run directory is missing, corrupt, or from another run."""


class ResourceError(EtgraphError):
    """The machine ran out of memory or disk space, or of what a limit allows (``ulimit -v``,
    ``ulimit -f``): :func:`resource_error` recognises it in a library's exception."""


#: What libraries say when memory runs out (numpy, ORT, the dynamic loader, pthreads).
_OUT_OF_MEMORY = (
    "bad_alloc",
    "Cannot allocate memory",
    "Failed to allocate memory",
    "failed to map segment",
    "Unable to allocate",
)
#: ... and when a write does not fit (ORT quotes strerror in its own exceptions).
_OUT_OF_DISK = ("No space left on device", "Disk quota exceeded", "File too large")


def resource_error(exc: BaseException) -> ResourceError | None:
    """The :class:`ResourceError` that ``exc`` (or an exception it was raised from) means —
    out of memory (``MemoryError``, ``ENOMEM``, a native allocation failure) or out of disk
    (``ENOSPC``, ``EDQUOT``, ``EFBIG``) — or None for any other error."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    for e in seen:
        text, code = str(e), getattr(e, "errno", None)
        if (
            isinstance(e, MemoryError)
            or code == errno.ENOMEM
            or any(s in text for s in _OUT_OF_MEMORY)
        ):
            return ResourceError(
                f"out of memory ({type(e).__name__}: {first_line(e)[:160]}): free memory, use a "
                "smaller --batch-size or --input-shape, or raise the limit (ulimit -v)"
            )
        if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or any(
            s in text for s in _OUT_OF_DISK
        ):
            where = f" {e.filename}" if getattr(e, "filename", None) else ""
            reason = next((s for s in _OUT_OF_DISK if s in text), os.strerror(code or 28))
            return ResourceError(
                f"no room to write{where} ({reason}): free space on the device, or raise the "
                "limit (ulimit -f), and run the command again"
            )
    return None


class TrainingDivergedError(EtgraphError):
    """The training loss became NaN or infinite (the learning rate is too high for this model).

    Attributes:
        epoch: 1-based epoch of the first non-finite loss.
        step: 1-based step within that epoch.
    """

    def __init__(self, message: str, epoch: int, step: int):
        super().__init__(message)
        self.epoch = epoch
        self.step = step


class Terminated(BaseException):  # noqa: N818 (a signal, like KeyboardInterrupt)
    """SIGTERM or SIGHUP arrived (:func:`etgraph.host.exit_on_sigterm`): raised in the main
    thread so that every ``with`` block and ``finally`` clause runs (temporary directories,
    atomic writes) before the process exits. A BaseException: ``except Exception`` does not
    stop it.

    Attributes:
        signum: the signal's number (the process exits with ``128 + signum``).
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
