"""Facts about the device etgraph runs on, and this process's memory.

* :func:`physical_cores`, :func:`host_description` — recorded with every profile.
* :func:`reset_peak_rss`, :func:`peak_rss_mb` — peak resident memory per period (Linux).
* :func:`release_native_memory` — hand freed native heap back to the OS after a re-selection.
* :func:`freeze_gc` — keep the cyclic garbage collector off the libraries' objects.
* :func:`exit_on_sigterm` — a SIGTERM unwinds the process like Ctrl-C (cleanup runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
import resource
import signal
from pathlib import Path

from .errors import Terminated

__all__ = [
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
    enough objects to trigger several. Called where the heavy work starts (profiling, a training
    run); objects frozen are still freed by reference counting, but cyclic garbage frozen would
    never be: without the collection first a ResNet50 run kept an onnx-ir model of its weights
    (+95 MiB peak RSS). Measured: ResNet50 at 128 px, fast profile: 2.76-2.86 s (3.01-3.88 s
    without; building the graphs 0.29-0.34 s vs 0.43-0.48 s).
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
    """Raise :class:`etgraph.errors.Terminated` in the main thread when SIGTERM arrives (the
    default action ends the process at once: no ``finally``, no ``atexit``, so temporary
    directories holding the model's weights stayed). ORT's native calls finish first."""

    def terminate(signum, frame):
        raise Terminated(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, terminate)
