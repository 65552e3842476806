"""Dumps of the tensor graph: node-link JSON (lossless), GraphML, Graphviz DOT (paper §5).

* :func:`write_graph` / :func:`read_graph` — write a graph built by
  :func:`etgraph.graph.build_tensor_graph` in one of :data:`GRAPH_FORMATS` and read it back
  (JSON losslessly; GraphML with list attributes as JSON text).
* :func:`render_dot` — render a DOT dump to SVG/PNG with Graphviz's ``dot`` when installed.

The graph layout (node ids, attributes, edge kinds) is documented in :mod:`passes.layout`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import networkx as nx
import numpy as np

from passes.layout import op_nodes, tensor_nodes

from .errors import ConfigError, ModelError
from .files import atomic_target

__all__ = ["GRAPH_FORMATS", "read_graph", "render_dot", "write_graph"]

GRAPH_FORMATS = ("json", "graphml", "dot")


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def _graphml_ready(graph: nx.DiGraph) -> nx.DiGraph:
    """A copy whose attributes GraphML accepts: one scalar type per key; lists/None as text."""

    def norm(items: Iterable[dict]) -> None:
        items = list(items)
        keys = {k for d in items for k in d}
        for key in keys:
            kinds = set()
            for d in items:
                v = d.get(key)
                if isinstance(v, np.generic):
                    d[key] = v = v.item()
                if isinstance(v, bool):
                    kinds.add("bool")
                elif isinstance(v, int):
                    kinds.add("int")
                elif isinstance(v, float):
                    kinds.add("float")
                elif v is not None:
                    kinds.add("other")
            numeric = kinds <= {"int", "float"} and kinds
            for d in items:
                if key not in d:
                    continue
                v = d[key]
                if numeric and v is None:
                    d[key] = math.nan if "float" in kinds else -1
                elif numeric and "float" in kinds:
                    d[key] = float(v)
                elif not numeric and not (kinds == {"bool"} and isinstance(v, bool)):
                    if v is None:
                        d[key] = ""
                    elif not isinstance(v, str):
                        d[key] = json.dumps(v, default=_json_default)
                elif kinds == {"bool"} and v is None:
                    d[key] = ""

    g = graph.copy()
    norm(d for _, d in g.nodes(data=True))
    norm(d for _, _, d in g.edges(data=True))
    g.graph = {
        k: (v if isinstance(v, (int, float, str)) else json.dumps(v, default=_json_default))
        for k, v in graph.graph.items()
        if v is not None
    }
    return g


def _dot_quote(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


_ROLE_COLOR = {"backward": "lightblue", "loss": "orange", "accumulate": "lightgrey"}


def _write_dot(graph: nx.DiGraph, path: Path) -> None:
    """Graphviz DOT of the backward view: tensors (boxes, forward order), non-forward ops
    (ellipses) and their data/charge edges. Forward ops are left out (they are all charged
    ``forward``); the JSON dump has them."""
    lines = [
        "digraph etgraph {",
        "  rankdir=RL;",
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=8];',
    ]
    for n in tensor_nodes(graph):
        a = graph.nodes[n]
        label = f"{a['index']}: {a['name']}\\n{a['kind']} {tuple(a['shape'])}"
        for key in ("t_dw_us", "t_dy_us", "tensor_mb"):
            if a.get(key) is not None:
                label += f"\\n{key}={a[key]:.1f}"
        fill = "palegreen" if a.get("selected") else "white"
        lines.append(
            f'  {_dot_quote(n)} [shape=box, style=filled, fillcolor={fill}, label="{label}"];'
        )
    for n in op_nodes(graph):
        a = graph.nodes[n]
        if a["role"] == "forward":
            continue
        color = _ROLE_COLOR.get(a["role"], "white")
        label = f"{a['op_type']}\\n[{a.get('charge')}]"
        lines.append(
            f"  {_dot_quote(n)} [shape=ellipse, style=filled, fillcolor={color}, "
            f"label={_dot_quote(label).replace(chr(92) * 2 + 'n', chr(92) + 'n')}, "
            f"tooltip={_dot_quote(a['name'])}];"
        )
    styles = {"chain": "bold", "charge": "dashed", "grad": "dotted", "data": "solid"}
    for u, v, a in graph.edges(data=True):
        kind = a.get("kind")
        if kind not in styles:
            continue
        if graph.nodes[u].get("role") == "forward":
            continue
        extra = f', label="{a["charge"]}", color=red' if a.get("charge") else ""
        lines.append(f"  {_dot_quote(u)} -> {_dot_quote(v)} [style={styles[kind]}{extra}];")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n")


def write_graph(graph: nx.DiGraph, path: str | os.PathLike, fmt: str = "json") -> Path:
    """Write ``graph`` to ``path`` as ``json`` (networkx node-link, lossless, :func:`read_graph`
    reloads it), ``graphml`` (lists/None stringified for Gephi/yEd) or ``dot`` (Graphviz text of
    the backward view). Returns the path.

    Raises:
        ConfigError: unknown ``fmt``.
    """
    path = Path(path)
    if fmt not in GRAPH_FORMATS:
        raise ConfigError(f"unknown graph format {fmt!r}: use one of {', '.join(GRAPH_FORMATS)}")
    with atomic_target(path) as tmp:
        if fmt == "json":
            data = nx.node_link_data(graph, edges="links")
            tmp.write_text(json.dumps(data, default=_json_default, indent=1) + "\n")
        elif fmt == "graphml":
            nx.write_graphml(_graphml_ready(graph), str(tmp))
        else:
            _write_dot(graph, tmp)
    return path


def read_graph(path: str | os.PathLike) -> nx.DiGraph:
    """Read a tensor graph written by :func:`write_graph` as JSON (``.json``, lossless) or GraphML
    (``.graphml``; list attributes stay JSON text).

    Raises:
        ConfigError: the file is missing, unreadable or not a tensor-graph dump.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such graph file")
    try:
        if path.suffix == ".graphml":
            return nx.read_graphml(str(path))
        data = json.loads(path.read_text())
        return nx.node_link_graph(data, directed=True, multigraph=False, edges="links")
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a tensor-graph dump ({exc})") from exc


def render_dot(dot_path: str | os.PathLike, fmt: str = "svg") -> Path | None:
    """Render a DOT file to ``svg`` or ``png`` next to it with Graphviz's ``dot`` binary.

    Returns the image path, or None when ``dot`` is not installed.

    Raises:
        ModelError: ``dot`` failed on the file.
    """
    exe = shutil.which("dot")
    if exe is None:
        return None
    dot_path = Path(dot_path)
    out = dot_path.with_suffix(f".{fmt}")
    proc = subprocess.run(
        [exe, f"-T{fmt}", str(dot_path), "-o", str(out)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise ModelError(f"graphviz could not render {dot_path}: {proc.stderr.strip()[:200]}")
    return out
