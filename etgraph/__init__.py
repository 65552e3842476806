"""etgraph: ElasticTrainer (MobiSys '23) as a graph-level optimizer over ONNX models.

Data flows one way: model -> tensor graph -> timings -> selection -> artifacts -> training.

The public API (names in :data:`__all__`, imported on first use so that ``import etgraph``
stays light)::

    import etgraph

    plan = etgraph.compile("model.onnx", rho=0.5)        # graph, profile, DP: a Plan in memory
    trainer = plan.trainer(plan.train_config(epochs=4), data=(x, y))
    result = trainer.fit()                                 # or begin_period / train_epoch / step

See the README's "Python API" section for a complete example.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

try:
    __version__ = version("etgraph")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

#: Public name -> the module that defines it (loaded on first access, PEP 562).
_EXPORTS = {
    "ArrayDataset": "data",
    "Callback": "events",
    "CheckpointError": "errors",
    "ConfigError": "errors",
    "DataError": "errors",
    "Dataset": "data",
    "ElasticTrainer": "trainer",
    "EpochRecord": "rundir",
    "EtgraphError": "errors",
    "InfeasibleBudgetError": "errors",
    "InfeasibleMemoryError": "errors",
    "LoadedModel": "model",
    "ModelError": "errors",
    "PeriodInfo": "events",
    "Plan": "plan",
    "Preprocess": "data",
    "Profile": "profile",
    "ProfileMismatchError": "errors",
    "TrainConfig": "config",
    "TrainResult": "rundir",
    "TrainingDivergedError": "errors",
    "UnsupportedOpError": "errors",
    "as_dataset": "data",
    "compile": "pipeline",
    "load_model": "api",
    "profile_model": "api",
}

__all__ = [
    "__version__",
    "ArrayDataset",
    "Callback",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "Dataset",
    "ElasticTrainer",
    "EpochRecord",
    "EtgraphError",
    "InfeasibleBudgetError",
    "InfeasibleMemoryError",
    "LoadedModel",
    "ModelError",
    "PeriodInfo",
    "Plan",
    "Preprocess",
    "Profile",
    "ProfileMismatchError",
    "TrainConfig",
    "TrainResult",
    "TrainingDivergedError",
    "UnsupportedOpError",
    "as_dataset",
    "compile",
    "load_model",
    "profile_model",
]

if TYPE_CHECKING:  # the names as type checkers see them
    from .api import load_model, profile_model
    from .arrays import ArrayDataset
    from .config import TrainConfig
    from .data import Dataset, as_dataset
    from .errors import (
        CheckpointError,
        ConfigError,
        DataError,
        EtgraphError,
        InfeasibleBudgetError,
        InfeasibleMemoryError,
        ModelError,
        ProfileMismatchError,
        TrainingDivergedError,
        UnsupportedOpError,
    )
    from .events import Callback, PeriodInfo
    from .images import Preprocess
    from .model import LoadedModel
    from .pipeline import compile
    from .plan import Plan
    from .profile import Profile
    from .rundir import EpochRecord, TrainResult
    from .trainer import ElasticTrainer


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'etgraph' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
