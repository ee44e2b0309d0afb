"""BatchedTorchExecutor: the batched executor contract (lookahead/executor.py) on the torch `Llama`.

    ex = BatchedTorchExecutor(model, max_batch=8, max_seq_len=2048, step_tokens=128)
    x = ex.prefill(slot, prompt_ids, SamplingParams())    # KV rows [0, P) of the slot; next token
    ex.claim(slot, SamplingParams())                       # or: cache_len 0; the prompt comes as causal rows
    out = ex.step(StepBatch(...))                          # [B, T]; valid at each row's output slots
    ex.commit(slot, rows); ex.release(slot)

The KV cache is [layers, max_batch * S, kv_heads, head_dim] (S = max_seq_len + step_tokens rows per
slot), allocated once; nothing is allocated per request. Two step paths, one contract:

  packed (CPU): only the real tokens of each row are fed (pads skipped), flattened over the rows, so
    the linear layers see M = the step's real tokens; attention runs per row (`RowAttention`) over that
    row's own cache_len + t keys. With `exact` (asked for, or by default in EXACT_BY_DEFAULT's dtypes
    where the model's projections are row-invariant, model/llama.py `row_invariant_layout`) a row's
    attention is kernels/reference.py's
    `BlockedAttention`, so every token's logits are bit-identical whatever shares its step: other
    requests, or its own lookahead slots (the 1-token greedy step gives the same bits; docs/design.md
    section 4.2). Prefill keeps SDPA: a prompt is prefilled by one call of its own, alone or batched.
  padded (CUDA): rows padded to [Bb, Tw], Bb the batch-size bucket (1, 2, 4, ..., max_batch) and Tw the step
    width (1, 2, 4, ..., step_tokens: a greedy step runs at 1); masks come from cache_len [Bb] and step_config
    [Bb, 3] device tensors through the one closed form (kernels/mask.py); the active slots are kept in physical
    slots 0 .. n-1 (a release moves the last one into the hole), so bucket Bb attends over the cache view of the
    first Bb slots; each (bucket, width, any row sampled, top-k) is captured once as a CUDA graph (all in one
    memory pool) and replayed. A step is one host-to-device copy (its inputs, and the KV moves of the commits
    before it, which `commit` only records) and one device-to-host copy (its tokens and top-k ids). It also
    runs eagerly on the CPU. Attention (`attention`, ATTENTIONS): SDPA over each slot's S rows under the mask, or
    the Triton kernel of kernels/padded_attention.py over each slot's own cache_len + Tw keys, the mask in
    registers. With `exact` (asked for, or by default in EXACT_BY_DEFAULT's dtypes on CUDA) the projections,
    norms and attention are the row-invariant Triton kernels of kernels/invariant.py (on CUDA; on the CPU only
    under TRITON_INTERPRET=1, for tests). The attentions and those kernels are kernels/step_ops.py's custom ops.
  compiled (`compile=True`, experimental, off by default: not yet measured on a GPU): the padded step's
    forward under torch.compile (inductor, fullgraph), one graph per (bucket, width) compiled on its first step
    (said once on stderr) and captured in its CUDA graphs; eager-but-compiled on the CPU. Inductor fuses
    the pointwise work (RoPE, KV writes, SiLU * mul, residuals, the mask) around the opaque custom ops; the
    token choice (argmax, sampling, top-k) stays eager. It needs a dense weight layout (not 'onednn'). Exact and
    compiled, the prompt is prefilled through the compiled step too (the steps' bits), and inductor splits no
    reduction.
  quantized weights (a model whose projections are QuantizedLinear: engine/quantize.py `quantize_model`): the
    padded step runs each as kernels/invariant.py's `quantized_linear` where those kernels run, the weight
    dequantized inside the product, on the fast step as on the exact one (row-invariant either way;
    docs/design.md 6.9); int4 weights on a GPU of compute capability 9.0+ with bfloat16 activations are put in
    QuantizedLinear's words layout, whose product (kernels/quantized_words.py) makes them in the tensor cores'
    registers (the executor changes the model it is given; `words_layout_applies`); elsewhere, and on the packed
    step, the module multiplies by its dequantized weight (QuantizedLinear.forward), never exact.

  tensor parallelism (`collectives`, backends/tensor_parallel.py): the model is one rank's shard and each
    projection's product is followed by its collective (`Ops.after`: the exact all-reduce after wo and w2, the
    vocab gather after the lm_head); eager steps only (docs/design.md 5.3).

Token choice: argmax, or the seeded Gumbel-max draw with each slot's temperature, top-k, top-p and seed
(kernels/sampling_torch.py `select_rows_torch`), keyed by the position of the output slot (docs/design.md
section 4.3).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from trt_lookahead.backends.row_probe import row_invariant_ops, step_variance
from trt_lookahead.engine.format import batch_buckets
from trt_lookahead.kernels import step_ops
from trt_lookahead.kernels.mask import CAUSAL, step_mask, step_visible, tree_ends, tree_step_visible
from trt_lookahead.kernels.reference import BlockedAttention
from trt_lookahead.kernels.sampling_torch import first_max_ids, select_rows_torch, top_k_ids, vocab_salts
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import (
    StepBatch,
    check_batch,
    check_commit,
    check_kv_memory,
    check_prompt,
    check_slot,
    kv_allocation,
)
from trt_lookahead.lookahead.sampling import MASK32, SamplingParams
from trt_lookahead.lookahead.tree import TreeTemplate, covers
from trt_lookahead.model.llama import (
    MODULE_OPS,
    AttentionFn,
    Llama,
    Ops,
    QuantizedLinear,
    attend,
    row_invariant_layout,
)

DEFAULT_STEP_TOKENS = 128  # the largest row a runtime's torch executor takes (15/5/15 is 120)
# dtypes where the exact step is on by default: bfloat16, whose fast step can round a near-tie otherwise than
# greedy, and where the exact step costs little (docs/design.md section 4.2; figures: docs/results/2026-11-26-cpu.md,
# "Exact step on an Intel Xeon with AMX", and docs/results/2026-11-27-h200.md)
EXACT_BY_DEFAULT = (torch.bfloat16,)
# the most prompt tokens an exact prefill feeds in one causal row: BlockedAttention holds every query row's scores
# over every key block, memory rows x keys, so a long prompt runs as rows of this many (any size gives the same bits)
EXACT_PREFILL_CHUNK = DEFAULT_STEP_TOKENS
# the fast padded step's attention: SDPA over each slot's S rows under the closed-form mask (the default until the
# other is measured on a GPU), or kernels/padded_attention.py's Triton kernel over each slot's own keys, the mask
# evaluated in registers (docs/design.md section 6.4)
ATTENTIONS = ("sdpa", "triton")


RowAttend = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q [t, Hq, D], k, v [keys, Hkv, D]) -> [t, Hq, D]


class RowAttention:
    """Attention of a packed step, row by row: a row's queries see its own slot's cache rows and tokens.

    spans: (first query, end query, first cache row, key rows, the row's attention), the keys being the
    slot's cached prefix followed by the row's own step tokens (written before the call).
    """

    def __init__(self, spans: list[tuple[int, int, int, int, RowAttend]]) -> None:
        self.spans = spans

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: Tensor, step_mask: Tensor) -> Tensor:
        out = torch.empty_like(q)
        for start, end, first, keys, row_attend in self.spans:
            out[start:end] = row_attend(q[start:end], k_cache[first : first + keys], v_cache[first : first + keys])
        return out


class PaddedAttention:
    """Attention of a padded step: row b's T queries over its slot's S cache rows under mask[b] [T, S]
    (kernels/step_ops.py `padded_sdpa`: one op, opaque to a compiled step)."""

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask  # [Bb, T, S]: one mask for every head

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: Tensor, step_mask: Tensor) -> Tensor:
        return step_ops.padded_sdpa(q, k_cache, v_cache, self.mask)


class StepAttention:
    """Attention of a padded step over each slot's own cache_len + T keys, the step mask evaluated in registers
    (kernels/step_ops.py `padded_attention`: one op, opaque to a compiled step; no [Bb, T, S] mask at all)."""

    def __init__(self, cache_len: Tensor, config: Tensor, tree_ends: Tensor, rows_per_slot: int) -> None:
        self.cache_len, self.config, self.tree_ends, self.rows_per_slot = cache_len, config, tree_ends, rows_per_slot

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: Tensor, step_mask: Tensor) -> Tensor:
        return step_ops.padded_attention(q, k_cache, v_cache, self.cache_len, self.config, self.tree_ends,
                                         self.rows_per_slot)


class BatchedTorchExecutor:
    """The batched executor contract on a torch `Llama`; see the module docstring."""

    def __init__(
        self,
        model: Llama,
        max_batch: int,
        max_seq_len: int,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        device: str | torch.device | None = None,
        *,
        padded: bool | None = None,
        cuda_graph: bool | None = None,
        tree: TreeTemplate | None = None,
        exact: bool | None = None,
        compile: bool = False,
        attention: str = "sdpa",
        collectives: Mapping[nn.Module, Callable[[Tensor], Tensor]] | None = None,
    ) -> None:
        self.device = model.device if device is None else torch.device(device)
        self.tree = tree  # every lookahead row's verification slots are this template's nodes (fixed, like an engine's)
        if model.device.type != self.device.type or (
            self.device.index is not None and model.device.index != self.device.index
        ):
            raise ValueError(f"model is on {model.device} but the executor was asked for {self.device}")
        for name, value in (("max_batch", max_batch), ("max_seq_len", max_seq_len), ("step_tokens", step_tokens)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        is_cuda = self.device.type == "cuda"
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
        self.padded = (is_cuda or compile or attention == "triton") if padded is None else padded
        if compile and not self.padded:
            raise ValueError("compile=True compiles the padded step; use padded=True (the default with compile)")
        if compile and model.weight_layout == "onednn":  # inductor cannot lower oneDNN's packed weights
            raise ValueError(
                "compile=True needs the model's projections in a dense layout, got 'onednn': load it with "
                "load_llama(..., weight_layout='out_in') or call model.set_weight_layout('out_in')"
            )
        self.compile = compile
        if attention == "triton":  # the fast padded step's own kernel
            if reason := invariant_kernels_reason(self.device):
                raise ValueError(f"attention='triton' {reason}; use attention='sdpa'")
            if not self.padded:
                raise ValueError("attention='triton' is the padded step's attention; use padded=True (its default)")
            if exact:
                raise ValueError("attention='triton' is the fast step's attention, and the exact step has its own "
                                 "(kernels/invariant.py): use exact=False, or attention='sdpa'")
            exact = False  # asking for the fast step's kernel is asking for the fast step
        self.attention = attention
        self.cuda_graph = (is_cuda and self.padded) if cuda_graph is None else cuda_graph
        if self.cuda_graph and not (is_cuda and self.padded):
            raise ValueError("cuda_graph needs device='cuda' and the padded step")
        self.exact = self._exact(model, exact)
        self._ops = (invariant_ops() if self.padded else row_invariant_ops(model)) if self.exact else MODULE_OPS
        if model.quantized and self.padded and not invariant_kernels_reason(self.device):
            self._ops = dataclasses.replace(self._ops, quantized=quantized_projection)
            if words_layout_applies(self.device, model.dtype):  # int4 weights where the tensor cores make them
                model.set_quantized_layout("words")
        if collectives:  # a tensor-parallel shard's (backends/tensor_parallel.py)
            if self.cuda_graph or compile:
                raise ValueError("collectives (tensor parallelism) run in eager steps for now: use cuda_graph=False "
                                 "and compile=False")
            self._ops = dataclasses.replace(self._ops, after=collectives)
        self.model = model
        self.vocab_size = model.cfg.vocab_size
        self.max_batch, self.max_seq_len, self.step_tokens = int(max_batch), int(max_seq_len), int(step_tokens)
        self.rows_per_slot = S = self.max_seq_len + self.step_tokens
        cfg, dev = model.cfg, self.device
        shape = (cfg.num_layers, self.max_batch * S, cfg.num_kv_heads, cfg.head_dim)
        # the packed step reads only rows it wrote (so untouched memory is never resident); the padded step
        # reads every row under a mask, and masked garbage could be NaN (NaN * 0 = NaN), so it starts zeroed
        alloc = torch.zeros if self.padded else torch.empty
        if not is_cuda:
            check_kv_memory(shape, model.dtype.itemsize, self.max_seq_len, self.max_batch)
        with kv_allocation(self.max_seq_len, self.max_batch):
            self.k_cache = alloc(shape, dtype=model.dtype, device=dev)
            self.v_cache = alloc(shape, dtype=model.dtype, device=dev)
        B = self.max_batch
        self._cache_len = np.zeros(B, np.int64)  # per logical slot
        self._step_real = np.zeros(B, np.int64)  # real tokens of the slot's uncommitted step (0: none)
        self._live = np.zeros(B, bool)
        self._physical = np.arange(B)  # logical slot -> physical slot (the padded path keeps live ones first)
        self._logical = np.arange(B)  # physical -> logical
        self._active = 0  # live slots
        self._row_masks: dict[tuple[tuple[int, int, int], int], Tensor] = {}
        self._salts = vocab_salts(self.vocab_size, dev)
        # sampling parameters per physical slot (device tensors, read inside captured graphs)
        self._temperature = torch.zeros(B, dtype=torch.float64, device=dev)
        self._top_k = torch.zeros(B, dtype=torch.int64, device=dev)
        self._top_p = torch.ones(B, dtype=torch.float64, device=dev)
        self._seed = torch.zeros(B, dtype=torch.int64, device=dev)
        self._sampled = np.zeros(B, bool)  # host copy: does the physical slot sample?
        if self.padded:
            T = self.step_tokens
            # one host-to-device copy a step: every physical slot's inputs [ids | positions | outputs | cache_len,
            # W, N, G] (B rows of 3T + 4), then the (source, destination) cache rows of the KV moves that the
            # commits since the last step left (at most T per slot); the host fills a (pinned on CUDA) staging copy
            # and never freezes values into a graph
            self._row_width = 3 * T + 4
            self._h_in = torch.zeros(B * self._row_width + 2 * B * T, dtype=torch.int64, pin_memory=is_cuda)
            self._d_in = torch.zeros(self._h_in.shape, dtype=torch.int64, device=dev)
            self._moves: dict[int, np.ndarray] = {}  # logical slot -> [k, 2] its commit's (source, destination) rows
            self._graphs: dict[tuple[int, int, bool, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
            self._graph_pool: Any = None  # one memory pool for every graph: they replay one at a time
            # the tree template's table as a [2T] device tensor (the closed form reads it per query and key slot)
            self._ends = torch.from_numpy(tree_ends(np.zeros(0) if tree is None else tree.table, T)).to(dev)
            self._no_tree = torch.zeros(0, dtype=torch.int64, device=dev)  # the Triton attention's "no tree"
            self.buckets = batch_buckets(B)
            # a step runs at the narrowest width that holds its rows (a greedy step at 1, not step_tokens)
            self.widths = batch_buckets(T)
            self._forward = self._compiled_forward() if compile else self._padded_forward
            self._compiled_shapes: set[tuple[int, int]] = set()  # (bucket, width) whose compile was announced

    def _exact(self, model: Llama, exact: bool | None) -> bool:
        """Whether steps run row-invariant: asked for, or by default where it is cheap and the projections are."""
        if self.padded:  # the Triton kernels of kernels/invariant.py
            reason = invariant_kernels_reason(self.device)
            if exact is None:  # compiled, on CUDA (interpreted on the CPU, they are for tests only)
                return self.device.type == "cuda" and reason is None and model.dtype in EXACT_BY_DEFAULT
            if exact and reason:
                raise ValueError(f"exact=True on the padded step {reason}; use exact=False")
            return bool(exact)
        if exact and model.quantized:
            raise ValueError("exact=True on quantized weights runs the padded step's Triton kernels (on CUDA, or on "
                             "the CPU under TRITON_INTERPRET=1): use padded=True, or exact=False")
        layout = row_invariant_layout(model.device, model.dtype)
        if exact is None:  # the probes (backends/row_probe.py, each shape once) run here, not in a request
            return (model.weight_layout == layout and model.dtype in EXACT_BY_DEFAULT
                    and step_variance(model) is None)
        if exact and layout is None:
            raise ValueError(
                f"exact=True needs the packed CPU step and row-invariant projections, which this executor "
                f"({model.dtype} on {model.device.type}, padded={self.padded}) does not have; use exact=False"
            )
        if exact and model.weight_layout != layout:
            raise ValueError(
                f"exact=True needs the model's projections in the {layout!r} layout, got {model.weight_layout!r}: "
                "load it with load_llama(..., weight_layout='auto') or call model.set_weight_layout('auto')"
            )
        if exact and (reason := step_variance(model)):
            raise ValueError(f"exact=True needs row-invariant attention products, and {reason}; use exact=False")
        return bool(exact)

    # -- contract ---------------------------------------------------------------------------------

    @property
    def pads_rows(self) -> bool:
        """The padded step runs every row as wide as the widest (the packed one feeds real tokens only)."""
        return self.padded

    def cache_len(self, slot: int) -> int:
        return int(self._cache_len[check_slot(slot, self.max_batch)])

    @torch.inference_mode()
    def claim(self, slot: int, sampling: SamplingParams) -> None:
        slot = check_slot(slot, self.max_batch)
        self._claim(slot)
        self._cache_len[slot] = self._step_real[slot] = 0
        if self.padded:
            self._moves.pop(slot, None)  # a restart in place: the old request's accepted rows never move
        self._set_sampling(int(self._physical[slot]), sampling)

    @torch.inference_mode()
    def prefill(self, slot: int, prompt_ids: np.ndarray, sampling: SamplingParams) -> int:
        logits = self.prefill_logits(slot, prompt_ids, sampling)
        P = self.cache_len(slot)
        return int(self._select(logits, torch.tensor([P - 1], device=self.device), self._physical[[slot]])[0])

    @torch.inference_mode()
    def prefill_logits(self, slot: int, prompt_ids: np.ndarray, sampling: SamplingParams) -> Tensor:
        """[1, vocab] the logits `prefill` chooses the first token from; KV and sampling as `prefill`.

        Exact: the prompt runs as causal step rows (`_causal_logits`) of at most EXACT_PREFILL_CHUNK tokens, so its
        KV and first token have the bits of chunked prefill or plain decoding (docs/design.md 4.2); else one call.
        Exact and compiled: as causal rows of the compiled step itself (`_compiled_prefill`).
        """
        ids = check_prompt(prompt_ids, self.max_seq_len, self.vocab_size)
        self.claim(slot, sampling)
        if self.compile and self.exact:
            return self._compiled_prefill(slot, ids)
        chunk = EXACT_PREFILL_CHUNK if self.exact else len(ids)
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            logits = self._causal_logits(slot, part)
            self._cache_len[slot] = start + len(part)
        return logits

    def _causal_logits(self, slot: int, ids: np.ndarray) -> Tensor:
        """[1, vocab] at the last of `ids`, run as one causal row at the slot's cache_len by the step's own path
        (padded exact: the Triton kernels; else packed, as `_packed_logits`), its KV written at their rows."""
        c, cache_len = len(ids), int(self._cache_len[slot])
        positions = cache_len + np.arange(c)[None]
        if self.padded and self.exact:
            phys, S, dev = int(self._physical[slot]), self.rows_per_slot, self.device
            rows = slice(phys * S, phys * S + S)  # the slot's own rows, as slot 0 of a one-slot cache
            return self._padded_forward(
                self.k_cache[:, rows], self.v_cache[:, rows], torch.from_numpy(ids[None]).to(dev),
                torch.from_numpy(positions).to(dev), torch.tensor([[c - 1]], device=dev),
                torch.tensor([cache_len], device=dev), torch.tensor([CAUSAL], device=dev),
            )
        batch = StepBatch(np.array([slot]), ids[None], positions, np.array([CAUSAL], np.int32), np.array([[c - 1]]))
        return self._packed_logits(batch, np.array([c]))[0]

    def _compiled_prefill(self, slot: int, ids: np.ndarray) -> Tensor:
        """[1, vocab] at the last of `ids`, fed as causal rows of step_tokens (the last padded) through the compiled
        step, each committed: a compiled graph may round pointwise work (RoPE's fused multiply-adds) otherwise than
        the eager prefill would, so the prompt's KV and first token take the bits of the steps that decode it."""
        T = self.step_tokens
        for start in range(0, len(ids), T):
            part = ids[start : start + T]
            c, cache_len = len(part), int(self._cache_len[slot])
            batch = StepBatch(np.array([slot]), np.pad(part, (0, T - c))[None], cache_len + np.arange(T)[None],
                              np.array([CAUSAL], np.int32), np.array([[c - 1]]))  # every chunk at width T
            logits = self.step_logits(batch)[0]
            self.commit(slot, np.arange(c))
        return logits

    @torch.inference_mode()
    def step(self, batch: StepBatch) -> np.ndarray:
        real = self._check_step(batch)
        out = self._step_padded(batch) if self.padded else self._step_packed(batch, real)
        self._step_real[batch.slots] = real
        return out

    @torch.inference_mode()
    def step_logits(self, batch: StepBatch) -> Tensor:
        """[B, K, vocab] the logits `step` chooses from at each row's output slots; KV as `step`."""
        real = self._check_step(batch)
        if self.padded:
            phys, bucket, width = self._stage_padded(batch)
            logits = self._padded_logits(bucket, width).view(bucket, width, -1)
            chosen = logits[torch.from_numpy(phys).to(self.device), : batch.output_slots.shape[1]]
        else:
            logits, distinct = self._packed_logits(batch, real)
            entry = np.cumsum(distinct.reshape(-1)) - 1  # each (row, k) -> its distinct output slot's logits row
            chosen = logits[torch.from_numpy(entry).to(self.device)].view(*distinct.shape, -1)
        self._step_real[batch.slots] = real
        return chosen

    def _check_step(self, batch: StepBatch) -> np.ndarray:
        """The real tokens per row, after every check of `batch` against the executor's state."""
        real = check_batch(batch, self.max_batch, self.step_tokens, self.vocab_size)
        slots = np.asarray(batch.slots, np.int64)
        if not self._live[slots].all():
            raise ValueError(f"step rows name slots that were never prefilled: {slots[~self._live[slots]].tolist()}")
        full = self._cache_len[slots] + real > self.rows_per_slot
        if full.any():
            raise ValueError(f"KV cache full in slot {int(slots[full][0])}: max_seq_len={self.max_seq_len}")
        return real

    @torch.inference_mode()
    def commit(self, slot: int, rows: np.ndarray) -> None:
        slot = check_slot(slot, self.max_batch)
        cache_len = int(self._cache_len[slot])
        rows = check_commit(rows, int(self._step_real[slot]), cache_len, self.max_seq_len)
        self._step_real[slot] = 0
        k = len(rows)
        if k and not np.array_equal(rows, np.arange(k)):  # rows already in place otherwise (greedy: [0])
            base = int(self._physical[slot]) * self.rows_per_slot + cache_len
            moves = np.stack([rows + base, np.arange(base, base + k)], axis=1)  # [k, 2] (source, destination)
            if self.padded:  # the next step moves them, its inputs and the moves in one copy: no device work here
                self._moves[slot] = moves
            else:
                self._move_rows(torch.from_numpy(moves).to(self.device))
        self._cache_len[slot] = cache_len + k

    def _move_rows(self, moves: Tensor) -> None:
        """Copy each layer's K and V cache row moves[i, 0] to row moves[i, 1] (moves [k, 2] on the device; a commit
        moves a slot's accepted step rows down to its cache_len, never onto a row another move reads)."""
        src, dst = moves[:, 0], moves[:, 1]
        for cache in (self.k_cache, self.v_cache):
            cache.index_copy_(1, dst, cache.index_select(1, src))

    def _take_moves(self) -> np.ndarray:
        """[n, 2] every pending commit's (source, destination) rows, which are no longer pending."""
        moves = np.concatenate(list(self._moves.values())) if self._moves else np.zeros((0, 2), np.int64)
        self._moves.clear()
        return moves

    def _flush_moves(self) -> None:
        """Make every pending commit's moves now (before slots' rows are copied elsewhere; not once per step)."""
        if self._moves:
            self._move_rows(torch.from_numpy(self._take_moves()).to(self.device))

    @torch.inference_mode()
    def slot_kv(self, slot: int) -> tuple[Tensor, Tensor]:
        """Copies of the slot's committed K and V rows [layers, cache_len, kv_heads, head_dim] (for inspection)."""
        slot = check_slot(slot, self.max_batch)
        if self.padded:
            self._flush_moves()
        first = int(self._physical[slot]) * self.rows_per_slot
        rows = slice(first, first + int(self._cache_len[slot]))
        return self.k_cache[:, rows].clone(), self.v_cache[:, rows].clone()

    @torch.inference_mode()
    def release(self, slot: int) -> None:
        slot = check_slot(slot, self.max_batch)
        if not self._live[slot]:
            return
        if self.padded:
            self._moves.pop(slot, None)
            self._compact(slot)
        self._live[slot] = False
        self._active -= 1
        self._cache_len[slot] = self._step_real[slot] = 0

    # -- slots ------------------------------------------------------------------------------------

    def _claim(self, slot: int) -> None:
        """Make `slot` live (prefilling a live slot restarts it in place); padded: it takes physical slot n."""
        if self._live[slot]:
            return
        if self.padded:
            phys, old = self._active, int(self._physical[slot])
            other = int(self._logical[phys])
            self._physical[slot], self._physical[other] = phys, old
            self._logical[phys], self._logical[old] = slot, other
        self._live[slot] = True
        self._active += 1

    def _compact(self, slot: int) -> None:
        """Move the last live physical slot into the released one's place: live slots stay 0 .. n-1."""
        hole, last = int(self._physical[slot]), self._active - 1
        if hole == last:
            return
        moved = int(self._logical[last])
        S, n = self.rows_per_slot, int(self._cache_len[moved])
        self._flush_moves()  # the moved slot's committed rows in place before they are copied
        for cache in (self.k_cache, self.v_cache):
            cache[:, hole * S : hole * S + n] = cache[:, last * S : last * S + n]
        for params in (self._temperature, self._top_k, self._top_p, self._seed):
            params[hole] = params[last]
        self._sampled[hole] = self._sampled[last]
        self._physical[moved], self._physical[slot] = hole, last
        self._logical[hole], self._logical[last] = moved, slot

    def _set_sampling(self, phys: int, sampling: SamplingParams) -> None:
        self._sampled[phys] = not sampling.greedy
        self._temperature[phys] = sampling.temperature
        self._top_k[phys] = sampling.top_k
        self._top_p[phys] = sampling.top_p
        self._seed[phys] = sampling.seed & MASK32

    def _select(self, logits: Tensor, positions: Tensor, phys: np.ndarray) -> np.ndarray:
        """Tokens for rows of logits [R, V]; row r draws with physical slot phys[r]'s sampling parameters."""
        tokens = first_max_ids(logits)
        sampled = np.flatnonzero(self._sampled[phys])
        if len(sampled):
            rows = torch.from_numpy(sampled).to(self.device)
            which = torch.from_numpy(phys[sampled]).to(self.device)
            tokens[rows] = select_rows_torch(
                logits.index_select(0, rows), positions.index_select(0, rows), self._temperature[which],
                self._top_k[which], self._top_p[which], self._seed[which], self._salts,
            )
        return tokens.cpu().numpy()

    # -- packed step (CPU) ------------------------------------------------------------------------

    def _step_packed(self, batch: StepBatch, real: np.ndarray) -> np.ndarray:
        logits, distinct = self._packed_logits(batch, real)
        # at least float32, the same ids: the CPU's argmax over bfloat16 takes 4x as long as over float32
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        row_of, col_of = np.nonzero(distinct)
        read = np.asarray(batch.output_slots, np.int64)[row_of, col_of]
        phys = self._physical[np.asarray(batch.slots, np.int64)]
        positions = torch.from_numpy(batch.positions[row_of, read]).to(self.device)
        result = np.full(batch.input_ids.shape, -1, np.int64)
        result[row_of, read] = self._select(logits, positions, phys[row_of])
        if batch.top_ids is not None:
            batch.top_ids[row_of, read] = top_k_ids(logits, batch.top_ids.shape[2]).cpu().numpy()
        return result

    def _packed_logits(self, batch: StepBatch, real: np.ndarray) -> tuple[Tensor, np.ndarray]:
        """Logits [R, vocab] of the step's distinct output slots, and `distinct` [B, K] marking them in order."""
        B, T = batch.input_ids.shape
        dev, S = self.device, self.rows_per_slot
        slots = np.asarray(batch.slots, np.int64)
        phys, cache_len = self._physical[slots], self._cache_len[slots]
        keep = np.arange(T)[None, :] < real[:, None]  # [B, T] the real tokens, row after row
        starts = np.concatenate(([0], np.cumsum(real)[:-1]))
        spans = [
            (int(starts[b]), int(starts[b] + real[b]), int(phys[b] * S), int(cache_len[b] + real[b]),
             self._row_attention(batch.step_config[b], int(real[b]), int(cache_len[b])))
            for b in range(B)
        ]
        out_slots = np.asarray(batch.output_slots, np.int64)
        distinct = np.ones(out_slots.shape, bool)
        distinct[:, 1:] = out_slots[:, 1:] != out_slots[:, :-1]  # padding repeats the last entry
        row_of, col_of = np.nonzero(distinct)
        read = out_slots[row_of, col_of]
        logits = self.model(
            torch.from_numpy(batch.input_ids[keep]).to(dev),
            torch.from_numpy(batch.positions[keep]).to(dev),
            self.k_cache,
            self.v_cache,
            None,
            None,
            torch.from_numpy(starts[row_of] + read).to(dev),
            attention=RowAttention(spans),
            cache_rows=torch.from_numpy(((phys * S + cache_len)[:, None] + np.arange(T)[None, :])[keep]).to(dev),
            ops=self._ops,
        )
        return logits, distinct

    def _row_attention(self, step_config: np.ndarray, tokens: int, cache_len: int) -> RowAttend:
        """One row's attention over its cached prefix and its `tokens` step tokens under its step mask."""
        W, N, G = (int(v) for v in step_config)
        key = ((W, N, G), tokens)
        step = self._row_masks.get(key)
        if step is None:
            tree = covers(self.tree, LookaheadConfig(W, N, G)) if W else None  # W = 0: a causal chunk
            table = None if tree is None else tree.table
            step = torch.from_numpy(step_mask(tokens, (W, N, G), table)).to(self.device)
            if tokens <= self.step_tokens:  # a step's; not a whole prompt's (fast prefill), which could be any length
                self._row_masks[key] = step
        cfg = self.model.cfg
        if self.exact:
            return BlockedAttention(step, cache_len, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.model.dtype,
                                    self.device)
        if tokens == 1:
            return functools.partial(attend, mask=None)
        mask = torch.ones(tokens, cache_len + tokens, dtype=torch.bool, device=self.device)
        mask[:, cache_len:] = step
        return functools.partial(attend, mask=mask)

    # -- padded step (CUDA; also eager on the CPU) -------------------------------------------------

    def _step_padded(self, batch: StepBatch) -> np.ndarray:
        B, T = batch.input_ids.shape
        K = batch.output_slots.shape[1]
        phys, bucket, width = self._stage_padded(batch)
        sampled = bool(self._sampled[:bucket].any())
        k = 0 if batch.top_ids is None else batch.top_ids.shape[2]
        if self.cuda_graph:
            graph, chosen = self._graph(bucket, width, sampled, k)
            graph.replay()
        else:
            chosen = self._run_padded(bucket, width, sampled, k)
        out = chosen.cpu().numpy()  # the step's one device-to-host copy: [bucket, width, 1 + k]
        result = np.full((B, T), -1, np.int64)
        rows = np.arange(B)[:, None]
        result[rows, batch.output_slots] = out[phys, :K, 0]
        if batch.top_ids is not None:
            batch.top_ids[rows, batch.output_slots] = out[phys, :K, 1:]
        return result

    def step_shape(self, active: int, tokens: int) -> tuple[int, int]:
        """(bucket, width): the padded step's slots and tokens a slot that a step of `active` slots and `tokens`
        tokens each runs at (its CUDA graph's shape)."""
        return next(b for b in self.buckets if b >= active), next(w for w in self.widths if w >= tokens)

    def _stage_padded(self, batch: StepBatch) -> tuple[np.ndarray, int, int]:
        """Copy `batch` into the device inputs of its bucket's physical slots, with the pending commits' KV moves, in
        one copy, and make those moves -> (each row's physical slot, bucket, width)."""
        T, K = batch.input_ids.shape[1], batch.output_slots.shape[1]
        TT, row = self.step_tokens, self._row_width
        phys = self._physical[np.asarray(batch.slots, np.int64)]
        bucket, width = self.step_shape(self._active, T)
        h = self._h_in.numpy()[: self.max_batch * row].reshape(self.max_batch, row)
        idle = self._cache_len[self._logical[:bucket]]  # rows not in this step: causal pads at cache_len
        h[:bucket] = 0
        h[:bucket, TT : 2 * TT] = idle[:, None]
        h[:bucket, 3 * TT] = idle
        h[phys, :T] = batch.input_ids
        h[phys, TT : TT + T] = batch.positions
        h[phys, 2 * TT : 3 * TT] = batch.output_slots[:, -1:]
        h[phys, 2 * TT : 2 * TT + K] = batch.output_slots
        h[phys, 3 * TT + 1 :] = batch.step_config
        moves = self._take_moves()
        n, rows_end = len(moves), self.max_batch * row
        self._h_in.numpy()[rows_end : rows_end + 2 * n] = moves.reshape(-1)
        end = rows_end + 2 * n if n else bucket * row  # the inputs of the bucket's slots (and the moves, if any)
        self._d_in[:end].copy_(self._h_in[:end], non_blocking=True)
        if n:
            self._move_rows(self._d_in[rows_end : rows_end + 2 * n].view(n, 2))
        return phys, bucket, width

    def _inputs(self, bucket: int, width: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Device views of the staged inputs of slots 0 .. bucket-1 at `width`: ids, positions, outputs [bucket,
        width], cache_len [bucket], step_config [bucket, 3]."""
        T = self.step_tokens
        d = self._d_in[: self.max_batch * self._row_width].view(self.max_batch, self._row_width)[:bucket]
        return d[:, :width], d[:, T : T + width], d[:, 2 * T : 2 * T + width], d[:, 3 * T], d[:, 3 * T + 1 :]

    def _run_padded(self, bucket: int, width: int, sampled: bool, k: int) -> Tensor:
        """The fixed-shape step of physical slots 0 .. bucket-1 at `width` (no host synchronisation: capturable).

        -> [bucket, width, 1 + k]: the token at each output slot entry, then its top-k next ids (k = 0: no top-k
        kernel in the step at all), one tensor so that the host reads the step back in one copy.
        """
        logits = self._padded_logits(bucket, width)
        if not sampled:
            tokens = torch.argmax(logits, dim=-1)
        else:
            _, positions, outputs, _, _ = self._inputs(bucket, width)
            each = torch.arange(bucket, device=self.device).repeat_interleave(width)  # each output row's slot
            tokens = select_rows_torch(
                logits, positions.gather(1, outputs).reshape(-1), self._temperature[each], self._top_k[each],
                self._top_p[each], self._seed[each], self._salts,
            )
        chosen = tokens[:, None]  # [bucket * width, 1]
        if k:  # top-k only where a row asked for it
            chosen = torch.cat((chosen, torch.topk(logits, k, dim=-1).indices), dim=1)
        return chosen.view(bucket, width, 1 + k)

    def _padded_logits(self, bucket: int, width: int) -> Tensor:
        """[bucket * width, vocab]: the logits at each physical slot's output slot entries (capturable)."""
        if self.compile and (bucket, width) not in self._compiled_shapes:
            self._compiled_shapes.add((bucket, width))
            print(f"trt-lookahead: compiling the step for batch bucket {bucket}, width {width} (once) ...",
                  file=sys.stderr, flush=True)
        return self._forward(self.k_cache, self.v_cache, *self._inputs(bucket, width))

    def _compiled_forward(self) -> Callable[..., Tensor]:
        """`_padded_forward` under torch.compile (inductor, default mode, one graph: fullgraph=True), static shapes:
        one graph per (bucket, width), compiled on its first step (before its CUDA graph is captured, by `_graph`'s
        warm-up) and reused by every later one. Inductor fuses the pointwise work around
        kernels/step_ops.py's opaque ops; the exact step's graph keeps every reduction in one piece."""
        options: dict[str, str | int | bool | Callable[..., Any]] | None = (
            {"split_reductions": False} if self.exact else None)
        # its own graphs (isolated from other executors'), one per shape and no more: a recompile beyond them fails
        # (fullgraph); a torch without these arguments (< 2.13) counts every executor's graphs of this method toward
        # one process-wide limit, which each executor then raises by its own graphs
        limits = {"recompile_limit": len(self.buckets) * len(self.widths), "isolate_recompiles": True}
        supported = inspect.signature(torch.compile).parameters
        kwargs: dict[str, Any] = {name: value for name, value in limits.items() if name in supported}
        if "recompile_limit" not in supported:
            torch._dynamo.config.recompile_limit += limits["recompile_limit"]
        return torch.compile(self._padded_forward, fullgraph=True, dynamic=False, options=options, **kwargs)

    def _padded_forward(self, k_cache: Tensor, v_cache: Tensor, ids: Tensor, positions: Tensor, outputs: Tensor,
                        cache_len: Tensor, config: Tensor) -> Tensor:
        """[Bb * K, vocab]: rows of T tokens ids/positions [Bb, T] (configs [Bb, 3], cache_len [Bb]) over slots
        0 .. Bb-1 of caches [layers, >= Bb * S, ..], logits at outputs [Bb, K] (no host synchronisation)."""
        S, dev = self.rows_per_slot, self.device
        bucket, T = ids.shape
        i = torch.arange(T, device=dev)
        rows = (torch.arange(bucket, device=dev)[:, None] * S + cache_len[:, None]) + i[None, :]
        attention: AttentionFn
        if self.attention == "triton":
            attention = StepAttention(cache_len, config, self._no_tree if self.tree is None else self._ends, S)
        else:
            mask = self._step_mask(cache_len, config, T)
            attention = invariant_attention(mask, cache_len, positions) if self.exact else PaddedAttention(mask)
        logits = self.model(
            ids.reshape(-1),
            positions.reshape(-1),
            k_cache,
            v_cache,
            None,
            None,
            (torch.arange(bucket, device=dev)[:, None] * T + outputs).reshape(-1),
            attention=attention,
            cache_rows=rows.reshape(-1),
            ops=self._ops,
        )
        return logits

    def _step_mask(self, cache_len: Tensor, config: Tensor, T: int) -> Tensor:
        """[Bb, T, S]: row b's T queries over its slot's S rows, its cached prefix then its step mask (closed form)."""
        S, dev = self.rows_per_slot, self.device
        i = torch.arange(T, device=dev)
        rel = torch.arange(S, device=dev)[None, None, :] - cache_len[:, None, None]  # [Bb, 1, S] key - cache_len
        W, N, G = (config[:, c, None, None] for c in range(3))
        j = rel.clamp(0, T - 1)
        own = step_visible(i[None, :, None], j, W, N, G)
        if self.tree is not None:  # rows whose G(N-1) slots the tree covers (tree.covers; causal rows too)
            covered = self.tree.nodes >= G * (N - 1)
            own = torch.where(covered, tree_step_visible(i[None, :, None], j, W, N, G, self._ends), own)
        own = own & (rel >= 0) & (rel < T)
        return (rel < 0) | own

    def _graph(self, bucket: int, width: int, sampled: bool, k: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """The CUDA graph of `_run_padded` for (bucket, width, sampled, k), captured on first use. Every graph shares
        one memory pool: they replay one at a time, and each step's output is read back before the next replay."""
        key = (bucket, width, sampled, k)
        entry = self._graphs.get(key)
        if entry is None:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: writes only scratch rows at or past each slot's cache_len
                    self._run_padded(bucket, width, sampled, k)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                chosen = self._run_padded(bucket, width, sampled, k)
            entry = self._graphs[key] = (graph, chosen)
        return entry


def invariant_kernels_reason(device: torch.device) -> str | None:
    """Why kernels/invariant.py's Triton kernels cannot run on `device`, or None."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"runs Triton kernels, on CUDA (or on the CPU under TRITON_INTERPRET=1), not on {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"runs Triton kernels, and `import triton` fails: {exc}"
    return None


def invariant_attention(mask: Tensor, cache_len: Tensor, positions: Tensor) -> AttentionFn:
    """The exact padded step's attention seam for mask [Bb, T, S] over each slot's rows: kernels/padded_attention.py
    over each query's keys in position order (through kernels/step_ops.py: one op, opaque to a compiled step)."""
    from trt_lookahead.kernels import padded_attention

    key_rows = padded_attention.key_rows(mask, cache_len, positions)  # [Bb, T, S], once per step for every layer
    lengths = cache_len.to(torch.int32)

    def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: Tensor, step_mask: Tensor) -> Tensor:
        return step_ops.invariant_padded_attention(q, k_cache, v_cache, key_rows, lengths)

    return attention


def quantized_projection(x: Tensor, module: QuantizedLinear) -> Tensor:
    """A projection on quantized weights in the padded step, fast or exact, the weight dequantized inside the
    product (through kernels/step_ops.py: one op, opaque to a compiled step): kernels/quantized_words.py's for the
    words layout, else kernels/invariant.py's."""
    if module.layout == "words":
        return step_ops.words_linear(x, module.codes, module.scales, module.mins)
    assert module.zero_points is not None  # the blocks layout's
    return step_ops.quantized_linear(x, module.codes, module.scales, module.zero_points, module.mins, module.bits)


def words_layout_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the padded step holds int4 weights in QuantizedLinear's words layout on `device` with `dtype`
    activations: where kernels/quantized_words.py's product runs, the faster one (docs/design.md 6.9)."""
    from trt_lookahead.kernels.quantized_words import words_kernel_reason

    return words_kernel_reason(device, dtype) is None


def invariant_ops() -> Ops:
    """The exact padded step's projections and norms: kernels/invariant.py, as kernels/step_ops.py's ops."""
    return Ops(linear=step_ops.invariant_linear, rms_norm=step_ops.invariant_rms_norm)
