import pytest

from trt_lookahead.lookahead.pool import OUTPUT, PROMPT, WINDOW, NgramPool


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
