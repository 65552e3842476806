"""Measurements on ONNX Runtime: what the profiler and the time-model checks time (paper §5).

Wall-clock time is measured, never FLOPs (docs/results.md, "Time model validation"). Every
measurement is a *runner* stepped once per round by :func:`round_robin`, so a change of the
machine's load hits all of them alike:

* :class:`ProfiledGraph` — a ``training_model.onnx`` in a profiled plain ``InferenceSession``
  (the training API cannot end profiling): per-node kernel times (:class:`NodeTiming`).
* :class:`TrainStep` — real training steps (:class:`etgraph.sessions.TrainingSession`: Module
  step + AdamW step + ``lazy_reset_grad``) of one set of artifacts.
* :class:`OptimizerSubsets` — the one ``AdamWOptimizer`` node of ``optimizer_model.onnx``,
  profiled on several subsets of the tensors.
* :func:`measure_node_overhead_us` — the executor's cost per node outside its kernel.
* :func:`measure_train_steps_us`, :func:`measure_selection_steps_us` — real steps of given
  artifacts / selections: the ground truth the time model is validated against.

Of repeated timings the :data:`TIME_QUANTILE` (20th percentile) is kept (:func:`robust_time`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from . import artifacts
from .errors import ConfigError, ModelError
from .files import private_temp_dir
from .host import physical_cores
from .io_specs import Batch, random_batch
from .model import LoadedModel
from .ort_options import session_options
from .sessions import TrainingSession, inference_session

log = logging.getLogger(__name__)

__all__ = [
    "CLOCKS",
    "TIME_QUANTILE",
    "Batch",
    "NodeTiming",
    "OptimizerSubsets",
    "ProfiledGraph",
    "TrainStep",
    "measure_node_overhead_us",
    "measure_selection_steps_us",
    "measure_train_steps_us",
    "paired_ratio",
    "random_batch",
    "reproduced",
    "robust_time",
    "round_robin",
    "run_spans_s",
    "step_clock",
]

#: Quantile of repeated timings used as "the" time of a node or step. A low quantile rather
#: than the median: on a shared machine other processes only ever add time, so the lower end of
#: the distribution is what is reproducible (the median of a 2-core box shared by busy
#: neighbours moves by 2x between minutes). Same statistic for profiling and validation.
TIME_QUANTILE = 0.2

#: Clocks real steps can be timed by (:func:`step_clock`).
CLOCKS = ("wall", "cpu")


def step_clock(clock: str, threads: int):
    """The timer for real steps (a callable returning seconds): ``"wall"`` =
    ``time.perf_counter`` (the paper's wall clock, default); ``"cpu"`` = ``time.thread_time``,
    the CPU time of the calling thread, which with one intra-op thread (ORT then runs every
    kernel on the caller) is the step's compute time without the time other processes take the
    core away — for validating the time model on a shared machine.

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


def robust_time(values, quantile: float = TIME_QUANTILE) -> float:
    """The ``quantile`` (default :data:`TIME_QUANTILE`, the 20th percentile) of repeated
    timings, same unit as the input (linear interpolation, as ``numpy.quantile``'s default;
    computed in Python: the profiler takes it of ~1500 short lists per graph, where numpy's
    overhead dominated).

    Raises:
        ValueError: no values.
    """
    xs = sorted(float(v) for v in np.ravel(values))
    if not xs:
        raise ValueError("robust_time of no values")
    h = (len(xs) - 1) * quantile
    lo = int(h)
    if lo + 1 >= len(xs):
        return xs[lo]
    return xs[lo] + (h - lo) * (xs[lo + 1] - xs[lo])


@dataclass
class NodeTiming:
    """One node of a training graph: op type, outputs (``""`` = not computed), kernel time in
    µs (:func:`robust_time` of its runs)."""

    op: str
    outputs: list[str]
    us: float


def _training_feeds(
    session, weights: dict[str, np.ndarray], batch: Batch, zeros: dict | None = None
) -> dict:
    """Feeds for ``training_model.onnx`` run as a plain inference session: the batch, the
    parameters, zero ``<param>_grad.accumulation.buffer`` s and ``lazy_reset_grad=[True]``.
    ``zeros``: the buffers by parameter name, shared by several sessions (filled as needed;
    ``lazy_reset_grad`` makes their values irrelevant).

    Raises:
        ModelError: an input is neither data nor a parameter in ``weights``.
    """
    feeds = {}
    for inp in session.get_inputs():
        name = inp.name
        if name in batch.inputs:
            feeds[name] = batch.inputs[name]
        elif name == batch.label_name:
            feeds[name] = batch.labels
        elif name == "lazy_reset_grad":
            feeds[name] = np.array([True])
        elif name.endswith("_grad.accumulation.buffer"):
            param = name[: -len("_grad.accumulation.buffer")]
            if zeros is None:
                feeds[name] = np.zeros_like(weights[param])
            else:
                if param not in zeros:
                    zeros[param] = np.zeros_like(weights[param])
                feeds[name] = zeros[param]
        elif name in weights:
            feeds[name] = weights[name]
        else:
            raise ModelError(f"training graph input {name!r} is neither data nor a parameter")
    return feeds


#: One kernel event of ORT's JSON trace (ORT writes one event per line, keys in this order).
_KERNEL_EVENT = re.compile(
    r'"dur" :(\d+),"ts" :(\d+),"ph" : "X","name" :"((?:[^"\\]|\\.)*)_kernel_time"'
)


def _kernel_events(trace_path: str) -> list[dict]:
    """The ``<node>_kernel_time`` events (``name``, ``dur`` µs, ``ts``) of an ORT JSON trace, in
    time order; deletes the file.

    Read line by line with a regular expression (a trace holds three events per node and run,
    with the kernels' thread statistics and shapes: ``json.load`` of it took ~0.2 s per
    ResNet-50 run); a line it does not match is parsed as JSON.
    """
    path = Path(trace_path)
    text = path.read_text()
    path.unlink(missing_ok=True)
    events = []
    for line in text.splitlines():
        if '"cat" : "Node"' not in line or '_kernel_time"' not in line:
            continue
        match = _KERNEL_EVENT.search(line)
        if match is not None:
            name = match.group(3)
            if "\\" in name:
                name = json.loads(f'"{name}"')
            events.append(
                {
                    "name": f"{name}_kernel_time",
                    "dur": int(match.group(1)),
                    "ts": int(match.group(2)),
                }
            )
            continue
        event = json.loads(line.strip().rstrip(","))
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            events.append(event)
    return sorted(events, key=lambda e: e.get("ts", 0))


def run_spans_s(events: Sequence[dict], runs: int) -> list[tuple[float, float]]:
    """Per run, ``(span, busy)`` in s: the time from its first kernel's start to its last
    kernel's end, and the part of it kernels took (the rest is the executor's per-node cost and
    the trace's own).

    Args:
        events: the kernel events of ``runs`` runs of one graph (:func:`_kernel_events`: ``ts``
            and ``dur`` in µs, time order); every run runs the same nodes.
        runs: how many runs the trace holds.

    Returns:
        ``runs`` pairs, or ``[]`` when the events do not split into ``runs`` equal runs.
    """
    if runs <= 0 or not events or len(events) % runs:
        return []
    per_run = len(events) // runs
    spans = []
    for r in range(runs):
        run = events[r * per_run : (r + 1) * per_run]
        span = run[-1]["ts"] + run[-1]["dur"] - run[0]["ts"]
        spans.append((span * 1e-6, sum(e["dur"] for e in run) * 1e-6))
    return spans


#: How ORT's graph optimisations name a node they rewrite, when it keeps no name of the graph:
#: ``"<node>/<Transformer>/"`` (a Transpose folded into a MatMul or Gemm by
#: ``MatmulTransposeFusion`` / ``GemmTransposeFusion``: in a transformer every dense layer's
#: forward MatMul and its gradient's, 60% of all-MiniLM-L6-v2's step) and ``"fused <node>..."``
#: (``MatMulAddFusion``'s Gemm, ``FusedGemm``); renames compose (``"fused /l1/MatMul/
#: MatMulAddFusion//GemmTransposeFusion/"``).
_FUSED_PREFIX = "fused "


def traced_node(traced: str, nodes) -> str | None:
    """The graph node whose work a traced kernel ran: the node of that name, else the one ORT
    rewrote into it (the longest ``/``-prefix of the traced name, less :data:`_FUSED_PREFIX`,
    that names a node), else None (a node ORT created under a name of its own).

    Args:
        traced: the node name of a kernel event (without ``_kernel_time``).
        nodes: the graph's node names (a set).
    """
    if traced in nodes:
        return traced
    if traced.startswith(_FUSED_PREFIX):
        traced = traced[len(_FUSED_PREFIX) :]
        if traced in nodes:
            return traced
    parts = traced.rstrip("/").split("/")
    for k in range(len(parts) - 1, 0, -1):
        prefix = "/".join(parts[:k])
        if prefix in nodes:
            return prefix
    return None


class ProfiledGraph:
    """A training graph in a profiled plain ``InferenceSession`` (one run per round).

    Args:
        training_model: the training graph: a path (``training_model.onnx`` of
            :func:`etgraph.artifacts.generate`) or a ModelProto
            (:func:`etgraph.artifacts.training_graphs`).
        weights: every parameter the graph takes as input (trainable and frozen), by name.
        batch: the input batch and labels.
        threads: intra-op threads. work_dir: where ORT writes its JSON trace.
        name: names the trace file (default: the model file's directory name).
        clock: times each run (:func:`step_clock`), kept in :attr:`times` (s); the wall time
            of each run (``time.perf_counter``, the clock of the trace's kernel durations) is
            kept in :attr:`wall`.
        zeros: gradient buffers shared with other graphs (:func:`_training_feeds`); ORT's
            accumulator may write the gradients into them.
    """

    def __init__(
        self,
        training_model,
        weights,
        batch: Batch,
        *,
        threads,
        work_dir,
        name=None,
        clock="wall",
        zeros=None,
    ):
        self.clock = step_clock(clock, threads)
        if isinstance(training_model, onnx.ModelProto):
            proto, source = training_model, training_model.SerializeToString()
            name = name or "graph"
        else:
            source = Path(training_model)
            proto = onnx.load(str(source), load_external_data=False)
            name = name or source.parent.name
        self.nodes = [(n.name, n.op_type, list(n.output)) for n in proto.graph.node]
        prefix = str(Path(work_dir) / f"ort_trace_{name}")
        self.session = inference_session(source, session_options(threads, prefix, role="profile"))
        self.feeds = _training_feeds(self.session, weights, batch, zeros)
        # Bound once, as the training API's Module binds its parameters and gradient buffers:
        # a run then costs no Python-side conversion of hundreds of inputs and outputs (which
        # would land in every step's fixed cost). The outputs (loss, logits, one bool
        # "accumulated" flag per gradient buffer) stay ORT values.
        self.binding = self.session.io_binding()
        values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in self.feeds.items()}
        for name, value in values.items():
            self.binding.bind_ortvalue_input(name, value)
        for out in self.session.get_outputs():
            self.binding.bind_output(out.name, "cpu")
        self._values = values  # kept alive with the binding
        self.wall: list[float] = []
        self.times: list[float] = []

    def step(self) -> None:
        t0, w0 = self.clock(), time.perf_counter()
        self.session.run_with_iobinding(self.binding)
        self.wall.append(time.perf_counter() - w0)
        self.times.append(self.clock() - t0)

    def time_us(self, warmup: int, quantile: float = TIME_QUANTILE) -> float:
        """:func:`robust_time` (at ``quantile``) of the runs' times (by ``clock``) after the
        first ``warmup``, µs."""
        times = self.times[warmup:] if len(self.times) > warmup else self.times
        return robust_time(times, quantile) * 1e6

    def result(self, warmup: int, quantile: float = TIME_QUANTILE) -> dict[str, NodeTiming]:
        """``{node name: NodeTiming}`` of every node that ran: :func:`robust_time` (at
        ``quantile``) of its kernel durations (µs) after dropping its first ``warmup`` runs; a
        kernel of a node ORT's optimisations rewrote and renamed counts for the node it was
        (:func:`traced_node`; until session 22 such kernels were left out of every node, so
        their time fell into the fixed per-step cost). Ends profiling."""
        durations: dict[str, list[float]] = defaultdict(list)
        events = _kernel_events(self.session.end_profiling())
        for ev in events:
            durations[ev["name"][: -len("_kernel_time")]].append(float(ev["dur"]))
        times = {
            node: robust_time(d[warmup:] if len(d) > warmup else d, quantile)
            for node, d in durations.items()
        }
        self.spans = run_spans_s(events, len(self.times))
        self.nodes_ran = len(durations)
        self.kernel_us = sum(times.values())
        self.traced_names = set(times)  # the node names the kernels ran under
        names = {name for name, _, _ in self.nodes}
        by_node: dict[str, float] = defaultdict(float)
        unmatched_us = 0.0
        for traced, us in times.items():
            node = traced_node(traced, names)
            if node is None:
                unmatched_us += us
            else:
                by_node[node] += us
        if unmatched_us > 0.01 * self.kernel_us:
            log.info(
                "%.0f of %.0f us of kernel time ran in nodes ORT named itself (left out of the "
                "tensors' timings)",
                unmatched_us,
                self.kernel_us,
            )
        return {
            name: NodeTiming(op, outputs, by_node[name])
            for name, op, outputs in self.nodes
            if name in by_node
        }

    def untraced_time_us(self, warmup: int, node_overhead_us: float) -> float:
        """The run's time without the trace and the machine's other work, µs: the sum of the
        nodes' kernel times of :meth:`result` (which must have run: the same statistic) + the
        executor's ``node_overhead_us`` per node + the smallest time of a run (after
        ``warmup``) outside its kernels' span (binding inputs and outputs, starting and ending
        the run; the runs' clock less the trace's wall span, at least 0).

        The time between kernels is left out: it is the trace's own cost (6-13 µs per node on
        training graphs, measured against untraced runs; a trivial node's 3-5 µs undercounts
        it) plus the executor's, counted per node instead; and a sum of per-node statistics is
        what the time model adds up, so a busy machine's stalls, which a whole run's time keeps,
        do not land in the fixed per-step cost.

        Raises:
            ValueError: :meth:`result` found no per-run kernel events.
        """
        if not self.spans:
            raise ValueError("no per-run kernel events: call result() first")
        outside = [max(0.0, t - span) for t, (span, _) in zip(self.times, self.spans, strict=True)][
            warmup:
        ] or [0.0]
        return self.kernel_us + self.nodes_ran * node_overhead_us + min(outside) * 1e6

    def trace_us_per_node(self, warmup: int) -> float:
        """The smallest time between kernels of a run after ``warmup``, per node that ran, µs
        (the trace's cost and the executor's; :meth:`result` must have run)."""
        gaps = [span - busy for span, busy in self.spans][warmup:] or [0.0]
        return min(gaps) * 1e6 / max(1, self.nodes_ran)


class TrainStep:
    """Real training steps of one set of artifacts (one step per round), timed by ``clock``.

    The session (:class:`etgraph.sessions.TrainingSession`) starts from the artifacts' own
    ``checkpoint``; a step is ``Module(*inputs, labels)`` + ``Optimizer.step()`` +
    ``lazy_reset_grad()``.
    """

    def __init__(self, artifact_dir, batch: Batch, *, threads, clock="wall"):
        self.clock = step_clock(clock, threads)
        d = Path(artifact_dir)
        self.batch = batch
        self.session = TrainingSession(d, d / "checkpoint", threads)
        self.times: list[float] = []

    def step(self) -> None:
        t0 = self.clock()
        self.session.step(self.batch.inputs, self.batch.labels)
        self.times.append(self.clock() - t0)

    def result(self, warmup: int) -> float:
        """:func:`robust_time` of the steps after the first ``warmup``, µs."""
        return robust_time(self.times[warmup:]) * 1e6


class OptimizerSubsets:
    """The ``AdamWOptimizer`` node, profiled on several subsets of tensors (each once per round).

    The optimizer model takes sequences, so one model serves every subset.

    Args:
        optimizer_model: ``optimizer_model.onnx`` of any artifacts of the model (path,
            ModelProto or serialized bytes).
        params: trainable tensors by name (float32 arrays; ORT may update them in place).
        subsets: lists of names (:func:`etgraph.fold.optimizer_subsets`).
        threads: intra-op threads. work_dir: where ORT writes its JSON trace.
        zeros: zero arrays by tensor name, shared (filled as needed): gradients and moments are
            then zeros (AdamW's time does not depend on the values) instead of three new
            arrays per tensor.
    """

    def __init__(self, optimizer_model, params, subsets, *, threads, work_dir, zeros=None):
        if isinstance(optimizer_model, onnx.ModelProto):
            optimizer_model = optimizer_model.SerializeToString()
        self.session = inference_session(
            optimizer_model,
            session_options(threads, str(Path(work_dir) / "ort_trace_optimizer"), role="profile"),
        )
        self.subsets = [list(s) for s in subsets]
        # One set of arrays shared by the subsets (the values do not change the kernel's time;
        # copies per subset cost seconds on big models). ``zeros``: the gradients and both
        # moments are one zero array per tensor (shared with the profiled graphs' buffers).
        used = [n for n in params if any(n in s for s in self.subsets)]
        if zeros is None:
            grads = {n: np.full_like(params[n], 1e-3) for n in used}
            moments = {n: (np.zeros_like(params[n]), np.zeros_like(params[n])) for n in used}
        else:
            for n in used:
                if n not in zeros:
                    zeros[n] = np.zeros_like(params[n])
            grads = {n: zeros[n] for n in used}
            moments = {n: (zeros[n], zeros[n]) for n in used}
        self.feeds = [
            {
                "learning_rate": np.array([1e-4], np.float32),
                "step": np.array([1], np.int64),
                "params": [params[n] for n in s],
                "gradients": [grads[n] for n in s],
                "first_order_moments": [moments[n][0] for n in s],
                "second_order_moments": [moments[n][1] for n in s],
            }
            for s in self.subsets
        ]
        self.sizes = [(len(s), sum(params[n].size for n in s)) for s in self.subsets]
        self.rounds = 0

    def step(self) -> None:
        for feeds in self.feeds:
            self.session.run(None, feeds)
        self.rounds += 1

    def result(self, warmup: int, quantile: float = TIME_QUANTILE) -> list[tuple[int, int, float]]:
        """``(tensor count, elements, kernel µs)`` per subset (:func:`robust_time` at
        ``quantile`` after ``warmup`` rounds). Ends profiling.

        Raises:
            ModelError: the trace does not have one kernel event per subset and round.
        """
        durs = [float(e["dur"]) for e in _kernel_events(self.session.end_profiling())]
        k = len(self.feeds)
        if len(durs) != k * self.rounds:
            raise ModelError(
                f"optimizer trace has {len(durs)} kernel events, expected {k * self.rounds}"
            )
        per_subset = np.array(durs).reshape(self.rounds, k)[warmup:]
        return [
            (count, elements, robust_time(per_subset[:, i], quantile))
            for i, (count, elements) in enumerate(self.sizes)
        ]


def round_robin(
    runners: Sequence,
    repeats: int,
    warmup: int,
    *,
    until=None,
    max_repeats: int | None = None,
) -> int:
    """Step every runner once per round for ``warmup + repeats`` rounds, so that changes of the
    machine's load hit every measurement alike (the machine may be shared). With ``until`` (a
    callable), more rounds follow, one at a time, until it returns True or ``max_repeats``
    measured rounds have run. Returns the number of measured rounds."""
    for _ in range(warmup + repeats):
        for runner in runners:
            runner.step()
    done = repeats
    while until is not None and done < (max_repeats or repeats) and not until():
        for runner in runners:
            runner.step()
        done += 1
    return done


def reproduced(times: Sequence[float], tolerance: float) -> bool:
    """Whether the two lowest of ``times`` agree within ``tolerance`` (relative): on a shared
    machine other processes only add time, so two runs at the same low time are what this
    machine's undisturbed speed looks like."""
    low = sorted(times)[:2]
    return len(low) == 2 and low[1] <= low[0] * (1.0 + tolerance)


def measure_node_overhead_us(
    threads: int,
    *,
    nodes: int = 400,
    repeats: int = 30,
    trace_dir: str | os.PathLike | None = None,
) -> float:
    """Executor cost per node outside its kernel (µs, >= 0): wall time (:func:`robust_time`) of
    a chain of ``nodes`` trivial ``Neg`` nodes on a 1-element tensor, minus a 1-node chain,
    divided by ``nodes - 1``. With ``trace_dir`` the sessions run with ORT's per-node profiling
    on (trace files written there and deleted): the cost per node of a profiled run, so the
    difference from the untraced figure is what the trace itself adds per node."""

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

    x = {"t0": np.ones(1, np.float32)}
    chain_s = []
    for k in (1, nodes):
        prefix = None if trace_dir is None else str(Path(trace_dir) / f"ort_trace_chain{k}")
        so = session_options(threads, prefix, role="profile")
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = inference_session(chain(k), so)
        times = []
        for _ in range(repeats + 3):
            t0 = time.perf_counter()
            sess.run(None, x)
            times.append(time.perf_counter() - t0)
        chain_s.append(robust_time(times[3:]))
        if trace_dir is not None:
            Path(sess.end_profiling()).unlink(missing_ok=True)
    return max(0.0, (chain_s[1] - chain_s[0]) * 1e6 / (nodes - 1))


def measure_train_steps_us(
    artifact_dirs: Sequence[str | os.PathLike],
    batch: Batch,
    *,
    threads: int,
    repeats: int,
    warmup: int,
    clock: str = "wall",
) -> list[float]:
    """:func:`robust_time` (20th percentile, µs) of one real training step for each set of
    artifacts.

    A step is what ``onnxruntime.training.api`` does per batch: ``Module(*inputs, labels)``
    (forward + backward + gradient accumulation), ``Optimizer.step()`` (AdamW) and
    ``Module.lazy_reset_grad()`` (:class:`TrainStep`). The artifact sets are stepped round-robin
    (one step each per round), so a change of machine load hits all of them alike and their
    ratios stay right.

    Args:
        artifact_dirs: directories of the four artifacts (:class:`etgraph.artifacts.ArtifactPaths`).
        batch: input and labels. threads: intra-op threads. repeats, warmup: rounds.
        clock: ``"wall"`` or ``"cpu"`` (:func:`step_clock`).

    Returns:
        One time per directory, µs, in the given order.

    Raises:
        ConfigError: bad clock (:func:`step_clock`).
    """
    runners = [TrainStep(d, batch, threads=threads, clock=clock) for d in artifact_dirs]
    round_robin(runners, repeats, warmup)
    return [r.result(warmup) for r in runners]


def paired_ratio(times, reference, warmup: int) -> float:
    """Median over rounds of ``times[i] / reference[i]`` after ``warmup`` rounds: the ratio of
    two runners stepped round robin (:func:`round_robin`), each round's pair measured at the
    machine's speed of that round.

    Args:
        times, reference: per-round times of the two runners (same length, same unit).

    Raises:
        ValueError: no round after ``warmup``, or a non-positive reference time.
    """
    pairs = list(zip(times, reference, strict=True))[warmup:]
    if not pairs or any(r <= 0 for _, r in pairs):
        raise ValueError("paired_ratio needs rounds with positive reference times")
    return float(np.median([t / r for t, r in pairs]))


def measure_selection_steps_us(
    model: LoadedModel,
    masks,
    *,
    batch_size: int = 4,
    input_shapes=None,
    threads: int | None = None,
    repeats: int = 10,
    warmup: int = 3,
    work_dir: str | os.PathLike | None = None,
    clock: str = "wall",
    group: int = 1,
    frozen_bn: str = "train",
) -> tuple[np.ndarray, np.ndarray]:
    """Measured step times (µs) of training exactly the tensors of each mask.

    For each mask, artifacts are generated (``requires_grad`` = selected tensors; the others and
    the BatchNorm running statistics frozen, :meth:`LoadedModel.split`); groups of ``group``
    masks are stepped round-robin with the full-training artifacts (:class:`TrainStep`, as
    :func:`measure_train_steps_us` does), so each mask also gets a full step measured under the
    same machine load, round by round. This is the ground truth :func:`etgraph.timing.step_us`
    is validated against (tests, ``benchmarks/time_model.py``).

    Args:
        model: the loaded model. masks: bool [K, N], forward order, no empty row.
        batch_size, input_shapes, threads, repeats, warmup: as in
            :func:`etgraph.profiler.profile_model`.
        work_dir: where the artifacts go (default: a temporary directory, removed).
        clock: ``"wall"`` or ``"cpu"`` (:func:`step_clock`).
        group: masks per round-robin group (more = fewer full steps, more memory).
        frozen_bn: how the masks' frozen batch norms run (:func:`etgraph.artifacts.generate`;
            ``"inference"`` is the training loop's default); the full step trains every batch
            norm either way.

    Returns:
        ``(mask_us float64 [K], full_us float64 [K])``: each mask's step (:func:`robust_time`)
        and the full step at the ratio measured round by round: ``mask_us / full_us`` is
        :func:`paired_ratio` of the mask's and the full steps (a change of the machine's speed
        between rounds cancels; the group's full steps alone moved by 1.5x between groups of
        one run on a shared 2-core machine, issue 30).

    Raises:
        ConfigError: a mask is empty or has the wrong length; bad input shape or clock.
        ModelError: ORT cannot build or run the training graph.
    """
    shapes = model.input_shapes(input_shapes)
    threads = physical_cores() if threads is None else int(threads)
    step_clock(clock, threads)
    n = len(model.tensors)
    masks = np.atleast_2d(np.asarray(masks, dtype=bool))
    if masks.shape[1] != n or not masks.any(axis=1).all():
        raise ConfigError(f"selection masks must be non-empty bool rows of length {n}")
    batch = random_batch(batch_size, model.inputs, shapes, model.task)
    model_b = model.with_batch(batch_size, shapes)
    loss = model.task.loss
    mask_us = np.zeros(len(masks))
    full_us = np.zeros(len(masks))
    with private_temp_dir("steps", dir=work_dir) as work:
        full_dir = artifacts.generate(
            model_b, *model.split(np.ones(n, dtype=bool)), Path(work) / "full", loss=loss
        ).directory
        for start in range(0, len(masks), group):
            dirs = [
                artifacts.generate(
                    model_b,
                    *model.split(masks[k]),
                    Path(work) / f"m{k}",
                    loss=loss,
                    frozen_bn=frozen_bn,
                ).directory
                for k in range(start, min(start + group, len(masks)))
            ]
            runners = [TrainStep(d, batch, threads=threads, clock=clock) for d in dirs]
            full = TrainStep(full_dir, batch, threads=threads, clock=clock)
            round_robin([*runners, full], repeats, warmup)
            for k, runner in enumerate(runners, start=start):
                mask_us[k] = runner.result(warmup)
                full_us[k] = mask_us[k] / paired_ratio(runner.times, full.times, warmup)
            log.info("selections %d-%d measured", start, start + len(dirs) - 1)
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
    return mask_us, full_us
