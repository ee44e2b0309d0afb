import numpy as np
import pytest

from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.layout import (
    LOOKAHEAD,
    PAD,
    VERIFY,
    StepLayout,
    mask_from_positions,
    pack_mask,
    unpack_mask,
)
from trt_lookahead.lookahead.tree import TreeTemplate

CONFIGS = [(w, n, g) for w in (1, 2, 3, 5, 8) for n in (2, 3, 4, 6) for g in (0, 1, 2, 5)] + [(15, 5, 15), (7, 5, 7)]


def test_design_example_positions():
    # docs/design.md section 2, W=5 N=4 G=2
    expected = "0 1 2 3 4 1 2 3 4 5 2 3 4 5 6 1 2 3 1 2 3"
    lay = StepLayout(LookaheadConfig(5, 4, 2))
    assert lay.rel_positions.tolist() == [int(v) for v in expected.split()]
    assert lay.kinds.tolist() == [LOOKAHEAD] * 15 + [VERIFY] * 6


def test_design_example_mask_rows():
    lay = StepLayout(LookaheadConfig(5, 4, 2))
    sees = {i: np.flatnonzero(lay.mask[i]).tolist() for i in range(lay.step_tokens)}
    assert sees[0] == [0]  # x_t
    assert sees[3] == [0, 1, 2, 3]  # B0 causal
    assert sees[7] == [0, 1, 2, 7]  # B1[2]: B0[0..2] + itself
    assert sees[12] == [0, 1, 2, 7, 12]  # B2[2]: B0[0..2], B1[2], itself
    assert sees[15] == [0, 15]  # V0[0]: x_t + itself
    assert sees[20] == [0, 18, 19, 20]  # V1[2]: x_t + V1[0..2]


def test_small_mask_by_hand():
    lay = StepLayout(LookaheadConfig(2, 2, 1))  # slots: x_t, L0[0], V0[0]
    assert lay.mask.astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    assert lay.packed_mask()[:, 0].tolist() == [0b001, 0b011, 0b101]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_mask_equals_mask_derived_from_positions(cfg):
    lay = StepLayout(LookaheadConfig(*cfg))
    order = lay.dfs_order()
    assert sorted(order.tolist()) == list(range(lay.step_tokens))
    derived = mask_from_positions(lay.rel_positions[order])
    back = np.empty_like(order)
    back[order] = np.arange(len(order))
    assert np.array_equal(derived[np.ix_(back, back)], lay.mask)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_every_slot_sees_a_contiguous_prefix(cfg):
    lay = StepLayout(LookaheadConfig(*cfg))
    for i in range(lay.step_tokens):
        seen = sorted(lay.rel_positions[lay.mask[i]].tolist())
        assert seen == list(range(int(lay.rel_positions[i]) + 1))


@pytest.mark.parametrize("cfg", [(4, 3, 4), (15, 5, 15), (1, 2, 0), (33, 2, 0)])
def test_packed_mask_round_trip(cfg):
    lay = StepLayout(LookaheadConfig(*cfg))
    packed = lay.packed_mask()
    assert packed.dtype == np.int32 and packed.shape == (lay.step_tokens, (lay.step_tokens + 31) // 32)
    assert np.array_equal(unpack_mask(packed, lay.step_tokens), lay.mask)
    i, j = np.argwhere(lay.mask)[-1]
    assert (int(packed[i, j // 32]) >> (j % 32)) & 1 == 1


def test_pack_mask_uses_the_sign_bit():
    mask = np.zeros((1, 32), bool)
    mask[0, 31] = True
    assert pack_mask(mask)[0, 0] == np.int32(-(2**31))


def test_mask_from_positions_rejects_non_tree_orders():
    with pytest.raises(ValueError, match="depth-first"):
        mask_from_positions(np.array([0, 2]))


def test_padding_slots_see_only_themselves():
    lay = StepLayout(LookaheadConfig(2, 3, 1), padded_tokens=10)
    assert lay.step_tokens == 10
    assert lay.kinds[6:].tolist() == [PAD] * 4
    assert lay.rel_positions[6:].tolist() == [0] * 4
    assert np.array_equal(lay.mask[6:], np.eye(10, dtype=bool)[6:])
    assert not lay.mask[:6, 6:].any()
    with pytest.raises(ValueError, match="cannot pad"):
        StepLayout(LookaheadConfig(4, 3, 4), padded_tokens=8)


def test_output_slots_cover_what_the_decoder_reads():
    lay = StepLayout(LookaheadConfig(15, 5, 15))
    out = set(lay.output_slots.tolist())
    assert 0 in out
    assert set(lay.candidate_slots.ravel().tolist()) <= out
    assert set(lay.chain_slots.tolist()) <= out
    assert set(lay.window_slots[-1].tolist()) <= out
    assert len(out) == 1 + 2 + 15 + 60  # x_t, chain B1[0] B2[0], newest level, candidates
    assert not set(lay.window_slots[0, 1:].tolist()) & out


def test_newest_level_for_bigram_window():
    lay = StepLayout(LookaheadConfig(4, 2, 3))
    assert lay.newest_level_slots.tolist() == [1, 2, 3]
    assert lay.chain_slots.size == 0


def test_previous_slots_by_hand():
    """Each slot's token one position earlier in what it sees: W=2 N=3 G=1 is B0 = 0 1, B1 = 2 3, V0 = 4 5 (verify's
    worked example); a tree (x_t -> a -> {b, c}; x_t -> d) at W=1 N=3 G=2 is B0 = 0, B1 = 1, nodes 2..5."""
    assert StepLayout(LookaheadConfig(2, 3, 1)).previous_slots.tolist() == [-1, 0, 0, 1, 0, 4]
    tree = TreeTemplate((-1, 0, 0, -1))
    assert StepLayout(LookaheadConfig(1, 3, 2), tree=tree).previous_slots.tolist() == [-1, 0, 0, 2, 2, 0]
    padded = StepLayout(LookaheadConfig(2, 3, 1), padded_tokens=8).previous_slots.tolist()
    assert padded == [-1, 0, 0, 1, 0, 4, -1, -1]  # pads see only themselves
