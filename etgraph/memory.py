"""Memory model of selective training: peak resident memory of a selection (issue #17).

The time model (:mod:`etgraph.timing`, paper Eq. 1) says how long a step of a selection ``M``
takes; this module says how much memory the process that trains ``M`` holds at its peak, as
the OS counts it (resident set size, ``VmHWM``: what gets a process killed on a device).

All arrays are in forward execution order (index 0 nearest the input), memory in MiB (``_mb``).
For a non-empty mask ``M`` with earliest selected tensor ``e = e(M)``::

    peak_mb(M) = max(load_mb,  base_mb + sum_k M[k] * tensor_mb[k] + earliest_mb[e]
                               - (max_{k >= e} grad_mb[k] - max_{k in M} grad_mb[k]))

* ``load_mb`` — the peak while the process starts: interpreter, numpy, onnxruntime-training and
  torch (which ``onnxruntime.training`` imports), and reading the checkpoint (ORT holds the file
  and the parsed weights at once). Paid whatever is selected.
* ``base_mb`` — resident after start-up with nothing selected: the libraries, every weight (the
  frozen ones are held too, in the checkpoint state), the training, eval and optimizer sessions.
* ``tensor_mb[k]`` — what selecting tensor ``k`` adds: its gradient accumulation buffer and the
  two AdamW moments (3 x 4 bytes per parameter; measured ``bytes_per_param``), allocated when
  the Module and Optimizer are built.
* ``earliest_mb[e]`` — the step's workspace in ORT's arena when the gradient must travel back to
  tensor ``e``: the forward activations the backward pass keeps alive (everything after ``e``
  that a backward op reads, branches included), the error gradients in flight and the kernels'
  scratch. It depends on ``e`` only — how far back the gradient travels — like the ``t_dy`` term
  of the time model. It is measured on suffix selections (every tensor from ``e`` on), so it
  includes the largest weight-gradient temporary of the suffix.
* ``grad_mb[k]`` — tensor ``k``'s weight gradient as the backward pass computes it (float32, 4
  bytes per parameter), a temporary in the arena until it is added to the accumulation buffer.
  A selection without the suffix's largest one needs less workspace than the suffix: the last
  term. It matters where one layer's weights dwarf the activations (VGG16's first fully
  connected layer at 128 px: a 128 MiB gradient; a selection of two convolutions near the input
  measured 87 MiB below the suffix from the first of them).

Without the last term (it is >= 0) ``earliest_mb`` depends on ``e(M)`` only and the rest is a
sum over selected tensors: the memory constraint of the DP (an upper bound of ``peak_mb``, exact
for suffixes) has the same structure as the time constraint of paper Eq. (3): once the
earliest selected tensor is fixed, both are 0/1-knapsack constraints over the tensors after it
(:func:`etgraph.selection.select_tensors` with :class:`etgraph.selection.MemoryCosts`).

The profile is of one batch-norm mode (``frozen_bn``, docs/how-it-works.md, "Frozen batch
norm"): with
``"inference"`` (``etgraph train``'s default) the anchor selections' frozen batch norms run as
their inference affine map, as in training, and a profile of the other mode is another profile
(another :func:`memory_key`, and :meth:`MemoryProfile.check_matches` refuses it).

How the parts are obtained (:mod:`etgraph.memory_profiler`): a measuring process, not the
compiler's own (ORT's CPU arena never returns memory, and the compiler holds much else), builds
the training session of a few anchor selections as training does and reports ``VmRSS`` after
start-up, after building the sessions and after a few steps, and ``VmHWM``. ORT's allocator
statistics are not used: the Python training API exposes none for the Module's sessions, and the
arena statistics would miss the libraries and the checkpoint, which are most of the peak on a
small model. ``earliest_mb`` is measured at the anchor tensors and interpolated between them in
proportion to the bytes of forward activations computed after each tensor (a static count from
ONNX shape inference, :func:`activation_bytes_after`).

Pure numpy (plus onnx shape inference): no ONNX Runtime import here.

JSON format (``format_version`` :data:`MEMORY_FORMAT_VERSION`), file ``memory.json`` beside
``profile.json``; other formats raise :class:`~etgraph.errors.ProfileMismatchError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from passes.onnx import DEFAULT_FROZEN_BN

from .errors import ConfigError, ProfileMismatchError
from .files import read_json, write_json_atomic
from .host import available_memory_bytes
from .io_specs import with_batch

__all__ = [
    "MEMORY_FORMAT_VERSION",
    "MemoryProfile",
    "activation_bytes_after",
    "interpolate_earliest_mb",
    "memory_key",
]

#: JSON format written by :meth:`MemoryProfile.to_dict` (2: ``frozen_bn``; sessions on the
#: shared arena, :func:`etgraph.ort_options.shared_arena`).
MEMORY_FORMAT_VERSION = 2

#: Version of the measurement method in :func:`memory_key` (bumped when what is measured changes).
_METHOD_VERSION = 2

_MIB = float(1 << 20)


def _dtype_bytes(elem_type: int) -> int:
    try:
        return int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)
    except (KeyError, TypeError, ValueError):
        return 4


def least_step_bytes(model: onnx.ModelProto, batch_size: int, shapes) -> float:
    """A lower bound of the memory one training step of ``model`` at ``batch_size`` and
    per-example input ``shapes`` (:func:`etgraph.io_specs.input_shapes`) needs, bytes: its
    weights, plus the largest node's inputs and outputs together (from ONNX shape inference;
    values whose shape is not static count 0). The weights are not copied: shapes are inferred
    on the graph with only the small initializers' values, which shape computations read."""
    graph = onnx.GraphProto()
    for name in ("node", "input", "output"):
        getattr(graph, name).extend(getattr(model.graph, name))
    weights = 0.0
    for init in model.graph.initializer:
        elements = math.prod(init.dims)
        weights += elements * _dtype_bytes(init.data_type)
        if elements <= 1024:  # shapes, axes, scalars: values shape inference may read
            graph.initializer.append(init)
        else:
            graph.initializer.add(name=init.name, dims=init.dims, data_type=init.data_type)
    light = onnx.helper.make_model(graph, opset_imports=model.opset_import)
    light.ir_version = model.ir_version
    light = with_batch(light, batch_size, shapes)
    try:
        inferred = onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception:  # a model onnx cannot infer: nothing known beyond the weights
        return weights
    sizes: dict[str, float] = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        if t.HasField("shape") and all(d >= 0 for d in dims):
            sizes[vi.name] = math.prod(dims) * float(_dtype_bytes(t.elem_type))
    largest = max(
        (sum(sizes.get(v, 0.0) for v in {*n.input, *n.output}) for n in inferred.graph.node),
        default=0.0,
    )
    return weights + largest


def check_step_fits(model, batch_size: int, shapes) -> None:
    """Refuse, before anything is allocated, a batch size and input shape at which one
    training step of ``model`` (:class:`etgraph.model.LoadedModel`) cannot fit in the memory
    this process can still allocate (:func:`least_step_bytes` against
    :func:`etgraph.host.available_memory_bytes`).

    Raises:
        ConfigError: naming the shapes, the memory needed and the memory available.
    """
    need = least_step_bytes(model.proto, batch_size, shapes)
    have = available_memory_bytes()
    if need > have:
        text = ", ".join(f"{n}={'x'.join(map(str, d))}" for n, d in shapes.items())
        raise ConfigError(
            f"input shape {text} at batch {batch_size} needs at least {need / 2**30:.1f} GiB "
            f"for one training step, and this process can allocate {have / 2**30:.1f} GiB: "
            "use a smaller --input-shape or --batch-size"
        )


def activation_bytes_after(model: onnx.ModelProto, layers: Sequence[str]) -> np.ndarray:
    """Bytes of forward values computed at or after each tensor's layer, float64 [N].

    A static proxy for what the backward pass keeps alive when the gradient travels back to
    tensor ``k``: the sum of the sizes of every node output (from ONNX shape inference at the
    model's static input shape) from ``layers[k]``'s node to the end of the graph, in the
    model's node order (topological). Outputs whose shape is not static count 0.

    Args:
        model: a forward model with a static input shape (``LoadedModel.with_batch``).
        layers: per trainable tensor (forward order) the name of the node applying it
            (``TensorInfo.layer``).

    Raises:
        ConfigError: a layer name is not a node of the model.
    """
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    sizes: dict[str, float] = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        if t.HasField("shape") and all(d >= 0 for d in dims):
            sizes[vi.name] = float(np.prod(dims, dtype=np.float64)) * _dtype_bytes(t.elem_type)
    nodes = inferred.graph.node
    per_node = np.array([sum(sizes.get(o, 0.0) for o in n.output) for n in nodes])
    after = np.concatenate([np.cumsum(per_node[::-1])[::-1], [0.0]])
    position = {n.name: i for i, n in enumerate(nodes)}
    out = np.empty(len(layers))
    for k, layer in enumerate(layers):
        if layer not in position:
            raise ConfigError(f"tensor layer {layer!r} is not a node of the model")
        out[k] = after[position[layer]]
    return out


def interpolate_earliest_mb(
    anchors: Sequence[int], anchor_mb: Sequence[float], proxy: np.ndarray
) -> np.ndarray:
    """``earliest_mb`` [N] from measurements at anchor tensors, interpolated by ``proxy``.

    Between two anchors ``a < b`` the workspace moves in proportion to the proxy (activation
    bytes after the tensor, :func:`activation_bytes_after`):
    ``mb(e) = mb(a) + (mb(b) - mb(a)) * (proxy[e] - proxy[a]) / (proxy[b] - proxy[a])``, linear
    in the index where the proxy does not change; before the first anchor and after the last the
    nearest anchor's value is kept. Exact at the anchors.

    Args:
        anchors: distinct tensor indices, any order. anchor_mb: measured MiB at each.
        proxy: float [N], forward order.

    Raises:
        ConfigError: no anchors, lengths differ, or an anchor index is out of range.
    """
    proxy = np.asarray(proxy, dtype=np.float64)
    n = proxy.size
    order = np.argsort(np.asarray(anchors))
    idx = np.asarray(anchors, dtype=np.int64)[order]
    val = np.asarray(anchor_mb, dtype=np.float64)[order]
    if idx.size == 0 or idx.size != val.size or idx[0] < 0 or idx[-1] >= n:
        raise ConfigError("memory anchors must be in-range tensor indices with one value each")
    out = np.empty(n)
    out[: idx[0] + 1] = val[0]
    out[idx[-1] :] = val[-1]
    for (a, b), (va, vb) in zip(
        zip(idx[:-1], idx[1:], strict=True), zip(val[:-1], val[1:], strict=True), strict=True
    ):
        e = np.arange(a, b + 1)
        span = proxy[a] - proxy[b]
        if span > 0:
            frac = np.clip((proxy[a] - proxy[e]) / span, 0.0, 1.0)
        else:
            frac = (e - a) / max(b - a, 1)
        out[a : b + 1] = va + (vb - va) * frac
    return out


@dataclass
class MemoryProfile:
    """Measured memory model of one model on this device (module docstring).

    Attributes:
        model_hash: :func:`etgraph.onnx_io.model_hash` of the model.
        tensors: trainable tensor names, forward order, length N.
        tensor_mb: float64 [N] MiB each selected tensor adds (gradient buffer + AdamW moments).
        earliest_mb: float64 [N] MiB of the step's workspace when tensor ``e`` is the earliest
            selected one.
        base_mb: MiB resident after start-up with no tensor's buffers (libraries, weights,
            sessions).
        load_mb: peak MiB while starting (imports + checkpoint read); a floor of every peak.
        import_mb: MiB resident after importing numpy + onnxruntime-training + torch (part of
            ``base_mb``: the interpreter and libraries).
        weights_mb: MiB of the model's parameters (float32), part of ``base_mb``.
        bytes_per_param: fitted bytes per selected parameter (theory: 12 = gradient + 2 moments).
        batch_size, input_shape (C, H, W), threads, ort_version, host: the setting.
        frozen_bn: the batch-norm mode of the measured artifacts (``"inference"`` or
            ``"train"``, :data:`passes.onnx.FROZEN_BN_MODES`); training in the other mode needs
            its own profile.
        anchors: tensor indices where ``earliest_mb`` was measured.
        measurements: raw measurements ``[{"mask": [indices], "rss": {...}}]`` (MiB).
        profiling_s: wall time of the measurements, s.
        profiling_cpu_s: CPU time of the measurements (this process and its measuring
            processes), s: what they cost on an idle machine, about (wall time grows with load).
    """

    model_hash: str
    tensors: list[str]
    tensor_mb: np.ndarray
    earliest_mb: np.ndarray
    base_mb: float
    load_mb: float
    import_mb: float
    weights_mb: float
    bytes_per_param: float
    batch_size: int
    input_shape: tuple[int, ...]
    threads: int
    frozen_bn: str = DEFAULT_FROZEN_BN
    ort_version: str = ""
    host: str = ""
    anchors: list = field(default_factory=list)
    measurements: list = field(default_factory=list)
    profiling_s: float = 0.0
    profiling_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        self.tensor_mb = np.asarray(self.tensor_mb, dtype=np.float64)
        self.earliest_mb = np.asarray(self.earliest_mb, dtype=np.float64)
        self.input_shape = tuple(int(d) for d in self.input_shape)
        n = len(self.tensors)
        if self.tensor_mb.shape != (n,) or self.earliest_mb.shape != (n,):
            raise ConfigError(f"memory profile arrays must have one entry per tensor ({n})")

    # -- the model -------------------------------------------------------------------------

    @property
    def grad_mb(self) -> np.ndarray:
        """float64 [N] MiB of each tensor's weight-gradient temporary (4 bytes per parameter,
        the parameters being ``tensor_mb / bytes_per_param``)."""
        return self.tensor_mb * (4.0 / self.bytes_per_param)

    def _suffix_grad_mb(self) -> np.ndarray:
        """float64 [N]: the largest ``grad_mb`` from each tensor on."""
        return np.maximum.accumulate(self.grad_mb[::-1])[::-1]

    def _mask(self, mask) -> np.ndarray:
        m = np.asarray(mask, dtype=bool)
        if m.shape != (len(self.tensors),):
            raise ConfigError(
                f"selection mask has shape {m.shape}, expected ({len(self.tensors)},)"
            )
        if not m.any():
            raise ConfigError("an empty selection trains nothing: select at least one tensor")
        return m

    def parts_mb(self, mask) -> dict[str, float]:
        """The predicted peak of ``mask`` (bool [N]) and its parts, MiB.

        Keys: ``peak_mb`` (the prediction), ``load_mb`` (start-up floor), ``base_mb`` (of which
        ``import_mb`` libraries and ``weights_mb`` weights), ``tensors_mb`` (gradient buffers and
        moments of the selected tensors), ``workspace_mb`` (activations and scratch: the suffix
        workspace of the earliest selected tensor ``earliest`` less ``gradient_slack_mb``, what
        the suffix's largest gradient temporary exceeds the selection's by).

        Raises:
            ConfigError: wrong mask length, or an empty mask.
        """
        m = self._mask(mask)
        e = int(np.argmax(m))
        tensors_mb = float(self.tensor_mb[m].sum())
        slack_mb = float(self._suffix_grad_mb()[e] - self.grad_mb[m].max())
        workspace_mb = float(self.earliest_mb[e]) - slack_mb
        steady = self.base_mb + tensors_mb + workspace_mb
        return {
            "peak_mb": max(self.load_mb, steady),
            "load_mb": self.load_mb,
            "base_mb": self.base_mb,
            "import_mb": self.import_mb,
            "weights_mb": self.weights_mb,
            "tensors_mb": tensors_mb,
            "workspace_mb": workspace_mb,
            "gradient_slack_mb": slack_mb,
            "earliest": e,
        }

    def peak_mb(self, mask) -> float:
        """Predicted peak RSS (MiB) of training ``mask`` (bool [N], non-empty)."""
        return self.parts_mb(mask)["peak_mb"]

    def peak_mb_many(self, masks) -> np.ndarray:
        """Vectorised :meth:`peak_mb` over bool [K, N] (non-empty rows), float64 [K] MiB."""
        m = np.asarray(masks, dtype=bool)
        if m.ndim != 2 or m.shape[1] != len(self.tensors) or not m.any(axis=1).all():
            raise ConfigError(f"masks must be non-empty bool rows of length {len(self.tensors)}")
        first = m.argmax(axis=1)
        slack = self._suffix_grad_mb()[first] - np.where(m, self.grad_mb, 0.0).max(axis=1)
        steady = self.base_mb + m @ self.tensor_mb + self.earliest_mb[first] - slack
        return np.maximum(self.load_mb, steady)

    def min_feasible_mb(self) -> float:
        """Smallest memory budget (MiB) under which the DP can train some single tensor (by its
        costs, :class:`etgraph.selection.MemoryCosts`: the suffix workspace, an upper bound)."""
        return float(
            max(self.load_mb, self.base_mb + float(np.min(self.tensor_mb + self.earliest_mb)))
        )

    @property
    def full_peak_mb(self) -> float:
        """Predicted peak of full training (every tensor selected), MiB."""
        return self.peak_mb(np.ones(len(self.tensors), dtype=bool))

    # -- JSON ------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """JSON-ready dict (format :data:`MEMORY_FORMAT_VERSION`); per-tensor rows under
        ``"tensor_memory"``."""
        out: dict = {"format_version": MEMORY_FORMAT_VERSION}
        for f in dataclasses.fields(self):
            if f.name in ("tensors", "tensor_mb", "earliest_mb"):
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["tensor_memory"] = [
            {"index": i, "name": n, "tensor_mb": float(t), "earliest_mb": float(a)}
            for i, (n, t, a) in enumerate(
                zip(self.tensors, self.tensor_mb, self.earliest_mb, strict=True)
            )
        ]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> MemoryProfile:
        """Inverse of :meth:`to_dict`.

        Raises:
            ProfileMismatchError: another format version.
            KeyError, TypeError: a required field is missing or malformed.
        """
        version = data.get("format_version")
        if version != MEMORY_FORMAT_VERSION:
            raise ProfileMismatchError(
                f"memory profile format {version!r} is not {MEMORY_FORMAT_VERSION}: "
                "delete it and compile again"
            )
        rows = data["tensor_memory"]
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        return cls(
            tensors=[r["name"] for r in rows],
            tensor_mb=[r["tensor_mb"] for r in rows],
            earliest_mb=[r["earliest_mb"] for r in rows],
            **kwargs,
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write as JSON atomically; returns the path."""
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> MemoryProfile:
        """Read a memory profile written by :meth:`save`.

        Raises:
            ConfigError: the file is missing or not valid JSON.
            ProfileMismatchError: another format version, or a missing field.
        """
        path = Path(path)
        data = read_json(
            path, what="memory profile", if_missing="compile again", if_unreadable="delete it"
        )
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError) as exc:
            raise ProfileMismatchError(
                f"memory profile {path} lacks field {exc}: delete it and compile again"
            ) from exc

    def check_matches(
        self,
        model_hash: str,
        *,
        batch_size: int,
        input_shape: Sequence[int],
        threads: int,
        frozen_bn: str | None = None,
    ) -> None:
        """Raise :class:`ProfileMismatchError` unless this memory profile fits the setting
        (``frozen_bn`` None: any batch-norm mode)."""
        if frozen_bn is not None and frozen_bn != self.frozen_bn:
            raise ProfileMismatchError(
                f"memory profile is of --frozen-bn {self.frozen_bn}, not {frozen_bn}: measure "
                "it again in that mode (compile with the same --frozen-bn)"
            )
        setting = (model_hash, int(batch_size), tuple(int(d) for d in input_shape), int(threads))
        mine = (self.model_hash, self.batch_size, self.input_shape, self.threads)
        if setting != mine:
            raise ProfileMismatchError(
                f"memory profile is of (model {self.model_hash[:12]}, batch {self.batch_size}, "
                f"shape {self.input_shape}, {self.threads} threads), not (model "
                f"{model_hash[:12]}, batch {batch_size}, shape {tuple(input_shape)}, {threads} "
                "threads): delete it and compile again"
            )


def memory_key(
    model_hash: str,
    input_shape: Sequence[int],
    batch_size: int,
    threads: int,
    *,
    frozen_bn: str = DEFAULT_FROZEN_BN,
) -> str:
    """Cache key of a memory profile (16 hex digits), like :func:`etgraph.profile.profile_key`;
    each batch-norm mode has its own."""
    shape = "x".join(str(int(d)) for d in input_shape)
    text = (
        f"memory|{model_hash}|{shape}|{int(batch_size)}|{int(threads)}|{frozen_bn}"
        f"|v{_METHOD_VERSION}"
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]
