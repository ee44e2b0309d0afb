"""The executor's id choice by chunk maxima: `top_k_ids` (the recycled drafts' top-k; the torch executor's and
the engine executors' numpy twin) against a full sort, and `first_max_ids` (the greedy id) against the first
maximum found by a plain loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trt_lookahead.kernels.sampling_torch import first_max_ids, top_k_ids
from trt_lookahead.lookahead import sampling
from trt_lookahead.lookahead.sampling import TOP_CHUNK


def numpy_top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    return torch.from_numpy(sampling.top_k_ids(logits.numpy(), k))


TWINS = pytest.mark.parametrize("top_k", [top_k_ids, numpy_top_k_ids], ids=["torch", "numpy"])


def assert_top_k(logits: torch.Tensor, ids: torch.Tensor, k: int) -> None:
    """ids [R, k] hold k distinct ids per row whose logits are the row's k largest, largest first."""
    expected = torch.sort(logits, dim=-1, descending=True).values[:, :k]
    assert ids.shape == (logits.shape[0], k) and ids.dtype == torch.int64
    assert all(len(set(row)) == k for row in ids.tolist())
    assert torch.equal(logits.gather(1, ids), expected)


@TWINS
@pytest.mark.parametrize("vocab", [49152, 50257, 32000, 9 * TOP_CHUNK, 300, 70, 8])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_the_k_largest_of_random_rows(top_k, vocab, k):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab + k))
    assert_top_k(logits, top_k(logits, k), k)


@TWINS
@pytest.mark.parametrize("seed", range(4))
def test_ties_and_crowded_chunks(top_k, seed):
    """Few distinct values (ties everywhere), and the largest all in one chunk or past the last whole chunk."""
    g = torch.Generator().manual_seed(seed)
    vocab = 40 * TOP_CHUNK + 23
    ties = torch.randint(0, 4, (5, vocab), generator=g).float()
    crowded = torch.randn(5, vocab, generator=g)
    crowded[0, 3 * TOP_CHUNK : 3 * TOP_CHUNK + 8] += 50.0  # the top 8 share chunk 3
    crowded[1, -20:] += 50.0  # the top ids are all in the partial chunk at the end
    crowded[2, ::TOP_CHUNK] += 50.0  # one of the top in every chunk
    for logits in (ties, crowded):
        assert_top_k(logits, top_k(logits, 8), 8)


def test_numpy_logits_not_contiguous():
    """The engine backends pass numpy rows gathered from a [B, K, V] buffer."""
    logits = np.random.default_rng(0).standard_normal((4, 3, 1000)).astype(np.float32)[:, 1]
    ids = torch.from_numpy(sampling.top_k_ids(logits, 8))
    assert_top_k(torch.from_numpy(np.ascontiguousarray(logits)), ids, 8)


@pytest.mark.parametrize("vocab", [49152, 50257, 9 * TOP_CHUNK, 300, 70, 64, 8])
def test_first_max_is_argmax_ties_included(vocab):
    """The first id of the maximum, as torch.argmax: random rows, rows of few values (ties), the maximum past
    the last whole chunk, and tied between a chunk and the tail."""
    g = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(4, vocab, generator=g), torch.randint(0, 3, (16, vocab), generator=g).float()]
    edge = torch.zeros(3, vocab)
    edge[0, -1] = 1.0  # the last id
    edge[1, [0, -1]] = 1.0  # tied between the first chunk and the tail: the first wins
    edge[2, [vocab // 2, -1]] = 1.0
    for logits in (*rows, edge):
        got = first_max_ids(logits)
        assert got.dtype == torch.int64
        assert got.tolist() == [max(range(vocab), key=lambda v, r=r: (r[v], -v)) for r in logits.tolist()]
