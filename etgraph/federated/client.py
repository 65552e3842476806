"""The elastic Flower client (issue 29): one device that trains, in each round, the tensors
that matter most within its own time budget.

A round (:meth:`FederatedClient.train_round`), all on the device's virtual clock
(:mod:`etgraph.federated.clock`):

1. the server's global model is set (AdamW moments start afresh);
2. the round's deadline becomes a rho (:func:`etgraph.federated.clock.plan_round`: the time
   left after the round's measured fixed costs, over its planned steps, per full step measured
   on this device); FedEL's switches shape the importance (:mod:`etgraph.federated.fedel`);
3. the period start of :class:`etgraph.ElasticTrainer` measures importance and solves the DP
   of Eq. (3) under that rho (paper §3-§4), and the client trains step by step, stopping
   before a step that would end past the deadline (``fedavg-drop`` clients train every step
   and may be late: the server drops them; ``fedavg-full`` clients have no deadline);
4. the tensors it trained (:meth:`etgraph.ElasticTrainer.trained_weights`: the selection and
   the running statistics that moved; nothing when it took no step) go back as an
   ``ArrayRecord`` keyed by ONNX initializer name, with metrics (examples, steps, selected
   tensors, virtual and measured time, rho requested and achieved, its importance).

The device's trainer is kept between rounds (a Flower ``ClientApp`` is called once per
message; the Ray worker that runs it lives on); its one-time setup (model, profile, trainer, a
measured full step, a calibration of a round's fixed costs) is not part of any round. Each
device draws from its own seed (:meth:`FederateConfig.client_seed`), not the run's: clients
sharing the run's seed drew the same Dropout masks, data order and probe batches in a round.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..files import private_temp_dir
from ..timing import min_feasible_rho
from ..trainer import ElasticTrainer
from . import fedel
from .clock import RoundCosts, RoundPlan, VirtualClock, next_step_s, plan_round
from .config import FederateConfig
from .task import Task, load_task

log = logging.getLogger(__name__)

__all__ = ["FederatedClient", "RoundResult", "client_for"]

#: The share of the deadline a client plans to use (the rest absorbs its estimates' error).
DEADLINE_TARGET = 0.97
#: Wall seconds a ``hang`` fault sleeps beyond the server's round timeout.
HANG_EXTRA_S = 5.0
#: A ``late`` fault's reply is delayed (a slow uplink) by this many round deadlines.
LATE_DELAY = 1.5
#: Devices whose trainers one process keeps (least recently used dropped).
MAX_CLIENTS = 16


@dataclass
class RoundResult:
    """What a client sends back: ``upload`` (initializer name -> array) and ``metrics``."""

    upload: dict[str, np.ndarray]
    metrics: dict


class FederatedClient:
    """One emulated device: partition ``partition_id`` of ``config``'s task, speed factor
    ``speed`` (module docstring).

    Raises:
        ModelError, DataError, ConfigError: the task cannot be loaded (:func:`load_task`).
    """

    def __init__(self, config: FederateConfig, partition_id: int, speed: float | None = None):
        self.config = config
        self.partition_id = int(partition_id)
        self.speed = float(speed if speed is not None else config.speed(partition_id))
        self.task: Task = load_task(config)
        task = self.task
        data = task.client_data(self.partition_id)
        strategy = "elastic" if config.elastic else "full"
        self.seed = config.client_seed(self.partition_id)  # this device's draws (not the run's)
        train_config = dataclasses.replace(
            task.train_config, strategy=strategy, rho=1.0, seed=self.seed
        )
        self.trainer = ElasticTrainer(
            task.model, task.profile, train_config, data=data, artifacts_root=_artifacts_root()
        )
        self.examples = data.n_train
        self.steps_per_epoch = self.trainer.steps_per_epoch
        p = self.trainer.profile
        # the cheapest selection's rho, 2% above it as deadline mode takes it (rounding)
        self.floor_rho = 1.02 * min_feasible_rho(p.t_dw_us, p.t_dy_us, p.forward_us, p.t_full_us)
        n = len(task.model.names)
        self.single_rho = np.array(  # training tensor k alone, as a share of a full step
            [p.predicted_step_us(np.arange(n) == k) / p.t_full_us for k in range(n)]
        )
        tensors = task.model.tensors
        self.head = [i for i, t in enumerate(tensors) if t.layer == tensors[-1].layer]
        self.full_step_s = self._measure_full_step()  # this machine, the clock's source
        self.correction = 1.0  # measured elastic step / predicted, from the last round
        self.costs = RoundCosts()  # a round's costs outside its steps, virtual
        if config.elastic:
            self._calibrate()

    def _measure_full_step(self, steps: int = 3) -> float:
        """Median full training step (every tensor, learning rate 0) on this machine, in the
        clock's source: the device's own measurement of its speed."""
        session = self.trainer.controller.reference_session()
        x, y = self.trainer.controller.timing_batch()
        clock = VirtualClock(1.0, self.config.clock)
        times = []
        for _ in range(steps):
            clock.start()
            session.train_step(x, y, 0.0)
            times.append(clock.measured_s())
        return float(np.median(times))

    def _calibrate(self) -> None:
        """Measure a round's costs outside its steady steps before the first round, as a round
        has them, in dry rounds (:meth:`_dry_round`): a warm-up at the cheapest rho (first-time
        costs, not kept), one at the cheapest rho, and one at the rho the first round's plan
        gives with those costs; the plan takes the worst. A larger selection's period end
        (its checkpoint and upload) and start cost more: MobileNetV2's end took 0.07-0.10 s of
        CPU at 2 tensors and 0.16-0.25 s at rho 0.3-1, and calibrated at the cheapest rho
        alone an s = 8 client's first round at rho 0.82 ended at 1.08x the deadline (issue
        29, docs/results.md)."""
        weights = self.trainer.get_weights()
        self._dry_round(weights, self.floor_rho)
        self.costs = RoundCosts(*self._dry_round(weights, self.floor_rho))
        rho = self._plan(DEADLINE_TARGET * self.config.deadline_s).rho
        begin_s, end_s, first_s = self._dry_round(weights, rho)
        self.costs.observe(begin_s=begin_s, end_s=end_s, first_step_s=first_s)
        self.trainer.set_weights(weights, reset_moments=True)

    def _dry_round(self, weights: dict, rho: float, steps: int = 3) -> tuple[float, float, float]:
        """A round's costs at ``rho`` with nothing kept (``weights`` set first): the period
        start, the period end and upload, and the first of ``steps`` steps less the median of
        the others; virtual s."""
        trainer = self.trainer
        x, y = trainer.controller.timing_batch()
        clock = VirtualClock(self.speed, self.config.clock)
        trainer.set_weights(weights, reset_moments=True)
        info = trainer.begin_period(rho)
        clock.discount(self._artifacts_time(info))
        begin_s = clock.elapsed_s()
        step_s = []
        for _ in range(steps):
            clock.start()
            trainer.step(x, y)
            step_s.append(clock.elapsed_s())
        clock.start()
        trainer.end_period()
        trainer.trained_weights()
        return begin_s, clock.elapsed_s(), step_s[0] - float(np.median(step_s[1:]))

    def _plan(self, left_s: float) -> RoundPlan:
        """The round's plan (:func:`plan_round`) with ``left_s`` virtual s left, from this
        device's full step (as corrected) and its planned fixed costs."""
        return plan_round(
            left_s=left_s,
            steps=self.config.local_epochs * self.steps_per_epoch,
            full_step_s=self.speed * self.full_step_s * self.correction,
            fixed_s=self.costs.fixed_s,
            floor_rho=self.floor_rho,
        )

    def _artifacts_time(self, info) -> float:
        """The period start's artifact generation, in the clock's source (taken off it)."""
        key = "artifacts_cpu_s" if self.config.clock == "cpu" else "artifacts_s"
        return float(info.timings.get(key, 0.0) or 0.0)

    def train_round(
        self,
        server_round: int,
        weights: dict[str, np.ndarray],
        *,
        window: tuple[int, int] | None = None,
        global_importance: list[float] | None = None,
        round_timeout_s: float | None = None,
    ) -> RoundResult:
        """Train one round from the global ``weights`` (module docstring).

        Args:
            server_round: 1-based.
            weights: the global model, initializer name -> array (every parameter).
            window: FedEL's window ``[start, end)`` for this client (None: off).
            global_importance: the server's importance, float [N] (None: local only).
            round_timeout_s: the server's wait (a ``hang`` fault sleeps past it).

        Raises:
            RuntimeError: a ``crash`` fault.
            ConfigError: ``weights`` do not fit the model.
        """
        cfg, trainer = self.config, self.trainer
        fault = cfg.fault(self.partition_id, server_round)
        clock = VirtualClock(self.speed, cfg.clock)  # the device's clock: the round starts now
        if fault == "crash":
            raise RuntimeError(f"client {self.partition_id}: injected crash, round {server_round}")
        deadline = cfg.deadline_s
        target = None if deadline is None else DEADLINE_TARGET * deadline
        trainer.set_weights(weights, reset_moments=True)
        planned = cfg.local_epochs * self.steps_per_epoch
        full_s = self.speed * self.full_step_s * self.correction  # what it believes (virtual)
        rho, steps, partial = 1.0, planned, False
        if cfg.elastic and target is not None:
            plan = self._plan(target - clock.elapsed_s())
            rho, steps, partial = plan.rho, plan.steps, plan.partial
        local: list[np.ndarray] = []
        bounds = None
        if window is not None and rho < 1.0:
            bounds = fedel.affordable_window(tuple(window), rho, self.single_rho)

        def shape_importance(importance: np.ndarray) -> np.ndarray:
            local.append(np.asarray(importance, dtype=np.float64).copy())
            shaped = fedel.blend(importance, global_importance, cfg.beta)
            return fedel.restrict(shaped, bounds, self.head) if bounds is not None else shaped

        upload: dict[str, np.ndarray] = {}
        losses, step_s = [], []
        info, begin_s = None, 0.0
        if steps > 0:
            t_begin = clock.elapsed_s()
            trainer.periods_ended = server_round - 1  # the round's probe batches: resumable
            info = trainer.begin_period(rho, importance_fn=shape_importance)
            clock.discount(self._artifacts_time(info))
            begin_s = clock.elapsed_s() - t_begin
            share = info.predicted_step_us / trainer.profile.t_full_us
            step_guess = full_s * share
            trainer.global_step = (server_round - 1) * planned  # the cosine's place: resumable
            first_s = self.costs.first_step_s  # the new session's first step costs more
            for x, y in self._batches(server_round, planned):
                if len(losses) >= steps:
                    break
                if target is not None and cfg.elastic:
                    expected = next_step_s(step_s, step_guess, first_s)
                    if clock.elapsed_s() + expected + self.costs.end_s > target:
                        break
                t0 = clock.elapsed_s()
                losses.append(trainer.step(x, y))
                step_s.append(clock.elapsed_s() - t0)
            t_end = clock.elapsed_s()
            trainer.end_period()
            # the selection counts as trained once a period starts; with no step taken (the
            # period start used the budget) it holds the global values: uploading them would
            # pull the average of every client that trained them back towards the old model
            upload = trainer.trained_weights() if losses else {}
        else:
            t_end = clock.elapsed_s()
        timed = step_s[1:]  # steady steps: the first one of a new session costs more
        mean_step = float(np.mean(timed)) if timed else float("nan")
        first_extra = None
        if step_s:  # a period started: step_guess is its predicted step
            if timed:
                self.correction *= float(np.clip(mean_step / step_guess, 0.5, 2.0))
            first_extra = step_s[0] - (mean_step if timed else step_guess)
        self.costs.observe(  # the next rounds' estimates
            begin_s=begin_s if info is not None else None,
            end_s=clock.elapsed_s() - t_end,
            first_step_s=first_extra,
        )
        if fault == "hang":
            time.sleep((round_timeout_s or 0.0) + HANG_EXTRA_S)
        round_s = clock.elapsed_s()
        if fault == "late":  # a slow uplink: the reply arrives after the deadline
            round_s += LATE_DELAY * (cfg.round_deadline_s or round_s)
        names = set(self.task.model.names)
        metrics = {
            "partition-id": self.partition_id,
            "speed": self.speed,
            "examples": self.examples,
            "steps": len(losses),
            "steps-planned": planned,
            "partial": int(partial or len(losses) < planned),
            "n-tensors": sum(1 for k in upload if k in names),
            "selected": [i for i, n in enumerate(self.task.model.names) if n in upload],
            "round-time-s": round_s,
            "measured-s": clock.measured_s(),
            "artifacts-s": float(info.timings.get("artifacts_s", 0.0)) if info else 0.0,
            "rho": rho if info is not None else 0.0,
            "rho-achieved": mean_step / (self.speed * self.full_step_s) if timed else float("nan"),
            "train-loss": float(np.mean(losses)) if losses else float("nan"),
            "window": list(bounds) if bounds is not None else [],
            "importance": [float(v) for v in local[0]] if local else [],
        }
        return RoundResult(upload, metrics)

    def _batches(self, server_round: int, steps: int):
        """The round's training batches: epochs over the client's data, reshuffled per round
        and epoch (seed ``client seed * 1000 + round * 10 + epoch``)."""
        ds, b = self.trainer.dataset, self.trainer.config.batch_size
        epoch = 0
        while True:
            seed = self.seed * 1000 + server_round * 10 + epoch
            yield from ds.train_batches(b, seed=seed)
            epoch += 1
            if epoch * self.steps_per_epoch >= steps:
                return

    def close(self) -> None:
        self.trainer.close()


_ARTIFACTS = None
_CLIENTS: OrderedDict[tuple, FederatedClient] = OrderedDict()


def _artifacts_root():
    """This process's artifact cache, shared by its clients (module docstring of
    :mod:`etgraph.federated.clock`: artifacts are compiled off the device)."""
    global _ARTIFACTS
    if _ARTIFACTS is None:
        _ARTIFACTS = private_temp_dir("fl-artifacts")
    return _ARTIFACTS.name


def client_for(config: FederateConfig, partition_id: int, speed: float | None = None):
    """The device of ``partition_id`` in the run of ``config``, built once per process."""
    key = (config.digest(), int(partition_id), speed)
    client = _CLIENTS.get(key)
    if client is None:
        client = FederatedClient(config, partition_id, speed)
        _CLIENTS[key] = client
        while len(_CLIENTS) > MAX_CLIENTS:
            _, old = _CLIENTS.popitem(last=False)
            old.close()
    _CLIENTS.move_to_end(key)
    return client


def _client_app():
    """The ``ClientApp`` (imported here: flwr only where a client runs)."""
    import json

    from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        """One round: the train message's ``arrays`` (the global model) and ``config``
        (:meth:`etgraph.federated.server.ElasticFedAvg.configure_train`); the node's
        ``partition-id`` (and optionally ``speed``) from its node config."""
        record = msg.content["config"]
        config = FederateConfig.from_json(json.loads(record["task"]))
        node = context.node_config
        speed = float(node["speed"]) if "speed" in node else None
        client = client_for(config, int(node["partition-id"]), speed)
        window = list(record.get("window", []))
        result = client.train_round(
            int(record["server-round"]),
            {k: a.numpy() for k, a in msg.content["arrays"].items()},
            window=tuple(window) if window else None,
            global_importance=list(record.get("global-importance", [])) or None,
            round_timeout_s=float(record.get("round-timeout-s", 0.0)),
        )
        arrays = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in result.upload.items()})
        content = RecordDict({"arrays": arrays, "metrics": MetricRecord(result.metrics)})
        return Message(content, reply_to=msg)

    @client_app.query()
    def query(msg: Message, context: Context) -> Message:
        """The node's ``partition-id`` (its client id), from its node config
        (:meth:`etgraph.federated.server.ElasticFedAvg.identify`)."""
        pid = int(context.node_config["partition-id"])
        return Message(RecordDict({"metrics": MetricRecord({"partition-id": pid})}), reply_to=msg)

    return client_app


#: The ``ClientApp`` ``flwr run`` and the simulation start (``[tool.flwr.app.components]``).
app = _client_app()
