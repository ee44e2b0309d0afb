"""scripts/host_replay.py: its replay gives the recorded outputs for the recorded inputs only, and the script
runs end to end on stories260K (the replayed decode must give the same tokens in the same steps)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from trt_lookahead.lookahead.executor import StepBatch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "host_replay.py"
STORIES = ROOT / "tests" / "fixtures" / "stories260K"


@pytest.fixture(scope="module")
def host_replay():
    spec = importlib.util.spec_from_file_location("host_replay", SCRIPT)
    module = sys.modules["host_replay"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
    spec.loader.exec_module(module)
    return module


class Like:
    vocab_size, max_seq_len, max_batch, step_tokens = 16, 64, 1, 4
    pads_rows = False


def batch(ids: list[int], k: int) -> StepBatch:
    return StepBatch(np.zeros(1, np.int64), np.array([ids]), np.zeros((1, 4), np.int64),
                     np.array([[1, 3, 1]], np.int32), np.array([[0, 1, 2, 3]]), np.zeros((1, 4, k), np.int64))


def test_the_replay_returns_the_recorded_step_and_refuses_other_inputs(host_replay):
    top = np.arange(8).reshape(1, 4, 2)
    recording = host_replay.Recording(5, [(np.array([[5, 1, 2, 3]]), np.array([[1, 2, 3, 4]]), top)])
    replay = host_replay.Replay(Like(), recording, 0.0, True)
    assert replay.prefill(0, np.array([1, 2]), None) == 5
    step = batch([5, 1, 2, 3], 2)
    assert replay.step(step).tolist() == [[1, 2, 3, 4]] and step.top_ids.tolist() == top.tolist()
    other = host_replay.Replay(Like(), recording, 0.0, False)
    with pytest.raises(AssertionError, match="step 1: the replayed request fed other inputs"):
        other.step(batch([5, 1, 2, 9], 2))


@pytest.mark.parametrize("spin", [True, False])
def test_wait_lasts_at_least_the_step(host_replay, spin):
    start = time.perf_counter()
    host_replay.wait(0.01, spin)
    assert time.perf_counter() - start >= 0.01


def test_the_script_on_stories260k(tmp_path):
    sets = tmp_path / "stories.jsonl"
    sets.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Once upon a time", "Lily and Tom went")))
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(STORIES), "--sets", str(sets), "--config",
                          "4,3,4", "--tokens", "12", "--step-ms", "1"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| linear") or
            line.startswith("| tree")]
    assert [r[0].strip() for r in rows] == ["linear", "tree"]
    for _, live, replayed, compression in rows:
        assert float(live) > 0 and float(replayed) > 0 and 1.0 <= float(compression) <= 3.0
    control = re.search(r"control, .*: ([\d.]+) us back to back, ([\d.]+) us after the wait \(([\d.]+)x\)", run.stdout)
    assert control is not None, run.stdout
    warm, waited, ratio = map(float, control.groups())
    assert warm > 0 and ratio == pytest.approx(waited / warm, abs=0.02)
