"""Tensor timing profiler: measure ``t_dw_us``, ``t_dy_us`` and ``forward_us`` on this device.

Paper §2.2 (time model) and §5 (profiling execution times of tensor training), on ONNX Runtime.
Wall-clock time is measured, never FLOPs. The result is a :class:`Profile` whose timings make
:func:`etgraph.timing.step_us` predict the measured step time of any selection mask::

    step_us(M) = forward_us + sum_k M[k] * t_dw_us[k] + sum_{k >= e(M)} t_dy_us[k]

(branch work counted exactly with :attr:`Profile.branches`, see :mod:`etgraph.timing`).

How the numbers are obtained (``shared/ORT_NOTES.md``, "Profiling"):

1. **Per-node backward times.** Artifacts are generated for a few *configurations* (sets of
   trainable tensors): ``full`` (all tensors), ``no_kernels`` (kernels frozen, biases/norms/
   embeddings trainable, so gradients still flow everywhere) and ``first_only`` (only tensor 0
   trainable, so every later layer computes its input gradient and nothing else). Each
   ``training_model.onnx`` runs in a plain ``onnxruntime.InferenceSession`` with
   ``enable_profiling`` (the training API cannot end profiling), fed the input batch, labels,
   the parameters, zero ``<param>_grad.accumulation.buffer`` s and ``lazy_reset_grad=[True]``;
   ``warmup`` runs are discarded, and of ``repeats`` runs of each node's ``<node>_kernel_time``
   event the 20th percentile is kept (:func:`robust_time`; a shared machine only ever adds
   time, so the low end is what reproduces; the same statistic times real steps). Each node
   also pays the executor's per-node cost outside its kernel, measured once on a chain of
   trivial nodes (``node_overhead_us``, ~1 µs).
2. **Charging** (``HELPERS_BRIEF.md``, "Charging rule"): every node of the ``full`` training graph
   is charged through :func:`etgraph.graph.charges` to one tensor's ``t_dw_us`` or ``t_dy_us``,
   or to the forward pass. Fused ``ConvGrad`` nodes (kind ``split``) compute dX, dW and dB in one
   kernel; they are split **by measurement**: in each configuration the node's non-empty outputs
   say which parts it computed, and its measured times over the configurations are solved for
   the per-part times by non-negative least squares (e.g. dW = full - no_kernels, dB = no_kernels
   - first_only, dX = first_only), rescaled to sum to the ``full`` time. dX goes where the charge
   says, dW to the kernel's ``t_dw_us``, dB to the bias's ``t_dw_us``.
3. **Optimizer.** ORT's optimizer model is ONE ``AdamWOptimizer`` node over the sequence of
   trainable tensors. Its kernel time is measured in a profiled ``InferenceSession`` for several
   subsets of the tensors (all, kernels only, the rest, halves, single tensors) and fitted as
   ``fixed + per_tensor * count + per_element * elements``; the per-tensor part
   ``per_tensor + per_element * numel[k]`` is added to ``t_dw_us[k]`` (it is paid exactly when
   tensor k is selected), the fixed part goes into ``forward_us``.
4. **Calibration.** ``full_step_us`` is MEASURED with ``onnxruntime.training.api`` (Module train
   step + ``Optimizer.step`` + ``lazy_reset_grad``), as are the steps of the other
   configurations; all measurements (profiled graphs, real steps, optimizer subsets) are taken
   round-robin, one run each per round, so load changes on a shared machine hit them alike.
   What the node and optimizer times do not explain (per-step session and binding cost,
   profiling bias) is ``step_overhead_us``, the mean residual over the configurations, folded
   into ``forward_us``. Measured vs predicted steps of the configurations are kept in
   ``checks``. Steps are timed by wall clock; ``clock="cpu"`` (one thread only) times them by
   the calling thread's CPU time instead, which other processes on a shared machine disturb
   far less (:func:`step_clock`).

5. **Forward work only training needs.** Where backward nodes consume the forward part, ORT
   keeps activations and cannot fuse (Conv+Relu, MatMul+Add); where no gradient passes, the
   forward runs as in inference, faster. A fourth configuration, ``last_only`` (only the last
   tensor trainable), is timed as a real step; the share of the forward it saves
   (``forward_saved_fraction``, :func:`saved_forward_fraction`) is moved from the forward pass
   to ``t_dy_us`` of each forward node's anchor tensor (the latest tensor consumed at or before
   it), so it is paid exactly when the earliest selected tensor is at or before the anchor.

``forward_us`` is therefore the selection-independent part of a step: forward pass and loss
(``forward_pass_us``, less the moved share) + optimizer fixed cost + ``step_overhead_us``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import ConfigError, ModelError, ProfileMismatchError
from .model import LoadedModel
from .model import input_shape as model_input_shape
from .sessions import session_options

log = logging.getLogger(__name__)

PROFILE_FORMAT_VERSION = 3  # 2: branch charges; 3: measured without thread-pool spinning

#: Output position of each part of ConvGrad / ConvTransposeGrad (dX, dW, dB).
_CONV_GRAD_PARTS = ("dx", "dw", "db")


# --------------------------------------------------------------------------------------------
# The Profile
# --------------------------------------------------------------------------------------------


@dataclass
class Profile:
    """Measured per-tensor timings of one model on this device (paper §5).

    Attributes:
        model_hash: :func:`etgraph.onnx_io.model_hash` of the profiled model.
        tensors: trainable tensor names, forward order (index 0 nearest the input), length N.
        kinds: tensor kinds (kernel, bias, gamma, beta, embedding, ...), length N.
        t_dw_us: float64 [N] µs: time to compute (and apply with AdamW) tensor k's own gradient;
            paid iff tensor k is selected.
        t_dy_us: float64 [N] µs: time of the error-gradient work charged to tensor k; paid iff the
            earliest selected tensor is at or before k.
        forward_us: µs paid by every step whatever the selection: ``forward_pass_us +
            optimizer_fixed_us + step_overhead_us``.
        full_step_us: MEASURED step (robust_time) with all tensors trainable (training API), µs.
        batch_size, input_shape (C, H, W), threads (intra-op threads), ort_version, host.
        clock: how real steps were timed, ``"wall"`` or ``"cpu"`` (:func:`step_clock`).
        forward_pass_us: forward + loss kernels (+ per-node overhead), µs.
        optimizer_fixed_us, optimizer_per_tensor_us, optimizer_per_element_us: AdamW fit, µs.
        node_overhead_us: executor cost per node outside its kernel, µs.
        step_overhead_us: measured step minus what nodes and optimizer explain, mean over the
            profiled configurations (:func:`calibrate`), µs.
        forward_saved_fraction: share of a layer's forward time saved when no gradient passes
            it (:func:`saved_forward_fraction`); that share is on ``t_dy_us`` of the layer's
            anchor tensor, the rest in ``forward_pass_us``.
        repeats, warmup: runs per measurement.
        profiling_s: wall time the profiling took, s.
        checks: ``{configuration: {"measured_us", "predicted_us", "mask"}}`` for the extra
            configurations profiled (a built-in validation of the time model).
        nodes: per backward-graph node ``{name, op, us, charge, tensor}`` of the full graph.
        branches: ``t_dy`` work of ops on parallel branches (D(o) not a prefix), grouped:
            ``[{"tensor", "prefix", "extra": [indices], "us"}]`` (:class:`~etgraph.timing.
            BranchCharges`); already inside ``t_dy_us``, used to count it exactly.
    """

    model_hash: str
    tensors: list[str]
    kinds: list[str]
    t_dw_us: np.ndarray
    t_dy_us: np.ndarray
    forward_us: float
    full_step_us: float
    batch_size: int
    input_shape: tuple[int, ...]
    threads: int
    ort_version: str
    host: str
    clock: str = "wall"
    forward_pass_us: float = 0.0
    optimizer_fixed_us: float = 0.0
    optimizer_per_tensor_us: float = 0.0
    optimizer_per_element_us: float = 0.0
    node_overhead_us: float = 0.0
    step_overhead_us: float = 0.0
    forward_saved_fraction: float = 0.0
    repeats: int = 0
    warmup: int = 0
    profiling_s: float = 0.0
    checks: dict = field(default_factory=dict)
    nodes: list = field(default_factory=list)
    branches: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.t_dw_us = np.asarray(self.t_dw_us, dtype=np.float64)
        self.t_dy_us = np.asarray(self.t_dy_us, dtype=np.float64)
        self.input_shape = tuple(int(d) for d in self.input_shape)

    def to_dict(self) -> dict:
        """JSON-ready dict; per-tensor rows under ``"tensor_timings"``."""
        out = {"format_version": PROFILE_FORMAT_VERSION}
        for f in dataclasses.fields(self):
            if f.name in ("tensors", "kinds", "t_dw_us", "t_dy_us"):
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["tensor_timings"] = [
            {"index": i, "name": n, "kind": k, "t_dw_us": float(dw), "t_dy_us": float(dy)}
            for i, (n, k, dw, dy) in enumerate(
                zip(self.tensors, self.kinds, self.t_dw_us, self.t_dy_us, strict=True)
            )
        ]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        """Inverse of :meth:`to_dict`. Raises ProfileMismatchError on an unknown format."""
        if data.get("format_version") != PROFILE_FORMAT_VERSION:
            raise ProfileMismatchError(
                f"profile format {data.get('format_version')!r} is not "
                f"{PROFILE_FORMAT_VERSION}: re-run `etgraph profile`"
            )
        rows = data["tensor_timings"]
        kwargs = {k: v for k, v in data.items() if k not in ("format_version", "tensor_timings")}
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in kwargs.items() if k in known}
        return cls(
            tensors=[r["name"] for r in rows],
            kinds=[r["kind"] for r in rows],
            t_dw_us=[r["t_dw_us"] for r in rows],
            t_dy_us=[r["t_dy_us"] for r in rows],
            **kwargs,
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON (atomically) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        """Read a profile written by :meth:`save`.

        Raises:
            ConfigError: the file is missing or not valid JSON.
            ProfileMismatchError: the file is a profile of another format version.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"profile {path} does not exist: run `etgraph profile`") from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"profile {path} is not readable JSON ({exc}): delete it") from exc
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError) as exc:
            raise ProfileMismatchError(
                f"profile {path} lacks field {exc}: re-run `etgraph profile`"
            ) from exc

    def check_matches(
        self,
        model_hash: str,
        *,
        batch_size: int | None = None,
        input_shape: Sequence[int] | None = None,
        threads: int | None = None,
        clock: str | None = None,
    ) -> None:
        """Raise :class:`ProfileMismatchError` unless this profile fits the given setting.

        Args:
            model_hash: :func:`etgraph.onnx_io.model_hash` of the model it is used for.
            batch_size, input_shape, threads, clock: checked when given.
        """
        if model_hash != self.model_hash:
            raise ProfileMismatchError(
                f"profile is of model {self.model_hash[:12]}, not {model_hash[:12]}: "
                "profile this model (`etgraph profile MODEL.onnx`)"
            )
        if batch_size is not None and int(batch_size) != self.batch_size:
            raise ProfileMismatchError(
                f"profile was measured at batch size {self.batch_size}, not {batch_size}: "
                "re-profile with --batch-size"
            )
        if input_shape is not None and tuple(int(d) for d in input_shape) != self.input_shape:
            raise ProfileMismatchError(
                f"profile was measured at input shape {_fmt_shape(self.input_shape)}, not "
                f"{_fmt_shape(input_shape)}: re-profile with --input-shape"
            )
        if threads is not None and int(threads) != self.threads:
            raise ProfileMismatchError(
                f"profile was measured with {self.threads} threads, not {threads}: "
                "re-profile with --threads"
            )
        if clock is not None and clock != self.clock:
            raise ProfileMismatchError(
                f"profile timed steps with the {self.clock} clock, not {clock}: re-profile"
            )

    @property
    def t_full_us(self) -> float:
        """``T_full`` of paper Eq. (1): the time model's step with every tensor selected, in µs.

        The budget ``rho * T_full`` compares two estimates of the same time model (the paper's
        ``T_selective(M) <= rho * T_full``), so ``rho = 1`` always admits every tensor, however
        noisy the measured ``full_step_us`` was. ``full_step_us`` stays the measurement that
        validates the model.
        """
        return float(self.forward_us + self.t_dw_us.sum() + self.t_dy_us.sum())

    @property
    def branch_charges(self):
        """:class:`etgraph.timing.BranchCharges` of :attr:`branches`."""
        from .timing import BranchCharges

        return BranchCharges.from_rows(self.branches, len(self.tensors))

    def predicted_step_us(self, mask) -> float:
        """:func:`etgraph.timing.step_us` of ``mask`` (bool [N]) with this profile's timings,
        branch work counted exactly."""
        from .timing import step_us

        return step_us(mask, self.t_dw_us, self.t_dy_us, self.forward_us, self.branch_charges)


def _fmt_shape(shape: Sequence[int]) -> str:
    return "x".join(str(int(d)) for d in shape)


def default_cache_dir() -> Path:
    """Default profile cache: ``$ETGRAPH_CACHE/profiles``, else ``~/.cache/etgraph/profiles``."""
    root = os.environ.get("ETGRAPH_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "etgraph"
    return base / "profiles"


def profile_key(
    model_hash: str, input_shape: Sequence[int], batch_size: int, threads: int, clock: str = "wall"
) -> str:
    """Cache key of a profile: sha256 over model hash, input shape, batch size, threads, clock."""
    text = (
        f"{model_hash}|{_fmt_shape(input_shape)}|{int(batch_size)}|{int(threads)}|{clock}"
        f"|v{PROFILE_FORMAT_VERSION}"
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Host facts
# --------------------------------------------------------------------------------------------


def physical_cores() -> int:
    """Number of physical CPU cores (distinct (package, core) pairs in sysfs; else cpu_count)."""
    cores = set()
    for topo in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        try:
            cores.add(((topo / "physical_package_id").read_text(), (topo / "core_id").read_text()))
        except OSError:
            continue
    return len(cores) or os.cpu_count() or 1


def host_description() -> str:
    """``hostname (machine, CPU model)`` of this host."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()} ({platform.machine()}, {cpu})"


# --------------------------------------------------------------------------------------------
# Measurement core (ONNX Runtime)
# --------------------------------------------------------------------------------------------

#: Quantile of repeated timings used as "the" time of a node or step. A low quantile rather
#: than the median: on a shared machine other processes only ever add time, so the lower end of
#: the distribution is what is reproducible (the median of a 2-core box shared by busy
#: neighbours moves by 2x between minutes). Same statistic for profiling and validation.
TIME_QUANTILE = 0.2


CLOCKS = ("wall", "cpu")


def step_clock(clock: str, threads: int):
    """The timer for real steps: ``"wall"`` = ``time.perf_counter`` (the paper's wall clock,
    default); ``"cpu"`` = ``time.thread_time``, the CPU time of the calling thread, which with
    one intra-op thread (ORT then runs every kernel on the caller) is the step's compute time
    without the time other processes take the core away — for validating the time model on a
    shared machine.

    Raises:
        ConfigError: unknown clock, or ``"cpu"`` with ``threads != 1`` (other threads' work
            would not be counted).
    """
    if clock == "wall":
        return time.perf_counter
    if clock == "cpu":
        if threads != 1:
            raise ConfigError(
                f"the cpu clock needs --threads 1 (got {threads}): use the wall clock"
            )
        return time.thread_time
    raise ConfigError(f"clock must be one of {CLOCKS}, got {clock!r}")


def robust_time(values) -> float:
    """The :data:`TIME_QUANTILE` quantile of repeated timings (same unit as the input)."""
    return float(np.quantile(np.asarray(values, dtype=np.float64), TIME_QUANTILE))


@dataclass
class NodeTiming:
    """One node of a training graph: op type, outputs (``""`` = not computed), µs (robust_time)."""

    op: str
    outputs: list[str]
    us: float


@dataclass
class _Batch:
    inputs: np.ndarray  # float32 [B, C, H, W]
    labels: np.ndarray  # int64 [B]


def _make_batch(batch_size: int, input_shape: Sequence[int], num_classes: int) -> _Batch:
    rng = np.random.default_rng(0)
    return _Batch(
        inputs=rng.standard_normal((batch_size, *input_shape)).astype(np.float32),
        labels=rng.integers(0, num_classes, size=batch_size).astype(np.int64),
    )


def _training_feeds(session, weights: dict[str, np.ndarray], batch: _Batch) -> dict:
    """Feeds for ``training_model.onnx`` run as a plain inference session."""
    feeds = {}
    for inp in session.get_inputs():
        name = inp.name
        if name == "input":
            feeds[name] = batch.inputs
        elif name == "labels":
            feeds[name] = batch.labels
        elif name == "lazy_reset_grad":
            feeds[name] = np.array([True])
        elif name.endswith("_grad.accumulation.buffer"):
            param = name[: -len("_grad.accumulation.buffer")]
            feeds[name] = np.zeros_like(weights[param])
        elif name in weights:
            feeds[name] = weights[name]
        else:
            raise ModelError(f"training graph input {name!r} is neither data nor a parameter")
    return feeds


def _parse_trace(trace_path: str, warmup: int) -> dict[str, float]:
    """:func:`robust_time` of ``<node>_kernel_time`` durations (µs) per node, dropping each
    node's first ``warmup`` events (one event per node per run)."""
    with open(trace_path) as fh:
        events = json.load(fh)
    durations: dict[str, list[float]] = defaultdict(list)
    for ev in sorted(events, key=lambda e: e.get("ts", 0)):
        name = ev.get("name", "")
        if ev.get("cat") == "Node" and name.endswith("_kernel_time"):
            durations[name[: -len("_kernel_time")]].append(float(ev["dur"]))
    return {
        node: robust_time(d[warmup:] if len(d) > warmup else d) for node, d in durations.items()
    }


class _ProfiledGraph:
    """A ``training_model.onnx`` in a profiled plain ``InferenceSession`` (one run per round)."""

    def __init__(self, training_model, weights, batch, *, threads, work_dir):
        import onnxruntime as ort

        self.path = Path(training_model)
        prefix = str(Path(work_dir) / f"ort_trace_{self.path.parent.name}")
        self.session = ort.InferenceSession(
            str(self.path), session_options(threads, prefix), providers=["CPUExecutionProvider"]
        )
        self.feeds = _training_feeds(self.session, weights, batch)

    def step(self) -> None:
        self.session.run(None, self.feeds)

    def result(self, warmup: int) -> dict[str, NodeTiming]:
        trace = self.session.end_profiling()
        medians = _parse_trace(trace, warmup)
        Path(trace).unlink(missing_ok=True)
        graph = onnx.load(str(self.path), load_external_data=False).graph
        return {
            node.name: NodeTiming(node.op_type, list(node.output), medians[node.name])
            for node in graph.node
            if node.name in medians
        }


class _TrainStep:
    """Real training steps with ``onnxruntime.training.api`` (one step per round)."""

    def __init__(self, artifact_dir, batch, *, threads, clock="wall"):
        from onnxruntime.training import api

        self.clock = step_clock(clock, threads)
        d = Path(artifact_dir)
        self.batch = batch
        self.state = api.CheckpointState.load_checkpoint(str(d / "checkpoint"))
        self.module = api.Module(
            str(d / "training_model.onnx"),
            self.state,
            str(d / "eval_model.onnx"),
            session_options=session_options(threads),
        )
        self.optimizer = api.Optimizer(str(d / "optimizer_model.onnx"), self.module)
        self.module.train()
        self.times: list[float] = []

    def step(self) -> None:
        t0 = self.clock()
        self.module(self.batch.inputs, self.batch.labels)
        self.optimizer.step()
        self.module.lazy_reset_grad()
        self.times.append(self.clock() - t0)

    def result(self, warmup: int) -> float:
        return robust_time(self.times[warmup:]) * 1e6


@dataclass
class OptimizerFit:
    """AdamW kernel time model: ``fixed_us + per_tensor_us * count + per_element_us * elements``."""

    fixed_us: float
    per_tensor_us: float
    per_element_us: float

    def tensor_us(self, numel: np.ndarray) -> np.ndarray:
        """Per-tensor part (µs) for tensors of ``numel`` elements, float64 [N]."""
        return self.per_tensor_us + self.per_element_us * np.asarray(numel, dtype=np.float64)


class _OptimizerSubsets:
    """The ``AdamWOptimizer`` node, profiled on several subsets of tensors (each once per round)."""

    def __init__(self, optimizer_model, params, subsets, *, threads, work_dir):
        import onnxruntime as ort

        self.session = ort.InferenceSession(
            str(optimizer_model),
            session_options(threads, str(Path(work_dir) / "ort_trace_optimizer")),
            providers=["CPUExecutionProvider"],
        )
        self.subsets = [list(s) for s in subsets]
        self.feeds = [
            {
                "learning_rate": np.array([1e-4], np.float32),
                "step": np.array([1], np.int64),
                "params": [params[n].copy() for n in s],
                "gradients": [np.full_like(params[n], 1e-3) for n in s],
                "first_order_moments": [np.zeros_like(params[n]) for n in s],
                "second_order_moments": [np.zeros_like(params[n]) for n in s],
            }
            for s in self.subsets
        ]
        self.sizes = [(len(s), sum(params[n].size for n in s)) for s in self.subsets]
        self.rounds = 0

    def step(self) -> None:
        for feeds in self.feeds:
            self.session.run(None, feeds)
        self.rounds += 1

    def result(self, warmup: int) -> list[tuple[int, int, float]]:
        trace = self.session.end_profiling()
        with open(trace) as fh:
            events = json.load(fh)
        Path(trace).unlink(missing_ok=True)
        durs = [
            float(e["dur"])
            for e in sorted(events, key=lambda e: e.get("ts", 0))
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")
        ]
        k = len(self.feeds)
        if len(durs) != k * self.rounds:
            raise ModelError(
                f"optimizer trace has {len(durs)} kernel events, expected {k * self.rounds}"
            )
        per_subset = np.array(durs).reshape(self.rounds, k)[warmup:]
        return [
            (count, elements, robust_time(per_subset[:, i]))
            for i, (count, elements) in enumerate(self.sizes)
        ]


def _round_robin(runners: Sequence, repeats: int, warmup: int) -> None:
    """Step every runner once per round for ``warmup + repeats`` rounds, so that changes of the
    machine's load hit every measurement alike (the machine may be shared)."""
    for _ in range(warmup + repeats):
        for runner in runners:
            runner.step()


def optimizer_subsets(params: dict[str, np.ndarray]) -> list[list[str]]:
    """Subsets of tensors the optimizer is measured on: all, multi-dim, 1-D, each half, the
    largest and the smallest tensor alone (empty ones dropped)."""
    names = list(params)
    sizes = {n: params[n].size for n in names}
    half = len(names) // 2
    subsets = [
        names,
        [n for n in names if params[n].ndim > 1],
        [n for n in names if params[n].ndim <= 1],
        names[:half],
        names[half:],
        [max(names, key=sizes.get)],
        [min(names, key=sizes.get)],
    ]
    return [s for s in subsets if s]


def fit_optimizer(observations: Sequence[tuple[int, int, float]]) -> OptimizerFit:
    """Non-negative least-squares fit of ``(count, elements, µs)`` observations of the AdamW
    kernel to ``fixed + per_tensor * count + per_element * elements``."""
    from scipy.optimize import nnls

    a = np.array([[1.0, c, e] for c, e, _ in observations])
    b = np.array([t for _, _, t in observations])
    scale = np.abs(a).max(axis=0)
    coef, _ = nnls(a / scale, b)
    coef = coef / scale
    return OptimizerFit(float(coef[0]), float(coef[1]), float(coef[2]))


def profile_training_graph(
    training_model: str | os.PathLike,
    weights: dict[str, np.ndarray],
    batch: _Batch,
    *,
    threads: int,
    repeats: int,
    warmup: int,
    work_dir: str | os.PathLike,
) -> dict[str, NodeTiming]:
    """Run a ``training_model.onnx`` with ORT profiling; kernel time (µs) per node.

    The graph runs in a plain ``onnxruntime.InferenceSession`` with ``enable_profiling`` fed the
    batch, the parameters, zero gradient accumulation buffers and ``lazy_reset_grad=[True]``.

    Args:
        training_model: path of the training graph (from :func:`etgraph.artifacts.generate`).
        weights: every parameter the graph takes as input (trainable and frozen), by name.
        batch: input ``float32 [B, C, H, W]`` and labels ``int64 [B]``.
        threads: intra-op threads. repeats, warmup: measured and discarded runs.
        work_dir: where ORT writes its JSON trace (deleted after parsing).

    Returns:
        ``{node name: NodeTiming}`` for every node that ran.
    """
    runner = _ProfiledGraph(training_model, weights, batch, threads=threads, work_dir=work_dir)
    _round_robin([runner], repeats, warmup)
    return runner.result(warmup)


def measure_train_steps_us(
    artifact_dirs: Sequence[str | os.PathLike],
    batch: _Batch,
    *,
    threads: int,
    repeats: int,
    warmup: int,
    clock: str = "wall",
) -> list[float]:
    """Median wall time (µs) of one real training step for each set of artifacts.

    A step is what ``onnxruntime.training.api`` does per batch: ``Module(input, labels)``
    (forward + backward + gradient accumulation), ``Optimizer.step()`` (AdamW) and
    ``Module.lazy_reset_grad()``. The artifact sets are stepped round-robin (one step each per
    round), so a change of machine load hits all of them alike and their ratios stay right.

    Args:
        artifact_dirs: directories of the four artifacts (:class:`etgraph.artifacts.ArtifactPaths`).
        batch: input and labels. threads: intra-op threads. repeats, warmup: rounds.
        clock: ``"wall"`` or ``"cpu"`` (:func:`step_clock`).

    Returns:
        One robust_time per directory, µs, in the given order.
    """
    runners = [_TrainStep(d, batch, threads=threads, clock=clock) for d in artifact_dirs]
    _round_robin(runners, repeats, warmup)
    return [r.result(warmup) for r in runners]


def measure_selection_steps_us(
    model_path: str | os.PathLike,
    masks,
    *,
    batch_size: int = 4,
    input_shape: Sequence[int] | None = None,
    threads: int | None = None,
    repeats: int = 10,
    warmup: int = 3,
    work_dir: str | os.PathLike | None = None,
    clock: str = "wall",
    group: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Measured step times (µs) of training exactly the tensors of each mask.

    For each mask, artifacts are generated (``requires_grad`` = selected tensors; the others and
    the BatchNorm running statistics frozen); groups of ``group`` masks are stepped round-robin
    with the full-training artifacts (:func:`measure_train_steps_us`), so each mask also gets a
    full step measured under the same machine load. This is the ground truth
    :func:`etgraph.timing.step_us` is validated against (tests, ``benchmarks/time_model.py``).

    Args:
        model_path: forward ONNX model. masks: bool [K, N], forward order, no empty row.
        batch_size, input_shape, threads, repeats, warmup: as in :func:`profile_model`.
        work_dir: where the artifacts go (default: a temporary directory, removed).
        clock: ``"wall"`` or ``"cpu"`` (:func:`step_clock`).
        group: masks per round-robin group (more = fewer full steps, more memory).

    Returns:
        ``(mask_us float64 [K], full_us float64 [K])``: each mask's step and the full step of
        its group.

    Raises:
        ConfigError: a mask is empty or has the wrong length.
    """
    from . import artifacts, graph

    model = LoadedModel.load(model_path).proto
    shape = tuple(model_input_shape(model, input_shape))
    threads = physical_cores() if threads is None else int(threads)
    step_clock(clock, threads)
    tensors = graph.trainable_tensors(model)
    masks = np.atleast_2d(np.asarray(masks, dtype=bool))
    if masks.shape[1] != len(tensors) or not masks.any(axis=1).all():
        raise ConfigError(f"selection masks must be non-empty bool rows of length {len(tensors)}")
    names = [t.name for t in tensors]
    stats = list(graph.running_statistics(model))
    model_b = _with_batch(model, batch_size, shape)
    batch = _make_batch(batch_size, shape, _num_classes(model))
    mask_us = np.zeros(len(masks))
    full_us = np.zeros(len(masks))
    with tempfile.TemporaryDirectory(prefix="etgraph-steps-", dir=work_dir) as work:
        full_dir = artifacts.generate(model_b, names, stats, Path(work) / "full").directory
        for start in range(0, len(masks), group):
            dirs = []
            for k in range(start, min(start + group, len(masks))):
                trainable = [n for n, m in zip(names, masks[k], strict=True) if m]
                frozen = [n for n, m in zip(names, masks[k], strict=True) if not m] + stats
                paths = artifacts.generate(model_b, trainable, frozen, Path(work) / f"m{k}")
                dirs.append(paths.directory)
            times = measure_train_steps_us(
                [*dirs, full_dir],
                batch,
                threads=threads,
                repeats=repeats,
                warmup=warmup,
                clock=clock,
            )
            mask_us[start : start + len(dirs)] = times[:-1]
            full_us[start : start + len(dirs)] = times[-1]
            log.info("selections %d-%d measured", start, start + len(dirs) - 1)
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
    return mask_us, full_us


def measure_node_overhead_us(threads: int, *, nodes: int = 400, repeats: int = 30) -> float:
    """Executor cost per node outside its kernel (µs): wall time of a chain of ``nodes`` trivial
    ``Neg`` nodes on a 1-element tensor, minus a 1-node chain, divided by ``nodes - 1``."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def chain(k: int) -> bytes:
        body = [helper.make_node("Neg", [f"t{i}"], [f"t{i + 1}"]) for i in range(k)]
        g = helper.make_graph(
            body,
            "chain",
            [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info(f"t{k}", TensorProto.FLOAT, [1])],
        )
        return helper.make_model(
            g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9
        ).SerializeToString()

    so = session_options(threads)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    x = {"t0": np.ones(1, np.float32)}
    medians = []
    for k in (1, nodes):
        sess = ort.InferenceSession(chain(k), so, providers=["CPUExecutionProvider"])
        times = []
        for _ in range(repeats + 3):
            t0 = time.perf_counter()
            sess.run(None, x)
            times.append(time.perf_counter() - t0)
        medians.append(robust_time(times[3:]))
    return max(0.0, (medians[1] - medians[0]) * 1e6 / (nodes - 1))


def measure_optimizer(
    optimizer_model: str | os.PathLike,
    params: dict[str, np.ndarray],
    *,
    threads: int,
    repeats: int,
    warmup: int,
    work_dir: str | os.PathLike,
) -> tuple[OptimizerFit, list[tuple[int, int, float]]]:
    """Measure the single ``AdamWOptimizer`` node as a function of the selection and fit it.

    The optimizer model takes sequences, so one model serves every subset: its kernel time is
    profiled on :func:`optimizer_subsets` and fitted by :func:`fit_optimizer`.

    Args:
        optimizer_model: ``optimizer_model.onnx`` of any artifacts of the model.
        params: trainable tensors by name (float32 arrays), forward order.

    Returns:
        ``(fit, observations)`` with observations ``(count, elements, kernel µs)``.
    """
    runner = _OptimizerSubsets(
        optimizer_model, params, optimizer_subsets(params), threads=threads, work_dir=work_dir
    )
    _round_robin([runner], repeats, warmup)
    obs = runner.result(warmup)
    return fit_optimizer(obs), obs


# --------------------------------------------------------------------------------------------
# Splitting fused ConvGrad by measurement
# --------------------------------------------------------------------------------------------


def conv_grad_parts(outputs: Sequence[str]) -> frozenset[str]:
    """Which of dX, dW, dB a ConvGrad node computes: its non-empty outputs (0, 1, 2)."""
    return frozenset(p for p, o in zip(_CONV_GRAD_PARTS, outputs, strict=False) if o)


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
    from scipy.optimize import nnls

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


# --------------------------------------------------------------------------------------------
# profile_model
# --------------------------------------------------------------------------------------------


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
        overhead_us: per-step overhead of the e=0 configurations (:func:`calibrate`).
        last_only_residual_us: measured minus explained step of the last_only configuration.
        anchored_forward_us: full-graph forward node time anchored before the last tensor.
    """
    if anchored_forward_us <= 0:
        return 0.0
    return float(np.clip((overhead_us - last_only_residual_us) / anchored_forward_us, 0.0, 1.0))


def _forward_us_by_anchor(model, rows, names, node_overhead) -> np.ndarray:
    """Forward node time (µs, kernel + per-node overhead) of the full training graph per
    anchor tensor: a forward node's anchor is the latest tensor (forward order) consumed by it
    or any forward node before it in graph order — the gradient passes the node iff the
    earliest selected tensor is at or before its anchor. Nodes before every tensor have none
    (never on a gradient path) and are left out. float64 [N]."""
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
        name = row["name"].removesuffix("_BatchNormInternal")
        anchor = anchor_of.get(name, -1)
        if anchor >= 0:
            out[anchor] += row["us"] + node_overhead
    return out


def _configurations(tensors) -> dict[str, list[int]]:
    """Sets of trainable tensor indices to profile: full, no_kernels, first_only."""
    n = len(tensors)
    configs = {"full": list(range(n))}
    no_kernels = [t.index for t in tensors if t.kind != "kernel"]
    if no_kernels and len(no_kernels) < n:
        configs["no_kernels"] = no_kernels
    if n > 1:
        configs["first_only"] = [0]
    return configs


def profile_model(
    model_path: str | os.PathLike,
    *,
    batch_size: int = 4,
    input_shape: Sequence[int] | None = None,
    repeats: int = 10,
    warmup: int = 3,
    threads: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    clock: str = "wall",
) -> Profile:
    """Profile per-tensor backward times of an ONNX model on this device (paper §5).

    See the module docstring for the method (configurations, charging, ConvGrad split by
    measurement, optimizer fit, calibration against a measured step).

    Args:
        model_path: forward ONNX model (one input ``input`` ``float32 [B, C, H, W]``, one output
            ``logits`` ``float32 [B, K]``).
        batch_size: B, > 0.
        input_shape: (C, H, W); None = the model's own static shape.
        repeats, warmup: measured / discarded runs per measurement (repeats >= 1, warmup >= 0).
        threads: ORT intra-op threads; None = physical cores. Recorded in the profile.
        cache_dir: if given, profiles are cached there as ``<key>.json`` keyed by model hash,
            input shape, batch size, threads and clock (:func:`profile_key`); a hit is
            returned as is.
        clock: how real steps (``full_step_us``, calibration) are timed: ``"wall"`` (default)
            or ``"cpu"`` (thread CPU time, needs ``threads=1``; see :func:`step_clock`).

    Returns:
        The :class:`Profile` (``t_dw_us``/``t_dy_us`` float64 [N], forward order).

    Raises:
        ModelError, UnsupportedOpError: the model cannot be loaded or trained.
        ConfigError: bad batch size, input shape, repeats or threads.
        ProfileMismatchError: a cached profile under this key belongs to another setting.
    """
    from . import onnx_io

    if batch_size <= 0:
        raise ConfigError(f"batch size must be a positive integer, got {batch_size}")
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    threads = physical_cores() if threads is None else int(threads)
    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    step_clock(clock, threads)
    model = LoadedModel.load(model_path).proto
    shape = tuple(model_input_shape(model, input_shape))
    model_hash = onnx_io.model_hash(model)

    cache_path = None
    if cache_dir is not None:
        cache_path = (
            Path(cache_dir) / f"{profile_key(model_hash, shape, batch_size, threads, clock)}.json"
        )
        if cache_path.is_file():
            cached = Profile.load(cache_path)
            cached.check_matches(
                model_hash, batch_size=batch_size, input_shape=shape, threads=threads, clock=clock
            )
            log.info("profile cache hit: %s", cache_path)
            return cached

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="etgraph-profile-") as work:
        prof = _profile(model, model_hash, shape, batch_size, repeats, warmup, threads, clock, work)
    prof.profiling_s = time.perf_counter() - start
    log.info("profiled %d tensors in %.1f s", len(prof.tensors), prof.profiling_s)
    if cache_path is not None:
        prof.save(cache_path)
    return prof


def _profile(
    model, model_hash, shape, batch_size, repeats, warmup, threads, clock, work
) -> Profile:
    import onnxruntime as ort

    from . import artifacts, graph

    tensors = graph.trainable_tensors(model)
    if not tensors:
        raise ModelError("the model has no trainable tensors: nothing to profile")
    names = [t.name for t in tensors]
    index = {n: i for i, n in enumerate(names)}
    stats = list(graph.running_statistics(model))
    weights = {
        init.name: numpy_helper.to_array(init)
        for init in model.graph.initializer
        if init.name in index or init.name in set(stats)
    }
    num_classes = _num_classes(model)
    batch = _make_batch(batch_size, shape, num_classes)
    model_b = _with_batch(model, batch_size, shape)

    configs = _configurations(tensors)
    art_dirs = {}
    for cname, sel in configs.items():
        trainable = [names[i] for i in sel]
        frozen = [n for n in names if n not in set(trainable)] + stats
        art_dirs[cname] = artifacts.generate(
            model_b, trainable, frozen, Path(work) / cname
        ).directory
    last_dir = None
    if len(names) > 2:  # only the last tensor trainable: the forward runs almost as inference
        last_dir = artifacts.generate(
            model_b, names[-1:], names[:-1] + stats, Path(work) / "last_only"
        ).directory
    node_overhead = measure_node_overhead_us(threads)
    try:  # ORT raises here when the model does not run at this input shape
        # All measurements interleaved round by round: profiled graphs, real steps, optimizer.
        graphs = {
            c: _ProfiledGraph(
                d / "training_model.onnx", weights, batch, threads=threads, work_dir=work
            )
            for c, d in art_dirs.items()
        }
        steps = {c: _TrainStep(d, batch, threads=threads, clock=clock) for c, d in art_dirs.items()}
        if last_dir is not None:
            steps["last_only"] = _TrainStep(last_dir, batch, threads=threads, clock=clock)
        params = {n: weights[n].astype(np.float32) for n in names}
        optimizer = _OptimizerSubsets(
            art_dirs["full"] / "optimizer_model.onnx",
            params,
            optimizer_subsets(params),
            threads=threads,
            work_dir=work,
        )
        runners = [r for c in art_dirs for r in (graphs[c], steps[c])] + [optimizer]
        if last_dir is not None:
            runners.append(steps["last_only"])
        _round_robin(runners, repeats, warmup)
    except Exception as exc:
        if not (isinstance(exc, RuntimeError) or type(exc).__module__.startswith("onnxruntime")):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelError(
            f"onnxruntime cannot run the model at input shape {_fmt_shape(shape)}, batch "
            f"{batch_size} ({first[-300:]}): pass the shape it was exported for with --input-shape"
        ) from exc
    node_times = {c: g.result(warmup) for c, g in graphs.items()}
    measured = {c: s.result(warmup) for c, s in steps.items()}
    opt_fit = fit_optimizer(optimizer.result(warmup))
    del graphs, steps, optimizer, runners
    for c in configs:
        log.info("config %s: %d nodes, step %.0f us", c, len(node_times[c]), measured[c])
    if last_dir is not None:
        log.info("config last_only: step %.0f us", measured["last_only"])
    numel = np.array([weights[n].size for n in names], dtype=np.float64)

    charges = _charges(model_b, art_dirs["full"] / "training_model.onnx")
    t_dw, t_dy, forward_pass, rows, branch_rows = _charge(
        node_times, configs, charges, names, node_overhead
    )
    t_dw = t_dw + opt_fit.tensor_us(numel)

    from .timing import BranchCharges, backward_us

    branches = BranchCharges.from_rows(branch_rows, len(names))

    full_step = measured["full"]
    masks = {}
    for cname, sel in [*configs.items(), ("last_only", [len(names) - 1])]:
        if cname in measured:
            masks[cname] = np.zeros(len(names), dtype=bool)
            masks[cname][sel] = True
    constant = forward_pass + opt_fit.fixed_us
    explained = {c: constant + backward_us(m, t_dw, t_dy, branches) for c, m in masks.items()}
    step_overhead = calibrate([explained[c] for c in configs], [measured[c] for c in configs])
    # Forward work that only a training graph does (activations kept, no fusion): saved when
    # no gradient passes the layer, so it belongs on t_dy of the layer's anchor tensor.
    forward_by_anchor = _forward_us_by_anchor(model_b, rows, names, node_overhead)
    forward_saved_fraction = 0.0
    if "last_only" in measured:
        forward_saved_fraction = saved_forward_fraction(
            step_overhead,
            measured["last_only"] - explained["last_only"],
            forward_by_anchor[:-1].sum(),
        )
    moved = forward_saved_fraction * forward_by_anchor
    t_dy = t_dy + moved
    forward_pass -= moved.sum()
    forward_us = forward_pass + opt_fit.fixed_us + step_overhead
    if forward_us < 0:
        log.warning("negative constant step time %.0f us; clamping to 0", forward_us)
        forward_us = 0.0

    from .timing import step_us

    checks = {
        cname: {
            "measured_us": measured[cname],
            "predicted_us": step_us(mask, t_dw, t_dy, forward_us, branches),
            "trainable": int(mask.sum()),
        }
        for cname, mask in masks.items()
    }
    return Profile(
        model_hash=model_hash,
        tensors=names,
        kinds=[t.kind for t in tensors],
        t_dw_us=t_dw,
        t_dy_us=t_dy,
        forward_us=float(forward_us),
        full_step_us=float(full_step),
        batch_size=int(batch_size),
        input_shape=shape,
        threads=threads,
        clock=clock,
        ort_version=ort.__version__,
        host=host_description(),
        forward_pass_us=float(forward_pass),
        optimizer_fixed_us=opt_fit.fixed_us,
        optimizer_per_tensor_us=opt_fit.per_tensor_us,
        optimizer_per_element_us=opt_fit.per_element_us,
        node_overhead_us=float(node_overhead),
        step_overhead_us=float(step_overhead),
        forward_saved_fraction=float(forward_saved_fraction),
        repeats=int(repeats),
        warmup=int(warmup),
        checks=checks,
        nodes=rows,
        branches=branch_rows,
    )


def _num_classes(model: onnx.ModelProto) -> int:
    out = model.graph.output[0]
    dims = out.type.tensor_type.shape.dim
    if len(dims) != 2 or not dims[1].dim_value:
        raise ModelError(f"model output {out.name!r} must be [B, K] with a static K")
    return int(dims[1].dim_value)


def _with_batch(model: onnx.ModelProto, batch_size: int, shape: Sequence[int]) -> onnx.ModelProto:
    """A copy of ``model`` whose input is the static ``[batch_size, *shape]`` and whose output
    batch dimension is ``batch_size`` (the training graph then has static shapes)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    init_names = {i.name for i in out.graph.initializer}
    inp = next(i for i in out.graph.input if i.name not in init_names)
    dims = inp.type.tensor_type.shape.dim
    for d, v in zip(dims, (batch_size, *shape), strict=True):
        d.Clear()
        d.dim_value = int(v)
    odim = out.graph.output[0].type.tensor_type.shape.dim[0]
    odim.Clear()
    odim.dim_value = int(batch_size)
    return out


def _charges(model, full_training_model: Path) -> dict:
    """``{training-graph node name: Charge}`` of the full training graph
    (:func:`etgraph.graph.charges` of :func:`etgraph.graph.build_tensor_graph`)."""
    from . import graph

    return graph.charges(graph.build_tensor_graph(model, training_model=full_training_model))


def _split_targets(charge, outputs: Sequence[str], index: dict[str, int]) -> dict:
    """``{part: (kind, tensor index)}`` of a split ConvGrad charge: dX -> ``t_dy`` of the
    charge's ``dy_tensor`` (forward pass when None), dW/dB -> ``t_dw`` of the tensor whose
    gradient the node's output 1/2 is (``<tensor>_grad``), which must be in ``dw_tensors``."""
    targets = {"dx": ("dy", index[charge.dy_tensor]) if charge.dy_tensor else ("forward", None)}
    for part, value in zip(_CONV_GRAD_PARTS[1:], list(outputs)[1:3], strict=False):
        if not value:
            continue
        name = value[: -len("_grad")] if value.endswith("_grad") else value
        if name not in charge.dw_tensors or name not in index:
            raise ModelError(
                f"split node {charge.node!r}: output {value!r} is not the gradient of one of "
                f"{list(charge.dw_tensors)}"
            )
        targets[part] = ("dw", index[name])
    return targets


def _charge(node_times, configs, charges, names, node_overhead):
    """Charge the ``full`` configuration's node times (kernel + per-node overhead, µs) to
    tensors: returns ``(t_dw_us [N], t_dy_us [N], forward_pass_us, rows, branches)``.

    Split nodes are split by measurement over all configurations (:func:`split_by_measurement`);
    the per-node overhead goes with the dX part when there is one (else the first part).
    ``t_dy`` work of ops whose D(o) has a gap (``Charge.gap``) is also summed per
    (tensor, gap) into ``branches`` (rows for :class:`etgraph.timing.BranchCharges`).
    """
    index = {n: i for i, n in enumerate(names)}
    t_dw = np.zeros(len(names))
    t_dy = np.zeros(len(names))
    forward_pass = 0.0
    rows = []
    branch_us: dict[tuple, float] = {}
    others = [c for c in configs if c != "full"]

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
            add(charge.kind, tensor, nt.us + node_overhead, charge.gap)
            row["tensor"] = charge.tensor
            rows.append(row)
            continue
        observations = [(conv_grad_parts(nt.outputs), nt.us)]
        for c in others:
            other = node_times[c].get(name)
            if other is not None:
                observations.append((conv_grad_parts(other.outputs), other.us))
        parts = split_by_measurement(observations)
        targets = _split_targets(charge, nt.outputs, index)
        first = "dx" if "dx" in parts else next(iter(parts))
        for part, us in parts.items():
            kind, tensor = targets[part]
            gap = charge.gap if part == "dx" else None
            add(kind, tensor, us + (node_overhead if part == first else 0.0), gap)
        row["parts"] = {
            p: {"charge": targets[p][0], "tensor": _name(names, targets[p][1]), "us": us}
            for p, us in parts.items()
        }
        row["observations"] = [[sorted(ps), us] for ps, us in observations]
        rows.append(row)
    branches = [
        {"tensor": k, "prefix": p, "extra": list(extra), "us": us}
        for (k, p, extra), us in sorted(branch_us.items())
    ]
    return t_dw, t_dy, forward_pass, rows, branches


def _name(names: list[str], index: int | None) -> str | None:
    return None if index is None else names[index]
