"""Elastic clients in federated learning on Flower (issue 29).

A fleet of devices of different speeds trains one model; in every round each client trains
the tensors that matter most within its own time budget (ElasticTrainer's DP under the
round's deadline, in its own clock), and the server averages every tensor over the clients
that trained it.

* :mod:`.config` — :class:`FederateConfig`, the run's settings and strategies;
* :mod:`.partition` — iid and Dirichlet label-skew splits;
* :mod:`.clock` — the virtual clock (speed factor x measured time) and the round plan;
* :mod:`.fedel` — FedEL's window and global importance;
* :mod:`.aggregate` — per-tensor aggregation, BatchNorm statistics pooled;
* :mod:`.client` — the elastic client and its ``ClientApp``;
* :mod:`.server` — the ``Strategy``, the round loop (checkpoints, resume) and the ``ServerApp``;
* :mod:`.run` — ``etgraph federate``: the simulation engine; :mod:`.rundir`, :mod:`.plots`.

Needs the ``fl`` extra (``pip install 'etgraph[fl]'``: flwr[simulation] 1.41.0, Python >= 3.11);
the pure modules (config, partition, clock, fedel, aggregate) do not import flwr.
"""

from .config import FederateConfig

__all__ = ["FederateConfig"]
