"""One error hierarchy for etgraph.

Every error a user can cause derives from :class:`EtgraphError`. Messages are one line that names
the file, node or op concerned and says what to do; the CLI prints them as
``etgraph: error: <message>`` and exits with status 1 (no traceback unless ``--debug``).
"""

from __future__ import annotations


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
    child process :func:`etgraph.sessions.check_sessions` runs its first steps in."""


class ConfigError(EtgraphError):
    """A setting is out of range or malformed (rho, batch size, input shape, paths)."""


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
