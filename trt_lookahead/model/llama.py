"""A compact torch Llama (in the spirit of gpt-fast) whose KV cache is passed in, not owned.

Several executors share one model's weights, each with its own cache, so `Llama.forward` takes the
cache and the step description as arguments:

    logits = model(input_ids[T] long, positions[T] long,
                   k_cache, v_cache,          # [layers, S, kv_heads, head_dim] each, model dtype
                   cache_len,                 # 0-dim long tensor p: rows 0..p-1 are cached tokens
                   step_mask,                 # [T, T] bool, step_mask[i, j]: step token i sees step token j
                   output_slots=None,         # LongTensor [k] of step slots that need logits (None: all)
                   attention=None,            # per-call override of `model.attention`
                   cache_rows=None,           # LongTensor [T]: the cache row of each token (None: p + i)
                   ops=None)                  # Ops: per-call projections and norms (None: the modules')
             -> [k or T, vocab]

The step's K/V are written into cache rows p .. p+T-1 (or `cache_rows`: a batched executor packs many
requests' tokens into one call, each writing into its own slot's rows); every query sees rows 0..p-1
and the step rows its `step_mask` row allows. The final norm and lm_head run only at `output_slots`.
With k_cache = v_cache = None nothing is written: each layer's attention gets the step's own K/V
[T, Hkv, D] as its cache (the ONNX export pairs them with the graph's cache inputs itself).

Attention seam: every layer calls `attention(q, k_cache_layer, v_cache_layer, cache_len, step_mask)`
with q [T, Hq, D] (RoPE applied), the layer's cache [S, Hkv, D] (step rows already written) and
returns [T, Hq, D]; softmax scale is D**-0.5, query head h uses KV head h // (Hq // Hkv). The
default `sdpa_attention` slices keys to p+T rows (needs p on the host: CPU, eager); the
`sdpa_attention_static` variant attends over all S rows with a mask computed from `cache_len` as a
tensor (no host sync, fixed shapes: for CUDA-graph capture and export). Replace it with a custom op
(e.g. a LookaheadAttention plugin node for ONNX/TensorRT) by passing `attention=` to the
constructor, assigning `model.attention`, or passing `attention=` to one forward call.

Ops seam: `ops=Ops(linear, rms_norm)` replaces every projection (`linear(x, weight [out, in], bias)`, the
lm_head included) and every RMSNorm (`rms_norm(x, weight, eps)`) of one call; the CUDA exact step passes
row-invariant kernels there (kernels/invariant.py) as it passes its attention.

Weights: q/k/v are fused into `wqkv` and gate/up into `w13` (gpt-fast style; `checkpoint.to_state_dict`
maps HF names). Projections are `Linear`s with a switchable layout (`Llama.set_weight_layout`):
'out_in' (nn.Linear's; export, CUDA) or, for the CPU executor, 'onednn' (oneDNN-packed weights,
1.5-3x faster than MKL sgemm on one core and batch-invariant) or 'in_out'. Quantized weights
(engine/quantize.py `quantize_model`) make the projections `QuantizedLinear`s, int8 or int4 blocks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trt_lookahead.errors import UserError

AttentionFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
# a layer's caches: the whole stacked K and V caches [layers, S, kv_heads, head_dim], the layer, and the layer as a
# 0-dim long tensor (an index of the caches' first dim); a layer given None has no cache (the ONNX export's)
LayerCache = tuple[Tensor, Tensor, int, Tensor]
LinearFn = Callable[[Tensor, Tensor, Tensor | None], Tensor]  # (x [.., in], weight [out, in], bias) -> [.., out]
NormFn = Callable[[Tensor, Tensor, float], Tensor]  # (x [.., H], weight [H], eps) -> [.., H]


@dataclass(frozen=True, eq=False)
class Ops:
    """The projections and norms of one forward (the seam beside `attention`); None: the modules' own.
    one_row_as_two: projections whose 1-row path rounds otherwise; they run a 1-row input as 2 rows, the second
    zeros. max_rows: projections whose GEMM reduces otherwise above that many rows; they run in calls of at
    most that many (backends/row_probe.py measures both). after: what follows a projection's product, once for
    all its rows (tensor parallelism's collectives, backends/tensor_parallel.py)."""

    linear: LinearFn | None = None
    rms_norm: NormFn | None = None
    quantized: Callable[[Tensor, QuantizedLinear], Tensor] | None = None  # projections on quantized weights
    one_row_as_two: frozenset[nn.Module] = frozenset()
    max_rows: Mapping[nn.Module, int] = field(default_factory=dict)
    after: Mapping[nn.Module, Callable[[Tensor], Tensor]] = field(default_factory=dict)

    def project(self, module: Linear | QuantizedLinear, x: Tensor) -> Tensor:
        y = self._product(module, x)
        then = self.after.get(module)
        return y if then is None else then(y)

    def _product(self, module: Linear | QuantizedLinear, x: Tensor) -> Tensor:
        rows = x.shape[0]
        if rows == 1 and module in self.one_row_as_two:
            return self._product(module, torch.cat([x, torch.zeros_like(x)]))[:1]
        if rows > (limit := self.max_rows.get(module, rows)):
            return torch.cat([self._product(module, part) for part in x.split(limit)])  # [rows, out]
        if isinstance(module, QuantizedLinear):
            return module(x) if self.quantized is None else self.quantized(x, module)
        return module(x) if self.linear is None else self.linear(x, module.dense_weight(), module.bias)

    def norm(self, module: RMSNorm, x: Tensor) -> Tensor:
        return module(x) if self.rms_norm is None else self.rms_norm(x, module.weight, module.eps)


MODULE_OPS = Ops()

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Llama dimensions and constants, read from a Hugging Face config.json (`from_hf`)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    # None, or a dict with "rope_type" in SUPPORTED_ROPE_TYPES plus its parameters
    # (linear: factor; llama3: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_scaling: dict | None = field(default=None, hash=False)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        sizes = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                 "vocab_size", "max_position_embeddings")
        for name in sizes:
            if getattr(self, name) < 1:
                raise UserError(f"model config has {name} = {getattr(self, name)}; it must be >= 1")
        for name in ("rope_theta", "rms_norm_eps"):
            if not 0 < getattr(self, name) < math.inf:
                raise UserError(f"model config has {name} = {getattr(self, name)}; it must be a finite number > 0")
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"model config has {self.num_heads} attention heads, not a multiple of its "
                f"{self.num_kv_heads} key/value heads; the checkpoint's config.json is inconsistent"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Read a HF Llama config.json dict (transformers 4 `rope_scaling` or 5 `rope_parameters` style)."""
        try:
            return cls._from_hf(hf)
        except (TypeError, ValueError, AttributeError) as exc:
            raise UserError(
                f"config.json has a value of the wrong type ({exc}); it is not a valid Llama config"
            ) from exc

    @classmethod
    def _from_hf(cls, hf: dict) -> ModelConfig:

        def need(key: str):
            if key not in hf:
                raise UserError(f"config.json has no {key!r}; it is not a complete Hugging Face Llama config")
            return hf[key]

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UserError(
                f"config.json asks for hidden_act={act!r}; Llama models use 'silu' and no other is supported"
            )

        rope = hf.get("rope_parameters") or {}
        if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
            raise UserError("config.json has per-layer-type rope_parameters; only one global RoPE is supported")
        rope_theta = float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)
        scaling = dict(hf.get("rope_scaling") or {})
        scaling.update({k: v for k, v in rope.items() if k != "rope_theta"})
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        if hf.get("partial_rotary_factor", scaling.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UserError("config.json sets partial_rotary_factor != 1; partial RoPE is not supported")
        scaling.pop("partial_rotary_factor", None)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UserError(
                f"config.json asks for RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        max_pos = int(hf.get("max_position_embeddings", 2048))
        if rope_type == "default":
            rope_scaling = None
        else:
            rope_scaling = {"rope_type": rope_type, **scaling}
            keys = ("factor",) if rope_type == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
            missing = [k for k in keys if k not in rope_scaling]
            if missing:
                raise UserError(f"config.json RoPE type {rope_type!r} lacks {', '.join(missing)}")
            if rope_type == "llama3":
                rope_scaling.setdefault(
                    "original_max_position_embeddings", hf.get("original_max_position_embeddings", max_pos)
                )

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        bos = hf.get("bos_token_id")
        return cls(
            hidden_size=hidden,
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),  # LlamaConfig default
            max_position_embeddings=max_pos,
            bos_token_id=None if bos is None else int(bos if not isinstance(bos, list) else bos[0]),
            eos_token_ids=eos_ids,
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )


def rope_default_inv_freq(theta: float, dim: int) -> Tensor:
    """[dim / 2] float32 unscaled inverse frequencies theta^(-2i/dim), as transformers (and llama.cpp's converter)
    compute them."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """[head_dim / 2] float32 inverse frequencies, computed exactly as transformers does (incl. llama3)."""
    inv = rope_default_inv_freq(cfg.rope_theta, cfg.head_dim)
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """q [T, Hq, D], k/v [n, Hkv, D] (any strides), mask [T, n] bool or None -> [T, Hq, D]."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True
    )
    return o[0].transpose(0, 1)


def sdpa_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: Tensor, step_mask: Tensor) -> Tensor:
    """Reference attention over cache rows 0..p+T-1 (p = cache_len, read on the host). [T, Hq, D]."""
    T = q.shape[0]
    n = int(cache_len) + T
    mask = None
    if T > 1:
        mask = torch.ones(T, n, dtype=torch.bool, device=q.device)
        mask[:, n - T :] = step_mask
    return attend(q, k_cache[:n], v_cache[:n], mask)


def static_attention_mask(cache_len: Tensor, step_mask: Tensor, rows: int) -> Tensor:
    """[T, rows] bool: cached rows < p visible to all, rows p..p+T-1 per `step_mask`, the rest hidden."""
    T = step_mask.shape[0]
    rel = torch.arange(rows, device=step_mask.device) - cache_len
    in_step = (rel >= 0) & (rel < T)
    return (rel < 0)[None, :] | (step_mask[:, rel.clamp(0, T - 1)] & in_step[None, :])


def sdpa_attention_static(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: Tensor, step_mask: Tensor) -> Tensor:
    """Fixed-shape attention over all S cache rows, masked from `cache_len` as a tensor (graph-capturable)."""
    return attend(q, k_cache, v_cache, static_attention_mask(cache_len, step_mask, k_cache.shape[0]))


WEIGHT_LAYOUTS = ("out_in", "in_out", "onednn")
ONEDNN_BATCH_HINT = 16  # oneDNN picks the packed blocking for this many rows; any row count works


@functools.cache
def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has oneDNN's packed linear (x86 CPU builds) and it computes a linear in `dtype` on
    this CPU (bfloat16 needs AVX-512 or AVX-NE-CONVERT: AVX2-only CPUs refuse it)."""
    try:
        w, x = torch.randn(8, 4, dtype=dtype), torch.randn(2, 4, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        tolerance = 1e-5 if dtype == torch.float32 else 0.1  # the inputs' own rounding in bfloat16
        return bool(torch.allclose(y.float(), x.float() @ w.float().t(), atol=tolerance))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class Linear(nn.Linear):
    """nn.Linear whose weight may be held in a faster CPU layout (`layout`, see `Llama.set_weight_layout`).

    out_in:  nn.Linear's [out, in] dense weight, F.linear (export, CUDA)
    in_out:  [in, out] dense weight, x @ W (plain MKL sgemm streams it faster for 1-row inputs)
    onednn:  the weight reordered by oneDNN for `torch.ops.mkldnn._linear_pointwise` (x86 CPU only):
             on one core 1x (1 row) to 2.5x (16-120 rows) faster than MKL in float32, also faster in
             bfloat16. With torch 2.13's oneDNN a row's result does not depend on how many rows are fed, except
             that a 1-row input may round otherwise and, in bfloat16 on AMX, 33 or more rows take another order
             (backends/row_probe.py measures it on the machine)
    """

    layout: str = "out_in"

    def forward(self, x: Tensor) -> Tensor:
        if self.layout == "out_in":
            return F.linear(x, self.weight, self.bias)
        if self.layout == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)

    def dense_weight(self) -> Tensor:
        """The weight as a dense [out, in] tensor, whatever the layout."""
        w = self.weight.detach()
        return w if self.layout == "out_in" else w.t() if self.layout == "in_out" else w.to_dense()

    def set_layout(self, layout: str) -> None:
        if layout == self.layout:
            return
        dense = self.dense_weight()
        if layout == "in_out":
            dense = dense.t().contiguous()
        elif layout == "onednn":
            dense = torch.ops.mkldnn._reorder_linear_weight(dense.contiguous(), ONEDNN_BATCH_HINT)
        self.weight = nn.Parameter(dense, requires_grad=False)
        self.layout = layout


# weights QuantizedLinear.forward makes dense at once on a CPU: its float transients (a few times this) stay in cache
DEQUANTIZED_WEIGHTS = 1 << 20


# the "words" layout of int4 weights (QuantizedLinear.set_layout): K in steps of WORDS_STEP input dims, four blocks
# of WORDS_BLOCK, each step's codes for one output in WORDS_PER_STEP uint32 words of 8
WORDS_BLOCK = 32
WORDS_STEP = 4 * WORDS_BLOCK
WORDS_PER_STEP = WORDS_STEP // 8
QUANTIZED_LAYOUTS = ("blocks", "words")


def nibbles(packed: Tensor) -> Tensor:
    """[n, b] bytes of two int4 codes each -> [n, 2b] codes, each byte's low nibble first (MatMulNBits' order)."""
    return torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2)


class QuantizedLinear(nn.Module):
    """A bias-free projection whose [out, in] weight is held in blocks along `in`, in one of two layouts (`layout`):

    blocks: engine/quantize.py's QuantizedWeight as tensors, MatMulNBits' layout: codes uint8
            [out, blocks * block * bits / 8] (int4: two a byte, the lower input dim in the low nibble), scales
            float32 [out, blocks], zero points uint8 [out, blocks] (int4: two a byte) and, for a GGUF Q4_1 weight,
            mins float32 [out, blocks]; w = (q - z) * s (+ m).
    words:  int4 in blocks of 32 only, the layout kernels/quantized_words.py's tensor-core product reads (set by
            `set_layout`, on a GPU whose product it is: backends/torch.py). `in` in steps of WORDS_STEP = 128 (four
            blocks), padded with zero codes and scales; codes int32 [out, steps * 16]: nibble p of word w of a
            step holds its dim (p % 4) * 32 + 2w + p // 4, so `(word >> 4j) & 0x000F000F` is block j's dims 2w and
            2w + 1, a bfloat16 pair's order; scales int32 [out, steps * 4]: a block's scale s and offset -(128 + z)
            in bfloat16, the scale in the low half (one load gives both); zero_points None (in the scales);
            mins bfloat16 [out, steps * 4]. w = ((128 + q) - (128 + z)) * s (+ m) rounded once to bfloat16 (one
            fused multiply-add): the blocks layout's weight to bfloat16's precision, not bit for bit.
            Worked example: dim 37 of a step is block 1, 2w + h = 5, so word 2, nibble 1 + 4 * 1 = 5: bits 20-23.

    `forward` multiplies by the dequantized weight (the definition; any device); a step passes the GPU's product
    through `Ops.quantized` (kernels/invariant.py `quantized_linear`, kernels/quantized_words.py `words_linear`,
    the weight dequantized inside it).
    """

    bias = None

    def __init__(self, codes: Tensor, scales: Tensor, zero_points: Tensor, mins: Tensor | None, bits: int,
                 in_features: int) -> None:
        super().__init__()
        self.bits, self.in_features, self.out_features = bits, in_features, scales.shape[0]
        self.layout = "blocks"
        self.codes: Tensor
        self.scales: Tensor
        self.zero_points: Tensor | None  # None in the words layout (held in its scales)
        self.mins: Tensor | None
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("zero_points", zero_points)
        self.register_buffer("mins", mins)

    @property
    def block(self) -> int:
        """The input dims a block holds."""
        if self.layout == "words":
            return WORDS_BLOCK
        return self.codes.shape[1] * 8 // self.bits // self.scales.shape[1]

    def forward(self, x: Tensor) -> Tensor:
        # on a CPU a slice of whole output channels at a time: a large weight made dense at once is written and
        # reread several times over from memory, which took most of a build's smoke check (docs/design.md 6.5);
        # elsewhere (a GPU's packed step) the whole weight at once: each slice would add its kernel launches
        rows = max(1, DEQUANTIZED_WEIGHTS // self.in_features) if x.device.type == "cpu" else self.out_features
        parts = [F.linear(x, self.dense_weight(slice(first, first + rows)).to(x.dtype))
                 for first in range(0, self.out_features, rows)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    def dense_weight(self, rows: slice = slice(None)) -> Tensor:
        """[out, in] float32 (of the output channels `rows`): the weight `layout` holds (see the class)."""
        codes, scales = self.codes[rows], self.scales[rows]
        mins = None if self.mins is None else self.mins[rows]
        n, blocks = scales.shape
        if self.layout == "words":
            scales, zeros = scales.view(torch.bfloat16).view(n, blocks, 2).unbind(-1)
            eights = torch.stack([(codes >> (4 * p)) & 0xF for p in range(8)], -1)  # [n, steps * 16, 8]
            # nibble p = j + 4h of word w -> dim j * 32 + 2w + h
            q = eights.view(n, -1, WORDS_PER_STEP, 2, 4).permute(0, 1, 4, 2, 3).reshape(n, blocks, WORDS_BLOCK)
            w = (q.double() + 128 + zeros.double()[..., None]) * scales.double()[..., None]  # exact
            if mins is not None:
                w += mins.double()[..., None]
            return w.to(torch.bfloat16).float().flatten(1)[:, : self.in_features]  # rounded once, as the fma
        assert self.zero_points is not None  # the blocks layout's
        zeros = self.zero_points[rows]
        if self.bits == 4:  # two a byte, low nibble first
            codes, zeros = nibbles(codes), nibbles(zeros)[:, :blocks]
        w = codes.view(n, blocks, -1).float()  # [n, blocks, block], a new tensor: the rest works in place
        w.sub_(zeros[..., None].float()).mul_(scales[..., None])
        if mins is not None:
            w.add_(mins[..., None])
        return w.flatten(1)[:, : self.in_features]

    def takes_layout(self, layout: str) -> bool:
        """Whether `set_layout(layout)` takes this weight: its own layout; words from blocks for int4 in blocks of
        WORDS_BLOCK (never back: see set_layout)."""
        return layout == self.layout or (layout == "words" and self.bits == 4 and self.block == WORDS_BLOCK)

    def set_layout(self, layout: str) -> None:
        """Hold the weight in `layout` (see the class): blocks -> words repacks the codes and rounds the scales,
        zero points and mins to bfloat16 (the weight then differs by bfloat16 rounding); words -> blocks is
        refused, that rounding being lost."""
        if layout not in QUANTIZED_LAYOUTS:
            raise ValueError(f"a quantized layout is one of {', '.join(QUANTIZED_LAYOUTS)}; got {layout!r}")
        if layout == self.layout:
            return
        if layout == "blocks":
            raise ValueError("a words-layout weight cannot go back to blocks: its scales were rounded to bfloat16")
        if not self.takes_layout(layout):
            raise ValueError(f"the words layout holds int4 blocks of {WORDS_BLOCK}; this weight is int{self.bits} "
                             f"in blocks of {self.block}")
        n, blocks = self.scales.shape
        steps = -(-blocks // 4)
        q = nibbles(self.codes).int()
        q = F.pad(q, (0, (steps * 4 - blocks) * WORDS_BLOCK))
        # dim j * 32 + 2w + h of a step -> nibble p = j + 4h of word w
        q = q.view(n, steps, 4, WORDS_PER_STEP, 2).permute(0, 1, 3, 4, 2).reshape(n, steps, WORDS_PER_STEP, 8)
        shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int32)
        words = (q << shifts).sum(-1, dtype=torch.int64)  # the nibbles are disjoint: the sum is their OR
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(n, steps * WORDS_PER_STEP)
        assert self.zero_points is not None  # the blocks layout's
        z = nibbles(self.zero_points)[:, :blocks]

        def per_block(t: Tensor) -> Tensor:  # [n, blocks] -> bfloat16 [n, steps * 4], zero past the last block
            return F.pad(t.float(), (0, steps * 4 - blocks)).to(torch.bfloat16)

        # a block's scale and offset side by side, one int32 (the scale in the low half): one load gives both
        pairs = torch.stack([per_block(self.scales), per_block(-128 - z.int())], -1).view(torch.int32)[..., 0]
        self.codes, self.scales, self.zero_points = words, pairs, None
        self.mins = None if self.mins is None else per_block(self.mins)
        self.layout = layout


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # fused; bit-identical to the expression below in float32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """HF rotate_half RoPE on x [T, H, D]; cos [T, 1, D], sin_signed = [-sin[:D/2], sin[D/2:]].

    x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1], written as roll(x) * sin_signed
    (the same products, so bit-identical to transformers).
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.wqkv = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias, dtype=dtype)
        self.wo = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_bias, dtype=dtype)

    def forward(self, x, cache: LayerCache | None, cos, sin, rows, cache_len, step_mask, attention: AttentionFn,
                ops: Ops = MODULE_OPS) -> Tensor:
        cfg = self.cfg
        T = x.shape[0]
        Hq, Hkv = cfg.num_heads, cfg.num_kv_heads
        qkv = ops.project(self.wqkv, x).view(T, Hq + 2 * Hkv, cfg.head_dim)
        qk = apply_rope(qkv[:, : Hq + Hkv], cos, sin)  # q and k heads rotated together
        if cache is None:  # no cache (the export's): attention gets the step's own K/V
            k_cache, v_cache = qk[:, Hq:], qkv[:, Hq + Hkv :]
        else:
            k_cache, v_cache, layer, index = cache
            # the whole stacked caches written at (layer, row) with index_put_, not through the layer's view:
            # inductor (torch.compile) writes that in place, and a view's write or an index_copy_ as a cache copy
            k_cache.index_put_((index, rows), qk[:, Hq:])
            v_cache.index_put_((index, rows), qkv[:, Hq + Hkv :])
            k_cache, v_cache = k_cache[layer], v_cache[layer]
        o = attention(qk[:, :Hq], k_cache, v_cache, cache_len, step_mask)
        return ops.project(self.wo, o.reshape(T, cfg.q_size))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(gate(x)) * up(x)); gate and up are one fused matrix w13 = [gate; up]."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.ffn = cfg.intermediate_size
        self.w13 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)

    def forward(self, x: Tensor, ops: Ops = MODULE_OPS) -> Tensor:
        gate, up = ops.project(self.w13, x).split(self.ffn, dim=-1)
        return ops.project(self.w2, F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attention = Attention(cfg, dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.feed_forward = FeedForward(cfg, dtype)

    def forward(self, x, cache: LayerCache | None, cos, sin, rows, cache_len, step_mask, attention,
                ops: Ops = MODULE_OPS) -> Tensor:
        h = x + self.attention(
            ops.norm(self.attention_norm, x), cache, cos, sin, rows, cache_len, step_mask, attention, ops
        )
        return h + self.feed_forward(ops.norm(self.ffn_norm, h), ops)


def auto_weight_layout(device: torch.device | str, dtype: torch.dtype) -> str:
    """The layout the executor runs in on `device`: onednn on x86 CPUs, else nn.Linear's out_in (CUDA).

    onednn on x86 CPUs in float32/bfloat16 wherever this CPU runs oneDNN's packed path in that dtype: from 2
    rows on it is row-invariant (a row's result does not depend on how many rows the call holds, which MKL
    sgemm's F.linear does not give; 1-row inputs see backends/row_probe.py). On SmolLM2-135M it ran 1.5x (1 row)
    to 2-3x (16-120 rows) faster than sgemm on an AMD EPYC VM; on an Intel Xeon VM (AVX-512, also limited to
    AVX2) 1.1-1.6x faster at 16-64 rows but ~1.3x slower at 1-2 rows (docs/design.md 4.2). Tiny models
    (stories260K) pay its ~10 us call overhead, for the same exactness. Else nn.Linear's out_in (CUDA; bfloat16
    on AVX2-only CPUs).
    """
    cpu = torch.device(device).type == "cpu"
    if cpu and dtype in (torch.float32, torch.bfloat16) and onednn_linear_available(dtype):
        return "onednn"
    return "out_in"


def row_invariant_layout(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """`auto_weight_layout` where its GEMM keeps one reduction order per row over a range of row counts, which
    the exact step's calls stay within (backends/row_probe.py measures the range); None where there is none.

    oneDNN's packed weights do (float32: from 2 rows on; bfloat16 on AMX: up to 32 rows); so does torch's CPU
    bfloat16 GEMM; MKL sgemm's float32 F.linear does not (1-3 rows take another path).
    """
    layout = auto_weight_layout(device, dtype)
    cpu = torch.device(device).type == "cpu"
    return layout if cpu and (layout == "onednn" or dtype == torch.bfloat16) else None


class Llama(nn.Module):
    """Llama decoder; see the module docstring for the forward contract and the attention seam."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype | None = None, attention: AttentionFn | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.attention: AttentionFn = attention or sdpa_attention
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.output = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.inv_freq: Tensor
        self.tie_weights()
        # float32 always; computed on the CPU even when built under torch.device("meta")
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings and self.output.layout == "out_in":
            self.output.weight = self.tok_embeddings.weight

    @property
    def weight_layout(self) -> str:
        """'out_in', 'in_out' or 'onednn': how the projections and the lm_head hold their weights; 'blocks' or
        'words': quantized (QuantizedLinear, engine/quantize.py `quantize_model`)."""
        return self.output.layout

    @property
    def quantized(self) -> bool:
        """Whether some projection holds its weight in blocks (QuantizedLinear)."""
        return any(isinstance(module, QuantizedLinear) for module in self.modules())

    def set_quantized_layout(self, layout: str) -> Llama:
        """Hold every QuantizedLinear that can take it in `layout` (see QuantizedLinear), the others as they are."""
        for module in self.modules():
            if isinstance(module, QuantizedLinear) and module.takes_layout(layout):
                module.set_layout(layout)
        return self

    def set_weight_layout(self, layout: str) -> Llama:
        """Hold every projection and the lm_head in `layout` (see `Linear`); 'auto' picks `auto_weight_layout`.

        'out_in' is nn.Linear's (the layout to export or move to CUDA); 'in_out' and 'onednn' are CPU layouts
        for the torch executor. Numerics are the same up to GEMM rounding. Outside 'out_in' a tied lm_head gets
        its own copy (vocab x hidden more memory); 'out_in' ties it again.
        """
        if layout == "auto":
            layout = auto_weight_layout(self.device, self.dtype)
        if layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight layout must be one of auto, {', '.join(WEIGHT_LAYOUTS)}; got {layout!r}")
        if layout == "onednn" and not (self.device.type == "cpu" and onednn_linear_available(self.dtype)):
            raise ValueError(
                f"the onednn weight layout needs a CPU model and a torch whose oneDNN runs {self.dtype} on this "
                "CPU (x86; bfloat16 also needs AVX-512 or AVX-NE-CONVERT); use weight_layout 'auto' or 'out_in'"
            )
        for module in self.modules():
            if isinstance(module, Linear):
                module.set_layout(layout)
        self.tie_weights()
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def cache_shape(self, rows: int) -> tuple[int, int, int, int]:
        """[layers, rows, kv_heads, head_dim]: the shape of each of the K and V caches."""
        return (self.cfg.num_layers, rows, self.cfg.num_kv_heads, self.cfg.head_dim)

    def new_cache(self, rows: int, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
        """Zeroed (k_cache, v_cache), each `cache_shape(rows)` in the model dtype."""
        shape = self.cache_shape(rows)
        device = self.device if device is None else device
        return (
            torch.zeros(shape, dtype=self.dtype, device=device),
            torch.zeros(shape, dtype=self.dtype, device=device),
        )

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, signed sin [T, 1, D] in the model dtype (computed in float32 like transformers)."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1).to(self.dtype)
        sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)
        return cos[:, None, :], sin[:, None, :]

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        k_cache: Tensor | None,
        v_cache: Tensor | None,
        cache_len: Tensor,
        step_mask: Tensor,
        output_slots: Tensor | None = None,
        attention: AttentionFn | None = None,
        cache_rows: Tensor | None = None,
        ops: Ops = MODULE_OPS,
    ) -> Tensor:
        attention = self.attention if attention is None else attention  # no truth test: dynamo 2.11 cannot trace one
        T = input_ids.shape[0]
        x = self.tok_embeddings(input_ids)
        cos, sin = self.rope(positions)
        rows = torch.arange(T, device=input_ids.device) + cache_len if cache_rows is None else cache_rows
        index = torch.arange(len(self.layers), device=input_ids.device)  # each layer's as a 0-dim tensor (LayerCache)
        for i, layer in enumerate(self.layers):
            cache = None if k_cache is None or v_cache is None else (k_cache, v_cache, i, index[i])
            x = layer(x, cache, cos, sin, rows, cache_len, step_mask, attention, ops)
        if output_slots is not None:
            x = x.index_select(0, output_slots)
        return ops.project(self.output, ops.norm(self.norm, x))
