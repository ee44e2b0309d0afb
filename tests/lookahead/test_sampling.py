"""The seeded sampler: deterministic per (seed, position), filtered correctly, distributed as the model says."""

import numpy as np
import pytest

from trt_lookahead.lookahead.sampling import (
    MASK32,
    MIN_TEMPERATURE,
    VOCAB_SALT,
    SamplingParams,
    filter_logits,
    gumbel_noise,
    noise_bits,
    select_tokens,
    uniform_noise,
)

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03]))


def draws(params: SamplingParams, n: int = 20000) -> np.ndarray:
    return select_tokens(np.tile(LOGITS, (n, 1)), np.arange(n), params)


def test_draws_follow_the_softmax():
    counts = np.bincount(draws(SamplingParams(temperature=1.0, seed=3)), minlength=5) / 20000
    assert np.allclose(counts, np.exp(LOGITS), atol=0.015)


def test_temperature_sharpens_and_flattens():
    cold = np.bincount(draws(SamplingParams(temperature=0.25, seed=1)), minlength=5) / 20000
    hot = np.bincount(draws(SamplingParams(temperature=4.0, seed=1)), minlength=5) / 20000
    expected_cold = np.exp(LOGITS / 0.25) / np.exp(LOGITS / 0.25).sum()
    assert np.allclose(cold, expected_cold, atol=0.015)
    assert hot.max() < 0.3 and hot.min() > 0.12


def test_top_k_and_top_p_restrict_the_support():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, seed=5)).tolist()) == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5, seed=5)).tolist()) == {0}  # 0.5 mass reached by token 0
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.8, seed=5)).tolist()) == {0, 1, 2}
    renormalised = np.bincount(draws(SamplingParams(temperature=1.0, top_k=2, seed=2)), minlength=5) / 20000
    assert renormalised[:2] == pytest.approx([2 / 3, 1 / 3], abs=0.015)


def test_filter_logits_keeps_ties_at_the_kth_value():
    kept = np.isfinite(filter_logits(np.array([[3.0, 1.0, 3.0, 2.0]]), top_k=1, top_p=1.0))
    assert kept.tolist() == [[True, False, True, False]]


def test_noise_is_a_pure_function_of_seed_and_position():
    a = uniform_noise(7, np.array([0, 5, 9]), 50)
    assert np.array_equal(a, uniform_noise(7, np.array([0, 5, 9]), 50))
    assert np.array_equal(a[1], uniform_noise(7, np.array([5]), 50)[0])
    assert not np.array_equal(a, uniform_noise(8, np.array([0, 5, 9]), 50))
    big = uniform_noise(1, np.arange(200), 1000)
    assert big.min() > 0 and big.max() < 1 and abs(big.mean() - 0.5) < 0.01


def test_greedy_params_take_the_argmax():
    assert select_tokens(np.array([[0.1, 0.9, 0.3]]), np.array([4]), SamplingParams()).tolist() == [1]


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize(
    ("bad", "name"),
    [
        (dict(temperature=float("inf")), "temperature"),  # issue 10: token id 0 sixteen times before
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature="0.5"), "temperature"),
        (dict(temperature=None), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_k=2.5), "top_k"),  # issue 10: failed inside torch.topk after the prefill before
        (dict(top_k="5"), "top_k"),
        (dict(top_k=None), "top_k"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_p="0.9"), "top_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(seed=1.0), "seed"),
        (dict(seed="1"), "seed"),
    ],
)
def test_sampling_params_name_the_bad_value(bad, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingParams(**bad)


def test_sampling_params_take_numpy_scalars_and_keep_python_types():
    params = SamplingParams(np.float32(0.5), np.int64(40), np.float64(0.9), np.uint64(2**64 - 1))
    assert params == SamplingParams(0.5, 40, 0.9, 2**64 - 1)
    assert [type(v) for v in (params.temperature, params.top_k, params.top_p, params.seed)] == [float, int, float, int]


@pytest.mark.parametrize("temperature", [1e-320, 1e-308, 1e-100, MIN_TEMPERATURE / 2])
def test_tiny_temperatures_are_greedy(temperature):
    # issue 10: 1e-320 and 1e-308 drew "t t t" (logits / t overflowed to inf, inf - inf = nan)
    logits = np.random.default_rng(0).normal(size=(64, 50)) * 5
    params = SamplingParams(temperature=temperature, top_k=5, seed=3)
    assert params.greedy
    assert select_tokens(logits, np.arange(64), params).tolist() == logits.argmax(-1).tolist()


def test_a_huge_finite_temperature_samples_only_what_the_filter_keeps():
    logits = np.random.default_rng(1).normal(size=(2000, 50))
    drawn = select_tokens(logits, np.arange(2000), SamplingParams(temperature=1e300, top_k=3, seed=4))
    top3 = np.argsort(-logits, axis=-1)[:, :3]
    assert all(token in row for token, row in zip(drawn.tolist(), top3.tolist(), strict=True))
    assert len(set(drawn.tolist())) > 3  # and it does sample (nearly uniformly) among them


def test_numpys_uint32_noise_has_the_int64_hashs_bits():  # the torch twin and ONNX graphs hash in int64
    seed, positions = 2**64 - 3, np.array([0, 1, 77, 2**31 + 5, 2**32 - 1])
    vocab = (np.arange(5000, dtype=np.int64)[None, :] * VOCAB_SALT) & MASK32
    bits = noise_bits(np.int64(seed & MASK32), positions.astype(np.int64)[:, None], vocab)
    assert bits.dtype == np.int64
    np.testing.assert_array_equal(uniform_noise(seed, positions, 5000), (bits + 0.5) / float(1 << 24))


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 2.0])
def test_a_draw_is_the_gumbel_max_over_the_whole_vocabulary(temperature):
    """select_tokens computes the noise only for tokens that can still win; the draw must be the argmax over every
    token of the filtered scores plus its noise, ties (the first wins) and a NaN logit included."""
    rng = np.random.default_rng(11)
    for trial in range(60):
        rows = int(rng.integers(1, 5))
        logits = rng.standard_normal((rows, 3000)) * float(rng.choice([0.3, 4.0, 25.0]))
        if trial % 5 == 0:
            logits[:, 10:14] = logits.max() + 1.0  # four tied best tokens
        if trial % 9 == 0:
            logits[0, 7] = np.nan
        params = SamplingParams(temperature=temperature, top_k=int(rng.choice([0, 3, 200])),
                                top_p=float(rng.choice([1.0, 0.8])), seed=int(rng.integers(0, 2**62)))
        positions = rng.integers(0, 10**6, rows)
        scores = filter_logits(logits, params.top_k, params.top_p) / temperature
        expected = np.argmax(scores + gumbel_noise(params.seed, positions, 3000), axis=-1)
        np.testing.assert_array_equal(select_tokens(logits, positions, params), expected)
