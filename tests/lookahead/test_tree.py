"""The draft tree: templates, the tree layout's mask (three derivations), the sources, pure verification, and
exactness with oracle executors over random templates, sources and sampling."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.ablation import AblatedDecoder, Switches, request_decoder
from support.oracles import (
    ORACLES,
    OracleExecutor,
    decode_together,
    induction_logits,
    reference_generate,
    warmed_shared_pool,
)

from trt_lookahead.kernels.mask import step_mask
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.decoder import match_drafts, step_tables
from trt_lookahead.lookahead.drafts import SUFFIX, SuffixIndex, lay_tree
from trt_lookahead.lookahead.layout import StepLayout, mask_from_positions
from trt_lookahead.lookahead.recycle import SuccessorMap
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.lookahead.stepper import BatchStepper, Row
from trt_lookahead.lookahead.tree import Acceptance, TreeTemplate, chain_template, covers, tree_template


@st.composite
def templates(draw, min_nodes=0, max_nodes=24):
    """A random tree, each node's parent x_t or any earlier node (preorder or not)."""
    nodes = draw(st.integers(min_nodes, max_nodes))
    return TreeTemplate(tuple(draw(st.integers(-1, i - 1)) for i in range(nodes)))


def walked_ancestors(parents) -> np.ndarray:
    """[V, V] by walking parent links (independent of the template's `ends`)."""
    V = len(parents)
    anc = np.zeros((V, V), bool)
    for v in range(V):
        u = v
        while u != -1:
            anc[v, u] = True
            u = parents[u]
    return anc


def test_template_tables_by_hand():
    #        x_t
    #       /    \
    #      0      3
    #     / \
    #    1   2
    t = TreeTemplate((-1, 0, 0, -1))
    assert t.depth.tolist() == [1, 2, 2, 1]
    assert t.pre.tolist() == [0, 1, 2, 3]  # listed in preorder
    assert t.ends.tolist() == [3, 2, 3, 4]
    assert t.rank.tolist() == [0, 0, 1, 1]
    assert t.table.tolist() == [0, 3, 1, 2, 2, 3, 3, 4]
    assert TreeTemplate.parse(str(t)) == t
    assert t.prefix(2).parents == (-1, 0)
    # the same shape as x_t -> 0 -> 1 -> 3, x_t -> 2, listed best-first (not in preorder): preorder 0, 1, 3, 2
    u = TreeTemplate((-1, 0, -1, 1))
    assert u.depth.tolist() == [1, 2, 1, 3] and u.rank.tolist() == [0, 0, 1, 0]
    assert u.pre.tolist() == [0, 1, 3, 2] and u.ends.tolist() == [3, 3, 4, 3]
    assert u.ancestors().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [1, 1, 0, 1]]
    assert u.prefix(3).parents == (-1, 0, -1) and u.prefix(3).ends.tolist() == [2, 2, 3]


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-1, 0, 3), (-2,), (-1, True)])
def test_templates_whose_parents_are_not_earlier_nodes_are_refused(parents):
    with pytest.raises(ValueError, match="tree node"):
        TreeTemplate(parents)


def test_tree_template_best_first_by_hand():
    # prior: rank-0 child 0.6 x parent, rank r sibling 0.45^r of rank 0: 0.6 (A), 0.36 (A's child), 0.27 (B) ...
    assert tree_template(3, 2).parents == (-1, 0, -1)
    assert tree_template(3, 1).parents == (-1, -1, -1)
    # 0.6 (A), 0.36 (A's child), 0.27 (B), then 0.216 (A's grandchild) beats 0.162 (B's child, A's 2nd child);
    # listed best-first, so the grandchild comes after B
    assert tree_template(4, 4).parents == (-1, 0, -1, 1)


@given(st.integers(0, 60), st.integers(1, 8))
def test_every_prefix_of_a_template_is_the_best_tree_of_its_size(nodes, depth):
    """A step with fewer slots lays the first nodes: the tree tree_template would build for that size."""
    t = tree_template(60, depth)
    assert t.prefix(min(nodes, t.nodes)) == tree_template(nodes, depth)


def test_a_fitted_acceptance_shapes_the_tree_by_hand():
    # a thin cell stays near its guess: (1 accepted of 1 + 8 x 0.6) / (1 + 8)
    assert Acceptance.fit({(1, 0): (1, 1)}).first.tolist() == pytest.approx([5.8 / 9])
    # rank 0 accepted 90%, every other rank almost never: the tree is one deep chain (the prior's is bushy)
    chain = {(d, r): (90 if r == 0 else 0, 100) for d in range(1, 7) for r in range(3)}
    assert tree_template(6, 6, Acceptance.fit(chain)).parents == (-1, 0, 1, 2, 3, 4)
    assert tree_template(6, 6).parents != (-1, 0, 1, 2, 3, 4)
    # depth 1 flat over 4 ranks, depth 2 never accepted: 4 siblings under x_t first, then the deeper nodes
    flat = {(1, r): (2000, 10000) for r in range(4)} | {(2, r): (0, 50000) for r in range(4)}
    fitted = Acceptance.fit(flat)  # so many offered that the guesses weigh nothing: rank r+1 as likely as rank r
    assert fitted.decay[0, :3].tolist() == pytest.approx([1.0, 1.0, 1.0], rel=1e-2)
    assert tree_template(5, 2, fitted).parents == (-1, -1, -1, -1, -1)
    # a rank measured above the one before it is capped by it: acceptance never grows with rank
    assert Acceptance.fit({(1, 0): (10, 100), (1, 1): (50, 100)}).decay[0, 0] == 1.0


def test_the_decoder_counts_acceptance_by_depth_and_rank_by_hand():
    # x_t -> n0 -> {n1, n2}; x_t -> n3 -> n4. The model confirms n0, then n0's rank-1 child n2
    tree = TreeTemplate((-1, 0, 0, -1, 3))
    cfg = LookaheadConfig(2, 2, 5)  # 5 verification slots, no column-0 chain (N = 2)
    d = AblatedDecoder(cfg, [1, 2, 3], 8, (), 0, Switches(pool=False, suffix=False, recycle=False), tree)
    d.setup(7)
    tab = step_tables(cfg, tree)
    T = len(tab.rel_positions)
    d.prepare(cfg, np.zeros(T, np.int64), np.zeros(T, np.int64), tab.step_config.copy(), tab.output_slots.copy())
    d._drafts[:] = [10, 11, 12, 13, 14]
    out = np.full(T, 99, np.int64)
    out[0], out[tab.node_slots[0]] = 10, 12  # after x_t the model says n0's token, after n0 n2's
    assert d.verify(out)[:2] == [10, 12]
    assert d.stats.tree_accepted == {(1, 0): 1, (2, 1): 1}
    # offered: x_t's children (n0, n3) and n0's (n1, n2); n3 was refused, so n4 was not offered
    assert d.stats.tree_offered == {(1, 0): 1, (1, 1): 1, (2, 0): 1, (2, 1): 1}


@given(st.integers(0, 80), st.integers(1, 9))
def test_tree_templates_of_every_size(nodes, depth):
    t = tree_template(nodes, depth)
    assert t.nodes == nodes and t.max_depth <= depth
    assert (t.rank[t.depth == 1] == np.arange((t.depth == 1).sum())).all()  # root's children ranked 0, 1, ...


@settings(max_examples=60, deadline=None)
@given(templates(), st.integers(1, 4), st.integers(2, 5), st.integers(0, 4))
def test_tree_layout_mask_three_ways(tree, W, N, pad):
    G = tree.nodes // (N - 1)
    tree = tree.prefix(G * (N - 1))
    cfg = LookaheadConfig(W, N, G)
    T = cfg.step_tokens + pad
    lay = StepLayout(cfg, padded_tokens=T, tree=tree)
    nwin = cfg.levels * W
    anc = walked_ancestors(tree.parents)
    expected = StepLayout(LookaheadConfig(W, N, 0), padded_tokens=T).mask.copy()  # the window, pads by themselves
    for v in range(tree.nodes):
        expected[nwin + v] = False
        expected[nwin + v, 0] = True
        expected[nwin + v, nwin + np.flatnonzero(anc[v])] = True
    assert (lay.mask == expected).all()
    assert (step_mask(T, (W, N, G), tree.table) == expected).all()  # the closed form with one table
    order = lay.dfs_order()
    assert (mask_from_positions(lay.rel_positions[order]) == expected[np.ix_(order, order)]).all()
    assert lay.rel_positions[nwin : nwin + tree.nodes].tolist() == anc.sum(axis=1).tolist()


def test_linear_layout_is_the_chain_template():
    cfg = LookaheadConfig(3, 4, 2)
    assert (StepLayout(cfg).mask == StepLayout(cfg, tree=chain_template(2, 3)).mask).all()
    # a tree with fewer nodes than the config's G(N-1) slots leaves it linear (a runtime's tree never caps a request)
    assert covers(tree_template(5, 3), cfg) is None and covers(tree_template(6, 3), cfg) == tree_template(6, 3)
    assert (StepLayout(cfg, tree=tree_template(5, 3)).mask == StepLayout(cfg).mask).all()
    assert not (StepLayout(cfg, tree=tree_template(7, 3)).mask == StepLayout(cfg).mask).all()


def test_verify_a_tree_by_hand():
    # W=1 N=3 G=2: window slots 0 (x_t), 1 (B1[0]); tree nodes at slots 2..5 with parents (-1, 0, 0, -1)
    tab = step_tables(LookaheadConfig(1, 3, 2), TreeTemplate((-1, 0, 0, -1)))
    assert list(tab.node_slots) == [2, 3, 4, 5, 1]  # the tree's nodes, then the chain's B1[0]
    assert list(tab.expect_slots) == [0, 2, 2, 0, 0]
    a, b, c, d, e = 10, 11, 12, 13, 14
    drafts = np.array([a, b, c, d, a])
    # model: after x_t -> a, after node 0 (a) -> c, after node 2 (a c) -> e
    out = np.array([a, -1, c, 99, e, 99])
    assert match_drafts(drafts, out, tab) == (2, 2)  # path x_t -> a -> c, then the bonus out[4] = e
    assert match_drafts(drafts, np.array([d, -1, c, 99, e, 99]), tab) == (3, 1)  # only node 3 (d) matches
    assert match_drafts(drafts, np.array([b, -1, c, 99, e, 99]), tab)[1] == 0


def test_suffix_index_longest_match_newest_first():
    idx = SuffixIndex(max_match=3)
    idx.extend([5, 1, 2, 3, 9, 1, 2, 4, 7, 2, 1, 2])
    # suffix (2, 1, 2) never occurred before; (1, 2) ends at 2 and 6: newest first -> (4, 7, 2), then (3, 9, 1)
    assert idx.continuations(3, 2) == [((4, 7, 2), 2), ((3, 9, 1), 2)]
    # then the 1-token suffix (2) at 9 -> (1, 2); the text's own end never matches itself
    assert idx.continuations(2, 5) == [((4, 7), 2), ((3, 9), 2), ((1, 2), 1)]


def test_lay_tree_merges_shared_prefixes_best_scored_first():
    t = TreeTemplate((-1, 0, 0, -1, 3))  # two root branches, the first with two children
    drafts, origins = np.full(5, -1), [""] * 5
    branches = [((7, 8), "window", 1.0), ((5, 6), SUFFIX, 3.0), ((7, 9), "prompt", 0.5), ((7, 8, 1), "output", 1.0)]
    lay_tree(t, t.rank.tolist(), branches, drafts, origins)
    # trie: 7 (score 2.5) -> 8 (2.0), 9 (0.5); 5 (3.0) -> 6 (3.0). Rank 0 at the root is 5.
    assert drafts.tolist() == [5, 6, -1, 7, 8]
    assert origins == [SUFFIX, SUFFIX, "", "window", "window"]


@st.composite
def tree_requests(draw, vocab):
    N = draw(st.integers(2, 5))
    config = LookaheadConfig(draw(st.integers(1, 4)), N, draw(st.integers(0, 5)))
    sampled = draw(st.booleans())
    return dict(
        config=config,
        prompt=draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20)),
        max_new=draw(st.integers(1, 30)),
        stop=draw(st.sets(st.integers(0, vocab - 1), max_size=1)),
        seed=draw(st.integers(0, 2**31)),
        switches=Switches(pool=draw(st.booleans()), suffix=draw(st.booleans()), chain=draw(st.booleans()),
                          bonus=draw(st.booleans()), recycle=draw(st.booleans())),
        sampling=SamplingParams(
            draw(st.floats(0.3, 1.5)), draw(st.sampled_from([0, 3])), draw(st.sampled_from([1.0, 0.8])),
            draw(st.integers(0, 2**31)),
        ) if sampled else SamplingParams(),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_tree_requests_emit_their_plain_decoding(data):
    vocab = data.draw(st.integers(6, 24))
    logits = ORACLES[data.draw(st.sampled_from(sorted(ORACLES)))](vocab, data.draw(st.integers(0, 1000)))
    specs = data.draw(st.lists(tree_requests(vocab), min_size=1, max_size=3))
    most = max(s["config"].G * s["config"].levels for s in specs)
    tree = data.draw(templates(min_nodes=most, max_nodes=most + 6))
    executor = OracleExecutor(logits, vocab, max_batch=len(specs), step_tokens=64, tree=tree)
    expect = [reference_generate(logits, s["prompt"], s["max_new"], s["sampling"], sorted(s["stop"])) for s in specs]
    shared = warmed_shared_pool(expect, vocab, data.draw(st.integers(0, 99))) if data.draw(st.booleans()) else None
    successors = None
    if data.draw(st.booleans()):  # one map for the batch, holding junk successors before the first step
        successors, rng = SuccessorMap(), np.random.default_rng(data.draw(st.integers(0, 99)))
        successors.record(rng.integers(0, vocab, 2 * vocab), rng.integers(0, vocab, (2 * vocab, 4)))
    # each step verifies a random prefix of the tree (fewer nodes)
    done = decode_together(executor, specs, lambda d: LookaheadConfig(
        d.config.W, d.config.N, data.draw(st.integers(0, d.config.G))), tree, shared, successors)
    for (d, got), expected in zip(done, expect, strict=True):
        assert got == d.tokens == expected


def test_suffix_drafts_are_accepted_deeper_than_n_on_repetitive_text():
    """An induction model copies the prompt: suffix drafts down a deep tree accept more than N tokens a step."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 2
    logits = induction_logits(12, 0)
    tree = tree_template(16, 8)
    cfg = LookaheadConfig(2, 3, 8)  # 16 verification slots, N = 3: linear candidates accept at most 2 drafts
    results = {}
    for name, t, switches in (("tree", tree, Switches(pool=False)), ("linear", None, Switches())):
        executor = OracleExecutor(logits, 12, max_batch=1, tree=t)
        d = request_decoder(cfg, prompt, 40, (), 0, switches, t)
        tokens = list(d.setup(executor.prefill(0, d.prompt, SamplingParams())))
        while not d.finished:
            BatchStepper(executor).run([Row(0, d, cfg)])
            tokens.extend(d.emitted)
        assert tokens == reference_generate(logits, prompt, 40)
        results[name] = d.stats
    assert max(results["tree"].depths) > cfg.levels
    assert results["tree"].sources[SUFFIX] > 0
    assert results["tree"].steps < results["linear"].steps


def test_a_draft_tree_supplies_every_row_where_recycled_successors_or_a_suffix_match_can_fill_it():
    """The policy feeds no more rows than draft_supply: with a tree, recycled successors and suffix matches fill
    rows the pool cannot (an empty pool for x_t must not turn the tree off)."""
    cfg, tree = LookaheadConfig(2, 3, 4), tree_template(8, 4)

    def supply(prompt, x, tree=tree, switches=None, successors=None):
        d = request_decoder(cfg, prompt, 8, (), 0, switches or Switches(), tree, successors=successors)
        d.setup(x)
        return d.draft_supply()

    known = SuccessorMap()
    known.record(np.array([9]), np.array([[4, 5]]))
    assert supply([1, 2, 3], 9) == 0  # x_t = 9: no pool candidate, no earlier 9, no successors recorded
    assert supply([1, 2, 3], 9, successors=known) == 4  # recycled successors of 9 fill the tree
    assert supply([1, 2, 3], 9, switches=Switches(recycle=False), successors=known) == 0
    assert supply([9, 4, 5, 1], 9, switches=Switches(recycle=False)) == 4  # the suffix 9 matched: 9 -> 4 5 1
    assert supply([9, 4, 5, 1], 9, tree=None) == 1  # linear candidates: the pool's one, (4, 5)
    assert supply([9, 4, 5, 1], 9, tree=tree_template(7, 4)) == 1  # a tree too small for 2/3/4 runs linear
