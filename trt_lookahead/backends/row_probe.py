"""Row-invariance probes of the CPU exact step: does this machine's BLAS give a row the same bits whatever the
number of rows sharing its call (docs/design.md 4.2)? Each probe runs once per shape, dtype and thread count.

`row_invariant_ops` gives the exact step's projections (a 1-row input runs as 2 rows where 1 row rounds
otherwise); `step_variance` says why a machine cannot run the exact step; `exact_weight_layout` is the layout to
hold a model in for it. May import model and kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from trt_lookahead.kernels.reference import KEY_BLOCK, ROW_MULTIPLE, VALUE_WIDTH
from trt_lookahead.model.llama import Linear, Llama, Ops, row_invariant_layouts

# row counts a probe feeds a projection: around the blockings CPU GEMMs switch at. torch 2.13's oneDNN on an
# AMD EPYC differs at 1 row only; torch 2.11's on an Intel Xeon (AMX) at 16 and more rows in float32 and at
# 2, 15, 16 or 33 in bfloat16 (docs/design.md 4.2). The last count is the one call every other is compared with.
ROW_PROBES = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65)
# query rows a probe feeds BlockedAttention's products: every ROW_MULTIPLE-padded count up to 68
ATTENTION_ROW_PROBES = tuple(range(ROW_MULTIPLE, 69, ROW_MULTIPLE))


def counts_that_differ(fn: Callable[[Tensor], Tensor], x: Tensor, counts: Sequence[int], dim: int = 0
                       ) -> tuple[int, ...]:
    """The counts M at which some row of x (rows along `dim`), fed to fn M contiguous rows at a time, gets other
    bits than in one call of all x. Every row is fed at each M: in bfloat16 another order shows in only 8-22% of
    rows."""
    rows = x.shape[dim]
    with torch.inference_mode():
        full = fn(x)
        return tuple(
            M for M in counts
            if any(not torch.equal(fn(x.narrow(dim, i, M).contiguous()), full.narrow(dim, i, M))
                   for i in range(0, rows - M + 1, M))
        )


def projection_rows_differ(module: Linear) -> tuple[int, ...]:
    """The row counts of ROW_PROBES at which the projection gives a row other bits than in 65 rows."""
    key = (module.layout, module.in_features, module.out_features, module.dtype, torch.get_num_threads())
    if key not in _PROJECTIONS:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(ROW_PROBES[-1], module.in_features, generator=g).to(module.dtype)
        _PROJECTIONS[key] = counts_that_differ(module, x.to(module.weight.device), ROW_PROBES[:-1])
    return _PROJECTIONS[key]


_PROJECTIONS: dict[tuple, tuple[int, ...]] = {}  # projection_rows_differ's measurements


def row_invariant_ops(model: Llama) -> Ops:
    """The CPU exact step's projections: those whose 1-row path rounds otherwise run a 1-row input as 2 rows.

    oneDNN's packed linear reduces a 1-row input of 1536 or more columns in another order than 2 or more rows
    (SmolLM2-135M's down projection, float32 and bfloat16); padding every projection instead cost 1.22x the fast
    step per greedy token in float32. Measured for the model's layout and the thread count now.
    """
    pad = frozenset(m for m in model.modules() if isinstance(m, Linear) and 1 in projection_rows_differ(m))
    return Ops(one_row_as_two=pad)


def projection_variance(model: Llama) -> str | None:
    """Why the model's projections are not row-invariant here even with 1-row inputs run as 2, or None."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and (counts := [M for M in projection_rows_differ(module) if M != 1]):
            return (f"projection {name} ({module.in_features} -> {module.out_features}, {module.dtype}, "
                    f"{module.layout} layout, {torch.get_num_threads()} threads) gives a row other bits in a call "
                    f"of {counts[0]} rows than in one of {ROW_PROBES[-1]} on this CPU with torch {torch.__version__}")
    return None


def _score(a: Tensor, b: Tensor) -> Tensor:
    """The score product as BlockedAttention runs it: onto a bias (its mask)."""
    return torch.baddbmm(a.new_zeros(a.shape[0], a.shape[1], b.shape[2]), a, b)


def _times(product: Callable[[Tensor, Tensor], Tensor], b: Tensor, a: Tensor) -> Tensor:
    return product(a, b)


@functools.cache
def attention_variance(head_dim: int, threads: int) -> str | None:
    """Why BlockedAttention's score or value product gives a query row other bits by how many rows share it on
    this CPU and torch (float32, `threads` torch threads), or None."""
    g, rows = torch.Generator().manual_seed(0), ATTENTION_ROW_PROBES[-1]
    width = -(-(head_dim + 1) // VALUE_WIDTH) * VALUE_WIDTH
    products: dict[str, tuple[int, int, Callable[[Tensor, Tensor], Tensor]]] = {
        "score": (head_dim, KEY_BLOCK, _score),
        "value": (KEY_BLOCK, width, torch.bmm),
    }
    for name, (K, N, product) in products.items():
        a, b = torch.randn(2, rows, K, generator=g), torch.randn(2, K, N, generator=g)
        if counts := counts_that_differ(functools.partial(_times, product, b), a, ATTENTION_ROW_PROBES[:-1], 1):
            return (f"BlockedAttention's {name} product ({K} -> {N}, float32, {threads} threads) gives a row "
                    f"other bits in {counts[0]}-row products than in {rows}-row ones on this CPU with torch "
                    f"{torch.__version__}")
    return None


def step_variance(model: Llama) -> str | None:
    """Why the CPU exact step's projections or attention products give a row other bits by row count on this
    machine, or None."""
    return projection_variance(model) or attention_variance(model.cfg.head_dim, torch.get_num_threads())


def exact_weight_layout(model: Llama) -> str:
    """The layout to hold `model`'s projections in for the exact step here: its own, or onednn_fp32 (float32
    weights) where this CPU's bfloat16 GEMM gives a row other bits by row count (Intel Xeons with AMX)."""
    wider = "onednn_fp32" in row_invariant_layouts(model.device, model.dtype) and model.weight_layout != "onednn_fp32"
    return "onednn_fp32" if wider and step_variance(model) else model.weight_layout
