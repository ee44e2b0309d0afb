"""One rank of a tensor-parallel run on stories260K (tests/backends/test_tensor_parallel.py):

    python tests/support/tensor_parallel_worker.py RANK WORLD PORT OUT [MODE]

Every rank loads the checkpoint, takes its shard and builds the same exact CPU executor (one torch thread). Rank 0
wraps it in a LeaderExecutor under a LookaheadRuntime and writes what the test checks to OUT (JSON); the others
follow. MODE "die": rank 1 exits after its first few calls (a lost rank), and rank 0 records the error it gets.
MODE "messages": rank 0 sends `messages()` (send_message), rank 1 writes to OUT.rank1 whether each arrived whole.
MODE "reduce": every rank reduces partials of several shapes in both exact forms; each writes to OUT.rankR whether
both equal the partials added in rank order (every rank's partials are drawn from seeds all ranks know).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from trt_lookahead.backends.tensor_parallel import (
    GATHER,
    MESSAGE_BYTES,
    TWO_PHASE,
    LeaderExecutor,
    end_rank,
    exact_all_reduce,
    follow,
    init_group,
    receive_message,
    send_message,
    shard_llama,
)
from trt_lookahead.backends.torch import BatchedTorchExecutor
from trt_lookahead.lookahead.config import Lookahead, LookaheadConfig
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.policy import AutoPolicy
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.model.checkpoint import load_llama, load_tokenizer
from trt_lookahead.runtime import LookaheadRuntime
from trt_lookahead.runtime.load import LoadedModel

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
PROMPTS = ["Once upon a time", "The little dog ran to the", "Lily and Ben went to the park"]
CONFIG = LookaheadConfig(4, 3, 4)


def executor(model: torch.nn.Module, collectives=None) -> BatchedTorchExecutor:
    return BatchedTorchExecutor(model, 4, 256, 16, exact=True, collectives=collectives)


def lookahead_step(rng: np.random.Generator, cache_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, positions, step config) of one random 4,3,4 lookahead row at cache_len."""
    layout = StepLayout(CONFIG)
    ids = rng.integers(3, 512, layout.step_tokens)
    return ids, cache_len + layout.rel_positions, np.array([4, 3, 4], np.int32)


def batch(rows: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], T: int) -> StepBatch:
    """A StepBatch of (slot, ids, positions, config) rows padded to T tokens, logits at every slot."""
    ids, positions = np.zeros((len(rows), T), np.int64), np.zeros((len(rows), T), np.int64)
    for b, (_, i, p, _) in enumerate(rows):
        ids[b, : len(i)], positions[b, : len(p)] = i, p
    outputs = np.tile(np.arange(T), (len(rows), 1))
    return StepBatch(np.array([r[0] for r in rows]), ids, positions, np.stack([r[3] for r in rows]), outputs)


def leader(ex: BatchedTorchExecutor, group, mode: str) -> dict:
    lead = LeaderExecutor(ex, group)
    if mode == "die":
        errors = []
        for _ in range(3):  # the first call meets the lost rank; the next ones fail at once, no collective tried
            started = time.monotonic()
            try:
                for _ in range(20):
                    lead.prefill(0, np.arange(3, 40), SamplingParams())
                    lead.release(0)
            except Exception as exc:  # what a lost rank looks like to rank 0
                errors.append({"error": f"{type(exc).__name__}: {exc}"[:800], "seconds": time.monotonic() - started})
        return {"errors": errors}
    result: dict = {}
    # the logits of a lookahead step at TP = 2 against the whole model (TP = 1) on this rank, and a slot's bits
    # alone against batched with a companion
    rng = np.random.default_rng(0)
    whole = executor(load_llama(STORIES, weight_layout="auto")[0])
    prompt = rng.integers(3, 512, 40)
    row = lookahead_step(rng, len(prompt))
    T = len(row[0])
    for e in (lead, whole):
        e.prefill(0, prompt, SamplingParams())
    lead.prefill(1, rng.integers(3, 512, 25), SamplingParams())  # a companion's prefix
    alone = lead.step_logits(batch([(0, *row)], T))[0]
    reference = whole.step_logits(batch([(0, *row)], T))[0]
    other = lookahead_step(rng, 25)
    together = lead.step_logits(batch([(1, *other), (0, *row)], T))[1]
    result["alone_equals_batched"] = bool(torch.equal(alone, together))
    result["max_abs_vs_whole"] = float((alone - reference).abs().max())
    result["max_abs_whole"] = float(reference.abs().max())
    for slot in (0, 1):
        lead.release(slot)
    # end to end: lookahead and batched requests answer as greedy
    loaded = LoadedModel(load_tokenizer(STORIES), lead, 256, [2], "torch", "float32", STORIES, max_lookahead=None)
    rt = LookaheadRuntime(loaded, lookahead=Lookahead(CONFIG), auto=AutoPolicy.untuned(ex.step_tokens))
    try:
        greedy = [rt.generate(p, max_new_tokens=40, lookahead="greedy").token_ids for p in PROMPTS]
        result["lookahead"] = [rt.generate(p, max_new_tokens=40).token_ids for p in PROMPTS]
        handles = [rt.stream(p, 40) for p in PROMPTS]  # three requests at once: batched steps
        result["batched"] = [[t for chunk in h for t in chunk.token_ids] for h in handles]
        result["greedy"] = greedy
    finally:
        rt.close()
    lead.close()
    return result


def messages() -> list:
    """What mode "messages" sends: a step-sized message, ones whose pickle fills one broadcast exactly and by one
    byte too many (a second broadcast), and a large one."""
    def sized(n: int) -> bytes:  # bytes whose pickle is n bytes long (a pickle's overhead past 255 bytes is fixed)
        return b"x" * (n - (len(pickle.dumps(b"x" * 300)) - 300))

    room = MESSAGE_BYTES - 8
    sent = [[("step", (np.arange(64), {"a": 1}))], sized(room), sized(room + 1), bytes(range(256)) * 1024]
    assert [len(pickle.dumps(m)) for m in sent[1:3]] == [room, room + 1]
    return sent


REDUCE_SHAPES = [(2, 64), (7, 64), (3, 5, 64), (1, 30)]  # 30 columns split over 2 ranks, not 4 (then: gather)


def partial(shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """Rank `rank`'s partial sum of this shape: values spread over 2^-10 .. 2^10, so the order of the adds shows."""
    generator = torch.Generator().manual_seed(1000 * rank + len(shape) * 100 + shape[0])
    return torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-10, 11, shape, generator=generator))


def reduce_checks(rank: int, world: int, group) -> list[bool]:
    """Per shape and form: exact_all_reduce's result == the partials added in rank order, bit for bit."""
    results = []
    for shape in REDUCE_SHAPES:
        expected = partial(shape, 0)
        for other in range(1, world):
            expected = expected + partial(shape, other)
        for form in (GATHER, TWO_PHASE, None):
            results.append(bool(torch.equal(exact_all_reduce(partial(shape, rank), group, form), expected)))
    return results


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "run"
    torch.set_num_threads(1)
    group = init_group(rank, world, port)
    code = 0
    try:
        run(rank, world, out, mode, group)
    except Exception:
        traceback.print_exc()
        code = 1
    # as open_leader's ranks end: the followers leave the group and exit first, then rank 0
    if rank:
        end_rank(code, Path(f"{out}.done{rank}").touch)
    deadline = time.monotonic() + 60
    while (mode != "die" and not all(Path(f"{out}.done{r}").exists() for r in range(1, world))
           and time.monotonic() < deadline):
        time.sleep(0.05)
    end_rank(code)


def run(rank: int, world: int, out: Path, mode: str, group) -> None:
    if mode == "reduce":
        Path(f"{out}.rank{rank}").write_text(json.dumps(reduce_checks(rank, world, group)))
        return
    if mode == "messages":  # rank 0 sends, rank 1 writes whether it received the same objects
        sent = messages()
        if rank:
            received = [receive_message(group) for _ in sent]
            same = [pickle.dumps(a) == pickle.dumps(b) for a, b in zip(received, sent, strict=True)]
            Path(f"{out}.rank{rank}").write_text(json.dumps(same))
        else:
            for message in sent:
                send_message(message, group)
            out.write_text(json.dumps({"sent": len(sent)}))
        return
    model, _ = load_llama(STORIES, weight_layout="auto")
    shard = shard_llama(model, rank, world, group)
    ex = executor(shard.model, shard.collectives)
    if rank:
        if mode == "die":
            os._exit(0)  # gone without a word: rank 0's next collective fails
        follow(ex, group)
        return
    out.write_text(json.dumps(leader(ex, group, mode)))


if __name__ == "__main__":
    main()
