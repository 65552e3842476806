"""The options of every ONNX Runtime session etgraph opens, by role.

* :class:`OrtConfig` — the options etgraph varies (thread-pool spinning, spin stop, graph
  optimisation, arena, memory pattern, shared arena), measured by ``benchmarks/ort_config.py``.
* :data:`ROLES` — the options of each session role (``train``, ``profile``, ``probe``,
  ``eval``).
* :func:`session_options` — the ``onnxruntime.SessionOptions`` of a role (or of an explicit
  :class:`OrtConfig`).
* :func:`shared_arena` — the process's one shared CPU arena, registered once.

The sessions themselves are opened in :mod:`etgraph.sessions`; which options the training
sessions use is measured per run in :mod:`etgraph.config_choice`.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnxruntime as ort

from .host import usable_threads

__all__ = [
    "ROLES",
    "OrtConfig",
    "session_options",
    "shared_arena",
]


@dataclass(frozen=True)
class OrtConfig:
    """Session options etgraph varies per session role (measured by
    ``benchmarks/ort_config.py``; docs/results.md, "ORT session options"). The defaults are ORT's.

    Attributes:
        spinning: ``session.intra_op.allow_spinning``: pool threads busy-wait for work between
            the parallel sections of a run (ORT's default: on).
        stop_spinning: ``session.force_spinning_stop``: the pool stops spinning as soon as a run
            returns, so an idle session never takes the cores from the one that runs next.
        optimization: graph optimisation level, ``"basic"``, ``"extended"`` or ``"all"``.
        arena: the CPU memory arena (``enable_cpu_mem_arena``).
        mem_pattern: memory-pattern planning (``enable_mem_pattern``).
        shared_arena: the session allocates from the process's one shared CPU arena
            (:func:`shared_arena`, ``session.use_env_allocators``), which grows by exactly what
            is requested (``kSameAsRequested``), instead of its own arena growing by powers of
            two (ORT's default). With ORT's default, the memory pattern's one block, requested
            on the second step, does not fit in the chunks the first step left and the arena
            grows again: +116 MiB on a one-tensor selection at ResNet50's input (128 px, batch
            4), +91 MiB on MobileNetV2's full training; the shared arena stays flat and was no
            slower (docs/how-it-works.md, "The memory model"). Ignored with ``arena=False``.
    """

    spinning: bool = True
    stop_spinning: bool = False
    optimization: str = "all"
    arena: bool = True
    mem_pattern: bool = True
    shared_arena: bool = False


_LEVELS = {
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

_NO_SPINNING = OrtConfig(spinning=False, shared_arena=True)

#: The configuration of each session role: ``train`` (the training loop's Module + Optimizer,
#: its full reference steps and the profiler's real steps: the profile measures what training
#: runs), ``profile`` (the profiler's per-node profiled graphs and optimizer runs), ``probe``
#: (importance's GradientSession), ``eval`` (inference sessions scoring an exported model).
#: Measured on 2 cores shared with other work (``benchmarks/ort_config.py``, README): spinning
#: on (ORT's default) made every role 2-4x slower under load, force_spinning_stop halved that
#: but did not remove it; graph optimisation below "all", no arena or no memory pattern were
#: slower or no better. Spinning off wins in every role there. On a quiet machine spinning on
#: wins, so a training run measures which to use
#: (:func:`etgraph.config_choice.choose_train_config`) and passes the winner as ``config`` to
#: its sessions; ``train`` here is the choice of a run that does not. Every role allocates
#: from the shared arena (:func:`shared_arena`): what a released session frees is reused by
#: the next.
ROLES: dict[str, OrtConfig] = {
    "train": _NO_SPINNING,
    "profile": _NO_SPINNING,
    "probe": _NO_SPINNING,
    "eval": _NO_SPINNING,
}


_SHARED_ARENA: list[bool] = []  # registered in this process (an ORT environment holds one)


def shared_arena() -> None:
    """Register the process's shared CPU arena with ORT's environment, once per process.

    One BFC arena for every session whose options set ``session.use_env_allocators`` (an
    :class:`OrtConfig` with ``shared_arena``): no memory limit, extended by exactly the bytes
    requested (``arena_extend_strategy`` 1, ``kSameAsRequested``), ORT's default initial chunk
    (1 MiB) and dead-bytes limit (128 MiB). Like every ORT CPU arena it never returns memory to
    the OS while the process lives, but a released session's chunks serve the next session.
    """
    if _SHARED_ARENA:
        return
    info = ort.OrtMemoryInfo(
        "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
    )
    ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))
    _SHARED_ARENA.append(True)


def session_options(
    threads: int | None,
    profile_prefix: str | None = None,
    *,
    role: str = "train",
    config: OrtConfig | None = None,
) -> ort.SessionOptions:
    """``onnxruntime.SessionOptions`` of every ORT session etgraph opens.

    Sequential execution, ``threads`` intra-op threads (None = ORT's default, one per core; at
    most the CPUs this process may use, :func:`etgraph.host.usable_threads`), and the
    :class:`OrtConfig` of ``role`` (:data:`ROLES`) unless ``config`` is given.

    Args:
        threads: intra-op threads, or None.
        profile_prefix: turn on ORT's per-node profiling, trace files named by this prefix.
        role: a key of :data:`ROLES`.
        config: explicit options (benchmarks), overriding ``role``.

    Raises:
        KeyError: unknown role.
    """
    cfg = config if config is not None else ROLES[role]
    so = ort.SessionOptions()
    if threads is not None:
        so.intra_op_num_threads = usable_threads(int(threads))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if cfg.spinning else "0")
    if cfg.spinning and cfg.stop_spinning:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    so.graph_optimization_level = _LEVELS[cfg.optimization]
    so.enable_cpu_mem_arena = cfg.arena
    so.enable_mem_pattern = cfg.mem_pattern
    if cfg.arena and cfg.shared_arena:
        shared_arena()
        so.add_session_config_entry("session.use_env_allocators", "1")
    # Errors come back as exceptions; native log lines would break the one-line CLI errors.
    so.log_severity_level = 4
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so
