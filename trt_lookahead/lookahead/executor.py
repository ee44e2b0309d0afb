"""The batched executor contract (docs/design.md section 5) and the argument checks every backend shares.

One step runs B request slots x T tokens. Row b belongs to KV slot slots[b]; its layout is
step_config[b] = (W, N, G) (docs/design.md section 2) padded to T, or (0, 0, 0) for a causal row.

    x = ex.prefill(slot, prompt_ids, sampling)   # KV rows [0, P) of the slot, its sampling set; next token
    out = ex.step(StepBatch(...))                # [B, T] int64 next tokens, valid at output_slots, -1 elsewhere
    ex.commit(slot, rows)                        # keep the KV of these step rows of the slot's last step
    ex.release(slot)                             # the slot is free (cache_len 0)

A row's pads (slots past its layout's real tokens) hold any valid id at position cache_len; an executor
may skip them. Token i of row b is chosen with the slot's sampling parameters, keyed by positions[b, i]
(lookahead/sampling.py). A row's results never depend on the other rows of the step.

`LayoutExecutor` is the single-request contract the engine backends still implement (one executor per
step layout); `LayoutAdapter` runs them under the batched contract until they are batched themselves.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams


@dataclass
class StepBatch:
    """One batched step; see the module docstring."""

    slots: np.ndarray  # [B] int64, distinct KV slots
    input_ids: np.ndarray  # [B, T] int64
    positions: np.ndarray  # [B, T] int64 absolute positions (pads: the row's cache_len)
    step_config: np.ndarray  # [B, 3] int32 (W, N, G) of each row; (0, 0, 0) = a causal row
    output_slots: np.ndarray  # [B, K] int64 step slots read per row (padded by repeating the last)

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])


class Executor(Protocol):
    vocab_size: int
    max_seq_len: int  # prompt + generated tokens a slot can hold
    max_batch: int  # KV slots
    step_tokens: int  # the largest T a row may have

    def prefill(self, slot: int, prompt_ids: np.ndarray, sampling: SamplingParams) -> int: ...

    def step(self, batch: StepBatch) -> np.ndarray: ...

    def commit(self, slot: int, rows: np.ndarray) -> None: ...

    def release(self, slot: int) -> None: ...

    def cache_len(self, slot: int) -> int: ...


def row_tokens(step_config: np.ndarray, tokens: int) -> np.ndarray:
    """[B] real tokens per row: (W + G)(N - 1), or all `tokens` of a causal row (W = 0)."""
    config = np.asarray(step_config, np.int64).reshape(-1, 3)
    real = (config[:, 0] + config[:, 2]) * (config[:, 1] - 1)
    return np.where(config[:, 0] == 0, tokens, real)


def check_slot(slot: int, max_batch: int) -> int:
    """The slot as an int; ValueError if it is not one of the executor's slots."""
    if isinstance(slot, bool) or not isinstance(slot, int | np.integer) or not 0 <= slot < max_batch:
        raise ValueError(f"KV slot {slot!r} does not exist: slots are 0 .. {max_batch - 1}")
    return int(slot)


def check_prompt(prompt_ids: np.ndarray, max_seq_len: int, vocab_size: int) -> np.ndarray:
    """The prompt as a flat int64 array; ValueError if it is empty, too long or outside the vocabulary."""
    ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if not 1 <= len(ids) <= max_seq_len:
        raise ValueError(f"prompt of {len(ids)} tokens does not fit: need 1 <= length <= max_seq_len={max_seq_len}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    return ids


def check_batch(batch: StepBatch, max_batch: int, step_tokens: int, vocab_size: int) -> np.ndarray:
    """ValueError unless `batch` is a valid step for these sizes; returns the real tokens of each row."""
    shape = np.shape(batch.input_ids)
    if len(shape) != 2 or not 1 <= shape[0] <= max_batch or not 1 <= shape[1] <= step_tokens:
        raise ValueError(
            f"a step holds 1 .. {max_batch} rows of 1 .. {step_tokens} tokens; got input_ids of shape {shape}"
        )
    B, T = shape
    for name, want in (("slots", (B,)), ("positions", (B, T)), ("step_config", (B, 3))):
        if np.shape(getattr(batch, name)) != want:
            raise ValueError(f"StepBatch.{name} must have shape {want}, got {np.shape(getattr(batch, name))}")
    out = np.asarray(batch.output_slots)
    if out.ndim != 2 or out.shape[0] != B or out.shape[1] < 1:
        raise ValueError(f"StepBatch.output_slots must have shape ({B}, K >= 1), got {out.shape}")
    slots = np.asarray(batch.slots)
    if len(np.unique(slots)) != B or slots.min() < 0 or slots.max() >= max_batch:
        raise ValueError(f"step rows need distinct KV slots in [0, {max_batch}), got {slots.tolist()}")
    config = np.asarray(batch.step_config, np.int64)
    W, N, G = config[:, 0], config[:, 1], config[:, 2]
    real = row_tokens(config, T)
    causal = (W == 0) & (N == 0) & (G == 0)
    bad = ~causal & ((W < 1) | (N < 2) | (G < 0) | (real > T))
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        raise ValueError(f"row {b}: step_config {config[b].tolist()} is not a layout of at most {T} tokens")
    if out.min() < 0 or (out >= real[:, None]).any():
        raise ValueError("output_slots must name real step slots of their row")
    ids = np.asarray(batch.input_ids)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"input ids must lie in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    return real


def check_room(cache_len: int, max_seq_len: int) -> None:
    """ValueError if no step fits any more: the cache already holds max_seq_len tokens or more."""
    if cache_len > max_seq_len:
        raise ValueError(f"KV cache full: {cache_len} tokens cached, max_seq_len={max_seq_len}")


def check_commit(rows: np.ndarray, step_tokens: int, cache_len: int, max_seq_len: int) -> np.ndarray:
    """The committed step rows as a flat int64 array; ValueError if outside the step or past the cache."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if len(rows) and (rows.min() < 0 or rows.max() >= step_tokens):
        raise ValueError(f"commit rows must be real slots of the last step, [0, {step_tokens}); got {rows.tolist()}")
    if cache_len + len(rows) > max_seq_len:
        raise ValueError(f"commit of {len(rows)} tokens at cache_len {cache_len} overflows max_seq_len={max_seq_len}")
    return rows


class LayoutExecutor(Protocol):
    """The single-request contract of one step layout (the engine backends, until they are batched)."""

    vocab_size: int
    max_seq_len: int
    step_tokens: int

    def reset(self, sampling: SamplingParams) -> None: ...

    def prefill(self, prompt_ids: np.ndarray) -> int: ...

    def step(self, input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray: ...

    def commit(self, slots: np.ndarray) -> None: ...


class LayoutAdapter:
    """The batched contract, one slot, over per-layout LayoutExecutors (transitional, see the module docstring).

    `make_executor(layout)` builds the executor of a layout: the config padded to `padded_tokens` (an
    engine's T), greedy unpadded. A step whose config differs from the slot's current executor's switches
    executors: the new one is prefilled with the committed tokens (prompt + accepted), then steps.
    """

    max_batch = 1

    def __init__(
        self, make_executor: Callable[[StepLayout], LayoutExecutor], step_tokens: int, padded_tokens: int | None = None
    ) -> None:
        self._make = make_executor
        self._padded = padded_tokens
        self._executors: OrderedDict[LookaheadConfig, LayoutExecutor] = OrderedDict()  # least recently used first
        greedy = self._executor(LookaheadConfig.greedy())
        self.vocab_size, self.max_seq_len, self.step_tokens = greedy.vocab_size, greedy.max_seq_len, step_tokens
        self._sequence: list[int] = []  # committed tokens of the slot
        self._sampling = SamplingParams()
        self._config: LookaheadConfig | None = None  # the config whose executor holds the slot's KV
        self._last: tuple[np.ndarray, int] = (np.zeros(0, np.int64), 0)  # last step's ids and real tokens

    def _executor(self, config: LookaheadConfig) -> LayoutExecutor:
        executor = self._executors.pop(config, None)
        if executor is None:
            padded = None if config.is_greedy else self._padded
            executor = self._make(StepLayout(config, padded_tokens=padded))
        self._executors[config] = executor
        while len(self._executors) > 4:  # each holds its own KV buffers
            self._executors.popitem(last=False)
        return executor

    def cache_len(self, slot: int) -> int:
        check_slot(slot, 1)
        return len(self._sequence)

    def prefill(self, slot: int, prompt_ids: np.ndarray, sampling: SamplingParams) -> int:
        check_slot(slot, 1)
        ids = check_prompt(prompt_ids, self.max_seq_len, self.vocab_size)
        executor = self._executor(LookaheadConfig.greedy())
        executor.reset(sampling)
        first = executor.prefill(ids)
        self._sequence, self._sampling, self._config = ids.tolist(), sampling, LookaheadConfig.greedy()
        return first

    def step(self, batch: StepBatch) -> np.ndarray:
        (real,) = check_batch(batch, 1, self.step_tokens, self.vocab_size)
        config = LookaheadConfig(*(int(v) for v in batch.step_config[0]))
        executor = self._executor(config)
        if config != self._config:  # this layout's executor does not hold the slot's KV yet
            executor.reset(self._sampling)
            executor.prefill(np.array(self._sequence, np.int64))
            self._config = config
        T = executor.step_tokens
        ids = np.zeros(T, np.int64)
        positions = np.full(T, len(self._sequence), np.int64)  # pads at cache_len
        ids[:real], positions[:real] = batch.input_ids[0, :real], batch.positions[0, :real]
        out = executor.step(ids, positions)
        result = np.full((1, batch.tokens), -1, np.int64)
        result[0, :real] = out[:real]
        self._last = (ids, int(real))
        return result

    def commit(self, slot: int, rows: np.ndarray) -> None:
        check_slot(slot, 1)
        ids, real = self._last
        rows = check_commit(rows, real, len(self._sequence), self.max_seq_len)
        assert self._config is not None
        self._executor(self._config).commit(rows)
        self._sequence.extend(ids[rows].tolist())
        self._last = (np.zeros(0, np.int64), 0)

    def release(self, slot: int) -> None:
        check_slot(slot, 1)
        self._sequence, self._config = [], None


def check_kv_memory(shape: tuple[int, ...], itemsize: int, max_seq_len: int, max_batch: int = 1) -> None:
    """UserError, before allocating, if the K and V caches of `shape` cannot fit in this machine's memory."""
    needed = 2 * itemsize * int(np.prod(shape, dtype=object))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > total:
        slots = f" for {max_batch} request slots" if max_batch > 1 else ""
        raise UserError(
            f"max_seq_len {max_seq_len} needs a KV cache of {needed / 2**30:.1f} GiB{slots}, more than this "
            f"machine's {total / 2**30:.1f} GiB of memory; lower max_seq_len" + (" or max_batch" if slots else "")
        )
