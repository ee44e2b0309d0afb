"""What other processes leave this one: spare CPUs from /proc/stat less this process's own CPU time."""

from __future__ import annotations

import os
import time

import pytest

from trt_lookahead.backends.cpu_load import CpuSample, IdleWatch, available_memory, spare_cpus

LINUX = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="CPU time is read from Linux's /proc/stat")


def test_spare_cpus_is_the_cpus_less_what_the_others_kept_busy() -> None:
    before = CpuSample(wall=10.0, idle=1000, total=4000, own=5.0)
    # 1 s on 2 CPUs: 200 jiffies, 50 idle -> 1.5 CPUs busy, 1.2 of them this process's -> others 0.3
    after = CpuSample(wall=11.0, idle=1050, total=4200, own=6.2)
    assert spare_cpus(before, after, cpus=2, usable=2) == pytest.approx(1.7)
    # 4 CPUs, 3 busy, none ours -> 1 spare; this process may use only 1 of the 4 -> at most 1
    after = CpuSample(wall=11.0, idle=1100, total=4400, own=5.0)
    assert spare_cpus(before, after, cpus=4, usable=4) == pytest.approx(1.0)
    idle = CpuSample(wall=11.0, idle=1400, total=4400, own=5.0)
    assert spare_cpus(before, idle, cpus=4, usable=1) == pytest.approx(1.0)
    # our time beyond the machine's busy time (jiffy rounding) never makes the others negative
    assert spare_cpus(before, CpuSample(11.0, 1200, 4200, 5.5), cpus=2, usable=2) == pytest.approx(2.0)
    assert spare_cpus(before, before, cpus=2, usable=2) == 2.0  # no time passed: nothing known against us


@LINUX
def test_the_watch_counts_other_processes_and_not_this_one(busy_cpus) -> None:
    usable = len(os.sched_getaffinity(0))
    watch = IdleWatch(period=0.5)
    assert watch.poll() is None  # within the first period
    time.sleep(0.6)
    quiet = watch.poll()
    if quiet is None or quiet < usable - 0.25:  # the readings below need the CPUs to ourselves
        pytest.skip(f"other processes keep {usable - (quiet or 0):.2f} CPUs busy: the live readings cannot be checked")
    end = time.monotonic() + 0.6
    while time.monotonic() < end:  # this process busy: its own time never counts against it
        pass
    own = watch.poll()
    assert own is not None and own > usable - 0.75
    with busy_cpus(3.0):
        time.sleep(0.3)
        watch.poll()  # the period that saw them start
        time.sleep(0.6)
        others = watch.poll()
        assert others is not None and others < 0.75


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux's /proc/meminfo")
def test_available_memory_is_read() -> None:
    available = available_memory()
    assert available is not None and 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
