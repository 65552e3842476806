"""Do elastic clients end their rounds within the deadline? Many rounds, quickly (issue 29).

    python benchmarks/round_deadline.py [--rounds 60] [--deadline 2.0] [--speeds 1,2,4,8]
                                        [--strategy elastic] [--local-epochs 2] [--seed 0]
                                        [--durable-end]

``benchmarks/federated.py`` answers it on whole Flower runs: 1-2 of 720 client rounds per
strategy (3 seeds) ended late. This drives the same clients (:class:`etgraph.federated.client.
FederatedClient`: the digits task, Dirichlet 0.5 over 8 partitions, batch 4, lr 1e-3, the
virtual clock of thread CPU time) in this process, one round after another, without Flower or
a server: each client starts every round from the weights it uploaded in its last one (its own
model, so the selection moves as in a run). Per speed factor: client rounds, how many ended
after the deadline + 5% (the issue's target), the worst and median round time over the
deadline, and for each late round the steps it took of those planned.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from etgraph.federated.client import FederatedClient  # noqa: E402
from etgraph.federated.config import FederateConfig  # noqa: E402
from etgraph.federated.rundir import LATE_TOLERANCE  # noqa: E402

#: A round is late above this multiple of the deadline, as the server counts it.
LATE = 1 + LATE_TOLERANCE


@click.command()
@click.option("--rounds", default=60, show_default=True, help="rounds per client")
@click.option("--deadline", default=2.0, show_default=True, help="virtual s")
@click.option("--speeds", default="1,2,4,8", show_default=True)
@click.option("--strategy", default="elastic", show_default=True)
@click.option("--local-epochs", default=2, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--durable-end",
    is_flag=True,
    help="save the clients' period ends as a run directory's (fsync, digest, previous "
    "version), as before session 20",
)
def main(rounds, deadline, speeds, strategy, local_epochs, seed, durable_end):
    speeds = [float(s) for s in speeds.split(",")]
    if durable_end:
        import etgraph.sessions as sessions

        target = sessions.checkpoint_target
        sessions.checkpoint_target = lambda path, durable=True: target(path, durable=True)
    config = FederateConfig(
        clients=8,
        rounds=rounds,
        round_deadline_s=deadline,
        speeds=tuple(speeds),
        strategy=strategy,
        local_epochs=local_epochs,
        seed=seed,
    ).validate()
    t0 = time.perf_counter()
    rows = []
    for k, speed in enumerate(speeds):
        client = FederatedClient(config, k, speed)
        weights = client.trainer.get_weights()
        late, ratios = [], []
        for r in range(1, rounds + 1):
            result = client.train_round(r, weights)
            weights = {**weights, **result.upload}
            m = result.metrics
            ratio = m["round-time-s"] / deadline
            ratios.append(ratio)
            if ratio > LATE:
                late.append((r, ratio, m["steps"], m["steps-planned"]))
        client.close()
        rows.append((speed, ratios, late))
        print(
            f"s = {speed:g}: {len(late)} of {rounds} late, worst {max(ratios):.3f}x, median "
            f"{np.median(ratios):.3f}x"
            + "".join(f"\n  round {r}: {x:.3f}x, {s} of {p} steps" for r, x, s, p in late),
            flush=True,
        )
    n = sum(len(r[1]) for r in rows)
    n_late = sum(len(r[2]) for r in rows)
    print(
        f"\n{strategy}, deadline {deadline:g} virtual s, {local_epochs} local epochs, seed {seed}"
        f"{', durable period ends' if durable_end else ''}: "
        f"{n_late} of {n} client rounds after the deadline + 5% "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    print("| speed | rounds | late | worst / deadline | median / deadline |")
    print("|---|---|---|---|---|")
    for speed, ratios, late in rows:
        print(
            f"| {speed:g} | {len(ratios)} | {len(late)} | {max(ratios):.3f} | "
            f"{np.median(ratios):.3f} |"
        )


if __name__ == "__main__":
    main()
