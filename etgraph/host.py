"""Facts about the device etgraph runs on, and this process's memory.

* :func:`physical_cores`, :func:`host_description` — recorded with every profile.
* :func:`usable_threads` — a thread count bounded by the CPUs this process may use.
* :func:`available_memory_bytes` — what this process can still allocate;
  :func:`check_address_space` — refuse an address-space limit the libraries cannot load under.
* :func:`reset_peak_rss`, :func:`peak_rss_mb` — peak resident memory per period (Linux).
* :func:`release_native_memory` — hand freed native heap back to the OS after a re-selection.
* :func:`freeze_gc` — keep the cyclic garbage collector off the libraries' objects.
* :func:`exit_on_sigterm` — SIGTERM and SIGHUP unwind the process like Ctrl-C (cleanup runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import math
import os
import platform
import resource
import signal
import threading
from pathlib import Path

from .errors import ResourceError, Terminated

log = logging.getLogger(__name__)

__all__ = [
    "MIN_ADDRESS_SPACE_BYTES",
    "available_memory_bytes",
    "check_address_space",
    "exit_on_sigterm",
    "freeze_gc",
    "process_age_s",
    "host_description",
    "peak_rss_mb",
    "physical_cores",
    "limit_heap_retention",
    "release_native_memory",
    "reset_peak_rss",
    "rss_mb",
    "usable_threads",
]


def physical_cores() -> int:
    """Number of physical CPU cores (distinct (package, core) pairs in sysfs; else cpu_count)."""
    cores = set()
    for topo in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        try:
            cores.add(((topo / "physical_package_id").read_text(), (topo / "core_id").read_text()))
        except OSError:
            continue
    return len(cores) or os.cpu_count() or 1


def usable_threads(threads: int) -> int:
    """``threads``, or the number of CPUs this process may run on if that is fewer (warned
    once per count): more threads than CPUs only cost memory (``--threads 100000`` grew to
    7.6 GB inside ORT's session creation)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    if threads > cpus:
        _warn_threads(threads, cpus)
    return min(threads, cpus)


@functools.cache
def _warn_threads(threads: int, cpus: int) -> None:
    log.warning("%d threads asked for, %d CPUs to run them on: using %d", threads, cpus, cpus)


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


def freeze_gc() -> None:
    """Collect garbage once, then move every object alive into the garbage collector's
    permanent generation (:func:`gc.freeze`), so its collections scan only what is created
    afterwards.

    onnxruntime-training imports torch: millions of long-lived objects that every full
    collection walks (~0.2 s each), and building training graphs (onnx-ir, onnxblock) creates
    enough objects to trigger several. Called where the heavy work starts (profiling, a trainer
    once built: whoever drives its periods); objects frozen are still freed by reference
    counting, but cyclic garbage frozen would never be: without the collection first a ResNet50
    run kept an onnx-ir model of its weights (+95 MiB peak RSS). Measured: ResNet50 at 128 px,
    fast profile: 2.76-2.86 s (3.01-3.88 s without; building the graphs 0.29-0.34 s vs
    0.43-0.48 s).
    """
    gc.collect()
    gc.freeze()


def release_native_memory() -> None:
    """Return freed native heap to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Rebuilding ORT sessions every period (importance, re-selection) frees and re-allocates
    hundreds of buffers; glibc keeps the freed pages, so RSS creeps up by ~10% over 12
    re-selections on the default model, then plateaus. Trimming after each re-selection keeps
    RSS flat (measured: 326 MiB after 1 and after 40 importance evaluations). Afterwards every
    large new array page-faults: keep whole-tensor temporaries out of per-period code.
    """
    # No gc.collect(): sessions are freed by reference counting, and a full collection costs
    # ~0.2 s once torch is imported (onnxruntime.training imports it); malloc_trim costs ~1-6 ms.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


#: glibc ``mallopt`` parameter number of ``M_MMAP_THRESHOLD``.
_M_MMAP_THRESHOLD = -3


def limit_heap_retention(threshold_bytes: int = 1 << 20) -> None:
    """Serve every allocation of ``threshold_bytes`` or more by its own ``mmap`` (glibc
    ``mallopt(M_MMAP_THRESHOLD)``; a no-op elsewhere), so freed large buffers go back to the OS.

    glibc raises its mmap threshold to the size of each freed mmapped block (up to 32 MiB):
    after ORT has loaded and freed a few checkpoints, tensor buffers below 32 MiB come from the
    heap and stay resident when freed. Measured (ResNet50 128 px): a training session opened
    after the importance chunks' sessions held 658 MiB instead of 542 MiB in a fresh process;
    544 MiB with this set. A fixed threshold also stops the dynamic adjustment.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes))


def available_memory_bytes() -> float:
    """Bytes this process can still allocate: the memory the OS has available (Linux
    ``MemAvailable`` plus free swap), at most what the address-space limit (``ulimit -v``)
    leaves beside this process's mappings; ``inf`` where neither is known."""
    available = math.inf
    with contextlib.suppress(OSError, ValueError, IndexError):
        info = {
            line.split(":")[0]: int(line.split()[1]) * 1024
            for line in Path("/proc/meminfo").read_text().splitlines()
        }
        available = float(info["MemAvailable"] + info.get("SwapFree", 0))
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit != resource.RLIM_INFINITY:
        mapped = (_status_mb("VmSize") or 0.0) * 2**20
        available = min(available, max(0.0, limit - mapped))
    return available


#: The address space etgraph's libraries need to load: onnxruntime-training and torch map
#: about 1 GiB of shared objects. Measured (x86_64, ``etgraph train`` on the default model):
#: under ``ulimit -v`` of 600-900 MiB imports fail, at 700 MiB torch's import aborts the
#: process (an uncaught ``std::bad_alloc``: no Python error to catch); 1.05 GiB trains.
MIN_ADDRESS_SPACE_BYTES = 1 << 30


def check_address_space() -> None:
    """Refuse to start under an address-space limit (``ulimit -v``) below
    :data:`MIN_ADDRESS_SPACE_BYTES`, where loading the libraries fails or aborts natively.

    Raises:
        ResourceError: naming the limit and the least that works.
    """
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit != resource.RLIM_INFINITY and limit < MIN_ADDRESS_SPACE_BYTES:
        raise ResourceError(
            f"the address-space limit (ulimit -v) is {limit / 2**20:.0f} MiB, below the "
            f"{MIN_ADDRESS_SPACE_BYTES / 2**20:.0f} MiB onnxruntime-training and torch need to "
            f"load: raise it (ulimit -v {MIN_ADDRESS_SPACE_BYTES // 1024} or more)"
        )


def reset_peak_rss() -> None:
    """Reset this process's peak RSS counter (Linux ``clear_refs``), if allowed."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _status_mb(field: str) -> float | None:
    """``field`` (``VmHWM``, ``VmRSS``) of this process's ``/proc/self/status``, MiB; None
    where the OS has none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def peak_rss_mb() -> float:
    """Peak resident set size (MiB) since the last :func:`reset_peak_rss` (Linux ``VmHWM``;
    elsewhere the process's lifetime peak)."""
    peak = _status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rss_mb() -> float:
    """This process's resident set size now (MiB, Linux ``VmRSS``; NaN where unknown)."""
    rss = _status_mb("VmRSS")
    return rss if rss is not None else float("nan")


def process_age_s() -> float:
    """Seconds since this process started (Linux: ``/proc/self/stat`` against
    ``/proc/uptime``); 0.0 where that cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    return 0.0


def exit_on_sigterm() -> None:
    """Raise :class:`etgraph.errors.Terminated` in the main thread when SIGTERM or SIGHUP
    arrives (their default action ends the process at once: no ``finally``, no ``atexit``, so
    temporary directories holding the model's weights stayed). ORT's native calls finish
    first."""

    def terminate(signum, frame):
        raise Terminated(signum)

    if threading.current_thread() is threading.main_thread():  # where handlers can be set
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, terminate)
