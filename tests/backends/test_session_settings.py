"""onnxruntime session settings: when the intra-op workers spin, measured from the machine's idle CPUs."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from trt_lookahead.backends.onnxruntime import SessionSettings, idle_cpus

SPIN = "session.intra_op.allow_spinning"


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_explicit_spinning_is_what_the_session_gets() -> None:
    assert SessionSettings(threads=2, spinning=True).options().get_session_config_entry(SPIN) == "1"
    assert SessionSettings(threads=2, spinning=False).options().get_session_config_entry(SPIN) == "0"


def test_one_thread_never_spins() -> None:  # it has no workers
    assert SessionSettings(threads=1).spins() is False
    assert SessionSettings(threads=1, spinning=True).spins() is False


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="idle CPUs are read from Linux's /proc/stat")
def test_idle_cpus_sees_busy_cpus() -> None:
    usable = len(os.sched_getaffinity(0))
    assert 0.0 <= idle_cpus(0.2) <= usable
    busy = [multiprocessing.get_context("fork").Process(target=_busy, args=(3.0,)) for _ in range(usable)]
    for process in busy:
        process.start()
    try:
        time.sleep(0.3)  # every usable CPU running a busy loop
        assert idle_cpus(0.5) < 0.75
        auto = SessionSettings(threads=2)
        assert auto.spins() is False  # a busy machine: the workers sleep
        assert auto.options().get_session_config_entry(SPIN) == "0"
    finally:
        for process in busy:
            process.terminate()
            process.join()
