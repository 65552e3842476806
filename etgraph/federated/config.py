"""The settings of one federated run (:class:`FederateConfig`): what ``etgraph federate``
takes, what ``run.json`` records, what the server sends every client (as JSON in the train
message's ``ConfigRecord``) and what ``flwr run`` reads from ``[tool.flwr.app.config]``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import ConfigError
from .clock import CLOCK_SOURCES
from .partition import parse_partition

__all__ = ["FAULT_KINDS", "STRATEGIES", "FederateConfig", "parse_faults"]

#: Server strategies (the benchmark's A-D): FedAvg of full training waiting for every client;
#: FedAvg of full training under the deadline, late clients dropped; elastic clients under the
#: deadline; elastic with FedEL's window and global importance (:mod:`etgraph.federated.fedel`).
STRATEGIES = ("fedavg-full", "fedavg-drop", "elastic", "elastic-fedel")

#: Faults a client can be told to play (:func:`parse_faults`), for tests and benchmarks:
#: ``crash`` raises in the client, ``hang`` sleeps past the server's wait, ``late`` delays its
#: reply (a slow uplink) by 1.5 round deadlines of virtual time.
FAULT_KINDS = ("crash", "hang", "late")

#: FedEL's switches when ``elastic-fedel`` does not set them (window width as a fraction of
#: the tensors; weight of the global importance).
FEDEL_WINDOW = 0.5
FEDEL_BETA = 0.5


def parse_faults(items) -> tuple[tuple[int, str, int], ...]:
    """``((partition id, kind, round), ...)`` of ``"ID:KIND:ROUND"`` strings.

    Raises:
        ConfigError: a malformed item or an unknown kind.
    """
    out = []
    for item in items:
        parts = str(item).split(":")
        try:
            pid, kind, rnd = int(parts[0]), parts[1], int(parts[2])
        except (IndexError, ValueError):
            raise ConfigError(f"fault {item!r}: use CLIENT:KIND:ROUND, e.g. 1:crash:2") from None
        if kind not in FAULT_KINDS or len(parts) != 3:
            raise ConfigError(f"fault {item!r}: KIND is one of {', '.join(FAULT_KINDS)}")
        out.append((pid, kind, rnd))
    return tuple(out)


@dataclass(frozen=True)
class FederateConfig:
    """One federated run.

    Attributes:
        model: the ONNX file or compiled directory (None: the embedded default model).
        data, tokenizer: the task's data spec (None: the embedded digits) and text tokenizer.
        clients: number of clients (Flower SuperNodes), >= 1.
        rounds: federated rounds, >= 1.
        round_deadline_s: every round's deadline in each client's own (virtual) clock, s;
            required by every strategy but ``fedavg-full``, which waits for the slowest.
        speeds: speed factors ``s`` (virtual time = ``s`` x measured time); client ``k`` gets
            ``speeds[k % len(speeds)]``.
        partition: ``iid`` or ``dirichlet:ALPHA`` (:mod:`etgraph.federated.partition`) of the
            task's training split; its validation split is the server's test set.
        strategy: one of :data:`STRATEGIES`.
        local_epochs: epochs over its data a client plans per round (>= 1).
        batch_size, learning_rate, weight_decay: the clients' training (AdamW, a cosine decay
            over ``rounds`` rounds, fresh moments every round).
        seed: the run's seed: the split, and each client's own seed (:meth:`client_seed`).
        clock: ``cpu`` or ``wall`` (:class:`etgraph.federated.clock.VirtualClock`).
        window: FedEL's window, a fraction of the tensors in (0, 1] (0: off; None: 0.5 for
            ``elastic-fedel``, else off).
        global_importance: weight ``beta`` of the server's importance in [0, 1] (0: off; None:
            0.5 for ``elastic-fedel``, else off).
        round_timeout_s: wall seconds the server waits for a round's replies.
        faults: ``"ID:KIND:ROUND"`` faults clients play (:func:`parse_faults`).
    """

    model: str | None = None
    data: str | None = None
    tokenizer: str | None = None
    clients: int = 8
    rounds: int = 20
    round_deadline_s: float | None = None
    speeds: tuple[float, ...] = (1.0,)
    partition: str = "dirichlet:0.5"
    strategy: str = "elastic"
    local_epochs: int = 1
    batch_size: int = 4
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    clock: str = "cpu"
    window: float | None = None
    global_importance: float | None = None
    round_timeout_s: float = 900.0
    faults: tuple[str, ...] = ()

    def validate(self) -> FederateConfig:
        """Return self if every setting is in range; else ConfigError naming the option."""
        for name in ("clients", "rounds", "local_epochs", "batch_size"):
            value = getattr(self, name)
            if int(value) != value or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer")
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}"
            )
        if self.round_deadline_s is None and self.strategy != "fedavg-full":
            raise ConfigError(
                f"--strategy {self.strategy} needs --round-deadline (e.g. 30s): every client "
                "trains within it"
            )
        if self.round_deadline_s is not None and not 0 < self.round_deadline_s < math.inf:
            raise ConfigError(f"--round-deadline must be positive, got {self.round_deadline_s}")
        if not self.speeds or not all(0 < s < math.inf for s in self.speeds):
            raise ConfigError(f"--speeds must be positive factors, e.g. 1,2,4,8; got {self.speeds}")
        parse_partition(self.partition)
        if self.clock not in CLOCK_SOURCES:
            raise ConfigError(f"unknown clock {self.clock!r}: choose {', '.join(CLOCK_SOURCES)}")
        if not self.learning_rate > 0 or not self.weight_decay >= 0:
            raise ConfigError("the learning rate must be positive and the weight decay >= 0")
        for name in ("window", "global_importance"):  # else ignored, silently
            if not self.elastic and getattr(self, name) is not None:
                raise ConfigError(
                    f"--{name.replace('_', '-')} shapes what elastic clients select: use it "
                    f"with --strategy elastic or elastic-fedel, not {self.strategy}"
                )
        if not 0 <= self.window_fraction <= 1 or not 0 <= self.beta <= 1:
            raise ConfigError("--window must be in [0, 1] and --global-importance in [0, 1]")
        if not self.round_timeout_s > 0:
            raise ConfigError("the round timeout must be positive")
        for pid, kind, rnd in parse_faults(self.faults):  # else it never fires, silently
            if not (0 <= pid < self.clients and 1 <= rnd <= self.rounds):
                raise ConfigError(
                    f"fault {pid}:{kind}:{rnd} names no client round of this run: CLIENT is "
                    f"0..{self.clients - 1} and ROUND 1..{self.rounds}"
                )
        return self

    # -- what the strategy means for a client ------------------------------------------------

    @property
    def elastic(self) -> bool:
        """Clients select tensors (else they train every tensor, FedAvg)."""
        return self.strategy.startswith("elastic")

    @property
    def deadline_s(self) -> float | None:
        """The round deadline the server enforces (None: it waits for every client)."""
        return None if self.strategy == "fedavg-full" else self.round_deadline_s

    @property
    def window_fraction(self) -> float:
        """FedEL's window width as a fraction of the tensors (0: off)."""
        if self.window is not None:
            return float(self.window)
        return FEDEL_WINDOW if self.strategy == "elastic-fedel" else 0.0

    @property
    def beta(self) -> float:
        """Weight of the server's importance in a client's selection (0: off)."""
        if self.global_importance is not None:
            return float(self.global_importance)
        return FEDEL_BETA if self.strategy == "elastic-fedel" else 0.0

    def speed(self, partition_id: int) -> float:
        """Client ``partition_id``'s speed factor."""
        return float(self.speeds[partition_id % len(self.speeds)])

    def client_seed(self, partition_id: int) -> int:
        """Client ``partition_id``'s own seed (31 bits), derived from the run's by
        ``numpy.random.SeedSequence``: its trainer's Dropout masks and probe batches and its
        data order come from it, keyed further by the round (the global step of the round's
        steps, the period, the round's epochs; :class:`etgraph.federated.client.FederatedClient`),
        so clients draw differently from each other and from round to round, and a run of the
        same seed draws alike."""
        state = np.random.SeedSequence((int(self.seed), int(partition_id))).generate_state(1)
        return int(state[0] >> 1)

    def fault(self, partition_id: int, server_round: int) -> str | None:
        """The fault client ``partition_id`` plays in ``server_round`` (None: none)."""
        for pid, kind, rnd in parse_faults(self.faults):
            if pid == partition_id and rnd == server_round:
                return kind
        return None

    # -- serialisation ---------------------------------------------------------------------------

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> FederateConfig:
        """Inverse of :meth:`to_json`, validated.

        Raises:
            ConfigError: unknown fields or values out of range.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ConfigError(f"unknown federated settings: {', '.join(sorted(unknown))}")
        data = dict(data)
        for name in ("speeds", "faults"):
            if name in data:
                data[name] = tuple(data[name])
        return cls(**data).validate()

    @classmethod
    def from_run_config(cls, run_config) -> FederateConfig:
        """From a Flower run config (``[tool.flwr.app.config]`` of ``pyproject.toml``, ``flwr
        run --run-config``): the same names with dashes; ``speeds`` and ``faults`` as
        comma-separated text; ``round-deadline`` as a duration (``30s``); empty text = None.

        Raises:
            ConfigError: as :meth:`from_json`, or a deadline that is not a duration.
        """
        data = {}
        for key, value in dict(run_config).items():
            name = key.replace("-", "_")
            if isinstance(value, str) and value.strip() == "":
                value = None
            if name == "round_deadline":
                name, value = "round_deadline_s", None if value is None else parse_seconds(value)
            elif name in ("speeds", "faults") and isinstance(value, str):
                items = [v for v in value.split(",") if v.strip()]
                value = tuple(float(v) for v in items) if name == "speeds" else tuple(items)
            if value is not None:
                data[name] = value
        return cls.from_json(data)

    def digest(self) -> str:
        """16 hex digits naming this configuration (clients cache their trainers under it)."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def parse_seconds(text) -> float:
    """Seconds of ``30``, ``"30s"``, ``"10m"`` or ``"1h"``.

    Raises:
        ConfigError: not a positive, finite duration.
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        units = {"s": 1.0, "m": 60.0, "h": 3600.0}
        t = str(text).strip().lower()
        scale = units.get(t[-1:])
        try:
            value = float(t[:-1] if scale else t) * (scale or 1.0)
        except ValueError:
            value = float("nan")
    if not 0 < value < math.inf:
        raise ConfigError(f"{text!r} is not a positive duration: use e.g. 30s, 2m or 1h")
    return value
