"""What the engine backends (onnxruntime, TensorRT) share: which graph a layout runs with which
step_config, the prefill chunks, and the host-side token choice (docs/design.md sections 5 and 6.3)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from trt_lookahead.engine.format import EngineConfig
from trt_lookahead.errors import UserError
from trt_lookahead.kernels.mask import CAUSAL
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams, select_tokens


@dataclass(frozen=True)
class EngineStep:
    """How a layout runs on an engine: the fixed-T step graph, or the dynamic graph at one token (greedy)."""

    step_graph: bool
    step_config: tuple[int, int, int]  # (W, N, G) of the layout; CAUSAL for the one-token graph


def engine_step(config: EngineConfig, layout: StepLayout) -> EngineStep:
    """The step graph for a layout of the engine's T (a smaller config padded to it), the dynamic graph for
    T = 1; anything else is refused naming the engine's T."""
    T = layout.step_tokens
    if config.step_tokens == T:
        layout.config.check_fits(config.lookahead)
        return EngineStep(True, (layout.config.W, layout.config.N, layout.config.G))
    if T == 1:
        return EngineStep(False, CAUSAL)
    raise UserError(
        f"a {T}-slot step ({layout.config}) does not fit engine {config.path}, built for T={config.step_tokens} "
        f"({config.lookahead}); pad the layout to the engine's T or rebuild"
    )


def prefill_chunks(ids: np.ndarray, chunk: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """(start, int32 graph inputs) per prefill chunk of at most `chunk` tokens: causal, the last row's output."""
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        n = len(part)
        yield start, {
            "input_ids": part.astype(np.int32),
            "positions": np.arange(start, start + n, dtype=np.int32),
            "cache_len": np.array([start], np.int32),
            "step_config": np.array(CAUSAL, np.int32),
            "output_slots": np.array([n - 1], np.int32),
        }


def choose_tokens(
    sampling: SamplingParams, argmax_ids: np.ndarray, read_logits: Callable[[], np.ndarray], positions: np.ndarray
) -> np.ndarray:
    """The graph's argmax ids (greedy), or the seeded sample from its float32 logits on the host."""
    if sampling.greedy:
        return argmax_ids.astype(np.int64)
    return select_tokens(read_logits(), positions, sampling)
