"""Batched steps with model-free oracles: many requests in one step, any config per step, the contract's checks."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.oracles import (
    ORACLES,
    OracleExecutor,
    decode_together,
    induction_logits,
    markov_logits,
    reference_generate,
    warmed_shared_pool,
)

from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.decoder import GREEDY_STEP, RequestDecoder
from trt_lookahead.lookahead.executor import StepBatch, check_batch
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.lookahead.stepper import BatchStepper, Row


@st.composite
def requests(draw, vocab):
    config = LookaheadConfig(draw(st.integers(1, 6)), draw(st.integers(2, 5)), draw(st.integers(0, 6)))
    sampled = draw(st.booleans())
    return dict(
        config=config,
        prompt=draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=16)),
        max_new=draw(st.integers(1, 30)),
        stop=draw(st.sets(st.integers(0, vocab - 1), max_size=1)),
        seed=draw(st.integers(0, 2**31)),
        sampling=SamplingParams(
            draw(st.floats(0.3, 1.5)), draw(st.sampled_from([0, 3])), draw(st.sampled_from([1.0, 0.8])),
            draw(st.integers(0, 2**31)),
        ) if sampled else SamplingParams(),
    )


def smaller(draw_int, config: LookaheadConfig) -> LookaheadConfig:
    """A config a step of a `config` request may use: greedy, or fewer columns and candidates at its N."""
    if draw_int(0, 3) == 0:
        return GREEDY_STEP
    return LookaheadConfig(draw_int(1, config.W), config.N, draw_int(0, config.G))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_every_request_of_a_batch_emits_its_plain_decoding_whatever_the_step_configs(data):
    vocab = data.draw(st.integers(8, 30))
    logits = ORACLES[data.draw(st.sampled_from(sorted(ORACLES)))](vocab, data.draw(st.integers(0, 1000)))
    specs = data.draw(st.lists(requests(vocab), min_size=1, max_size=5))
    executor = OracleExecutor(logits, vocab, max_batch=len(specs), step_tokens=64)
    draw_int = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    expect = [reference_generate(logits, s["prompt"], s["max_new"], s["sampling"], sorted(s["stop"])) for s in specs]
    # a shared pool (junk and the requests' own future text) changes the drafts only, never the tokens
    shared = warmed_shared_pool(expect, vocab, draw_int(0, 99)) if data.draw(st.booleans()) else None
    done = decode_together(executor, specs, lambda d: smaller(draw_int, d.config), shared=shared)
    for s, (d, got), expected in zip(specs, done, expect, strict=True):
        assert got == d.tokens == expected
        assert d.finish_reason == ("stop" if expected[-1] in s["stop"] else "length")


def test_a_request_that_fails_leaves_the_others_in_the_step_untouched():
    logits = induction_logits(20, 3)
    executor = OracleExecutor(logits, 20, max_batch=3)
    decoders = [RequestDecoder(LookaheadConfig(3, 3, 3), [1, 2, 3, 4, 1, 2], 12) for _ in range(3)]
    for slot, d in enumerate(decoders):
        d.setup(executor.prefill(slot, d.prompt, SamplingParams()))
    stepper = BatchStepper(executor)
    errors = stepper.run([Row(0, decoders[0], decoders[0].config), Row(1, decoders[1], LookaheadConfig(3, 4, 3)),
                          Row(2, decoders[2], decoders[2].config)])
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], ValueError) and "does not fit" in str(errors[1])
    while not decoders[0].finished:
        rows = [Row(0, decoders[0], decoders[0].config), Row(2, decoders[2], decoders[2].config)]
        assert stepper.run(rows) == [None, None]
    expected = reference_generate(logits, [1, 2, 3, 4, 1, 2], 12)
    assert decoders[0].tokens == decoders[2].tokens == expected


def test_rows_see_only_their_own_slot():
    logits = markov_logits(30, 3, 1)
    executor = OracleExecutor(logits, 30, max_batch=2)
    a = RequestDecoder(LookaheadConfig(2, 3, 2), [5, 6, 7, 8], 20)
    b = RequestDecoder(LookaheadConfig(2, 3, 2), [9, 9, 1], 20)
    a.setup(executor.prefill(1, a.prompt, SamplingParams()))
    b.setup(executor.prefill(0, b.prompt, SamplingParams()))
    stepper = BatchStepper(executor)
    while not (a.finished and b.finished):
        stepper.run([Row(s, d, d.config) for s, d in ((1, a), (0, b)) if not d.finished])
    assert a.tokens == reference_generate(logits, [5, 6, 7, 8], 20)
    assert b.tokens == reference_generate(logits, [9, 9, 1], 20)
    assert executor.caches[1][:4] == [5, 6, 7, 8] and executor.caches[0][:3] == [9, 9, 1]


def batch(**overrides):
    fields = dict(
        slots=np.array([0, 1]), input_ids=np.zeros((2, 4), np.int64), positions=np.zeros((2, 4), np.int64),
        step_config=np.array([[1, 2, 0], [1, 3, 1]], np.int32), output_slots=np.array([[0, 0], [0, 1]]),
    )
    return StepBatch(**{**fields, **overrides})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(input_ids=np.zeros((2, 9), np.int64), positions=np.zeros((2, 9), np.int64)), "1 .. 8 tokens"),
        (dict(slots=np.array([1, 1])), "distinct KV slots"),
        (dict(slots=np.array([0, 5])), "distinct KV slots"),
        (dict(step_config=np.array([[1, 2, 0], [3, 3, 1]], np.int32)), "not a layout of at most 4 tokens"),
        (dict(step_config=np.array([[1, 1, 0], [1, 3, 1]], np.int32)), "row 0"),
        (dict(output_slots=np.array([[0, 1], [0, 1]])), "output_slots must name real step slots"),
        (dict(input_ids=np.full((2, 4), 50)), r"input ids must lie in \[0, 10\)"),
        (dict(positions=np.zeros((2, 3), np.int64)), r"positions must have shape \(2, 4\)"),
    ],
)
def test_check_batch_refuses_bad_steps(overrides, match):
    with pytest.raises(ValueError, match=match):
        check_batch(batch(**overrides), max_batch=4, step_tokens=8, vocab_size=10)


def test_check_batch_gives_the_real_tokens_of_each_row():
    assert check_batch(batch(), max_batch=4, step_tokens=8, vocab_size=10).tolist() == [1, 4]
    causal = batch(step_config=np.array([[0, 0, 0], [1, 3, 1]], np.int32))
    assert check_batch(causal, max_batch=4, step_tokens=8, vocab_size=10).tolist() == [4, 4]

