"""The tensor-level backward graph (paper §5; DESIGN: TensorGraph).

* :func:`build_tensor_graph` — ORT's training graph (all tensors trainable) as a networkx DiGraph
  of tensor nodes (the trainable tensors of :func:`etgraph.model.trainable_tensors`, forward
  order) and op nodes, charged by the tensor-graph pipeline (:func:`passes.tensor_graph_pipeline`)
  so that every backward op lands on exactly one tensor's ``t_dw`` or ``t_dy`` (or on forward /
  loss).
* :func:`charges`, :func:`tensor_table`, :func:`coverage` — what the profiler and the CLI read
  from it.
* :func:`load_tensor_graph`, :func:`format_tensor_table` — what ``etgraph inspect`` shows.

Dumps (JSON, GraphML, DOT) are in :mod:`etgraph.dumps`; the graph layout (node ids, attributes,
edge kinds) is documented in :mod:`passes.layout`.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import onnx

from passes import tensor_graph_pipeline
from passes.base import run_passes
from passes.layout import CHARGE_KINDS, op_id, op_nodes, tensor_id, tensor_nodes
from passes.onnx import head_lr_of

from . import model as model_spec
from .artifacts import ArtifactCache, generate
from .dumps import read_graph
from .errors import ConfigError, ModelError
from .files import private_temp_dir, require_model_path
from .io_specs import input_specs, removed_head
from .onnx_io import model_hash
from .ops import op_rule

__all__ = [
    "TABLE_COLUMNS",
    "TENSOR_KINDS",
    "Charge",
    "build_tensor_graph",
    "charges",
    "coverage",
    "format_tensor_table",
    "load_tensor_graph",
    "node_roles",
    "tensor_table",
]

log = logging.getLogger(__name__)

TENSOR_KINDS = ("kernel", "bias", "gamma", "beta", "embedding")

# ---- the tensor graph ----


def node_roles(training: onnx.ModelProto, forward_names: set[str], output_name: str) -> list[str]:
    """Role of every node of the training graph: forward, loss, accumulate or backward.

    forward: the node is an ancestor of the model's output ``output_name`` (or keeps a forward
    node's name);
    loss: an ancestor of the loss output (training graph output 0) that is not forward;
    accumulate: registry family ``accumulate`` (ORT's per-parameter gradient accumulators);
    backward: everything else (gradient ops, including ORT's early Shape/Size helpers).
    """
    nodes = training.graph.node
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}

    def ancestors(value: str) -> set[int]:
        out: set[int] = set()
        stack = [producer[value]] if value in producer else []
        while stack:
            i = stack.pop()
            if i in out:
                continue
            out.add(i)
            stack.extend(producer[v] for v in nodes[i].input if v in producer)
        return out

    forward = ancestors(output_name) | {i for i, n in enumerate(nodes) if n.name in forward_names}
    loss = ancestors(training.graph.output[0].name) - forward
    roles = []
    for i, node in enumerate(nodes):
        if i in forward:
            roles.append("forward")
        elif i in loss:
            roles.append("loss")
        elif op_rule(node.op_type).family == "accumulate":
            roles.append("accumulate")
        else:
            roles.append("backward")
    return roles


def _training_model(
    model: onnx.ModelProto,
    tensors: list[model_spec.TensorInfo],
    training_model: onnx.ModelProto | str | os.PathLike | None,
    cache: ArtifactCache | None,
    loss: str,
) -> onnx.ModelProto:
    """ORT's all-trainable training graph of ``model``: given, or generated (through ``cache``
    when given, else in a temporary directory)."""
    if isinstance(training_model, onnx.ModelProto):
        return training_model
    if training_model is not None:
        return onnx.load(str(training_model))
    requires_grad = [t.name for t in tensors]
    frozen = model_spec.running_statistics(model)
    if cache is not None:
        paths, hit = cache.get(model, requires_grad, frozen, loss=loss)
        log.debug("all-trainable artifacts in %s (cache hit: %s)", paths.directory, hit)
        return onnx.load(str(paths.training_model))
    with private_temp_dir("graph") as tmp:
        paths = generate(model, requires_grad, frozen, Path(tmp) / "all_trainable", loss=loss)
        return onnx.load(str(paths.training_model))


def build_tensor_graph(
    model: onnx.ModelProto,
    *,
    training_model: onnx.ModelProto | str | os.PathLike | None = None,
    cache: ArtifactCache | None = None,
    loss: str = "ce",
) -> nx.DiGraph:
    """Build the charged tensor-level backward graph of ``model`` (paper §5).

    Args:
        model: a legalised forward model (``LoadedModel.proto``, or ``LoadedModel.with_batch``
            for static shapes).
        training_model: ORT's ``training_model.onnx`` for ``model`` with *all* trainable tensors
            trainable (ModelProto or path). When omitted it is generated (seconds for small
            models, ~2-8 s for ResNet50/ViT-B/16): through ``cache`` when given (so the profiler
            can reuse the same artifacts), else in a temporary directory removed afterwards.
        cache: the :class:`etgraph.artifacts.ArtifactCache` to generate the all-trainable
            artifacts through (requires_grad = every trainable tensor, frozen = the running
            statistics).
        loss: the loss of the training graph (``"ce"`` or ``"mse"``;
            :func:`etgraph.artifacts.generate`).

    Returns:
        DiGraph with tensor and op nodes (layout in :mod:`passes.layout`), every op charged; graph
        attributes ``model_hash``, ``tensor_order`` (names by index), ``num_tensors``,
        ``num_ops``, ``head_lr_scale`` (the head's stored learning-rate factor, 1.0: none).
        Tensor nodes carry ``t_dw_us``, ``t_dy_us``, ``importance``, ``selected``
        = None for later stages to fill.

    Raises:
        ModelError: no trainable tensors; ORT cannot build the training graph; a tensor gets no
            gradient in the training graph.
        onnx_ir.passes.PassError: a pass's pre- or postcondition failed (e.g. an op left
            uncharged): a bug in etgraph, not the user's fault.
    """
    tensors = model_spec.trainable_tensors(model)
    training = _training_model(model, tensors, training_model, cache, loss)
    forward_names = {n.name for n in model.graph.node}
    output_name = model.graph.output[0].name
    roles = node_roles(training, forward_names, output_name)

    graph = nx.DiGraph()
    graph.graph.update(
        num_tensors=len(tensors),
        num_ops=len(training.graph.node),
        output_name=output_name,
        loss=loss,
        **_model_attributes(model),
    )
    for t in tensors:
        graph.add_node(
            tensor_id(t.name),
            node_type="tensor",
            index=t.index,
            name=t.name,
            kind=t.kind,
            layer=t.layer,
            op_type=t.op_type,
            shape=list(t.shape),
            params=t.params,
            values=list(t.values),
            t_dw_us=None,
            t_dy_us=None,
            importance=None,
            selected=None,
        )
    producer: dict[str, str] = {}
    for node, role in zip(training.graph.node, roles, strict=True):
        nid = op_id(node.name)
        if nid in graph:
            raise ModelError(f"training graph has two nodes named {node.name!r}")
        graph.add_node(
            nid,
            node_type="op",
            name=node.name,
            op_type=node.op_type,
            domain=node.domain,
            role=role,
            inputs=list(node.input),
            outputs=list(node.output),
            charge=None,
        )
        for value in node.output:
            if value:
                producer[value] = nid
    for node, role in zip(training.graph.node, roles, strict=True):
        nid = op_id(node.name)
        for value in node.input:
            src = producer.get(value)
            if src is None:
                continue
            src_role = graph.nodes[src]["role"]
            if (src_role == "forward") != (role == "forward"):
                continue  # saved activations and weights: left out to keep the dumps readable
            kind = "forward" if role == "forward" else "data"
            if graph.has_edge(src, nid):
                if value not in graph.edges[src, nid]["values"]:
                    graph.edges[src, nid]["values"].append(value)
            else:
                graph.add_edge(src, nid, kind=kind, values=[value])
    for t in tensors:
        grad = f"{t.name}_grad"
        src = producer.get(grad)
        if src is None:
            raise ModelError(
                f"tensor {t.name!r} gets no gradient {grad!r} in the training graph; "
                "it cannot be trained"
            )
        graph.add_edge(src, tensor_id(t.name), kind="grad", values=[grad])

    run_passes(tensor_graph_pipeline(), graph)
    log.debug("tensor graph: %d tensors, %d ops", len(tensors), len(training.graph.node))
    return graph


# ---- reading the charges ----


@dataclass(frozen=True)
class Charge:
    """Where one node of the training graph is charged (shared design: "Charging rule").

    Attributes:
        node: training-graph node name (as in ORT profile events).
        op_type: its op type.
        role: forward, loss, backward or accumulate.
        kind: ``dw`` (whole op on ``t_dw_us[tensor]``), ``dy`` (on ``t_dy_us[tensor]``),
            ``split`` (fused ConvGrad: dX part on ``t_dy_us[dy_tensor]``, dW/dB parts on
            ``t_dw_us`` of ``dw_tensors``; split by measurement), ``forward`` or ``loss``.
        tensor: tensor name for dw/dy, else None.
        dy_tensor: for split, the tensor receiving the dX part (None when ORT computes no dX).
        dw_tensors: for split, the kernel (and bias) receiving the dW (and dB) parts.
        rule: the pass that decided (linearize/conv_dense/batch_norm/non_trainable).
        gap: for the ``t_dy`` part (kind dy, or the dX part of a split): None when the op's
            D(o) is a prefix {0..max}, else ``(p, extra)`` — the op runs iff the earliest
            selected tensor is < p or a tensor in ``extra`` is selected (branch charge).
    """

    node: str
    op_type: str
    role: str
    kind: str
    tensor: str | None = None
    dy_tensor: str | None = None
    dw_tensors: tuple[str, ...] = ()
    rule: str = ""
    gap: tuple[int, tuple[int, ...]] | None = None


def charges(graph: nx.DiGraph) -> dict[str, Charge]:
    """Charge of every op node of ``graph``, keyed by training-graph node name (graph order).

    Raises:
        ModelError: an op node has no charge (graph not built by :func:`build_tensor_graph`).
    """
    out: dict[str, Charge] = {}
    for n in op_nodes(graph):
        a = graph.nodes[n]
        if a.get("charge") not in CHARGE_KINDS:
            raise ModelError(f"op {a['name']!r} has no charge; rebuild the tensor graph")
        out[a["name"]] = Charge(
            node=a["name"],
            op_type=a["op_type"],
            role=a["role"],
            kind=a["charge"],
            tensor=a.get("charge_tensor"),
            dy_tensor=a.get("charge_dy_tensor"),
            dw_tensors=tuple(a.get("charge_dw_tensors") or ()),
            rule=a.get("rule", ""),
            gap=_dy_gap(a),
        )
    return out


def _dy_gap(attrs: dict) -> tuple[int, tuple[int, ...]] | None:
    """The D(o) gap (``passes.linearize.gap``) of the part of an op charged to ``t_dy``."""
    if attrs["charge"] == "dy":
        g = attrs.get("d_gap")
    elif attrs["charge"] == "split":
        dx = [i for i, part in op_rule(attrs["op_type"]).fused_grad.items() if part == "dx"]
        out_gaps = attrs.get("d_out_gap") or []
        g = out_gaps[dx[0]] if dx and dx[0] < len(out_gaps) else None
    else:
        g = None
    return None if g is None else (int(g[0]), tuple(int(k) for k in g[1]))


TABLE_COLUMNS = (
    "index",
    "name",
    "kind",
    "layer",
    "shape",
    "params",
    "t_dw_us",
    "t_dy_us",
    "importance",
    "selected",
    "tensor_mb",
    "earliest_mb",
)


def tensor_table(graph: nx.DiGraph) -> list[dict]:
    """One row per tensor in forward order with :data:`TABLE_COLUMNS` (None where unknown)."""
    rows = []
    for n in tensor_nodes(graph):
        a = graph.nodes[n]
        rows.append({c: a.get(c) for c in TABLE_COLUMNS})
    return rows


def coverage(graph: nx.DiGraph) -> dict[str, int]:
    """Counts of training-graph nodes by charge kind, plus ``total``, ``charged``, and
    ``prefix_dy`` / ``dy_ops`` (dy-charged backward ops whose D(o) is a prefix {0..max}, the
    case where the time model is exact; see :mod:`passes.linearize`)."""
    counts = {k: 0 for k in CHARGE_KINDS}
    total = charged = prefix = dy_ops = 0
    for n in op_nodes(graph):
        a = graph.nodes[n]
        total += 1
        if a.get("charge") in counts:
            counts[a["charge"]] += 1
            charged += 1
        if a.get("charge") == "dy" and a.get("d_max") is not None:
            dy_ops += 1
            prefix += int(a["d_min"] == 0 and a["d_size"] == a["d_max"] + 1)
    return {**counts, "total": total, "charged": charged, "dy_ops": dy_ops, "prefix_dy": prefix}


# ---- what `etgraph inspect` does (the CLI only parses and prints) ----


def _model_attributes(model: onnx.ModelProto) -> dict:
    """The tensor graph's attributes read off the model: its hash, input names, the head
    legalisation removed and the head's stored learning-rate factor (1.0: not scaled)."""
    record = head_lr_of(model)
    return dict(
        model_hash=model_hash(model),
        input_names=[i.name for i in input_specs(model)],
        removed_head=removed_head(model),
        head_lr_scale=record.scale if record is not None else 1.0,
    )


def load_tensor_graph(
    target: str | os.PathLike, *, output: str | None = None, loss: str = "ce"
) -> nx.DiGraph:
    """The tensor graph of ``target``: an ``.onnx`` model (loaded, legalised to train its output
    ``output`` (None: the only one) with ``loss``, and built with :func:`build_tensor_graph`,
    artifacts in a temporary directory), a ``graph.json`` dump
    (:func:`etgraph.dumps.read_graph`), or a compiled directory holding one.

    Raises:
        ConfigError: a directory without ``graph.json``, or a JSON file that is not a
            tensor-graph dump.
        ModelError: the target does not exist; as :meth:`etgraph.model.LoadedModel.load` and
            :func:`build_tensor_graph`.
    """
    target = Path(target)
    if target.is_dir():
        dump = target / "graph.json"
        if not dump.is_file():
            raise ConfigError(f"{target}: no graph.json in this directory; compile a model first")
        return read_graph(dump)
    if target.suffix == ".json":
        return read_graph(target)
    require_model_path(target, directory_ok=True)
    loaded = model_spec.LoadedModel.load(target, output=output, loss=loss)
    return build_tensor_graph(loaded.proto, loss=loaded.task.loss)


def format_tensor_table(rows: list[dict]) -> str:
    """Plain-text table of :func:`tensor_table` rows (index, name, kind, shape, params, t_dw_us,
    t_dy_us, importance, selected; with a memory model (``compile --memory-mb``) also tensor_mb,
    what selecting the tensor adds, and earliest_mb, the step's workspace when it is the
    earliest selected tensor, MiB); blank where unknown."""
    columns = (
        "index",
        "name",
        "kind",
        "shape",
        "params",
        "t_dw_us",
        "t_dy_us",
        "importance",
        "selected",
    )
    if any(r.get("tensor_mb") is not None for r in rows):
        columns += ("tensor_mb", "earliest_mb")

    def cell(key, value) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return ""
        if key == "shape":
            return "x".join(str(d) for d in value) if value else "scalar"
        if key in ("t_dw_us", "t_dy_us"):
            return f"{float(value):.1f}"
        if key in ("tensor_mb", "earliest_mb"):
            return f"{float(value):.2f}"
        if key == "importance":
            return f"{float(value):.3g}"
        if key == "selected":
            return "yes" if value else "no"
        return str(value)

    cells = [[cell(c, r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    numeric = {"index", "params", "t_dw_us", "t_dy_us", "importance", "tensor_mb", "earliest_mb"}

    def line(values) -> str:
        return "  ".join(
            v.rjust(w) if c in numeric else v.ljust(w)
            for c, v, w in zip(columns, values, widths, strict=True)
        ).rstrip()

    return "\n".join([line(columns), *(line(r) for r in cells)])
