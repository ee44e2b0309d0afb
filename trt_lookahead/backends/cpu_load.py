"""What the rest of the machine leaves this process: the CPUs other processes keep busy, and free memory.

    watch = IdleWatch(period=2.0)
    ...                                  # work: this process's own CPU time never counts against it
    spare = watch.poll()                 # CPUs the others left over the period just ended (None within one)

Read from Linux's /proc/stat (idle + iowait jiffies; a VM's steal time counts as busy), os.times and
/proc/meminfo; elsewhere the readers say they cannot tell. The onnxruntime backend decides from these whether
its intra-op workers spin (backends/onnxruntime.py, docs/design.md section 6.6). Imports only the standard
library.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuSample:
    """The machine's and this process's CPU time at one moment (Linux /proc/stat jiffies; os.times seconds)."""

    wall: float  # time.monotonic()
    idle: int  # idle + iowait jiffies, all CPUs
    total: int  # all but guest jiffies, all CPUs
    own: float  # this process's user + system seconds, all its threads


def cpu_sample() -> CpuSample | None:
    """Now's CpuSample; None where /proc/stat cannot be read."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    times = os.times()
    return CpuSample(time.monotonic(), fields[3] + fields[4], sum(fields[:8]), times.user + times.system)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (os.cpu_count where the platform has none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def spare_cpus(before: CpuSample, after: CpuSample, cpus: int, usable: int) -> float:
    """The CPUs the rest of the machine left this process between two samples: all `cpus` less those other
    processes kept busy (busy time machine-wide less this process's own), at most the `usable` ones.

    Worked example: 2 CPUs over 1 s, 150 of 200 jiffies busy (1.5 CPUs) of which this process used 1.2
    CPU-seconds: the others kept 0.3 CPUs busy, so 1.7 are spare. Our own spinning workers never count against us.
    """
    wall, total = after.wall - before.wall, after.total - before.total
    if wall <= 0 or total <= 0:
        return float(usable)
    busy = cpus * (total - (after.idle - before.idle)) / total
    others = max(0.0, busy - (after.own - before.own) / wall)
    return max(0.0, min(float(usable), cpus - others))


class IdleWatch:
    """Follows the CPUs other processes leave this one (`spare_cpus`), one reading per `period` seconds."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.usable = usable_cpus()
        self._cpus = os.cpu_count() or self.usable
        self._last = cpu_sample()

    @property
    def readable(self) -> bool:
        return self._last is not None

    def poll(self) -> float | None:
        """The spare CPUs over the period just ended; None within a period (or without /proc/stat)."""
        if self._last is None or time.monotonic() - self._last.wall < self.period:
            return None
        now = cpu_sample()
        if now is None:
            self._last = None
            return None
        spare, self._last = spare_cpus(self._last, now, self._cpus, self.usable), now
        return spare


def idle_cpus(seconds: float) -> float:
    """How many CPUs other processes leave this one over the next `seconds` (`spare_cpus`; a VM's steal time counts
    as busy), at most the CPUs it may use; without /proc/stat, those CPUs less the 1-minute load average."""
    watch = IdleWatch(period=seconds)
    time.sleep(seconds)
    spare = watch.poll()
    if spare is not None:
        return spare
    return max(0.0, watch.usable - os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0.0


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
