"""``etgraph federate``: the command (kept here; :mod:`etgraph.cli` adds it). Thin: parse,
call :func:`etgraph.federated.run.federate`, print."""

from __future__ import annotations

import logging
import sys

import click

from ..cli_options import (
    FRACTION,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    tokenizer_option,
)
from ..errors import ConfigError
from ..files import require_model_path
from .config import STRATEGIES, FederateConfig, parse_seconds

__all__ = ["federate_command", "format_summary"]


def format_summary(summary: dict, out) -> str:
    """The lines ``etgraph federate`` prints at the end."""
    lines = [
        f"strategy {summary['strategy']}: {summary['rounds']} rounds, global accuracy "
        f"{summary['final_val_acc']:.3f} (best {summary['best_val_acc']:.3f}) after "
        f"{summary['virtual_time_s']:.1f} s of virtual time "
        f"(mean round {summary['mean_round_time_s']:.2f} s)",
        f"uploads: {summary['upload_bytes_per_round'] / 1e6:.2f} MB per round; clients "
        f"{', '.join(f'{k} {v}' for k, v in sorted(summary['status_counts'].items()))}",
    ]
    if summary.get("deadline_s"):
        lines.append(
            f"deadline {summary['deadline_s']:g} s: worst client round "
            f"{summary['worst_deadline_ratio']:.2f}x of it, "
            f"{100 * summary['within_deadline']:.0f}% within +5%"
        )
    lines.append(f"run directory: {out} (times are virtual: speed factor x measured time)")
    return "\n".join(lines)


def _round_line(record: dict) -> str:
    counts: dict[str, int] = {}
    for c in record["clients"]:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    status = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    failed = [  # Flower's own logs of it (tracebacks) show with --verbose only
        f"\n  client {c['client']} failed: {c.get('reason', 'unknown')}"
        for c in record["clients"]
        if c["status"] == "failed"
    ]
    return (
        f"round {record['round']:>3}: acc {record['val_acc']:.3f}  virtual "
        f"{record['virtual_time_s']:.1f} s (+{record['round_time_s']:.2f})  clients {status}"
        + "".join(failed)
    )


def _new_run_config(model, opts: dict) -> FederateConfig:
    """The configuration of a new run from the command line, checked before Flower is
    imported (:meth:`FederateConfig.validate`).

    Raises:
        ConfigError: no ``--out``, malformed ``--speeds``, ``--round-deadline`` with
            ``fedavg-full`` (it waits for every client: the option would be ignored), or a
            setting :meth:`FederateConfig.validate` refuses.
    """
    if opts["out"] is None:
        raise ConfigError("missing --out RUN: where to write the log, checkpoints and model")
    try:
        speeds = tuple(float(s) for s in opts["speeds"].split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--speeds {opts['speeds']!r}: use factors like 1,2,4,8") from None
    deadline = opts["round_deadline"]
    if opts["strategy"] == "fedavg-full" and deadline is not None:
        raise ConfigError(
            "--strategy fedavg-full waits for every client: drop --round-deadline, or use "
            "--strategy fedavg-drop to drop the clients that miss it"
        )
    return FederateConfig(
        model=model,
        data=opts["data"],
        tokenizer=opts["tokenizer"],
        clients=opts["clients"],
        rounds=opts["rounds"],
        round_deadline_s=parse_seconds(deadline) if deadline is not None else None,
        speeds=speeds,
        partition=opts["partition"],
        strategy=opts["strategy"],
        local_epochs=opts["local_epochs"],
        batch_size=opts["batch_size"],
        learning_rate=opts["lr"],
        seed=opts["seed"],
        clock=opts["clock"],
        window=opts["window"],
        global_importance=opts["global_importance"],
        faults=tuple(opts["faults"]),
    ).validate()


@click.command("federate")
@click.argument("model", required=False, type=click.Path())
@click.option("--data", default=None, help="Dataset spec, as etgraph train's [digits].")
@tokenizer_option
@click.option(
    "--clients", default=8, show_default=True, type=POSITIVE_INT, help="Flower SuperNodes."
)
@click.option(
    "--rounds", default=20, show_default=True, type=POSITIVE_INT, help="Federated rounds."
)
@click.option(
    "--round-deadline",
    default=None,
    help="Every round's deadline in each client's own virtual clock (30s, 2m).",
)
@click.option(
    "--speeds",
    default="1",
    show_default=True,
    help="Speed factors, comma-separated (client k gets the (k mod n)-th; 8 = 8x slower).",
)
@click.option(
    "--partition", default="dirichlet:0.5", show_default=True, help="iid or dirichlet:ALPHA."
)
@click.option(
    "--strategy",
    default="elastic",
    show_default=True,
    type=click.Choice(STRATEGIES),
    help="fedavg-full waits for the slowest; fedavg-drop drops late clients; elastic clients "
    "train what fits the deadline; elastic-fedel adds FedEL's window and global importance.",
)
@click.option("--local-epochs", default=1, show_default=True, type=POSITIVE_INT, help="Per round.")
@click.option("--batch-size", default=4, show_default=True, type=POSITIVE_INT)
@click.option("--lr", default=1e-3, show_default=True, type=POSITIVE, help="Client AdamW lr.")
@click.option(
    "--seed", default=0, show_default=True, type=NON_NEGATIVE_INT, help="Split, order, probes."
)
@click.option(
    "--clock",
    default="cpu",
    show_default=True,
    type=click.Choice(["cpu", "wall"]),
    help="What a client measures (cpu: robust on a shared machine).",
)
@click.option(
    "--window", default=None, type=FRACTION, help="FedEL window, share of tensors (0 off)."
)
@click.option(
    "--global-importance", default=None, type=FRACTION, help="Weight of the server's importance."
)
@click.option(
    "--fault",
    "faults",
    multiple=True,
    help="Make a client fail, for testing a fleet: ID:KIND:ROUND, KIND crash, hang or late "
    "(repeatable).",
)
@click.option("-o", "--out", "out", default=None, type=click.Path(), help="Run directory.")
@click.option("--resume", "resume_dir", default=None, type=click.Path(), help="Continue a run.")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines (results and errors only).")
@click.option("-v", "--verbose", is_flag=True, help="Show Flower's and Ray's logs too.")
def federate_command(model, **opts):
    """Federated learning on Flower's simulation engine: --clients devices of --speeds train
    MODEL (an ONNX file, a compiled directory, or the embedded default model and digits) for
    --rounds rounds, each within --round-deadline in its own clock (needs the fl extra)."""
    config = _new_run_config(model, opts) if opts["resume_dir"] is None else None
    if config is not None and config.model is not None:
        require_model_path(config.model, directory_ok=True)  # before the imports (seconds)
    try:
        from .run import federate
    except ImportError as exc:
        raise ConfigError(
            f"etgraph federate needs Flower ({exc.name} is missing): pip install 'etgraph[fl]' "
            "(Python >= 3.11)"
        ) from None
    progress = None if opts["quiet"] else (lambda r: click.echo(_round_line(r), err=True))
    if opts["verbose"]:
        logging.getLogger().setLevel(logging.INFO)
    if opts["resume_dir"] is not None:
        out = opts["resume_dir"]
        summary = federate(None, out, resume=True, on_round=progress, verbose=opts["verbose"])
        click.echo(format_summary(summary, out))
        return
    summary = federate(config, opts["out"], on_round=progress, verbose=opts["verbose"])
    click.echo(format_summary(summary, opts["out"]))
    sys.stdout.flush()
