"""The exact engine step (docs/design.md section 4.2) through the onnxruntime executor on stories260K: every
output slot of a lookahead step has the logits, bit for bit (==), of the 1-token greedy step at the same
context, alone and beside companion rows of other configs and cache lengths, whether the attention runs as the
exact standard-op decomposition or as the native kernel (which makes the fast engine exact too); the fast
decomposition does not. The same holds for an exact engine of int4 weights multiplying int8 activations (design
6.9: no product has one row).
"""

from pathlib import Path

import numpy as np
import pytest

from trt_lookahead.backends.onnxruntime import SessionSettings
from trt_lookahead.backends.open import open_engine
from trt_lookahead.cli import main
from trt_lookahead.engine.format import load_engine_config
from trt_lookahead.kernels.mask import CAUSAL
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.lookahead.tree import TreeTemplate

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
MAX_SEQ_LEN, MAX_BATCH, T = 256, 4, 16  # T: the step tokens of the built 4,3,4
GREEDY = (1, 2, 0)
TARGETS = [(4, 3, 4), (2, 3, 2), (2, 2, 1), (1, 3, 4), (4, 2, 3)]  # configs within 4/3/4, padded to T
COMPANIONS = [(4, 3, 4), GREEDY, CAUSAL, (2, 2, 1), (3, 3, 1)]
NEAR_BLOCKS = [1, 2, 62, 63, 64, 65, 126, 127, 128, 190, 191, 192]  # prompt lengths around 64-key blocks

pytestmark = pytest.mark.export  # every test here builds engine dirs


def build(out: Path, *extra: str) -> Path:
    argv = ["build", "--model", str(STORIES), "--output", str(out), "--lookahead_config", "4,3,4", "--max_seq_len",
            str(MAX_SEQ_LEN), "--max_input_len", "64", "--max-batch", str(MAX_BATCH), *extra]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    return {"exact": build(root / "exact", "--exact", "--tree", "off"), "fast": build(root / "fast", "--tree", "off"),
            "exact-tree": build(root / "exact-tree", "--exact", "--tree", "auto"),
            "exact-int4a8": build(root / "exact-int4a8", "--exact", "--tree", "auto", "--weights", "int4",
                                  "--activations", "int8")}


def step_row(slot: int, config: tuple, cache_len: int, ids: np.ndarray, tree: TreeTemplate | None = None) -> StepBatch:
    """One row of `config` (padded to len(ids) tokens, its verification slots laid as `tree`; CAUSAL: all
    causal) at `cache_len`."""
    tokens = len(ids)
    if config == CAUSAL:
        positions, slots = np.arange(tokens), np.arange(tokens)
    else:
        layout = StepLayout(LookaheadConfig(*config), padded_tokens=tokens, tree=tree)
        positions, slots = layout.rel_positions, layout.output_slots
    return StepBatch(np.array([slot]), ids[None], (cache_len + positions)[None], np.array([config], np.int32),
                     slots[None])


def stack(rows: list[StepBatch]) -> StepBatch:
    """The rows as one batch (output slots padded by repeating the last)."""
    K = max(r.output_slots.shape[1] for r in rows)
    slots = [np.pad(r.output_slots[0], (0, K - r.output_slots.shape[1]), mode="edge") for r in rows]
    return StepBatch(np.concatenate([r.slots for r in rows]), np.concatenate([r.input_ids for r in rows]),
                     np.concatenate([r.positions for r in rows]), np.concatenate([r.step_config for r in rows]),
                     np.array(slots))


def greedy_logits(ex, prompt: np.ndarray, chain: np.ndarray) -> np.ndarray:
    """Logits [V] of plain 1-token greedy decoding: the prompt, then the chain's tokens one step each."""
    ex.prefill(0, prompt, SamplingParams())
    for i, token in enumerate(chain.tolist()):
        ex.step(step_row(0, GREEDY, ex.cache_len(0), np.array([token])))
        if i < len(chain) - 1:
            ex.commit(0, np.array([0]))
    logits = ex.step_logits()[0, 0]
    ex.release(0)
    return logits


def differences(engine_dir: Path, trials: int, seed: int, threads: int = 1, native: bool = True
                ) -> tuple[int, list[tuple]]:
    """(slots compared, the differing ones): each output slot of random lookahead steps, alone and batched with
    random companions in a random row order, against 1-token greedy decoding of the same context. native: the C
    kernels (the default where they build: kernels/onnxruntime_attention.c, and onnxruntime_quantized.c for int8
    activations), else standard ops and MatMulNBits."""
    engine = open_engine(engine_dir, session=SessionSettings(threads=threads, native_kernels=native))
    ex, ref, tree = engine.executor(), engine.executor(max_batch=1), engine.config.tree
    rng = np.random.default_rng(seed)
    compared, differ = 0, []
    for trial in range(trials):
        length = int(rng.choice(NEAR_BLOCKS)) if trial % 2 else int(rng.integers(1, 200))
        prompt = rng.integers(0, 512, length)
        config = TARGETS[int(rng.integers(len(TARGETS)))]
        for slot in range(MAX_BATCH):
            ex.release(slot)
        ex.prefill(0, prompt, SamplingParams())
        for slot in range(1, MAX_BATCH):
            ex.prefill(slot, rng.integers(0, 512, int(rng.integers(1, 200))), SamplingParams())
        target = step_row(0, config, length, rng.integers(0, 512, T), tree)
        ex.step(target)
        alone = ex.step_logits()[0]
        companions = range(1, int(rng.integers(2, MAX_BATCH + 1)))
        rows = [target] + [step_row(s, COMPANIONS[int(rng.integers(len(COMPANIONS)))], ex.cache_len(s),
                                    rng.integers(0, 512, T), tree) for s in companions]
        order = rng.permutation(len(rows))
        ex.step(stack([rows[i] for i in order]))
        batched = ex.step_logits()[int(np.flatnonzero(order == 0)[0])]
        mask = StepLayout(LookaheadConfig(*config), padded_tokens=T, tree=tree).mask
        for k, slot in enumerate(target.output_slots[0].tolist()):
            want = greedy_logits(ref, prompt, target.input_ids[0][mask[slot]])
            for how, got in (("alone", alone[k]), ("batched", batched[k])):
                compared += 1
                if not np.array_equal(got, want):
                    differ.append((how, config, length, slot, float(np.abs(got - want).max())))
    return compared, differ


@pytest.mark.parametrize(("name", "threads", "native"),
                         [("exact", 1, True), ("exact", 2, True), ("exact-tree", 1, True), ("exact-int4a8", 1, True),
                          ("exact-int4a8", 2, True), ("exact", 2, False), ("exact-tree", 1, False),
                          ("exact-int4a8", 2, False), ("fast", 1, True), ("fast", 2, True)])
def test_exact_engine_lookahead_slots_equal_greedy_steps_bit_for_bit(engines, name, threads, native):
    """Random prompts (many ending around 64-key blocks), configs, companions and row orders: every output slot
    of the lookahead step, alone and batched, == the 1-token greedy step at its context; with a draft tree too.
    The exact decomposition (native False) gives it with standard ops; the native kernel to any float32 engine."""
    assert (load_engine_config(engines[name]).tree is not None) == (name not in ("exact", "fast"))
    compared, differ = differences(engines[name], trials=16, seed=threads, threads=threads, native=native)
    assert compared > 150 and differ == []


def test_the_quantized_exact_engine_steps_one_row_natively_and_pads_to_two_with_matmulnbits(engines):
    """With QuantizedMatMul every product is row-invariant down to one row, so a greedy step runs one token; the
    MatMulNBits graph rounds a 1-row product another way, so there an exact engine pads it to two (design 6.9)."""
    from trt_lookahead.kernels.onnxruntime_library import native_library

    if not native_library().quantized:
        pytest.skip("no QuantizedMatMul on this CPU (AVX2, FMA and F16C)")
    for native, rows, op in ((True, 1, "QuantizedMatMul"), (False, 2, "MatMulNBits")):
        engine = open_engine(engines["exact-int4a8"], session=SessionSettings(threads=1, native_kernels=native))
        ops = {node.op_type for node in engine.graph().graph.node}
        assert engine.min_rows == rows and op in ops and ops.isdisjoint({"QuantizedMatMul", "MatMulNBits"} - {op})


def test_fast_decomposition_lookahead_slots_differ_from_greedy_steps(engines):
    """The same check on the fast standard-op decomposition finds differing bits (one softmax over all of a row's
    keys): the check can fail."""
    compared, differ = differences(engines["fast"], trials=12, seed=0, native=False)
    assert differ, compared


def chunked_then_step(ex, prompt: np.ndarray, chunk: int, token: int, rng) -> np.ndarray:
    """Logits [V] of a 1-token step after the prompt was fed as causal rows of `chunk` tokens (chunked prefill),
    full chunks beside companion rows of slots 1 .. 3 (prefilled, random configs)."""
    for slot in range(MAX_BATCH):
        ex.release(slot)
    ex.claim(0, SamplingParams())
    for slot in range(1, MAX_BATCH):
        ex.prefill(slot, rng.integers(0, 512, int(rng.integers(1, 150))), SamplingParams())
    for start in range(0, len(prompt), chunk):
        part = prompt[start : start + chunk]
        rows = [step_row(0, CAUSAL, ex.cache_len(0), part)]
        if len(part) == T:
            rows += [step_row(s, COMPANIONS[int(rng.integers(len(COMPANIONS)))], ex.cache_len(s),
                              rng.integers(0, 512, T)) for s in range(1, MAX_BATCH)]
        ex.step(stack(rows))
        ex.commit(0, np.arange(len(part)))
    ex.step(step_row(0, GREEDY, ex.cache_len(0), np.array([token])))
    return ex.step_logits()[0, 0]


@pytest.mark.parametrize("name", ["exact", "exact-int4a8"])
def test_exact_engine_prompt_fed_as_causal_chunks_gives_its_prefills_logits(engines, name):
    """Chunked prefill (causal rows of 1, 5 or T tokens, beside other rows) leaves the KV that prefill leaves:
    the next step's logits are ==."""
    engine = open_engine(engines[name], threads=1)
    ex, ref = engine.executor(), engine.executor(max_batch=1)
    rng = np.random.default_rng(5)
    for length in (1, 63, 64, 65, 130):
        prompt, token = rng.integers(0, 512, length), int(rng.integers(512))
        want = greedy_logits(ref, prompt, np.array([token]))
        for chunk in (1, 5, T):
            assert np.array_equal(chunked_then_step(ex, prompt, chunk, token, rng), want), (length, chunk)


PROMPTS = ["Once upon a time", "Lily and Tom went to the park. They", "The cat sat on the", "Sam had a red ball"]


@pytest.mark.parametrize("name", ["exact", "exact-tree", "exact-int4a8"])
def test_runtime_on_the_exact_engine_gives_lookahead_tokens_equal_to_greedy(engines, name):
    """End to end: exact=True is taken on an engine built with --exact (and --tree auto), and its lookahead
    tokens are its greedy tokens, one request at a time and four at once."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from trt_lookahead.runtime import LookaheadRuntime

    assert json.loads((engines[name] / "config.json").read_text())["exact"] is True
    with LookaheadRuntime.from_pretrained(engines[name], exact=True) as rt:
        assert rt.exact and rt.backend == "onnxruntime" and (rt.tree is not None) == (name != "exact")
        greedy = [rt.generate(p, max_new_tokens=60, lookahead="greedy").token_ids for p in PROMPTS]
        for config in ("4,3,4", "2,3,2", "1,2,0"):
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                together = list(pool.map(lambda p, c=config: rt.generate(p, max_new_tokens=60, lookahead=c).token_ids,
                                         PROMPTS))
            assert together == greedy, config
            assert [rt.generate(p, max_new_tokens=60, lookahead=config).token_ids for p in PROMPTS] == greedy


def test_seeded_sampling_on_the_quantized_exact_engine_equals_plain_sampling(engines):
    """int4 weights, int8 activations: a sampled request's lookahead tokens are its plain sampled tokens (the draw
    reads a 1-row step's logits through the pad rows), alone and beside three others."""
    from concurrent.futures import ThreadPoolExecutor

    from trt_lookahead.runtime import LookaheadRuntime

    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
    with LookaheadRuntime.from_pretrained(engines["exact-int4a8"], exact=True) as rt:
        plain = [rt.generate(p, max_new_tokens=50, lookahead="greedy", **sampled).token_ids for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: rt.generate(p, max_new_tokens=50, **sampled).token_ids, PROMPTS))
        alone = [rt.generate(p, max_new_tokens=50, **sampled).token_ids for p in PROMPTS]
    assert together == plain and alone == plain
    assert len({tuple(ids) for ids in plain}) == len(PROMPTS)


def test_exact_is_refused_where_the_engine_cannot_run_it(engines, capsys):
    from trt_lookahead.errors import UserError
    from trt_lookahead.runtime import LookaheadRuntime

    with pytest.raises(UserError, match=r"built without them \(rebuild it with `trt-lookahead build --exact`"):
        LookaheadRuntime.from_pretrained(engines["fast"], exact=True)
    with pytest.raises(UserError, match="the TensorRT backend has no exact step"):
        open_engine(engines["exact"], backend="tensorrt", exact=True)
    with pytest.raises(UserError, match="row-invariant only with prepacked weights"):
        open_engine(engines["exact"], session=SessionSettings(prepacking=False))
    assert main(["generate", "--engine", str(engines["fast"]), "--prompt", "Once", "--exact"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exact steps were asked for but the engine was built without them" in err[0]
    # the other way round: an exact engine has no fast graph to run, so --no-exact is refused, not ignored
    with pytest.raises(UserError, match=r"built with exact steps only \(build one without --exact, or drop"):
        LookaheadRuntime.from_pretrained(engines["exact"], exact=False)
    assert main(["generate", "--engine", str(engines["exact"]), "--prompt", "Once", "--no-exact"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the fast step was asked for (--no-exact)" in err[0]


@pytest.mark.parametrize(("extra", "words"), [
    (["--dtype", "bfloat16"], "it runs float32, not bfloat16 (--dtype float32)"),
    (["--attention", "native"], "its attention is the LookaheadAttention node, not native (--attention plugin)"),
    (["--target", "tensorrt"], "TensorRT has no exact step (--target onnx)"),
    (["--lookahead_config", "8,6,8"], "its steps hold at most 64 tokens, and 8/6/8 has T = 80 (a --lookahead_config "
                                      "with T <= 64)"),
])
def test_build_exact_refuses_what_it_cannot_build(tmp_path, capsys, extra, words):
    """Each reason with its fix, and the way to a graph that is not exact."""
    argv = ["build", "--model", str(STORIES), "--output", str(tmp_path / "e"), "--exact", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--exact cannot build this engine" in err[0] and words in err[0]
    assert err[0].endswith("; or drop --exact")
    assert not (tmp_path / "e").exists()


@pytest.mark.slow
def test_smollm2_engine_slots_equal_greedy_steps_by_native_or_exact_attention(tmp_path):
    """The same check on SmolLM2-135M (30 layers, 3 query heads per KV head, head_dim 64), 2 threads, both engines
    with build's default `auto` tree: the exact engine with either attention, the fast one with the native kernel;
    the fast decomposition differs."""
    from trt_lookahead.model.fetch import resolve_model

    model = str(resolve_model("smollm2-135m-instruct"))
    common = ["--model", model, "--lookahead_config", "4,3,4", "--max_seq_len", "384", "--max-batch", str(MAX_BATCH)]
    assert main(["build", *common, "--output", str(tmp_path / "exact"), "--exact"]) == 0
    assert main(["build", *common, "--output", str(tmp_path / "fast")]) == 0
    assert load_engine_config(tmp_path / "exact").tree is not None
    for name, native, trials in (("exact", True, 4), ("exact", False, 2), ("fast", True, 2)):
        compared, differ = differences(tmp_path / name, trials=trials, seed=7, threads=2, native=native)
        assert compared > 10 * trials and differ == [], (name, native)
    compared, differ = differences(tmp_path / "fast", trials=2, seed=7, threads=2, native=False)
    assert differ, compared
