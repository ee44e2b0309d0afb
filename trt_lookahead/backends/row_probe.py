"""Row-invariance probes of the CPU exact step: does this machine's BLAS give a row the same bits whatever the
number of rows sharing its call (docs/design.md 4.2)? Each probe runs once per shape, dtype and thread count.

`row_invariant_ops` gives the exact step's projections: a 1-row input runs as 2 rows where 1 row rounds
otherwise, and a projection whose GEMM reduces otherwise above some row count runs in calls of at most that
many rows. `step_variance` says why a machine cannot run the exact step. May import model and kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from trt_lookahead.kernels.reference import KEY_BLOCK, ROW_MULTIPLE, VALUE_WIDTH
from trt_lookahead.model.llama import Linear, Llama, Ops

# row counts a probe feeds a projection, each against 2-row calls: every count up to 33 (2 aside), then around the
# blockings CPU GEMMs switch at. torch 2.13's oneDNN differs at 1 row only on an AMD EPYC, and in float32 on an
# Intel Xeon with AMX, where in bfloat16 it reduces otherwise from 33 rows on; on the H200 machine's Xeon at every
# even count from 18 on (a 1536 -> 128 projection), so no count below the limit goes unprobed; torch
# 2.11's on such a Xeon at 16 and more rows in float32 (docs/design.md 4.2).
ROW_PROBES = (1, *range(3, 34), 63, 64, 65, 127, 128)  # not 2: the reference
PROBE_ROWS = 130  # rows a projection probe feeds: even (the 2-row reference calls) and above every count
# query rows a probe feeds BlockedAttention's products: every ROW_MULTIPLE-padded count up to 68
ATTENTION_ROW_PROBES = tuple(range(ROW_MULTIPLE, 69, ROW_MULTIPLE))


def counts_that_differ(fn: Callable[[Tensor], Tensor], x: Tensor, counts: Sequence[int], dim: int = 0,
                       reference: int | None = None, calls: int | None = None) -> tuple[int, ...]:
    """The counts M at which some row of x (rows along `dim`), fed to fn M contiguous rows at a time (the first
    `calls` such calls; None: every row, as random rows need: in bfloat16 another order shows in only 8-22% of
    them), gets other bits than fed `reference` rows at a time (None: one call of all x)."""
    rows = x.shape[dim]
    with torch.inference_mode():
        step = reference or rows
        full = torch.cat([fn(x.narrow(dim, i, min(step, rows - i))) for i in range(0, rows, step)], dim)
        return tuple(
            M for M in counts
            if any(not torch.equal(fn(x.narrow(dim, i, M).contiguous()), full.narrow(dim, i, M))
                   for i in range(0, rows - M + 1, M)[:calls])
        )


def projection_rows_differ(module: Linear) -> tuple[int, ...]:
    """The row counts of ROW_PROBES at which a projection of the module's shape, dtype and layout gives a row
    other bits than in 2-row calls (`cancelling_probe`'s rows, where another order shows in almost every output:
    two calls per count suffice, and a wide lm_head's probe costs a fifth of feeding every row at each)."""
    key = (module.layout, module.in_features, module.out_features, module.weight.dtype, torch.get_num_threads())
    if key not in _PROJECTIONS:
        probe, x = cancelling_probe(module, PROBE_ROWS)
        _PROJECTIONS[key] = counts_that_differ(probe, x, ROW_PROBES, reference=2, calls=2)
    return _PROJECTIONS[key]


def cancelling_probe(module: Linear, rows: int) -> tuple[Linear, Tensor]:
    """A projection like `module` and `rows` rows for it whose outputs are mostly the GEMM's rounding residue:
    weight [w, -w, r / 64] against rows [a, a, b], w and a spread over 2^-6 .. 2^6. Any other reduction order
    then shows in almost every output, where random rows show one in bfloat16 in about 1 output in 10^4."""
    g, N, K, dtype = torch.Generator().manual_seed(0), module.out_features, module.in_features, module.weight.dtype
    half = (K - 1) // 2

    def spread(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-6, 7, shape, generator=g).float())

    w, a = spread(N, half), spread(rows, half)
    probe = Linear(K, N, bias=False, device="meta")  # its weight is set below, not initialised
    weight = torch.cat([w, -w, torch.randn(N, K - 2 * half, generator=g) / 64], 1)  # [N, K]
    probe.weight = nn.Parameter(weight.to(dtype).to(module.weight.device), requires_grad=False)
    probe.set_layout(module.layout)
    x = torch.cat([a, a, torch.randn(rows, K - 2 * half, generator=g)], 1)  # [rows, K]
    return probe, x.to(dtype).to(module.weight.device)


_PROJECTIONS: dict[tuple, tuple[int, ...]] = {}  # projection_rows_differ's measurements


def projection_max_rows(module: Linear) -> int:
    """The most rows the exact step feeds the projection in one call: the last probed count before the first
    that differs from 2-row calls (1 aside: it is padded), else the largest probed (larger calls are unproven:
    oneDNN's bfloat16 GEMM packed for 1 row reduces otherwise from 160 rows on, on an Intel Xeon with AMX)."""
    counts = sorted({2, *ROW_PROBES} - {1})  # 2 is the reference, so it never differs
    first = next((i for i, M in enumerate(counts) if M in projection_rows_differ(module)), len(counts))
    return counts[first - 1]


def row_invariant_ops(model: Llama) -> Ops:
    """The CPU exact step's projections: those whose 1-row path rounds otherwise run a 1-row input as 2 rows,
    those whose reduction changes above some row count run in calls of at most that many rows.

    oneDNN's packed linear reduces a 1-row input of 1536 or more columns in another order than 2 or more rows
    (SmolLM2-135M's down projection, float32 and bfloat16); padding every projection instead cost 1.22x the fast
    step per greedy token in float32. Its bfloat16 GEMM on AMX reduces otherwise from 33 rows on. Measured for
    the model's layout and the thread count now.
    """
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    pad = frozenset(m for m in linears if 1 in projection_rows_differ(m))
    return Ops(one_row_as_two=pad, max_rows={m: projection_max_rows(m) for m in linears})


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
    """Why the CPU exact step's attention products give a row other bits by row count on this machine, or None
    (its projections run in calls of the row counts the probe found invariant: `row_invariant_ops`)."""
    return attention_variance(model.cfg.head_dim, torch.get_num_threads())
