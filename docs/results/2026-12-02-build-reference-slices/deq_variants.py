"""One 8B-shaped gate/up projection (28672 x 4096, int4 blocks) times 12 rows, as the smoke check's reference
multiplies it: a slice of whole output channels made dense at a time, at several slice sizes (2 ** c weights),
for three ways of making a slice dense, alternating. Prints the medians of 7; every product equals the landed one's."""

import time

import numpy as np
import torch
import torch.nn.functional as F

from trt_lookahead.engine.quantize import quantize_blocks, quantized_linear
from trt_lookahead.model.llama import QuantizedLinear

torch.set_num_threads(2)
rng = np.random.default_rng(0)
n, k = 28672, 4096
module = quantized_linear(quantize_blocks(rng.standard_normal((n, k), dtype=np.float32), 4))
x = torch.randn(12, k)
reference = module(x)
TABLE = torch.stack([torch.arange(256) & 0xF, torch.arange(256) >> 4], -1).float()  # a code byte's two nibbles


def out_of_place(self: QuantizedLinear, rows: slice) -> torch.Tensor:
    """The session start's arithmetic: a new tensor per operation."""
    codes, zeros, scales = self.codes[rows], self.zero_points[rows], self.scales[rows]
    m, blocks = scales.shape
    codes = torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2)
    zeros = torch.stack([zeros & 0xF, zeros >> 4], -1).flatten(-2)[:, :blocks]
    w = (codes.view(m, blocks, -1).float() - zeros[..., None].float()) * scales[..., None]
    return w.flatten(1)[:, : self.in_features]


def lookup(self: QuantizedLinear, rows: slice) -> torch.Tensor:
    """Each code byte's two floats from a 256-entry table, then in place."""
    codes, zeros, scales = self.codes[rows], self.zero_points[rows], self.scales[rows]
    m, blocks = scales.shape
    w = TABLE[codes.int()].view(m, blocks, -1)
    zeros = torch.stack([zeros & 0xF, zeros >> 4], -1).flatten(-2)[:, :blocks]
    w.sub_(zeros[..., None].float()).mul_(scales[..., None])
    return w.flatten(1)[:, : self.in_features]


def product(dense, c: int) -> torch.Tensor:
    rows = max(1, (1 << c) // k)
    return torch.cat([F.linear(x, dense(module, slice(first, first + rows))) for first in range(0, n, rows)], -1)


VARIANTS = {"out of place": out_of_place, "in place (landed)": QuantizedLinear.dense_weight, "lookup": lookup}
for c in (17, 18, 19, 20, 21, 30):  # 2 ** 30: the whole weight in one slice, as before
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(7):  # the variants alternate, so a slower spell of the machine touches each alike
        for name, dense in VARIANTS.items():
            start = time.perf_counter()
            y = product(dense, c)
            times[name].append(time.perf_counter() - start)
            assert torch.equal(y, reference), name
    print(c, {name: round(sorted(t)[3], 3) for name, t in times.items()}, flush=True)
