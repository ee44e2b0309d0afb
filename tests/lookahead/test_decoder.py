"""LookaheadDecoder (tests/support) on model-free oracles: exactness, verification rules, stops, bad input."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.ablation import LookaheadDecoder, Switches
from support.oracles import ORACLES, OracleExecutor, induction_logits, markov_logits

from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.decoder import CHAIN
from trt_lookahead.lookahead.pool import PROMPT
from trt_lookahead.lookahead.sampling import SamplingParams

VOCAB = 100
WRONG = 0


def script_logits(script: list[int]):
    """Greedy continuation is `script`; any context that leaves the script predicts WRONG."""

    def logits(context):
        out = np.zeros(VOCAB)
        on_script = len(context) < len(script) and list(context) == script[: len(context)]
        out[script[len(context)] if on_script else WRONG] = 1.0
        return out

    return logits


class Recorder(OracleExecutor):
    """An oracle that also records each step's row width and each commit's slots."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.commits, self.widths = [], []

    def step(self, batch):
        self.widths.append(batch.tokens)
        return super().step(batch)

    def commit(self, slot, rows):
        self.commits.append(list(rows))
        super().commit(slot, rows)


def make(config, logits_fn, vocab=VOCAB, max_seq_len=4096, **kwargs):
    config = config if isinstance(config, LookaheadConfig) else LookaheadConfig(*config)
    executor = Recorder(logits_fn, vocab, max_batch=1, step_tokens=config.step_tokens, max_seq_len=max_seq_len)
    return LookaheadDecoder(executor, config, **kwargs)


def greedy(logits_fn, prompt, max_new, vocab=VOCAB, stop=(), sampling=None):
    return make(LookaheadConfig.greedy(), logits_fn, vocab, stop_tokens=stop).generate(prompt, max_new, sampling)


def first_decode_block(decoder, prompt, max_new):
    blocks = list(decoder.stream(prompt, max_new))
    return blocks[1]


# prompt holds the n-gram (11, 12, 13) and the script continues 11 -> 12 13 14 15 ...
PROMPT_IDS = [10, 11, 12, 13, 20, 10]
SCRIPT = [*PROMPT_IDS, 11, 12, 13, 14, 15, 16, 17, 18]


def test_full_match_yields_n_tokens_with_bonus():
    decoder = make((2, 3, 2), script_logits(SCRIPT))
    assert first_decode_block(decoder, PROMPT_IDS, 6) == [12, 13, 14]  # 2 drafts + bonus = N
    assert decoder.stats.sources == {PROMPT: 2}


def test_without_bonus_a_full_match_yields_n_minus_1_tokens_like_lade():
    decoder = make((2, 3, 2), script_logits(SCRIPT), switches=Switches(bonus=False))
    assert first_decode_block(decoder, PROMPT_IDS, 6) == [12, 13]


def test_without_prompt_pool_the_first_step_yields_one_token():
    decoder = make((2, 3, 2), script_logits(SCRIPT), switches=Switches(prompt_pool=False))
    assert first_decode_block(decoder, PROMPT_IDS, 6) == [12]


def test_tie_between_candidates_commits_the_newest():
    prompt = [10, 11, 12, 50, 7, 11, 12, 51, 7, 10]  # key 11 -> (12, 50) then (12, 51)
    script = [*prompt, 11, 12, 13, 14, 15]
    decoder = make((2, 3, 2), script_logits(script))
    result = decoder.generate(prompt, 4)
    assert result.token_ids[:3] == [11, 12, 13]
    newest_first_slot = int(decoder.layout.candidate_slots[0, 0])
    assert decoder.executor.commits[0] == [0, newest_first_slot]


def test_stop_token_inside_an_accepted_block_ends_generation_there():
    stop = 99
    prompt = [10, 11, 12, stop, 14, 20, 10]
    script = [*prompt, 11, 12, stop, 14, 15, 16]
    decoder = make((2, 4, 2), script_logits(script), stop_tokens=[stop])
    result = decoder.generate(prompt, 20)
    assert result.token_ids == [11, 12, stop]
    assert result.finish_reason == "stop"
    assert decoder.stats.steps == 2 and decoder.stats.accepted_histogram == {2: 1}


def test_max_new_tokens_cuts_an_accepted_block():
    decoder = make((2, 3, 2), script_logits(SCRIPT))
    result = decoder.generate(PROMPT_IDS, 2)
    assert result.token_ids == [11, 12] and result.finish_reason == "length"


def test_column0_chain_is_verified():
    # Output depends on the absolute position alone: Jacobi columns become exact after N-2 steps, so
    # with no candidates (G=0) and no pool only the column-0 chain can accept more than one token.
    def by_position(context):
        out = np.zeros(VOCAB)
        out[(3 * len(context) + 1) % VOCAB] = 1.0
        return out

    prompt = [5, 6, 7]
    expected = [(3 * q + 1) % VOCAB for q in range(3, 43)]
    decoder = make((4, 4, 0), by_position, switches=Switches(prompt_pool=False))
    result = decoder.generate(prompt, 40)
    assert result.token_ids == expected
    assert decoder.stats.sources[CHAIN] > 0
    assert decoder.stats.compression > 1.5
    assert max(decoder.stats.accepted_histogram) == 3  # the chain has N-2 drafts, plus the bonus token
    off = make((4, 4, 0), by_position, switches=Switches(prompt_pool=False, chain=False))
    assert off.generate(prompt, 40).token_ids == expected
    assert off.stats.compression == 1.0


def test_same_seed_same_run_and_stats():
    logits = markov_logits(30, 2, seed=3)
    a = make((5, 4, 5), logits, vocab=30, seed=7).generate([1, 2, 3, 4, 5], 50)
    b = make((5, 4, 5), logits, vocab=30, seed=7).generate([1, 2, 3, 4, 5], 50)
    assert a.token_ids == b.token_ids and a.stats.steps == b.stats.steps
    assert a.stats.accepted_histogram == b.stats.accepted_histogram


def test_every_step_feeds_the_same_number_of_tokens():
    logits = induction_logits(30, seed=1)
    decoder = make((4, 3, 4), logits, vocab=30)
    decoder.generate([3, 4, 5, 6, 3, 4], 30)
    assert decoder.executor.widths and set(decoder.executor.widths) == {16}


def test_stats_are_consistent():
    decoder = make((4, 3, 4), induction_logits(30, seed=2), vocab=30)
    result = decoder.generate([3, 4, 5, 6, 7, 3, 4, 5], 40)
    s = decoder.stats
    assert s.generated_tokens == len(result.token_ids) == 40
    assert sum(k * v for k, v in s.accepted_histogram.items()) == 40 - 1  # the prefill's token is not a decode step
    assert sum(s.accepted_histogram.values()) == s.steps - 1
    assert s.compression == pytest.approx(40 / s.steps)
    assert 0 <= s.executor_seconds <= s.decode_seconds
    assert sum(s.sources.values()) == sum((k - 1) * v for k, v in s.accepted_histogram.items())


@pytest.mark.parametrize(
    ("prompt", "max_new", "match"),
    [
        ([], 5, "prompt is empty"),
        ([1, 2], 0, "max_new_tokens must be a positive integer"),
        ([1, 2], -3, "max_new_tokens"),
        ([1, VOCAB], 5, f"token id {VOCAB} is outside the vocabulary"),
        ([-1, 2], 5, "outside the vocabulary"),
        ([1] * 60, 50, "the prompt's 60 tokens \\+ max_new_tokens 50 exceed max_seq_len 100; lower max_new_tokens "
                       "to at most 40, shorten the prompt or raise max_seq_len"),
        ([1] * 100, 1, "the prompt's 100 tokens leave no room to generate in max_seq_len 100; shorten the prompt or "
                       "raise max_seq_len"),
    ],
)
def test_bad_requests_fail_before_any_work(prompt, max_new, match):
    decoder = make((4, 3, 4), markov_logits(VOCAB, 1, 0), max_seq_len=100)
    with pytest.raises(ValueError, match=match):
        decoder.generate(prompt, max_new)
    assert decoder.executor.steps == 0 and decoder.executor.caches[0] == []


def test_a_layout_wider_than_the_executor_is_refused():
    executor = OracleExecutor(markov_logits(VOCAB, 1, 0), VOCAB, step_tokens=16)
    with pytest.raises(ValueError, match="needs 56 tokens per step but the executor takes at most 16"):
        LookaheadDecoder(executor, LookaheadConfig(7, 5, 7))


class CausalClaim(OracleExecutor):
    """Runs every row as if it were causal (0, 0, 0): a lookahead row's slots then see far too much."""

    def step(self, batch):
        batch.step_config[:] = 0
        return super().step(batch)


def test_oracle_catches_a_wrong_mask():
    executor = CausalClaim(markov_logits(VOCAB, 1, 0), VOCAB)
    with pytest.raises(AssertionError, match="sees positions"):
        LookaheadDecoder(executor, LookaheadConfig(4, 3, 4)).generate([1, 2, 3], 5)




@st.composite
def scenarios(draw):
    vocab = draw(st.integers(8, 40))
    return dict(
        config=LookaheadConfig(draw(st.integers(1, 8)), draw(st.integers(2, 6)), draw(st.integers(0, 8))),
        vocab=vocab,
        oracle=draw(st.sampled_from(sorted(ORACLES))),
        oracle_seed=draw(st.integers(0, 1000)),
        prompt=draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24)),
        max_new=draw(st.integers(1, 40)),
        stop=draw(st.sets(st.integers(0, vocab - 1), max_size=1)),
        seed=draw(st.integers(0, 2**31)),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_lookahead_equals_greedy(s):
    logits = ORACLES[s["oracle"]](s["vocab"], s["oracle_seed"])
    expected = greedy(logits, s["prompt"], s["max_new"], s["vocab"], s["stop"])
    decoder = make(s["config"], logits, s["vocab"], stop_tokens=s["stop"], seed=s["seed"])
    got = decoder.generate(s["prompt"], s["max_new"])
    assert got.token_ids == expected.token_ids
    assert got.finish_reason == expected.finish_reason
    assert decoder.stats.compression >= 1.0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenarios(),
    st.floats(0.3, 2.0),
    st.sampled_from([0, 1, 3, 8]),
    st.sampled_from([1.0, 0.9, 0.5]),
    st.integers(0, 2**31),
)
def test_lookahead_sampling_equals_plain_sampling(s, temperature, top_k, top_p, sample_seed):
    logits = ORACLES[s["oracle"]](s["vocab"], s["oracle_seed"])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=sample_seed)
    expected = greedy(logits, s["prompt"], s["max_new"], s["vocab"], s["stop"], sampling=params)
    decoder = make(s["config"], logits, s["vocab"], stop_tokens=s["stop"], seed=s["seed"])
    assert decoder.generate(s["prompt"], s["max_new"], params).token_ids == expected.token_ids
    assert decoder.stats.compression >= 1.0


def test_sampling_differs_from_greedy_and_depends_on_seed():
    logits = markov_logits(40, 2, seed=5)
    g = greedy(logits, [1, 2, 3], 30, 40).token_ids
    runs = [greedy(logits, [1, 2, 3], 30, 40, sampling=SamplingParams(1.0, seed=s)).token_ids for s in range(3)]
    assert g not in runs
    assert len({tuple(r) for r in runs}) == 3
