"""The seeded sampler: deterministic per (seed, position), filtered correctly, distributed as the model says."""

import numpy as np
import pytest

from trt_lookahead.lookahead.sampling import SamplingParams, filter_logits, select_tokens, uniform_noise

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
