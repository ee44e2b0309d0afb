"""Lookahead decoding of one request in named phases, driven by a batched step (docs/design.md sections 3, 9).

    setup(x)                     after prefill: emit x, seed the window and the n-gram pool          (once)
    prepare(config, row views)   write this step's row: ids, positions, step_config, output slots
    verify(out_row)              match the drafts against the row's outputs, emit under the stop and
                                 length rules, set `commit_slots` and `finished`
    (executor.commit)            the stepper commits `commit_slots` to the request's KV slot
    harvest(out_row)             harvest the window columns used, shift them, replace stop tokens, add
                                 the new tokens' n-grams

`RequestDecoder` holds one request's state. Each step may use a smaller config than the request's own
(W, N, G): fewer window columns W' <= W and candidates G' <= G at the same N, or GREEDY_STEP (1, 2, 0).
Columns a step does not use keep their state; a step of another N (greedy under N > 2) uses no column.
Which config a step uses never changes the tokens (docs/design.md section 4), only how many are accepted.
lookahead/stepper.py runs these phases for every row of a batched step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from trt_lookahead.errors import UserError, as_int
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.drafts import SUFFIX, Branch, SuffixIndex, lay_tree
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.pool import OUTPUT, PROMPT, SHARED, WINDOW, Continuation, NgramPool, SharedPool
from trt_lookahead.lookahead.recycle import RECYCLE, RECYCLE_CHAINS, SuccessorMap, fill_recycled
from trt_lookahead.lookahead.tree import ROOT, TreeTemplate, covers

CHAIN = "chain"
NO_DRAFT = -1
GREEDY_STEP = LookaheadConfig.greedy()
SUFFIX_MATCH = 4  # suffix drafts match the context's last 1 .. SUFFIX_MATCH tokens
SUFFIX_BRANCHES = 4  # suffix-matched continuations offered to the tree per step


@dataclass
class DecodeStats:
    """Counters of one generation. `steps` counts every forward pass that emitted tokens, prefill included."""

    steps: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time of the decode steps the request was in
    executor_seconds: float = 0.0  # inside executor.step/commit during those steps (a batched step counts whole)
    accepted_histogram: Counter = field(default_factory=Counter)  # tokens emitted per decode step
    sources: Counter = field(default_factory=Counter)  # accepted drafts by origin: prompt/output/window/shared/
    # suffix/chain
    depths: Counter = field(default_factory=Counter)  # accepted drafts by depth (1 = the token after x_t)
    nodes: Counter = field(default_factory=Counter)  # accepted drafts by verification node (template's, then chain's)
    configs: Counter = field(default_factory=Counter)  # decode steps per step config label (greedy or W/N/G)
    # tree steps only, by the template node's (depth, rank): verified on the accepted path / offered (its parent
    # was on that path), so accepted / offered = P(accepted | parent accepted), what Acceptance.fit reads
    tree_accepted: Counter = field(default_factory=Counter)
    tree_offered: Counter = field(default_factory=Counter)

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
            "depths": {str(k): v for k, v in sorted(self.depths.items())},
            "nodes": {str(k): v for k, v in sorted(self.nodes.items())},
            "configs": dict(sorted(self.configs.items())),
            "tree_acceptance": acceptance_counts(self.tree_accepted, self.tree_offered),
        }


def acceptance_counts(accepted: Counter, offered: Counter) -> dict[str, list[int]]:
    """{"depth/rank": [accepted, offered]} of a tree's nodes, the JSON form `tune` stores (Acceptance.fit)."""
    return {f"{d}/{r}": [accepted[d, r], n] for (d, r), n in sorted(offered.items())}


def verify_nodes(layout: StepLayout) -> tuple[np.ndarray, np.ndarray]:
    """(slots [M], parents [M]) of the verifiable nodes: the verification branch's, then the column-0 chain's.

    M = G(N-1) + N-2; a parent is an earlier node, or -1 for x_t (slot 0).
    """
    template, chain = layout.template, layout.chain_slots
    chain_parents = np.arange(template.nodes - 1, template.nodes + len(chain) - 1)  # the node before
    chain_parents[:1] = ROOT
    slots = np.concatenate([layout.candidate_slots.ravel(), chain]).astype(np.int64)
    return slots, np.concatenate([np.asarray(template.parents, np.int64), chain_parents])


def match_drafts(drafts: Sequence[int], out: Sequence[int], tables: StepTables) -> tuple[int, int]:
    """(best node, accepted drafts k): the deepest node whose path from x_t matches the model, first on ties.

    drafts [M] (-1 = no draft, never matches), out [T] the step's next tokens. Node v matches when
    drafts[v] == out[expect_slots[v]] (the model's token after its parent); it is accepted when it and
    all its ancestors match. The step emits the drafts on the path to `best` + out[node_slots[best]]
    (k drafts + the bonus token), or out[0] alone when k = 0.

    Worked example, W=2 N=3 G=1 (T = 6: B0 = slots 0 1, B1 = 2 3, candidate V0 = 4 5):
        node_slots = [4, 5, 2]  expect_slots = [0, 4, 0]   V0's two nodes, then the chain node B1[0]
        drafts     = [cat, sat, cat]                        V0 from the pool, the chain's B1[0] = cat
        out        = [cat, ., sat, the, sat, on]            out[i]: the model's token after slot i
        match      = [T, T, T]   depth [1, 2, 1]  ->  best 1, k 2, emitted [cat, sat] + [out[5]] = [.., on]

    A plain loop over lists (RequestDecoder.verify passes them): it runs right after the model step, when
    numpy's code is out of the CPU's caches and each numpy call costs ~10 us (docs/design.md 9).
    """
    best = k = 0
    reach = [0] * len(drafts)  # accepted drafts on the path to each node, 0 if it or an ancestor fails
    for v, (parent, expect) in enumerate(zip(tables.parents, tables.expect_slots, strict=True)):
        if drafts[v] == out[expect] and (parent == ROOT or reach[parent]):
            depth = reach[v] = reach[parent] + 1 if parent != ROOT else 1
            if depth > k:
                best, k = v, depth
    return best, k


@dataclass(frozen=True)
class StepTables:
    """The static tables of one step config (and tree template), built once (`step_tables`)."""

    config: LookaheadConfig
    step_config: np.ndarray  # [3] int32 (W, N, G)
    rel_positions: np.ndarray  # [T] offsets from x_t's position
    output_slots: np.ndarray  # [K] increasing: the slots whose outputs verify/harvest read
    output_previous: tuple[int, ...]  # [K] the slot of the token before each output slot's, -1: x_t's (layout)
    # plain ints, read per node by `match_drafts` and `verify` (numpy is slow right after the step)
    node_slots: tuple[int, ...]  # [M] the verifiable nodes' slots (`verify_nodes`)
    expect_slots: tuple[int, ...]  # [M] the slot whose output checks each node: its parent's, x_t's = 0
    parents: tuple[int, ...]  # [M] each node's parent (ROOT = x_t)
    depth: np.ndarray  # [M] 1-based depth below x_t
    template: TreeTemplate  # the verification branch's G(N-1) nodes (G chains when linear)
    ranks: tuple[int, ...]  # template.rank, read per node by the tree laying
    newest_slots: np.ndarray  # [W] the last window level: its outputs become the newest level
    window_size: int  # (N - 1) W: the window's slots come first, level-major
    linear: bool  # the verification slots are G linear candidates (no tree, or one too small: tree.covers)
    cells: tuple[tuple[int, int], ...]  # [V] (depth, rank) of each tree node; () when linear
    child_cells: tuple[tuple[tuple[int, int], ...], ...]  # [1 + V] the cells of x_t's, then node v's, children
    label: str  # config.label

    def path_to(self, node: int) -> list[int]:
        """The nodes from x_t's child down to `node`, in order."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


@lru_cache(maxsize=1024)
def step_tables(config: LookaheadConfig, tree: TreeTemplate | None = None) -> StepTables:
    layout = StepLayout(config, tree=tree)
    step_config = np.array((config.W, config.N, config.G), np.int32)
    slots, parents = verify_nodes(layout)
    expect = np.where(parents == ROOT, 0, slots[np.maximum(parents, 0)])
    depth = np.ones(len(slots), np.int64)
    for v, p in enumerate(parents.tolist()):
        if p != ROOT:
            depth[v] += depth[p]
    for value in (step_config, depth):
        value.flags.writeable = False
    template, linear = layout.template, covers(tree, config) is None
    cells = () if linear else tuple(zip(template.depth.tolist(), template.rank.tolist(), strict=True))
    return StepTables(
        config, step_config, layout.rel_positions, layout.output_slots,
        tuple(layout.previous_slots[layout.output_slots].tolist()), tuple(slots.tolist()),
        tuple(expect.tolist()),
        tuple(parents.tolist()), depth,
        template, tuple(template.rank.tolist()), layout.window_slots[-1], config.levels * config.W, linear, cells,
        tuple(tuple(cell for cell, q in zip(cells, template.parents, strict=False) if q == p)
              for p in range(ROOT, len(cells))),
        config.label,
    )


def check_request(prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int, vocab_size: int,
                  max_seq_len: int) -> np.ndarray:
    """Validate a request before any work; returns the prompt as an int64 array."""
    ids = np.asarray(prompt_ids).reshape(-1)
    if ids.size == 0:
        raise UserError("the prompt is empty: give at least one token", field="prompt")
    # integer arrays compare as they are; anything else (bools, floats, ints beyond 64 bits) id by id
    values = ids.tolist() if ids.dtype.kind in "iu" else [as_int("token id", t, "prompt") for t in ids.tolist()]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer):
        raise UserError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}", field="max_new_tokens")
    bad = [t for t in values if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}); check the tokenizer",
                        field="prompt")
    problem = length_error(len(values), int(max_new_tokens), max_seq_len)
    if problem is not None:
        raise UserError(problem.message, field=problem.culprit)
    return np.array(values, np.int64)


@dataclass(frozen=True)
class LengthError:
    """Why a request does not fit its context: `culprit` is "prompt" or the new-token limit's name."""

    culprit: str
    message: str


def length_error(prompt_len: int, new_tokens: int, max_seq_len: int, *, tokens: str = "max_new_tokens",
                 context: str = "max_seq_len", grow: str = "raise max_seq_len") -> LengthError | None:
    """None if `prompt_len` tokens and `new_tokens` more (at least one) fit `max_seq_len`, else the reason.

    The one length rule of every surface; each names the limits as its users know them: `tokens` is the
    new-token limit's name (the runtime's max_new_tokens, the APIs' max_tokens), `context` the context's
    (max_seq_len; the OpenAI API's max_model_len), `grow` how a user could raise it ("" where a client cannot).
    """
    if new_tokens < 1:
        return LengthError(tokens, f"{tokens} must be a positive integer, got {new_tokens}")
    room = max_seq_len - prompt_len
    if room < 1:
        culprit = "prompt"
        problem = f"the prompt's {prompt_len} tokens leave no room to generate in {context} {max_seq_len}"
        fixes = ["shorten the prompt", grow]
    elif new_tokens > room:
        culprit = tokens
        problem = f"the prompt's {prompt_len} tokens + {tokens} {new_tokens} exceed {context} {max_seq_len}"
        fixes = [f"lower {tokens} to at most {room}", "shorten the prompt", grow]
    else:
        return None
    *others, last = [f for f in fixes if f]
    return LengthError(culprit, f"{problem}; {', '.join(others)} or {last}" if others else f"{problem}; {last}")


class RequestDecoder:
    """One request's decoding state (window, pool, position), advanced by setup / prepare / verify / harvest.

    The ablations of docs/design.md 3.8 (tests/support/ablation.py) subclass it: the draft sources are the
    attributes `pool`, `shared`, `suffix` and `successors` and the methods `_pool_candidates`, `_lay_drafts`
    and `_previous`.
    """

    def __init__(
        self,
        config: LookaheadConfig,
        prompt: np.ndarray | Sequence[int],
        max_new_tokens: int,
        stop_tokens: Iterable[int] = (),
        seed: int = 0,
        tree: TreeTemplate | None = None,
        shared: SharedPool | None = None,
        successors: SuccessorMap | None = None,
    ) -> None:
        self.config = config  # the largest config any step of this request may use
        self.tree = tree  # the executor's verification tree template; None = G linear candidates
        self.prompt = np.asarray(prompt, np.int64).reshape(-1)
        self.max_new_tokens = max_new_tokens
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.stats = DecodeStats()
        self.rng = np.random.default_rng(seed)
        prompt_list = self.prompt.tolist()
        self.fillers = np.array([t for t in prompt_list if t not in self.stop_tokens] or prompt_list)
        self.window = np.zeros((config.levels, config.W), np.int64)  # row l = level l, row 0 = B0 = [x_t, L0]
        self.pool = NgramPool(config.N, config.G)
        # other requests' n-grams (None: request scope); fed with text only, read after the own pool
        self.shared = shared if config.G else None
        self.suffix = SuffixIndex(SUFFIX_MATCH) if tree is not None else None
        # token -> top-k successors: this request's own, falling back to the runtime's shared map (if given)
        self.successors = SuccessorMap(successors) if tree is not None else None
        self._tree_rows = covers(tree, config) is not None  # its G(N-1) slots are the tree's (draft_supply)
        self._ids = np.zeros(0, np.int64)  # this step's row of input ids (a view into the stepper's buffer)
        self.candidates: list[tuple[Continuation, str]] = []
        self.sequence: list[int] = []
        self.tokens: list[int] = []  # emitted so far
        self.x = NO_DRAFT  # x_t: the last emitted token, whose KV is not cached yet
        self.cache_len = len(self.prompt)  # x_t's position
        self.block: list[int] = []  # this step's verified tokens (drafts + bonus), set by verify
        self.emitted: list[int] = []  # what this step emitted: the block, cut at a stop token or the length
        self.commit_slots = np.zeros(0, np.int64)
        self.finished = False
        self._tables: StepTables | None = None  # of the step in flight (prepare .. harvest)
        nodes = config.G * config.levels + config.levels - 1  # verification nodes, then the chain's
        self._drafts_buffer = np.empty(nodes, np.int64)
        self._drafts = self._drafts_buffer[:0]
        self._origins = [CHAIN] * nodes  # each node's draft source, for the statistics

    @property
    def finish_reason(self) -> str:
        return "stop" if self.tokens and self.tokens[-1] in self.stop_tokens else "length"

    def setup(self, first_token: int) -> list[int]:
        """After prefill: emit the prefill's token; unless that ends the request, seed the window and the pool."""
        x = int(first_token)
        self.tokens, self.emitted = [x], [x]
        self.stats.steps = self.stats.generated_tokens = 1
        self.finished = x in self.stop_tokens or self.max_new_tokens == 1
        if self.finished:
            return [x]
        self.x = x
        self.sequence = [*self.prompt.tolist(), x]
        self.pool.insert_sequence(self.sequence, PROMPT)
        if self.shared is not None:
            self.shared.insert_sequence(self.sequence, self.config.N)
        if self.suffix is not None:
            self.suffix.extend(self.sequence)
        self.window = self.rng.choice(self.fillers, size=self.window.shape)
        self.window[0, 0] = x
        return [x]

    def fits(self, config: LookaheadConfig) -> bool:
        """Whether a step of this request may use `config`: GREEDY_STEP, or at most W and G at the same N."""
        cfg = self.config
        return config == GREEDY_STEP or (config.N == cfg.N and config.W <= cfg.W and config.G <= cfg.G)

    def draft_supply(self) -> int:
        """Verification rows (of G) a step could fill now; the policy feeds no more (lookahead/policy.py).

        Every row where a draft tree has recycled successors of x_t or a suffix match to lay: those fill the
        tree's nodes wherever the pool has too few candidates (on SmolLM2 it has none for x_t at half the
        steps, docs/design.md 9). Otherwise x_t's pool candidates, as the G linear candidates take them.
        """
        G = self.config.G
        if not G:
            return 0
        if self._tree_rows and ((self.successors is not None and self.successors.get(self.x))
                     or (self.suffix is not None and self.suffix.continuations(1, 1))):
            return G
        return len(self._pool_candidates(G))

    def _pool_candidates(self, limit: int) -> list[tuple[Continuation, str]]:
        """x_t's own pool candidates, then the shared pool's (other than those) up to `limit`, newest first each."""
        own = self.pool.candidates(self.x, limit)
        if self.shared is None or len(own) >= limit:
            return own
        seen = {c for c, _ in own}
        extra = [(c, SHARED) for c in self.shared.candidates(self.config.N, self.x, limit) if c not in seen]
        return own + extra[: limit - len(own)]

    def prepare(
        self,
        config: LookaheadConfig,
        input_ids: np.ndarray,
        positions: np.ndarray,
        step_config: np.ndarray,
        output_slots: np.ndarray,
    ) -> None:
        """Write this step's row into the given views: the window level-major, then the verification branch.

        The views may be wider than the row: pads get token 0 at x_t's position, output slots repeat the last.
        """
        if not self.fits(config):
            raise ValueError(f"a step of config {config} does not fit this request's {self.config}")
        tab = self._tables = step_tables(config, self.tree)
        W, levels = config.W, config.levels
        V = config.G * levels
        drafts = self._drafts = self._lay_drafts(tab)
        T, n = len(tab.rel_positions), tab.window_size
        self._ids = input_ids
        input_ids[:n].reshape(levels, W)[:] = self.window[:levels, :W]
        np.maximum(drafts[:V], 0, out=input_ids[n:T])  # empty nodes: any valid id
        input_ids[T:] = 0
        np.add(tab.rel_positions, self.cache_len, out=positions[:T])
        positions[T:] = self.cache_len
        step_config[:] = tab.step_config
        k = len(tab.output_slots)
        output_slots[:k] = tab.output_slots
        output_slots[k:] = tab.output_slots[-1]

    def _lay_drafts(self, tab: StepTables) -> np.ndarray:
        """This step's drafts [M] (NO_DRAFT: none) and their origins: the verification branch's nodes from the
        pool, suffix and recycled sources, then the column-0 chain."""
        config = tab.config
        levels, G = config.levels, config.G
        V = G * levels
        self.candidates = self._pool_candidates(G) if G else []
        drafts = self._drafts_buffer[: V + levels - 1]  # verification nodes, then the chain
        drafts.fill(NO_DRAFT)
        if tab.linear:  # candidate k in nodes k(N-1) ..
            for k, (continuation, origin) in enumerate(self.candidates):
                drafts[k * levels : (k + 1) * levels] = continuation
                self._origins[k * levels : (k + 1) * levels] = [origin] * levels
        elif V:
            lay_tree(tab.template, tab.ranks, self._branches(tab.template.max_depth), drafts, self._origins)
            if self.successors is not None:
                fill_recycled(tab.template.parents, drafts[:V], self._origins, self.successors, self.x,
                              self._previous)
        drafts[V:] = self.window[1:levels, 0]
        self._origins[V : V + levels - 1] = [CHAIN] * (levels - 1)
        return drafts

    def _branches(self, depth: int) -> list[Branch]:
        """This step's draft branches for the tree: pool candidates (newest first), suffix matches, then recycled
        chains; a rank-r recycled chain scores as the rank-r pool candidate does (docs/design.md 3.9)."""
        branches: list[Branch] = [(c, origin, 1.0 / (1 + rank)) for rank, (c, origin) in enumerate(self.candidates)]
        if self.suffix is not None:
            branches.extend((c, SUFFIX, n - 0.5) for c, n in self.suffix.continuations(depth, SUFFIX_BRANCHES))
        if self.successors is not None:
            chains = self.successors.chains(self.x, RECYCLE_CHAINS, depth, self._previous)
            branches.extend((c, RECYCLE, 1.0 / (1 + rank)) for rank, c in enumerate(chains))
        return branches

    def verify(self, out: np.ndarray) -> list[int]:
        """Match the drafts against the step's outputs; return the tokens emitted (cut at a stop or the length)."""
        tab = self._tables
        assert tab is not None, "verify() needs a prepared step"
        drafts, got = self._drafts.tolist(), out.tolist()
        best, k = match_drafts(drafts, got, tab)
        path = tab.path_to(best) if k else []
        self.block = [*(drafts[v] for v in path), got[tab.node_slots[best] if k else 0]]
        emitted: list[int] = []
        for token in self.block:
            emitted.append(token)
            if token in self.stop_tokens or len(self.tokens) + len(emitted) == self.max_new_tokens:
                break
        self.tokens.extend(emitted)
        self.emitted = emitted
        stats = self.stats
        stats.steps += 1
        stats.generated_tokens = len(self.tokens)
        stats.accepted_histogram[len(emitted)] += 1
        stats.configs[tab.label] += 1
        for depth, node in enumerate(path[: len(emitted)], start=1):
            stats.sources[self._origins[node]] += 1
            stats.depths[depth] += 1
            stats.nodes[node] += 1
        if tab.cells:  # the whole verified path: acceptance, not what the stop token let out
            stats.tree_offered.update(tab.child_cells[0])
            for node in path:
                if node < len(tab.cells):  # not the column-0 chain
                    stats.tree_accepted[tab.cells[node]] += 1
                    stats.tree_offered.update(tab.child_cells[node + 1])
        self.finished = (
            len(emitted) < len(self.block)
            or emitted[-1] in self.stop_tokens
            or len(self.tokens) == self.max_new_tokens
        )
        self.commit_slots = np.array([0, *(tab.node_slots[v] for v in path)], np.int64)  # x_t, then the accepted drafts
        return emitted

    @property
    def _previous(self) -> int:
        """The token before x_t, the context its recycled successors are looked up after."""
        return self.sequence[-2]

    @property
    def recycles(self) -> bool:
        """Whether this request's steps need the executor's top-k ids (StepBatch.top_ids)."""
        return self.successors is not None

    def harvest(self, out: np.ndarray, top: np.ndarray | None = None) -> None:
        """After the commit: harvest and shift the window columns this step used, extend the sequence and the pool.

        top [T, k]: the step's top-k ids at the output slots, recorded as successors of the tokens fed there.
        """
        tab, cfg = self._tables, self.config
        assert tab is not None, "harvest() needs a verified step"
        if self.successors is not None and top is not None:
            slots = np.concatenate((tab.output_slots, self.commit_slots))  # the accepted path last: its context wins
            # plain lists: numpy calls are slow right after the step (match_drafts' docstring)
            ids, before, commit = self._ids.tolist(), self._previous, self.commit_slots.tolist()
            previous = [ids[s] if s >= 0 else before for s in tab.output_previous]
            previous += [before, *(ids[s] for s in commit[:-1])]  # x_t's, then each path node's parent
            self.successors.record(self._ids[slots], top[slots], previous)
        self.cache_len += len(self.commit_slots)
        self.x = self.block[-1]
        if tab.config.N == cfg.N:  # a greedy step under a larger N uses no window column
            W, window = tab.config.W, self.window
            newest = out[tab.newest_slots]
            if cfg.G:  # one n-gram per column: (B0[j], .., B_{N-2}[j], newest[j]), keyed by B0[j]
                insert = self.pool.insert
                for column, last in zip(window[:, :W].T.tolist(), newest.tolist(), strict=True):
                    insert(column[0], (*column[1:], last), WINDOW)
            window[:-1, :W] = window[1:, :W]
            window[-1, :W] = newest
            if self.stop_tokens:
                self._replace_stop_tokens(window[-1, 1:W] if cfg.N == 2 else window[-1, :W])
        self.window[0, 0] = self.x
        before = len(self.sequence)
        self.sequence.extend(self.block)
        if self.suffix is not None:
            self.suffix.extend(self.block)
        if cfg.G:
            self.pool.insert_sequence(self.sequence, OUTPUT, start=before)
        if self.shared is not None:
            self.shared.insert_sequence(self.sequence, cfg.N, start=before)
        self._tables = None

    def _replace_stop_tokens(self, level: np.ndarray) -> None:
        """Stop tokens in the newest level poison the window: swap them for random prompt tokens (in place)."""
        for i, token in enumerate(level.tolist()):
            if token in self.stop_tokens:
                level[i] = self.fillers[self.rng.integers(len(self.fillers))]

