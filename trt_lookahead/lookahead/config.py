"""LookaheadConfig: the (W, N, G) triple, its validation and the sizes derived from it; the config labels.
Lookahead: what a request asks for (greedy, a fixed config, or `auto` up to a ceiling), parsed once at each edge.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_SEPARATORS = re.compile(r"[,/\s]+")
_INTEGER = re.compile(r"-?[0-9]{1,30}")  # ASCII digits only (str.isdigit also takes other scripts' digits)
MAX_STEP_TOKENS = 1024  # the largest T = (W+G)(N-1) a step may feed; so W, G <= 1024 and N <= 1025
GREEDY = "greedy"  # the label of the (1, 2, 0) config: plain greedy (or sampled) decoding
AUTO = "auto"  # the label of `auto`: the policy chooses each step's config, up to a ceiling
DEFAULT = "default"  # the input word for "as loaded": a runtime's lookahead AUTO, its tree an engine's built one
# `LookaheadConfig.split` gives the window WINDOW_SCALE x sqrt(W + G) of a step's columns: harvesting wants a few
# columns at any budget, while a draft tree keeps paying for more nodes (docs/design.md section 9; the fit to the
# best measured splits of T = 28, 56 and 120: docs/results/2026-11-27-cpu.md, "Splitting a step budget")
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


# the shape `build` compiles when none is given; a checkpoint's cached engine and tree cover it. What a request that
# names no config runs is AUTO, not this (runtime.from_pretrained)
DEFAULT_LOOKAHEAD = LookaheadConfig(4, 3, 4)


@dataclass(frozen=True)
class Lookahead:
    """What a request asks for: greedy, one config every step (`auto` False), or `auto` up to a ceiling.

    Each edge parses its own spelling once into this type (`parse`: CLI and Python text; `from_parts`: the W, N, G
    of an OpenAI body or Triton inputs); a runtime narrows it against what it serves (`narrow`), and the scheduler,
    the policy and the decoder take it as it is (docs/design.md section 9).

        Lookahead.parse("greedy")    Lookahead(1/2/0)            greedy: one token a step
        Lookahead.parse("4,3,4")     Lookahead(4/3/4)            4/3/4 every step
        Lookahead.parse("auto")      Lookahead(None, auto=True)  the policy chooses, up to the runtime's ceiling
        _.narrow(ceiling=7/5/7, ...) Lookahead(7/5/7, auto=True)
    """

    config: LookaheadConfig | None  # the config every step runs; for `auto` the largest (None: the runtime's)
    auto: bool = False

    def __post_init__(self) -> None:
        if self.config is None and not self.auto:
            raise ValueError("a fixed lookahead needs its config")

    @classmethod
    def greedy(cls) -> Lookahead:
        return cls(LookaheadConfig.greedy())

    @classmethod
    def parse(cls, value: Any) -> Lookahead:
        """A Lookahead, a LookaheadConfig, or text: "greedy", "auto", or W,N,G (ValueError naming the forms)."""
        if isinstance(value, Lookahead):
            return value
        if isinstance(value, LookaheadConfig):
            return cls(value)
        if not isinstance(value, str):
            raise ValueError(f"lookahead must be {GREEDY!r}, {AUTO!r}, 'W,N,G' text or a LookaheadConfig, got "
                             f"{value!r}")
        word = value.strip().lower()
        if word == GREEDY:
            return cls.greedy()
        if word == AUTO:
            return cls(None, auto=True)
        return cls(LookaheadConfig.parse(value))

    @classmethod
    def from_parts(cls, values: Sequence[int | None], served: LookaheadConfig, names: Sequence[str]) -> Lookahead:
        """A fixed config from a request's (W, N, G): omitted (None) values from `served`, each at most `served`'s
        (ValueError naming the request's `names` for W, N and G otherwise). (1, 2, 0) is greedy and always fits."""
        limits = (served.W, served.N, served.G)
        W, N, G = (limit if value is None else value for value, limit in zip(values, limits, strict=True))
        config = LookaheadConfig(W, N, G)
        if not config.is_greedy and (config.W > served.W or config.N > served.N or config.G > served.G):
            at_most = ", ".join(f"{name}={limit}" for name, limit in zip(names, limits, strict=True))
            raise ValueError(
                f"lookahead (W, N, G) = ({W}, {N}, {G}) exceeds the served config ({served.W}, {served.N}, "
                f"{served.G}); ask for at most {at_most}"
            )
        return cls(config)

    @property
    def ceiling(self) -> LookaheadConfig:
        """The largest config a step of the request may use (set once narrowed)."""
        if self.config is None:
            raise ValueError("`auto` has no ceiling until a runtime narrows it")
        return self.config

    @property
    def label(self) -> str:
        """AUTO, GREEDY or W/N/G, as results and stats report the choice."""
        return AUTO if self.auto else self.ceiling.label

    def narrow(self, auto_ceiling: LookaheadConfig, built: LookaheadConfig | None, step_tokens: int) -> Lookahead:
        """This choice as a runtime runs it: `auto` up to `auto_ceiling` (its own ceiling, if any, within it;
        `auto` whose ceiling is greedy is plain greedy); a config must fit the engine's `built` config and the
        executor's `step_tokens` (ValueError naming the limit and the fix)."""
        if self.auto:
            mine = self.config or auto_ceiling
            ceiling = LookaheadConfig(*(min(getattr(mine, k), getattr(auto_ceiling, k)) for k in ("W", "N", "G")))
            return Lookahead.greedy() if ceiling.is_greedy else Lookahead(ceiling, auto=True)
        config = self.ceiling
        if built is not None:
            config.check_fits(built)
        if config.step_tokens > step_tokens:
            raise ValueError(
                f"lookahead config {config} feeds {config.step_tokens} tokens per step; this runtime's executor "
                f"takes at most {step_tokens}: ask for a smaller W, N or G"
            )
        return self

    def __str__(self) -> str:
        return self.label
