"""The ``etgraph`` command line: thin click commands over the Python API.

Every user error is an :class:`~etgraph.errors.EtgraphError`; :func:`main` prints it as one line
``etgraph: error: ...`` on stderr and exits 1. ``--debug`` shows tracebacks of everything.
"""

from __future__ import annotations

import logging
import sys

import click

from . import __version__
from .errors import EtgraphError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="etgraph")
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.option("-v", "--verbose", is_flag=True, help="Show progress logs.")
@click.pass_context
def cli(ctx: click.Context, debug: bool, verbose: bool) -> None:
    """Make on-device training fast: select the tensors worth training (ElasticTrainer)."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the CLI, turning EtgraphError into one line and exit 1."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        cli.main(args=args, prog_name="etgraph", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("etgraph: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except EtgraphError as exc:
        if debug:
            raise
        click.echo(f"etgraph: error: {exc}", err=True)
        sys.exit(1)


# ---- commands: each parses options, calls the Python API, prints. Keep them thin. ----

# [inspect]

# [profile]

# [compile]

# [train]
