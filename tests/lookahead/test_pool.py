import numpy as np
import pytest

from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.decoder import RequestDecoder
from trt_lookahead.lookahead.pool import OUTPUT, PROMPT, SHARED, WINDOW, NgramPool, SharedPool


def test_candidates_newest_first_and_capacity_eviction():
    pool = NgramPool(n=3, capacity=2)
    pool.insert(1, (2, 3), PROMPT)
    pool.insert(1, (4, 5), WINDOW)
    pool.insert(1, (6, 7), WINDOW)  # evicts (2, 3), the oldest
    assert pool.candidates(1, 5) == [((6, 7), WINDOW), ((4, 5), WINDOW)]
    assert len(pool) == 2


def test_reinsert_refreshes_recency_and_origin():
    pool = NgramPool(n=3, capacity=2)
    pool.insert(1, (2, 3), PROMPT)
    pool.insert(1, (4, 5), WINDOW)
    pool.insert(1, (2, 3), OUTPUT)  # refresh, no eviction
    pool.insert(1, (8, 9), WINDOW)  # now (4, 5) is the oldest
    assert pool.candidates(1, 2) == [((8, 9), WINDOW), ((2, 3), OUTPUT)]


def test_limit_and_unknown_key():
    pool = NgramPool(n=2, capacity=4)
    for t in range(4):
        pool.insert(0, (t,), WINDOW)
    assert [c for c, _ in pool.candidates(0, 2)] == [(3,), (2,)]
    assert pool.candidates(9, 2) == []
    assert pool.candidates(0, 0) == []


def test_zero_capacity_pool_stores_nothing():
    pool = NgramPool(n=3, capacity=0)
    pool.insert(1, (2, 3), PROMPT)
    assert len(pool) == 0


def test_insert_sequence_from_a_start_index():
    pool = NgramPool(n=3, capacity=8)
    tokens = [5, 6, 7, 5, 6, 8]
    pool.insert_sequence(tokens, PROMPT)
    assert [c for c, _ in pool.candidates(5, 8)] == [(6, 8), (6, 7)]
    assert [c for c, _ in pool.candidates(7, 8)] == [(5, 6)]
    more = NgramPool(n=3, capacity=8)
    more.insert_sequence(tokens, OUTPUT, start=5)  # only n-grams ending at index 5: (5, 6, 8)
    assert len(more) == 1 and more.candidates(5, 1) == [((6, 8), OUTPUT)]


@pytest.mark.parametrize(("n", "capacity"), [(1, 2), (3, -1)])
def test_bad_arguments(n, capacity):
    with pytest.raises(ValueError):
        NgramPool(n, capacity)


def test_shared_pool_keeps_n_apart_and_newest_first():
    pool = SharedPool(budget=100, per_key=2)
    pool.insert_sequence([1, 2, 3, 1, 4, 5], 3)
    pool.insert_sequence([1, 7], 2)
    assert pool.candidates(3, 1, 5) == [(4, 5), (2, 3)]
    assert pool.candidates(2, 1, 5) == [(7,)]
    pool.insert(1, (8, 9))  # per_key 2: evicts (2, 3), the oldest of key 1 at N = 3
    assert pool.candidates(3, 1, 5) == [(8, 9), (4, 5)]
    assert pool.candidates(3, 1, 0) == [] and pool.candidates(4, 1, 5) == []


def test_shared_pool_stays_within_its_budget_and_evicts_the_least_recently_used_key():
    pool = SharedPool(budget=50, per_key=4)
    rng = np.random.default_rng(0)
    for _ in range(200):  # many requests' worth of text
        pool.insert_sequence(rng.integers(0, 1000, 64).tolist(), int(rng.integers(2, 6)))
        assert len(pool) <= 50
    assert len(pool) == sum(len(e) for e in pool._keys.values()) > 40
    small = SharedPool(budget=2, per_key=4)
    small.insert(1, (2,))
    small.insert(3, (4,))
    small.candidates(2, 1, 1)  # reading key 1 makes key 3 the least recently used
    small.insert(5, (6,))
    assert small.candidates(2, 3, 1) == [] and small.candidates(2, 1, 1) == [(2,)] and len(small) == 2


@pytest.mark.parametrize(("budget", "per_key"), [(-1, 2), (10, 0)])
def test_shared_pool_bad_arguments(budget, per_key):
    with pytest.raises(ValueError):
        SharedPool(budget, per_key)


def _seeded(prompt: list[int], shared: SharedPool | None) -> RequestDecoder:
    decoder = RequestDecoder(LookaheadConfig(2, 3, 4), prompt, 8, shared=shared)
    decoder.setup(prompt[-1])
    return decoder


def test_shared_candidates_come_after_the_own_pool_and_request_scope_sees_none():
    shared = SharedPool()
    _seeded([5, 6, 7, 9, 9, 5, 8, 8], shared)  # another request's text: 5 -> (6, 7) and (8, 8)
    own = _seeded([1, 5, 2, 3, 5], shared)  # its own: 5 -> (2, 3); x_t = 5
    assert own.pool.candidates(5, 4) == [((2, 3), PROMPT)]
    assert own.draft_supply() == 3
    own.prepare(own.config, *(np.zeros(64, np.int64) for _ in range(2)), np.zeros(3, np.int32),
                np.zeros(64, np.int64))
    assert own.candidates == [((2, 3), PROMPT), ((8, 8), SHARED), ((6, 7), SHARED)]
    isolated = _seeded([1, 5, 2, 3, 5], None)  # request scope: no n-gram only another request held
    assert isolated.draft_supply() == 1
    assert {c for c, _ in isolated._pool_candidates(4)} == {(2, 3)}
