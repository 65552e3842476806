"""``etgraph federate``: a federated run on Flower's simulation engine (Ray), one process.

:func:`federate` prepares (or reopens) the run directory, measures the model's profile once
(cached on disk, so the clients load it), and runs :func:`etgraph.federated.server.serve` and
``config.clients`` SuperNodes of :data:`etgraph.federated.client.app` with
``flwr.simulation.run_simulation``. Each client gets every core of the machine (Ray's
``client_resources``), so clients run one at a time and do not contend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from .. import files
from ..errors import ConfigError, ModelError
from . import rundir
from .config import FederateConfig

log = logging.getLogger(__name__)

__all__ = ["federate", "open_run", "with_absolute_paths"]


def with_absolute_paths(config: FederateConfig) -> FederateConfig:
    """``config`` with its model, data and tokenizer paths absolute (clients run in other
    processes, maybe other directories); a data spec that is not a path stays as it is.

    Raises:
        ModelError: the model does not exist.
    """
    changes = {}
    for name in ("model", "data", "tokenizer"):
        value = getattr(config, name)
        if value and Path(value).exists():
            changes[name] = str(Path(value).resolve())
        elif value and name == "model":
            raise ModelError(f"model {value} does not exist: pass an ONNX file or compiled dir")
    return dataclasses.replace(config, **changes)


@contextlib.contextmanager
def open_run(out: Path, config: FederateConfig | None, *, resume: bool) -> Iterator[FederateConfig]:
    """The run directory ``out`` locked for the block: a new run (``config`` written to
    ``run.json``) or, with ``resume``, the run there (its configuration; ``config`` must be
    None or the same). Yields the run's configuration.

    Raises:
        ConfigError: a new run where one exists, nothing to resume, another configuration, or
            another process holds the directory.
    """
    out = Path(out)
    if resume:
        saved = rundir.read_config(out)
        if config is not None and config.digest() != saved.digest():
            raise ConfigError(f"--resume {out} continues the run as configured: drop the options")
        config = saved
    elif config is None:
        raise ConfigError("a new federated run needs its settings")
    else:
        config.validate()
        rundir.prepare(out, config)
    with files.exclusive_lock(out, "--out"):
        files.remove_temporaries(out)
        yield config


def federate(
    config: FederateConfig | None,
    out: str | os.PathLike,
    *,
    resume: bool = False,
    on_round=None,
    verbose: bool = False,
) -> dict:
    """Run (or with ``resume`` continue) a federated run into ``out`` on Flower's simulation
    engine; returns the summary (``summary.json``).

    Raises:
        ConfigError, ModelError, DataError: bad settings, model or data (before Ray starts).
        ImportError: flwr is not installed (``pip install etgraph[fl]``).
    """
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from .client import app as client_app
    from .server import serve
    from .task import load_task

    out = Path(out)
    if config is not None and not resume:  # model, data and profile checked before any file
        config = with_absolute_paths(config).validate()
        load_task(config)
    with open_run(out, config, resume=resume) as config:
        load_task(config)  # the profile measured (and cached) before the clients load it
        result: dict = {}
        server_app = ServerApp()

        @server_app.main()
        def main(grid: Grid, context) -> None:
            result.update(serve(grid, config, out, on_round=on_round))

        cores = os.cpu_count() or 1
        backend = {
            "client_resources": {"num_cpus": cores, "num_gpus": 0.0},
            "init_args": {
                "num_cpus": cores,
                "num_gpus": 0,
                "include_dashboard": False,
                "logging_level": "INFO" if verbose else "ERROR",
                "log_to_driver": verbose,
            },
        }
        flwr_logger = logging.getLogger("flwr")
        level = flwr_logger.level
        if not verbose:
            flwr_logger.setLevel(logging.ERROR)
        try:
            run_simulation(server_app, client_app, config.clients, backend_config=backend)
        finally:
            flwr_logger.setLevel(level)
        if not result:
            raise ConfigError(f"the federated run in {out} did not finish: resume it with --resume")
        return result
