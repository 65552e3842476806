"""The ``etgraph`` command's entry point (console script and ``python -m etgraph``): checks that
the process may load etgraph's libraries before importing them, so that even that failure is one
line and not a traceback (or a native abort), then runs :func:`etgraph.cli.main`.
"""

from __future__ import annotations

import sys

from .errors import ResourceError
from .host import check_address_space

__all__ = ["main"]


def main() -> None:
    """Run the CLI; exit 1 with one line when the libraries cannot be loaded (an address-space
    limit below :data:`etgraph.host.MIN_ADDRESS_SPACE_BYTES`, or memory running out while
    importing them)."""
    try:
        check_address_space()  # below it torch's import aborts the process (no Python error)
        from .cli import main as run_cli
    except ResourceError as exc:
        sys.exit(f"etgraph: error: {exc}")
    except MemoryError:
        sys.exit(
            "etgraph: error: out of memory while loading etgraph's libraries (onnxruntime, torch, "
            "numpy): free memory or raise the limit (ulimit -v) and run again"
        )
    run_cli()
