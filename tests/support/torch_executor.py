"""`TorchExecutor`: the older single-request contract of one layout (reset/prefill/step/commit) over slot 0 of
a BatchedTorchExecutor, which scripts/bench_executor.py still times and tests/backends/test_torch_executor.py
checks; `layout_config` recovers a layout's step_config from its mask. Test support, not shipped.
"""

from __future__ import annotations

import numpy as np
import torch

from trt_lookahead.backends.torch import BatchedTorchExecutor
from trt_lookahead.kernels.mask import CAUSAL, step_mask
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.model.llama import Llama


def layout_config(mask: np.ndarray) -> tuple[int, int, int]:
    """The step_config whose closed-form mask (kernels/mask.py) is `mask`: a lookahead layout, else CAUSAL."""
    mask = np.asarray(mask, bool)
    T = len(mask)
    for levels in (d for d in range(1, T + 1) if T % d == 0):
        for W in range(1, T // levels + 1):
            config = (W, levels + 1, T // levels - W)
            if np.array_equal(step_mask(T, config), mask):
                return config
    if np.array_equal(step_mask(T, CAUSAL), mask):
        return CAUSAL
    raise ValueError(f"step_mask of shape {mask.shape} is neither a lookahead layout's mask nor causal")


class TorchExecutor:
    """The single-request contract of one layout (reset/prefill/step/commit) over slot 0 of a batched executor,
    for the scripts that time one request's steps (scripts/bench_executor.py, scripts/gpu_check.py)."""

    def __init__(
        self,
        model: Llama,
        step_mask: np.ndarray,
        max_seq_len: int,
        output_slots: np.ndarray | None = None,
        device: str | torch.device = "cpu",
        *,
        static_attention: bool | None = None,
        cuda_graph: bool | None = None,
    ) -> None:
        self.config = layout_config(step_mask)
        T = len(step_mask)
        self.batched = BatchedTorchExecutor(
            model, 1, max_seq_len, T, device, padded=static_attention, cuda_graph=cuda_graph
        )
        self.vocab_size, self.max_seq_len, self.step_tokens = model.cfg.vocab_size, int(max_seq_len), T
        slots = np.arange(T) if output_slots is None else np.unique(np.asarray(output_slots, np.int64))
        if len(slots) == 0 or slots[0] < 0 or slots[-1] >= T:
            raise ValueError(f"output_slots must be non-empty step slots in [0, {T}), got {output_slots}")
        self.output_slots = slots
        self.sampling = SamplingParams()

    @property
    def cache_len(self) -> int:
        return self.batched.cache_len(0)

    def reset(self, sampling: SamplingParams | None = None) -> None:
        self.sampling = sampling or SamplingParams()
        self.batched.release(0)

    def prefill(self, prompt_ids: np.ndarray) -> int:
        return self.batched.prefill(0, prompt_ids, self.sampling)

    def step(self, input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        batch = StepBatch(
            np.zeros(1, np.int64), np.asarray(input_ids, np.int64)[None], np.asarray(positions, np.int64)[None],
            np.array([self.config], np.int32), self.output_slots[None],
        )
        return self.batched.step(batch)[0]

    def commit(self, slots: np.ndarray) -> None:
        self.batched.commit(0, slots)

