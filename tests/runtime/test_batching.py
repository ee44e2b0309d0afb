"""LookaheadRuntime under in-flight batching on real models: concurrent requests from threads and asyncio are
token-identical to the same requests run alone, their prompts prefilled separately or in chunks beside the
decode steps; cancellation, disconnects, a full queue, bad requests and faults in one request's host code
leave the others exact and every slot free."""

import asyncio
import gc
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import AUTO, Lookahead, LookaheadConfig
from trt_lookahead.lookahead.decoder import RequestDecoder
from trt_lookahead.lookahead.policy import StepCost
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.runtime import LookaheadRuntime, checkpoint_tuning_key, tuning_file
from trt_lookahead.runtime import scheduler as sched
from trt_lookahead.runtime.scheduler import SEPARATE, QueueFull, SchedulerClosed

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
PROMPTS = [
    "Once upon a time", "Lily and Tom went to the park. They", "The cat sat on the", "Sam had a red ball",
    "One day, a little bird", "Mom said to Ben,", "The sun was hot and", "There was a big dog named",
]
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.95)
# eight mixed requests: configs, sampling, stop strings and lengths differ; `auto` needs the tuning entry
MIXED = [
    dict(lookahead="greedy", max_new_tokens=60),
    dict(lookahead="4,3,4", max_new_tokens=80),
    dict(lookahead="7,5,7", max_new_tokens=40, seed=3, **SAMPLED),
    dict(lookahead="2,2,1", max_new_tokens=64, stop=["."]),
    dict(lookahead="15,5,15", max_new_tokens=90),
    dict(lookahead=AUTO, max_new_tokens=70),
    dict(lookahead="greedy", max_new_tokens=50, seed=1, **SAMPLED),
    dict(lookahead=AUTO, max_new_tokens=30, seed=2, temperature=1.0),
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the tuning key names the thread count
# The runtimes here run the torch backend: the mixed configs go up to 15/5/15, beyond the cached engine of the
# default backend (8/5/8); tests/backends/test_engine_executors.py batches engine runtimes.


@pytest.fixture(scope="module")
def tuning(tmp_path_factory, one_torch_thread):
    """A tuning file of this module's own with an entry for stories260K: `auto` needs no tuning."""
    path = tmp_path_factory.mktemp("tuning") / "tuning.json"
    cost = StepCost({1: [(1, 2.0), (32, 3.0), (256, 12.0)], 8: [(8, 3.0), (256, 14.0)]})
    entry = {"config": "8/3/8", "step_cost": cost.to_dict(), "priors": {"1/3/1": 1.3, "2/3/2": 1.5, "4/3/4": 1.7}}
    key = checkpoint_tuning_key(STORIES, "float32", "torch", LookaheadConfig(4, 3, 4))  # the `stories` runtime's
    tuning_file.write_tuning_entry(key, entry, path)
    return path


@pytest.fixture(scope="module")
def stories(tuning):
    with LookaheadRuntime.from_pretrained(STORIES, backend="torch", lookahead="4,3,4", max_batch=8, max_seq_len=256,
                                          tuning_file=tuning) as rt:
        yield rt


def wait_idle(rt):
    """Until nothing is in flight (a request cut by a stop string leaves at the next step)."""
    deadline = time.monotonic() + 30
    while not rt.scheduler.idle:
        assert time.monotonic() < deadline
        time.sleep(0.005)


@contextmanager
def prefilling(rt, prefill):
    """Requests that join inside the block are prefilled this way (nothing is in flight at either end)."""
    wait_idle(rt)
    before, rt.scheduler.prefill = rt.scheduler.prefill, prefill
    try:
        yield
    finally:
        wait_idle(rt)
        rt.scheduler.prefill = before


# chunked prefill in 4-token chunks: every prompt is split, its causal rows padded beside rows of up to 120 tokens
PREFILLS = [SEPARATE, 4]


def solo(rt, prompt, kwargs):
    """The request alone: nothing else in flight."""
    wait_idle(rt)
    out = rt.generate(prompt, **kwargs)
    wait_idle(rt)
    return out


def run_concurrently(rt, jobs):
    """Each (prompt, kwargs) in its own thread, all started together; their outputs in order."""
    outputs = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def work(i):
        barrier.wait()
        outputs[i] = rt.generate(jobs[i][0], **jobs[i][1])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outputs


@pytest.mark.parametrize("prefill", PREFILLS)
def test_eight_mixed_concurrent_requests_equal_their_solo_runs(stories, prefill):
    """Batched, and alone, with this prefill: the tokens of each request alone with separate prefill."""
    jobs = list(zip(PROMPTS, MIXED, strict=True))
    with prefilling(stories, SEPARATE):
        reference = [solo(stories, p, kw) for p, kw in jobs]
    with prefilling(stories, prefill):
        alone = [solo(stories, p, kw) for p, kw in jobs]
        steps_before, chunks_before = stories.scheduler.stats.steps, stories.scheduler.stats.prefill_chunks
        together = run_concurrently(stories, jobs)
    for (prompt, kw), r, a, b in zip(jobs, reference, alone, together, strict=True):
        assert b.token_ids == a.token_ids == r.token_ids and b.text == a.text, (prompt, kw)
        assert b.finish_reason == a.finish_reason == r.finish_reason, (prompt, kw)
    log = list(stories.scheduler.steps)[-(stories.scheduler.stats.steps - steps_before):]
    assert max(s.rows for s in log) >= 6  # they did share steps
    if prefill != SEPARATE:
        chunks = sum(math.ceil(out.prompt_tokens / prefill) for out in together)
        assert stories.scheduler.stats.prefill_chunks - chunks_before == chunks > len(jobs)
        assert any(0 < s.prefill_rows < s.rows for s in log)  # chunks ran beside decode rows
    assert together[5].config == AUTO and sum(together[5].stats.configs.values()) == together[5].steps - 1
    assert stories.scheduler.free_slots == 8


def test_asyncio_requests_equal_their_solo_runs(stories):
    jobs = list(zip(PROMPTS[:6], MIXED[:6], strict=True))
    alone = [solo(stories, p, kw) for p, kw in jobs]

    async def main():
        async def one(prompt, kw):
            text, ids, final = [], [], None
            async for chunk in stories.astream(prompt, **kw):
                text.append(chunk.text)
                ids.extend(chunk.token_ids)
                final = chunk.output
            return "".join(text), final

        return await asyncio.gather(*(one(p, kw) for p, kw in jobs))

    for a, (text, out) in zip(alone, asyncio.run(main()), strict=True):
        assert out.token_ids == a.token_ids and text == a.text
    assert asyncio.run(stories.agenerate(jobs[1][0], **jobs[1][1])).token_ids == alone[1].token_ids


@pytest.mark.parametrize("prefill", PREFILLS)
def test_a_request_joining_or_others_leaving_midway_changes_nothing(stories, prefill):
    long = ("Once upon a time", dict(lookahead="4,3,4", max_new_tokens=120))
    with prefilling(stories, SEPARATE):
        reference = solo(stories, *long).token_ids
    with prefilling(stories, prefill), closing(stories.stream(*long[:1], **long[1])) as chunks:
        tokens = list(next(chunks).token_ids)
        others = [stories.stream(p, max_new_tokens=n, lookahead=c) for p, n, c in
                  (("Sam had a red ball", 5, "greedy"), ("The cat sat on the", 30, "7,5,7"), ("Mom said", 60, "2,2,1"))]
        cancelled = stories.stream("One day, a little bird", max_new_tokens=100)
        next(cancelled)
        for i, chunk in enumerate(chunks):
            tokens.extend(chunk.token_ids)
            if i == 3:
                cancelled.close()  # leaves at the next step
            if i == 5:
                for other in others:
                    list(other)
    assert tokens == reference


def test_closing_or_dropping_a_stream_frees_its_slot(stories):
    stream = stories.stream("Once upon a time", max_new_tokens=200)
    next(stream)
    stream.close()
    dropped = stories.stream("Lily and Tom went to the park. They", max_new_tokens=200)
    next(dropped)
    del dropped  # a client that went away: the generator's finaliser cancels
    gc.collect()
    wait_idle(stories)
    assert stories.scheduler.free_slots == 8 and stories.scheduler.stats.cancelled >= 2


@pytest.mark.parametrize("max_batch", [1, 8])
def test_reentry_from_one_thread_runs_both_requests(max_batch):
    with LookaheadRuntime.from_pretrained(STORIES, backend="torch", max_batch=max_batch, max_seq_len=256) as rt:
        outer = rt.generate("Once upon a time", max_new_tokens=40).token_ids
        inner = rt.generate("The cat sat on the", max_new_tokens=20).token_ids
        first = rt.stream("Once upon a time", max_new_tokens=40)
        head = next(first).token_ids
        assert rt.generate("The cat sat on the", max_new_tokens=20).token_ids == inner  # never hangs
        assert head + [t for chunk in first for t in chunk.token_ids] == outer


def test_a_full_queue_is_a_clear_error_and_the_queue_drains():
    with LookaheadRuntime.from_pretrained(STORIES, backend="torch", max_batch=1, max_queue=1, max_seq_len=256) as rt:
        running = rt.stream("Once upon a time", max_new_tokens=30)
        queued = rt.stream("The cat sat on the", max_new_tokens=10)
        with pytest.raises(QueueFull, match=r"max_queue=1\); retry later"):
            rt.stream("Sam had a red ball", max_new_tokens=10)
        assert isinstance(QueueFull("x"), ValueError)
        assert list(queued)[-1].output.generated_tokens == 10
        assert list(running)[-1].output.generated_tokens == 30
        assert rt.generate("Sam had a red ball", max_new_tokens=10).generated_tokens == 10


def test_bad_requests_fail_before_any_work(stories):
    steps = stories.scheduler.stats.admitted
    with pytest.raises(ValueError, match="tokens leave no room to generate in max_seq_len 256"):
        stories.stream("Once " * 300, max_new_tokens=10)
    with pytest.raises(ValueError, match="takes at most 128"):
        stories.stream("Once", max_new_tokens=10, lookahead="20,5,20")
    with pytest.raises(ValueError, match="max_batch must be a positive integer"):
        LookaheadRuntime.from_pretrained(STORIES, backend="torch", max_batch=0)
    assert stories.scheduler.stats.admitted == steps


def test_close_ends_requests_in_flight():
    rt = LookaheadRuntime.from_pretrained(STORIES, backend="torch", max_batch=1, max_seq_len=256)
    running = rt.stream("Once upon a time", max_new_tokens=200)
    next(running)
    rt.close()
    with pytest.raises(SchedulerClosed):
        list(running)
    with pytest.raises(SchedulerClosed, match="closed"):
        rt.generate("Once", max_new_tokens=3)


class Faulty(RequestDecoder):
    """Host code that raises after some steps (a bug in one request's processing)."""

    def __init__(self, fail_at: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_at = fail_at

    def verify(self, out):
        self.fail_at -= 1
        if self.fail_at < 0:
            raise RuntimeError("injected host fault")
        return super().verify(out)


@pytest.mark.parametrize("requests", [120, pytest.param(500, marks=pytest.mark.slow)])
def test_requests_with_faults_leave_every_slot_free_and_the_next_batch_exact(tuning, requests):
    """Normal requests (checked against their solo runs), cancelled streams, dropped clients, oversize
    requests, configs beyond the executor, a full queue, host-code faults and consumer faults, mixed."""
    rng = random.Random(12)
    kinds = ["normal"] * 10 + ["cancel", "drop", "oversize", "too_wide", "host_fault", "consumer_fault"]
    cases = [rng.choice(kinds) for _ in range(requests)]
    params = [dict(lookahead=c, max_new_tokens=n, **s) for c in ("greedy", "4,3,4", "7,5,7", "2,2,1", AUTO)
              for n in (6, 25) for s in ({}, dict(seed=5, **SAMPLED))]
    references: dict[tuple, list[int]] = {}
    outcome: dict[str, int] = {}
    lock = threading.Lock()

    def reference(prompt, kw):
        key = (prompt, tuple(sorted((k, v) for k, v in kw.items() if k != "lookahead")))
        with lock:
            if key not in references:  # computed on a separate runtime, one request at a time
                references[key] = refs.generate(prompt, **{**kw, "lookahead": "greedy"}).token_ids
            return references[key]

    def count(what):
        with lock:
            outcome[what] = outcome.get(what, 0) + 1

    def client(worker):
        local = random.Random(worker)
        for i in range(worker, len(cases), 10):
            prompt, kw = local.choice(PROMPTS), local.choice(params)
            case = cases[i]
            try:
                if case == "normal":
                    out = stories.generate(prompt, **kw)
                    assert out.token_ids == reference(prompt, kw), (prompt, kw)
                elif case in ("cancel", "drop"):
                    stream = stories.stream(prompt, **{**kw, "max_new_tokens": 200})
                    next(stream)
                    if case == "cancel":
                        stream.close()
                    del stream
                elif case == "oversize":
                    with pytest.raises(ValueError, match="tokens leave no room to generate in max_seq_len 256"):
                        stories.generate(prompt * 100, max_new_tokens=100)
                elif case == "too_wide":
                    with pytest.raises(ValueError, match="takes at most"):
                        stories.generate(prompt, max_new_tokens=5, lookahead="20,5,20")
                elif case == "host_fault":
                    ids = stories.encode(prompt)
                    decoder = Faulty(local.randint(0, 4), LookaheadConfig(4, 3, 4), ids, 40, stories.stop_token_ids)
                    handle = stories.scheduler.submit(sched.Job(decoder, Lookahead(decoder.config), SamplingParams()))
                    with pytest.raises(RuntimeError, match="injected host fault"):
                        list(handle)
                else:  # the consumer's own code fails while reading the stream
                    with pytest.raises(KeyError), closing(stories.stream(prompt, **kw)) as stream:
                        for _ in stream:
                            raise KeyError("consumer fault")
                count(case)
            except QueueFull:
                count("queue_full")

    with (LookaheadRuntime.from_pretrained(STORIES, backend="torch", max_batch=8, max_queue=4, max_seq_len=256,
                                           tuning_file=tuning) as stories,
          LookaheadRuntime.from_pretrained(STORIES, backend="torch", max_batch=1, max_seq_len=256,
                                           tuning_file=tuning) as refs):
        threads = [threading.Thread(target=client, args=(w,)) for w in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gc.collect()
        wait_idle(stories)
        assert sum(outcome.values()) == requests, outcome
        assert set(outcome) - {"queue_full"} == set(kinds) and outcome["normal"] > requests // 3, outcome
        assert stories.scheduler.free_slots == 8 and stories.scheduler.waiting == 0
        assert all(stories.executor.cache_len(s) == 0 for s in range(8))
        jobs = list(zip(PROMPTS, MIXED, strict=True))
        for (prompt, kw), out in zip(jobs, run_concurrently(stories, jobs), strict=True):
            assert out.token_ids == refs.generate(prompt, **kw).token_ids, (prompt, kw)


@pytest.mark.slow
def test_smollm2_eight_mixed_concurrent_requests_equal_their_solo_runs():
    prompts = [
        [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
        [{"role": "user", "content": "Name three rivers in Europe."}],
        "def fibonacci(n):",
        [{"role": "user", "content": "What is 12 times 7? Explain."}],
        "The quick brown fox",
        [{"role": "user", "content": "Give me a haiku about the sea."}],
        "import numpy as np\n\ndef softmax(x):",
        [{"role": "user", "content": "List the planets of the solar system."}],
    ]
    mixed = [{**kw, "max_new_tokens": min(kw["max_new_tokens"], 48)} for kw in MIXED]
    mixed[5] = mixed[7] = dict(lookahead="4,3,4", max_new_tokens=40)  # no tuning entry for SmolLM2 here
    with LookaheadRuntime.from_pretrained("smollm2-135m-instruct", backend="torch", max_batch=8, max_seq_len=512) as rt:
        jobs = list(zip(prompts, mixed, strict=True))
        alone = [solo(rt, p, kw) for p, kw in jobs]
        together = run_concurrently(rt, jobs)
    for (prompt, kw), a, b in zip(jobs, alone, together, strict=True):
        assert b.token_ids == a.token_ids, (prompt, kw)


def assert_two_at_once_give_the_default_tokens(rt: LookaheadRuntime, stories: LookaheadRuntime, tokens: int) -> None:
    """Two requests at once on `rt` (buckets 1 and 2), lookahead and greedy: the default runtime's tokens."""
    for lookahead in ("4,3,4", "greedy"):
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(rt.generate, p, max_new_tokens=tokens, lookahead=lookahead) for p in PROMPTS[:2]]
            got = [f.result(timeout=300).token_ids for f in futures]
        assert got == [stories.generate(p, max_new_tokens=tokens, lookahead=lookahead).token_ids
                       for p in PROMPTS[:2]], lookahead


def test_a_runtime_on_the_triton_attention_gives_the_default_runtimes_tokens(stories):
    """attention='triton' (experimental): the padded step with the Triton attention over each slot's own keys
    (interpreted on the CPU), two requests at once, lookahead and greedy: the default runtime's tokens."""
    with LookaheadRuntime.from_pretrained(STORIES, lookahead="4,3,4", max_batch=2, max_seq_len=256,
                                          attention="triton") as rt:
        assert rt.executor.attention == "triton" and rt.executor.padded and not rt.executor.exact
        assert_two_at_once_give_the_default_tokens(rt, stories, 12)


@pytest.mark.slow
def test_a_compiled_runtime_gives_the_eager_runtimes_tokens(stories):
    """compile=True (experimental): the torch executor's compiled padded step, two requests at once (buckets 1 and
    2), lookahead and greedy, the eager runtime's tokens; it runs a checkpoint on the torch backend only."""
    with pytest.raises(UserError, match="drop them or the backend"):
        LookaheadRuntime.from_pretrained(STORIES, backend="onnxruntime", compile=True)
    with LookaheadRuntime.from_pretrained(STORIES, lookahead="4,3,4", max_batch=2, max_seq_len=256,
                                          compile=True) as rt:
        assert_two_at_once_give_the_default_tokens(rt, stories, 40)
