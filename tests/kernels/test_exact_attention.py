"""BlockedAttention (kernels/reference.py): a row's output depends only on its query and the keys it sees at
their positions, to the bit, whatever else the call holds (docs/design.md section 4.2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trt_lookahead.kernels.mask import step_mask
from trt_lookahead.kernels.reference import (
    KEY_BLOCK,
    BlockedAttention,
    chain_shape,
    pack_mask,
    plan_chains,
    relative_error,
)
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.tree import tree_template

CONFIGS = [(4, 3, 4), (7, 5, 7), (2, 4, 3), (1, 2, 0), (15, 5, 15), (3, 2, 5)]
HEADS = [(8, 4, 8), (9, 3, 64), (4, 4, 16), (6, 1, 32)]  # (Hq, Hkv, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("seed", range(6))
def test_a_rows_output_is_its_chain_alone(dtype, seed):
    """Every slot of a lookahead step == the last row of a causal step over its chain alone (plain decoding)."""
    rng = np.random.default_rng(seed)
    Hq, Hkv, D = HEADS[seed % len(HEADS)]
    layout = StepLayout(LookaheadConfig(*CONFIGS[seed % len(CONFIGS)]))
    T = layout.step_tokens
    P = int(rng.choice([0, KEY_BLOCK - 1, KEY_BLOCK, 3 * KEY_BLOCK - 5, int(rng.integers(1, 300))]))
    q = torch.from_numpy(rng.standard_normal((T, Hq, D))).to(dtype)
    k = torch.from_numpy(rng.standard_normal((P + T, Hkv, D))).to(dtype)
    v = torch.from_numpy(rng.standard_normal((P + T, Hkv, D))).to(dtype)
    step = BlockedAttention(layout.mask, P, Hq, Hkv, D, dtype)(q, k, v)
    for i in range(T):
        seen = np.flatnonzero(layout.mask[i])
        chain = seen[np.argsort(layout.rel_positions[seen])]  # its step keys in position order, itself last
        n = len(chain)
        keys = torch.cat([k[:P], k[P + chain]])  # stored at their positions' rows, as plain decoding has them
        values = torch.cat([v[:P], v[P + chain]])
        alone = BlockedAttention(np.tril(np.ones((n, n), bool)), P, Hq, Hkv, D, dtype)(q[chain], keys, values)
        assert torch.equal(step[i], alone[-1]), (i, (step[i].double() - alone[-1].double()).abs().max().item())


def test_blocked_attention_is_attention():
    """Against a dense float64 softmax: same numbers up to float32 rounding."""
    rng = np.random.default_rng(0)
    layout = StepLayout(LookaheadConfig(4, 3, 4))
    T, P, Hq, Hkv, D = layout.step_tokens, 150, 8, 2, 16
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).float() for s in ((T, Hq, D), (P + T, Hkv, D), (P + T, Hkv, D)))
    out = BlockedAttention(layout.mask, P, Hq, Hkv, D, torch.float32)(q, k, v)
    allowed = torch.cat([torch.ones(T, P, dtype=torch.bool), torch.from_numpy(layout.mask.copy())], 1)
    kk, vv = (x.double().repeat_interleave(Hq // Hkv, 1) for x in (k, v))
    scores = torch.einsum("thd,shd->hts", q.double(), kk) / D**0.5
    expected = torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)
    assert relative_error(out, expected) < 1e-6


def test_a_mask_that_is_not_a_chain_is_refused():
    mask = np.eye(4, dtype=bool)
    mask[3, [0, 1]] = True  # row 3 sees two step tokens that both sit at the step's first position
    with pytest.raises(ValueError, match="not a chain of positions"):
        BlockedAttention(mask, 10, 4, 2, 8, torch.float32)


@pytest.mark.parametrize(("nodes", "depth", "W", "N"), [(6, 3, 3, 4), (12, 4, 4, 5), (30, 6, 5, 4)])
def test_a_tree_nodes_output_is_its_path_alone(nodes, depth, W, N):
    """With a tree template's verification slots (kernels/mask.py tree_ends), each node == its path alone."""
    rng = np.random.default_rng(nodes)
    G = nodes // (N - 1)
    mask = step_mask((W + G) * (N - 1), (W, N, G), tree_template(nodes, depth).table)
    T, P, Hq, Hkv, D = len(mask), int(rng.integers(50, 150)), 6, 2, 16
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).float() for s in ((T, Hq, D), (P + T, Hkv, D), (P + T, Hkv, D)))
    step = BlockedAttention(mask, P, Hq, Hkv, D, torch.float32)(q, k, v)
    rel = mask.sum(1) - 1  # a node's depth (its position - cache_len)
    for i in range(T):
        seen = np.flatnonzero(mask[i])
        chain = seen[np.argsort(rel[seen])]
        n = len(chain)
        keys, values = torch.cat([k[:P], k[P + chain]]), torch.cat([v[:P], v[P + chain]])
        alone = BlockedAttention(np.tril(np.ones((n, n), bool)), P, Hq, Hkv, D, torch.float32)(q[chain], keys, values)
        assert torch.equal(step[i], alone[-1]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_planned_step_serves_every_layer_alike(dtype):
    """One plan, called once per layer, reuses its buffers: a call's output is its own (a later call leaves it
    as it was) and has the bits a fresh plan gives, whatever the call before it held."""
    rng = np.random.default_rng(3)
    layout = StepLayout(LookaheadConfig(4, 3, 4))  # lookahead branches: the own-block path runs too
    T, P, Hq, Hkv, D = layout.step_tokens, 2 * KEY_BLOCK + 7, 9, 3, 64
    layers = [tuple(torch.from_numpy(rng.standard_normal(s)).to(dtype) for s in ((T, Hq, D), (P + T, Hkv, D),
                                                                                  (P + T, Hkv, D))) for _ in range(3)]
    plan = BlockedAttention(layout.mask, P, Hq, Hkv, D, dtype)
    outs = [plan(*layer) for layer in layers]
    for out, layer in zip(outs, layers, strict=True):
        assert torch.equal(out, BlockedAttention(layout.mask, P, Hq, Hkv, D, dtype)(*layer))
    assert not torch.equal(outs[0], outs[1])


def test_a_mask_that_is_not_a_tree_is_refused():
    mask = np.eye(4, dtype=bool)
    mask[2, 0] = True  # slot 2 sees slot 0 (its parent), at position 1
    mask[3, [1, 2]] = True  # slot 3 sees slots 1 (position 0) and 2 (position 1), but not slot 2's parent 0
    with pytest.raises(ValueError, match="not a tree"):
        BlockedAttention(mask, 10, 4, 2, 8, torch.float32)


def test_branch_slots_share_their_leaf_chains_layout():
    """2/3/1, by hand (lookahead/layout.py): slots x_t B0[1] | B1[0] B1[1] | c0[0] c0[1] at r = 0 1 | 1 2 | 1 2.
    B1[0] sees x_t; B1[1] sees x_t, B0[1]; c0[1] sees x_t, c0[0]. Branch slots (a key away from its position's
    row): 2, 3, 4, 5; leaves (seen by no other): 2, 3, 5; c0[0] (slot 4) rides on c0[1]'s layout."""
    mask = StepLayout(LookaheadConfig(2, 3, 1)).mask
    shape = chain_shape(pack_mask(mask), 6, 1)
    assert shape is not None
    assert [list(r[real]) for r, real in zip(shape.row, shape.real, strict=True)] == [[2], [3], [4, 5]]
    assert shape.real.shape == (3, 4)  # one query head per KV head: 2 rows, padded to ROW_MULTIPLE
    P = KEY_BLOCK - 1  # x_t at position 63: the chains cross into block 1
    chains = plan_chains(mask, P, 1)
    assert chains is not None and chains.first == 0 and chains.layout.shape == (3, 2 * KEY_BLOCK)
    x = slice(P, P + 3)  # positions P, P + 1, P + 2 hold these K/V rows (the step's slot j is row P + j)
    assert list(chains.layout[0, x]) == [P, P + 2, 0]  # B1[0]: x_t, itself; nothing at P + 2
    assert list(chains.layout[1, x]) == [P, P + 1, P + 3]  # B1[1]: x_t, B0[1], itself
    assert list(chains.layout[2, x]) == [P, P + 4, P + 5]  # c0[1]: x_t, c0[0], itself
    assert list(chains.key[2, 0, x]) == [P, P + 4, P + 1]  # c0[0] at P + 2 reads a key it does not see (B0[1])
    assert list(chains.key[2, 1, x]) == [P, P + 4, P + 5]
    assert (chains.key[:, :, :P] == np.arange(P)).all()  # the cached keys, at their own rows
