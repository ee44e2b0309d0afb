"""The executor contract: what every backend (torch, onnxruntime, TensorRT, test oracles) provides.

See docs/design.md section 5.

    reset(sampling)                      new request; buffers are reused
    prefill(prompt_ids) -> id            fills KV[0:len(prompt)), returns the next token
    step(input_ids[T], positions[T])     -> ids[T]: next token (argmax or seeded sample) per slot
    commit(slots[k])                     keep the KV of these step slots at rows cache_len, cache_len+1, ...

An executor is built for one static step mask ([T, T] bool, from StepLayout or [[True]] for greedy).
Step KV is written to scratch rows cache_len..cache_len+T-1 (buffers hold max_seq_len + T rows); `commit`
moves the chosen rows down to cache_len.. and advances cache_len. Slots listed in `output_slots` are the
only ones whose ids are read; an executor may leave the others unset.
"""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.sampling import SamplingParams


class Executor(Protocol):
    vocab_size: int
    max_seq_len: int  # prompt + generated tokens it can hold
    step_tokens: int  # T of the step it was built for

    @property
    def cache_len(self) -> int:  # tokens whose KV is committed: rows 0 .. cache_len - 1
        ...

    def reset(self, sampling: SamplingParams) -> None: ...

    def prefill(self, prompt_ids: np.ndarray) -> int: ...

    def step(self, input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray: ...

    def commit(self, slots: np.ndarray) -> None: ...


def check_prompt(prompt_ids: np.ndarray, max_seq_len: int, vocab_size: int) -> np.ndarray:
    """The prompt as a flat int64 array; ValueError if it is empty, too long or outside the vocabulary."""
    ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if not 1 <= len(ids) <= max_seq_len:
        raise ValueError(f"prompt of {len(ids)} tokens does not fit: need 1 <= length <= max_seq_len={max_seq_len}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    return ids


def check_room(cache_len: int, max_seq_len: int) -> None:
    """ValueError if no step fits any more: the cache already holds max_seq_len tokens or more."""
    if cache_len > max_seq_len:
        raise ValueError(f"KV cache full: {cache_len} tokens cached, max_seq_len={max_seq_len}")


def check_commit(slots: np.ndarray, step_tokens: int, cache_len: int, max_seq_len: int) -> np.ndarray:
    """The commit slots as a flat int64 array; ValueError if outside the step or past the cache."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    if len(slots) and (slots.min() < 0 or slots.max() >= step_tokens):
        raise ValueError(f"commit slots must lie in [0, {step_tokens}), got {slots.tolist()}")
    if cache_len + len(slots) > max_seq_len:
        raise ValueError(f"commit of {len(slots)} tokens at p={cache_len} overflows max_seq_len={max_seq_len}")
    return slots


def check_kv_memory(shape: tuple[int, ...], itemsize: int, max_seq_len: int) -> None:
    """UserError, before allocating, if the K and V caches of `shape` cannot fit in this machine's memory."""
    needed = 2 * itemsize * int(np.prod(shape, dtype=object))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > total:
        raise UserError(
            f"max_seq_len {max_seq_len} needs a KV cache of {needed / 2**30:.1f} GiB, more than this machine's "
            f"{total / 2**30:.1f} GiB of memory; lower max_seq_len"
        )
