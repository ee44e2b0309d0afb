"""The executor contract: what every backend (torch, onnxruntime, TensorRT, test oracles) provides.

    reset(sampling)                      new request; buffers are reused
    prefill(prompt_ids) -> id            fills KV[0:len(prompt)), returns the next token
    step(input_ids[T], positions[T])     -> ids[T]: next token (argmax or seeded sample) per slot
    commit(slots[k])                     keep the KV of these step slots at p, p+1, ..., p+k-1

An executor is built for one static step mask ([T, T] bool, from StepLayout or [[True]] for greedy).
Step KV is written to scratch rows p..p+T-1 (buffers hold max_seq_len + T rows); `commit` moves the
chosen rows down to p.. and advances p. Slots listed in `output_slots` are the only ones whose ids
are read; an executor may leave the others unset.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from trt_lookahead.sampling import SamplingParams


class Executor(Protocol):
    vocab_size: int
    max_seq_len: int  # prompt + generated tokens it can hold
    step_tokens: int  # T of the step it was built for

    def reset(self, sampling: SamplingParams) -> None: ...

    def prefill(self, prompt_ids: np.ndarray) -> int: ...

    def step(self, input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray: ...

    def commit(self, slots: np.ndarray) -> None: ...
