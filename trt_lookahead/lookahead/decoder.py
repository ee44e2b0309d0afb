"""Lookahead decoding of one request in named phases, and the single-request driver (docs/design.md section 3).

    setup(x)       after prefill: emit x, seed the window and the n-gram pool                  (once)
    prepare()      fill this step's input_ids[T] and positions[T] (preallocated buffers)
    accept(out)    verify the drafts against the step's outputs, emit under the stop and length rules,
                   set `commit_slots` and `finished`
    update(out)    harvest one n-gram per window column, shift the window, replace stop tokens, add
                   the new tokens' n-grams

`RequestDecoder` holds one request's state and runs these phases, so a batched driver can advance many
requests around one executor step (section 9). `LookaheadDecoder` drives one request: prefill -> setup,
then prepare -> executor.step -> accept -> executor.commit(commit_slots) -> update per step, yielding
each step's tokens. Greedy decoding is the degenerate layout (W, N, G) = (1, 2, 0): T = 1, one token.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from trt_lookahead.errors import UserError, as_int
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import Executor
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.pool import OUTPUT, PROMPT, WINDOW, Continuation, NgramPool
from trt_lookahead.lookahead.sampling import SamplingParams

CHAIN = "chain"
NO_DRAFT = -1


@dataclass
class DecodeStats:
    """Counters of one generation. `steps` counts every forward pass that emitted tokens, prefill included."""

    steps: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    executor_seconds: float = 0.0  # inside executor.step/commit during decoding
    accepted_histogram: Counter = field(default_factory=Counter)  # tokens emitted per decode step
    sources: Counter = field(default_factory=Counter)  # accepted draft tokens by origin: prompt/output/window/chain

    @property
    def decode_steps(self) -> int:
        return max(self.steps - 1, 0)

    @property
    def compression(self) -> float:
        """Generated tokens per forward pass (greedy is exactly 1.0)."""
        return self.generated_tokens / self.steps if self.steps else 0.0

    @property
    def host_ms_per_step(self) -> float:
        """Decode wall time outside the executor, per decode step."""
        if not self.decode_steps:
            return 0.0
        return 1000.0 * (self.decode_seconds - self.executor_seconds) / self.decode_steps

    @property
    def tokens_per_second(self) -> float:
        """Tokens emitted by decode steps per decode second (the prefill's token is timed with prefill)."""
        decoded = self.generated_tokens - 1
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "compression": round(self.compression, 4),
            "prefill_seconds": round(self.prefill_seconds, 6),
            "decode_seconds": round(self.decode_seconds, 6),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "host_ms_per_step": round(self.host_ms_per_step, 4),
            "accepted_histogram": {str(k): v for k, v in sorted(self.accepted_histogram.items())},
            "sources": dict(sorted(self.sources.items())),
        }


@dataclass
class DecodeResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token was emitted, and is the last id) or "length"
    stats: DecodeStats


@dataclass(frozen=True)
class Switches:
    """Our additions to lookahead decoding, each switchable for ablations (docs/design.md section 3.8)."""

    bonus: bool = True  # emit the model's token after the last accepted draft
    prompt_pool: bool = True  # seed the pool from the prompt and the accepted output
    chain: bool = True  # verify the window's column-0 chain as an extra candidate


def expect_index(layout: StepLayout) -> np.ndarray:
    """[G + 1, N] int64: the slot whose output each draft is checked against (see `verify`).

    Column 0 is slot 0 (x_t); column m + 1 is the slot of draft m. Rows 0 .. G-1 are the candidates,
    row G the column-0 chain, whose N - 2 drafts leave its last column at slot 0 (never read: run <= N - 2).
    """
    cfg = layout.config
    index = np.zeros((cfg.G + 1, cfg.levels + 1), np.int64)
    index[: cfg.G, 1:] = layout.candidate_slots
    index[cfg.G, 1 : cfg.levels] = layout.chain_slots
    return index


def verify(drafts: np.ndarray, out: np.ndarray, index: np.ndarray, max_accept: int) -> tuple[int, int]:
    """(best row, accepted drafts k): the row whose drafts match the model's outputs longest, first on ties.

    drafts [R, N-1] (-1 = no draft, never matches), out [T] the step's next tokens, index = `expect_index`.
    expect = out[index]; row r accepts the leading run where drafts[r, m] == expect[r, m], capped at
    max_accept; the step emits drafts[best, :k] + [expect[best, k]] (k drafts + the bonus token).

    Worked example, W=2 N=3 G=1 (T = 6: B0 = slots 0 1, B1 = 2 3, candidate V0 = 4 5):
        index  = [[0, 4, 5],  [0, 2, 0]]        V0's slots; the chain row checks B1[0] (slot 2)
        drafts = [[cat, sat], [cat, -1]]        V0 from the pool; the chain row holds B1[0] = cat
        out    = [cat, ., sat, the, sat, on]    out[i]: the model's token after slot i
        expect = [[cat, sat, on], [cat, sat, cat]]
        run    = [2, 1]  ->  best 0, k 2, emitted [cat, sat] + [on]
    """
    expect = out[index]
    run = np.cumprod(drafts == expect[:, :-1], axis=1).sum(axis=1)
    np.minimum(run, max_accept, out=run)
    best = int(np.argmax(run))
    return best, int(run[best])


def check_request(prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int, vocab_size: int,
                  max_seq_len: int) -> np.ndarray:
    """Validate a request before any work; returns the prompt as an int64 array."""
    ids = np.asarray(prompt_ids).reshape(-1)
    if ids.size == 0:
        raise UserError("the prompt is empty: give at least one token")
    # integer arrays compare as they are; anything else (bools, floats, ints beyond 64 bits) id by id
    values = ids.tolist() if ids.dtype.kind in "iu" else [as_int("token id", t) for t in ids.tolist()]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) or max_new_tokens <= 0:
        raise UserError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    bad = [t for t in values if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}); check the tokenizer")
    prompt = np.array(values, np.int64)
    if prompt.size + max_new_tokens > max_seq_len:
        raise UserError(
            f"prompt of {prompt.size} tokens + max_new_tokens {max_new_tokens} exceeds max_seq_len {max_seq_len}; "
            "shorten the prompt, lower max_new_tokens or raise max_seq_len"
        )
    return prompt


class RequestDecoder:
    """One request's decoding state (window, pool, position), advanced by setup / prepare / accept / update."""

    def __init__(
        self,
        layout: StepLayout,
        prompt: np.ndarray,
        max_new_tokens: int,
        stop_tokens: Iterable[int] = (),
        seed: int = 0,
        switches: Switches = Switches(),
    ) -> None:
        cfg = layout.config
        self.layout = layout
        self.prompt = np.asarray(prompt, np.int64)
        self.max_new_tokens = max_new_tokens
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.switches = switches
        self.stats = DecodeStats()
        self.rng = np.random.default_rng(seed)
        prompt_list = self.prompt.tolist()
        self.fillers = np.array([t for t in prompt_list if t not in self.stop_tokens] or prompt_list)
        self.expect_index = expect_index(layout)
        self.draft_slots = self.expect_index[:, 1:]
        self.max_accept = cfg.levels if switches.bonus else cfg.levels - 1
        self.window_size = cfg.levels * cfg.W
        self.candidate_span = slice(self.window_size, self.window_size + cfg.G * cfg.levels)
        self.input_ids = np.zeros(layout.step_tokens, np.int64)  # pad slots keep token 0
        self.positions = np.zeros(layout.step_tokens, np.int64)
        self.drafts = np.full((cfg.G + 1, cfg.levels), NO_DRAFT, np.int64)  # candidate rows, then the chain
        self.window = np.zeros((cfg.levels, cfg.W), np.int64)  # row l = level l, row 0 = B0 = [x_t, L0]
        self.pool = NgramPool(cfg.N, cfg.G)
        self.candidates: list[tuple[Continuation, str]] = []
        self.sequence: list[int] = []
        self.x = NO_DRAFT  # x_t: the last emitted token, whose KV is not cached yet
        self.cache_len = len(self.prompt)  # x_t's position
        self.produced = 0
        self.block: list[int] = []  # this step's verified tokens (drafts + bonus), set by accept
        self.commit_slots = np.zeros(0, np.int64)
        self.finished = False

    @property
    def config(self) -> LookaheadConfig:
        return self.layout.config

    def setup(self, first_token: int) -> list[int]:
        """After prefill: emit the prefill's token; unless that ends the request, seed the window and the pool."""
        x = int(first_token)
        self.produced = self.stats.steps = self.stats.generated_tokens = 1
        self.finished = x in self.stop_tokens or self.max_new_tokens == 1
        if self.finished:
            return [x]
        self.x = x
        self.sequence = [*self.prompt.tolist(), x]
        if self.switches.prompt_pool:
            self.pool.insert_sequence(self.sequence, PROMPT)
        self.window = self.rng.choice(self.fillers, size=self.window.shape)
        self.window[0, 0] = x
        return [x]

    def prepare(self) -> tuple[np.ndarray, np.ndarray]:
        """This step's (input_ids [T], positions [T]): the window level-major, then the candidates of x_t."""
        G, drafts = self.config.G, self.drafts
        self.candidates = self.pool.candidates(self.x, G) if G else []
        drafts[:G] = NO_DRAFT
        if self.candidates:
            drafts[: len(self.candidates)] = [c for c, _ in self.candidates]
        if self.switches.chain:
            drafts[G, : self.config.levels - 1] = self.window[1:, 0]
        self.input_ids[: self.window_size] = self.window.ravel()
        self.input_ids[self.candidate_span] = np.maximum(drafts[:G], 0).ravel()  # empty rows: any valid id
        np.add(self.cache_len, self.layout.rel_positions, out=self.positions)
        return self.input_ids, self.positions

    def accept(self, out: np.ndarray) -> list[int]:
        """Verify against the step's outputs and return the tokens emitted (cut at a stop token or the length)."""
        best, k = verify(self.drafts, out, self.expect_index, self.max_accept)
        self.block = [*self.drafts[best, :k].tolist(), int(out[self.expect_index[best, k]])]
        emitted: list[int] = []
        for token in self.block:
            emitted.append(token)
            self.produced += 1
            if token in self.stop_tokens or self.produced == self.max_new_tokens:
                break
        stats = self.stats
        stats.steps += 1
        stats.generated_tokens = self.produced
        stats.accepted_histogram[len(emitted)] += 1
        if k:
            stats.sources[CHAIN if best == self.config.G else self.candidates[best][1]] += min(k, len(emitted))
        self.finished = (
            len(emitted) < len(self.block) or emitted[-1] in self.stop_tokens or self.produced == self.max_new_tokens
        )
        self.commit_slots = np.concatenate(([0], self.draft_slots[best, :k]))
        return emitted

    def update(self, out: np.ndarray) -> None:
        """After the commit: harvest, shift the window, replace stop tokens, extend the sequence and the pool."""
        cfg = self.config
        self.cache_len += len(self.commit_slots)
        self.x = self.block[-1]
        newest = out[self.layout.window_slots[-1]]
        if cfg.G:
            columns = np.concatenate((self.window, newest[None]), axis=0)  # [N, W]: one n-gram per column
            self.pool.insert_columns(columns[0].tolist(), map(tuple, columns[1:].T.tolist()), WINDOW)
        self.window = np.concatenate((self.window[1:], newest[None]), axis=0)
        self._replace_stop_tokens(self.window[-1, 1:] if cfg.N == 2 else self.window[-1])
        self.window[0, 0] = self.x
        before = len(self.sequence)
        self.sequence.extend(self.block)
        if self.switches.prompt_pool and cfg.G:
            self.pool.insert_sequence(self.sequence, OUTPUT, start=before)

    def _replace_stop_tokens(self, level: np.ndarray) -> None:
        """Stop tokens in the newest level poison the window: swap them for random prompt tokens (in place)."""
        if not self.stop_tokens:
            return
        for i, token in enumerate(level.tolist()):
            if token in self.stop_tokens:
                level[i] = self.fillers[self.rng.integers(len(self.fillers))]


class LookaheadDecoder:
    """Drives an executor built for `layout`, one request at a time; `switches` exist for ablations."""

    def __init__(
        self,
        executor: Executor,
        layout: StepLayout | LookaheadConfig,
        *,
        stop_tokens: Iterable[int] = (),
        seed: int = 0,
        switches: Switches = Switches(),
    ) -> None:
        self.layout = layout if isinstance(layout, StepLayout) else StepLayout(layout)
        if executor.step_tokens != self.layout.step_tokens:
            raise ValueError(
                f"executor steps {executor.step_tokens} tokens but the {self.layout.config} layout needs "
                f"{self.layout.step_tokens}; build the executor for this layout"
            )
        self.executor = executor
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.seed = seed
        self.switches = switches
        self.stats = DecodeStats()

    @property
    def config(self) -> LookaheadConfig:
        return self.layout.config

    def check_request(self, prompt_ids: Sequence[int], max_new_tokens: int) -> np.ndarray:
        """Validate a request before any work; returns the prompt as an int64 array."""
        return check_request(prompt_ids, max_new_tokens, self.executor.vocab_size, self.executor.max_seq_len)

    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None
    ) -> DecodeResult:
        tokens: list[int] = []
        for block in self.stream(prompt_ids, max_new_tokens, sampling):
            tokens.extend(block)
        finish = "stop" if tokens and tokens[-1] in self.stop_tokens else "length"
        return DecodeResult(tokens, finish, self.stats)

    def stream(
        self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None
    ) -> Generator[list[int], None, None]:
        """Yield each step's accepted tokens as soon as the step is verified; self.stats is live.

        Decode time excludes the consumer's time between yields; executor time is inside step and commit.
        """
        prompt = self.check_request(prompt_ids, max_new_tokens)
        ex = self.executor
        request = RequestDecoder(self.layout, prompt, max_new_tokens, self.stop_tokens, self.seed, self.switches)
        stats = self.stats = request.stats
        ex.reset(sampling or SamplingParams())
        start = time.perf_counter()
        first_token = ex.prefill(prompt)
        stats.prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        block = request.setup(first_token)
        if not request.finished:
            stats.decode_seconds += time.perf_counter() - start  # seeding the window and the pool
        yield block
        while not request.finished:
            step_start = time.perf_counter()
            input_ids, positions = request.prepare()
            start = time.perf_counter()
            out = ex.step(input_ids, positions)
            stats.executor_seconds += time.perf_counter() - start
            block = request.accept(out)
            if not request.finished:
                start = time.perf_counter()
                ex.commit(request.commit_slots)
                stats.executor_seconds += time.perf_counter() - start
                request.update(out)
            stats.decode_seconds += time.perf_counter() - step_start
            yield block
