"""LookaheadConfig: the (W, N, G) triple, its validation and the sizes derived from it; the config labels."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

_SEPARATORS = re.compile(r"[,/\s]+")
_INTEGER = re.compile(r"-?[0-9]{1,30}")  # ASCII digits only (str.isdigit also takes other scripts' digits)
MAX_STEP_TOKENS = 1024  # the largest T = (W+G)(N-1) a step may feed; so W, G <= 1024 and N <= 1025
GREEDY = "greedy"  # the label of the (1, 2, 0) config: plain greedy (or sampled) decoding
AUTO = "auto"  # the label of the config tuned for this machine, model and workload (trt_lookahead.tuning)
DEFAULT = "default"  # the runtime's default: DEFAULT_LOOKAHEAD, or an engine's built config
# `LookaheadConfig.split` gives the window WINDOW_SCALE x sqrt(W + G) of a step's columns: harvesting wants a few
# columns at any budget, while a draft tree fed by the pool, suffix matches and recycled top-k keeps paying for more
# nodes; fitted to the best measured splits of T = 28, 56 and 120 at N = 5, shared scope (docs/design.md section 9)
WINDOW_SCALE = 1.2


@dataclass(frozen=True)
class LookaheadConfig:
    """W lookahead columns, N-gram size (N-1 window levels), G verified candidates per step."""

    W: int
    N: int
    G: int

    def __post_init__(self) -> None:
        for name in ("W", "N", "G"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"lookahead {name} must be an integer, got {value!r}")
        if self.W < 1:
            raise ValueError(f"lookahead window W={self.W} is impossible: W must be >= 1")
        if self.N < 2:
            raise ValueError(f"lookahead n-gram size N={self.N} is impossible: N must be >= 2")
        if self.G < 0:
            raise ValueError(f"lookahead verification size G={self.G} is impossible: G must be >= 0")
        if self.step_tokens > MAX_STEP_TOKENS:
            raise ValueError(
                f"lookahead config {self} steps T = (W+G)(N-1) = {self.step_tokens} tokens, above the limit of "
                f"{MAX_STEP_TOKENS}; lower W, N or G (15/5/15 is T = 120)"
            )

    @classmethod
    def greedy(cls) -> LookaheadConfig:
        """The degenerate config (1, 2, 0): one token in, one token out, exactly greedy decoding."""
        return cls(1, 2, 0)

    @classmethod
    def from_label(cls, label: str) -> LookaheadConfig:
        """The config of a `label` (GREEDY or W/N/G), as DecodeStats.configs and tuning entries store it."""
        return cls.greedy() if label == GREEDY else cls.parse(label)

    @classmethod
    def parse(cls, text: str) -> LookaheadConfig:
        """Parse `W,N,G`, `W/N/G` or `[W,N,G]` (as TensorRT-LLM users type it)."""
        body = text.strip().removeprefix("[").removesuffix("]").strip()
        parts = [p for p in _SEPARATORS.split(body) if p]
        if len(parts) != 3 or not all(_INTEGER.fullmatch(p) for p in parts):
            raise ValueError(
                f"lookahead config {text!r} is not of the form W,N,G (also W/N/G or [W,N,G]), e.g. 4,3,4"
            )
        return cls(*(int(p) for p in parts))

    @classmethod
    def split(cls, columns: int, N: int, most: LookaheadConfig | None = None) -> LookaheadConfig:
        """`columns` = W + G columns of N - 1 tokens: W = WINDOW_SCALE sqrt(columns) rounded (at least 1, and a column
        left for G), G the rest; within `most`'s W and G, where a cut G's columns go to the window.
        split(7, 5) = 3/5/4, split(14, 5) = 4/5/10, split(30, 5) = 7/5/23."""
        columns = max(columns, 1)
        window = max(1, min(columns - 1, int(WINDOW_SCALE * math.sqrt(columns) + 0.5)))
        G = min(columns - window, most.G if most else columns)
        return cls(max(min(columns - G, most.W if most else columns), 1), N, G)

    @classmethod
    def cover(cls, configs: Sequence[LookaheadConfig]) -> LookaheadConfig:
        """The smallest config every one of `configs` fits (`check_fits`): the largest W, N and G among them."""
        return cls(*(max(getattr(c, k) for c in configs) for k in ("W", "N", "G")))

    @property
    def is_greedy(self) -> bool:
        return self.step_tokens == 1

    @property
    def label(self) -> str:
        """GREEDY for the one-token config, else W/N/G."""
        return GREEDY if self.is_greedy else str(self)

    @property
    def levels(self) -> int:
        """Window levels (rows of the 2D Jacobi window): N - 1."""
        return self.N - 1

    @property
    def step_tokens(self) -> int:
        """T = (W + G)(N - 1): the fixed number of tokens every step feeds."""
        return (self.W + self.G) * (self.N - 1)

    @property
    def max_accepted_per_step(self) -> int:
        """A full candidate match yields N - 1 tokens plus the bonus token."""
        return self.N

    @property
    def trtllm_max_decoding_tokens(self) -> int:
        """TensorRT-LLM's `maxDecodingTokens` (golden token + drafts); it equals T."""
        return 1 + (self.N - 2) + (self.W - 1 + self.G) * (self.N - 1)

    @property
    def trtllm_max_draft_len(self) -> int:
        return self.trtllm_max_decoding_tokens - 1

    def check_fits(self, engine: LookaheadConfig) -> None:
        """Raise ValueError naming what differs if this request cannot run on `engine`'s shapes."""
        if self.is_greedy:
            return
        too_big = [
            f"{name}={mine} > {theirs}"
            for name, mine, theirs in (("W", self.W, engine.W), ("N", self.N, engine.N), ("G", self.G, engine.G))
            if mine > theirs
        ]
        if too_big:
            raise ValueError(
                f"lookahead config {self} does not fit the engine built for {engine} "
                f"({', '.join(too_big)}); ask for at most {engine} or rebuild the engine"
            )

    def __str__(self) -> str:
        return f"{self.W}/{self.N}/{self.G}"


DEFAULT_LOOKAHEAD = LookaheadConfig(4, 3, 4)
