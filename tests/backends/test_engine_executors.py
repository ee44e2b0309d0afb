"""The batched engine executors on real engine dirs built from stories260K: each row of a mixed batch gives
what the torch model gives on that row alone, and what the executor gives on that row alone; commits,
releases and the compact slot order keep every slot's cache right; requests beyond the engine are refused.

onnxruntime runs here; TensorRT runs the same tests on a GPU host with TensorRT (they skip elsewhere).
SmolLM2-135M runs only in the @slow test.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from trt_lookahead.backends.devices import tensorrt_unavailable_reason
from trt_lookahead.backends.open import open_engine
from trt_lookahead.cli import main
from trt_lookahead.engine.format import cache_names
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import StepBatch, row_tokens
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams, select_tokens
from trt_lookahead.model.checkpoint import load_llama

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
MAX_SEQ_LEN, MAX_BATCH, T = 256, 4, 16  # T: the step tokens of the built 4,3,4
CAUSAL = (0, 0, 0)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=3)

pytestmark = pytest.mark.export  # every test here builds or reads engine dirs


def build(out: Path, *extra, model=STORIES, max_seq_len=MAX_SEQ_LEN, max_input_len=64) -> Path:
    argv = ["build", "--model", str(model), "--output", str(out), "--lookahead_config", "4,3,4", "--max_seq_len",
            str(max_seq_len), "--max_input_len", str(max_input_len), "--max-batch", str(MAX_BATCH), *extra]
    if "--tree" not in extra:  # linear candidates unless a test asks for a tree (build's default is `auto`)
        argv += ["--tree", "off"]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("engines")
    return {"plugin": build(root / "plugin"), "native": build(root / "native", "--attention", "native")}


@pytest.fixture(scope="module")
def stories():
    model, _ = load_llama(STORIES)
    return model


BACKENDS = ["onnxruntime", pytest.param("tensorrt", marks=pytest.mark.gpu)]


def open_for(backend: str, path: Path):
    """The engine dir opened for `backend` (TensorRT: its plan built first, on a GPU host only)."""
    if backend == "tensorrt":
        reason = tensorrt_unavailable_reason()
        if reason:
            pytest.skip(f"the TensorRT executor needs TensorRT and a GPU: {reason}")
        from trt_lookahead.engine.tensorrt_plan import build_plan

        build_plan(path)
    return open_engine(path, backend=backend, threads=1)


# -- the reference: the torch model, one row at a time, each slot with its own cache ------------------


class ModelRows:
    """Per slot a torch cache and a length, driven like an executor; the model runs each row alone."""

    def __init__(self, model, cache_rows: int) -> None:
        self.model, self.cache_rows = model, cache_rows
        self.caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lengths: dict[int, int] = {}

    def prefill(self, slot: int, ids: np.ndarray) -> np.ndarray:
        """Logits [1, V] at the prompt's last token; the prompt's K/V kept."""
        self.caches[slot], self.lengths[slot] = self.model.new_cache(self.cache_rows), 0
        n = len(ids)
        logits = self._forward(slot, ids, np.arange(n), np.tril(np.ones((n, n), bool)), [n - 1])
        self.lengths[slot] = n
        return logits

    def step(self, batch: StepBatch) -> list[np.ndarray]:
        """Per row, logits [K, V] at its output slots."""
        tokens = batch.input_ids.shape[1]
        out = []
        for b, slot in enumerate(batch.slots.tolist()):
            config = tuple(int(v) for v in batch.step_config[b])
            mask = (np.tril(np.ones((tokens, tokens), bool)) if config == CAUSAL
                    else StepLayout(LookaheadConfig(*config), padded_tokens=tokens).mask)
            out.append(self._forward(slot, batch.input_ids[b], batch.positions[b], mask, batch.output_slots[b]))
        return out

    def commit(self, slot: int, rows: np.ndarray) -> None:
        """The model wrote the step's K/V at rows length + i; keep step rows `rows` there, in order."""
        p, index = self.lengths[slot], torch.as_tensor(rows)
        for cache in self.caches[slot]:
            cache[:, p : p + len(index)] = cache[:, p + index].clone()
        self.lengths[slot] += len(index)

    def _forward(self, slot: int, ids, positions, mask, output_slots) -> np.ndarray:
        k, v = self.caches[slot]
        with torch.no_grad():
            logits = self.model(torch.as_tensor(np.asarray(ids, np.int64)), torch.as_tensor(np.asarray(positions)),
                                k, v, torch.tensor(self.lengths[slot]), torch.tensor(mask),
                                torch.as_tensor(np.asarray(output_slots, np.int64)))
        return logits.numpy()


# -- mixed steps --------------------------------------------------------------------------------------


def row(config: tuple, cache_len: int, rng: np.random.Generator, tokens: int):
    """(ids, positions, step_config, output slots) of one row: a layout of `config` padded to `tokens`
    (pads at cache_len), or a causal row of `tokens` tokens."""
    ids = rng.integers(0, 512, tokens)
    if config == CAUSAL:
        return ids, cache_len + np.arange(tokens), CAUSAL, np.arange(tokens)
    layout = StepLayout(LookaheadConfig(*config), padded_tokens=tokens)
    return ids, cache_len + layout.rel_positions, config, layout.output_slots


def mixed_batch(slots: list[int], configs: list[tuple], cache_len, rng, tokens: int = T) -> StepBatch:
    rows = [row(c, cache_len(s), rng, tokens) for s, c in zip(slots, configs, strict=True)]
    K = max(len(r[3]) for r in rows)
    output_slots = np.array([np.pad(r[3], (0, K - len(r[3])), mode="edge") for r in rows])  # repeat the last
    return StepBatch(np.array(slots, np.int64), np.array([r[0] for r in rows]), np.array([r[1] for r in rows]),
                     np.array([r[2] for r in rows], np.int32), output_slots)


def one_row(batch: StepBatch, b: int) -> StepBatch:
    """Row b of `batch` as a one-row step of slot 0."""
    return StepBatch(np.zeros(1, np.int64), batch.input_ids[b : b + 1], batch.positions[b : b + 1],
                     batch.step_config[b : b + 1], batch.output_slots[b : b + 1])


def commit_rows(batch: StepBatch, b: int) -> np.ndarray:
    """Step slots to keep for row b: its first real slots at relative positions 0, 1 (one for a 1-token row)."""
    return np.arange(min(2, int(row_tokens(batch.step_config[b], batch.input_ids.shape[1])[0])))


class Lockstep:
    """A batched executor, a one-slot executor per slot and the model per row, driven through the same calls;
    every token of the batched executor is checked against both."""

    def __init__(self, engine, model, sampling: dict[int, SamplingParams]) -> None:
        self.ex = engine.executor()
        self.solo = {slot: engine.executor(max_batch=1) for slot in sampling}
        self.model = ModelRows(model, engine.config.cache_rows)
        self.sampling = sampling

    def prefill(self, slot: int, prompt: np.ndarray) -> None:
        sampling = self.sampling[slot]
        first = self.ex.prefill(slot, prompt, sampling)
        assert self.solo[slot].prefill(0, prompt, sampling) == first, slot
        want = select_tokens(self.model.prefill(slot, prompt), np.array([len(prompt) - 1]), sampling)
        assert first == want[0], slot
        assert self.ex.cache_len(slot) == len(prompt)

    def step(self, slots: list[int], configs: list[tuple], rng) -> None:
        batch = mixed_batch(slots, configs, self.ex.cache_len, rng)
        batch.top_ids = np.full((*batch.input_ids.shape, 3), -1, np.int64)  # recycled drafts' top-k, asked for
        out = self.ex.step(batch)
        assert out.shape == batch.input_ids.shape and out.dtype == np.int64
        for b, (slot, logits) in enumerate(zip(slots, self.model.step(batch), strict=True)):
            read = batch.output_slots[b]
            want = select_tokens(logits, batch.positions[b][read], self.sampling[slot])
            assert np.array_equal(out[b, read], want), (slot, configs[b])
            assert (np.delete(out[b], read) == -1).all() and (np.delete(batch.top_ids[b], read, axis=0) == -1).all()
            for k, row_logits in zip(read.tolist(), logits, strict=True):
                ranked = np.argsort(-row_logits, kind="stable")[:3]
                gaps = -np.diff(row_logits[ranked])
                sure = next((r for r, g in enumerate(gaps) if g < 1e-4), 2) + 1  # ranks clear of float near-ties
                assert batch.top_ids[b, k, :sure].tolist() == ranked[:sure].tolist(), (slot, configs[b], k)
            assert np.array_equal(self.solo[slot].step(one_row(batch, b))[0], out[b]), (slot, configs[b])
        for b, slot in enumerate(slots):
            rows = commit_rows(batch, b)
            self.ex.commit(slot, rows)
            self.solo[slot].commit(0, rows)
            self.model.commit(slot, rows)
            assert self.ex.cache_len(slot) == self.model.lengths[slot] == self.solo[slot].cache_len(0)


PROMPT_LENGTHS = {0: 12, 1: 1, 2: 40, 3: 150}  # slot -> prompt tokens; 150 > max_input_len 64: three chunks
SAMPLING = {0: SamplingParams(), 1: SamplingParams(), 2: SAMPLED, 3: SamplingParams()}
KINDS = [(4, 3, 4), (1, 2, 0), CAUSAL, (2, 2, 1)]  # the built config, greedy, causal, a smaller config padded


def prompts(rng) -> dict[int, np.ndarray]:
    return {slot: rng.integers(0, 512, n) for slot, n in PROMPT_LENGTHS.items()}


def run_mixed_steps(engine, model, slots: list[int], steps: int, seed: int) -> None:
    """Prefill every slot, then `steps` steps of all slots, one row of each kind, the kinds rotating over the
    slots from step to step; everything checked by Lockstep."""
    run = Lockstep(engine, model, SAMPLING)
    rng = np.random.default_rng(seed)
    for slot, prompt in prompts(rng).items():
        run.prefill(slot, prompt)
    kinds = list(KINDS)
    for _ in range(steps):
        run.step(slots, kinds, rng)
        kinds = kinds[1:] + kinds[:1]  # every slot runs every kind of row


# -- tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["plugin", "native"])
def test_mixed_rows_give_what_each_row_gives_alone_and_what_the_model_gives(engines, stories, backend, mode):
    """Rows of different cache lengths and kinds (the built config, greedy, causal, a smaller config padded),
    a sampled slot, in shuffled slot order, over steps that commit: every token equals the model's on that
    row alone and the executor's on that row alone."""
    run_mixed_steps(open_for(backend, engines[mode]), stories, [3, 0, 2, 1], steps=4, seed=0)


def test_an_executor_opened_for_a_shorter_max_seq_len_keeps_shorter_caches_and_the_same_tokens(engines, stories):
    """The graph's cache length is dynamic: an engine built for 256 tokens, opened for 200, allocates 200 + T
    rows per slot and still gives every row the model's tokens."""
    engine = open_engine(engines["plugin"], threads=1, max_seq_len=200)
    assert engine.executor().k_cache.shape == (5, MAX_BATCH, 4, 200 + T, 8)  # [L, max_batch, Hkv, S, D]
    run_mixed_steps(engine, stories, [0, 1, 2, 3], steps=2, seed=5)


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_an_executor_commits_its_kv_cache_as_slots_fill_not_when_opened(tmp_path, stories):
    """256 slots of 512 + T rows: opening the executor maps none of its cache's pages (a start-up that wrote them
    all took seconds on a real model), however much memory the tests before freed into this process's heap; a step
    writes its rows, and its tokens are the model's."""
    engine = open_engine(build(tmp_path / "wide", "--max-batch", "256", max_seq_len=512), threads=1)
    before = resident_bytes()
    executor = engine.executor()
    cache_bytes = executor.k_cache.nbytes + executor.v_cache.nbytes
    assert executor.k_cache.shape == (5, 256, 4, 512 + T, 8) and executor.k_cache.nbytes > 32 << 20
    assert resident_bytes() - before < cache_bytes // 4, (resident_bytes() - before, cache_bytes)
    del executor
    run_mixed_steps(engine, stories, [0, 1, 2, 3], steps=2, seed=5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_release_and_partial_batches_keep_every_other_slot_exact(engines, stories, backend):
    """Releasing a slot moves the last active slot into its place; stepping only some slots swaps them to the
    front; a freed slot takes a new request. The other slots' tokens never change."""
    engine = open_for(backend, engines["plugin"])
    run = Lockstep(engine, stories, SAMPLING)
    rng = np.random.default_rng(1)
    for slot, prompt in prompts(rng).items():
        run.prefill(slot, prompt)
    run.step([0, 1, 2, 3], KINDS, rng)
    run.ex.release(1)  # slot 3, the last active one, moves into slot 1's place
    assert run.ex.cache_len(1) == 0
    run.step([3, 0, 2], KINDS[:3], rng)
    run.step([2], [(4, 3, 4)], rng)  # slot 2 is not among the first physical slots: swapped to the front
    run.step([0, 3], [(2, 2, 1), CAUSAL], rng)
    run.prefill(1, rng.integers(0, 512, 7))  # the freed slot takes a new request
    run.step([1, 2, 3, 0], KINDS, rng)
    for slot in (0, 1, 2, 3):
        run.ex.release(slot)
    run.prefill(2, rng.integers(0, 512, 5))  # everything released: the first slot prefilled takes the front
    run.step([2], [(4, 3, 4)], rng)


def test_the_graph_gives_a_row_the_same_logits_alone_and_batched(engines):
    """One run of the engine's graph over mixed rows against each row run alone (onnxruntime, random caches)."""
    engine = open_engine(engines["plugin"], threads=1)
    config, session = engine.config, engine.session()
    rng = np.random.default_rng(2)
    batch = mixed_batch([0, 1, 2, 3], KINDS, lambda slot: [5, 0, 200, 31][slot], rng)
    caches = [rng.standard_normal((4, config.num_kv_heads, config.cache_rows, config.head_dim), np.float32)
              for _ in range(2 * config.num_layers)]

    def run(rows: slice) -> list[np.ndarray]:
        feeds = {"input_ids": batch.input_ids[rows], "positions": batch.positions[rows],
                 "cache_len": np.array([5, 0, 200, 31])[rows], "step_config": batch.step_config[rows],
                 "output_slots": batch.output_slots[rows]}
        feeds = {name: np.ascontiguousarray(value, np.int32) for name, value in feeds.items()}
        feeds |= {name: np.ascontiguousarray(cache[rows]) for name, cache in zip(cache_names(5), caches, strict=True)}
        return session.run(None, feeds)

    next_ids, logits, keys, values = run(slice(None))
    assert logits.shape == (4, batch.output_slots.shape[1], 512) and keys.shape == (5, 4, 4, T, 8)
    for b in range(4):
        ids_b, logits_b, keys_b, values_b = run(slice(b, b + 1))
        assert np.array_equal(ids_b[0], next_ids[b]), KINDS[b]
        np.testing.assert_allclose(logits_b[0], logits[b], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(keys_b[:, 0], keys[:, b], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(values_b[:, 0], values[:, b], rtol=1e-5, atol=1e-6)


def test_steps_beyond_the_engine_are_refused_naming_the_limit(engines):
    engine = open_engine(engines["plugin"], threads=1)
    ex = engine.executor()
    rng = np.random.default_rng(3)
    for slot in range(MAX_BATCH):
        ex.prefill(slot, rng.integers(0, 512, 5), SamplingParams())
    batch = mixed_batch([0, 1], [(4, 3, 4), (1, 2, 0)], ex.cache_len, rng)
    five = StepBatch(np.arange(5), *(np.repeat(a[:1], 5, 0) for a in (batch.input_ids, batch.positions,
                                                                        batch.step_config, batch.output_slots)))
    with pytest.raises(ValueError, match=r"1 \.\. 4 rows of 1 \.\. 16 tokens"):
        ex.step(five)  # five rows, four slots
    with pytest.raises(ValueError, match=r"1 \.\. 4 rows of 1 \.\. 16 tokens"):
        ex.step(mixed_batch([0], [CAUSAL], ex.cache_len, rng, tokens=17))  # more tokens than the built T
    with pytest.raises(ValueError, match=r"5/3/2 does not fit the engine built for 4/3/4 \(W=5 > 4\)"):
        ex.step(mixed_batch([0, 1], [(1, 2, 0), (5, 3, 2)], ex.cache_len, rng))
    with pytest.raises(ValueError, match=r"is not a layout of at most 16 tokens"):
        ex.step(StepBatch(np.array([0]), np.zeros((1, 16), np.int64), np.zeros((1, 16), np.int64),
                          np.array([[4, 3, 5]], np.int32), np.zeros((1, 1), np.int64)))  # 18 tokens
    ex.release(2)
    with pytest.raises(ValueError, match=r"slots \[2\] hold no request"):
        ex.step(mixed_batch([2], [(1, 2, 0)], ex.cache_len, rng))
    with pytest.raises(ValueError, match="slot 0 has no step to commit"):
        ex.commit(0, np.array([0]))
    ex.step(mixed_batch([0], [(2, 2, 1)], ex.cache_len, rng))
    with pytest.raises(ValueError, match=r"commit .*\[0, 3\)"):
        ex.commit(0, np.array([0, 5]))  # slot 5 is a pad of the 2,2,1 row
    with pytest.raises(ValueError, match="KV slot 4 does not exist"):
        ex.prefill(4, np.array([1]), SamplingParams())
    with pytest.raises(ValueError, match="prompt of 257 tokens does not fit"):
        ex.prefill(0, np.ones(257, np.int64), SamplingParams())
    with pytest.raises(UserError, match=r"max_batch 5 exceeds the engine's 4 \(rebuild with --max-batch 5\)"):
        open_engine(engines["plugin"], max_batch=5)
    with pytest.raises(UserError, match=r"max_batch 5 is outside 1 \.\. 4"):
        engine.executor(max_batch=5)


def test_runtime_generates_from_the_engine_dir(engines):
    """The runtime on the engine dir (its batched executor) gives the checkpoint's tokens, config by config."""
    from trt_lookahead.runtime import LookaheadRuntime

    with (LookaheadRuntime.from_pretrained(STORIES, lookahead="4,3,4", max_seq_len=MAX_SEQ_LEN) as checkpoint,
          LookaheadRuntime.from_pretrained(engines["plugin"]) as engine):
        assert engine.backend == "onnxruntime" and engine.max_batch == MAX_BATCH
        # naming no config runs `auto`, within the built 4/3/4 (greedy's tokens)
        assert engine.lookahead.auto and engine.lookahead.ceiling.W <= 4 and engine.lookahead.ceiling.G <= 4
        assert engine.lookahead.ceiling.N <= 3
        default = engine.generate("Once upon a time", max_new_tokens=40)
        greedy = checkpoint.generate("Once upon a time", max_new_tokens=40, lookahead="greedy")
        assert default.config == "auto" and default.token_ids == greedy.token_ids
        for config in ("4,3,4", "2,2,1", "greedy"):
            a = engine.generate("Once upon a time", max_new_tokens=40, lookahead=config)
            b = checkpoint.generate("Once upon a time", max_new_tokens=40, lookahead=config)
            assert a.token_ids == b.token_ids and a.text == b.text
        with pytest.raises(ValueError, match=r"does not fit the engine built for 4/3/4 \(W=5 > 4\)"):
            engine.generate("Once upon a time", max_new_tokens=4, lookahead="5,3,4")
    with pytest.raises(UserError, match=r"max_batch 5 exceeds the engine's 4"):
        LookaheadRuntime.from_pretrained(engines["plugin"], max_batch=5)


ENGINE_JOBS = [  # (prompt, request): configs within the engine's 4/3/4, sampling, a stop string, `auto`
    ("Once upon a time", dict(lookahead="greedy", max_new_tokens=60)),
    ("Lily and Tom went to the park. They", dict(lookahead="4,3,4", max_new_tokens=80)),
    ("The cat sat on the", dict(lookahead="2,3,2", max_new_tokens=40, seed=3, temperature=0.8, top_k=40, top_p=0.95)),
    ("Sam had a red ball", dict(lookahead="2,2,1", max_new_tokens=64, stop=["."])),
    ("One day, a little bird", dict(lookahead="auto", max_new_tokens=70)),
    ("Mom said to Ben,", dict(lookahead="greedy", max_new_tokens=50, seed=1, temperature=0.8)),
]


def test_the_scheduler_prices_an_engine_step_as_rows_times_its_widest_row(engines):
    """The engine's graph runs every row as wide as the widest: a step of a 1/3/1 row (4 tokens) and a 4/3/4 row
    (16) is learnt by the policy as 2 x 16 tokens, the shape tune times (B rows of T tokens)."""
    from trt_lookahead.lookahead.config import Lookahead
    from trt_lookahead.lookahead.decoder import RequestDecoder
    from trt_lookahead.lookahead.policy import LookaheadPolicy, Priors, StepCost
    from trt_lookahead.runtime.scheduler import Job, Scheduler

    executor = open_engine(engines["plugin"], threads=1).executor()
    assert executor.pads_rows
    policy = LookaheadPolicy(StepCost.linear(10.0, 0.1), Priors({"4/3/4": 1.7}))
    scheduler = Scheduler(executor, policy)
    for config in (LookaheadConfig(1, 3, 1), LookaheadConfig(4, 3, 4)):
        decoder = RequestDecoder(config, [1, 2, 3, 4], 8)
        scheduler.submit(Job(decoder, Lookahead(config, auto=False), SamplingParams()))
    while policy.cost.last is None:
        scheduler.run_once()
    assert policy.cost.last[:2] == (2 * T, 2)


@pytest.mark.parametrize("prefill", ["separate", 5])
def test_concurrent_requests_on_an_engine_equal_their_solo_runs(engines, tmp_path, prefill):
    """Six requests from six threads on one engine runtime of four slots (two wait for a slot, joining later):
    every answer is token-identical to the same request run alone with separate prefill, and every slot is
    free afterwards. With chunked prefill (5-token chunks, padded to the step's T beside 4/3/4 rows) too."""
    import threading

    from trt_lookahead.lookahead.policy import StepCost
    from trt_lookahead.runtime import LookaheadRuntime, tuning_file

    tuning = tmp_path / "tuning.json"  # `auto` reads the step cost from here instead of tuning first
    cost = StepCost({1: [(1, 2.0), (16, 3.0), (64, 8.0)], 4: [(4, 3.0), (64, 10.0)]})
    entry = {"config": "4/3/4", "step_cost": cost.to_dict(), "priors": {"1/3/1": 1.3, "2/3/2": 1.5, "4/3/4": 1.7}}
    tuning_file.write_tuning_entry(tuning_file.tuning_key(str(engines["plugin"]), "float32", "onnxruntime"), entry,
                                   tuning)
    with LookaheadRuntime.from_pretrained(engines["plugin"], tuning_file=tuning, prefill="separate") as rt:
        alone = [rt.generate(prompt, **request) for prompt, request in ENGINE_JOBS]
        rt.scheduler.prefill = prefill
        together: list = [None] * len(ENGINE_JOBS)
        barrier = threading.Barrier(len(ENGINE_JOBS))

        def work(i: int) -> None:
            barrier.wait()
            together[i] = rt.generate(ENGINE_JOBS[i][0], **ENGINE_JOBS[i][1])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(ENGINE_JOBS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for job, a, b in zip(ENGINE_JOBS, alone, together, strict=True):
            assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason, job
        assert max(step.rows for step in rt.scheduler.steps) >= 3  # they did share steps
        assert rt.scheduler.free_slots == MAX_BATCH
        if prefill != "separate":
            assert any(0 < step.prefill_rows < step.rows for step in rt.scheduler.steps)  # beside decode rows
            assert rt.scheduler.stats.prefill_chunks > len(ENGINE_JOBS)  # prompts were split


@pytest.mark.slow
def test_smollm2_engine_rows_match_the_model_and_their_solo_runs(tmp_path):
    from trt_lookahead.model.fetch import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    engine = open_engine(build(tmp_path / "smollm2", model=path, max_seq_len=512, max_input_len=128), threads=2)
    run_mixed_steps(engine, load_llama(path)[0], [2, 3, 1, 0], steps=3, seed=4)


def test_a_tree_engine_verifies_its_draft_tree_and_emits_the_checkpoints_tokens(tmp_path):
    """build --tree auto --target tensorrt: config.json carries the template, every LookaheadAttention node its
    subtree ends (tree = 1, an initializer over the graph's 64 tokens, which the plugin and the decomposition
    read), the build's smoke check compares the graph with the torch model row by row, the plan is left to a
    TensorRT host, and the runtime on the engine dir emits greedy's tokens while accepting recycled drafts.
    A template of the wrong size in config.json and a tree on a graph without the LookaheadAttention node are
    refused."""
    from collections import Counter

    import onnx
    from onnx import numpy_helper

    from trt_lookahead.engine.build import build_request
    from trt_lookahead.engine.format import load_engine_config
    from trt_lookahead.kernels import mask, onnx_op
    from trt_lookahead.lookahead.tree import TREE_DEPTH, tree_template
    from trt_lookahead.runtime import LookaheadRuntime

    path = build(tmp_path / "tree", "--lookahead_config", "7,5,7", "--tree", "auto", "--target", "tensorrt")
    template = tree_template(28, TREE_DEPTH)
    assert load_engine_config(path).tree == template
    graph = onnx.load(str(path / "model.onnx"), load_external_data=False)
    nodes = onnx_op.attention_nodes(graph)
    assert len(nodes) == load_engine_config(path).num_layers and len({n.input[7] for n in nodes}) == 1
    assert all(a.i == 1 for n in nodes for a in n.attribute if a.name == "tree")
    (table,) = (numpy_helper.to_array(t) for t in graph.graph.initializer if t.name == nodes[0].input[7])
    assert np.array_equal(table, mask.tree_ends(template.table, 64).astype(np.int32))
    tensorrt = json.loads((path / "config.json").read_text())["targets"]["tensorrt"]
    if tensorrt_unavailable_reason():  # everything but the plan, and the command that builds it
        assert not tensorrt["built"] and tensorrt["command"] == f"python -m trt_lookahead.engine.tensorrt_plan {path}"
        with pytest.raises(UserError, match="the tensorrt backend cannot run here"):  # not for its tree
            open_engine(path, backend="tensorrt")
    sources: Counter = Counter()
    with (LookaheadRuntime.from_pretrained(path) as engine,
          LookaheadRuntime.from_pretrained(STORIES, backend="torch", max_seq_len=MAX_SEQ_LEN) as reference):
        assert engine.tree == tree_template(28, TREE_DEPTH) and engine.executor.tree == engine.tree
        long = " ".join(["Lily and Tom went to the park."] * 10)  # > T = 56 tokens: a 64-token prefill chunk
        for prompt in ("Once upon a time", "Lily and Tom went to the park. They", "Sam had a red ball", long):
            out = engine.generate(prompt, max_new_tokens=64, pool_scope="request", lookahead="7,5,7")  # as built
            assert out.token_ids == reference.generate(prompt, max_new_tokens=64, lookahead="greedy").token_ids
            sources.update(out.stats.sources)
        with pytest.raises(UserError, match="verifies the tree it was built with"):
            LookaheadRuntime.from_pretrained(path, tree="auto")
    assert sources["recycled"] > 0
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "tree": [-1, 0]}))
    with pytest.raises(UserError, match="tree does not have the G\\(N-1\\) nodes of 7/5/7"):
        load_engine_config(path, verify=False)
    with pytest.raises(UserError, match="--tree cannot build this engine: its mask is the LookaheadAttention"):
        build_request(STORIES, tmp_path / "native", lookahead=LookaheadConfig(7, 5, 7), attention="native",
                      tree="auto")
    assert build_request(STORIES, tmp_path / "trt", lookahead=LookaheadConfig(4, 3, 4), target="tensorrt",
                         tree="auto").tree == tree_template(8, TREE_DEPTH)


def test_tune_measures_only_the_configs_an_engine_runs(engines):
    """tune's ladders keep the configs within the engine's 4/3/4 (it once asked an 8/3/8 engine for 1/4/1)."""
    from trt_lookahead.runtime import LookaheadRuntime
    from trt_lookahead.tuning import tune

    with LookaheadRuntime.from_pretrained(engines["plugin"]) as rt:
        fits = {str(c): tune._runs_on(rt, c) for c in (LookaheadConfig(4, 3, 4), LookaheadConfig(1, 3, 1),
                                                       LookaheadConfig(1, 4, 1), LookaheadConfig(8, 3, 8))}
    assert fits == {"4/3/4": True, "1/3/1": True, "1/4/1": False, "8/3/8": False}


def test_bench_runs_on_an_engine_dir(engines, tmp_path, capsys):
    """`bench --engine`: greedy and lookahead rows on the engine's executor, exact, and the memory limit from the
    engine's weights file (it once read the engine dir as a checkpoint and failed)."""
    from trt_lookahead.engine.format import WEIGHTS_FILE

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n" + json.dumps({"prompt": "Sam had a"}) + "\n")
    code = main(["bench", "--engine", str(engines["plugin"]), "--dataset", str(prompts), "--limit", "2",
                 "--max-new-tokens", "16", "--configs", "greedy,4/3/4", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    result = json.loads(out.out.strip().splitlines()[-1])
    rows = {r["config"]: r for r in result["results"]}
    assert rows["4/3/4"]["exact"] == 1.0 and rows["4/3/4"]["prompts"] == 2 and result["backend"] == "onnxruntime"
    size = (engines["plugin"] / WEIGHTS_FILE).stat().st_size
    assert result["memory_limit"]["weight_mb"] == round(size / 1e6, 1)
