"""The server's aggregation of partial updates (issue 29): per tensor, over the clients that
trained it, weighted by their examples; every other tensor keeps its global value.

Stock FedAvg (Flower's) needs every reply to carry the same tensors and replaces the whole
model; an elastic client uploads only the tensors it trained, so here each tensor is averaged
over its own contributors (VectorInstitute FL4Health's ``fedavg_dynamic_layer`` is prior art).
When every client sends every tensor this is FedAvg exactly.

**BatchNorm running statistics** (stated rule): a client uploads a batch norm's running mean and
variance when its training moved them (it trained that batch norm in training mode). They are
pooled over those clients as the moments of the union of their data: ``mean = sum w_i mean_i``,
``var = sum w_i (var_i + (mean_i - mean)^2)`` (``w`` the examples' shares), so the global model
normalises the whole federation's data, not the average client's. A variance whose mean was not
uploaded pairs with the global mean.

Pure numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

__all__ = ["aggregate", "batch_norm_pairs"]


def batch_norm_pairs(model: onnx.ModelProto) -> dict[str, str]:
    """``{running_var name: running_mean name}`` of the model's BatchNormalization nodes."""
    inits = {i.name for i in model.graph.initializer}
    pairs = {}
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and len(node.input) >= 5:
            mean, var = node.input[3], node.input[4]
            if mean in inits and var in inits:
                pairs[var] = mean
    return pairs


def aggregate(
    global_weights: Mapping[str, np.ndarray],
    updates: Sequence[tuple[Mapping[str, np.ndarray], float]],
    bn_pairs: Mapping[str, str] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The next global model from the clients' partial updates.

    Args:
        global_weights: the round's global model, initializer name -> array.
        updates: per client ``(tensors it trained, examples it trained on)``; tensor names a
            subset of ``global_weights``' with their shapes (checked by the caller); weights
            > 0.
        bn_pairs: ``{running_var: running_mean}`` (:func:`batch_norm_pairs`): those variances
            are pooled (module docstring).

    Returns:
        ``(weights, coverage)``: every tensor of ``global_weights`` (new arrays where someone
        trained it, the global arrays otherwise, same dtypes), and per tensor the share of the
        round's examples (of the updates given) whose client trained it, in [0, 1].
    """
    pairs = dict(bn_pairs or {})
    total = float(sum(n for _, n in updates)) or 1.0
    out: dict[str, np.ndarray] = {}
    coverage: dict[str, float] = {}
    means: dict[str, np.ndarray] = {}
    for name, value in global_weights.items():
        contrib = [(u[name], n) for u, n in updates if name in u]
        coverage[name] = sum(n for _, n in contrib) / total
        if not contrib or name in pairs:
            out[name] = value
            continue
        w = np.array([n for _, n in contrib], dtype=np.float64)
        stacked = np.stack([np.asarray(a, dtype=np.float64) for a, _ in contrib])
        mean = np.tensordot(w / w.sum(), stacked, axes=1)
        means[name] = mean
        out[name] = mean.astype(value.dtype)
    for var_name, mean_name in pairs.items():  # pooled variances, after the pooled means
        if var_name not in global_weights:
            continue
        contrib = [
            (u[var_name], u.get(mean_name, global_weights[mean_name]), n)
            for u, n in updates
            if var_name in u
        ]
        if not contrib:
            out[var_name] = global_weights[var_name]
            continue
        w = np.array([n for *_, n in contrib], dtype=np.float64)
        w /= w.sum()
        mean_i = np.stack([np.asarray(m, dtype=np.float64) for _, m, _ in contrib])
        pooled_mean = np.tensordot(w, mean_i, axes=1)
        var_i = np.stack([np.asarray(v, dtype=np.float64) for v, _, _ in contrib])
        pooled = np.tensordot(w, var_i + (mean_i - pooled_mean) ** 2, axes=1)
        out[var_name] = pooled.astype(global_weights[var_name].dtype)
    return out, coverage
