"""Tuning: the tuning file, the choice on a fake runtime with a fake clock, `auto` on first use, `tune`."""

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from trt_lookahead.cli import main
from trt_lookahead.lookahead.config import AUTO, LookaheadConfig
from trt_lookahead.runtime import LookaheadRuntime
from trt_lookahead.tuning import file as tuning_file
from trt_lookahead.tuning import tune

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"


@pytest.fixture(autouse=True)
def _one_thread_and_private_tuning_file(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setattr(tuning_file, "cache_dir", lambda: tmp_path / "cache")  # models stay in the real cache


def test_tuning_file_round_trip_and_auto(tmp_path):
    key = tuning_file.tuning_key(str(STORIES), "float32", "torch")
    assert str(STORIES.resolve()) in key and "dtype=float32" in key and "machine=" in key
    assert tuning_file.lookup_tuning(str(STORIES), "float32", "torch") is None
    tuning_file.write_tuning_entry(key, {"config": "4/3/4"})
    tuning_file.write_tuning_entry(tuning_file.tuning_key(str(STORIES), "bfloat16", "torch"), {"config": "greedy"})
    assert tuning_file.tuning_path() == tmp_path / "cache" / "tuning.json"
    entry = tuning_file.lookup_tuning(str(STORIES), "float32", "torch")
    assert tuning_file.config_from_entry(entry) == LookaheadConfig(4, 3, 4)
    assert LookaheadRuntime.from_pretrained(STORIES, lookahead=AUTO).lookahead == LookaheadConfig(4, 3, 4)
    bf16 = LookaheadRuntime.from_pretrained(STORIES, dtype="bfloat16", lookahead=AUTO)
    assert bf16.lookahead is None and bf16.request_config(AUTO).is_greedy  # tuned: greedy wins
    assert len(json.loads(tuning_file.tuning_path().read_text())["entries"]) == 2


def test_unreadable_tuning_file_is_ignored(capsys):
    path = tuning_file.tuning_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert tuning_file.lookup_tuning(str(STORIES), "float32", "torch") is None
    assert "ignoring unreadable tuning file" in capsys.readouterr().err
    tuning_file.write_tuning_entry("k", {"config": "greedy"})
    assert tuning_file.read_tuning_file()["entries"] == {"k": {"config": "greedy"}}


def test_step_cost_interpolation():
    costs = {1: 10.0, 16: 25.0, 56: 65.0}
    assert tune.step_cost_at(costs, 16) == 25.0
    assert tune.step_cost_at(costs, 6) == pytest.approx(15.0)
    assert tune.step_cost_at(costs, 96) == pytest.approx(105.0)  # extrapolated from the last two
    assert tune.step_cost_at({1: 10.0}, 4) == 40.0


# A fake runtime with a fake clock: step cost and compression are functions of (W, N, G), so the tuner's
# choice is known in advance and no real timing is involved.


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@dataclass
class FakeStats:
    decode_seconds: float
    host_ms_per_step: float = 0.0
    executor_seconds: float = 0.0
    accepted_histogram: Counter = field(default_factory=Counter)


@dataclass
class FakeOutput:
    generated_tokens: int
    steps: int
    stats: FakeStats


class FakeExecutor:
    vocab_size = 100

    def __init__(self, rt, T):
        self.rt, self.T = rt, T

    def reset(self, sampling):
        pass

    def prefill(self, ids):
        return 1

    def step(self, ids, positions):
        assert len(ids) == len(positions) == self.T
        self.rt.clock.now += self.rt.cost(self.T) / 1000.0
        return np.zeros(self.T, np.int64)

    def commit(self, slots):
        assert slots[0] == 0 and len(slots) == (1 if self.T == 1 else 2)


class FakeLayout:
    def __init__(self, config):
        self.step_tokens = config.step_tokens
        self.rel_positions = np.zeros(self.step_tokens, np.int64)


class FakeRuntime:
    dtype, backend, max_seq_len, max_lookahead, tokenizer, model_path = "float32", "torch", 512, None, None, "fake"

    def __init__(self, cost, compression, run_cost=None):
        self.cost, self.compression, self.clock = cost, compression, FakeClock()
        self.run_cost = run_cost or cost  # per step inside generate (the probe uses `cost`)
        self.calls = Counter()

    def executor_for(self, config):
        return FakeExecutor(self, config.step_tokens), FakeLayout(config)

    def generate(self, ids, max_new_tokens, lookahead):
        config = LookaheadConfig.greedy() if lookahead == "greedy" else lookahead
        self.calls[str(config)] += 1
        c = 1.0 if config.is_greedy else self.compression(config)
        steps = max(1, round(max_new_tokens / c))
        seconds = (steps - 1) * self.run_cost(config.step_tokens) / 1000.0
        self.clock.now += seconds
        return FakeOutput(max_new_tokens, steps, FakeStats(seconds))


def _fake_tune(rt, budget=1e6):
    prompts = [[1, 2, 3, 4]] * 3
    return tune.tune(
        rt, prompt_ids=prompts, budget_seconds=budget, max_new_tokens=64, progress=False,
        clock=rt.clock, candidates=[LookaheadConfig(*c) for c in [(1, 3, 2), (4, 3, 4), (7, 5, 7), (15, 5, 15)]],
    )


def test_tune_picks_the_lowest_predicted_time_per_token():
    rt = FakeRuntime(cost=lambda T: 20.0 + 0.5 * T, compression=lambda c: 1.0 + 0.3 * c.W * (c.N - 2))
    report = _fake_tune(rt)
    # predicted ms/token: 1/3/2 -> 23/1.3, 4/3/4 -> 28/2.2, 7/5/7 -> 48/7.3, 15/5/15 -> 80/14.5
    assert report.config == "15/5/15"
    assert report.step_cost_ms["1"] == pytest.approx(20.5) and report.step_cost_ms["120"] == pytest.approx(80.0)
    assert report.verified[0]["config"] == "15/5/15" and report.verified[0]["speedup"] > 1.0
    assert rt.calls["1/2/0"] > 0  # verified against greedy


def test_tune_answers_greedy_when_wide_steps_cost_too_much():
    rt = FakeRuntime(cost=lambda T: 20.0 + 10.0 * T, compression=lambda c: 1.2)
    report = _fake_tune(rt)
    assert report.config == "greedy" and report.verified == []
    skipped = [c for c in report.candidates if c.skipped]
    assert {c.config for c in skipped} == {"4/3/4", "7/5/7", "15/5/15"}
    assert "1/3/2" not in {c.config for c in skipped}


def test_tune_rejects_a_winner_that_verification_finds_slower():
    # the step-cost probe says wide steps are cheap, but real generation runs them three times slower
    rt = FakeRuntime(cost=lambda T: 20.0, compression=lambda c: 1.5, run_cost=lambda T: 20.0 if T == 1 else 60.0)
    report = _fake_tune(rt)
    assert report.config == "greedy"
    assert len(report.verified) == 3 and all(v["speedup"] < 1.0 for v in report.verified)
    assert "not faster than greedy" in report.reason



@pytest.mark.slow  # tunes for its 2 s budget
def test_auto_tunes_on_first_use_and_caches(monkeypatch, capsys):
    monkeypatch.setenv("TRT_LOOKAHEAD_TUNE_BUDGET", "2")
    monkeypatch.setattr(tune, "CANDIDATES", (LookaheadConfig(4, 3, 4), LookaheadConfig(2, 2, 1)))
    rt = LookaheadRuntime.from_pretrained(STORIES, lookahead=None)
    first = rt.request_config(AUTO)
    assert "tuning now" in capsys.readouterr().err
    entry = tuning_file.lookup_tuning(str(STORIES), "float32", "torch")
    assert entry is not None and entry["config"] in ("greedy", "4/3/4", "2/2/1")
    assert set(entry["step_cost_ms"]) >= {"1"} and entry["machine"]["cpu"]
    assert first == (tuning_file.config_from_entry(entry) or LookaheadConfig.greedy())
    assert rt.request_config(AUTO) == first
    assert "tuning now" not in capsys.readouterr().err


@pytest.mark.slow  # tunes for its 3 s budget
def test_tune_cli_writes_the_tuning_file(capsys):
    code = main(["tune", "--model", str(STORIES), "--dataset", "humaneval", "--budget-seconds", "3", "--json"])
    assert code == 0
    entry = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert entry["dataset"] == "humaneval" and entry["dtype"] == "float32"
    assert tuning_file.lookup_tuning(str(STORIES), "float32", "torch") == entry
