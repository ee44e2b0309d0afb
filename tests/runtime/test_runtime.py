"""LookaheadRuntime and `trt-lookahead generate` on real models: exactness, streaming, JSON, bad input."""

import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from trt_lookahead.lookahead.config import Lookahead, LookaheadConfig
from trt_lookahead.lookahead.tree import TREE_DEPTH, tree_template
from trt_lookahead.runtime import LookaheadRuntime

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
DATA = Path(__file__).parents[2] / "trt_lookahead" / "bench" / "data"
PROMPTS = ["Once upon a time", "Lily and Tom went to the park. They", "The cat sat on the", "Sam had a red ball"]
# the quick check runs two configs; CI runs them all
CONFIGS = ["4,3,4", "1,3,3", *(pytest.param(c, marks=pytest.mark.slow) for c in ("7,5,7", "15,5,15", "2,2,1", "5,4,0"))]


@pytest.fixture(scope="module")
def stories():
    torch.set_num_threads(1)
    return LookaheadRuntime.from_pretrained(STORIES, backend="torch", lookahead="4,3,4")


@pytest.mark.parametrize("config", CONFIGS)
def test_lookahead_equals_greedy_on_stories260k(stories, config):
    for prompt in PROMPTS:
        greedy = stories.generate(prompt, max_new_tokens=96, lookahead="greedy")
        ahead = stories.generate(prompt, max_new_tokens=96, lookahead=config)
        assert ahead.token_ids == greedy.token_ids, (config, prompt)
        assert ahead.text == greedy.text
        assert greedy.steps == greedy.generated_tokens and greedy.compression == 1.0


def test_lookahead_compresses_on_stories260k(stories):
    out = [stories.generate(p, max_new_tokens=128, lookahead="7,5,7") for p in PROMPTS]
    assert sum(o.generated_tokens for o in out) / sum(o.steps for o in out) > 1.3


def test_greedy_reproduces_the_documented_llama2c_sample(stories):
    # karpathy/llama2.c doc/stories260K.md: the temperature-0 sample from BOS begins with this sentence
    out = stories.generate([1], max_new_tokens=40, lookahead="4,3,4")
    assert out.text.startswith("Once upon a time, there was a little girl named Lily. She loved to play outside")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lookahead_sampling_equals_plain_sampling(stories, seed):
    kwargs = dict(max_new_tokens=64, temperature=0.8, top_k=40, top_p=0.95, seed=seed)
    plain = stories.generate("Once upon a time", lookahead="greedy", **kwargs)
    ahead = stories.generate("Once upon a time", lookahead="7,5,7", **kwargs)
    assert ahead.token_ids == plain.token_ids


def test_sampling_seeds_give_different_text(stories):
    texts = {stories.generate("Once upon a time", max_new_tokens=32, temperature=1.0, seed=s).text for s in range(3)}
    assert len(texts) == 3


def test_stream_yields_each_step_and_joins_to_the_text(stories):
    chunks = list(stories.stream("Once upon a time", max_new_tokens=80, lookahead="7,5,7"))
    final = chunks[-1]
    assert final.done and final.output is not None
    assert "".join(c.text for c in chunks) == final.output.text
    assert [t for c in chunks for t in c.token_ids] == final.output.token_ids
    assert len(chunks) - 1 == final.output.steps  # one chunk per forward pass
    assert any(len(c.token_ids) > 1 for c in chunks)


def test_stop_string_ends_generation_and_is_cut(stories):
    full = stories.generate("Once upon a time", max_new_tokens=60)
    stop = full.text[20:26]
    out = stories.generate("Once upon a time", max_new_tokens=60, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    streamed = "".join(c.text for c in stories.stream("Once upon a time", max_new_tokens=60, stop=[stop]))
    assert streamed == out.text


def test_the_lookahead_choice_and_token_id_prompts(stories):
    assert stories.lookahead == Lookahead(LookaheadConfig(4, 3, 4))  # a checkpoint's default
    assert stories.check_request([1, 2], 4, lookahead="greedy").lookahead == Lookahead.greedy()
    assert stories.check_request([1, 2], 4).lookahead == stories.lookahead
    # `auto` takes the runtime's ceiling, its own within it (min per W, N, G); an `auto` capped to greedy is greedy
    ceiling = LookaheadConfig(3, 3, 2)
    assert Lookahead.parse("auto").narrow(ceiling, None, 128) == Lookahead(ceiling, auto=True)
    assert Lookahead(LookaheadConfig(7, 2, 7), auto=True).narrow(ceiling, None, 128) == Lookahead(
        LookaheadConfig(3, 2, 2), auto=True)
    assert Lookahead(LookaheadConfig(1, 2, 0), auto=True).narrow(ceiling, None, 128) == Lookahead.greedy()
    with pytest.raises(ValueError, match="does not fit the engine built for 4/3/4"):
        Lookahead.parse("5,3,4").narrow(ceiling, LookaheadConfig(4, 3, 4), 128)
    with pytest.raises(ValueError, match="feeds 140 tokens per step"):  # (15 + 20) x 4 > the executor's 128
        stories.check_request([1, 2], 4, lookahead="15,5,20")
    with pytest.raises(ValueError, match="lookahead must be 'greedy', 'auto'"):
        stories.check_request([1, 2], 4, lookahead=7)
    ids = stories.encode("Once upon a time")
    assert ids[0] == 1  # stories260K prompts start with BOS
    assert stories.generate(ids, max_new_tokens=10).token_ids == stories.generate("Once upon a time", 10).token_ids


def test_runtime_errors_are_clear(stories):
    with pytest.raises(ValueError, match="tokens leave no room to generate in max_seq_len"):
        stories.generate("Once " * 600, max_new_tokens=10)
    with pytest.raises(ValueError, match="max_new_tokens"):
        stories.generate("Once", max_new_tokens=0)
    with pytest.raises(ValueError, match="no chat template"):
        stories.generate("Hi", chat=True)


def test_every_config_runs_on_the_one_executor_and_frees_its_slot(stories):
    configs = ["2,2,1", "2,3,1", "3,3,1", "3,2,2", "4,3,4", "15,5,15", "greedy"]
    reference = stories.generate("Once upon a time", max_new_tokens=20, lookahead="greedy").token_ids
    for config in configs:
        assert stories.generate("Once upon a time", max_new_tokens=20, lookahead=config).token_ids == reference
    assert stories.scheduler.free_slots == stories.max_batch
    assert all(stories.executor.cache_len(s) == 0 for s in range(stories.max_batch))
    with pytest.raises(ValueError, match="takes at most 128"):
        stories.generate("Once", max_new_tokens=5, lookahead="20,5,20")


def test_incremental_detokenizer_matches_a_full_decode(stories):
    from trt_lookahead.runtime.text import Detokenizer

    texts = ["Once upon a time, Lily saw a café. 🎈 She said “héllo” — and ran.", "Tom    had 12 dogs. Ünïcödé ✓ ok"]
    rng = np.random.default_rng(0)
    for text in texts:
        ids = stories.encode(text)[1:]  # no BOS; multi-byte characters become byte-fallback pieces
        assert len(ids) > len(text) // 3
        for _ in range(10):
            detokenizer, start, pushed = Detokenizer(stories.decode), 0, []
            while start < len(ids):
                size = int(rng.integers(1, 5))
                pushed.append(detokenizer.push(ids[start : start + size]))
                start += size
            assert all("\ufffd" not in t for t in pushed)
            assert all(b.startswith(a) for a, b in itertools.pairwise(pushed))
            assert detokenizer.text == stories.decode(ids)


def test_a_checkpoint_verifies_a_draft_tree_by_default_and_off_runs_linear_candidates():
    """The default path (float32 on the cached onnxruntime engine) verifies the `auto` tree of its 8/5/8 engine,
    requests with smaller configs its first nodes; tree="off" runs a linear engine. Both emit greedy's tokens."""
    with (LookaheadRuntime.from_pretrained(STORIES, max_seq_len=256) as tree_rt,
          LookaheadRuntime.from_pretrained(STORIES, max_seq_len=256, tree="off") as linear):
        assert tree_rt.backend == linear.backend == "onnxruntime"
        assert tree_rt.tree == tree_template(32, TREE_DEPTH) and linear.tree is None
        sources: dict[str, Counter] = {"tree": Counter(), "linear": Counter()}
        for prompt, config in zip(PROMPTS, ["8,5,8", "4,3,4", "8,5,8", "2,5,2"], strict=True):
            want = linear.generate(prompt, max_new_tokens=48, lookahead="greedy").token_ids
            for name, rt in (("tree", tree_rt), ("linear", linear)):
                out = rt.generate(prompt, max_new_tokens=48, lookahead=config, pool_scope="request")
                assert out.token_ids == want, (name, prompt, config)
                sources[name].update(out.stats.sources)
        assert sources["tree"]["recycled"] > 0 and sources["linear"]["recycled"] == 0


def test_a_draft_tree_runtime_emits_greedy_and_recycles_successors_in_its_shared_scope(stories):
    """tree="auto": the torch executor verifies a 28-node tree fed by the pool, suffix matches and recycled top-k;
    the tokens are greedy's. Shared-scope requests feed the runtime's successor map; request scope does not."""
    rt = LookaheadRuntime.from_pretrained(STORIES, backend="torch", lookahead="7,5,7", tree="auto")
    try:
        assert rt.tree is not None and rt.tree.nodes == 28 and rt.executor.tree == rt.tree
        sources = Counter()
        for prompt in PROMPTS:
            out = rt.generate(prompt, max_new_tokens=64, pool_scope="request")
            assert out.token_ids == stories.generate(prompt, max_new_tokens=64, lookahead="greedy").token_ids
            sources.update(out.stats.sources)
        assert sources["recycled"] > 0 and len(rt.successors) == 0
        rt.generate(PROMPTS[0], max_new_tokens=16)
        assert len(rt.successors) > 0
    finally:
        rt.close()
