"""Elastic clients in federated learning (issue 29): time to accuracy on a heterogeneous fleet.

Four strategies on the same split, seeds and fleet, each a run of ``etgraph federate``
(:func:`etgraph.federated.run.federate`: Flower's simulation engine, clients one at a time):

* **A** ``fedavg-full`` — FedAvg, every client trains every tensor, each round waits for the
  slowest client;
* **B** ``fedavg-drop`` — FedAvg under the round deadline: late clients are dropped;
* **C** ``elastic`` — every client trains the tensors that fit its budget under the deadline;
* **D** ``elastic-fedel`` — C with FedEL's window and global importance.

All times are **virtual**: each client's speed factor x its measured CPU time (one ORT thread),
a round as long as the slowest client the server waited for (:mod:`etgraph.federated.clock`).
Reported per strategy, mean ± std over seeds: time to reach A's final accuracy within 1 point
(and the speed-up over A), final accuracy, accuracy at B's total time, every client's round
time against the deadline (worst ratio; share within +5%), bytes uploaded per round, and
per-tensor coverage (mean share of examples whose client trained a tensor; input half vs
output half). Targets (issue 29): D >= 2x sooner than A at A's final accuracy, D above B at
equal time, every client round within the deadline +5%, uploads below A's.

Tasks (``--task``): ``digits`` (default) — the embedded default model and the digits
transfer task (or ``--model`` / ``--data``), batch 4, lr 1e-3; ``animals`` — issue 30's
pretrained vision task (``benchmarks/whole_run.py``'s :func:`animals_task`: ImageNet
MobileNetV2 with a fresh 10-class head at 96 px on ``--examples`` Animal-MNIST training images;
the held-out 20% is the server's test set), batch 16, lr 3e-4, written once under ``--out``.

Usage (keep it modest on a shared machine)::

    nice -n 5 python benchmarks/federated.py [--rounds 20] [--seeds 3] [--deadline 1.5]
    nice -n 5 python benchmarks/federated.py --task animals --examples 600 ...
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from etgraph.federated import FederateConfig  # noqa: E402
from etgraph.federated.plots import plot_accuracy  # noqa: E402
from etgraph.federated.run import federate  # noqa: E402
from etgraph.federated.rundir import LATE_TOLERANCE, read_log  # noqa: E402

#: ``--task``'s batch size and learning rate when not given.
TASK_DEFAULTS = {"digits": (4, 1e-3), "animals": (16, 3e-4)}

LETTERS = {"fedavg-full": "A", "fedavg-drop": "B", "elastic": "C", "elastic-fedel": "D"}


def time_to(records: list[dict], target: float) -> float:
    """Virtual time of the first round whose accuracy reaches ``target`` (inf: never)."""
    for r in records:
        if r["val_acc"] >= target:
            return r["virtual_time_s"]
    return math.inf


def acc_at(records: list[dict], t: float) -> float:
    """Accuracy of the last round ended by virtual time ``t`` (the initial model's before)."""
    acc = records[0].get("initial_val_acc", math.nan)
    for r in records:
        if r["virtual_time_s"] <= t + 1e-9:
            acc = r["val_acc"]
    return acc


def animals_files(work: Path, examples: int) -> tuple[str, str]:
    """The animals task's model and image folder in ``work`` (written once, reused)."""
    model, data = work / "animals.onnx", work / "animals"
    if not (model.is_file() and data.is_dir()):
        from benchmarks.whole_run import animals_task

        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        model, data = animals_task(work, examples)
    return str(model), str(data)


def ms(values) -> str:
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=float)
    if v.size == 0:
        return "never"
    return f"{v.mean():.3g} ± {v.std():.2g}" if v.size > 1 else f"{v.mean():.3g}"


@click.command()
@click.option("--rounds", default=20, show_default=True, help="Rounds of A and B.")
@click.option(
    "--elastic-rounds",
    default=None,
    type=int,
    help="Rounds of C and D [--rounds]: their rounds are shorter, so the same count ends them "
    "earlier in virtual time than A; give them enough to reach A's accuracy.",
)
@click.option("--seeds", default=3, show_default=True)
@click.option("--clients", default=8, show_default=True)
@click.option("--speeds", default="1,1,2,2,4,4,8,8", show_default=True)
@click.option("--partition", default="dirichlet:0.5", show_default=True)
@click.option("--deadline", default=1.5, show_default=True, help="Round deadline, virtual s.")
@click.option("--local-epochs", default=1, show_default=True)
@click.option(
    "--task",
    type=click.Choice(sorted(TASK_DEFAULTS)),
    default="digits",
    show_default=True,
    help="digits: --model on --data; animals: the pretrained MobileNetV2 task (module doc).",
)
@click.option("--examples", default=600, show_default=True, help="animals: training images.")
@click.option("--batch-size", default=None, type=int, help="[digits 4, animals 16]")
@click.option("--lr", default=None, type=float, help="AdamW's [digits 1e-3, animals 3e-4]")
@click.option("--model", default=None, help="digits: ONNX file or compiled dir [the default].")
@click.option("--data", default=None, help="digits: data spec [digits].")
@click.option("--strategies", default="fedavg-full,fedavg-drop,elastic,elastic-fedel")
@click.option("--out", default="/tmp/etgraph-federated-bench", show_default=True)
@click.option("--json", "json_path", default=None, help="Write the results here.")
@click.option("--plot", default=None, help="Accuracy vs virtual time of every run (PNG).")
@click.option("--reuse", is_flag=True, help="Read runs already in --out instead of running.")
def main(
    rounds,
    elastic_rounds,
    seeds,
    clients,
    speeds,
    partition,
    deadline,
    local_epochs,
    task,
    examples,
    batch_size,
    lr,
    model,
    data,
    strategies,
    out,
    json_path,
    plot,
    reuse,
):
    strategies = [s for s in strategies.split(",") if s]
    speeds = tuple(float(s) for s in speeds.split(","))
    runs: dict[str, list[list[dict]]] = {s: [] for s in strategies}
    root = Path(out)
    batch_size = batch_size or TASK_DEFAULTS[task][0]
    lr = lr or TASK_DEFAULTS[task][1]
    if task == "animals":
        model, data = animals_files(root / f"animals{examples}", examples)
    for seed in range(seeds):
        for strategy in strategies:
            run_dir = root / f"{strategy}-seed{seed}"
            if not (reuse and (run_dir / "summary.json").exists()):
                shutil.rmtree(run_dir, ignore_errors=True)
                config = FederateConfig(
                    model=model,
                    data=data,
                    clients=clients,
                    rounds=elastic_rounds
                    if elastic_rounds and strategy.startswith("elastic")
                    else rounds,
                    round_deadline_s=deadline,
                    speeds=speeds,
                    partition=partition,
                    strategy=strategy,
                    local_epochs=local_epochs,
                    batch_size=batch_size,
                    learning_rate=lr,
                    seed=seed,
                )
                t0 = time.time()
                summary = federate(config, run_dir)
                print(
                    f"seed {seed} {strategy:>13}: acc {summary['final_val_acc']:.3f} at "
                    f"{summary['virtual_time_s']:.1f} virtual s ({time.time() - t0:.0f} s wall)",
                    flush=True,
                )
            runs[strategy].append(read_log(run_dir))
    rows, results = [], {}
    base = runs.get("fedavg-full")
    b_time = (
        [r[-1]["virtual_time_s"] for r in runs["fedavg-drop"]] if "fedavg-drop" in runs else None
    )
    for strategy, seeds_records in runs.items():
        ttas, speedups, finals, at_b, worst, within, upload, front, back = ([] for _ in range(9))
        for i, records in enumerate(seeds_records):
            finals.append(records[-1]["val_acc"])
            if base is not None:
                target = base[i][-1]["val_acc"] - 0.01
                t = time_to(records, target)
                ttas.append(t)
                speedups.append(time_to(base[i], target) / t if math.isfinite(t) else 0.0)
            if b_time is not None:
                at_b.append(acc_at(records, b_time[i]))
            entries = [c for r in records for c in r["clients"]]
            ratios = [
                c["round_time_s"] / deadline for c in entries if math.isfinite(c["round_time_s"])
            ]
            worst.append(max(ratios))
            within.append(float(np.mean([x <= 1 + LATE_TOLERANCE for x in ratios])))
            upload.append(sum(c["upload_bytes"] for c in entries) / len(records))
            cover = np.mean([r["coverage"] for r in records], axis=0)
            half = len(cover) // 2
            front.append(float(cover[:half].mean()))
            back.append(float(cover[half:].mean()))
        results[strategy] = dict(
            time_to_target_s=ttas,
            speedup_vs_a=speedups,
            final_acc=finals,
            acc_at_b_time=at_b,
            worst_deadline_ratio=worst,
            within_deadline=within,
            upload_bytes_per_round=upload,
            coverage_input_half=front,
            coverage_output_half=back,
        )
        rows.append(
            [
                f"{LETTERS.get(strategy, '?')} {strategy}",
                ms(ttas),
                ms(speedups),
                ms(finals),
                ms(at_b),
                ms(worst),
                ms(within),
                ms([u / 1e6 for u in upload]),
                f"{ms(front)} / {ms(back)}",
            ]
        )
    head = [
        "strategy",
        "t to A-1pt (s)",
        "speed-up vs A",
        "final acc",
        "acc at B's t",
        "worst t/deadline",
        "within +5%",
        "MB up/round",
        "coverage in/out half",
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    print(
        f"\n{task} task, {clients} clients, speeds {speeds}, {partition}, batch {batch_size}, "
        f"lr {lr:g}, {local_epochs} local epochs, deadline {deadline} s (virtual), "
        f"{rounds} rounds (C, D: {elastic_rounds or rounds}), {seeds} seeds; times virtual "
        "(speed x measured CPU time)"
    )
    for row in [head, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))
    print(
        "\nclient round time / deadline by speed factor (mean, max over rounds and seeds; ok = "
        "share of client rounds aggregated)"
    )
    by_speed_rows = []
    for strategy, seeds_records in runs.items():
        entries = [c for records in seeds_records for r in records for c in r["clients"]]
        cells = []
        for s in sorted({c["speed"] for c in entries if c["speed"] is not None}):
            mine = [c for c in entries if c["speed"] == s]
            ratios = [c["round_time_s"] / deadline for c in mine]
            ok = np.mean([c["status"] == "ok" for c in mine])
            cells.append(f"s={s:g}: {np.mean(ratios):.2f}/{max(ratios):.2f} ok {ok:.0%}")
            results[strategy].setdefault("by_speed", {})[str(s)] = dict(
                mean_ratio=float(np.mean(ratios)), max_ratio=float(max(ratios)), ok=float(ok)
            )
        by_speed_rows.append(f"{LETTERS.get(strategy, '?')} {strategy:<14}" + "  ".join(cells))
    print("\n".join(by_speed_rows))
    if json_path:
        Path(json_path).write_text(
            json.dumps(
                {
                    "settings": dict(
                        rounds=rounds,
                        elastic_rounds=elastic_rounds or rounds,
                        seeds=seeds,
                        clients=clients,
                        speeds=speeds,
                        partition=partition,
                        deadline_s=deadline,
                        local_epochs=local_epochs,
                        task=task,
                        examples=examples if task == "animals" else None,
                        batch_size=batch_size,
                        lr=lr,
                        model=model,
                        data=data,
                    ),
                    "results": results,
                },
                indent=1,
            )
        )
    if plot:
        plot_accuracy({f"{LETTERS.get(k, '?')} {k}": v for k, v in runs.items()}, Path(plot))


if __name__ == "__main__":
    main()
