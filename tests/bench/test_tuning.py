"""Tuning: the tuning file, the policy an entry gives `auto`, the built-in priors without one, the measurements on
stories260K, `tune`; the runtime reads the file and never imports trt_lookahead.tuning.

Every test reads and writes a tuning file of its own (tmp_path), given to the runtime or the CLI."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from trt_lookahead.cli import main
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import AUTO, GREEDY, Lookahead, LookaheadConfig
from trt_lookahead.lookahead.policy import (
    PRIORS,
    TUNED,
    AutoPolicy,
    LookaheadPolicy,
    Priors,
    StepCost,
    choose_ceiling,
    prior_policy,
    single_request_speed,
    widest,
)
from trt_lookahead.lookahead.tree import TREE_DEPTH, TreeTemplate, tree_template
from trt_lookahead.runtime import LookaheadRuntime, checkpoint_tuning_key, tuning_file
from trt_lookahead.runtime.load import loaded_tuning_key
from trt_lookahead.tuning import tune

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
COMPRESSION = {"1/3/1": 1.4, "2/3/2": 1.7, "4/3/4": 2.0, "1/4/1": 1.5, "2/4/2": 1.9, "4/4/4": 2.3, "8/4/8": 2.5}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the tuning key names the thread count


@pytest.fixture
def tuning(tmp_path):
    return tmp_path / "tuning.json"


def entry(config="8/4/8", cost=None, priors=None):
    cost = cost or StepCost({1: [(1, 10.0), (32, 11.0), (256, 60.0)], 8: [(8, 12.0), (256, 70.0)]})
    return {"config": config, "step_cost": cost.to_dict(), "priors": priors or COMPRESSION}


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


@pytest.mark.parametrize(("content", "what"), [
    (bytes(range(256)), "not JSON"),  # model weights given by mistake
    (b'{"model_type": "llama"}', "JSON, but not a tuning file"),  # a checkpoint's config.json
    (b"[1, 2]", "JSON, but not a tuning file"),
    (b"{" * 100_000, "not JSON"),  # deeper than json's recursion limit
])
def test_a_file_that_is_not_a_tuning_file_is_never_written_over(tmp_path, content, what):
    path = tmp_path / "mine.json"
    path.write_bytes(content)
    with pytest.raises(UserError, match=f"tuning file {path} holds something else \\({what}\\)"):
        tuning_file.write_tuning_entry("k", entry(), path)
    assert path.read_bytes() == content
    with pytest.raises(UserError, match=f"--tuning-file {path} holds something else"):
        tuning_file.check_tuning_file(path)


def test_an_empty_file_or_a_tuning_file_of_any_version_is_written_over_and_the_lock_is_its_own(tmp_path, capsys):
    path, users_lock = tmp_path / "t.json", tmp_path / "t.lock"
    users_lock.write_text("the user's")  # the name a lock beside t.json once took
    path.write_bytes(b"")  # as mktemp leaves it
    tuning_file.write_tuning_entry("a", entry(), path)
    assert json.loads(path.read_text()) == {"version": tuning_file.TUNING_VERSION, "entries": {"a": entry()}}
    path.write_text(json.dumps({"version": 1, "entries": {"old": {"config": "4/3/4"}}}))
    tuning_file.write_tuning_entry("b", entry("greedy"), path)
    assert json.loads(path.read_text())["entries"] == {"b": entry("greedy")}  # version 1's entries mean nothing now
    assert "another format version" in capsys.readouterr().err
    assert users_lock.read_text() == "the user's"


def test_an_entry_gives_auto_its_largest_config_and_policy():
    auto = AutoPolicy.from_entry(entry())
    assert auto.ceiling == LookaheadConfig(8, 4, 8) and auto.source == TUNED
    assert auto.policy.priors.extra(LookaheadConfig(2, 4, 2)) == pytest.approx(0.9)
    assert auto.policy.cost(32, 1) == pytest.approx(11.0)
    assert AutoPolicy.from_entry(entry("greedy")).ceiling.is_greedy


def test_auto_runs_the_tuned_policy_and_keeps_greedy_tokens(tuning, capsys):
    key = checkpoint_tuning_key(STORIES, "float32")  # the default: a cached engine, with a draft tree
    tuning_file.write_tuning_entry(key, entry("4/3/4"), tuning)
    with LookaheadRuntime.from_pretrained(STORIES, lookahead=AUTO, max_seq_len=256, tuning_file=tuning) as rt:
        assert loaded_tuning_key(rt.model) == key and rt.backend == "onnxruntime" and rt.tree is not None
        assert rt.auto.source == TUNED and rt.auto.ceiling == LookaheadConfig(4, 3, 4)  # the entry's, not the priors'
        assert rt.lookahead == Lookahead(LookaheadConfig(4, 3, 4), auto=True)
        assert rt.scheduler.policy is rt.auto.policy
        out = rt.generate("Once upon a time", max_new_tokens=60)
        assert out.token_ids == rt.generate("Once upon a time", max_new_tokens=60, lookahead="greedy").token_ids
        assert out.config == AUTO
        for label in out.stats.configs:  # greedy, or at most 4/3/4 (candidates capped by the pool's supply)
            c = LookaheadConfig.greedy() if label == "greedy" else LookaheadConfig.parse(label)
            assert c.is_greedy or (c.N == 3 and c.W <= 4 and c.G <= 4), label
        assert out.stats.configs.get("greedy", 0) < out.steps - 1  # a cheap step: it used lookahead
        assert isinstance(rt.scheduler.policy, LookaheadPolicy)
    assert "built-in priors" not in capsys.readouterr().err


def test_auto_without_an_entry_runs_on_the_priors_says_so_once_and_keeps_greedy_tokens(tuning, capsys):
    with LookaheadRuntime.from_pretrained(STORIES, backend="torch", lookahead=AUTO, max_seq_len=256,
                                          tuning_file=tuning) as rt:
        said = capsys.readouterr().err
        assert rt.auto.source == PRIORS and rt.scheduler.policy is rt.auto.policy
        # the ladder's widest config at the N the priors predict fastest, within the executor's step
        assert rt.auto.ceiling == AutoPolicy.untuned(rt.executor.step_tokens).ceiling == widest(3, 128)
        assert rt.lookahead == Lookahead(rt.auto.ceiling, auto=True)
        ids = rt.encode("Once upon a time")
        outs = [rt.generate(ids, 60) for _ in range(2)]
        assert outs[0].config == AUTO and sum(c != GREEDY for c in outs[0].stats.configs)  # it ran lookahead steps
        assert all(o.token_ids == rt.generate(ids, 60, lookahead=GREEDY).token_ids for o in outs)
        rt.auto.announce()  # what a runtime calls when it narrows an `auto` request
    for text in ("built-in priors (up to 5/3/11)", "`trt-lookahead tune`", "`trt-lookahead serve --tune`"):
        assert text in said
    assert capsys.readouterr().err.count("built-in priors") == 0  # once per runtime: said at load, not again
    assert not list(tuning.parent.glob("tuning.json"))  # nothing was tuned or written
    with LookaheadRuntime.from_pretrained(STORIES, backend="torch", lookahead=GREEDY, max_seq_len=256,
                                          tuning_file=tuning) as rt:
        assert rt.auto.source == PRIORS and "built-in priors" not in capsys.readouterr().err  # greedy: not said


def test_a_runtime_naming_no_config_runs_auto_on_the_priors_without_a_word(tuning, capsys):
    with LookaheadRuntime.from_pretrained(STORIES, backend="torch", max_seq_len=256, tuning_file=tuning) as rt:
        assert rt.auto.source == PRIORS and rt.lookahead == Lookahead(rt.auto.ceiling, auto=True)
        ids = rt.encode("Once upon a time")
        out = rt.generate(ids, 60)
        assert out.config == AUTO and sum(c != GREEDY for c in out.stats.configs)  # it ran lookahead steps
        assert out.token_ids == rt.generate(ids, 60, lookahead=GREEDY).token_ids
    assert "built-in priors" not in capsys.readouterr().err  # the default: `auto` was not asked for by name


def test_an_auto_request_on_a_runtime_serving_a_config_says_the_priors_once(tuning, capsys):
    with LookaheadRuntime.from_pretrained(STORIES, backend="torch", lookahead="4,3,4", max_seq_len=256,
                                          tuning_file=tuning) as rt:
        assert "built-in priors" not in capsys.readouterr().err  # nothing asked for `auto` yet
        ids = rt.encode("Once upon a time")
        outs = [rt.generate(ids, 24, lookahead=AUTO) for _ in range(2)]
        assert outs[0].token_ids == outs[1].token_ids == rt.generate(ids, 24, lookahead=GREEDY).token_ids
    assert capsys.readouterr().err.count("`auto` runs on built-in priors") == 1


def test_the_priors_never_predict_auto_slower_than_greedy():
    policy = prior_policy()
    greedy = 1000.0 / policy.cost(1, 1)
    for step_tokens, engine in ((128, None), (64, LookaheadConfig(8, 5, 8)), (16, LookaheadConfig(4, 3, 4))):
        auto = AutoPolicy.untuned(step_tokens, engine)
        assert auto.source == PRIORS and auto.ceiling.step_tokens <= step_tokens
        if engine is not None:
            auto.ceiling.check_fits(engine)
        assert single_request_speed(policy, auto.ceiling) > greedy
        # a lone fresh request's first step: the policy's choice is predicted at least as fast as greedy
        state = policy.start(Lookahead(auto.ceiling, auto=True))
        (chosen,) = policy.choose([state], [auto.ceiling.G])
        assert 1000.0 * policy.expected(state, chosen) / policy.cost(chosen.step_tokens, 1) >= greedy
    # where no lookahead step fits (T = 1), auto is greedy
    assert AutoPolicy.untuned(1).ceiling.is_greedy


def test_importing_and_running_the_runtime_never_loads_tuning(tmp_path):
    code = (
        "import sys, torch\n"
        "torch.set_num_threads(1)\n"
        "from trt_lookahead.runtime import LookaheadRuntime\n"
        f"with LookaheadRuntime.from_pretrained({str(STORIES)!r}, backend='torch', lookahead='auto', max_seq_len=128,"
        f" tuning_file={str(tmp_path / 'tuning.json')!r}) as rt:\n"
        "    rt.generate('Once upon a time', 16)\n"
        "print(sorted(m for m in sys.modules if m.startswith('trt_lookahead.')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    loaded = run.stdout.strip().splitlines()[-1]
    assert "trt_lookahead.runtime.tuning_file" in loaded and "trt_lookahead.tuning" not in loaded
    assert run.stderr.count("built-in priors") == 1


def test_the_ceiling_is_the_n_predicted_fastest_for_one_request():
    cheap = LookaheadPolicy(StepCost.linear(10.0, 0.01), Priors(COMPRESSION))
    config, predicted = choose_ceiling(cheap, step_tokens=128)
    assert config == LookaheadConfig(5, 4, 11) and predicted["4"] > predicted["3"]  # 16 columns: 1.2 x 4 window
    narrow = choose_ceiling(cheap, step_tokens=16)[0]
    # 16 tokens are 8 columns at N = 3 (1.2 sqrt(8) = 3.4 of them window), 5 at N = 4 and 4 at N = 5
    assert narrow in (LookaheadConfig(3, 3, 5), LookaheadConfig(3, 4, 2), LookaheadConfig(2, 5, 2))
    # an engine dir built for 8/3/8 runs no N = 4 or 5 (tune once asked it for 1/4/1 and failed)
    assert choose_ceiling(cheap, step_tokens=32, engine=LookaheadConfig(8, 3, 8))[0] == LookaheadConfig(8, 3, 8)
    assert choose_ceiling(cheap, step_tokens=48, engine=LookaheadConfig(2, 5, 4))[0].W == 2


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
def test_tune_on_its_own_runtimes_stores_the_entry_the_next_runtime_reads(tuning, capsys):
    with LookaheadRuntime.from_pretrained(STORIES, lookahead=None, max_batch=2, max_seq_len=256,
                                          tuning_file=tuning) as loaded:
        assert loaded.auto.source == PRIORS
    stored = tune.tune_and_store(loaded.model, tuning, budget_seconds=4)  # tune's runtimes, once this one closed
    assert stored == tuning_file.read_tuning_file(tuning)["entries"].get(checkpoint_tuning_key(STORIES, "float32"))
    assert stored["version"] == tuning_file.TUNING_VERSION and stored["machine"]["cpu"]
    assert "1" in stored["step_cost"] and stored["priors"] and stored["verified"]["prompts"] >= 1
    with LookaheadRuntime.from_pretrained(STORIES, lookahead=AUTO, max_batch=2, max_seq_len=256,
                                          tuning_file=tuning) as rt:
        assert rt.auto.source == TUNED and rt.auto.ceiling == AutoPolicy.from_entry(stored).ceiling
        # where tuning found greedy best (a loaded machine can), `auto` is greedy; else the policy chooses each step
        assert rt.lookahead == (Lookahead.greedy() if rt.auto.ceiling.is_greedy else
                                Lookahead(rt.auto.ceiling, auto=True))
    assert "built-in priors" not in capsys.readouterr().err


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


def test_triton_repo_with_auto_tunes_nothing(tmp_path):
    """The repository records `auto`; its instances read the tuning entry when they load (it once tuned here, for
    minutes, through the runtime's first-use tuning). bfloat16 runs on torch: no engine to build either."""
    cache = tmp_path / "cache"
    run = subprocess.run(
        [sys.executable, "-m", "trt_lookahead.cli", "triton-repo", "--model", str(STORIES), "--output",
         str(tmp_path / "repo"), "--lookahead_config", "auto", "--dtype", "bfloat16"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TRT_LOOKAHEAD_CACHE": str(cache)},
    )
    assert run.returncode == 0, run.stderr
    config = (tmp_path / "repo" / "lookahead" / "config.pbtxt").read_text()
    assert 'key: "lookahead_config" value: { string_value: "auto" }' in config
    assert "tune:" not in run.stderr and not list(cache.rglob("tuning.json"))
