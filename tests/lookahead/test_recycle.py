"""Recycled top-k drafts: the successor map, the laying onto a template, the executor contract's top_ids, and
exactness and acceptance with oracle executors."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.decoder import (
    BatchStepper,
    LookaheadDecoder,
    RequestDecoder,
    Row,
    Switches,
    step_tables,
)
from trt_lookahead.lookahead.executor import StepBatch, check_batch
from trt_lookahead.lookahead.oracles import ORACLES, OracleExecutor, markov_logits, reference_generate
from trt_lookahead.lookahead.recycle import RECYCLE, SuccessorMap, fill_recycled
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.lookahead.tree import TreeTemplate, resolve_tree, tree_template

RECYCLE_ONLY = Switches(pool=False, suffix=False, chain=False)


def successors(table: dict[int, list[int]]) -> SuccessorMap:
    m = SuccessorMap()
    for token, nxt in table.items():
        m.record(np.array([token]), np.array([nxt]))
    return m


def test_the_docstring_example():
    drafts, origins = np.array([7, -1, -1, -1]), ["pool", "", "", ""]
    fill_recycled((-1, 0, 0, -1), drafts, origins, successors({5: [7, 9], 7: [3, 4], 9: [1, 2]}), x=5)
    assert drafts.tolist() == [7, 3, 4, 9]
    assert origins == ["pool", RECYCLE, RECYCLE, RECYCLE]


def test_chains_by_hand():
    m = successors({5: [7, 9], 7: [3, 4], 3: [5]})
    assert m.chains(5, 2, 4) == [(7, 3, 5, 7), (9,)]  # the docstring's example: 9 has no successors
    assert m.chains(5, 1, 2) == [(7, 3)] and m.chains(9, 2, 4) == []
    own = SuccessorMap(m)  # each token of a chain is looked up in the request's own map first
    own.record(np.array([3]), np.array([[8]]))
    assert own.chains(5, 1, 4) == [(7, 3, 8)]


def test_recycled_chains_compete_with_pool_candidates_in_the_trie():
    """x_t = 2 has pool candidates (4, 5) and (6, 7) (newest first) and recycled successors 8 (then 9) and 3: the
    rank-0 chain (8, 9) scores as the rank-0 candidate, above (6, 7), so it takes x_t's second child."""
    tree, cfg = TreeTemplate((-1, -1, 0, 1)), LookaheadConfig(1, 3, 2)
    d = RequestDecoder(cfg, [2, 6, 7, 2, 4, 5, 1], 8, (), 0, Switches(suffix=False, chain=False), tree,
                       successors=successors({2: [8, 3], 8: [9]}))
    d.setup(2)
    tab = step_tables(cfg, tree)
    T = len(tab.rel_positions)
    d.prepare(cfg, np.zeros(T, np.int64), np.zeros(T, np.int64), tab.step_config.copy(), tab.output_slots.copy())
    assert d._drafts[:4].tolist() == [4, 8, 5, 9]
    assert d._origins[:4] == ["prompt", RECYCLE, "prompt", RECYCLE]


def test_nodes_under_an_empty_parent_or_an_unknown_token_stay_empty():
    # x_t = 1 has one successor: the rank-1 child of x_t stays empty, and so does its own child
    drafts, origins = np.full(4, -1), [""] * 4
    fill_recycled((-1, 0, -1, 2), drafts, origins, successors({1: [2], 2: [8]}), x=1)
    assert drafts.tolist() == [2, 8, -1, -1]
    drafts = np.full(2, -1)
    fill_recycled((-1, 0), drafts, [""] * 2, SuccessorMap(), x=1)
    assert drafts.tolist() == [-1, -1]


def test_the_newest_record_of_a_token_wins_and_later_slots_in_one_record_too():
    m = SuccessorMap()
    m.record(np.array([4, 5]), np.array([[1, 2], [3, 4]]))
    m.record(np.array([4, 4]), np.array([[6, 7], [8, 9]]))
    assert m.get(4) == (8, 9) and m.get(5) == (3, 4) and m.get(6) == () and len(m) == 2


def test_a_request_reads_its_own_successors_before_those_other_requests_shared_since():
    """Requests batched together feed one shared map in turn: a token this request recorded keeps this request's
    successors (its own context), a token it never fed reads the shared map, and its records reach that map."""
    shared = SuccessorMap()
    mine, other = SuccessorMap(shared), SuccessorMap(shared)
    mine.record(np.array([4]), np.array([[1, 2]]))
    other.record(np.array([4, 6]), np.array([[8, 9], [5, 3]]))  # a later step of another request
    assert mine.get(4) == (1, 2) and other.get(4) == (8, 9)
    assert mine.get(6) == (5, 3) and mine.get(7) == () and len(mine) == 1
    assert shared.get(4) == (8, 9) and len(shared) == 2
    drafts = np.full(2, -1)
    fill_recycled((-1, 0), drafts, [""] * 2, mine, x=4)  # x_t's own successor 1, then 1's (none anywhere)
    assert drafts.tolist() == [1, -1]
    drafts = np.full(2, -1)
    fill_recycled((-1, 0), drafts, [""] * 2, mine, x=6)  # 6 only in the shared map: 5, then nothing under 5
    assert drafts.tolist() == [5, -1]


@given(st.integers(0, 2**31), st.integers(1, 30))
def test_siblings_never_repeat_a_token_and_every_node_continues_its_parent(seed, nodes):
    rng = np.random.default_rng(seed)
    template = tree_template(nodes, 4)
    m = SuccessorMap()
    m.record(rng.integers(0, 6, 20), rng.integers(0, 6, (20, 4)))
    drafts = np.where(rng.random(nodes) < 0.3, rng.integers(0, 6, nodes), -1)
    laid = drafts.copy()
    fill_recycled(template.parents, drafts, [""] * nodes, m, x=int(rng.integers(0, 6)))
    assert ((laid < 0) | (drafts == laid)).all()  # what the trie laid stays
    for p in {*template.parents}:
        kids = [int(drafts[v]) for v, q in enumerate(template.parents) if q == p and drafts[v] >= 0 and laid[v] < 0]
        assert len(kids) == len(set(kids))


def test_a_bad_top_ids_buffer_is_refused():
    batch = StepBatch(np.array([0]), np.zeros((1, 2), np.int64), np.array([[3, 4]]), np.array([[0, 0, 0]], np.int32),
                      np.array([[1]]), np.zeros((1, 3, 4), np.int64))
    with pytest.raises(ValueError, match=r"top_ids must have shape \(1, 2, k\)"):
        check_batch(batch, 1, 8, 16)


def test_recycled_successors_are_accepted_where_the_model_is_a_bigram():
    """Markov(1) logits depend on the last token only: the recycled successors are the model's own next tokens,
    so a recycle-only tree accepts deep paths; with recording broken it would stay near one token per step."""
    vocab, prompt = 40, [3, 1, 4, 1, 5, 9, 2, 6]
    logits = markov_logits(vocab, 1, seed=4)
    tree = tree_template(12, 6)
    ex = OracleExecutor(logits, vocab, max_batch=1, tree=tree)
    out = LookaheadDecoder(ex, LookaheadConfig(2, 2, 12), switches=RECYCLE_ONLY, tree=tree).generate(prompt, 80)
    assert out.token_ids == reference_generate(logits, prompt, 80)
    assert out.stats.sources[RECYCLE] > 0 and set(out.stats.sources) == {RECYCLE}
    assert out.stats.compression > 2.5


def test_a_shared_map_carries_successors_to_the_next_request():
    vocab, prompt = 40, [3, 1, 4, 1, 5]
    logits = markov_logits(vocab, 1, seed=7)
    tree = tree_template(8, 4)
    ex = OracleExecutor(logits, vocab, max_batch=1, tree=tree)
    shared = SuccessorMap()

    def run(m: SuccessorMap | None) -> RequestDecoder:
        d = RequestDecoder(LookaheadConfig(2, 2, 8), prompt, 30, switches=RECYCLE_ONLY, tree=tree, successors=m)
        d.setup(ex.prefill(0, d.prompt, SamplingParams()))
        stepper = BatchStepper(ex)
        while not d.finished:
            assert stepper.run([Row(0, d, d.config)]) == [None]
        ex.release(0)
        return d

    first = run(shared)
    assert len(shared) > 0
    again = run(shared)  # warm: the first request's successors are drafted from the first step on
    assert again.tokens == first.tokens == reference_generate(logits, prompt, 30)
    assert again.stats.steps < first.stats.steps


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(ORACLES)), st.integers(0, 2**31), st.integers(1, 20), st.integers(2, 5),
       st.booleans())
def test_any_oracle_with_recycling_emits_its_plain_decoding(oracle, seed, nodes, ngram, sampled):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(4, 30))
    logits = ORACLES[oracle](vocab, seed)
    levels = ngram - 1
    G = -(-nodes // levels)
    tree = tree_template(G * levels, int(rng.integers(1, 7)))
    sampling = SamplingParams(temperature=0.9, seed=seed) if sampled else SamplingParams()
    prompt = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
    ex = OracleExecutor(logits, vocab, max_batch=1, tree=tree)
    config = LookaheadConfig(int(rng.integers(1, 4)), ngram, G)
    out = LookaheadDecoder(ex, config, tree=tree).generate(prompt, 40, sampling)
    assert out.token_ids == reference_generate(logits, prompt, 40, sampling)


def test_a_template_of_the_wrong_size_for_a_tree_is_a_user_error(tmp_path):
    assert resolve_tree("off", LookaheadConfig(7, 5, 7)) is None
    assert resolve_tree("auto", LookaheadConfig(7, 5, 7)).nodes == 28
    assert resolve_tree(" -1,0,-1 ", LookaheadConfig(1, 2, 3)) == TreeTemplate((-1, 0, -1))
    (tmp_path / "tree.txt").write_text("-1,0,\n0,-1\n")
    assert resolve_tree(str(tmp_path / "tree.txt"), LookaheadConfig(1, 2, 4)) == TreeTemplate((-1, 0, 0, -1))
    with pytest.raises(UserError, match="cannot fill the 28 verification slots"):
        resolve_tree("-1,0", LookaheadConfig(7, 5, 7))
    with pytest.raises(UserError, match="G >= 1"):
        resolve_tree("auto", LookaheadConfig(4, 3, 0))
    with pytest.raises(UserError, match="parents must be -1"):
        resolve_tree("2,1", LookaheadConfig(1, 2, 1))
