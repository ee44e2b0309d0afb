"""Recycled top-k drafts: the successor map, the laying onto a template, the executor contract's top_ids, and
exactness and acceptance with oracle executors."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.ablation import AblatedDecoder, LookaheadDecoder, Switches
from support.oracles import ORACLES, OracleExecutor, markov_logits, reference_generate

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.decoder import RequestDecoder, step_tables
from trt_lookahead.lookahead.executor import StepBatch, check_batch
from trt_lookahead.lookahead.recycle import RECYCLE, SuccessorMap, fill_recycled
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.lookahead.stepper import BatchStepper, Row
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
    d = AblatedDecoder(cfg, [2, 6, 7, 2, 4, 5, 1], 8, (), 0, Switches(suffix=False, chain=False), tree,
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
        d = AblatedDecoder(LookaheadConfig(2, 2, 8), prompt, 30, switches=RECYCLE_ONLY, tree=tree, successors=m)
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
    (tmp_path / "tree.bin").write_bytes(b"-1,0,\xff\n")  # a binary file given by mistake
    with pytest.raises(UserError, match=r"tree file .*tree\.bin is not UTF-8 text \(invalid start byte at byte 5\)"):
        resolve_tree(str(tmp_path / "tree.bin"), LookaheadConfig(1, 2, 2))


def test_pairs_are_looked_up_before_tokens_own_map_before_shared():
    """Order: own pair, own token, shared pair, shared token. After 9, 5 the own pair gives 1; after 8, 5 the own
    entry for 5 (written with another context) still wins over another request's pair (8, 5) -> 6, which a map
    that never saw 5 reads."""
    shared = SuccessorMap()
    other, mine = SuccessorMap(shared), SuccessorMap(shared)
    other.record(np.array([5]), np.array([[6]]), np.array([8]))
    mine.record(np.array([5, 5]), np.array([[1], [2]]), np.array([9, 7]))  # token entry 5 -> 2 (the later slot)
    assert mine.get(5, 9) == (1,) and mine.get(5, 7) == (2,)
    assert mine.get(5, 8) == mine.get(5, 3) == mine.get(5) == (2,)  # no own pair: the own token entry
    fresh = SuccessorMap(shared)
    assert fresh.get(5, 8) == (6,)  # the shared pair
    assert fresh.get(5, 4) == fresh.get(5) == (2,)  # no pair anywhere: the shared token entry, written last
    mine.record(np.array([3]), np.array([[7]]), np.array([-1]))  # previous unknown: the token entry only
    assert mine.get(3, 5) == (7,) and len(mine.pairs) == 2


def test_chains_follow_pairs():
    """Tokens {5: [7, 9], 7: [3, 4], 3: [5]}; after the pair (5, 7) the model said 4, so the chain from 5 goes
    7 -> 4 (4 has no successors); without pairs it is the docstring's 7 -> 3 -> 5 -> 7."""
    m = SuccessorMap()
    m.record(np.array([7, 5, 7, 3]), np.array([[4, 3], [7, 9], [3, 4], [5, 5]]), np.array([5, -1, -1, -1]))
    assert m.chains(5, 2, 4) == [(7, 4), (9,)]
    assert m.chains(5, 2, 4, previous=9) == [(7, 4), (9,)]  # no pair (9, 5): 5's own successors
    assert successors({5: [7, 9], 7: [3, 4], 3: [5]}).chains(5, 2, 4) == [(7, 3, 5, 7), (9,)]


def test_past_its_capacity_the_pair_table_keeps_the_newest_half_by_first_write():
    m = SuccessorMap(pairs=4)
    for previous in (1, 2, 3, 4, 1, 6):  # (1, 5) rewritten keeps its first place; (6, 5) makes 5 > 4 pairs
        m.record(np.array([5]), np.array([[previous + 10]]), np.array([previous]))
    assert len(m.pairs) == 2
    assert (m.get(5, 4), m.get(5, 6)) == ((14,), (16,))
    assert m.get(5, 1) == m.get(5, 2) == (16,)  # dropped: the token entry, written last


def test_fill_recycled_looks_up_each_node_after_its_grandparent():
    """x_t = 5 after 9, template x_t -> a -> b: the pair (9, 5) gives a = 7, the pair (5, 7) gives b = 4; unknown
    context (previous -1) reads the tokens: 5 -> 1, and 1 has no successors."""
    m = SuccessorMap()
    m.record(np.array([5, 7, 5, 7]), np.array([[7], [4], [1], [3]]), np.array([9, 5, -1, -1]))
    drafts = np.full(2, -1)
    fill_recycled((-1, 0), drafts, [""] * 2, m, x=5, previous=9)
    assert drafts.tolist() == [7, 4]
    drafts = np.full(2, -1)
    fill_recycled((-1, 0), drafts, [""] * 2, m, x=5)
    assert drafts.tolist() == [1, -1]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pairs_draft_a_trigram_model_better_than_tokens_alone(seed):
    """Markov(2) logits depend on the last two tokens: a pair's recorded top-1 is the model's next token, a
    token's is one of several, so recycled drafts with pairs are accepted more; both are greedy's tokens."""
    vocab, prompt = 40, [3, 1, 4, 1, 5, 9, 2, 6]
    logits = markov_logits(vocab, 2, seed=seed)
    tree = tree_template(12, 6)
    runs = {}
    for pairs in (True, False):
        ex = OracleExecutor(logits, vocab, max_batch=1, tree=tree)
        switches = Switches(pool=False, suffix=False, chain=False, pairs=pairs)
        runs[pairs] = LookaheadDecoder(ex, LookaheadConfig(2, 2, 12), switches=switches, tree=tree).generate(prompt, 80)
        assert runs[pairs].token_ids == reference_generate(logits, prompt, 80)
    assert runs[True].stats.steps < runs[False].stats.steps


@given(st.integers(0, 2**31), st.integers(1, 8), st.integers(-1, 5))
def test_fill_recycled_on_a_chain_template_lays_the_rank_0_chain(seed, nodes, previous):
    """fill_recycled inlines `get`'s lookup order; on a one-path template it must lay what `chains` gives."""
    rng = np.random.default_rng(seed)
    shared = SuccessorMap()
    other, mine = SuccessorMap(shared), SuccessorMap(shared)
    for m in (other, mine):
        m.record(rng.integers(0, 6, 12), rng.integers(0, 6, (12, 3)), rng.integers(-1, 6, 12))
    x = int(rng.integers(0, 6))
    drafts = np.full(nodes, -1)
    fill_recycled(tuple(range(-1, nodes - 1)), drafts, [""] * nodes, mine, x, previous)
    chain = (mine.chains(x, 1, nodes, previous) or [()])[0]
    assert drafts.tolist() == [*chain, *[-1] * (nodes - len(chain))]


def test_every_recorded_pair_holds_the_models_top_ids_after_that_pair():
    """Under Markov(2) logits a slot's output depends on its token and the one before it in what it sees, so each
    recorded pair must hold the top ids of exactly that pair: a wrong previous token (window, tree or path slot)
    records another pair's ids."""
    vocab, prompt = 30, [3, 1, 4, 1, 5, 9, 2, 6]
    logits = markov_logits(vocab, 2, seed=11)
    tree = tree_template(12, 4)
    ex = OracleExecutor(logits, vocab, max_batch=1, tree=tree)
    d = RequestDecoder(LookaheadConfig(3, 4, 4), prompt, 60, tree=tree)
    d.setup(ex.prefill(0, d.prompt, SamplingParams()))
    stepper = BatchStepper(ex)
    while not d.finished:
        assert stepper.run([Row(0, d, d.config)]) == [None]
    assert d.tokens == reference_generate(logits, prompt, 60)
    assert len(d.successors.pairs) > 50
    for key, top in d.successors.pairs.items():
        previous, token = key >> 32, key & 0xFFFFFFFF
        assert top[0] == int(np.argmax(logits((previous, token)))), (previous, token)
