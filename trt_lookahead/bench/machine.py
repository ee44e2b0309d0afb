"""What machine a measurement ran on (CPU, threads, load, date) and the process's peak memory.

Peak RSS is read from /proc/self/status (VmHWM). Before each measured call `reset_peak_rss()` writes
"5" to /proc/self/clear_refs, which resets the high-water mark (Linux >= 4.0), so each generate call
gets its own peak; where that is not allowed the process-lifetime peak (ru_maxrss) is reported.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import resource
import statistics
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else None


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """The `machine` object of bench/tune output: cpu, cpus, threads, load (1/5/15 min), date."""
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "threads": threads if threads is not None else torch_threads(),
        "load": load_average(),
        "date": utc_now(),
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
    }


def read_bandwidth_gbps(megabytes: int = 512, repeats: int = 7) -> float:
    """Memory read bandwidth in GB/s with torch's threads: the median over `repeats` sums of a buffer much
    larger than any cache (what a memory-bound decode step can at best stream its weights at)."""
    import torch

    buffer = torch.ones(megabytes * 2**20 // 4)  # float32
    buffer.sum()  # first touch (page faults) outside the timing
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        seconds.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(seconds) / 1e9


def machine_key(threads: int | None = None) -> str:
    """Identifies 'this machine' for tuning: the CPU model, its core count and the torch thread count."""
    threads = threads if threads is not None else torch_threads()
    return f"{cpu_model()} x{os.cpu_count()} t{threads}"


def _status_kb(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the peak-RSS mark; False where the kernel does not allow it (tried on every call: one syscall)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mb() -> float:
    """Peak RSS since the last reset_peak_rss() (or of the whole process where resetting is refused)."""
    kb = _status_kb("VmHWM")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024.0
