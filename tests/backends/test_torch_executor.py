"""BatchedTorchExecutor on stories260K and a random GQA Llama: the contract, rows exact alone or batched,
commit, sampling, the padded (CUDA) path on the CPU, and the single-request adapter."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from support.ablation import LookaheadDecoder
from support.torch_executor import TorchExecutor, layout_config
from transformers import LlamaForCausalLM

from trt_lookahead.backends.devices import gpu_count
from trt_lookahead.backends.torch import BatchedTorchExecutor, RowAttention
from trt_lookahead.engine.format import batch_buckets
from trt_lookahead.kernels.mask import CAUSAL, step_mask
from trt_lookahead.kernels.sampling_torch import select_rows_torch, select_tokens_torch, vocab_salts
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams, select_tokens
from trt_lookahead.lookahead.tree import TreeTemplate, tree_template
from trt_lookahead.model.checkpoint import load_llama
from trt_lookahead.model.llama import Llama, ModelConfig, attend

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
PROMPT = np.array([1, 403, 407, 261, 378, 505, 263, 260, 345, 411, 280, 306, 263, 417, 300, 45])
GREEDY = LookaheadConfig.greedy()


def has_cuda_device() -> tuple[bool, str]:
    """A CUDA device (backends.devices.gpu_count) and a CUDA build of torch."""
    if gpu_count() == 0:
        return False, "no CUDA device (cudaGetDeviceCount found none)"
    if not torch.cuda.is_available():
        return False, f"a CUDA device exists but torch {torch.__version__} is a CPU build"
    return True, ""


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # stories260K runs fastest on one thread


@pytest.fixture(scope="module")
def model():
    return load_llama(STORIES, weight_layout="auto")[0]


def random_gqa(layout: str) -> Llama:
    """A random-weight Llama with grouped-query attention (4 query heads share 2 KV heads), weights in `layout`."""
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                      vocab_size=97, max_position_embeddings=512)
    m = Llama(cfg, dtype=torch.float32).eval().requires_grad_(False)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m.set_weight_layout(layout)


@pytest.fixture(scope="module")
def gqa():
    return random_gqa("auto")


def row(config: tuple[int, int, int], ids, positions, tokens: int | None = None):
    """One row of a batch: ids/positions padded to `tokens` (pads at the row's first position), its output slots."""
    real = len(ids)
    T = tokens or real
    out = np.arange(real) if config == CAUSAL else StepLayout(LookaheadConfig(*config)).output_slots
    return config, np.pad(ids, (0, T - real)), np.pad(positions, (0, T - real), constant_values=positions[0]), out


def make_batch(slots, rows) -> StepBatch:
    T = max(len(r[1]) for r in rows)
    K = max(len(r[3]) for r in rows)
    pad = lambda a, n, v: np.concatenate([a, np.full(n - len(a), v)])  # noqa: E731
    return StepBatch(
        np.array(slots, np.int64),
        np.stack([pad(r[1], T, 0) for r in rows]).astype(np.int64),
        np.stack([pad(r[2], T, r[2][0]) for r in rows]).astype(np.int64),
        np.array([r[0] for r in rows], np.int32),
        np.stack([pad(r[3], K, r[3][-1]) for r in rows]).astype(np.int64),
    )


def greedy_decode(ex: BatchedTorchExecutor, slot: int, prompt, n: int, sampling=None) -> list[int]:
    x = ex.prefill(slot, np.asarray(prompt), sampling or SamplingParams())
    out = [x]
    for _ in range(n - 1):
        p = ex.cache_len(slot)
        x = int(ex.step(make_batch([slot], [row((1, 2, 0), np.array([x]), np.array([p]))]))[0, 0])
        ex.commit(slot, np.array([0]))
        out.append(x)
    return out


def test_executor_sizes(model):
    ex = BatchedTorchExecutor(model, max_batch=3, max_seq_len=64, step_tokens=16)
    assert (ex.vocab_size, ex.max_seq_len, ex.max_batch, ex.step_tokens) == (512, 64, 3, 16)
    assert ex.k_cache.shape == (5, 3 * 80, 4, 8) and not ex.padded
    assert [ex.cache_len(s) for s in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("layout", ["auto", "out_in"])
@pytest.mark.parametrize("prompt", [[1], PROMPT.tolist()])
def test_greedy_rows_reproduce_transformers_generate(prompt, layout):
    model = load_llama(STORIES, weight_layout=layout)[0]
    n = 200 if len(prompt) == 1 else 100
    hf = LlamaForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    ref = hf.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    ex = BatchedTorchExecutor(model, 2, 512, 8)
    assert greedy_decode(ex, 1, prompt, n) == ref
    ex.release(1)
    assert greedy_decode(ex, 1, prompt, 20) == ref[:20]  # the same buffers, a new request


_SEQUENTIAL: dict[tuple[int, ...], int] = {}


def sequential_argmax(model, prefix: list[int]) -> int:
    """Greedy next token after `prefix`, by prefilling it (memoized: the same prefixes recur)."""
    key = tuple(prefix)
    if key not in _SEQUENTIAL:
        _SEQUENTIAL[key] = BatchedTorchExecutor(model, 1, 512, 1).prefill(0, np.array(prefix), SamplingParams())
    return _SEQUENTIAL[key]


# the step paths: packed (the CPU's), padded with SDPA over every row, padded with the Triton attention over each
# slot's own keys (interpreted on the CPU)
STEP_PATHS = {"packed": dict(padded=False), "padded": dict(padded=True), "triton": dict(attention="triton")}


@pytest.mark.parametrize("path", STEP_PATHS)
@pytest.mark.parametrize("tree", [None, tree_template(6, 3)], ids=["linear", "tree"])
def test_each_row_slot_sees_exactly_its_own_prefix(model, path, tree):
    """A batch of rows with different configs and cache lengths: every output slot == greedy on its prefix. With
    a 6-node tree, 2/2/1 verifies its first node and 4/3/4 (8 slots) linear candidates (tree.covers)."""
    rng = np.random.default_rng(0)
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:12]]
    configs = [(4, 3, 4), (2, 2, 1), CAUSAL]
    ex = BatchedTorchExecutor(model, 4, 128, 16, tree=tree, **STEP_PATHS[path])
    rows, contexts = [], []
    for slot, (prompt, config) in enumerate(zip(prompts, configs, strict=True)):
        x = ex.prefill(slot, prompt, SamplingParams())
        if config == CAUSAL:  # a causal chunk of 6 tokens after the prompt
            ids = np.concatenate([[x], rng.integers(3, 512, 5)])
            rel, mask = np.arange(6), step_mask(6, CAUSAL)
        else:
            layout = StepLayout(LookaheadConfig(*config), tree=tree)
            ids = rng.integers(3, 512, layout.step_tokens)
            ids[0] = x
            rel, mask = layout.rel_positions, layout.mask
        rows.append(row(config, ids, len(prompt) + rel))
        contexts.append((prompt, ids, rel, mask))
    batch = make_batch([2, 0, 1], [rows[2], rows[0], rows[1]])  # rows in another order than slots
    out = ex.step(batch)
    assert out.shape == batch.input_ids.shape and out.dtype == np.int64
    for b, (prompt, ids, rel, mask) in zip((1, 2, 0), contexts, strict=True):
        reads = np.unique(batch.output_slots[b])
        for i in reads:
            visible = np.flatnonzero(mask[i])
            visible = visible[np.argsort(rel[visible], kind="stable")]
            assert out[b, i] == sequential_argmax(model, [*prompt.tolist(), *ids[visible].tolist()]), (b, i)
        assert (np.delete(out[b], reads) == -1).all()


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
def test_commit_keeps_the_accepted_rows(model, padded):
    """Speculate the true greedy continuation in a candidate row; commit moves its KV; decoding goes on exactly."""
    cfg = LookaheadConfig(3, 4, 2)
    layout = StepLayout(cfg)
    reference = greedy_decode(BatchedTorchExecutor(model, 1, 512, 1), 0, PROMPT, 60)
    ex = BatchedTorchExecutor(model, 2, 256, layout.step_tokens, padded=padded)
    x = ex.prefill(1, PROMPT, SamplingParams())
    produced, rng, steps = [x], np.random.default_rng(1), 0
    while len(produced) < len(reference):
        p = ex.cache_len(1)
        ids = rng.integers(3, 512, layout.step_tokens)
        ids[0] = x
        k_row = steps % cfg.G  # the right draft sits in a varying candidate row
        truth = reference[len(produced) : len(produced) + cfg.N - 1]
        accept = min(len(truth), 1 + steps % (cfg.N - 1))  # accept 1..N-1 drafted tokens
        draft = layout.candidate_slots[k_row]
        ids[draft[: len(truth)]] = truth
        out = ex.step(make_batch([1], [row((3, 4, 2), ids, p + layout.rel_positions)]))[0]
        assert out[0] == truth[0]
        assert list(out[draft[: accept - 1]]) == truth[1:accept]
        bonus = int(out[draft[accept - 1]])
        ex.commit(1, np.concatenate(([0], draft[:accept])))
        assert ex.cache_len(1) == p + 1 + accept
        produced += [*truth[:accept], bonus]
        x, steps = bonus, steps + 1
    assert produced[: len(reference)] == reference

    # the committed KV rows equal a fresh prefill of the same sequence (slot 1's rows of the flat cache)
    n = ex.cache_len(1)
    fresh = BatchedTorchExecutor(model, 1, 256, 1)
    fresh.prefill(0, np.array([*PROMPT.tolist(), *produced])[:n], SamplingParams())
    for got, want in zip(ex.slot_kv(1), fresh.slot_kv(0), strict=True):
        assert torch.allclose(got, want, atol=1e-5)


def random_rows(rng, vocab, slots, cache_lens, step_tokens):
    """A random row per slot: a lookahead layout, greedy, or a causal chunk, at the slot's cache_len."""
    rows = []
    for slot in slots:
        kind = rng.integers(3)
        if kind == 0:
            config = (int(rng.integers(1, 4)), int(rng.integers(2, 5)), int(rng.integers(0, 4)))
            layout = StepLayout(LookaheadConfig(*config))
            rel = layout.rel_positions
        else:
            config = (1, 2, 0) if kind == 1 else CAUSAL
            rel = np.arange(1 if kind == 1 else int(rng.integers(2, 6)))
        rows.append(row(config, rng.integers(0, vocab, len(rel)), cache_lens[slot] + rel))
    return rows


@pytest.mark.parametrize("which", ["stories", "gqa"])
def test_a_row_gets_the_same_tokens_alone_and_in_any_batch(model, gqa, which):
    """The batched-vs-solo invariant through the executor: each row's outputs equal the row run alone."""
    m = model if which == "stories" else gqa
    vocab = m.cfg.vocab_size
    rng = np.random.default_rng(3)
    batched, alone = BatchedTorchExecutor(m, 6, 256, 32), BatchedTorchExecutor(m, 1, 256, 32)
    prompts = [rng.integers(0, vocab, int(rng.integers(1, 40))) for _ in range(6)]
    params = [SamplingParams() if s % 2 else SamplingParams(0.9, 20, 0.9, s) for s in range(6)]
    history: dict[int, list] = {s: [] for s in range(6)}  # (row, kept rows) of each committed step
    for slot in range(6):
        batched.prefill(slot, prompts[slot], params[slot])
    for _ in range(5):
        slots = sorted(rng.choice(6, int(rng.integers(1, 7)), replace=False).tolist())
        rows = random_rows(rng, vocab, slots, {s: batched.cache_len(s) for s in slots}, 32)
        out = batched.step(make_batch(slots, rows))
        for b, (slot, r) in enumerate(zip(slots, rows, strict=True)):
            alone.prefill(0, prompts[slot], params[slot])
            for earlier, kept in history[slot]:
                alone.step(make_batch([0], [earlier]))
                alone.commit(0, kept)
            solo = alone.step(make_batch([0], [r]))[0]
            reads = np.unique(r[3])
            assert np.array_equal(out[b, reads], solo[reads]), (which, slot)
            alone.release(0)
        for slot, r in zip(slots, rows, strict=True):  # keep x_t, sometimes the next token too
            kept = np.arange(min(len(r[1]), 1 + int(rng.integers(0, 2))))
            batched.commit(slot, kept)
            history[slot].append((r, kept))


@pytest.mark.parametrize("which", ["stories", "gqa"])
def test_row_attention_makes_a_rows_logits_bit_identical_alone_and_batched(model, gqa, which):
    """The mechanism behind the invariant: packed rows with per-row attention give each row the same logits,
    to the bit, as the row alone (float32, the row-invariant weight layout)."""
    m = model if which == "stories" else gqa
    cfg, rng = m.cfg, np.random.default_rng(5)
    S = 64
    shape = (cfg.num_layers, 3 * S, cfg.num_kv_heads, cfg.head_dim)
    k, v = torch.randn(shape), torch.randn(shape)  # three slots' caches, any content
    rows = [(0, 10, LookaheadConfig(4, 3, 4)), (1, 3, GREEDY), (2, 25, LookaheadConfig(2, 4, 1))]

    def run(selected):
        ids, pos, cache_rows, spans, start = [], [], [], [], 0
        for slot, p, config in selected:
            layout = StepLayout(config)
            t = layout.step_tokens
            ids.append(np.random.default_rng(slot).integers(0, cfg.vocab_size, t))
            pos.append(p + layout.rel_positions)
            cache_rows.append(slot * S + p + np.arange(t))
            mask = None
            if t > 1:
                mask = torch.ones(t, p + t, dtype=torch.bool)
                mask[:, p:] = torch.from_numpy(layout.mask.copy())
            spans.append((start, start + t, slot * S, p + t, functools.partial(attend, mask=mask)))
            start += t
        with torch.inference_mode():
            return m(torch.from_numpy(np.concatenate(ids)), torch.from_numpy(np.concatenate(pos)), k.clone(), v.clone(),
                     None, None, None, attention=RowAttention(spans),
                     cache_rows=torch.from_numpy(np.concatenate(cache_rows)))

    together = run(rows)
    start = 0
    for r in rows:
        t = r[2].step_tokens
        assert torch.equal(run([r]), together[start : start + t]), (which, r)
        start += t
    assert rng is not None


def test_padded_buckets_are_the_engine_formats_batch_buckets(model):
    """One batch-bucket formula (engine/format.py) for TensorRT plans, the padded torch step and tune's rows."""
    assert BatchedTorchExecutor(model, 6, 32, 4, padded=True).buckets == batch_buckets(6) == [1, 2, 4, 6]


def test_padded_path_gives_the_packed_tokens_and_survives_releases(model):
    """The padded (CUDA-graph) layout run eagerly on the CPU: same tokens as the packed path, also after
    releasing a slot in the middle moves another slot's cache into its place."""
    rng = np.random.default_rng(7)
    packed, padded = BatchedTorchExecutor(model, 4, 128, 16), BatchedTorchExecutor(model, 4, 128, 16, padded=True)
    prompts = {s: rng.integers(0, 512, 5 + 3 * s) for s in range(4)}
    params = {s: SamplingParams() if s != 2 else SamplingParams(1.0, 0, 0.9, 3) for s in range(4)}
    for ex in (packed, padded):
        for s in range(4):
            ex.prefill(s, prompts[s], params[s])
    live = [0, 1, 2, 3]
    for step in range(8):
        if step == 3:
            live.remove(1)  # physical slot 1 is refilled from the last one
            packed.release(1)
            padded.release(1)
        rows = random_rows(rng, 512, live, {s: packed.cache_len(s) for s in live}, 16)
        a, b = packed.step(make_batch(live, rows)), padded.step(make_batch(live, rows))
        assert np.array_equal(a, b), step
        for s in live:
            packed.commit(s, np.array([0]))
            padded.commit(s, np.array([0]))
    assert padded._active == 3 and sorted(padded._physical[live].tolist()) == [0, 1, 2]


# -- sampling ---------------------------------------------------------------------------------------

SAMPLING = [
    SamplingParams(temperature=1.0, seed=0),
    SamplingParams(temperature=0.7, top_k=5, seed=123),
    SamplingParams(temperature=1.3, top_p=0.9, seed=2**40 + 7),
    SamplingParams(temperature=0.5, top_k=50, top_p=0.5, seed=42),
    SamplingParams(temperature=2.0, top_k=1, seed=9),
    SamplingParams(temperature=1.0, top_p=0.01, seed=5),
    SamplingParams(),
]


@pytest.mark.parametrize("params", SAMPLING, ids=str)
def test_sampling_twin_equals_numpy_reference(params):
    rng = np.random.default_rng(7)
    for vocab, rows in ((512, 40), (3001, 8)):
        logits = (rng.normal(size=(rows, vocab)) * rng.uniform(0.5, 4)).astype(np.float32)
        logits[0, :10] = logits[0, 0]  # exact ties
        positions = rng.integers(0, 10**6, rows)
        ref = select_tokens(logits, positions, params)
        got = select_tokens_torch(torch.from_numpy(logits), torch.from_numpy(positions), params)
        assert np.array_equal(got.numpy(), ref)


def test_rows_with_their_own_sampling_parameters_equal_each_alone():
    rng = np.random.default_rng(8)
    logits = torch.from_numpy((rng.normal(size=(len(SAMPLING), 512)) * 3).astype(np.float32))
    positions = torch.from_numpy(rng.integers(0, 1000, len(SAMPLING)))
    column = lambda name, dtype: torch.tensor([getattr(p, name) for p in SAMPLING], dtype=dtype)  # noqa: E731
    together = select_rows_torch(logits, positions, column("temperature", torch.float64), column("top_k", torch.int64),
                                 column("top_p", torch.float64), column("seed", torch.int64) & 0xFFFFFFFF,
                                 vocab_salts(512))
    for i, params in enumerate(SAMPLING):
        assert together[i] == select_tokens(logits[i : i + 1].double().numpy(), positions[i : i + 1].numpy(), params)[0]


def test_seeded_sampling_in_the_executor_equals_numpy_reference(model):
    """One-token sampled rows == numpy select_tokens on the model's logits, keyed by position."""
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11)
    ex = BatchedTorchExecutor(model, 2, 256, 4)
    got = greedy_decode(ex, 1, PROMPT, 30, params)
    tokens = PROMPT.tolist()
    for x in got:
        ref = BatchedTorchExecutor(model, 1, 256, 1)
        with torch.inference_mode():
            ids = torch.tensor(tokens)
            logits = model(ids, torch.arange(len(ids)), ref.k_cache, ref.v_cache, torch.tensor(0),
                           torch.ones(len(ids), len(ids)).tril().bool())
        assert x == select_tokens(logits[-1:].double().numpy(), np.array([len(tokens) - 1]), params)[0]
        tokens.append(x)
    ex.release(1)
    assert greedy_decode(ex, 1, PROMPT, 30, params) == got  # the same seed replays the same draws


@pytest.mark.parametrize(
    ("config", "tree", "padded"),
    [
        ((3, 3, 2), None, False),  # linear candidates
        ((2, 3, 2), TreeTemplate((-1, 0, 1, 0, -1, 4, -1)), False),  # a tree: depth 3 on 4 verification slots
        ((2, 3, 2), TreeTemplate((-1, 0, 1, 0, -1, 4, -1)), True),
    ],
    ids=["linear", "tree-packed", "tree-padded"],
)
def test_sampled_lookahead_row_slots_equal_the_draw_on_their_visible_prefix(model, config, tree, padded):
    """With seeded sampling, each output slot's draw equals the one-token draw on its visible prefix (StepLayout's
    mask), for linear candidates and for a draft tree."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    layout = StepLayout(LookaheadConfig(*config), tree=tree)
    ids = np.random.default_rng(2).integers(3, 512, layout.step_tokens)
    ex = BatchedTorchExecutor(model, 1, 128, 16, padded=padded, tree=tree)
    ids[0] = ex.prefill(0, PROMPT, params)
    out = ex.step(make_batch([0], [row(config, ids, len(PROMPT) + layout.rel_positions)]))[0]
    seq = BatchedTorchExecutor(model, 1, 128, 1)
    for i in layout.output_slots:
        visible = np.flatnonzero(layout.mask[i])
        visible = visible[np.argsort(layout.rel_positions[visible], kind="stable")]
        seq.release(0)
        assert out[i] == seq.prefill(0, np.array([*PROMPT.tolist(), *ids[visible].tolist()]), params), f"slot {i}"


@pytest.mark.parametrize("path", STEP_PATHS)
def test_top_ids_are_the_likeliest_next_tokens_of_each_output_slots_prefix(model, path):
    """StepBatch.top_ids: at every output slot, the k ids of the largest logits of the one-token forward pass on
    that slot's visible prefix (the model called directly), largest first; other entries untouched."""
    tree = TreeTemplate((-1, 0, 1, 0, -1, 4, -1))
    config = (2, 3, 2)
    layout = StepLayout(LookaheadConfig(*config), tree=tree)
    ids = np.random.default_rng(5).integers(3, 512, layout.step_tokens)
    ex = BatchedTorchExecutor(model, 2, 128, 16, tree=tree, **STEP_PATHS[path])
    ids[0] = ex.prefill(1, PROMPT, SamplingParams())
    batch = make_batch([1], [row(config, ids, len(PROMPT) + layout.rel_positions)])
    batch.top_ids = np.full((1, batch.tokens, 4), -7, np.int64)
    out = ex.step(batch)[0]
    reads = np.unique(layout.output_slots)
    assert (np.delete(batch.top_ids[0], reads, axis=0) == -7).all()
    for i in reads:
        visible = np.flatnonzero(layout.mask[i])
        context = [*PROMPT.tolist(), *ids[visible[np.argsort(layout.rel_positions[visible], kind="stable")]].tolist()]
        scratch = BatchedTorchExecutor(model, 1, 128, 1)
        with torch.inference_mode():
            logits = model(torch.tensor(context), torch.arange(len(context)), scratch.k_cache, scratch.v_cache,
                           torch.tensor(0), torch.ones(len(context), len(context)).tril().bool())[-1]
        top = torch.argsort(logits, descending=True)[:4].tolist()
        gaps = (logits[top[:-1]] - logits[top[1:]]).tolist()
        assert batch.top_ids[0, i, 0] == out[i] == top[0], f"slot {i}"
        sure = next((r for r, g in enumerate(gaps) if g < 1e-4), 3) + 1  # ranks clear of float near-ties
        assert batch.top_ids[0, i, :sure].tolist() == top[:sure], f"slot {i}"


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=9)],
                         ids=["greedy", "sampled"])
def test_tree_decoding_emits_plain_decoding(model, sampling):
    """stories260K through a draft tree (pool + suffix + chain) emits what one-token decoding emits."""
    tree = tree_template(24, 6)
    ex = BatchedTorchExecutor(model, 1, 512, 64, tree=tree)
    got = LookaheadDecoder(ex, LookaheadConfig(4, 4, 8), tree=tree).generate(PROMPT, 120, sampling)
    assert got.token_ids == greedy_decode(BatchedTorchExecutor(model, 1, 512, 1), 0, PROMPT, 120, sampling)
    assert got.stats.steps < 120  # the drafts were used, not only the bonus token


# -- dtypes, errors, the single-request adapter, GPU ------------------------------------------------


def test_bfloat16_executor_runs_and_mostly_agrees(model):
    ref = greedy_decode(BatchedTorchExecutor(model, 1, 256, 1), 0, PROMPT, 40)
    bf16, _ = load_llama(STORIES, dtype="bfloat16")
    ex = BatchedTorchExecutor(bf16, 2, 256, 16)
    assert ex.k_cache.dtype == torch.bfloat16
    got = greedy_decode(ex, 0, PROMPT, 40)
    assert all(0 <= t < 512 for t in got)
    assert got[:3] == ref[:3]  # the first tokens are far from ties; the rest is reported by the bench
    layout = StepLayout(LookaheadConfig(4, 3, 4))
    ids = np.full(layout.step_tokens, 5)
    ids[0] = ex.prefill(1, PROMPT, SamplingParams())
    out = ex.step(make_batch([1], [row((4, 3, 4), ids, len(PROMPT) + layout.rel_positions)]))[0]
    assert (out[layout.output_slots] >= 0).all()


def test_contract_errors(model):
    ex = BatchedTorchExecutor(model, 2, 16, 4)
    with pytest.raises(ValueError, match=r"slots are 0 \.\. 1"):
        ex.prefill(2, np.ones(3, np.int64), SamplingParams())
    with pytest.raises(ValueError, match="does not fit"):
        ex.prefill(0, np.ones(17, np.int64), SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        ex.prefill(0, np.array([1, 512]), SamplingParams())
    with pytest.raises(ValueError, match="never prefilled"):
        ex.step(make_batch([1], [row((1, 2, 0), np.array([1]), np.array([0]))]))
    ex.prefill(0, np.ones(15, np.int64), SamplingParams())
    with pytest.raises(ValueError, match=r"1 \.\. 4 tokens"):
        ex.step(make_batch([0], [row((2, 2, 3), np.ones(5, np.int64), np.arange(15, 20))]))
    with pytest.raises(ValueError, match="real slots of the last step"):
        ex.commit(0, np.array([0]))  # nothing stepped yet
    ex.step(make_batch([0], [row((2, 2, 0), np.array([1, 2]), np.array([15, 16]))]))
    with pytest.raises(ValueError, match="overflows"):
        ex.commit(0, np.array([0, 1]))
    with pytest.raises(ValueError, match="real slots"):
        ex.commit(0, np.array([2]))
    ex.commit(0, np.array([1]))
    assert ex.cache_len(0) == 16
    ex.release(0)
    assert ex.cache_len(0) == 0
    with pytest.raises(ValueError, match="is on"):
        BatchedTorchExecutor(model, 1, 16, device="meta")
    with pytest.raises(ValueError, match="max_batch must be a positive integer"):
        BatchedTorchExecutor(model, 0, 16)


def test_the_single_request_adapter_keeps_the_old_signature(model):
    """The single-request contract of one layout (scripts time it) over slot 0: its layouts' masks map back to
    their configs, and its greedy steps give the batched executor's tokens."""
    for config in (LookaheadConfig(4, 3, 4), LookaheadConfig(2, 2, 1), GREEDY, LookaheadConfig(5, 4, 0)):
        layout = StepLayout(config)
        assert np.array_equal(step_mask(layout.step_tokens, layout_config(layout.mask)), layout.mask)
        assert TorchExecutor(model, layout.mask, 256, output_slots=layout.output_slots).step_tokens == len(layout.mask)
    legacy = TorchExecutor(model, np.ones((1, 1), bool), 256)
    legacy.reset()
    got = [legacy.prefill(np.asarray(PROMPT))]
    for _ in range(39):
        got.append(int(legacy.step(np.array([got[-1]]), np.array([legacy.cache_len]))[0]))
        legacy.commit(np.array([0]))
    assert got == greedy_decode(BatchedTorchExecutor(model, 1, 256, 1), 0, PROMPT, 40)
    with pytest.raises(ValueError, match="neither a lookahead layout"):
        TorchExecutor(model, np.eye(3, dtype=bool)[::-1], 16)


CUDA_OK, CUDA_REASON = has_cuda_device()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_cuda_graph_batches_match_the_cpu(dtype, compile):
    """The padded step captured per batch-size bucket (compiled: the compiled step captured): one-token, lookahead
    and sampled rows vs the CPU."""
    cpu_model, _ = load_llama(STORIES, dtype=dtype)
    gpu_model, _ = load_llama(STORIES, dtype=dtype, device="cuda")
    ref = greedy_decode(BatchedTorchExecutor(cpu_model, 1, 256, 1), 0, PROMPT, 60)
    ex = BatchedTorchExecutor(gpu_model, 8, 256, 16, compile=compile)
    assert ex.cuda_graph and ex.padded and ex.buckets == [1, 2, 4, 8]
    got = greedy_decode(ex, 3, PROMPT, 60)
    assert got == ref if dtype == "float32" else got[:3] == ref[:3]
    rng = np.random.default_rng(0)
    cpu = BatchedTorchExecutor(cpu_model, 8, 256, 16)
    gpu = BatchedTorchExecutor(gpu_model, 8, 256, 16, compile=compile)
    prompts = {s: rng.integers(0, 512, 4 + s) for s in range(5)}
    for e in (cpu, gpu):
        for s in range(5):
            e.prefill(s, prompts[s], SamplingParams() if s % 2 else SamplingParams(0.8, 20, 0.9, s))
    for step in range(6):  # buckets 8 then 4 after releases; replays at growing cache lengths
        live = [0, 1, 2, 3, 4] if step < 3 else [0, 2, 4]
        if step == 3:
            for e in (cpu, gpu):
                e.release(1)
                e.release(3)
        rows = random_rows(rng, 512, live, {s: cpu.cache_len(s) for s in live}, 16)
        a, b = cpu.step(make_batch(live, rows)), gpu.step(make_batch(live, rows))
        if dtype == "float32":
            assert np.array_equal(a, b), step
        for s in live:
            cpu.commit(s, np.array([0]))
            gpu.commit(s, np.array([0]))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)
@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_quantized_checkpoint_on_cuda_answers_as_its_own_greedy(weights, compile):
    """--weights on CUDA: the torch executor with each weight dequantized inside kernels/invariant.py's product, or
    int4 ones on a GPU of compute capability 9.0+ inside kernels/quantized_words.py's (CUDA graphs, eager or
    compiled); lookahead and `auto` answer as the same quantized model's greedy, alone and batched, and the tuning
    key names the weights."""
    from concurrent.futures import ThreadPoolExecutor

    from trt_lookahead.backends.torch import words_layout_applies
    from trt_lookahead.model.llama import QuantizedLinear
    from trt_lookahead.runtime import LookaheadRuntime
    from trt_lookahead.runtime.load import loaded_tuning_key

    prompts = ["Once upon a time", "The little dog ran to the", "Lily and Ben went to the park"]
    with LookaheadRuntime.from_pretrained(STORIES, dtype="bfloat16", device="cuda", weights=weights,
                                          compile=compile) as rt:
        assert rt.model.backend == "torch" and loaded_tuning_key(rt.model).endswith(f"|weights={weights}")
        words = weights == "int4" and words_layout_applies(torch.device("cuda"), torch.bfloat16)
        layouts = {m.layout for m in rt.model.executor.model.modules() if isinstance(m, QuantizedLinear)}
        assert layouts == {"words" if words else "blocks"}
        greedy = [rt.generate(p, max_new_tokens=48, lookahead="greedy").token_ids for p in prompts]
        for config in (LookaheadConfig(4, 3, 4), "auto"):
            assert [rt.generate(p, max_new_tokens=48, lookahead=config).token_ids for p in prompts] == greedy
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(lambda p: rt.generate(p, max_new_tokens=48).token_ids, prompts)) == greedy


# -- the padded step's widths and commits ----------------------------------------------------------------------


def profiled(run: Callable[[], object]) -> list:
    """The torch.profiler events (names, input shapes) of the ops `run()` calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    return list(prof.events())


def linear_rows(ex: BatchedTorchExecutor, batch: StepBatch) -> set[int]:
    """The row counts (M) of the projections the step `batch` runs."""
    return {e.input_shapes[0][0] for e in profiled(lambda: ex.step(batch)) if "linear" in e.name and e.input_shapes}


def test_a_padded_step_runs_at_the_narrowest_width_that_holds_its_rows(model):
    """A greedy row on a padded executor built for 16-token rows runs its projections on 1 row, not 16; a lookahead
    row of 6 tokens on 8 (the widths are 1, 2, 4, .. step_tokens); a batch of two slots on bucket 2 x its width."""
    ex = BatchedTorchExecutor(model, 2, 64, 16, padded=True)
    assert ex.widths == [1, 2, 4, 8, 16]
    x = ex.prefill(0, PROMPT, SamplingParams())
    greedy = make_batch([0], [row((1, 2, 0), np.array([x]), np.array([len(PROMPT)]))])
    assert linear_rows(ex, greedy) == {1}
    layout = StepLayout(LookaheadConfig(2, 3, 1))
    ids = np.full(layout.step_tokens, x)
    lookahead = make_batch([0], [row((2, 3, 1), ids, len(PROMPT) + layout.rel_positions)])
    assert layout.step_tokens == 6 and linear_rows(ex, lookahead) == {8}
    ex.prefill(1, PROMPT[:5], SamplingParams())
    both = make_batch([0, 1], [row((2, 3, 1), ids, len(PROMPT) + layout.rel_positions),
                               row((1, 2, 0), np.array([x]), np.array([5]))])
    assert linear_rows(ex, both) == {16}


def commit_runs_no_torch_op(ex: BatchedTorchExecutor, slot: int, rows: np.ndarray) -> bool:
    return not [e.name for e in profiled(lambda: ex.commit(slot, rows)) if e.name.startswith("aten::")]


@pytest.mark.parametrize("then", ["step", "release another slot", "restart"])
def test_a_padded_commit_moves_its_rows_with_the_next_step(model, then):
    """The padded step's commit does no device work (its rows move inside the next step's staging, with that step's
    inputs in one copy); a slot's committed KV is then what an immediate move gives (the packed executor's), also
    when another slot's release moves this slot to another physical slot first, and a restart of the slot in place
    drops the moves it had not made yet."""
    layout = StepLayout(LookaheadConfig(3, 4, 2))
    T, draft = layout.step_tokens, layout.candidate_slots[1]
    executors = [BatchedTorchExecutor(model, 2, 96, T, padded=padded) for padded in (True, False)]
    for ex in executors:
        ex.prefill(0, PROMPT[:7], SamplingParams())
        x = ex.prefill(1, PROMPT, SamplingParams())
        ids = np.random.default_rng(3).integers(3, 512, T)
        ids[0] = x
        ex.step(make_batch([1], [row((3, 4, 2), ids, len(PROMPT) + layout.rel_positions)]))
        rows = np.array([0, *draft[:2]])  # accepted rows 0, draft[0], draft[1]: two move down
    padded, packed = executors
    assert commit_runs_no_torch_op(padded, 1, rows)
    packed.commit(1, rows)
    longer = np.concatenate([PROMPT, PROMPT[:8]])  # past the old cache_len: a stale move would land inside it
    for ex in executors:
        if then == "release another slot":
            ex.release(0)  # slot 1 moves into physical slot 0
        if then == "restart":
            ex.prefill(1, longer, SamplingParams())
        n = ex.cache_len(1)
        y = ex.step(make_batch([1], [row((1, 2, 0), np.array([5]), np.array([n]))]))[0, 0]
        ex.commit(1, np.array([0]))
        ex.last = y  # type: ignore[attr-defined]
    assert padded.last == packed.last  # type: ignore[attr-defined]
    for got, want in zip(padded.slot_kv(1), packed.slot_kv(1), strict=True):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    if then == "restart":
        fresh = BatchedTorchExecutor(model, 1, 96, T, padded=True)
        fresh.prefill(0, longer, SamplingParams())
        assert torch.allclose(padded.slot_kv(1)[0][:, : len(longer)], fresh.slot_kv(0)[0], atol=1e-5)


# -- the compiled padded step (compile=True) --------------------------------------------------------------------


def graph_counts() -> tuple[int, int]:
    """(graph breaks, graphs) torch._dynamo counted so far in this process."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def dense_models():
    """stories260K and the random GQA Llama in nn.Linear's dense layout (compile=True refuses oneDNN's packing)."""
    return {"stories260K": load_llama(STORIES, weight_layout="out_in")[0], "gqa": random_gqa("out_in")}


def lookahead_batches(ex: BatchedTorchExecutor, rng: np.random.Generator):
    """Prefill three slots, then -> a step of lookahead rows (linear, tree-free) and a causal chunk over them."""
    vocab = ex.vocab_size
    prompts = [rng.integers(3, vocab, n) for n in (16, 5, 9)]
    configs = [(4, 3, 4), (2, 2, 1), CAUSAL]
    rows = []
    for slot, (prompt, config) in enumerate(zip(prompts, configs, strict=True)):
        x = ex.prefill(slot, prompt, SamplingParams())
        if config == CAUSAL:
            ids, rel = np.concatenate([[x], rng.integers(3, vocab, 5)]), np.arange(6)
        else:
            layout = StepLayout(LookaheadConfig(*config))
            ids, rel = rng.integers(3, vocab, layout.step_tokens), layout.rel_positions
            ids[0] = x
        rows.append(row(config, ids, len(prompt) + rel))
    return make_batch([2, 0, 1], [rows[2], rows[0], rows[1]])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stories260K", "gqa"])
def test_the_compiled_step_is_one_graph_with_the_eager_steps_logits(dense_models, name, capfd):
    """compile=True: each bucket's step body is one graph (no graph break), compiled once and said once on stderr;
    its logits equal the eager padded step's to float32 rounding, its tokens equal them, steps after steps."""
    model = dense_models[name]
    breaks, graphs = graph_counts()
    compiled = BatchedTorchExecutor(model, 4, 64, 16, compile=True)
    eager = BatchedTorchExecutor(model, 4, 64, 16, padded=True)
    assert compiled.padded and compiled.compile and not compiled.exact
    for step in range(3):
        batches = [lookahead_batches(ex, np.random.default_rng(step)) for ex in (compiled, eager)]
        a, b = compiled.step_logits(batches[0]), eager.step_logits(batches[1])
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), step
        assert np.array_equal(compiled.step(batches[0]), eager.step(batches[1])), step
    assert graph_counts() == (breaks, graphs + 1)  # bucket 4: one graph, no break, never compiled again
    assert capfd.readouterr().err.count("trt-lookahead: compiling the step for batch bucket 4, width 16 (once)") == 1


@pytest.mark.slow
@pytest.mark.parametrize("config", [GREEDY, LookaheadConfig(4, 3, 4), LookaheadConfig(5, 4, 3)], ids=str)
def test_compiled_lookahead_is_greedy_on_stories260K(dense_models, config):
    """stories260K decoded through the compiled padded step emits exactly the eager packed step's greedy tokens."""
    model = dense_models["stories260K"]
    reference = greedy_decode(BatchedTorchExecutor(model, 1, 256, 1), 0, PROMPT, 80)
    ex = BatchedTorchExecutor(model, 2, 256, StepLayout(config).step_tokens, compile=True)
    assert LookaheadDecoder(ex, config).generate(PROMPT, 80).token_ids == reference


def test_a_step_without_top_ids_runs_no_top_k(model):
    """The padded step computes top-k ids only for a batch that asks for them (StepBatch.top_ids): no topk kernel
    runs otherwise (it used to run topk(k=0) every step)."""
    ex = BatchedTorchExecutor(model, 2, 64, 4, padded=True)
    x = ex.prefill(0, PROMPT, SamplingParams())
    batch = make_batch([0], [row((1, 2, 0), np.array([x]), np.array([len(PROMPT)]))])

    def ops(batch: StepBatch) -> set[str]:
        return {event.name for event in profiled(lambda: ex.step(batch))}

    assert "aten::topk" not in ops(batch)
    batch.top_ids = np.full((1, 1, 3), -1, np.int64)
    assert "aten::topk" in ops(batch) and batch.top_ids[0, 0, 0] == ex.step(batch)[0, 0]


def test_compile_refuses_what_it_cannot_compile(model, dense_models):
    """compile=True: the padded step (its default) and dense weights; each refusal says what to change."""
    with pytest.raises(ValueError, match="use padded=True"):
        BatchedTorchExecutor(dense_models["gqa"], 1, 16, 4, padded=False, compile=True)
    if model.weight_layout == "onednn":
        with pytest.raises(ValueError, match="set_weight_layout\\('out_in'\\)"):
            BatchedTorchExecutor(model, 1, 16, 4, compile=True)
    ex = BatchedTorchExecutor(dense_models["gqa"], 1, 16, 4, compile=True)  # nothing compiles before a step
    assert ex.padded and not ex.exact
