"""scripts/modeled_speed.py: each step is charged the entry's cost at its T, and on stories260K under a constant
step cost the modeled speedup is greedy's decode steps over auto's for the same tokens."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from trt_lookahead.lookahead.policy import StepCost
from trt_lookahead.runtime import LookaheadRuntime
from trt_lookahead.runtime.tuning_file import TUNING_VERSION

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "modeled_speed.py"
STORIES = ROOT / "tests" / "fixtures" / "stories260K"
PROMPTS = ("Once upon a time", "Lily and Tom went")


@pytest.fixture(scope="module")
def modeled_speed():
    sys.path.insert(0, str(SCRIPT.parent))  # it imports tree_compression as a sibling script
    spec = importlib.util.spec_from_file_location("modeled_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(SCRIPT.parent))


def test_each_step_is_charged_the_cost_at_its_step_tokens(modeled_speed):
    cost = StepCost({1: [(1, 10.0), (8, 24.0)]})  # 10 ms + 2 ms per token past the first
    # 3 greedy steps (T = 1): 30 ms; 2 steps of 2/3/2 (T = 8): 48 ms; 1 of 1/3/0 (T = 2): 12 ms
    assert modeled_speed.charge(cost, Counter({"greedy": 3, "2/3/2": 2, "1/3/0": 1})) == pytest.approx(90.0)


def test_the_script_on_stories260k(tmp_path):
    sets = tmp_path / "stories.jsonl"
    sets.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    entry = {"config": "4/3/4", "step_cost": {"1": [[1, 20.0], [64, 20.0]]},  # every step costs the same
             "priors": {"1/3/1": 1.5, "2/3/2": 1.8, "4/3/4": 2.1}}
    tuning = tmp_path / "tuning.json"
    tuning.write_text(json.dumps({"version": TUNING_VERSION, "entries": {"tuned elsewhere": entry}}))
    run = subprocess.run([sys.executable, str(SCRIPT), str(tuning), "--model", str(STORIES), "--backend", "torch",
                          "--sets", str(sets), "--tokens", "24"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={**os.environ, "TRT_LOOKAHEAD_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr
    (row,) = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith(f"| {sets}")]
    auto_steps, speedup = int(row[1]), float(row[3].split()[0])
    with LookaheadRuntime.from_pretrained(STORIES, "torch", threads=1) as rt:
        greedy_steps = sum(rt.generate(p, 24, lookahead="greedy").stats.steps - 1 for p in PROMPTS)  # no prefill
    assert auto_steps < greedy_steps  # the cheap steps bought lookahead, which accepted drafts
    assert speedup == pytest.approx(greedy_steps / auto_steps, abs=1e-3)
