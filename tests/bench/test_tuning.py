"""Tuning: the tuning file, the policy an entry gives `auto`, the measurements on stories260K, `tune`.

Every test reads and writes a tuning file of its own (tmp_path), given to the runtime or the CLI."""

import json
from collections import Counter
from pathlib import Path

import pytest

from trt_lookahead.cli import main
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import AUTO, LookaheadConfig
from trt_lookahead.lookahead.policy import LookaheadPolicy, Priors, StepCost
from trt_lookahead.lookahead.tree import TREE_DEPTH, TreeTemplate, tree_template
from trt_lookahead.runtime import LookaheadRuntime, checkpoint_tuning_key
from trt_lookahead.tuning import file as tuning_file
from trt_lookahead.tuning import tune

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
PRIORS = {"1/3/1": 1.4, "2/3/2": 1.7, "4/3/4": 2.0, "1/4/1": 1.5, "2/4/2": 1.9, "4/4/4": 2.3, "8/4/8": 2.5}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the tuning key names the thread count


@pytest.fixture
def tuning(tmp_path):
    return tmp_path / "tuning.json"


def entry(config="8/4/8", cost=None, priors=None):
    cost = cost or StepCost({1: [(1, 10.0), (32, 11.0), (256, 60.0)], 8: [(8, 12.0), (256, 70.0)]})
    return {"config": config, "step_cost": cost.to_dict(), "priors": priors or PRIORS}


def test_tuning_file_round_trip(tuning):
    key = tuning_file.tuning_key(str(STORIES), "float32", "torch")
    assert str(STORIES.resolve()) in key and "dtype=float32" in key and "machine=" in key
    assert tuning_file.lookup_tuning(str(STORIES), "float32", "torch", path=tuning) is None
    assert tuning_file.write_tuning_entry(key, entry(), tuning) == tuning
    tuning_file.write_tuning_entry(tuning_file.tuning_key(str(STORIES), "bfloat16", "torch"), entry("greedy"), tuning)
    assert tuning_file.lookup_tuning(str(STORIES), "float32", "torch", path=tuning) == entry()
    # a draft tree accepts differently at every rung: its runtime has an entry of its own
    tree = str(tree_template(8, TREE_DEPTH))
    assert tuning_file.tuning_key(str(STORIES), "float32", "torch", tree=tree) != key
    assert tuning_file.lookup_tuning(str(STORIES), "float32", "torch", path=tuning, tree=tree) is None
    tuning_file.write_tuning_entry(tuning_file.tuning_key(str(STORIES), "float32", "torch", tree=tree), entry("1/3/1"),
                                   tuning)
    assert tuning_file.lookup_tuning(str(STORIES), "float32", "torch", path=tuning, tree=tree) == entry("1/3/1")
    assert tuning_file.lookup_tuning(str(STORIES), "float32", "torch", path=tuning) == entry()
    assert len(json.loads(tuning.read_text())["entries"]) == 3
    assert tuning_file.tuning_path().name == "tuning.json"  # the default: in the cache dir, beside the models


def test_unreadable_or_older_tuning_files_are_ignored(tuning, capsys):
    tuning.write_text("{not json")
    assert tuning_file.lookup_tuning(str(STORIES), "float32", "torch", path=tuning) is None
    assert "ignoring unreadable tuning file" in capsys.readouterr().err
    tuning.write_text(json.dumps({"version": 1, "entries": {"k": {"config": "4/3/4"}}}))  # before the policy
    assert tuning_file.read_tuning_file(tuning)["entries"] == {}
    assert "another format version" in capsys.readouterr().err


def test_an_entry_gives_auto_its_largest_config_and_policy():
    config, policy = tune.policy_from_entry(entry())
    assert config == LookaheadConfig(8, 4, 8)
    assert policy.priors.extra(LookaheadConfig(2, 4, 2)) == pytest.approx(0.9)
    assert policy.cost(32, 1) == pytest.approx(11.0)
    assert tune.policy_from_entry(entry("greedy"))[0].is_greedy


def test_auto_runs_the_tuned_policy_and_keeps_greedy_tokens(tuning):
    key = checkpoint_tuning_key(STORIES, "float32")  # the default: a cached engine, with a draft tree
    tuning_file.write_tuning_entry(key, entry("4/3/4"), tuning)
    with LookaheadRuntime.from_pretrained(STORIES, lookahead=AUTO, max_seq_len=256, tuning_file=tuning) as rt:
        assert tune.runtime_tuning_key(rt) == key and rt.backend == "onnxruntime" and rt.tree is not None
        assert rt.request_config(None) == (LookaheadConfig(4, 3, 4), False)
        out = rt.generate("Once upon a time", max_new_tokens=60)
        assert out.token_ids == rt.generate("Once upon a time", max_new_tokens=60, lookahead="greedy").token_ids
        assert out.config == AUTO
        for label in out.stats.configs:  # greedy, or at most 4/3/4 (candidates capped by the pool's supply)
            c = LookaheadConfig.greedy() if label == "greedy" else LookaheadConfig.parse(label)
            assert c.is_greedy or (c.N == 3 and c.W <= 4 and c.G <= 4), label
        assert out.stats.configs.get("greedy", 0) < out.steps - 1  # a cheap step: it used lookahead
        assert isinstance(rt.scheduler.policy, LookaheadPolicy)


def test_the_ceiling_is_the_n_predicted_fastest_for_one_request():
    cheap = LookaheadPolicy(StepCost.linear(10.0, 0.01), Priors(PRIORS))
    config, predicted = tune.choose_ceiling(cheap, step_tokens=128)
    assert config == LookaheadConfig(5, 4, 11) and predicted["4"] > predicted["3"]  # 16 columns: 1.2 x 4 window
    narrow = tune.choose_ceiling(cheap, step_tokens=16)[0]
    # 16 tokens are 8 columns at N = 3 (1.2 sqrt(8) = 3.4 of them window), 5 at N = 4 and 4 at N = 5
    assert narrow in (LookaheadConfig(3, 3, 5), LookaheadConfig(3, 4, 2), LookaheadConfig(2, 5, 2))
    # an engine dir built for 8/3/8 runs no N = 4 or 5 (tune once asked it for 1/4/1 and failed)
    assert tune.choose_ceiling(cheap, step_tokens=32, engine=LookaheadConfig(8, 3, 8))[0] == LookaheadConfig(8, 3, 8)
    assert tune.choose_ceiling(cheap, step_tokens=48, engine=LookaheadConfig(2, 5, 4))[0].W == 2


@pytest.fixture(scope="module")
def stories():
    with LookaheadRuntime.from_pretrained(STORIES, lookahead=None, max_batch=4, max_seq_len=256) as rt:
        yield rt


def test_step_cost_is_measured_for_every_row_count_and_config(stories):
    ids = stories.encode("Once upon a time there was a little girl")
    cost = tune.measure_step_cost(stories, ids, rounds=1)
    assert sorted(cost.points) == [1, 2, 4]
    assert [m for m, _ in cost.points[2]] == [2 * c.step_tokens for c in tune.COST_LADDER]
    assert all(ms > 0 for pts in cost.points.values() for _, ms in pts)
    assert stories.scheduler.free_slots == 4


def test_one_row_points_get_their_own_rounds(stories):
    ids = stories.encode("Once upon a time there was a little girl")

    def steps_by_rows(one_row_rounds: int) -> Counter[int]:
        before = stories.scheduler.stats.steps
        tune.measure_step_cost(stories, ids, rows=[1, 2], rounds=1, one_row_rounds=one_row_rounds)
        fresh = list(stories.scheduler.steps)[-(stories.scheduler.stats.steps - before):]
        return Counter(s.rows for s in fresh if not s.prefill_rows)

    # the same prompt and configs decode the same steps every round: 3 rounds of one row, 1 of two rows
    once, thrice = steps_by_rows(1), steps_by_rows(3)
    assert once[1] > 0 and once[2] > 0
    assert thrice[1] == 3 * once[1] and thrice[2] == once[2]


def test_priors_are_measured_compression(stories):
    named = [("a", stories.encode("Once upon a time")), ("b", stories.encode("The cat sat on the mat. The cat"))]
    configs = [LookaheadConfig(1, 3, 1), LookaheadConfig(4, 3, 4)]
    compression, per_set, acceptance = tune.measure_priors(stories, named, configs, 40)
    assert set(compression) == {"1/3/1", "4/3/4"} and all(1.0 <= v <= 3.0 for v in compression.values())
    # the runtime's tree, best-first under the prior: A 0.6, A's child 0.36, B 0.27, A's grandchild 0.216, A's
    # 2nd child and B's child 0.162 (A's first on the tie), A's great-grandchild 0.13, C 0.12. Its 2-node prefix
    # (1/3/1) has one node under x_t, its 8-node one (4/3/4) three: A and B have a rank-0 child there, C none
    cells = tune.acceptance_cells(acceptance)
    assert str(stories.tree).startswith("-1,0,-1,1,0,2,3,-1,") and all(0 <= a <= n for a, n in cells.values())
    assert cells[1, 0][1] > cells[1, 1][1] == cells[1, 2][1] > 0 and (1, 3) not in cells
    assert cells[2, 0][1] == cells[1, 0][0] + cells[1, 1][0] > 0  # offered: the rank-0 child of an accepted A or B
    assert set(per_set["4/3/4"]) == {"a", "b"}
    outs = [stories.generate(p, 40, lookahead="4,3,4", pool_scope="request") for _, p in named]
    measured = sum(o.generated_tokens for o in outs) / sum(o.steps for o in outs)
    assert compression["4/3/4"] == pytest.approx(measured, abs=1e-4)


@pytest.mark.slow  # tunes for its 4 s budget
def test_auto_tunes_when_the_file_has_no_entry_and_then_reads_it(tuning, capsys):
    with LookaheadRuntime.from_pretrained(STORIES, lookahead=None, max_batch=2, max_seq_len=256,
                                          tuning_file=tuning) as rt:
        config, _ = tune.auto_tuning(rt, budget_seconds=4)  # what the first `auto` request calls
        assert f"tuning now, about 4 s, result cached in {tuning}" in capsys.readouterr().err
        stored = tuning_file.read_tuning_file(tuning)["entries"].get(checkpoint_tuning_key(STORIES, "float32"))
        assert stored is not None and stored["version"] == tuning_file.TUNING_VERSION and stored["machine"]["cpu"]
        assert "1" in stored["step_cost"] and stored["priors"] and stored["verified"]["prompts"] >= 1
        assert config == tune.policy_from_entry(stored)[0]
        # the stored entry, no second tuning; where tuning found greedy best (a loaded machine can), the
        # request runs greedy steps only (explicit), else the policy chooses each step
        assert rt.request_config(AUTO) == (config, config.is_greedy)
        assert "tuning now" not in capsys.readouterr().err


def test_a_tuned_tree_by_hand():
    # rank 0 accepted 90% at depths 1 and 2, rank 1 almost never: rank-0 path first, then x_t's second child (0.04)
    # before n0's (0.88 x 0.036); nothing deeper than the measured depth 2
    acceptance = {"1/0": [90, 100], "1/1": [1, 100], "2/0": [90, 90], "2/1": [0, 90]}
    assert tune.tuned_tree(acceptance, LookaheadConfig(1, 4, 1)).parents == (-1, 0, -1)
    assert tune.tuned_tree(acceptance, LookaheadConfig(2, 3, 2)).max_depth == 2
    with pytest.raises(UserError, match="not --tree off"):
        tune.tuned_tree({}, LookaheadConfig(1, 4, 1))


def test_a_step_budget_is_split_at_the_n_predicted_fastest():
    # 56 tokens at N = 5: 14 columns, W = round(1.2 sqrt 14 = 4.49) = 4; at N = 3: 28 columns, round(6.35) = 6
    assert tune.budget_config(56, {"3": 40.0, "4": 41.0, "5": 42.5}) == LookaheadConfig(4, 5, 10)
    assert tune.budget_config(56, {"3": 45.0, "4": 41.0, "5": 42.5}) == LookaheadConfig(6, 3, 22)
    # 120 at N = 4: 40 columns, round(7.59) = 8
    assert tune.budget_config(120, {"4": 1.0}) == LookaheadConfig(8, 4, 32)


@pytest.mark.slow  # tunes for its 4 s budget
@pytest.mark.parametrize("tree_for", ["4,3,4", "16"])
def test_tune_cli_writes_the_tuning_file_and_a_tree_that_decodes_exactly(tuning, capsys, tmp_path, tree_for):
    tree = tmp_path / "tree.txt"
    code = main(["tune", "--model", str(STORIES), "--dataset", "humaneval", "--budget-seconds", "4", "--json",
                 "--tuning-file", str(tuning), "--tree-out", str(tree), "--tree-for", tree_for])
    assert code == 0
    out, err = capsys.readouterr()
    stored = json.loads(out.strip().splitlines()[-1])
    assert stored["dataset"] == "humaneval" and stored["dtype"] == "float32"
    assert tuning_file.read_tuning_file(tuning)["entries"].get(checkpoint_tuning_key(STORIES, "float32")) == stored
    assert "draft tree: accepted / offered nodes by depth" in tune.format_report(stored)
    template = TreeTemplate.parse(tree.read_text())
    config = err.split("--lookahead_config ")[1].split()[0]
    assert f"--tree {tree}" in err
    if tree_for == "16":  # 16 tokens: 8, 5 or 4 columns at N = 3, 4 or 5; W = round(1.2 sqrt(columns)) = 3, 3 or 2
        n = max(stored["predicted"], key=lambda k: stored["predicted"][k])
        assert config == {"3": "3,3,5", "4": "3,4,2", "5": "2,5,2"}[n]
    else:
        assert config == tree_for
    _, N, G = map(int, config.split(","))
    assert template.nodes == G * (N - 1)
    prompt = "Once upon a time there was a"
    with LookaheadRuntime.from_pretrained(STORIES, backend="torch", lookahead=config, max_seq_len=256,
                                          tree=str(tree)) as rt:
        assert rt.tree == template
        ids = rt.encode(prompt)
        assert rt.generate(ids, 48).token_ids == rt.generate(ids, 48, lookahead="greedy").token_ids
