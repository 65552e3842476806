"""The server of a federated run (issue 29): the per-tensor aggregation strategy
(:class:`ElasticFedAvg`, a Flower ``Strategy``) and the round loop around it (:func:`serve`:
the global model's evaluation, the run log, a checkpoint every round, resume).

:data:`app` is the ``ServerApp`` ``flwr run`` starts (``[tool.flwr.app.components]``); its
settings come from the run config (:meth:`FederateConfig.from_run_config`, plus ``out``: the run
directory, and ``resume``). ``etgraph federate`` runs :func:`serve` on Flower's simulation
engine (:mod:`etgraph.federated.run`).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from ..errors import ConfigError
from . import fedel, rundir
from .aggregate import aggregate, batch_norm_pairs
from .config import FederateConfig
from .task import Task, load_task

log = logging.getLogger(__name__)

__all__ = ["STOP", "ElasticFedAvg", "GlobalModel", "Stopped", "app", "exchange", "serve"]

#: Set by the process that runs a simulation when it is interrupted
#: (:func:`etgraph.federated.run.federate`): the server stops waiting for replies. Flower's
#: ``send_and_receive`` cannot be cancelled, and its thread kept an interrupted ``etgraph
#: federate`` alive after its last line (it waits ``round_timeout_s``, 15 minutes by default).
STOP = threading.Event()

#: Seconds between two polls for replies (Flower's in-memory grid polls every 0.1 s too).
PULL_INTERVAL_S = 0.1


class Stopped(Exception):
    """The server was stopped (:data:`STOP`) while it waited."""


def exchange(grid: Grid, messages: Iterable[Message], timeout_s: float) -> list[Message]:
    """Flower's ``grid.send_and_receive(messages, timeout=timeout_s)`` that gives up when
    :data:`STOP` is set: push, then pull the replies until every message has one or
    ``timeout_s`` wall seconds have passed.

    Raises:
        Stopped: :data:`STOP` was set.
    """
    pending = set(grid.push_messages(messages))
    end = time.monotonic() + timeout_s
    replies: list[Message] = []
    while pending and time.monotonic() < end:
        if STOP.is_set():
            raise Stopped
        new = list(grid.pull_messages(pending))
        replies += new
        pending -= {m.metadata.reply_to_message_id for m in new}
        if pending:
            STOP.wait(PULL_INTERVAL_S)
    return replies


#: Wall seconds the server waits for the run's clients to connect.
CONNECT_TIMEOUT_S = 300.0


class ElasticFedAvg(Strategy):
    """FedAvg over partial updates: every tensor is averaged over the clients that trained it,
    weighted by their examples, and keeps its global value when nobody did
    (:func:`etgraph.federated.aggregate.aggregate`; BatchNorm running statistics pooled). Late
    replies (virtual round time beyond the deadline + 5%) and failed ones are left out.

    With FedEL's switches (:mod:`etgraph.federated.fedel`) it sends each client its window and
    the global importance.

    After :meth:`aggregate_train`, :attr:`clients` holds the round's per-client entries and
    :attr:`coverage` the per-tensor coverage.

    Args:
        config: the run's settings. names: the model's trainable tensors, forward order.
        bn_pairs: ``{running_var: running_mean}`` of its batch norms.
    """

    def __init__(self, config: FederateConfig, names: list[str], bn_pairs: dict[str, str]):
        self.config = config
        self.names = list(names)
        self.bn_pairs = dict(bn_pairs)
        self.global_importance: list[float] | None = None
        self.node_partitions: dict[int, int] = {}  # node id -> partition (:meth:`identify`)
        self.clients: list[dict] = []
        self.coverage: list[float] = []
        self._global: dict[str, np.ndarray] = {}
        self._sent: dict[int, int] = {}  # node id -> ordinal

    def summary(self) -> None:
        log.info("ElasticFedAvg: %s, deadline %s s", self.config.strategy, self.config.deadline_s)

    @property
    def cutoff_s(self) -> float | None:
        """The virtual time after which a reply is late (None: no deadline)."""
        d = self.config.deadline_s
        return None if d is None else d * (1 + rundir.LATE_TOLERANCE)

    def identify(self, grid: Grid, timeout_s: float) -> None:
        """Learn the partition (client id) of every connected node not known yet: a ``query``
        message each, answered from the node's config (the client's ``query`` handler). Node
        ids are the transport's (new in every simulation, so after a resume too): without this a
        client that crashed before its first reply was logged by its node's position, and the
        FedEL window followed the nodes' sort order instead of the client. A node that does not
        answer within ``timeout_s`` (wall seconds) stays unknown; its replies name it later."""
        unknown = [n for n in grid.get_node_ids() if n not in self.node_partitions]
        if not unknown:
            return
        queries = [
            Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY)
            for node in unknown
        ]
        for reply in exchange(grid, queries, timeout_s):
            if not reply.has_error():
                pid = int(reply.content["metrics"]["partition-id"])
                self.node_partitions[reply.metadata.src_node_id] = pid

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per connected node: the global model (every tensor) and a
        ``config`` record with the run's settings (``task``, JSON), ``server-round``, the
        node's FedEL ``window`` (``[start, end)`` or empty; offset by the node's client id,
        :meth:`identify`, or its position among the nodes while that is unknown) and
        ``global-importance``."""
        self._global = {k: a.numpy() for k, a in arrays.items()}
        nodes = sorted(grid.get_node_ids())
        self._sent = {node: i for i, node in enumerate(nodes)}
        messages = []
        for node, ordinal in self._sent.items():
            offset = self.node_partitions.get(node, ordinal)
            record = ConfigRecord(dict(config))
            record["server-round"] = server_round
            record["task"] = json.dumps(self.config.to_json())
            record["round-timeout-s"] = float(self.config.round_timeout_s)
            w = self.config.window_fraction
            record["window"] = (
                list(fedel.window(len(self.names), w, server_round, offset)) if w > 0 else []
            )
            record["global-importance"] = list(self.global_importance or [])
            content = RecordDict({"arrays": arrays, "config": record})
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        return messages

    def _entry(self, node: int, reply: Message | None) -> tuple[dict, dict | None, float]:
        """A client's log entry, its checked upload (None: not aggregated) and its examples."""
        cfg = self.config
        ordinal = self._sent.get(node, -1)
        entry = {
            "client": self.node_partitions.get(node, f"node{ordinal}"),
            "speed": None,
            "deadline_s": cfg.deadline_s,
            "round_time_s": math.nan,
            "n_tensors": 0,
            "upload_bytes": 0,
            "status": "late",
        }
        if reply is None:
            entry["reason"] = "no reply within the server's wait"
            return entry, None, 0.0
        if reply.has_error():
            entry.update(status="failed", reason=rundir.failure_reason(str(reply.error.reason)))
            return entry, None, 0.0
        m = dict(reply.content["metrics"])
        arrays = reply.content["arrays"]
        pid = int(m["partition-id"])
        self.node_partitions[node] = pid
        entry.update(
            client=pid,
            speed=float(m["speed"]),
            round_time_s=float(m["round-time-s"]),
            n_tensors=int(m["n-tensors"]),
            upload_bytes=int(arrays.count_bytes()),
            examples=int(m["examples"]),
            steps=int(m["steps"]),
            steps_planned=int(m["steps-planned"]),
            rho=float(m["rho"]),
            rho_achieved=float(m["rho-achieved"]),
            measured_s=float(m["measured-s"]),
            artifacts_s=float(m["artifacts-s"]),
            train_loss=float(m["train-loss"]),
            window=list(m["window"]),
            selected=list(m["selected"]),
            status="ok",
        )
        upload = {k: a.numpy() for k, a in arrays.items()}
        bad = [
            k
            for k, v in upload.items()
            if k not in self._global or v.shape != self._global[k].shape
        ]
        if bad:
            entry.update(status="failed", reason=f"tensors not in the model: {bad[:3]}")
            return entry, None, 0.0
        cutoff = self.cutoff_s
        if cutoff is not None and entry["round_time_s"] > cutoff:
            entry["status"] = "late"
            return entry, None, 0.0
        if m.get("importance"):
            entry["importance"] = list(m["importance"])
        return entry, upload, float(m["examples"])

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The next global model (every tensor) from the round's replies (class docstring);
        the global model unchanged when no reply can be used."""
        by_node = {r.metadata.src_node_id: r for r in replies}
        entries, updates, importances = [], [], []
        for node in self._sent:
            entry, upload, examples = self._entry(node, by_node.get(node))
            imp = entry.pop("importance", None)
            entries.append(entry)
            if upload is not None:
                updates.append((upload, examples))
                if imp:
                    importances.append((fedel.normalised(imp), examples))
        weights, coverage = aggregate(self._global, updates, self.bn_pairs)
        if importances and self.config.beta > 0:
            w = np.array([n for _, n in importances])
            stacked = np.stack([v for v, _ in importances])
            self.global_importance = (w / w.sum() @ stacked).tolist()
        self.clients = sorted(entries, key=lambda e: str(e["client"]))
        self.coverage = [coverage[n] for n in self.names]
        ok = [e for e in entries if e["status"] == "ok"]
        metrics = MetricRecord({"clients-ok": len(ok), "clients": len(entries)})
        return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in weights.items()}), metrics

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        """None: the server evaluates the global model itself (:class:`GlobalModel`)."""
        return []

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None

    def round_time_s(self) -> float:
        """The round's virtual length: as long as its slowest client the server waited for —
        the last reply, or the cutoff when a client was late or sent nothing."""
        times = [e["round_time_s"] for e in self.clients if math.isfinite(e["round_time_s"])]
        cutoff = self.cutoff_s
        if cutoff is not None:
            if any(e["status"] == "late" for e in self.clients):
                return cutoff
            return min(max(times, default=0.0), cutoff)
        return max(times, default=0.0)


class GlobalModel:
    """The server's copy of the model: evaluates and exports given weights with an
    :class:`etgraph.ElasticTrainer` that never trains (its output layer's eval graph)."""

    def __init__(self, task: Task):
        from ..trainer import ElasticTrainer

        config, data = task.train_config, task.test_data()
        self.trainer = ElasticTrainer(task.model, task.profile, config, data=data)

    def evaluate(self, weights: dict[str, np.ndarray]) -> tuple[float, float]:
        """``(loss, accuracy)`` of ``weights`` on the server's test set."""
        self.trainer.set_weights(weights)
        return self.trainer.evaluate()

    def export(self, weights: dict[str, np.ndarray], path: Path) -> Path:
        self.trainer.set_weights(weights)
        return self.trainer.export(path)

    def close(self) -> None:
        self.trainer.close()


def _initial_weights(model) -> dict:
    """The global model's first weights, in the original parametrisation the clients'
    ``get_weights`` and ``set_weights`` speak (a head compiled with ``--head-lr-scale`` is
    stored scaled)."""
    weights = model.initial_weights()
    return weights if model.head_lr is None else model.head_lr.original(weights)


def _wait_for_nodes(grid: Grid, count: int) -> None:
    t0 = time.monotonic()
    while len(list(grid.get_node_ids())) < count:
        if STOP.is_set():
            raise Stopped
        if time.monotonic() - t0 > CONNECT_TIMEOUT_S:
            raise ConfigError(
                f"only {len(list(grid.get_node_ids()))} of {count} clients connected within "
                f"{CONNECT_TIMEOUT_S:.0f} s: start {count} SuperNodes, or lower --clients"
            )
        STOP.wait(0.2)


def serve(grid: Grid, config: FederateConfig, out: Path, *, on_round=None) -> dict:
    """Run the federated rounds of ``config`` into the run directory ``out`` (prepared by the
    caller; continued from its checkpoint if it has one) and return ``summary.json``'s dict.

    ``on_round`` is called with each round's record (progress output).
    """
    out = Path(out)
    task = load_task(config)
    model = task.model
    strategy = ElasticFedAvg(config, model.names, batch_norm_pairs(model.proto))
    server = GlobalModel(task)
    try:
        saved = rundir.read_checkpoint(out)
        if saved is None:
            weights, first, virtual = _initial_weights(model), 1, 0.0
            records = rundir.truncate_log(out, 0)
            loss, acc = server.evaluate(weights)
            initial = {"initial_val_acc": acc, "initial_val_loss": loss}
        else:
            weights, state = saved
            first, virtual = state["round"] + 1, state["virtual_time_s"]
            strategy.global_importance = state.get("global_importance")
            initial = state["initial"]
            records = rundir.truncate_log(out, state["round"])
            log.info("resuming after round %d", state["round"])
        _wait_for_nodes(grid, config.clients)
        for rnd in range(first, config.rounds + 1):
            t0 = time.perf_counter()
            strategy.identify(grid, config.round_timeout_s)
            arrays = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in weights.items()})
            messages = strategy.configure_train(rnd, arrays, ConfigRecord(), grid)
            replies = exchange(grid, messages, config.round_timeout_s)
            new, _ = strategy.aggregate_train(rnd, replies)
            weights = {k: a.numpy() for k, a in new.items()}
            t_eval = time.perf_counter()
            loss, acc = server.evaluate(weights)
            round_s = strategy.round_time_s()
            virtual += round_s
            record = {
                "round": rnd,
                "virtual_time_s": virtual,
                "round_time_s": round_s,
                "val_acc": acc,
                "val_loss": loss,
                "clients": strategy.clients,
                "coverage": strategy.coverage,
                "wall_s": time.perf_counter() - t0,
                "server_eval_s": time.perf_counter() - t_eval,
                **initial,
            }
            rundir.append_log(out, record)
            rundir.write_checkpoint(
                out,
                weights,
                {
                    "round": rnd,
                    "virtual_time_s": virtual,
                    "global_importance": strategy.global_importance,
                    "initial": initial,
                },
            )
            records.append(record)
            if on_round is not None:
                on_round(record)
        summary = rundir.summarize(records, config)
        server.export(weights, out / rundir.MODEL_FILE)
        from .plots import plot_accuracy, plot_tensors

        plot_accuracy({config.strategy: [records]}, out / rundir.ACCURACY_PLOT)
        plot_tensors(records, len(model.names), out / rundir.TENSORS_PLOT)
        from ..files import write_json_atomic

        write_json_atomic(out / rundir.SUMMARY_FILE, summary)
        return summary
    finally:
        server.close()


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run``'s entry: the run config's settings (``out``: the run directory, required;
    ``resume``: continue it)."""
    settings = dict(context.run_config)
    out = settings.pop("out", "")
    resume = bool(settings.pop("resume", False))
    if not out:
        raise ConfigError('the run config needs out = "RUN": the run directory to write')
    config = FederateConfig.from_run_config(settings)
    from .run import open_run

    with open_run(Path(out), config, resume=resume) as config:
        serve(grid, config, Path(out))
