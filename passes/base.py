"""The pass contract, shared by the ONNX-level passes and the tensor-graph passes.

Every pass of etgraph is an ``onnx_ir.passes.PassBase`` (onnx/ir-py's pass infrastructure, after
torch.fx's): ``__call__`` runs ``requires(model)`` (precondition), ``call(model) ->
PassResult(model, modified)`` and ``ensures(model)`` (postcondition), raising
``PreconditionError`` / ``PostconditionError`` when a check fails. ``modified`` is True only when
the pass changed something (a second run of a pass on its own output reports False). A
``PassManager`` is itself a pass. The ONNX-level passes work on an ``onnx_ir.Model``; the
tensor-graph passes subclass the same classes and work on the ``networkx.DiGraph`` of
:mod:`passes.layout` (PassBase's ``__call__`` does not depend on the type):

* :class:`TensorGraphPass` — an in-place pass over the tensor graph (logs its wall time);
* :class:`ChargingPass` — the one "charge every uncharged op" loop: a subclass only decides the
  charge of one op (:meth:`ChargingPass.decide`); it requires a linearised graph and ensures
  that every charge it leaves is well formed.

A failed precondition or postcondition is a bug in etgraph, not the user's fault: it is not an
:class:`~etgraph.errors.EtgraphError`, so the CLI reports it as an internal error (exit 3).
A pass that finds a *user* error (an op without a gradient, a model with no weights) raises an
``EtgraphError`` from ``call``; onnx_ir's managers wrap whatever a pass raises in ``PassError``,
so pipelines are run through :func:`run_passes`, which hands the user error back as itself.
"""

from __future__ import annotations

import abc
import logging
import re
import time
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import networkx as nx
from onnx_ir.passes import (
    InPlacePass,
    PassBase,
    PassManager,
    PassResult,
    PostconditionError,
    PreconditionError,
)

from etgraph.errors import EtgraphError

from .layout import (
    charge_problems,
    linearized_problems,
    missing_attributes,
    set_charge,
    uncharged,
)

__all__ = [
    "ChargeDecision",
    "ChargingPass",
    "TensorGraphPass",
    "describe_pipeline",
    "run_passes",
    "user_error_in",
]

log = logging.getLogger(__name__)

M = TypeVar("M")
C = TypeVar("C")


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


# ---- tensor-graph passes ----


class TensorGraphPass(InPlacePass):
    """An in-place pass over the tensor graph (a ``networkx.DiGraph``, layout in
    :mod:`passes.layout`): ``pass_(graph) -> PassResult(graph, modified)``.

    Subclasses set :attr:`name` (recorded as ``rule`` on the ops they charge) and implement
    ``call``; ``requires``/``ensures`` raise ``PreconditionError``/``PostconditionError``.
    """

    name: ClassVar[str]

    def __call__(self, graph: nx.DiGraph | PassResult, /) -> PassResult:
        start_s = time.perf_counter()
        result = super().__call__(graph)
        log.debug(
            "pass %s: modified=%s in %.3f s",
            self.name,
            result.modified,
            time.perf_counter() - start_s,
        )
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(frozen=True)
class ChargeDecision:
    """Where a charging pass puts one op (the arguments of :func:`passes.layout.set_charge`).

    Attributes:
        kind: ``dw``, ``dy``, ``split``, ``forward`` or ``loss``.
        tensor: tensor name receiving the whole op (``dw``/``dy``), else None.
        dy_tensor: for ``split``, the tensor receiving the input-gradient part (None when the op
            computes no input gradient).
        dw_tensors: for ``split``, the tensors receiving the weight/bias parts.
    """

    kind: str
    tensor: str | None = None
    dy_tensor: str | None = None
    dw_tensors: tuple[str, ...] = ()


class ChargingPass(TensorGraphPass, Generic[C]):
    """The shared charging loop: visit every op that no earlier pass charged, in graph order,
    and charge it where :meth:`decide` says (never re-charging a charged op).

    Requires: a linearised graph (:func:`passes.layout.linearized_problems` finds nothing:
    ``tensor_order`` and the D(o) summary on every backward op), and the attributes a subclass
    names in :attr:`tensor_attributes` / :attr:`op_attributes` on every tensor / op node.

    Ensures: every charge in the graph is well formed (:func:`passes.layout.charge_problems`);
    subclasses add what they promise to have charged.

    ``modified`` is True when the pass charged at least one op.
    """

    #: Node attributes :meth:`decide` reads, checked by :meth:`requires`.
    tensor_attributes: ClassVar[tuple[str, ...]] = ()
    op_attributes: ClassVar[tuple[str, ...]] = ()

    def requires(self, graph: nx.DiGraph) -> None:
        problems = linearized_problems(graph)
        if problems:
            raise PreconditionError(
                f"pass {self.name}: the graph is not linearised (run LinearizePass first): "
                + "; ".join(problems)
            )
        problems = missing_attributes(graph, "tensor", self.tensor_attributes)
        problems += missing_attributes(graph, "op", self.op_attributes)
        if problems:
            raise PreconditionError(f"pass {self.name}: " + "; ".join(problems))

    def prepare(self, graph: nx.DiGraph) -> C:
        """Lookup tables :meth:`decide` needs, built once per run (default None)."""
        return None  # type: ignore[return-value]

    @abc.abstractmethod
    def decide(self, graph: nx.DiGraph, op: str, context: C) -> ChargeDecision | None:
        """The charge of uncharged op node ``op``, or None to leave it to a later pass."""

    def call(self, graph: nx.DiGraph) -> PassResult:
        context = self.prepare(graph)
        modified = False
        for op in uncharged(graph):
            decision = self.decide(graph, op, context)
            if decision is None:
                continue
            set_charge(
                graph,
                op,
                decision.kind,
                self.name,
                decision.tensor,
                dy_tensor=decision.dy_tensor,
                dw_tensors=decision.dw_tensors,
            )
            modified = True
        return PassResult(graph, modified)

    def ensures(self, graph: nx.DiGraph) -> None:
        problems = charge_problems(graph)
        if problems:
            raise PostconditionError(f"pass {self.name}: malformed charges: {'; '.join(problems)}")


def _plain(text: str) -> str:
    """reST markup as plain text: ``:role:`~a.b.name``` -> ``name``, double backticks -> one."""
    text = re.sub(r":\w+:`~?([^`<]*?)(?: <[^>]*>)?`", lambda m: m.group(1).split(".")[-1], text)
    return text.replace("``", "`")


def describe_pipeline(pipeline: PassBase, indent: str = "") -> list[str]:
    """One line per pass of ``pipeline`` in order, nested managers indented: ``"<i>. <class
    name>: <first paragraph of its docstring on one line>"``. For ``etgraph inspect --passes``
    and the README."""
    lines = []
    for i, p in enumerate(getattr(pipeline, "passes", (pipeline,)), 1):
        if isinstance(p, PassManager):
            lines.append(f"{indent}{i}. {type(p).__name__}")
            lines.extend(describe_pipeline(p, indent + "   "))
            continue
        doc = (type(p).__doc__ or "").strip().split("\n\n")[0]
        summary = _plain(" ".join(doc.split()))
        lines.append(f"{indent}{i}. {type(p).__name__}" + (f": {summary}" if summary else ""))
    return lines
