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
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .. import files
from ..errors import ConfigError, Terminated
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
            files.require_model_path(value, directory_ok=True)  # raises: it does not exist
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


#: Wall seconds an interrupted simulation's threads get to end (they took under 3 s).
STOP_WAIT_S = 20.0


def _stop_simulation(threads: set[threading.Thread]) -> None:
    """End an interrupted (or failed) simulation's threads, so that the process can exit:
    Flower's server thread waits for replies (:data:`etgraph.federated.server.STOP` ends that
    wait) and a thread of its simulation engine waits in ``ray.get`` for a client that will
    never reply (Ray's shutdown ends that). Before, an interrupted ``etgraph federate`` printed
    its last line and never ended. What those threads log and raise as Ray stops under them
    is not shown; the threads running before the simulation (``threads``) are left alone."""
    import ray

    from .server import STOP

    STOP.set()
    flwr_logger = logging.getLogger("flwr")
    quiet, hook = flwr_logger.disabled, threading.excepthook
    flwr_logger.disabled, threading.excepthook = True, lambda args: None
    try:
        with contextlib.suppress(Exception):
            ray.shutdown()
        end = time.monotonic() + STOP_WAIT_S
        for thread in set(threading.enumerate()) - threads:  # those that keep a process up
            if not thread.daemon and thread is not threading.current_thread():
                thread.join(max(0.0, end - time.monotonic()))
    finally:
        flwr_logger.disabled, threading.excepthook = quiet, hook


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
    from .server import STOP, serve
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
        disabled = flwr_logger.disabled
        # Flower logs a failed client's two tracebacks: the round line and the log say which
        # client failed and why (verbose: Flower's logs too)
        flwr_logger.disabled = not verbose
        STOP.clear()
        # Ray's native failure handler would take SIGTERM from etgraph's (a stack dump, no
        # cleanup, exit status 15): the CLI turns it into an exit like Ctrl-C's
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        threads = set(threading.enumerate())
        try:
            run_simulation(server_app, client_app, config.clients, backend_config=backend)
        except BaseException as exc:  # Ctrl-C, SIGTERM, an error: Flower's threads end too
            if isinstance(exc, SystemExit) and exc.code == signal.SIGTERM:
                exc = Terminated(signal.SIGTERM)  # ray.init's SIGTERM handler: sys.exit(15)
            _stop_simulation(threads)
            if isinstance(exc, Terminated):
                raise exc from None
            raise
        finally:
            flwr_logger.disabled = disabled
        if not result:
            raise ConfigError(f"the federated run in {out} did not finish: resume it with --resume")
        return result
