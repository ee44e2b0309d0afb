"""kernels/padded_attention.py's fast mode (`step_attention`, the op kernels/step_ops.py `padded_attention`):
attention of a padded step over each slot's own keys, the step mask evaluated in registers, against a float64
softmax over the mask kernels/mask.py `step_mask` gives. Compiled on a GPU; interpreted (TRITON_INTERPRET=1,
tests/conftest.py) without one. (The exact mode: tests/kernels/test_invariant.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trt_lookahead.backends.devices import gpu_count
from trt_lookahead.kernels import padded_attention, reference, step_ops
from trt_lookahead.kernels.mask import CAUSAL, step_mask, tree_ends
from trt_lookahead.lookahead.tree import TreeTemplate, tree_template

DTYPES = pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)],
                                 ids=["float32", "bfloat16"])
HEADS = pytest.mark.parametrize("Hq,Hkv", [(4, 2), (2, 2)], ids=["gqa", "mha"])
DEVICE = "cuda" if gpu_count() else "cpu"
T, D = 16, 16
TREE = tree_template(8, 3)  # covers the 8 verification slots of 2/3/4, not the 12 of 2/3/6
# (cache_len, (W, N, G)) per row: an empty cache, a causal row, lookahead rows, one long enough for 3 chunks of 64
ROWS = [(0, (2, 3, 1)), (37, CAUSAL), (150, (2, 3, 4)), (9, (2, 3, 6)), (70, (4, 3, 4))]
SLOT_ROWS = 176  # S: the longest row's 150 + T keys, and rows it never reads


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def row_mask(config: tuple[int, int, int], tree: TreeTemplate | None) -> np.ndarray:
    """[T, T]: the step mask of a row; a tree lays the verification slots only where it has G(N-1) nodes."""
    _, N, G = config
    covered = tree is not None and tree.nodes >= G * (N - 1)
    return step_mask(T, config, tree.table if covered else None)


def expected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list, tree: TreeTemplate | None,
             S: int) -> torch.Tensor:
    """float64 softmax(q k^T / sqrt(D)) v per row over its cache_len cached keys and its T step keys only."""
    Hq, Hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, (cache_len, config) in enumerate(rows):
        seen = np.ones((T, cache_len + T), bool)
        seen[:, cache_len:] = row_mask(config, tree)
        qb = q[b * T : (b + 1) * T].cpu().double()  # [T, Hq, D]
        kb, vb = (x[b * S : b * S + cache_len + T].cpu().double().repeat_interleave(Hq // Hkv, 1) for x in (k, v))
        scores = torch.einsum("thd,khd->htk", qb, kb) * reference.default_scale(D)
        weights = torch.softmax(scores.masked_fill(~torch.from_numpy(seen), float("-inf")), -1)
        out[b * T : (b + 1) * T] = torch.einsum("htk,khd->thd", weights, vb)
    return out


def step_inputs(rows: list, Hq: int, Hkv: int, dtype: torch.dtype, S: int = SLOT_ROWS, spare: int = 3):
    """q, the caches (`spare` rows past the last slot), cache_len and config: int64 views of one staging matrix
    [rows, 6] (other columns, then cache_len, W, N, G), strided as the executor's step inputs are."""
    q = randn(len(rows) * T, Hq, D, dtype=dtype, seed=0)
    k = randn(len(rows) * S + spare, Hkv, D, dtype=dtype, seed=1)
    v = randn(len(rows) * S + spare, Hkv, D, dtype=dtype, seed=2)
    staged = torch.tensor([[-7, -7, c, *cfg] for c, cfg in rows], dtype=torch.int64, device=DEVICE)
    return q, k, v, staged[:, 2], staged[:, 3:]


def ends(tree: TreeTemplate | None) -> torch.Tensor:
    """The op's tree_ends: the template's table padded to T (int64), or empty for linear candidates."""
    table = np.zeros(0, np.int64) if tree is None else tree_ends(tree.table, T)
    return torch.from_numpy(table).to(DEVICE)


@DTYPES
@HEADS
@pytest.mark.parametrize("tree", [None, TREE], ids=["linear", "tree"])
def test_step_attention_is_attention_under_the_step_mask(dtype, tolerance, Hq, Hkv, tree):
    """Rows of other cache lengths and configs in one call, in one chunk (the op's) and in chunks of 64 keys
    merged by the combine kernel (the 150-key row spans 3): each row's queries see its cached keys and the step
    keys its (W, N, G) shows them, through the tree where it covers the row's verification slots."""
    q, k, v, cache_len, config = step_inputs(ROWS, Hq, Hkv, dtype)
    want = expected(q, k, v, ROWS, tree, SLOT_ROWS)
    whole = step_ops.padded_attention(q, k, v, cache_len, config, ends(tree), SLOT_ROWS)
    assert whole.dtype == dtype and whole.shape == q.shape
    assert reference.relative_error(whole.cpu(), want) <= tolerance
    split = padded_attention.step_attention(q, k, v, cache_len, config, ends(tree), SLOT_ROWS, chunk=64)
    assert reference.relative_error(split.cpu(), want) <= tolerance


def test_the_tree_changes_only_the_rows_it_covers():
    """The tree's mask differs from the linear one on the 2/3/4 row it covers, and not on the 2/3/6 row it is
    too small for (so the kernel's per-row coverage is what is checked above, not a mask that never differs)."""
    assert not np.array_equal(row_mask((2, 3, 4), TREE), row_mask((2, 3, 4), None))
    assert np.array_equal(row_mask((2, 3, 6), TREE), row_mask((2, 3, 6), None))


@pytest.mark.parametrize("tree", [None, TREE], ids=["linear", "tree"])
def test_step_attention_reads_only_each_slots_keys(tree):
    """Every cache row at or past a slot's cache_len + T (and past the last slot) holds NaN: the output is finite
    and has the bits it has when those rows hold zeros, whether one chunk or several."""
    rows = [(0, CAUSAL), (100, (2, 3, 4)), (45, (4, 3, 4))]
    q, k, v, cache_len, config = step_inputs(rows, 4, 2, torch.float32, S=128)
    for b, (length, _) in enumerate(rows):
        k[b * 128 + length + T : (b + 1) * 128] = 0.0
        v[b * 128 + length + T : (b + 1) * 128] = 0.0
    k[len(rows) * 128 :], v[len(rows) * 128 :] = 0.0, 0.0
    k_nan, v_nan = k.clone(), v.clone()
    for cache in (k_nan, v_nan):
        for b, (length, _) in enumerate(rows):
            cache[b * 128 + length + T : (b + 1) * 128] = float("nan")
        cache[len(rows) * 128 :] = float("nan")
    for chunk in (padded_attention.STEP_KEY_CHUNK, 32):
        clean = padded_attention.step_attention(q, k, v, cache_len, config, ends(tree), 128, chunk=chunk)
        dirty = padded_attention.step_attention(q, k_nan, v_nan, cache_len, config, ends(tree), 128, chunk=chunk)
        assert torch.isfinite(dirty).all(), chunk
        assert torch.equal(dirty, clean), chunk


def test_step_attention_runs_in_a_compiled_graph():
    """The op is one opaque node of a torch.compile(fullgraph=True) graph (its fake gives the shape) and the
    compiled function computes what the eager one does."""
    rows = [(20, (2, 3, 1)), (0, CAUSAL)]
    q, k, v, cache_len, config = step_inputs(rows, 4, 2, torch.float32, S=64)
    table = ends(None)

    def step(q: torch.Tensor) -> torch.Tensor:
        return step_ops.padded_attention(q * 2.0, k, v, cache_len, config, table, 64) + 1.0

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(q), step(q))


def test_step_attention_names_a_bad_shape():
    q, k, v, cache_len, config = step_inputs([(5, CAUSAL)], 2, 2, torch.float32, S=32)
    with pytest.raises(ValueError, match=r"config \[2, 3\] do not hold 1 rows"):
        padded_attention.step_attention(q, k, v, cache_len, config.repeat(2, 1), ends(None), 32)
    with pytest.raises(ValueError, match="do not hold 1 slots of 64"):
        padded_attention.step_attention(q, k, v, cache_len, config, ends(None), 64)
    with pytest.raises(ValueError, match=r"tree_ends must be \[>= 32\]"):
        padded_attention.step_attention(q, k, v, cache_len, config, torch.zeros(8, dtype=torch.int64), 32)
