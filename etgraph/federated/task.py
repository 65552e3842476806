"""The federated task every process of a run loads alike (server, clients): the model, its
profile on this machine, the task's data and its split among clients.

Loaded once per process and kept (:func:`load_task`): the simulation runs every client of a
run in the same Ray worker process, one at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import TrainConfig, load_run_data
from ..data import ArrayDataset, Dataset
from ..model import LoadedModel
from ..profile import Profile
from .config import FederateConfig
from .partition import partition

__all__ = ["CLIENT_THREADS", "Task", "load_task"]

#: ONNX Runtime intra-op threads of every federated session: one, so a client's CPU time is
#: its work (:mod:`etgraph.federated.clock`) and one emulated device is one core.
CLIENT_THREADS = 1


@dataclass
class Task:
    """What a federated run trains.

    Attributes:
        model: the loaded model. profile: its profile on this machine at
            :data:`CLIENT_THREADS` threads (cached on disk).
        dataset: the task's data: its training split is divided among the clients, its
            validation split is the server's test set.
        train_config: the clients' training settings (rho and strategy set per round).
        parts: the training examples of each client (indices into ``dataset.train_index``).
    """

    model: LoadedModel
    profile: Profile
    dataset: Dataset | ArrayDataset
    train_config: TrainConfig
    parts: list[np.ndarray]

    def client_data(self, partition_id: int) -> Dataset | ArrayDataset:
        """Client ``partition_id``'s training examples (no validation split: the server
        evaluates)."""
        ds = self.dataset
        index = ds.train_index[self.parts[partition_id]]
        return dataclasses.replace(ds, train_index=index, val_index=index[:0])

    def test_data(self) -> Dataset | ArrayDataset:
        """The server's test set (the validation split) with a token training part (the
        evaluating trainer trains nothing)."""
        ds = self.dataset
        return dataclasses.replace(ds, train_index=ds.train_index[: self.train_config.batch_size])


def load_task(config: FederateConfig) -> Task:
    """The task of ``config`` (cached per process).

    Raises:
        ModelError, DataError, ConfigError: the model or data cannot be used; a client would
            get fewer examples than two batches.
    """
    return _load(json.dumps(config.to_json(), sort_keys=True))


@functools.lru_cache(maxsize=4)
def _load(key: str) -> Task:
    from ..api import load_model, profile_model

    cfg = FederateConfig.from_json(json.loads(key))
    source = Path(cfg.model) if cfg.model else None
    base = dict(
        batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        seed=cfg.seed,
        data=cfg.data,
        tokenizer=cfg.tokenizer,
        epochs=cfg.rounds * cfg.local_epochs,
        period=1,
        threads=CLIENT_THREADS,
        spinning="off",  # one thread: nothing to spin
        closed_loop=False,  # the client plans its round from its own measurements
    )
    if source is not None and source.is_dir():  # a compiled directory
        from ..plan import Plan

        plan = Plan.load(source)
        model = plan.model
        base.update(
            preprocess=plan.preprocess,
            frozen_bn=plan.frozen_bn,
            head_lr_scale=model.head_lr_scale,  # as compiled (--head-lr-scale)
        )
        base["data"] = cfg.data or plan.data
        base["tokenizer"] = cfg.tokenizer or plan.tokenizer
        shapes = plan.input_shapes
    else:
        model = load_model(source)
        shapes = None
    train_config = TrainConfig(**base).validate()
    profile = profile_model(
        model, batch_size=cfg.batch_size, input_shape=shapes, threads=CLIENT_THREADS
    )
    dataset = load_run_data(train_config, model, model.input_shapes(profile.input_shapes))
    labels = dataset.labels[dataset.train_index]
    parts = partition(
        labels, cfg.clients, cfg.partition, seed=cfg.seed, min_examples=2 * cfg.batch_size
    )
    return Task(model, profile, dataset, train_config, parts)
