"""TorchExecutor: the executor contract on stories260K (greedy parity, masked steps, commit, sampling)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from trt_lookahead.backends.devices import gpu_count
from trt_lookahead.backends.torch import TorchExecutor
from trt_lookahead.kernels.sampling_torch import select_tokens_torch
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import Executor
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams, select_tokens
from trt_lookahead.model.checkpoint import load_llama
from trt_lookahead.model.llama import onednn_linear_available

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
GREEDY_MASK = np.ones((1, 1), bool)
PROMPT = np.array([1, 403, 407, 261, 378, 505, 263, 260, 345, 411, 280, 306, 263, 417, 300, 45])


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


def greedy_decode(ex: TorchExecutor, prompt, n: int) -> list[int]:
    x = ex.prefill(np.asarray(prompt))
    out = [x]
    for _ in range(n - 1):
        p = ex.cache_len
        x = int(ex.step(np.array([x]), np.array([p]))[0])
        ex.commit(np.array([0]))
        out.append(x)
    return out


def test_executor_satisfies_the_contract(model):
    ex = TorchExecutor(model, GREEDY_MASK, 64)
    for name in ("vocab_size", "max_seq_len", "step_tokens", "reset", "prefill", "step", "commit"):
        assert hasattr(Executor, name) or name in Executor.__annotations__
        assert hasattr(ex, name), name
    assert (ex.vocab_size, ex.max_seq_len, ex.step_tokens) == (512, 64, 1)
    assert ex.k_cache.shape == (5, 65, 4, 8)


@pytest.mark.parametrize("layout", ["auto", "onednn"])
@pytest.mark.parametrize("prompt", [[1], PROMPT.tolist()])
def test_greedy_t1_reproduces_transformers_generate(model, prompt, layout):
    if layout == "onednn":
        if not onednn_linear_available():
            pytest.skip("this torch has no oneDNN packed linear (non-x86 build)")
        model = load_llama(STORIES, weight_layout="onednn")[0]
    n = 256 if len(prompt) == 1 else 120
    hf = LlamaForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    ref = hf.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    ex = TorchExecutor(model, GREEDY_MASK, 512)
    assert greedy_decode(ex, prompt, n) == ref
    ex.reset(SamplingParams())  # same buffers, a new request
    assert greedy_decode(ex, prompt, 20) == ref[:20]


_SEQUENTIAL: dict[tuple[int, ...], int] = {}


def sequential_argmax(model, prefix: list[int]) -> int:
    """Greedy next token after `prefix`, by prefilling it (memoized: the same prefixes recur)."""
    key = tuple(prefix)
    if key not in _SEQUENTIAL:
        _SEQUENTIAL[key] = TorchExecutor(model, GREEDY_MASK, 512).prefill(np.array(prefix))
    return _SEQUENTIAL[key]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_lookahead_step_matches_each_slots_sequential_prefix(model, static):
    layout = StepLayout(LookaheadConfig(4, 3, 4))
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 512, layout.step_tokens)
    P = len(PROMPT)
    ex = TorchExecutor(model, layout.mask, 128, static_attention=static)
    ids[0] = ex.prefill(PROMPT)
    out = ex.step(ids, P + layout.rel_positions)
    assert out.shape == (layout.step_tokens,) and out.dtype == np.int64
    for i in range(layout.step_tokens):
        visible = np.flatnonzero(layout.mask[i])
        visible = visible[np.argsort(layout.rel_positions[visible], kind="stable")]
        assert layout.rel_positions[visible].tolist() == list(range(layout.rel_positions[i] + 1))
        assert out[i] == sequential_argmax(model, [*PROMPT.tolist(), *ids[visible].tolist()]), f"slot {i}"

    # output_slots: the same ids there, -1 elsewhere
    only = TorchExecutor(model, layout.mask, 128, output_slots=layout.output_slots, static_attention=static)
    only.prefill(PROMPT)
    part = only.step(ids, P + layout.rel_positions)
    assert np.array_equal(part[layout.output_slots], out[layout.output_slots])
    others = np.setdiff1d(np.arange(layout.step_tokens), layout.output_slots)
    assert len(others) and (part[others] == -1).all()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_commit_keeps_the_accepted_rows(model, static):
    """Speculate the true greedy continuation in a candidate row; commit moves its KV; decoding goes on exactly."""
    cfg = LookaheadConfig(3, 4, 2)
    layout = StepLayout(cfg)
    reference = greedy_decode(TorchExecutor(model, GREEDY_MASK, 512), PROMPT, 80)
    ex = TorchExecutor(model, layout.mask, 256, output_slots=layout.output_slots, static_attention=static)
    x = ex.prefill(PROMPT)
    produced, rng, steps = [x], np.random.default_rng(1), 0
    while len(produced) < len(reference):
        p = ex.cache_len
        ids = rng.integers(3, 512, layout.step_tokens)
        ids[0] = x
        k_row = steps % cfg.G  # the right draft sits in a varying candidate row
        truth = reference[len(produced) : len(produced) + cfg.N - 1]
        accept = min(len(truth), 1 + steps % (cfg.N - 1))  # accept 1..N-1 drafted tokens
        draft = layout.candidate_slots[k_row]
        ids[draft[: len(truth)]] = truth
        out = ex.step(ids, p + layout.rel_positions)
        assert out[0] == truth[0]
        assert list(out[draft[: accept - 1]]) == truth[1:accept]
        bonus = int(out[draft[accept - 1]])
        ex.commit(np.concatenate(([0], draft[:accept])))
        assert ex.cache_len == p + 1 + accept
        produced += [*truth[:accept], bonus]
        x, steps = bonus, steps + 1
    assert produced[: len(reference)] == reference

    # the committed KV rows equal a fresh prefill of the same sequence
    n = ex.cache_len
    fresh = TorchExecutor(model, GREEDY_MASK, 256)
    fresh.prefill(np.array([*PROMPT.tolist(), *produced])[:n])
    assert torch.allclose(ex.k_cache[:, :n], fresh.k_cache[:, :n], atol=1e-5)
    assert torch.allclose(ex.v_cache[:, :n], fresh.v_cache[:, :n], atol=1e-5)


def test_static_and_dynamic_greedy_agree(model):
    a = greedy_decode(TorchExecutor(model, GREEDY_MASK, 256), PROMPT, 60)
    b = greedy_decode(TorchExecutor(model, GREEDY_MASK, 256, static_attention=True), PROMPT, 60)
    assert a == b


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


def test_seeded_sampling_in_the_executor_equals_numpy_reference(model):
    """T=1 sampling through the executor == numpy select_tokens on the model's logits, keyed by position."""
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11)
    ex = TorchExecutor(model, GREEDY_MASK, 256)
    ex.reset(params)
    x = ex.prefill(PROMPT)
    tokens = [*PROMPT.tolist(), x]
    ref_ex = TorchExecutor(model, GREEDY_MASK, 256)
    for _ in range(30):
        p = ex.cache_len
        x = int(ex.step(np.array([x]), np.array([p]))[0])
        ex.commit(np.array([0]))
        with torch.inference_mode():
            k, v = ref_ex.k_cache, ref_ex.v_cache
            ids = torch.tensor(tokens)
            logits = model(
                ids, torch.arange(len(ids)), k, v, torch.tensor(0), torch.ones(len(ids), len(ids)).tril().bool()
            )
        expect = select_tokens(logits[-1:].double().numpy(), np.array([len(tokens) - 1]), params)[0]
        assert x == expect
        tokens.append(x)
    ex.reset(params)  # the same seed replays the same draws
    again = [ex.prefill(PROMPT)]
    for _ in range(30):
        again.append(int(ex.step(np.array([again[-1]]), np.array([ex.cache_len]))[0]))
        ex.commit(np.array([0]))
    assert again == tokens[len(PROMPT) :]


def test_sampled_lookahead_step_equals_sampled_sequential(model):
    """With seeded sampling, each slot's draw equals the T=1 draw on its visible prefix (position-keyed noise)."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    layout = StepLayout(LookaheadConfig(3, 3, 2))
    ids = np.random.default_rng(2).integers(3, 512, layout.step_tokens)
    ex = TorchExecutor(model, layout.mask, 128)
    ex.reset(params)
    ids[0] = ex.prefill(PROMPT)
    out = ex.step(ids, len(PROMPT) + layout.rel_positions)
    seq = TorchExecutor(model, GREEDY_MASK, 128)
    seq.reset(params)
    for i in range(layout.step_tokens):
        visible = np.flatnonzero(layout.mask[i])
        visible = visible[np.argsort(layout.rel_positions[visible], kind="stable")]
        assert out[i] == seq.prefill(np.array([*PROMPT.tolist(), *ids[visible].tolist()])), f"slot {i}"


# -- dtypes, errors, GPU ----------------------------------------------------------------------------


def test_bfloat16_executor_runs_and_mostly_agrees(model):
    ref = greedy_decode(TorchExecutor(model, GREEDY_MASK, 256), PROMPT, 40)
    bf16, _ = load_llama(STORIES, dtype="bfloat16")
    ex = TorchExecutor(bf16, GREEDY_MASK, 256)
    assert ex.k_cache.dtype == torch.bfloat16
    got = greedy_decode(ex, PROMPT, 40)
    assert all(0 <= t < 512 for t in got)
    assert got[:3] == ref[:3]  # the first tokens are far from ties; the rest is reported by the bench
    layout = StepLayout(LookaheadConfig(4, 3, 4))
    la = TorchExecutor(bf16, layout.mask, 256, output_slots=layout.output_slots)
    ids = np.full(layout.step_tokens, 5)
    ids[0] = la.prefill(PROMPT)
    out = la.step(ids, len(PROMPT) + layout.rel_positions)
    assert (out[layout.output_slots] >= 0).all()


def test_contract_errors(model):
    with pytest.raises(ValueError, match="square"):
        TorchExecutor(model, np.ones((2, 3), bool), 16)
    with pytest.raises(ValueError, match="output_slots"):
        TorchExecutor(model, np.eye(2, dtype=bool), 16, output_slots=np.array([2]))
    ex = TorchExecutor(model, np.eye(2, dtype=bool), 16)
    with pytest.raises(ValueError, match="does not fit"):
        ex.prefill(np.ones(17, np.int64))
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        ex.prefill(np.array([1, 512]))
    ex.prefill(np.ones(15, np.int64))
    ex.step(np.array([1, 2]), np.array([15, 16]))
    with pytest.raises(ValueError, match="overflows"):
        ex.commit(np.array([0, 1]))
    with pytest.raises(ValueError, match="slots must lie"):
        ex.commit(np.array([2]))
    ex.commit(np.array([1]))
    assert ex.cache_len == 16
    with pytest.raises(ValueError, match="is on"):
        TorchExecutor(model, GREEDY_MASK, 16, device="meta")


CUDA_OK, CUDA_REASON = has_cuda_device()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_executor_matches_cpu(dtype):
    cpu_model, _ = load_llama(STORIES, dtype=dtype)
    gpu_model, _ = load_llama(STORIES, dtype=dtype, device="cuda")
    ref = greedy_decode(TorchExecutor(cpu_model, GREEDY_MASK, 256), PROMPT, 60)
    ex = TorchExecutor(gpu_model, GREEDY_MASK, 256, device="cuda")
    assert ex.cuda_graph and ex.static_attention
    got = greedy_decode(ex, PROMPT, 60)
    if dtype == "float32":
        assert got == ref
    else:
        assert got[:3] == ref[:3]
    layout = StepLayout(LookaheadConfig(4, 3, 4))
    ids = np.random.default_rng(0).integers(3, 512, layout.step_tokens)
    outs = []
    for m, device in ((cpu_model, "cpu"), (gpu_model, "cuda")):
        ex = TorchExecutor(m, layout.mask, 256, output_slots=layout.output_slots, device=device)
        ids[0] = ex.prefill(PROMPT)
        for _ in range(3):  # replays of the captured graph at growing p
            out = ex.step(ids, ex.cache_len + layout.rel_positions)
            ex.commit(np.array([0, 5]))
        outs.append(out)
    if dtype == "float32":
        assert np.array_equal(outs[0], outs[1])
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1)
    draws = []
    for m, device in ((cpu_model, "cpu"), (gpu_model, "cuda")):
        ex = TorchExecutor(m, GREEDY_MASK, 256, device=device)
        ex.reset(params)
        draws.append(greedy_decode(ex, PROMPT, 20))
    if dtype == "float32":
        assert draws[0] == draws[1]
