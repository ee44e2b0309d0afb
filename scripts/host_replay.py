"""Host time per decode step with real drafts: after the CPU model step, and after a replayed step's wait.

    python scripts/host_replay.py --step-ms 20 --wait spin

Host time (decode wall time outside executor step/commit, docs/design.md 8) is the decoder's Python work, and
how long it takes depends on what ran on the core before it. This script decodes prompts of the given sets
with a checkpoint (SmolLM2-135M-Instruct by default) in float32 at one config (default 15/5/15, T = 120) on
the torch executor, recording every step's outputs and top-k ids, then decodes the same prompts against a
replay of those steps: it waits --step-ms, spinning (as CUDA's default sync does) or sleeping (blocking
sync), and returns the recorded outputs. The replay checks that each step's inputs equal the recorded ones
and that the tokens do, so both runs do the same host work. A control, a fixed loop of plain Python that is
not the decoder, is timed back to back and right after the same wait: its ratio is what the machine alone
does to host code after a wait. Give the machine's load beside the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trt_lookahead.backends.torch import BatchedTorchExecutor
from trt_lookahead.bench.datasets import encode_row, load_dataset
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.lookahead.tree import TREE_DEPTH, tree_template
from trt_lookahead.model.checkpoint import load_llama, load_tokenizer
from trt_lookahead.model.fetch import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test support, not in the package
from support.ablation import LookaheadDecoder


@dataclass
class Recording:
    """What one request's executor calls returned, in order: the prefill's token, then each step."""

    first: int = 0
    steps: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = field(default_factory=list)  # ids, out, top


class Recorder:
    """The torch executor, recording what each call returned (one request at a time, slot 0)."""

    def __init__(self, inner: BatchedTorchExecutor) -> None:
        self.inner, self.recording = inner, Recording()
        self.vocab_size, self.max_seq_len = inner.vocab_size, inner.max_seq_len
        self.max_batch, self.step_tokens = inner.max_batch, inner.step_tokens
        self.pads_rows = inner.pads_rows

    def prefill(self, slot: int, prompt_ids: np.ndarray, sampling: SamplingParams) -> int:
        self.recording = Recording(self.inner.prefill(slot, prompt_ids, sampling))
        return self.recording.first

    def step(self, batch: StepBatch) -> np.ndarray:
        out = self.inner.step(batch)
        top = None if batch.top_ids is None else batch.top_ids.copy()
        self.recording.steps.append((batch.input_ids.copy(), out.copy(), top))
        return out

    def commit(self, slot: int, rows: np.ndarray) -> None:
        self.inner.commit(slot, rows)

    def release(self, slot: int) -> None:
        self.inner.release(slot)


def wait(seconds: float, spin: bool) -> None:
    """What the host does while a device step runs: spin on the clock, or sleep (then spin out the rest)."""
    deadline = time.perf_counter() + seconds
    if not spin:
        time.sleep(seconds)
    while time.perf_counter() < deadline:
        pass


def control_work(table: dict[int, list[int]]) -> int:
    """A fixed loop of dict, list and set work in plain Python, about the decoder's kind of host code."""
    acc = 0
    for t in range(120):
        for x in table[t * 7 % len(table)][:4]:
            acc = acc + x if x & 1 else acc ^ x
        acc += len({t, t + 1})
    return acc


def control_us(step_s: float, spin: bool, rounds: int = 40) -> tuple[float, float]:
    """Median microseconds of `control_work` run back to back, and right after a wait of `step_s`."""
    rng = np.random.default_rng(0)
    table = {i: rng.integers(0, 1000, 8).tolist() for i in range(5000)}
    warm, waited = [], []
    for _ in range(rounds):
        for times, seconds in ((warm, 0.0), (waited, step_s)):
            control_work(table)
            wait(seconds, spin)
            start = time.perf_counter()
            control_work(table)
            times.append(1e6 * (time.perf_counter() - start))
    return statistics.median(warm), statistics.median(waited)


class Replay:
    """Returns a recording's outputs after waiting `step_ms` (spinning or sleeping), as a device step would;
    the inputs must match the recorded ones."""

    def __init__(self, like: Recorder, recording: Recording, step_ms: float, spin: bool) -> None:
        self.vocab_size, self.max_seq_len = like.vocab_size, like.max_seq_len
        self.max_batch, self.step_tokens = like.max_batch, like.step_tokens
        self.pads_rows = like.pads_rows
        self.recording, self.step_s, self.spin, self.next = recording, step_ms / 1000.0, spin, 0

    def prefill(self, slot: int, prompt_ids: np.ndarray, sampling: SamplingParams) -> int:
        return self.recording.first

    def step(self, batch: StepBatch) -> np.ndarray:
        ids, out, top = self.recording.steps[self.next]
        self.next += 1
        if not np.array_equal(ids, batch.input_ids):
            raise AssertionError(f"step {self.next}: the replayed request fed other inputs than the recorded one")
        if top is not None and batch.top_ids is not None:
            batch.top_ids[:] = top
        wait(self.step_s, self.spin)
        return out

    def commit(self, slot: int, rows: np.ndarray) -> None:
        pass

    def release(self, slot: int) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a known model name or a checkpoint dir")
    ap.add_argument("--config", default="15,5,15")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--sets", default="humaneval,mt_bench,gsm8k", help="dataset names or JSONL files")
    ap.add_argument("--prompts", type=int, default=2, help="per set")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the replayed step's wait")
    ap.add_argument("--wait", choices=("spin", "sleep"), default="spin", help="how the replay waits")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model, _ = load_llama(path, dtype="float32", weight_layout="auto")
    tokenizer = load_tokenizer(path)
    prompts = [encode_row(tokenizer, row) for name in args.sets.split(",")
               for row in load_dataset(name).rows[: args.prompts]]
    cfg = LookaheadConfig.parse(args.config)
    print(f"{path.name} float32, {cfg}, {len(prompts)} prompts x {args.tokens} tokens, torch threads "
          f"{args.threads}, replayed step {args.step_ms} ms ({args.wait}); load at start {os.getloadavg()}\n")
    print("| verification | host ms/step, CPU model step | host ms/step, replayed step | compression |")
    print("|---|---:|---:|---:|")
    for name, tree in (("linear", None), ("tree", tree_template(cfg.G * cfg.levels, TREE_DEPTH))):
        recorder = Recorder(BatchedTorchExecutor(model, 1, 1024, cfg.step_tokens, tree=tree))
        live, replayed, generated, steps = [], [], 0, 0
        for ids in prompts:
            result = LookaheadDecoder(recorder, cfg, tree=tree).generate(list(ids), args.tokens)
            replay = Replay(recorder, recorder.recording, args.step_ms, args.wait == "spin")
            again = LookaheadDecoder(replay, cfg, tree=tree).generate(list(ids), args.tokens)
            assert again.token_ids == result.token_ids and replay.next == len(recorder.recording.steps)
            live.append(result.stats.host_ms_per_step)
            replayed.append(again.stats.host_ms_per_step)
            generated, steps = generated + result.stats.generated_tokens, steps + result.stats.steps
        print(f"| {name} | {statistics.median(live):.3f} | {statistics.median(replayed):.3f} | "
              f"{generated / steps:.3f} |", flush=True)
    warm, waited = control_us(args.step_ms / 1000.0, args.wait == "spin")
    print(f"\n(medians over prompts) control, plain Python that is not the decoder: {warm:.1f} us back to back, "
          f"{waited:.1f} us after the wait ({waited / warm:.2f}x); load at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
