"""Exact by construction: a slot's logits are bit-identical (==) whatever else shares its step.

For random states (prompt, lookahead config, step tokens), every slot of a T-token lookahead step run by
the CPU executor's exact path gives, to the bit, the logits that plain decoding gives at that slot's
context (1-token steps feeding the slot's chain of visible step tokens in position order), and the same
logits again when the step is batched with random companions (other requests, other configs, other
cache lengths, any row order). float32 and bfloat16, on stories260K and on a random-weight Llama with
grouped-query attention. docs/design.md section 4.2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from trt_lookahead.backends.devices import gpu_count
from trt_lookahead.backends.row_probe import (
    projection_max_rows,
    projection_rows_differ,
    row_invariant_ops,
    step_variance,
)
from trt_lookahead.backends.torch import BatchedTorchExecutor
from trt_lookahead.engine.quantize import quantize_model
from trt_lookahead.kernels.reference import KEY_BLOCK
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.model.checkpoint import load_llama
from trt_lookahead.model.llama import Linear, Llama, ModelConfig, Ops, apply_rope

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
CONFIGS = [LookaheadConfig(4, 3, 4), LookaheadConfig(2, 4, 3), LookaheadConfig(5, 2, 3), LookaheadConfig(3, 3, 0)]
STEP_TOKENS = 16
DTYPE_SEEDS = [(torch.float32, 0), (torch.bfloat16, 1), (torch.float32, 1), (torch.bfloat16, 0)]
TINY_GQA = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
GREEDY_STEP = LookaheadConfig.greedy()

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # 1 thread for speed; 2 threads pass too (measured)


def random_gqa_llama(dtype: torch.dtype, layout: str = "auto", **shape: int) -> Llama:
    """A Llama with random weights: 8 query heads over 2 KV heads (or `shape`), untied head, norms away from 1."""
    dims = dict(hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=256,
                vocab_size=300, max_position_embeddings=1024)
    cfg = ModelConfig(**(dims | shape))
    torch.manual_seed(0)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.to(dtype).eval().requires_grad_(False).set_weight_layout(layout)


@pytest.fixture(scope="module", params=["stories260K", "random-gqa", "random-gqa-wide"])
def models(request) -> dict[torch.dtype, Llama]:
    """The model in float32 and bfloat16, projections in the runtime's layout ('auto'). random-gqa-wide has
    SmolLM2-135M's 1536-wide down projection: oneDNN reduces a 1-row input that wide in another order."""
    if request.param == "stories260K":
        return {dtype: load_llama(STORIES, dtype=dtype, weight_layout="auto")[0]
                for dtype in (torch.float32, torch.bfloat16)}
    wide = dict(intermediate_size=1536) if request.param == "random-gqa-wide" else {}
    return {dtype: random_gqa_llama(dtype, **wide) for dtype in (torch.float32, torch.bfloat16)}


def batch(rows: list[tuple[int, LookaheadConfig, np.ndarray, int]]) -> StepBatch:
    """A step of rows (slot, config, step ids, cache_len), every real slot an output slot."""
    T = max(len(ids) for _, _, ids, _ in rows)
    K = T
    input_ids = np.zeros((len(rows), T), np.int64)
    positions = np.zeros((len(rows), T), np.int64)
    outputs = np.zeros((len(rows), K), np.int64)
    for b, (_, config, ids, cache_len) in enumerate(rows):
        layout = StepLayout(config)
        t = layout.step_tokens
        input_ids[b, :t] = ids
        positions[b] = cache_len
        positions[b, :t] = cache_len + layout.rel_positions
        outputs[b] = np.minimum(np.arange(K), t - 1)
    configs = np.array([(c.W, c.N, c.G) for _, c, _, _ in rows], np.int32)
    return StepBatch(np.array([r[0] for r in rows], np.int64), input_ids, positions, configs, outputs)


def chain(layout: StepLayout, slot: int) -> np.ndarray:
    """The step slots `slot` sees, in position order (its own last)."""
    seen = np.flatnonzero(layout.mask[slot])
    return seen[np.argsort(layout.rel_positions[seen])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("seed", range(3))
def test_a_slots_logits_are_bit_identical_alone_batched_and_in_plain_decoding(models, dtype, seed):
    assert_slot_bits(BatchedTorchExecutor(invariant_here(models[dtype]), 4, 300, STEP_TOKENS, exact=True), seed)


def invariant_here(model: Llama) -> Llama:
    """The model, or a skip naming the projection where this CPU and torch give a row other bits by row count
    (the executor refuses exact=True there: test_exact_is_on_by_default_...)."""
    if reason := step_variance(model):
        pytest.skip(reason)
    return model


PADDED_CASES = [  # (model, dtype, seed): interpreted, a tiny-gqa case takes ~3 min (slow); the rest need a GPU
    *(pytest.param("tiny-gqa", dtype, seed, marks=pytest.mark.slow) for dtype, seed in DTYPE_SEEDS[:2]),
    *((name, dtype, seed) for name in ("random-gqa", "stories260K") for dtype, seed in DTYPE_SEEDS),
]


@pytest.mark.parametrize("name,dtype,seed", PADDED_CASES)
def test_the_padded_exact_step_gives_a_slot_the_same_bits_too(name, dtype, seed, interpreted_float32_dot):
    """The padded (CUDA) step's exact path, kernels/invariant.py: compiled on a GPU; interpreted without one,
    where a program per query and head runs ~1 ms a key block, so only on a one-layer model of two heads."""
    interpreted_float32_dot(dtype)
    device = "cuda" if gpu_count() else "cpu"
    if device == "cpu" and name != "tiny-gqa":
        pytest.skip("interpreted Triton: the one-layer model only (the others run where a GPU is, gpu_check)")
    if name == "stories260K":
        model = load_llama(STORIES, dtype=dtype)[0]
    else:
        model = random_gqa_llama(dtype, "out_in", **(TINY_GQA if name == "tiny-gqa" else {}))
    ex = BatchedTorchExecutor(model.to(device), 4, 300, STEP_TOKENS, device, padded=True, cuda_graph=False,
                              exact=True)
    assert_slot_bits(ex, seed)


QUANTIZED_CASES = [  # (model, scheme, dtype, seed): interpreted, the tiny-gqa int4 cases (slow); the rest need a GPU
    pytest.param("tiny-gqa", "int4", torch.bfloat16, 1, marks=pytest.mark.slow),
    pytest.param("tiny-gqa", "int4-words", torch.bfloat16, 1, marks=pytest.mark.slow),  # QuantizedLinear's layout
    *(("stories260K", scheme, dtype, seed) for scheme in ("int4", "int8") for dtype, seed in DTYPE_SEEDS[:2]),
]


@pytest.mark.parametrize("name,scheme,dtype,seed", QUANTIZED_CASES)
def test_the_padded_step_on_quantized_weights_gives_a_slot_the_same_bits(name, scheme, dtype, seed,
                                                                        interpreted_float32_dot):
    """Quantized weights (engine/quantize.py `quantize_model`), each dequantized inside kernels/invariant.py's
    product (or, in the words layout, kernels/quantized_words.py's; an executor on a GPU that runs it chooses that
    layout for int4 weights itself): the exact padded step keeps a slot's bits alone, batched and in plain
    decoding."""
    scheme, _, layout = scheme.partition("-")
    interpreted_float32_dot(torch.float32 if layout else dtype)  # the words product is interpreted in float32
    device = "cuda" if gpu_count() else "cpu"
    if device == "cpu" and name != "tiny-gqa":
        pytest.skip("interpreted Triton: the one-layer model only (the others run where a GPU is, gpu_check)")
    model = load_llama(STORIES)[0] if name == "stories260K" else random_gqa_llama(torch.float32, "out_in", **TINY_GQA)
    quantize_model(model, scheme, dtype)
    if layout:
        model.set_quantized_layout(layout)
    ex = BatchedTorchExecutor(model.to(device), 4, 300, STEP_TOKENS, device, padded=True, cuda_graph=False,
                              exact=True)
    assert_slot_bits(ex, seed)


def assert_slot_bits(ex: BatchedTorchExecutor, seed: int) -> None:
    """A random lookahead step's slots: the same bits batched with random companions as alone, and as the
    1-token steps of plain decoding feeding each slot's context."""
    vocab = ex.vocab_size
    rng = np.random.default_rng(seed)
    config = CONFIGS[seed % len(CONFIGS)]
    layout = StepLayout(config)
    T = layout.step_tokens
    # prompts ending just before, on and after a key-block boundary, so branches cross one
    P = int(rng.choice([KEY_BLOCK - 3, KEY_BLOCK, 2 * KEY_BLOCK + 1, int(rng.integers(5, 200))]))
    prompt = rng.integers(3, vocab, P)
    greedy = SamplingParams()
    ex.prefill(0, prompt, greedy)
    ids = rng.integers(3, vocab, T)
    alone = ex.step_logits(batch([(0, config, ids, P)]))[0, :T]  # [T, vocab]

    companions = []
    for slot in (1, 2):  # other requests: other prompts, configs and cache lengths
        other = CONFIGS[int(rng.integers(len(CONFIGS)))] if slot == 1 else GREEDY_STEP
        p = int(rng.integers(1, 200))
        ex.prefill(slot, rng.integers(3, vocab, p), greedy)
        companions.append((slot, other, rng.integers(3, vocab, StepLayout(other).step_tokens), p))
    rows = [(0, config, ids, P), *companions]
    order = rng.permutation(len(rows))
    together = ex.step_logits(batch([rows[i] for i in order]))
    row = int(np.flatnonzero(order == 0)[0])
    assert torch.equal(together[row, :T], alone), "batched with companions != alone"

    for slot in range(T):  # plain decoding of the slot's context, one token per step, each kept
        ex.prefill(3, prompt, greedy)
        for n, j in enumerate(chain(layout, slot)):
            logits = ex.step_logits(batch([(3, GREEDY_STEP, ids[j : j + 1], P + n)]))[0, 0]
            ex.commit(3, np.array([0]))
        assert torch.equal(logits, alone[slot]), (
            f"slot {slot} of {config}: max |diff| {(logits - alone[slot]).abs().max().item():.3g}"
        )


def test_exact_needs_row_invariant_projections():
    """float32 nn.Linear (MKL sgemm) is not row-invariant: the default turns exact off, asking for it fails."""
    model = load_llama(STORIES)[0]  # 'out_in'
    assert not BatchedTorchExecutor(model, 1, 64, 4).exact
    with pytest.raises(ValueError, match="weight_layout='auto'"):
        BatchedTorchExecutor(model, 1, 64, 4, exact=True)
    model.set_weight_layout("auto")
    assert BatchedTorchExecutor(invariant_here(model), 1, 64, 4, exact=True).exact
    assert not BatchedTorchExecutor(model, 1, 64, 4, exact=False).exact


def test_exact_is_on_by_default_where_it_is_cheap_and_the_projections_are_row_invariant(models):
    """On by default in bfloat16 (where it is cheap, docs/design.md section 4.2), asked for in float32; off by
    default, and refused when asked for, where a probe finds a row count that changes a row's bits."""
    for dtype, model in models.items():
        reason = step_variance(model)
        assert BatchedTorchExecutor(model, 1, 64, 4).exact == (dtype == torch.bfloat16 and reason is None)
        if reason is None:
            assert BatchedTorchExecutor(model, 1, 64, 4, exact=True).exact
        else:
            with pytest.raises(ValueError, match=r"needs row-invariant attention products, and .* rows"):
                BatchedTorchExecutor(model, 1, 64, 4, exact=True)


def test_the_padded_step_is_exact_by_default_in_bfloat16_on_cuda_only():
    """The padded step's Triton kernels: by default on CUDA in bfloat16 (docs/design.md section 4.2; cost:
    docs/results/2026-11-27-h200.md); never by default on the CPU, where they run interpreted (tests only);
    asked for, they run."""
    on_gpu = bool(gpu_count())
    device = "cuda" if on_gpu else "cpu"
    for dtype in (torch.float32, torch.bfloat16):
        model = random_gqa_llama(dtype, "out_in", **TINY_GQA).to(device)
        assert BatchedTorchExecutor(model, 1, 64, 4, device, padded=True, cuda_graph=False).exact == (
            on_gpu and dtype == torch.bfloat16)
        assert BatchedTorchExecutor(model, 1, 64, 4, device, padded=True, cuda_graph=False, exact=True).exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_row_probe_sees_whether_1_row_rounds_otherwise_even_where_few_rows_show_it(dtype):
    """A 1536-wide down projection: oneDNN reduces a 1-row input in another order, which in bfloat16 changes
    only some rows' bits. The probe's answer for 1 row must be what 256 random rows, alone and in pairs, say."""
    w2 = random_gqa_llama(dtype, "auto", intermediate_size=1536).layers[0].feed_forward.w2
    x = torch.randn(256, w2.in_features, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([w2(x[i : i + 1]) for i in range(256)])
        pairs = torch.cat([w2(x[i : i + 2]) for i in range(0, 256, 2)])
    assert (1 in projection_rows_differ(w2)) == (not torch.equal(alone, pairs))


def test_the_exact_step_calls_a_gemm_whose_rows_vary_with_the_row_count_below_the_count_that_varies():
    """MKL sgemm's float32 F.linear (nn.Linear's layout) reduces a row otherwise at some row counts (1, and 4 or
    6 on; measured on an AMD EPYC and an Intel Xeon): the probe must see it, and the exact step's calls of it
    stay below that count, so a row of any call gets the bits it gets alone."""
    model = random_gqa_llama(torch.float32, "out_in")
    wqkv, ops = model.layers[0].attention.wqkv, row_invariant_ops(model)
    varies = [M for M in projection_rows_differ(wqkv) if M > 1]
    assert varies and projection_max_rows(wqkv) < varies[0]
    x = torch.randn(130, wqkv.in_features, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        alone = torch.cat([ops.project(wqkv, x[i : i + 1]) for i in range(130)])
        assert not torch.equal(wqkv(x), alone)  # the plain call rounds some row otherwise
        for M in (2, 3, 4, 7, 16, 57, 130):
            assert torch.equal(torch.cat([ops.project(wqkv, x[i : i + M]) for i in range(0, 130, M)]), alone), M


def test_the_exact_ops_feed_a_projection_at_most_its_row_limit_and_1_row_as_2():
    """Ops.project's two guards, seen through its linear seam: calls never exceed max_rows, a lone row runs as 2
    (the second zeros), and the rows come back in order. float64 integers, so any order sums exactly."""
    proj = Linear(6, 4, bias=False, dtype=torch.float64)
    with torch.no_grad():
        proj.weight.copy_(torch.arange(24, dtype=torch.float64).reshape(4, 6) % 7 - 3)
    calls: list[int] = []

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, w, b)

    ops = Ops(linear=linear, one_row_as_two=frozenset({proj}), max_rows={proj: 5})
    x = torch.arange(66, dtype=torch.float64).reshape(11, 6) % 5 - 2
    assert torch.equal(ops.project(proj, x), x @ proj.weight.t()) and calls == [5, 5, 2]
    calls.clear()
    assert torch.equal(ops.project(proj, x[:4]), x[:4] @ proj.weight.t()) and calls == [4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_per_row_ops_give_a_row_the_same_bits_in_any_call(models, dtype):
    """RMSNorm, RoPE, SwiGLU and the projections as the exact step runs them (the row-invariant layout,
    row_invariant_ops): row r of an M-row call == r alone."""
    model = invariant_here(models[dtype])
    cfg, block, exact_ops = model.cfg, model.layers[0], row_invariant_ops(model)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((130, cfg.hidden_size))).to(dtype)
    cos, sin = model.rope(torch.from_numpy(rng.integers(0, 500, 130)))
    heads = torch.from_numpy(rng.standard_normal((130, cfg.num_heads, cfg.head_dim))).to(dtype)
    ops = {
        "rms_norm": lambda r: block.attention_norm(x[r]),
        "rope": lambda r: apply_rope(heads[r], cos[r], sin[r]),
        "feed_forward": lambda r: block.feed_forward(x[r], exact_ops),
        "wqkv": lambda r: exact_ops.project(block.attention.wqkv, x[r]),
        "lm_head": lambda r: exact_ops.project(model.output, x[r]),
    }
    with torch.inference_mode():
        for name, op in ops.items():
            alone = torch.cat([op(slice(r, r + 1)) for r in range(130)])  # every row: a few rows show another order
            for M in (2, 3, 4, 7, 16, 33, 57, 64, 100, 130):  # around the blockings GEMMs switch at
                together = torch.cat([op(slice(r, r + M)) for r in range(0, 130 - M + 1, M)])
                assert torch.equal(together, alone[: len(together)]), (name, M)


PREFILL_CHUNKS = (1, 7, STEP_TOKENS)  # causal rows of chunked prefill (runtime/scheduler.py), the last one T


def feed_whole(ex: BatchedTorchExecutor, slot: int, prompt: np.ndarray) -> torch.Tensor:
    """The prompt in one `prefill` call -> its last token's logits [vocab]."""
    return ex.prefill_logits(slot, prompt, SamplingParams())[0]


def feed_chunks(ex: BatchedTorchExecutor, slot: int, prompt: np.ndarray, chunk: int) -> torch.Tensor:
    """The prompt as causal step rows of `chunk` tokens after `claim`, each committed (chunked prefill)."""
    ex.claim(slot, SamplingParams())
    for start in range(0, len(prompt), chunk):
        ids = prompt[start : start + chunk]
        c = len(ids)
        logits = ex.step_logits(StepBatch(np.array([slot]), ids[None], start + np.arange(c)[None],
                                          np.zeros((1, 3), np.int32), np.array([[c - 1]])))[0, 0]
        ex.commit(slot, np.arange(c))
    return logits


def feed_steps(ex: BatchedTorchExecutor, slot: int, prompt: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """A prefix prefilled, then the rest as accepted steps: 4/3/4 steps whose second candidate branch holds the
    prompt's next two tokens (accepted, so the commit moves their rows down), then greedy 1-token steps."""
    config = LookaheadConfig(4, 3, 4)
    layout = StepLayout(config)
    branch = layout.candidate_slots[1]
    P, m = len(prompt), len(prompt) - 9
    ex.prefill(slot, prompt[:m], SamplingParams())
    while m + len(branch) < P - 3:
        ids = rng.integers(3, ex.vocab_size, layout.step_tokens)
        ids[0], ids[branch] = prompt[m], prompt[m + 1 : m + 1 + len(branch)]
        logits = ex.step_logits(batch([(slot, config, ids, m)]))[0, branch[-1]]
        ex.commit(slot, np.array([0, *branch]))
        m += 1 + len(branch)
    for n in range(m, P):
        logits = ex.step_logits(batch([(slot, GREEDY_STEP, prompt[n : n + 1], n)]))[0, 0]
        ex.commit(slot, np.array([0]))
    return logits




def assert_prefill_bits(ex: BatchedTorchExecutor, P: int, seed: int) -> None:
    """A P-token prompt fed whole, in causal chunks of PREFILL_CHUNKS and as prefix + accepted steps: the same
    last-token logits (the first token's) and the same KV bits, each way."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, ex.vocab_size, P)
    feeds = {"whole": lambda slot: feed_whole(ex, slot, prompt),
             **{f"chunks of {c}": lambda slot, c=c: feed_chunks(ex, slot, prompt, c) for c in PREFILL_CHUNKS},
             "prefix + accepted steps": lambda slot: feed_steps(ex, slot, prompt, rng)}
    results = {name: (feed(slot), *ex.slot_kv(slot)) for slot, (name, feed) in enumerate(feeds.items())}
    logits, k, v = results.pop("whole")
    assert int(torch.argmax(logits)) == ex.prefill(len(feeds), prompt, SamplingParams())
    for name, (other_logits, other_k, other_v) in results.items():
        assert torch.equal(other_logits, logits), (
            f"{name}: first token's logits differ from whole prefill's by up to "
            f"{(other_logits.float() - logits.float()).abs().max().item():.3g}")
        assert torch.equal(other_k, k) and torch.equal(other_v, v), f"{name}: KV differs from whole prefill's"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_prompts_first_token_and_kv_do_not_depend_on_how_it_was_fed(models, dtype):
    """Exact prefill runs the steps' row-invariant attention and projections: a prompt prefilled whole (longer
    than EXACT_PREFILL_CHUNK, across key blocks), in chunks of 1, 7 and T, or as a prefix and accepted steps
    leaves the same KV bits and gives the same first-token logits (issue 46: SDPA prefill differed)."""
    ex = BatchedTorchExecutor(invariant_here(models[dtype]), 6, 300, STEP_TOKENS, exact=True)
    for seed, P in enumerate((2 * KEY_BLOCK + 9, KEY_BLOCK - 1)):
        assert_prefill_bits(ex, P, seed)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_padded_exact_prefill_runs_the_steps_kernels(dtype):
    """The padded (CUDA) executor's exact prefill runs the exact step's Triton kernels on the slot's own rows. On a
    GPU: the same bits however the prompt was fed. On the CPU the kernels run interpreted, whose numpy dot rounds
    by tile shape (docs/design.md 4.2), so there it must run, leave the prompt's KV and agree closely."""
    on_gpu = bool(gpu_count())
    device = "cuda" if on_gpu else "cpu"
    model = random_gqa_llama(dtype, "out_in", **TINY_GQA).to(device)
    ex = BatchedTorchExecutor(model, 6, 80, 16, device, padded=True, cuda_graph=False, exact=True)
    assert ex.exact
    if on_gpu:
        assert_prefill_bits(ex, 40, 0)
        return
    prompt = np.random.default_rng(0).integers(3, ex.vocab_size, 40)
    whole, chunked = feed_whole(ex, 0, prompt), feed_chunks(ex, 1, prompt, 7)
    assert ex.cache_len(0) == ex.cache_len(1) == 40
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(whole.float().cpu(), chunked.float().cpu(), atol=tolerance)
    (k0, v0), (k1, v1) = ex.slot_kv(0), ex.slot_kv(1)
    assert torch.allclose(k0.float(), k1.float(), atol=tolerance) and torch.allclose(v0.float(), v1.float(),
                                                                                       atol=tolerance)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,seed", DTYPE_SEEDS[:2])
def test_the_compiled_padded_exact_step_gives_a_slot_the_same_bits(dtype, seed, interpreted_float32_dot):
    """compile=True on the exact step: a slot's bits alone, batched and in plain decoding, compiled 1-token and
    T-token steps against each other (the prompts prefilled through the compiled step too). On a GPU only: without
    one the padded exact step runs interpreted Triton, over ten minutes for this test (gpu_check runs it)."""
    if not gpu_count():
        pytest.skip("the compiled padded exact step runs interpreted Triton without a GPU (over ten minutes)")
    interpreted_float32_dot(dtype)
    device = "cuda"
    model = random_gqa_llama(dtype, "out_in", **({} if device == "cuda" else TINY_GQA))
    ex = BatchedTorchExecutor(model.to(device), 4, 300, STEP_TOKENS, device, padded=True, cuda_graph=False,
                              exact=True, compile=True)
    assert ex.exact and ex.compile
    assert_slot_bits(ex, seed)
