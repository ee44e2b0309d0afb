"""The scheduler with model-free oracles: exact under batching whatever arrives, leaves or fails, and when, with
prompts prefilled separately or in chunks beside the decode steps."""

import asyncio
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.oracles import ORACLES, OracleExecutor, induction_logits, markov_logits, reference_generate

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import Lookahead, LookaheadConfig
from trt_lookahead.lookahead.decoder import GREEDY_STEP, RequestDecoder
from trt_lookahead.lookahead.policy import LookaheadPolicy, Priors, StepCost
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.runtime import LookaheadRuntime
from trt_lookahead.runtime.scheduler import CHUNKED, SEPARATE, Job, QueueFull, Scheduler, SchedulerClosed


def job(decoder: RequestDecoder, sampling: SamplingParams | None = None, explicit: bool = True) -> Job:
    """A scheduler job: the decoder's config every step (`explicit`), or `auto` up to it."""
    return Job(decoder, Lookahead(decoder.config, auto=not explicit), sampling or SamplingParams())

PREFILLS = [SEPARATE, 3]  # 3: prompts of up to 14 tokens take up to five chunks

PRIORS = Priors({"1/3/1": 1.5, "2/3/2": 1.8, "4/3/4": 2.1, "2/4/2": 2.0})


class RandomPolicy(LookaheadPolicy):
    """Any config each request may use, at random each step: the tokens must not care."""

    def __init__(self, seed: int) -> None:
        super().__init__(StepCost.linear(1.0, 0.1), PRIORS)
        self.rng = random.Random(seed)

    def choose(self, states, supplies, pads_rows=False):
        out = []
        for state in states:
            cfg = state.config
            if not state.auto or self.rng.random() < 0.2:
                out.append(GREEDY_STEP if state.auto else cfg)
            else:
                out.append(LookaheadConfig(self.rng.randint(1, cfg.W), cfg.N, self.rng.randint(0, cfg.G)))
        return out


@st.composite
def workloads(draw):
    vocab = draw(st.integers(8, 30))
    n = draw(st.integers(1, 9))
    requests = []
    for _ in range(n):
        sampled = draw(st.booleans())
        requests.append(dict(
            arrival=draw(st.integers(0, 25)),
            prompt=draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=14)),
            config=LookaheadConfig(draw(st.integers(1, 5)), draw(st.integers(2, 5)), draw(st.integers(0, 5))),
            explicit=draw(st.booleans()),
            max_new=draw(st.integers(1, 30)),
            stop=sorted(draw(st.sets(st.integers(0, vocab - 1), max_size=1))),
            seed=draw(st.integers(0, 2**31)),
            sampling=SamplingParams(draw(st.floats(0.3, 1.5)), draw(st.sampled_from([0, 4])),
                                    draw(st.sampled_from([1.0, 0.9])), draw(st.integers(0, 2**31)))
            if sampled else SamplingParams(),
            cancel_after=draw(st.one_of(st.none(), st.integers(0, 15))),
        ))
    return dict(
        vocab=vocab,
        oracle=draw(st.sampled_from(sorted(ORACLES))),
        oracle_seed=draw(st.integers(0, 1000)),
        max_batch=draw(st.integers(1, 4)),
        pads_rows=draw(st.booleans()),
        policy=draw(st.sampled_from(["random", "cheap", "steep"])),
        policy_seed=draw(st.integers(0, 1000)),
        requests=requests,
    )


def make_policy(kind: str, seed: int) -> LookaheadPolicy:
    if kind == "random":
        return RandomPolicy(seed)
    return LookaheadPolicy(StepCost.linear(10.0, 0.1 if kind == "cheap" else 6.0), PRIORS)


@pytest.mark.parametrize("prefill", PREFILLS)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_every_request_emits_its_plain_decoding_whatever_shares_its_steps(prefill, w):
    """Greedy and seeded sampling, any arrivals, configs, stops and cancellations (during prefill too): every
    request's tokens are those of plain decoding alone (the oracle checks every position and commit)."""
    logits = ORACLES[w["oracle"]](w["vocab"], w["oracle_seed"])
    executor = OracleExecutor(logits, w["vocab"], max_batch=w["max_batch"], step_tokens=64, pads_rows=w["pads_rows"])
    scheduler = Scheduler(executor, make_policy(w["policy"], w["policy_seed"]), max_queue=100, prefill=prefill)
    handles, step = {}, 0
    pending = sorted(range(len(w["requests"])), key=lambda i: w["requests"][i]["arrival"])
    while pending or not scheduler.idle:
        while pending and w["requests"][pending[0]]["arrival"] <= step:
            i = pending.pop(0)
            r = w["requests"][i]
            decoder = RequestDecoder(r["config"], r["prompt"], r["max_new"], r["stop"], r["seed"])
            handles[i] = scheduler.submit(job(decoder, r["sampling"], r["explicit"]))
        for i, handle in handles.items():
            if w["requests"][i]["cancel_after"] == step - w["requests"][i]["arrival"]:
                handle.cancel()
        scheduler.run_once()
        step += 1
        assert step < 2000
    for i, handle in handles.items():
        r = w["requests"][i]
        got = [t for block in handle for t in block]
        expected = reference_generate(logits, r["prompt"], r["max_new"], r["sampling"], r["stop"])
        assert handle.result is not None and got == handle.result.token_ids
        if handle.result.finish_reason == "cancelled":
            assert got == expected[: len(got)]
        else:
            assert got == expected
            assert handle.result.finish_reason == ("stop" if expected[-1] in r["stop"] else "length")
    assert scheduler.free_slots == w["max_batch"] and all(executor.cache_len(s) == 0 for s in range(w["max_batch"]))
    assert max(executor.rows_per_step, default=0) <= w["max_batch"]


class Faulty(RequestDecoder):
    """A request whose host code raises in one phase after `after` calls of it."""

    def __init__(self, phase: str, after: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phase, self.after = phase, after

    def _maybe(self, phase):
        if phase == self.phase:
            if self.after == 0:
                raise RuntimeError(f"injected fault in {phase}")
            self.after -= 1

    def setup(self, first_token):
        self._maybe("setup")
        return super().setup(first_token)

    def prepare(self, *args):
        self._maybe("prepare")
        return super().prepare(*args)

    def verify(self, out):
        self._maybe("verify")
        return super().verify(out)

    def harvest(self, out, top=None):
        self._maybe("harvest")
        return super().harvest(out, top)

    def draft_supply(self):
        self._maybe("draft_supply")
        return super().draft_supply()


@pytest.mark.parametrize("prefill", PREFILLS)
@pytest.mark.parametrize(("phase", "after"), [("setup", 0), ("prepare", 2), ("verify", 2), ("harvest", 2),
                                              ("draft_supply", 2)])
def test_a_fault_in_one_requests_host_code_fails_that_request_only(phase, after, prefill):
    logits = induction_logits(20, 1)
    executor = OracleExecutor(logits, 20, max_batch=3)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS), prefill=prefill)
    prompt = [1, 2, 3, 4, 1, 2]
    good = [scheduler.submit(job(RequestDecoder(LookaheadConfig(3, 3, 3), prompt, 25), explicit=e))
            for e in (True, False)]
    bad = scheduler.submit(job(Faulty(phase, after, LookaheadConfig(2, 3, 2), prompt, 25), explicit=False))
    while not scheduler.idle:
        scheduler.run_once()
    with pytest.raises(RuntimeError, match=f"injected fault in {phase}"):
        list(bad)
    expected = reference_generate(logits, prompt, 25)
    assert [[t for b in h for t in b] for h in good] == [expected, expected]
    assert scheduler.stats.failed == 1 and scheduler.free_slots == 3


class BrokenStep(OracleExecutor):
    """An executor whose step fails once, at the given step."""

    def __init__(self, *args, fail_at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_at = fail_at

    def step(self, batch):
        if self.steps == self.fail_at:
            self.steps += 1
            raise RuntimeError("device lost")
        return super().step(batch)


def test_a_failing_step_fails_its_requests_and_the_next_ones_run_exactly():
    logits = markov_logits(20, 2, 4)
    executor = BrokenStep(logits, 20, max_batch=2, fail_at=3)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS))
    first = [scheduler.submit(job(RequestDecoder(LookaheadConfig(2, 3, 2), [i, 2, 3], 20))) for i in range(2)]
    later = scheduler.submit(job(RequestDecoder(LookaheadConfig(2, 3, 2), [5, 6], 20)))
    while not scheduler.idle:
        scheduler.run_once()
    for handle in first:
        with pytest.raises(RuntimeError, match="device lost"):
            list(handle)
    assert [t for b in later for t in b] == reference_generate(logits, [5, 6], 20)
    assert scheduler.free_slots == 2


def test_a_full_queue_is_refused_with_the_limit_and_the_fix():
    executor = OracleExecutor(markov_logits(10, 1, 0), 10, max_batch=2)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS), max_queue=3)
    handles = [scheduler.submit(job(RequestDecoder(GREEDY_STEP, [1], 5))) for _ in range(5)]  # 2 slots + 3
    with pytest.raises(QueueFull, match=r"max_queue=3\); retry later, or raise max_queue or max_batch"):
        scheduler.submit(job(RequestDecoder(GREEDY_STEP, [1], 5)))
    while not scheduler.idle:
        scheduler.run_once()
    assert all(h.result.finish_reason == "length" for h in handles for _ in [list(h)])
    scheduler.submit(job(RequestDecoder(GREEDY_STEP, [1], 5)))  # room again


def test_admission_is_first_come_first_served_and_every_request_is_in_every_step():
    executor = OracleExecutor(markov_logits(10, 1, 0), 10, max_batch=2)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS))
    handles = [scheduler.submit(job(RequestDecoder(GREEDY_STEP, [i + 1], 4))) for i in range(6)]
    order = []
    while not scheduler.idle:
        scheduler.run_once()
        order.extend(i for i, h in enumerate(handles) if h.result is not None and i not in order)
    assert order == list(range(6))
    assert executor.rows_per_step == [2] * 3 * 3  # three pairs, each 3 decode steps after its prefill


def test_close_ends_waiting_and_running_requests_and_frees_their_slots():
    executor = OracleExecutor(markov_logits(10, 1, 0), 10, max_batch=1)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS))
    running = scheduler.submit(job(RequestDecoder(GREEDY_STEP, [1], 50)))
    waiting = scheduler.submit(job(RequestDecoder(GREEDY_STEP, [2], 50)))
    scheduler.run_once()
    scheduler.close()
    for handle in (running, waiting):
        with pytest.raises(SchedulerClosed):
            list(handle)
    assert scheduler.free_slots == 1 and executor.cache_len(0) == 0
    with pytest.raises(SchedulerClosed, match="closed"):
        scheduler.submit(job(RequestDecoder(GREEDY_STEP, [1], 5)))


def test_threads_and_asyncio_consumers_share_one_scheduler_thread():
    logits = induction_logits(30, 7)
    executor = OracleExecutor(logits, 30, max_batch=3)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS))
    scheduler.start()
    prompts = [np.random.default_rng(i).integers(0, 30, 8).tolist() for i in range(10)]
    results: dict[int, list[int]] = {}

    def worker(i):
        decoder = RequestDecoder(LookaheadConfig(3, 4, 3), prompts[i], 30)
        handle = scheduler.submit(job(decoder, explicit=i % 2 == 0))
        results[i] = [t for b in handle for t in b]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()

    async def consume(i):
        loop = asyncio.get_running_loop()
        handle = scheduler.submit(job(RequestDecoder(LookaheadConfig(2, 3, 2), prompts[i], 30)), loop)
        return [t async for b in handle for t in b]

    async def main():
        return await asyncio.gather(*(consume(i) for i in range(6, 10)))

    for i, tokens in zip(range(6, 10), asyncio.run(main()), strict=True):
        results[i] = tokens
    for t in threads:
        t.join()
    scheduler.close()
    assert results == {i: reference_generate(logits, prompts[i], 30) for i in range(10)}
    assert max(executor.rows_per_step) > 1  # they did share steps


class QueueWatcher(OracleExecutor):
    """Records, at each step, how many items the watched handles' consumers have been handed so far."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handles, self.seen = [], []

    def step(self, batch):
        self.seen.append([h._queue.qsize() for h in self.handles])
        return super().step(batch)


def test_blocks_are_handed_over_while_the_next_step_runs_and_all_when_the_batch_ends():
    logits = markov_logits(10, 1, 0)
    executor = QueueWatcher(logits, 10, max_batch=2)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS))
    executor.handles = [scheduler.submit(job(RequestDecoder(GREEDY_STEP, [i + 1], 4))) for i in range(2)]
    scheduler.run_once()  # prefill (1 block each) and the first decode step
    assert executor.seen == [[1, 1]]  # the prefill's blocks reached the consumers before that step ran
    assert [h._queue.qsize() for h in executor.handles] == [1, 1]  # the step's own blocks wait for the next
    while not scheduler.idle:
        scheduler.run_once()
    assert executor.seen == [[1, 1], [2, 2], [3, 3]]
    assert [[t for b in h for t in b] for h in executor.handles] == [
        reference_generate(logits, [i + 1], 4) for i in range(2)
    ]  # the last blocks and the end marks were handed over although no step followed


class PrefillWatcher(OracleExecutor):
    """Records, at each prefill, how many items the watched handles' consumers have been handed so far."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handles, self.seen = [], []

    def prefill(self, slot, prompt_ids, sampling):
        self.seen.append([h._queue.qsize() for h in self.handles])
        return super().prefill(slot, prompt_ids, sampling)


def test_a_joining_requests_first_token_is_handed_over_while_the_next_prompt_is_prefilled():
    """Requests joining together are prefilled one after another: each one's first token reaches its consumer
    while the next prompt runs, not after the last one's (the mean time to first token of 8 joining together
    would be 8 prefills instead of 4.5)."""
    logits = markov_logits(10, 1, 0)
    executor = PrefillWatcher(logits, 10, max_batch=4)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS))
    executor.handles = scheduler.submit_many([job(RequestDecoder(GREEDY_STEP, [i + 1, i], 5)) for i in range(4)])
    scheduler.run_once()  # four prefills, then one decode step
    assert executor.seen == [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert scheduler.stats.steps == 1
    while not scheduler.idle:
        scheduler.run_once()
    assert [[t for b in h for t in b] for h in executor.handles] == [
        reference_generate(logits, [i + 1, i], 5) for i in range(4)
    ]


class Watched:
    """A real executor whose prefills record how many items the watched handles' consumers hold by then."""

    def __init__(self, executor):
        self.executor, self.handles, self.seen = executor, [], []

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def prefill(self, slot, prompt_ids, sampling):
        self.seen.append([h._queue.qsize() for h in self.handles])
        return self.executor.prefill(slot, prompt_ids, sampling)


def test_eight_requests_joining_together_on_stories260k_get_first_tokens_early_and_their_solo_answers(
        one_torch_thread):
    """Eight short requests joining at once (AIPerf's waves): one decode step carries all eight after their
    prefills, each first token is handed over while the next prompt runs, and every answer is its solo answer."""
    from trt_lookahead.runtime.load import load_model

    stories = Path(__file__).parents[1] / "fixtures" / "stories260K"
    model = load_model(stories, backend="torch", dtype="float32", asked=None, max_seq_len=128, max_batch=8,
                       verify=True, exact=None, tree=None)
    prompts = [model.tokenizer.encode(text) for text in (
        "Once upon a time", "Lily and Tom went to the park. They", "The cat sat on the", "Sam had a red ball",
        "One day, a little bird", "Mom said to Ben,", "The sun was hot and", "There was a big dog named")]

    def decoder(prompt):
        return RequestDecoder(GREEDY_STEP, prompt, 12, model.stop_token_ids)

    executor = Watched(model.executor)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS))
    solo = []
    for prompt in prompts:
        handle = scheduler.submit(job(decoder(prompt)))
        while not scheduler.idle:
            scheduler.run_once()
        solo.append([t for b in handle for t in b])
    executor.seen, steps = [], scheduler.stats.steps
    executor.handles = scheduler.submit_many([job(decoder(prompt)) for prompt in prompts])
    scheduler.run_once()
    assert executor.seen == [[1] * i + [0] * (8 - i) for i in range(8)]
    assert scheduler.stats.steps == steps + 1 and scheduler.steps[-1].rows == 8
    while not scheduler.idle:
        scheduler.run_once()
    assert [[t for b in h for t in b] for h in executor.handles] == solo
    assert all(len(answer) > 1 for answer in solo)


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_decode_steps_and_gives_the_same_tokens():
    logits = induction_logits(30, 5)
    executor = OracleExecutor(logits, 30, max_batch=2, step_tokens=16)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS), prefill=4)
    sampled = SamplingParams(0.8, 4, 0.9, 11)
    running = scheduler.submit(job(RequestDecoder(LookaheadConfig(2, 3, 2), [1, 2, 3], 20)))
    scheduler.run_once()  # the three-token prompt: one chunk, alone in the step, whose output is the first token
    prompt = np.random.default_rng(0).integers(0, 30, 10).tolist()
    joining = scheduler.submit(job(RequestDecoder(LookaheadConfig(2, 3, 2), prompt, 12), sampled))
    for _ in range(3):  # 10 tokens in chunks of 4, 4, 2, each a causal row beside the running request's row
        assert joining.result is None and joining._queue.empty()
        scheduler.run_once()
    assert [(s.rows, s.prefill_rows, s.tokens) for s in list(scheduler.steps)[1:4]] == [
        (2, 1, 4 + 8), (2, 1, 4 + 8), (2, 1, 2 + 8)]  # 2/3/2 rows are 8 tokens
    assert executor.cache_len(1) == 10 and scheduler.stats.prefill_chunks == 4
    assert next(iter(running)) == reference_generate(logits, [1, 2, 3], 1)  # the first chunk's output
    while not scheduler.idle:
        scheduler.run_once()
    assert [t for b in joining for t in b] == reference_generate(logits, prompt, 12, sampled)
    assert [t for b in running for t in b] == reference_generate(logits, [1, 2, 3], 20)[1:]


def test_a_request_cancelled_while_its_prompt_is_prefilled_frees_its_slot():
    executor = OracleExecutor(markov_logits(20, 2, 3), 20, max_batch=1, step_tokens=8)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS), prefill=CHUNKED)
    handle = scheduler.submit(job(RequestDecoder(GREEDY_STEP, list(range(20)), 5)))
    waiting = scheduler.submit(job(RequestDecoder(GREEDY_STEP, [3, 4], 5)))
    scheduler.run_once()  # the first chunk of 8 of the 20 prompt tokens
    assert executor.cache_len(0) == 8 and scheduler.free_slots == 0
    handle.cancel()
    scheduler.run_once()  # it leaves before the step; the waiting request takes the slot
    assert list(handle) == [] and handle.result.finish_reason == "cancelled"
    while not scheduler.idle:
        scheduler.run_once()
    assert [t for b in waiting for t in b] == reference_generate(markov_logits(20, 2, 3), [3, 4], 5)
    assert scheduler.free_slots == 1 and executor.cache_len(0) == 0 and scheduler.stats.cancelled == 1


@pytest.mark.parametrize("prefill", [0, 9, -1, "sideways", True])
def test_a_bad_prefill_is_refused_naming_the_choices(prefill):
    executor = OracleExecutor(markov_logits(10, 1, 0), 10, step_tokens=8)
    with pytest.raises(UserError, match=r"prefill must be 'separate', 'chunked' or a chunk of 1 \.\. 8 tokens"):
        Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS), prefill=prefill)


def test_a_waiting_request_that_is_cancelled_leaves_the_queue_at_once():
    """Issue 39 item 3: the queue counts only live requests. A cancelled waiting request is gone from `waiting`
    and the QueueFull count before any iteration runs, and its consumer already has its end."""
    logits = markov_logits(10, 1, 0)
    executor = OracleExecutor(logits, 10, max_batch=1)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS), max_queue=2)
    running = scheduler.submit(job(RequestDecoder(GREEDY_STEP, [1], 20)))
    scheduler.run_once()  # admitted: it holds the only slot
    queued = [scheduler.submit(job(RequestDecoder(GREEDY_STEP, [i], 20))) for i in (2, 3)]
    with pytest.raises(QueueFull):
        scheduler.submit(job(RequestDecoder(GREEDY_STEP, [4], 5)))
    assert running.wait_dequeued(0) and not any(h.wait_dequeued(0) for h in queued)
    for handle in queued:
        handle.cancel()
    assert scheduler.waiting == 0 and scheduler.stats.cancelled == 2  # no iteration ran since
    assert all(h.wait_dequeued(0) for h in queued)
    for handle in queued:
        assert list(handle) == [] and handle.result.finish_reason == "cancelled"  # told at once: no hang
    late = scheduler.submit(job(RequestDecoder(GREEDY_STEP, [4], 5)))  # the two places are free again
    late.cancel()
    late.cancel()  # idempotent: counted once
    assert scheduler.stats.cancelled == 3
    after = scheduler.submit(job(RequestDecoder(GREEDY_STEP, [5], 5)))
    while not scheduler.idle:
        scheduler.run_once()
    assert [t for b in running for t in b] == reference_generate(logits, [1], 20)
    assert [t for b in after for t in b] == reference_generate(logits, [5], 5)
    assert scheduler.stats.admitted == 2 and executor.steps and scheduler.free_slots == 1


def test_cancel_racing_admission_ends_each_request_exactly_once():
    """Cancels from other threads while the scheduler thread admits: each request is either withdrawn from the
    queue or admitted (and then cancelled at a step or finished), never both; every consumer gets one end."""
    logits = markov_logits(10, 1, 0)
    executor = OracleExecutor(logits, 10, max_batch=2)
    scheduler = Scheduler(executor, LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS), max_queue=200)
    scheduler.start()
    rng = random.Random(7)
    lengths = [2000] + [rng.randint(1, 30) for _ in range(149)]  # the first is still running when cancelled
    handles = scheduler.submit_many([job(RequestDecoder(GREEDY_STEP, [i % 9 + 1], n))
                                     for i, n in enumerate(lengths)])
    deadline = time.monotonic() + 30
    while scheduler.free_slots:  # both slots taken before the cancels start
        assert time.monotonic() < deadline
        time.sleep(0.001)
    chosen = [handles[0], *(h for h in handles[1:] if rng.random() < 0.6)]

    def cancel(part, seed):
        pause = random.Random(seed)
        for handle in part:
            time.sleep(pause.random() * 0.002)  # let admission and steps interleave with the cancels
            handle.cancel()

    cancellers = [threading.Thread(target=cancel, args=(chosen[i::2], i)) for i in range(2)]
    for t in cancellers:
        t.start()
    for t in cancellers:
        t.join()
    blocks = [list(handle) for handle in handles]  # each ends (no hang), each with its end mark only once
    scheduler.close()
    assert all(h._queue.empty() for h in handles)
    for handle, got in zip(handles, blocks, strict=True):
        tokens = [t for b in got for t in b]
        assert tokens == handle.result.token_ids
        expected = reference_generate(logits, handle.request.decoder.prompt, handle.request.decoder.max_new_tokens)
        assert tokens == (expected[: len(tokens)] if handle.result.finish_reason == "cancelled" else expected)
        assert handle in chosen or handle.result.finish_reason == "length"
    withdrawn = [h for h in handles if h.slot is None]  # never admitted: ended by cancel() itself
    assert all(h.result.finish_reason == "cancelled" and not h.result.token_ids for h in withdrawn)
    assert scheduler.stats.admitted + len(withdrawn) == len(handles)
    assert withdrawn and scheduler.stats.cancelled > len(withdrawn)  # both ways were taken
    assert scheduler.stats.finished + scheduler.stats.cancelled == len(handles)
    assert scheduler.waiting == 0 and scheduler.free_slots == 2


@pytest.mark.parametrize("prefill", [SEPARATE, 8])
def test_every_decode_step_feeds_its_time_to_the_policy(tmp_path, one_torch_thread, prefill):
    """The step cost `auto` chooses by learns from each decode step: one observation per step (its real tokens,
    rows and wall ms, as its StepRecord says); steps with prompt chunks are not fed (their cost is the prompts')."""
    stories = Path(__file__).parents[1] / "fixtures" / "stories260K"
    with LookaheadRuntime.from_pretrained(stories, backend="torch", lookahead="auto", max_batch=4, max_seq_len=256,
                                          tuning_file=tmp_path / "none.json", prefill=prefill) as rt:
        handles = rt.submit([rt.check_request("Once upon a time there was a little dog who", 24) for _ in range(3)])
        for handle in handles:
            handle.drain()
        cost, records = rt.auto.policy.cost, list(rt.scheduler.steps)
        assert not rt.scheduler.executor.pads_rows  # the packed CPU step: priced at its real tokens
    decode = [r for r in records if not r.prefill_rows]
    assert len(records) == rt.scheduler.stats.steps and (len(decode) < len(records)) == (prefill != SEPARATE)
    assert cost.observations == len(decode) > 0
    last = decode[-1]
    assert cost.last == (last.tokens, last.rows, pytest.approx(1000.0 * (last.executor_seconds + last.host_seconds)))


@pytest.mark.parametrize(("pads_rows", "priced"), [(False, 4 + 16), (True, 2 * 16)])
def test_the_policy_learns_from_steps_priced_as_the_executor_lays_them_out(pads_rows, priced):
    """Two rows of 4 and 16 real tokens: an executor that pads rows runs 2 x 16 tokens, one that packs them 20; the
    step cost is learnt at that M (tune's c(M, B) is B rows of T tokens)."""
    logits = markov_logits(30, 2, 5)
    executor = OracleExecutor(logits, 30, max_batch=2, step_tokens=16, pads_rows=pads_rows)
    policy = LookaheadPolicy(StepCost.linear(10.0, 0.1), PRIORS)
    scheduler = Scheduler(executor, policy)
    for config in (LookaheadConfig(1, 3, 1), LookaheadConfig(4, 3, 4)):
        scheduler.submit(job(RequestDecoder(config, [1, 2, 3], 6)))
    while policy.cost.last is None:
        scheduler.run_once()
    assert policy.cost.last[:2] == (priced, 2)
