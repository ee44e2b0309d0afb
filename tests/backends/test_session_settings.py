"""onnxruntime session settings: when the intra-op workers spin, measured from the machine's idle CPUs as the session
is made and followed while it runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from trt_lookahead.backends.cpu_load import idle_cpus
from trt_lookahead.backends.onnxruntime import SessionSettings
from trt_lookahead.backends.open import open_engine
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.sampling import SamplingParams

SPIN = "session.intra_op.allow_spinning"
STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"


def test_explicit_spinning_is_what_the_session_gets() -> None:
    assert SessionSettings(threads=2, spinning=True).options().get_session_config_entry(SPIN) == "1"
    assert SessionSettings(threads=2, spinning=False).options().get_session_config_entry(SPIN) == "0"


def test_one_thread_never_spins() -> None:  # it has no workers
    assert SessionSettings(threads=1).spins() is False
    assert SessionSettings(threads=1, spinning=True).spins() is False


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="idle CPUs are read from Linux's /proc/stat")
def test_idle_cpus_sees_busy_cpus(busy_cpus) -> None:
    usable = len(os.sched_getaffinity(0))
    assert 0.0 <= idle_cpus(0.2) <= usable
    with busy_cpus(3.0):
        time.sleep(0.3)  # every usable CPU running a busy loop
        assert idle_cpus(0.5) < 0.75
        auto = SessionSettings(threads=2)
        assert auto.spins() is False  # a busy machine: the workers sleep
        assert auto.options().get_session_config_entry(SPIN) == "0"


# -- an engine's spinning follows the machine -------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    from trt_lookahead.cli import main

    out = tmp_path_factory.mktemp("follow") / "engine"
    assert main(["build", "--model", str(STORIES), "--output", str(out), "--lookahead_config", "2,2,1",
                 "--max_seq_len", "512", "--max_input_len", "16", "--max-batch", "1", "--tree", "off"]) == 0
    return out


def _greedy(executor, tokens: int, before_step=lambda: None) -> list[tuple[int, np.ndarray]]:
    """`tokens` one-token greedy steps after a prefill: (token, logits) of each, the slot released after."""
    token, out = executor.prefill(0, np.arange(1, 9), SamplingParams()), []
    for i in range(tokens):
        before_step()
        batch = StepBatch(np.array([0]), np.array([[token]]), np.array([[8 + i]]), np.array([[1, 2, 0]], np.int32),
                          np.array([[0]]))
        token = int(executor.step(batch)[0, 0])
        out.append((token, executor.step_logits().copy()))
        executor.commit(0, np.array([0]))
    executor.release(0)
    return out


@pytest.mark.export
@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="idle CPUs are read from Linux's /proc/stat")
def test_an_engine_stops_spinning_when_other_processes_take_the_cpus(engine_dir, busy_cpus) -> None:
    """A session whose workers spin is replaced by one whose workers sleep once other processes keep the CPUs busy
    (a few FOLLOW_PERIOD_S readings and a session build later), and the steps give the same bits throughout."""
    engine = open_engine(engine_dir, session=SessionSettings(threads=2), verify=False)
    executor = engine.executor()
    spun = engine.spinning  # True on a quiet machine: the first session was made with spinning workers
    deadline = time.monotonic() + 40
    with busy_cpus(60.0):
        executor.prefill(0, np.arange(1, 9), SamplingParams())
        while engine.spinning and time.monotonic() < deadline:  # keep stepping while the watch reads the machine
            executor.step(StepBatch(np.array([0]), np.array([[1]]), np.array([[8]]),
                                    np.array([[1, 2, 0]], np.int32), np.array([[0]])))
            time.sleep(0.05)
        executor.release(0)
    assert engine.spinning is False
    assert engine.respins == (1 if spun else 0)
    followed = _greedy(executor, 12)
    fixed = open_engine(engine_dir, session=SessionSettings(threads=2, spinning=False), verify=False).executor()
    reference = _greedy(fixed, 12)
    assert [t for t, _ in followed] == [t for t, _ in reference]
    for (_, a), (_, b) in zip(followed, reference, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.export
def test_an_explicit_spinning_setting_is_never_replaced(engine_dir, busy_cpus) -> None:
    engine = open_engine(engine_dir, session=SessionSettings(threads=2, spinning=True), verify=False)
    executor = engine.executor()
    with busy_cpus(10.0):
        _greedy(executor, 8, before_step=lambda: time.sleep(0.6))  # readings would say: stop spinning
        time.sleep(1.0)  # a replacement would be made by now
    assert engine.spinning is True and engine.respins == 0
