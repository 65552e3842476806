"""Fold measured times into the time model: ``t_dw_us``, ``t_dy_us``, ``forward_us`` (paper §5).

Pure arithmetic on what :mod:`etgraph.measure` measured (no ORT here):

* :func:`charge_node_times` — every node of the ``full`` training graph is charged through its
  :class:`etgraph.graph.Charge` to one tensor's ``t_dw_us`` or ``t_dy_us``, or to the forward
  pass; fused gradient nodes (registry ``fused_grad``: ConvGrad, ConvTransposeGrad) are split
  into their dX/dW/dB parts **by measurement** (:func:`fused_grad_parts`,
  :func:`split_by_measurement`).
* :class:`OptimizerFit`, :func:`fit_optimizer`, :func:`optimizer_subsets` — the AdamW kernel
  as ``fixed + per_tensor * count + per_element * elements``.
* :func:`calibrate` — the per-step overhead no node explains.
* :func:`forward_us_by_anchor`, :func:`saved_forward_fraction` — the forward work only a
  training graph does, moved onto ``t_dy_us`` of each forward node's anchor tensor.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from scipy.optimize import nnls

from .errors import ModelError
from .graph import Charge
from .measure import NodeTiming
from .ops import op_rule

__all__ = [
    "ChargedTimes",
    "OptimizerFit",
    "calibrate",
    "charge_node_times",
    "fit_optimizer",
    "forward_us_by_anchor",
    "fused_grad_parts",
    "optimizer_subsets",
    "saved_forward_fraction",
    "split_by_measurement",
]


# ---- the optimizer ----


@dataclass
class OptimizerFit:
    """AdamW kernel time model (µs): ``fixed_us + per_tensor_us * count + per_element_us *
    elements``."""

    fixed_us: float
    per_tensor_us: float
    per_element_us: float

    def tensor_us(self, numel: np.ndarray) -> np.ndarray:
        """Per-tensor part (µs) for tensors of ``numel`` elements, float64 [N]."""
        return self.per_tensor_us + self.per_element_us * np.asarray(numel, dtype=np.float64)


def optimizer_subsets(params: Mapping[str, np.ndarray], *, fast: bool = False) -> list[list[str]]:
    """Subsets of tensors the optimizer is measured on: all, multi-dim, 1-D, each half, the
    largest and the smallest tensor alone; ``fast``: all, 1-D, the largest and the smallest
    alone, repeats dropped (each of the three coefficients of :func:`fit_optimizer` still has
    a subset that moves it, at about a third of the elements). Empty subsets are dropped."""
    names = list(params)
    sizes = {n: params[n].size for n in names}
    half = len(names) // 2
    largest, smallest = [max(names, key=sizes.get)], [min(names, key=sizes.get)]
    one_dim = [n for n in names if params[n].ndim <= 1]
    if fast:
        subsets = [names, one_dim, largest, smallest]
    else:
        subsets = [
            names,
            [n for n in names if params[n].ndim > 1],
            one_dim,
            names[:half],
            names[half:],
            largest,
            smallest,
        ]
    if not fast:
        return [s for s in subsets if s]
    out: list[list[str]] = []
    for subset in subsets:
        if subset and subset not in out:
            out.append(subset)
    return out


def fit_optimizer(observations: Sequence[tuple[int, int, float]]) -> OptimizerFit:
    """Non-negative least-squares fit of ``(count, elements, µs)`` observations of the AdamW
    kernel to ``fixed + per_tensor * count + per_element * elements``."""
    a = np.array([[1.0, c, e] for c, e, _ in observations])
    b = np.array([t for _, _, t in observations])
    scale = np.abs(a).max(axis=0)
    coef, _ = nnls(a / scale, b)
    coef = coef / scale
    return OptimizerFit(float(coef[0]), float(coef[1]), float(coef[2]))


# ---- fused gradient kernels, split by measurement ----


def fused_grad_parts(op_type: str, outputs: Sequence[str]) -> frozenset[str]:
    """Which parts (``"dx"``, ``"dw"``, ``"db"``) a fused gradient node computes: the registry's
    ``fused_grad`` parts (:mod:`etgraph.ops`; ConvGrad: outputs 0, 1, 2) of its non-empty
    outputs. Empty for an op type without ``fused_grad``."""
    parts = op_rule(op_type).fused_grad
    return frozenset(part for i, part in parts.items() if i < len(outputs) and outputs[i])


def split_by_measurement(observations: Sequence[tuple[frozenset[str], float]]) -> dict[str, float]:
    """Per-part times (µs) of one fused node from its times in several configurations.

    Args:
        observations: ``(parts computed, µs)`` per configuration; the FIRST is the
            configuration whose time is split (all tensors trainable).

    Returns:
        ``{part: µs}`` over the parts of the first observation, >= 0, summing to its time.
        Solved by non-negative least squares ``time(config) = sum(part times computed)``;
        parts the other configurations cannot tell apart share the rest equally.
    """
    parts = sorted(observations[0][0])
    total = observations[0][1]
    if len(parts) <= 1:
        return {p: total for p in parts}
    rows = [(s, t) for s, t in observations if s and s <= set(parts)]
    a = np.array([[1.0 if p in s else 0.0 for p in parts] for s, _ in rows])
    b = np.array([t for _, t in rows])
    x, _ = nnls(a, b)
    # Columns never observed apart from each other are not identified: share them equally.
    rank = np.linalg.matrix_rank(a)
    if rank < len(parts):
        x = np.full(len(parts), total / len(parts))
        for j, p in enumerate(parts):
            alone = [t for s, t in rows if s == {p}]
            if alone:
                x[j] = min(total, statistics.median(alone))
        rest = [j for j, p in enumerate(parts) if not any(s == {p} for s, _ in rows)]
        if rest:
            left = max(0.0, total - sum(x[j] for j in range(len(parts)) if j not in rest))
            for j in rest:
                x[j] = left / len(rest)
    s = x.sum()
    x = x * (total / s) if s > 0 else np.full(len(parts), total / len(parts))
    return {p: float(v) for p, v in zip(parts, x, strict=True)}


_GRAD_SUFFIX = re.compile(r"_grad(_\d+)?$")


def _split_targets(
    charge: Charge,
    outputs: Sequence[str],
    index: Mapping[str, int],
    values: Mapping[str, Sequence[str]],
) -> dict[str, tuple[str, int | None]]:
    """``{part: (kind, tensor index)}`` of a split charge: dX -> ``t_dy`` of the charge's
    ``dy_tensor`` (forward pass when None), dW/dB -> ``t_dw`` of the tensor in ``dw_tensors``
    whose gradient the node's dW/dB output is: ORT names it ``<value>_grad`` (``_grad_<k>``
    when the value has several readers), the value being the tensor itself or one it carries
    into its layer (``values``: a Transpose of it, or the kernel a weight-norm Mul computes).

    Raises:
        ModelError: a dW/dB output is not the gradient of exactly one of ``dw_tensors``.
    """
    targets = {"dx": ("dy", index[charge.dy_tensor]) if charge.dy_tensor else ("forward", None)}
    for i, part in op_rule(charge.op_type).fused_grad.items():
        value = outputs[i] if i < len(outputs) else ""
        if part == "dx" or not value:
            continue
        base = _GRAD_SUFFIX.sub("", value)
        owners = [t for t in charge.dw_tensors if t == base or base in values.get(t, ())]
        if len(owners) != 1 or owners[0] not in index:
            raise ModelError(
                f"split node {charge.node!r}: output {value!r} is not the gradient of one of "
                f"{list(charge.dw_tensors)}"
            )
        targets[part] = ("dw", index[owners[0]])
    return targets


# ---- charging the node times ----


@dataclass
class ChargedTimes:
    """Node times of the ``full`` configuration charged to tensors (:func:`charge_node_times`).

    Attributes:
        t_dw_us, t_dy_us: float64 [N] µs (without the optimizer's per-tensor part).
        forward_pass_us: forward + loss node time, µs.
        rows: per node ``{name, op, us, charge, tensor}`` (split nodes: ``parts``,
            ``observations``), :attr:`etgraph.profile.Profile.nodes`.
        branches: rows of :class:`etgraph.timing.BranchCharges` (:attr:`Profile.branches`).
    """

    t_dw_us: np.ndarray
    t_dy_us: np.ndarray
    forward_pass_us: float
    rows: list[dict]
    branches: list[dict]


def charge_node_times(
    node_times: Mapping[str, Mapping[str, NodeTiming]],
    charges: Mapping[str, Charge],
    names: Sequence[str],
    node_overhead_us: float,
    values: Mapping[str, Sequence[str]] | None = None,
) -> ChargedTimes:
    """Charge the ``full`` configuration's node times (kernel + per-node overhead, µs) to
    tensors (paper §5; shared design "Charging rule").

    Split nodes are split by measurement over all configurations (:func:`split_by_measurement`);
    the per-node overhead goes with the dX part when there is one (else the first part).
    ``t_dy`` work of ops whose D(o) has a gap (``Charge.gap``) is also summed per
    (tensor, gap) into ``branches`` (rows for :class:`etgraph.timing.BranchCharges`).

    Args:
        node_times: ``{configuration: {node name: NodeTiming}}``; must hold ``"full"`` (every
            tensor trainable), whose nodes are charged; the others only help split nodes.
        charges: :func:`etgraph.graph.charges` of the full training graph.
        names: trainable tensor names, forward order, length N.
        node_overhead_us: executor cost per node, µs.
        values: tensor name -> the value names that carry it into its layer
            (:attr:`etgraph.model.TensorInfo.values`), to find whose gradient a split node's
            dW/dB output is; None: each tensor's own name only.

    Raises:
        ModelError: a profiled node is not in the tensor graph, or a split node's outputs do not
            match its charge.
    """
    index = {n: i for i, n in enumerate(names)}
    t_dw = np.zeros(len(names))
    t_dy = np.zeros(len(names))
    forward_pass = 0.0
    rows = []
    branch_us: dict[tuple, float] = {}
    others = [c for c in node_times if c != "full"]

    def add(kind: str, tensor: int | None, us: float, gap=None) -> None:
        nonlocal forward_pass
        if kind == "dw":
            t_dw[tensor] += us
        elif kind == "dy":
            t_dy[tensor] += us
            if gap is not None:
                key = (tensor, gap[0], tuple(gap[1]))
                branch_us[key] = branch_us.get(key, 0.0) + us
        else:
            forward_pass += us

    for name, nt in node_times["full"].items():
        charge = charges.get(name)
        if charge is None:
            raise ModelError(f"profiled node {name!r} ({nt.op}) is not in the tensor graph")
        row = {"name": name, "op": nt.op, "us": nt.us, "charge": charge.kind}
        if charge.kind != "split":
            tensor = index[charge.tensor] if charge.tensor is not None else None
            add(charge.kind, tensor, nt.us + node_overhead_us, charge.gap)
            row["tensor"] = charge.tensor
            rows.append(row)
            continue
        observations = [(fused_grad_parts(nt.op, nt.outputs), nt.us)]
        for c in others:
            other = node_times[c].get(name)
            if other is not None:
                observations.append((fused_grad_parts(other.op, other.outputs), other.us))
        parts = split_by_measurement(observations)
        targets = _split_targets(charge, nt.outputs, index, values or {})
        first = "dx" if "dx" in parts else next(iter(parts))
        for part, us in parts.items():
            kind, tensor = targets[part]
            gap = charge.gap if part == "dx" else None
            add(kind, tensor, us + (node_overhead_us if part == first else 0.0), gap)
        row["parts"] = {
            p: {
                "charge": targets[p][0],
                "tensor": None if targets[p][1] is None else names[targets[p][1]],
                "us": us,
            }
            for p, us in parts.items()
        }
        row["observations"] = [[sorted(ps), us] for ps, us in observations]
        rows.append(row)
    branches = [
        {"tensor": k, "prefix": p, "extra": list(extra), "us": us}
        for (k, p, extra), us in sorted(branch_us.items())
    ]
    return ChargedTimes(t_dw, t_dy, forward_pass, rows, branches)


# ---- calibration against measured steps ----


def calibrate(explained_us: Sequence[float], measured_us: Sequence[float]) -> float:
    """The per-step overhead (µs): mean of ``measured - explained`` over the configurations.

    ``explained`` is what the profiled kernels, per-node overhead and optimizer fit predict for
    a configuration; ``measured`` its real step (training API, measured round-robin with the
    profiling runs). The residual is the per-step cost outside any node (Module and Optimizer
    calls, input binding, the trace's own cost with the sign it has). A multiplicative factor
    was tried and dropped: on this machine the training API costs the same as the sessions it
    wraps (``Module`` ~ ``InferenceSession.run``, ``Optimizer.step`` ~ the optimizer kernel),
    and a slope fitted to 3 noisy points wandered from 0.5 to 2 on small models.

    Args:
        explained_us, measured_us: float [K] µs, configurations in the same order.
    """
    x = np.asarray(explained_us, dtype=np.float64)
    y = np.asarray(measured_us, dtype=np.float64)
    return float(np.mean(y - x))


def saved_forward_fraction(
    overhead_us: float, last_only_residual_us: float, anchored_forward_us: float
) -> float:
    """Share of the forward pass a step saves when no gradient passes a layer, in [0, 1].

    ORT's training graph runs the forward part differently where backward nodes consume it
    (activations kept alive, no Conv+Relu / MatMul+Add fusion); where no gradient passes, the
    forward runs as in inference, faster. Measured with the ``last_only`` configuration (only
    the last tensor trainable): its real step falls short of what the full-graph forward
    explains by ``overhead_us - last_only_residual_us``; divided by the forward time of the
    layers it skips (``anchored_forward_us``, anchors 0..N-2).

    Args:
        overhead_us: per-step overhead of the e=0 configurations (:func:`calibrate`), µs.
        last_only_residual_us: measured minus explained step of the last_only configuration, µs.
        anchored_forward_us: full-graph forward node time anchored before the last tensor, µs.
    """
    if anchored_forward_us <= 0:
        return 0.0
    return float(np.clip((overhead_us - last_only_residual_us) / anchored_forward_us, 0.0, 1.0))


def forward_us_by_anchor(
    model: onnx.ModelProto, rows: Sequence[Mapping], names: Sequence[str], node_overhead_us: float
) -> np.ndarray:
    """Forward node time (µs, kernel + per-node overhead) of the full training graph per anchor
    tensor, float64 [N].

    A forward node's anchor is the latest tensor (forward order) consumed by it or any forward
    node before it in ``model``'s graph order — the gradient passes the node iff the earliest
    selected tensor is at or before its anchor. Nodes before every tensor have none (never on a
    gradient path) and are left out.

    Args:
        model: the forward model the training graph was generated from.
        rows: :attr:`ChargedTimes.rows` (``name``, ``op``, ``us``, ``charge``).
        names: trainable tensor names, forward order. node_overhead_us: per-node cost, µs.
    """
    index = {n: i for i, n in enumerate(names)}
    anchor_of: dict[str, int] = {}
    latest = -1
    for node in model.graph.node:
        for value in node.input:
            if value in index:
                latest = max(latest, index[value])
        anchor_of[node.name] = latest
    out = np.zeros(len(names))
    for row in rows:
        if row["charge"] != "forward":
            continue
        # Not an op-type special case: ORT's training-graph transformers that replace a forward
        # node name the new node "<forward name>_<new op type>" (BatchNormalization ->
        # "<name>_BatchNormInternal"); such a node is anchored where the node it replaces was.
        name = row["name"]
        if name not in anchor_of:
            name = name.removesuffix(f"_{row['op']}")
        anchor = anchor_of.get(name, -1)
        if anchor >= 0:
            out[anchor] += row["us"] + node_overhead_us
    return out


# ---- batch norms in both modes (--frozen-bn) ----


def batch_norm_modes(
    full: Mapping[str, NodeTiming],
    inference: Mapping[str, NodeTiming],
    layers: Sequence[tuple[str, int, int]],
    charges: Mapping[str, Charge],
    node_overhead_us: float,
) -> list[dict]:
    """Each batch norm's measured cost in training and in inference mode (issue #14).

    Node times are kernel + per-node overhead, µs. In the ``full`` training graph ORT names a
    batch norm ``<bn>_BatchNormInternal`` and its backward ``<bn>_BatchNormInternal_Grad/...``;
    in the ``inference`` configuration's graph (every batch norm frozen in inference mode,
    :class:`passes.onnx.InferenceBatchNormPass`) its nodes are ``<bn>/inference/...`` and their
    backward ``<bn>/inference/..._Grad/...``.

    Args:
        full, inference: ``{node name: NodeTiming}`` of the two configurations.
        layers: ``(node name, gamma index, beta index)`` per batch norm.
        charges: :func:`etgraph.graph.charges` of the full graph (for the backward's branch gap).
        node_overhead_us: executor cost per node, µs.

    Returns:
        One row per layer: ``node``, ``gamma``, ``beta``, ``train_dy_us``,
        ``train_forward_us``, ``inference_dy_us``, ``inference_forward_us``, and ``gap``
        (``[prefix, [extra indices]]`` of the backward's branch group, or None), the input of
        :meth:`etgraph.profile.Profile.for_frozen_bn`.
    """

    def total(times: Mapping[str, NodeTiming], prefix: str, backward: bool) -> float:
        return sum(
            t.us + node_overhead_us
            for name, t in times.items()
            if name.startswith(prefix) and ("_Grad/" in name) == backward
        )

    rows = []
    for node, gamma, beta in layers:
        train = f"{node}_BatchNormInternal"
        grad = next((charges[n] for n in full if n.startswith(f"{train}_Grad/")), None)
        gap = grad.gap if grad is not None else None
        rows.append(
            {
                "node": node,
                "gamma": int(gamma),
                "beta": int(beta),
                "train_dy_us": total(full, train, True),
                "train_forward_us": total(full, train, False),
                "inference_dy_us": total(inference, f"{node}/inference/", True),
                "inference_forward_us": total(inference, f"{node}/inference/", False),
                "gap": None if gap is None else [int(gap[0]), [int(i) for i in gap[1]]],
            }
        )
    return rows
