"""The pass contract, shared by the ONNX-level passes and the tensor-graph passes.

Every pass of etgraph is an ``onnx_ir.passes.PassBase`` (onnx/ir-py's pass infrastructure, after
torch.fx's): ``__call__`` runs ``requires(model)`` (precondition), ``call(model) ->
PassResult(model, modified)`` and ``ensures(model)`` (postcondition), raising
``PreconditionError`` / ``PostconditionError`` when a check fails. ``modified`` is True only when
the pass changed something. A ``PassManager`` is itself a pass. The ONNX-level passes work on an
``onnx_ir.Model``; the tensor-graph passes subclass the same classes and work on the
``networkx.DiGraph`` of :mod:`passes` (PassBase's ``__call__`` does not depend on the type).

A failed precondition or postcondition is a bug in etgraph, not the user's fault: it is not an
:class:`~etgraph.errors.EtgraphError`, so the CLI reports it as an internal error (exit 3).
A pass that finds a *user* error (an op without a gradient, a model with no weights) raises an
``EtgraphError`` from ``call``; onnx_ir's managers wrap whatever a pass raises in ``PassError``,
so pipelines are run through :func:`run_passes`, which hands the user error back as itself.
"""

from __future__ import annotations

from typing import TypeVar

from onnx_ir.passes import PassBase, PassResult

from etgraph.errors import EtgraphError

__all__ = ["run_passes", "user_error_in"]

M = TypeVar("M")


def user_error_in(exc: BaseException) -> EtgraphError | None:
    """The first :class:`EtgraphError` in ``exc`` and its chain of causes, or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, EtgraphError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def run_passes(pipeline: PassBase, model: M) -> PassResult:
    """Run ``pipeline`` (a pass or a ``PassManager``) on ``model``.

    Returns:
        The pipeline's ``PassResult`` (``.model``, ``.modified``).

    Raises:
        EtgraphError: a pass found a user error (the original error, not onnx_ir's wrapper).
        onnx_ir.passes.PreconditionError, PostconditionError, PassError: a bug in a pass.
    """
    try:
        return pipeline(model)
    except EtgraphError:
        raise
    except Exception as exc:
        user = user_error_in(exc)
        if user is not None:
            raise user from None
        raise
