"""Load- and acceptance-aware lookahead: how much of the step each request uses, chosen every step.

    policy = LookaheadPolicy(StepCost(...), Priors({...}))       # both measured by `trt-lookahead tune`
    state = policy.start(Lookahead(LookaheadConfig(4, 3, 4), auto=True))      # per request
    configs = policy.choose([state, ...], supplies=[3, 0, ...], pads_rows=True)  # per step
    policy.observe(state, configs[0], emitted=2)                               # after the step
    policy.observe_step(tokens=M, rows=B, seconds=s)                           # its wall time (the scheduler)

A request's ladder runs from GREEDY_STEP through 2, 4, 8, ... columns, each split into window and tree by
`LookaheadConfig.split` within its own config (1/N/1, 2/N/2, 3/N/5 below 5/N/11), up to that config; a rung's
candidate rows are capped by the rows the request can fill (`supplies`, RequestDecoder.draft_supply: x_t's pool
candidates, or every row of a draft tree that recycled successors or a suffix match fill), since empty rows would
cost tokens and never match. Expected tokens of a rung: e = 1 + the config's prior extra tokens per step (tune's
measured compression - 1) x the request's own acceptance ratio, at most N. The ratio is an EMA of observed / prior
extra tokens of the steps that verified drafts; it starts at 1 and drifts back towards 1 while the request verifies
none, so a request whose drafts kept failing is probed again later. A window-only rung (chosen when x_t has no
drafts) emits only what the column-0 chain matches, far below its prior (interpolated from rungs with drafts), and
says nothing of the drafts, so it scales its prior by a ratio of its own, learnt the same way from window-only
steps: it soon runs greedy where tokens are dear, and keeps the widest window where they are cheap, for its
harvest. A request that has drafts to verify and has run `probe_every` steps without them in a row runs its
cheapest rung with drafts once whatever the prediction (a probe): a request whose drafts match far better than
tune's prompts did (code, quoted text) then climbs where the priors alone would keep it greedy. `probe_every`
starts at PROBE_EVERY, doubles after each lookahead step that accepted nothing (up to MAX_PROBE_EVERY) and resets
after one that accepted, so probing a request whose drafts keep failing costs ever less. A probe whose step shape has
been timed at this row count runs only if it could pay: if the policy, given that request's drafts matching as well
as a ratio can say (MAX_RATIO; every `auto` row's, where rows pad), would choose drafts; at loads where even that
loses (8 rows of a small CPU), the step's timing is all a probe learns, and it has. The step's predicted speed
is sum(e) / c(M, B) for M real tokens in B rows. c starts as tune's measurement (or the priors) and learns while
it runs (LearnedCost): per row count B, a factor f_B(M) from the wall time of every decode step the scheduler
runs (steps with prompt chunks are not fed: the prompts' tokens, not the policy's choice, make their cost), kept
at knots in log M as the lower median of each knot's last steps' observed / tuned ms, so a stale or wrong tuning
costs a few steps and one slow step changes nothing once a knot has history. The policy times only what it runs,
so both sides are made observable: lookahead dearer than tuned is timed as it runs and the policy steps down the
ladder to greedy (below the lowest timed shape tune's value holds: the greedy step is not scaled by the lookahead
steps' error); lookahead cheaper than tuned is timed by the probes, and the knots just above the highest timed
one follow its trend, so the policy climbs while the steps it runs stay cheap; an all-greedy step the tuning made
too dear, never chosen, is run once every GREEDY_PROBE_EVERY steps of a row count without one (when every request
is `auto`); a knot not timed for STALE steps of its row count is forgotten, so a shape found dear is retried.
Each request's ladder is reduced to its upper concave hull; all requests' upgrades are taken in order of extra
tokens per extra step token while the predicted speed grows. All-greedy is always a candidate, so the prediction
never falls below batched greedy but for the probes. Explicit configs run every step as asked.
An executor that pads rows (lookahead/executor.py `pads_rows`: the engines, the CUDA step) runs B rows of the
widest row's tokens, so the step is priced at M = B x width (`priced_tokens`, for the choice and for what the
scheduler feeds back) and rows narrower than the step cost nothing: the policy tries each width a rung has, every
request taking its rung of most expected tokens that fits, and keeps the fastest. Probes there widen every row, so
the rows probe together (all ride in the step one request's probe widens) and a probe waits `probe_every` times
what widening the B rows costs over one request's probe alone. The policy changes
how fast a request decodes, never its tokens (docs/design.md section 4).

`auto` runs an AutoPolicy: a ceiling (its largest config) and a policy, from the tuning entry `trt-lookahead tune`
measured for the model, dtype, backend and machine (`AutoPolicy.from_entry`), else from the built-in priors
(`AutoPolicy.untuned`: PRIOR_STEP_COST and PRIOR_COMPRESSION, up to the ladder's widest config that fits the
executor, said once on stderr). The ladder's constants (NGRAMS, TOP, COLUMNS, `widest`, `auto_cover`) live here
too: the runtime sizes engines and trees by them, and tune measures along them.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from trt_lookahead.lookahead.config import MAX_STEP_TOKENS, Lookahead, LookaheadConfig
from trt_lookahead.lookahead.decoder import GREEDY_STEP
from trt_lookahead.lookahead.executor import priced_tokens

EMA = 0.2  # weight of the newest observation in a request's acceptance ratio
RECOVERY = 0.05  # per step that observes it not, a ratio moves this fraction of the way back to 1
MAX_RATIO = 4.0
MARGIN = 0.02  # lookahead must be predicted this much faster than all-greedy to be chosen
PROBE_EVERY = 8  # steps without drafts in a row after which a request with drafts probes its cheapest rung with them
MAX_PROBE_EVERY = 256  # the longest wait between probes, reached by doubling after failed lookahead steps
# the `auto` ladder (docs/design.md section 8): the N it may use, and how wide its steps get
NGRAMS = (3, 4, 5)  # the N `auto` may use
TOP = 8  # the most window columns and candidates of tune's cost ladder and of the standard cached engine (8/5/8)
COLUMNS = 2 * TOP  # W + G of the widest step `auto` uses, split by LookaheadConfig.split: 5/N/11
LEAST_COLUMNS = 2  # the fewest a step budget is split into: a window column and a tree column
# Built-in priors: what `auto` runs on without a tuning entry for its model, dtype, backend and machine. The
# conservative end of what `tune` measured on a CPU (docs/design.md section 8): a step's cost in units of a
# one-token step by step tokens M (one curve for any number of rows: M counts every row's tokens), and the
# compression of linear candidates (a draft tree compresses more at every rung)
PRIOR_STEP_COST = ((1, 1.0), (4, 1.13), (32, 2.62))
PRIOR_COMPRESSION = {"1/3/1": 1.31, "2/3/2": 1.34, "4/3/4": 1.45, "8/3/8": 1.59, "8/5/8": 1.63}
TUNED, PRIORS = "tuned", "priors"  # where an AutoPolicy comes from
# learning the step cost while running (LearnedCost)
KNOTS = 2  # correction knots per doubling of a step's tokens: a knot pools steps within about 20% of its M
WINDOW = 5  # steps a knot remembers: their median ignores two slow ones and follows a real change within three
EXTRAPOLATE = 2  # knots (one doubling of M) past the highest observed one that follow its trend: one rung up
STALE = 256  # steps of a row count after which a knot it has not observed is forgotten: dear shapes are retried
UNCONFIRMED = 16  # the same for a knot one step made: a single slow step keeps its shape off this long at most
GREEDY_PROBE_EVERY = 64  # steps of a row count without an all-greedy one after which `auto` runs one to time it


class StepCost:
    """Predicted milliseconds of one executor step of B rows holding M real tokens in all.

    `points[B]` lists measured (M, ms) for B rows. Between measured M: linear; beyond the last two
    (or before the first two): their line. Between measured B: linear; outside: the nearest B.
    """

    def __init__(self, points: Mapping[int, Sequence[tuple[int, float]]]) -> None:
        self.points = {int(b): sorted((int(m), float(ms)) for m, ms in pts) for b, pts in points.items()}
        if not self.points or any(len(p) < 2 or len({m for m, _ in p}) < len(p) for p in self.points.values()):
            raise ValueError("a step cost needs, for each row count, at least two distinct token counts")
        self.rows = np.array(sorted(self.points), np.float64)
        self._curves: dict[tuple[int, int], np.ndarray] = {}

    @classmethod
    def linear(cls, base_ms: float, per_token_ms: float, per_row_ms: float = 0.0, max_rows: int = 64) -> StepCost:
        """c(M, B) = base + per_token M + per_row B: a shape for tests and for a runtime before tuning."""
        rows = (1, max_rows)
        return cls({b: [(m, base_ms + per_token_ms * m + per_row_ms * b) for m in (b, 2 * b + 8)] for b in rows})

    def to_dict(self) -> dict[str, list[list[float]]]:
        return {str(b): [[m, round(ms, 4)] for m, ms in pts] for b, pts in self.points.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Sequence[Sequence[float]]]) -> StepCost:
        return cls({int(b): [(int(m), float(ms)) for m, ms in pts] for b, pts in data.items()})

    def curve(self, rows: int, max_tokens: int) -> np.ndarray:
        """[max_tokens + 1] predicted ms of M = 0 .. max_tokens tokens in `rows` rows (cached)."""
        key = (rows, max_tokens)
        curve = self._curves.get(key)
        if curve is None:
            m = np.arange(max_tokens + 1, dtype=np.float64)
            b = float(np.clip(rows, self.rows[0], self.rows[-1]))
            hi = min(int(np.searchsorted(self.rows, b)), len(self.rows) - 1)
            lo = max(hi - 1, 0) if self.rows[hi] > b else hi
            w = 0.0 if hi == lo else (b - self.rows[lo]) / (self.rows[hi] - self.rows[lo])
            curve = (1 - w) * self._along(int(self.rows[lo]), m) + w * self._along(int(self.rows[hi]), m)
            self._curves[key] = curve
        return curve

    def __call__(self, tokens: int, rows: int) -> float:
        return float(self.curve(rows, tokens)[tokens])

    def _along(self, rows: int, m: np.ndarray) -> np.ndarray:
        xs, ys = (np.array(v, np.float64) for v in zip(*self.points[rows], strict=True))
        head = ys[0] + (ys[1] - ys[0]) / (xs[1] - xs[0]) * (m - xs[0])
        tail = ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (m - xs[-1])
        return np.where(m < xs[0], head, np.where(m > xs[-1], tail, np.interp(m, xs, ys)))


class LearnedCost:
    """A tuned StepCost corrected by the step times the runtime observes: c(M, B) = tuned(M, B) x f_B(M).

    log f_B is learnt at knots KNOTS per doubling of M, for each B apart: a knot keeps the log of observed /
    tuned ms of its last WINDOW steps and answers their lower median (a slow step counts only once most agree,
    a real change is followed within a few steps). Between observed knots log f is linear in log M; past the
    highest it follows the two highest knots' line for EXTRAPOLATE knots, then stays flat (a cheaper-than-tuned
    trend is tried one rung further, and the step that runs it corrects it); below the lowest (by more than half a
    knot) it is 0: tune's own value. A knot not observed for STALE steps of its B (UNCONFIRMED when one step made
    it: tried again, its old step and the new one decide by their lower median) is forgotten, so a shape found
    dear is tried again now and then. How the policy gets both the greedy and the lookahead shapes observed: the
    module docstring. Touched only by the scheduler thread (the one that runs the policy).
    """

    def __init__(self, tuned: StepCost) -> None:
        self.tuned = tuned
        self.observations = 0  # steps observed, and the last (tokens, rows, ms): what the scheduler fed
        self.last: tuple[int, int, float] | None = None
        self._knots: dict[int, dict[int, deque[float]]] = {}  # rows -> knot -> log(observed / tuned) of its steps
        self._seen: dict[int, dict[int, int]] = {}  # rows -> knot -> that rows' step count when last observed
        self._steps: dict[int, int] = {}  # rows -> steps observed with that many rows
        self._doubted: dict[int, dict[int, float]] = {}  # rows -> knot -> the one step of a knot forgotten unconfirmed
        self._since_greedy: dict[int, int] = {}  # rows -> steps of that many rows since one of one token per row
        self._curves: dict[int, np.ndarray] = {}  # rows -> the curve as learnt so far (dropped by `observe`)

    def __call__(self, tokens: int, rows: int) -> float:
        return float(self.curve(rows, tokens)[tokens])

    def curve(self, rows: int, max_tokens: int) -> np.ndarray:
        """[max_tokens + 1] predicted ms of M = 0 .. max_tokens tokens in `rows` rows (read-only: kept until the
        next step of `rows` rows is observed, as the policy asks for it many times a step)."""
        curve = self._curves.get(rows)
        if curve is None or len(curve) <= max_tokens:
            curve = self._curves[rows] = self._learned(rows, max_tokens)
        return curve[: max_tokens + 1]

    def _learned(self, rows: int, max_tokens: int) -> np.ndarray:
        tuned = self.tuned.curve(rows, max_tokens)
        knots = self._knots.get(rows)
        if not knots:
            return tuned
        xs = np.array(sorted(knots), np.float64)
        ys = np.array([_lower_median(knots[int(x)]) for x in xs])
        x = KNOTS * np.log2(np.maximum(np.arange(max_tokens + 1, dtype=np.float64), 1.0))
        log_f = np.interp(x, xs, ys)
        if len(xs) >= 2:  # past the highest knot: the line of the two highest, for EXTRAPOLATE knots
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            log_f = np.where(x > xs[-1], ys[-1] + slope * (np.minimum(x, xs[-1] + EXTRAPOLATE) - xs[-1]), log_f)
        log_f[x < xs[0] - 0.5] = 0.0
        return tuned * np.exp(log_f)

    def observe(self, tokens: int, rows: int, ms: float) -> None:
        """Learn from one step of `rows` rows, `tokens` real tokens in all, that took `ms` milliseconds."""
        tuned = self.tuned(tokens, rows)
        if tokens < 1 or rows < 1 or ms <= 0.0 or tuned <= 0.0:
            return
        self.observations += 1
        self.last = (tokens, rows, ms)
        self._curves.pop(rows, None)
        steps = self._steps[rows] = self._steps.get(rows, 0) + 1
        self._since_greedy[rows] = 0 if tokens == rows else self._since_greedy.get(rows, 0) + 1
        knot = _knot(tokens)
        knots, seen = self._knots.setdefault(rows, {}), self._seen.setdefault(rows, {})
        doubted = self._doubted.setdefault(rows, {})
        if knot not in knots:  # a knot forgotten unconfirmed starts from its one step: the two then decide
            knots[knot] = deque([doubted.pop(knot)] if knot in doubted else [], maxlen=WINDOW)
        knots[knot].append(math.log(ms / tuned))
        seen[knot] = steps
        for k in [k for k, at in seen.items() if steps - at > (STALE if len(knots[k]) > 1 else UNCONFIRMED)]:
            if len(knots[k]) == 1:
                doubted[k] = knots[k][0]
            del knots[k], seen[k]

    def observed(self, tokens: int, rows: int) -> bool:
        """Whether steps of about `tokens` tokens in `rows` rows have been timed (their knot holds steps)."""
        return tokens >= 1 and _knot(tokens) in self._knots.get(rows, {})

    def greedy_due(self, rows: int) -> bool:
        """Whether `rows` rows have run GREEDY_PROBE_EVERY steps since their one-token-per-row step was observed."""
        return self._since_greedy.get(rows, 0) >= GREEDY_PROBE_EVERY

    def greedy_probed(self, rows: int) -> None:
        """An all-greedy step was chosen for `rows` rows: the next greedy probe waits GREEDY_PROBE_EVERY again."""
        self._since_greedy[rows] = 0


def _knot(tokens: int) -> int:
    """The knot a step of `tokens` tokens (at least 1) is learnt at: KNOTS per doubling of M."""
    return round(KNOTS * math.log2(tokens))


def _lower_median(values: deque[float]) -> float:
    """The lower median: of two, the smaller; a knot's one slow step needs others that agree to raise it."""
    return sorted(values)[(len(values) - 1) // 2]


class Priors:
    """Measured compression (tokens per step) of configs; `extra(config)` = expected extra tokens per step.

    A config that was not measured is interpolated between the measured configs of the same N by T
    (linear in log T; below the smallest, scaled down with log T), else between all of them; greedy is 0.
    """

    def __init__(self, compression: Mapping[str, float]) -> None:
        table = {
            LookaheadConfig.parse(c): float(v)
            for c, v in compression.items()
        }
        self.compression = {c: v for c, v in table.items() if not c.is_greedy}
        self.extra = lru_cache(maxsize=4096)(self._extra)

    def to_dict(self) -> dict[str, float]:
        return {str(c): round(v, 4) for c, v in sorted(self.compression.items(), key=lambda i: str(i[0]))}

    def _extra(self, config: LookaheadConfig) -> float:
        if config.is_greedy or not self.compression:
            return 0.0
        if config in self.compression:
            return max(self.compression[config] - 1.0, 0.0)
        known = {c: v for c, v in self.compression.items() if c.N == config.N} or self.compression
        xs, ys = zip(*sorted((math.log(c.step_tokens), v - 1.0) for c, v in known.items()), strict=True)
        x = math.log(config.step_tokens)
        if x < xs[0]:
            return max(ys[0] * x / xs[0], 0.0)
        return max(float(np.interp(x, xs, ys)), 0.0)


@dataclass
class RequestState:
    """What the policy knows about one request."""

    config: LookaheadConfig  # the request's largest config
    auto: bool  # the policy chooses each step up to `config` (False: `config` every step)
    ladder: tuple[LookaheadConfig, ...]
    ratio: float = 1.0  # observed / prior extra tokens of its steps with drafts (EMA)
    window_ratio: float = 1.0  # the same of its window-only steps
    draftless_run: int = 0  # steps without drafts (greedy or window-only) since its last one with drafts
    probe_every: int = PROBE_EVERY  # steps without drafts in a row before a probe (see the module docstring)


def ladder(config: LookaheadConfig) -> tuple[LookaheadConfig, ...]:
    """GREEDY_STEP, then `LookaheadConfig.split` of 2, 4, 8, ... columns within `config`, then `config`."""
    rungs = [GREEDY_STEP]
    columns = 2
    while columns < config.W + config.G:
        rung = LookaheadConfig.split(columns, config.N, config)
        if rung != rungs[-1]:
            rungs.append(rung)
        columns *= 2
    if not config.is_greedy:
        rungs.append(config)
    return tuple(rungs)


def budget_split(step_tokens: int, n: int, engine: LookaheadConfig | None = None) -> LookaheadConfig:
    """A step of at most `step_tokens` tokens at N = n: its T // (N - 1) columns (at least LEAST_COLUMNS) split into
    window and tree by LookaheadConfig.split, within an engine's W and G (56 at N = 5: 4/5/10)."""
    return LookaheadConfig.split(max(LEAST_COLUMNS, step_tokens // (n - 1)), n, engine)


def widest(n: int, step_tokens: int, engine: LookaheadConfig | None = None) -> LookaheadConfig:
    """The largest config of N = n `auto` may use: `budget_split` of COLUMNS columns (fewer where `step_tokens` is
    smaller)."""
    return budget_split(min(step_tokens, COLUMNS * (n - 1)), n, engine)


def auto_cover() -> LookaheadConfig:
    """The W, N and G every config `auto` may use fits, where no engine limits them (5/5/11)."""
    return LookaheadConfig.cover([widest(n, MAX_STEP_TOKENS) for n in NGRAMS])


Rung = tuple[int, float, LookaheadConfig]  # (step tokens, prior extra tokens, config)
Upgrade = tuple[float, int, int, float, LookaheadConfig]  # (extra tokens per extra step token, owner, dT, dE, rung)


class LookaheadPolicy:
    """See the module docstring."""

    def __init__(self, cost: StepCost, priors: Priors, learn: bool = True) -> None:
        """`learn`: correct the step cost by the steps observed (False: choices depend on tokens and `cost` only,
        as a replay of a tuning entry needs)."""
        self.cost = LearnedCost(cost)  # tune's (or the priors') step cost, corrected by the steps observed
        self.priors = priors
        self.learn = learn
        self.rungs = lru_cache(maxsize=4096)(self._rungs)

    def start(self, lookahead: Lookahead) -> RequestState:
        """A request's state from its narrowed choice: a fixed config runs as asked, `auto` climbs its ladder."""
        return RequestState(lookahead.ceiling, lookahead.auto, ladder(lookahead.ceiling))

    def expected(self, state: RequestState, config: LookaheadConfig) -> float:
        """Expected tokens of one step of `config` for this request."""
        return _expected(_ratio(state, config), self.priors.extra(config), config.N)

    def choose(self, states: Sequence[RequestState], supplies: Sequence[int], pads_rows: bool = False
               ) -> list[LookaheadConfig]:
        """Each request's config for the coming step (states[i] with supplies[i] pool candidates); `pads_rows`: the
        executor runs every row as wide as the widest (lookahead/executor.py), so a step is priced as B x widest."""
        options = self._options(states, supplies) if pads_rows else []
        chosen = self._fastest_padded(states, options) if pads_rows else self._fastest(states, supplies)
        rows = len(states)
        if all(s.auto for s in states) and not all(c.is_greedy for c in chosen) and self.cost.greedy_due(rows):
            self.cost.greedy_probed(rows)  # time the all-greedy step again: lookahead is judged against it
            return [GREEDY_STEP] * rows
        if pads_rows:
            return self._probe_padded(states, supplies, options, chosen)
        for i, (state, supply) in enumerate(zip(states, supplies, strict=True)):
            if chosen[i].is_greedy and state.auto and state.draftless_run >= state.probe_every:
                probe = self._probe_rung(state, supply)
                if probe is None:
                    continue
                tokens = sum(c.step_tokens for c in chosen) - chosen[i].step_tokens + probe.step_tokens
                if not self.cost.observed(tokens, rows) or self._fastest(  # it could pay: with its best drafts
                        [*states[:i], replace(state, ratio=MAX_RATIO), *states[i + 1:]], supplies)[i].G:
                    chosen[i] = probe
        return chosen

    def _probe_rung(self, state: RequestState, supply: int) -> LookaheadConfig | None:
        """The request's cheapest rung with drafts (None: it has none to verify)."""
        return next((cfg for _, _, cfg in self.rungs(state.ladder, min(supply, state.config.G)) if cfg.G), None)

    def _options(self, states: Sequence[RequestState], supplies: Sequence[int]) -> list[list[tuple[int, float,
                                                                                                LookaheadConfig]]]:
        """Per request its (step tokens, expected tokens, rung) choices of the step: an `auto` request's rungs capped
        by its supply, a fixed config alone (computed once per padded step, read at every width)."""
        return [[(t, _expected(_ratio(state, cfg), extra, cfg.N), cfg)
                 for t, extra, cfg in self.rungs(state.ladder, min(supply, state.config.G))]
                if state.auto else [(state.config.step_tokens, self.expected(state, state.config), state.config)]
                for state, supply in zip(states, supplies, strict=True)]

    def _at_width(self, options: Sequence[Sequence[tuple[int, float, LookaheadConfig]]], width: int
                  ) -> tuple[float, list[LookaheadConfig]]:
        """(expected tokens, configs) of a padded step `width` wide: each request takes its choice of most expected
        tokens that fits (narrower rows cost the same as the widest; of equal ones the narrowest; greedy, or a fixed
        config, where none fits)."""
        expected, chosen = 0.0, []
        for choices in options:
            t0, e0, cfg0 = choices[0]  # greedy for `auto` (its ladder starts there), else the fixed config
            best = max(((e, -t, cfg) for t, e, cfg in choices if t <= width), default=(e0, -t0, cfg0),
                       key=lambda c: (c[0], c[1]))
            expected += best[0]
            chosen.append(best[2])
        return expected, chosen

    def _fastest_padded(self, states: Sequence[RequestState],
                        options: Sequence[Sequence[tuple[int, float, LookaheadConfig]]]) -> list[LookaheadConfig]:
        """The step predicted fastest when it costs c(B x width, B): of every width a request's rung has (at least
        the widest fixed config), the one of most expected tokens per ms, taken if it beats the narrowest by
        MARGIN (there every `auto` request runs what fits for free: greedy when all are `auto`)."""
        rows = len(states)
        floor = max((s.config.step_tokens for s in states if not s.auto), default=1)
        widths = {floor} | {t for choices in options for t, _, _ in choices if t > floor}
        curve = self.cost.curve(rows, rows * max(widths))

        def price(configs: list[LookaheadConfig]) -> float:
            return float(curve[priced_tokens([c.step_tokens for c in configs], pads_rows=True)])

        expected, chosen = self._at_width(options, floor)
        base = best = expected / price(chosen)
        for width in sorted(widths - {floor}):
            e, configs = self._at_width(options, width)
            speed = e / price(configs)
            if speed > best and speed >= (1 + MARGIN) * base:
                best, chosen = speed, configs
        return chosen

    def _probe_padded(self, states: Sequence[RequestState], supplies: Sequence[int],
                      options: Sequence[Sequence[tuple[int, float, LookaheadConfig]]],
                      chosen: list[LookaheadConfig]) -> list[LookaheadConfig]:
        """Probes in a padded step: when a request is due, the step widens to its cheapest rung with drafts and every
        `auto` request rides in it (their probes then fall due together). A request is due after `probe_every`
        steps without drafts times what widening B rows costs over what its probe alone would cost, so the share
        of time spent probing does not grow with B; once the probe's step shape is timed at B rows, it runs only
        if it could pay (the module docstring)."""
        rows = len(states)
        width = max(c.step_tokens for c in chosen)
        due = []
        for state, supply in zip(states, supplies, strict=True):
            if state.auto and state.draftless_run >= state.probe_every:
                probe = self._probe_rung(state, supply)
                if probe is not None and probe.step_tokens > width and (
                        state.draftless_run >= state.probe_every * self._shared_probe(rows, width, probe.step_tokens)):
                    due.append(probe.step_tokens)
        if not due:
            return chosen
        if self.cost.observed(priced_tokens([min(due)] * rows, pads_rows=True), rows):  # could it pay?
            hopeful = [replace(s, ratio=MAX_RATIO) if s.auto else s for s in states]  # every row rides in it
            if max(c.step_tokens for c in self._fastest_padded(hopeful, self._options(hopeful, supplies))) <= width:
                return chosen
        return self._at_width(options, min(due))[1]

    def _shared_probe(self, rows: int, width: int, probe: int) -> float:
        """How many times a lone request's probe cost widening a padded step of `rows` rows from `width` to `probe`
        tokens costs (at least 1), each measured against the step it widens."""
        alone = self.cost(probe, 1) / self.cost(1, 1) - 1.0
        padded = [priced_tokens([w] * rows, pads_rows=True) for w in (probe, width)]
        shared = self.cost(padded[0], rows) / self.cost(padded[1], rows) - 1.0
        return max(1.0, shared / alone) if alone > 0.0 else 1.0

    def _fastest(self, states: Sequence[RequestState], supplies: Sequence[int]) -> list[LookaheadConfig]:
        """Each request's config in the step predicted fastest (all-greedy unless a step beats it by MARGIN)."""
        chosen = [GREEDY_STEP if s.auto else s.config for s in states]
        tokens = sum(c.step_tokens for c in chosen)
        expected = sum(self.expected(s, c) for s, c in zip(states, chosen, strict=True))
        upgrades: list[Upgrade] = []
        for owner, (state, supply) in enumerate(zip(states, supplies, strict=True)):
            if state.auto:
                upgrades.extend(self._upgrades(owner, state, supply))
        if not upgrades:
            return chosen
        upgrades.sort(key=lambda u: -u[0])  # stable: a request's hull steps keep their order
        M = tokens + np.concatenate(([0], np.cumsum([u[2] for u in upgrades])))
        E = expected + np.concatenate(([0.0], np.cumsum([u[3] for u in upgrades])))
        speed = E / self.cost.curve(len(states), int(M[-1]))[M]
        best = int(np.argmax(speed))
        if speed[best] < (1 + MARGIN) * speed[0]:
            return chosen
        for _, owner, _, _, rung in upgrades[:best]:
            chosen[owner] = rung  # a request's steps come in order: the last one taken is its rung
        return chosen

    def _rungs(self, ladder: tuple[LookaheadConfig, ...], supply: int) -> tuple[Rung, ...]:
        """(step tokens, prior extra tokens, rung) of a ladder with candidate rows capped at `supply`, by step
        tokens, keeping the rung with the most extra tokens per step size (cached: `choose` runs every step)."""
        points: dict[int, tuple[float, LookaheadConfig]] = {}
        for rung in ladder:
            capped = rung if supply >= rung.G else LookaheadConfig(rung.W, rung.N, supply)
            t, extra = capped.step_tokens, self.priors.extra(capped)
            if t not in points or extra > points[t][0]:
                points[t] = (extra, capped)
        return tuple((t, *points[t]) for t in sorted(points))

    def _upgrades(self, owner: int, state: RequestState, supply: int) -> list[Upgrade]:
        """The upper concave hull of the request's (step tokens, expected tokens) ladder, as steps from greedy."""
        hull: list[Rung] = []  # (step tokens, expected tokens, config)
        for t, extra, cfg in self.rungs(state.ladder, min(supply, state.config.G)):
            e = _expected(_ratio(state, cfg), extra, cfg.N)
            while len(hull) >= 2 and _below(hull[-2], hull[-1], (t, e)):
                hull.pop()
            hull.append((t, e, cfg))
        steps: list[Upgrade] = []
        for (t0, e0, _), (t1, e1, cfg) in itertools.pairwise(hull):
            if e1 <= e0:
                break
            steps.append(((e1 - e0) / (t1 - t0), owner, t1 - t0, e1 - e0, cfg))
        return steps

    def observe_step(self, tokens: int, rows: int, seconds: float) -> None:
        """Learn the step cost from one decode step of `rows` rows and `tokens` real tokens that took `seconds`."""
        if self.learn:
            self.cost.observe(tokens, rows, 1000.0 * seconds)

    def observe(self, state: RequestState, config: LookaheadConfig, emitted: int) -> None:
        """Update the request's ratios after a step of `config` that emitted `emitted` tokens: the one the step
        observed learns (none for greedy, whose prior is 0), the other drifts back towards 1."""
        prior = self.priors.extra(config)
        observed = (emitted - 1) / prior if prior > 0.0 else None
        if config.G:
            state.draftless_run = 0
            state.probe_every = PROBE_EVERY if emitted > 1 else min(2 * state.probe_every, MAX_PROBE_EVERY)
            state.ratio, state.window_ratio = _learn(state.ratio, observed), _learn(state.window_ratio, None)
        else:  # greedy or window-only: no drafts verified, so nothing learnt of them
            state.draftless_run += 1
            state.ratio, state.window_ratio = _learn(state.ratio, None), _learn(state.window_ratio, observed)


def _ratio(state: RequestState, config: LookaheadConfig) -> float:
    """The request's ratio that scales `config`'s prior: its drafts' or, for a window-only config, its window's."""
    return state.ratio if config.G else state.window_ratio


def _learn(ratio: float, observed: float | None) -> float:
    """A ratio after one step: the EMA with its observation, else (nothing observed) drifted back towards 1."""
    if observed is None:
        return ratio + RECOVERY * (1.0 - ratio) if ratio < 1.0 else ratio
    return min((1 - EMA) * ratio + EMA * observed, MAX_RATIO)


def _expected(ratio: float, extra: float, ngram: int) -> float:
    """Expected tokens of a step: 1 + the request's ratio x the config's prior extra tokens, at most N."""
    return min(1.0 + ratio * extra, float(ngram))


def _below(a: tuple, b: tuple, c: tuple) -> bool:
    """Whether b lies on or below the segment from a to c (so b is not on the upper hull)."""
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0]) >= 0


def single_request_speed(policy: LookaheadPolicy, config: LookaheadConfig) -> float:
    """Predicted tokens per second of one request alone with `config` as its largest (its best rung)."""
    state = policy.start(Lookahead(config, auto=True))
    return max(1000.0 * policy.expected(state, c) / policy.cost(c.step_tokens, 1) for c in state.ladder)


def choose_ceiling(policy: LookaheadPolicy, step_tokens: int, engine: LookaheadConfig | None = None
                   ) -> tuple[LookaheadConfig, dict[str, float]]:
    """The largest config `auto` may use: `widest` within `step_tokens` (and an engine's W, N, G), for the N
    predicted fastest; and each N's predicted tokens per second."""
    predicted = {}
    best = LookaheadConfig.greedy()
    for n in (n for n in NGRAMS if engine is None or n <= engine.N):
        top = widest(n, step_tokens, engine)
        predicted[str(n)] = round(single_request_speed(policy, top), 4)
        if best.is_greedy or predicted[str(n)] > predicted[str(best.N)]:
            best = top
    return best, predicted


def prior_policy() -> LookaheadPolicy:
    """The policy of the built-in priors (PRIOR_STEP_COST, PRIOR_COMPRESSION)."""
    return LookaheadPolicy(StepCost({1: PRIOR_STEP_COST}), Priors(PRIOR_COMPRESSION))


@dataclass(frozen=True)
class AutoPolicy:
    """What `auto` requests run on: the largest config they may use, the policy that chooses up to it, and where
    both came from (TUNED: a tuning entry; PRIORS: the built-in priors), for the start-up line and /v1/models."""

    ceiling: LookaheadConfig
    policy: LookaheadPolicy
    source: str
    _untold: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    @classmethod
    def from_entry(cls, entry: Mapping, learn: bool = True) -> AutoPolicy:
        """A tuning entry's (runtime/tuning_file.py): its largest config (greedy where `auto` is greedy) and policy
        (`learn`: see LookaheadPolicy)."""
        policy = LookaheadPolicy(StepCost.from_dict(entry["step_cost"]), Priors(entry["priors"]), learn)
        return cls(LookaheadConfig.from_label(entry["config"]), policy, TUNED)

    @classmethod
    def untuned(cls, step_tokens: int, engine: LookaheadConfig | None = None) -> AutoPolicy:
        """The built-in priors, up to the ladder's widest config that fits an executor of `step_tokens` (and an
        engine's W, N, G) at the N they predict fastest; greedy if none fits or it is not predicted faster than
        greedy."""
        policy = prior_policy()
        ceiling, predicted = choose_ceiling(policy, step_tokens, engine)
        if (ceiling.is_greedy or ceiling.step_tokens > step_tokens
                or predicted[str(ceiling.N)] <= (1 + MARGIN) * 1000.0 / policy.cost(1, 1)):
            ceiling = LookaheadConfig.greedy()
        return cls(ceiling, policy, PRIORS)

    def announce(self) -> None:
        """Say on stderr that `auto` runs on the built-in priors: once per AutoPolicy (a runtime holds one), from
        any thread; nothing for a tuned one."""
        if self.source == PRIORS and self._untold.acquire(blocking=False):  # never released: said once
            print(f"trt-lookahead: `auto` runs on built-in priors (up to {self.ceiling.label}): no tuning entry for "
                  "this model, dtype, backend and machine; `trt-lookahead tune` (or `trt-lookahead serve --tune`) "
                  "measures them", file=sys.stderr, flush=True)
