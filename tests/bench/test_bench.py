"""bench and its helpers: datasets, results rows, Markdown, plots; end to end on stories260K.

Fast tests use synthetic rows and stories260K; SmolLM2 only in @slow.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trt_lookahead.bench import bench, datasets
from trt_lookahead.bench.bench import RunRecord, aggregate, format_markdown, mark_exact, parse_configs, parse_peers
from trt_lookahead.cli import main
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.policy import StepCost
from trt_lookahead.runtime import LookaheadRuntime, checkpoint_tuning_key, tuning_file
from trt_lookahead.runtime.scheduler import SchedulerClosed

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
DATA = Path(datasets.__file__).parent / "data"
CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tuning keys name the thread count


@pytest.fixture
def tuning(tmp_path):
    """A tuning file of the test's own (given to the runtime or the CLI); the real cache is never written."""
    return tmp_path / "tuning.json"


def cheap_entry(config):
    """A tuning entry whose wide steps cost almost nothing: the policy climbs to lookahead."""
    cost = StepCost.linear(10.0, 0.01).to_dict()
    return {"config": config, "step_cost": cost, "priors": {"2/5/2": 1.8, "4/5/4": 2.2, "7/5/7": 2.4}}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(STORIES))


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# datasets


def test_shipped_data_files_match_source_md():
    source = (DATA / "SOURCE.md").read_text()
    for name in ("mt_bench.jsonl", "humaneval.jsonl", "gsm8k_test.jsonl"):
        digest = hashlib.sha256((DATA / name).read_bytes()).hexdigest()
        assert re.search(rf"`{re.escape(name)}` \| \d+ \| `{digest}`", source), name


@pytest.mark.parametrize(
    ("name", "rows", "chat"), [("mt_bench", 80, True), ("humaneval", 164, False), ("gsm8k", 1319, True)]
)
def test_builtin_datasets_load_with_their_prompt_kind(name, rows, chat):
    full = datasets.load_dataset(name)
    assert len(full) == rows and full.name == name
    assert all(r.is_chat == chat for r in full.rows)
    first = datasets.load_dataset(name, limit=3)
    assert first.rows == full.rows[:3]


def test_mt_bench_uses_turn_one_and_humaneval_its_raw_prompt():
    mt = datasets.load_dataset("mt_bench", limit=1).rows[0]
    first_line = json.loads((DATA / "mt_bench.jsonl").read_text().splitlines()[0])
    assert mt.id == "81" and mt.chat_messages() == [{"role": "user", "content": first_line["turns"][0]}]
    he = datasets.load_dataset("humaneval", limit=1).rows[0]
    assert he.id == "HumanEval/0" and he.text.startswith("from typing import List")


def test_jsonl_rows_of_every_kind(tmp_path):
    path = _jsonl(
        tmp_path / "mine.jsonl",
        [
            {"prompt": "raw text"},
            {"turns": ["first", "second"], "question_id": 7},
            {"question": "how many?"},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        ],
    )
    ds = datasets.load_dataset(str(path))
    assert ds.name == "mine" and len(ds) == 4
    assert ds.rows[0].text == "raw text" and not ds.rows[0].is_chat
    assert ds.rows[1].id == "7" and ds.rows[1].messages == (("user", "first"),)
    assert ds.rows[2].messages == (("user", "how many?"),)
    assert ds.rows[3].messages == (("system", "be brief"), ("user", "hi"))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"answer": 3}\n', "none of `prompt`"),
        ('{"prompt": 5}\n', "`prompt` must be a string, got int"),
        ('{"question": ["how many?"]}\n', "`question` must be a string, got list"),
        ("not json\n", "not valid JSON"),
        ('{"turns": []}\n', "`turns` must be"),
        ("[1, 2]\n", "must be a JSON object"),
        ("\n\n", "has no rows"),
    ],
)
def test_bad_jsonl_rows_name_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        datasets.load_dataset(str(path))


def test_a_dataset_in_another_encoding_is_refused_naming_its_line_and_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "ok"}\n{"prompt": "café"}\n'.encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.jsonl:2: not UTF-8 text \(invalid continuation byte at byte 15"):
        datasets.load_dataset(str(path))
    path.write_bytes('{"prompt": "ok"}\n{"prompt": "café"}\n'.encode("utf-8-sig"))  # as Windows editors save
    assert [row.text for row in datasets.load_dataset(str(path)).rows] == ["ok", "café"]


def test_unknown_dataset_and_bad_limit():
    with pytest.raises(UserError, match="neither a built-in set"):
        datasets.load_dataset("no_such_set")
    with pytest.raises(UserError, match="--limit must be positive"):
        datasets.load_dataset("gsm8k", limit=0)


def test_encode_raw_prompt_is_the_runtime_encoding(tokenizer):
    row = datasets.PromptRow("x", text="Once upon a time")
    assert datasets.encode_row(tokenizer, row) == list(tokenizer("Once upon a time")["input_ids"])


def test_encode_chat_row_uses_the_chat_template(tokenizer):
    row = datasets.PromptRow("x", messages=(("user", "Lily had a cat"),))
    with pytest.raises(UserError, match="no chat template"):
        datasets.encode_row(tokenizer, row)
    tokenizer.chat_template = CHATML
    try:
        ids = datasets.encode_row(tokenizer, row)
    finally:
        tokenizer.chat_template = None
    text = tokenizer.decode(ids)
    assert "Lily had a cat" in text and text.rstrip().endswith("<|assistant|>")


# ---------------------------------------------------------------------------------------------
# configs, rows, Markdown, plots


def test_parse_configs_normalises_and_puts_greedy_first():
    assert parse_configs("7/5/7,auto") == ["greedy", "7/5/7", "auto"]
    assert parse_configs("15/5/15,greedy,[4,3,4],15/5/15,1/2/0") == ["greedy", "15/5/15", "4/3/4"]
    with pytest.raises(UserError, match="--configs entry '4/3'"):
        parse_configs("greedy,4/3")
    with pytest.raises(UserError, match="N=1 is impossible"):
        parse_configs("4/1/4")
    assert parse_peers("hf-prompt-lookup, hf-greedy") == ["hf-prompt-lookup", "hf-greedy"]
    with pytest.raises(UserError, match="unknown peer"):
        parse_peers("vllm")


def _record(config, index, tokens, steps, seconds, ids, T=1, executor=None, hist=None, dataset="d"):
    return RunRecord(
        dataset=dataset, prompt_index=index, prompt_id=str(index), config=config, resolved=config, T=T,
        prompt_tokens=10, generated_tokens=tokens, steps=steps, decode_seconds=seconds,
        executor_seconds=executor, peak_rss_mb=100.0 + index, accepted_histogram=hist or {}, token_ids=ids,
    )


def _synthetic_records():
    return [
        _record("greedy", 0, 11, 11, 1.0, [1] * 11, executor=0.9, hist={"1": 10}),
        _record("greedy", 1, 21, 21, 4.0, [2] * 21, executor=3.8, hist={"1": 20}),
        _record("4/3/4", 0, 11, 5, 0.5, [1] * 11, T=16, executor=0.4, hist={"1": 2, "3": 2, "2": 0}),
        _record("4/3/4", 1, 21, 6, 1.0, [2] * 20 + [3], T=16, executor=0.95, hist={"4": 5}),
    ]


def test_aggregate_rows_follow_the_measure_definitions():
    records = _synthetic_records()
    mark_exact(records)
    greedy, ahead = aggregate(records)
    assert greedy["compression"] == 1.0 and greedy["speedup"] == 1.0 and greedy["exact"] == 1.0
    assert ahead["generated_tokens"] == 32 and ahead["steps"] == 11
    assert ahead["compression"] == round(32 / 11, 4)
    # decode time per token: greedy 5.0 s / 30 tokens, lookahead 1.5 s / 30 tokens
    assert ahead["speedup"] == pytest.approx(5.0 / 1.5, abs=1e-4)
    assert ahead["speedup_median"] == pytest.approx(statistics_median([2.0, 4.0]))
    assert ahead["exact"] == 0.5 and ahead["exact_prompts"] == 1
    # host ms per step: (1.5 - 1.35) s over 4 + 5 decode steps
    assert ahead["host_ms_per_step"] == pytest.approx(1000 * 0.15 / 9, abs=1e-3)
    assert ahead["tokens_per_second"] == pytest.approx(30 / 1.5, abs=1e-3)
    assert ahead["peak_rss_mb"] == 101.0
    assert ahead["accepted_histogram"] == {"1": 2, "2": 0, "3": 2, "4": 5}
    assert ahead["ms_per_step"] == pytest.approx(statistics_median([1000 * 0.5 / 4, 1000 * 1.0 / 5]))


def statistics_median(xs):
    return float(np.median(xs))


def test_peer_rows_count_against_our_greedy_and_their_own():
    records = [
        *_synthetic_records()[:2],
        RunRecord("d", 0, "0", "hf-greedy", "transformers", None, 10, 11, 11, 2.0, token_ids=[1] * 11),
        RunRecord("d", 0, "0", "hf-prompt-lookup", "pl", None, 10, 11, 4, 1.0, token_ids=[1] * 11, decoded_tokens=8),
    ]
    mark_exact(records)
    rows = {r["config"]: r for r in aggregate(records)}
    pl = rows["hf-prompt-lookup"]
    assert pl["kind"] == "peer" and pl["host_ms_per_step"] is None and pl["exact"] == 1.0
    assert pl["compression"] == 2.75
    assert pl["speedup"] == pytest.approx((1.0 / 10) / (1.0 / 8))  # vs our greedy on prompt 0
    assert pl["speedup_vs_hf_greedy"] == pytest.approx((2.0 / 10) / (1.0 / 8))


def _result(records):
    mark_exact(records)
    return {
        "model": "/m/stories260K", "backend": "torch", "dtype": "float32", "max_new_tokens": 16, "limit": 2,
        "machine": {"cpu": "CPU", "cpus": 2, "threads": 1, "load": [1.0, 2.0, 3.0], "date": "2026-11-22T02:00:00Z"},
        "load_end": [1.5, 2.0, 3.0], "results": aggregate(records),
    }


def test_markdown_table_has_one_line_per_row():
    records = _synthetic_records()
    records += [RunRecord(**{**r.__dict__, "config": "auto", "resolved": "4/3/4"}) for r in records[2:]]
    text = format_markdown(_result(records))
    table = [line for line in text.splitlines() if line.startswith("| d |")]
    assert len(table) == 3
    assert "| d | auto = 4/3/4 | 16 | 2 | 32 | 11 | 2.91 |" in text
    assert "load average 1.00/2.00/3.00 at start" in text and "1/2" in table[1]


def test_markdown_gives_greedy_steps_against_the_memory_limit():
    result = _result(_synthetic_records())
    result["memory_limit"] = {"weight_mb": 540.0, "read_gbps": 10.8, "ms_per_step": 50.0}
    # greedy: 1.0 s over 10 decode steps and 4.0 s over 20: median 150 ms per step, 3x the limit
    assert ("Memory limit: 540 MB of weights / 10.8 GB/s read = 50.0 ms per step; greedy ms/step over it: d 3.00x."
            in format_markdown(result))


def test_weight_bytes_count_every_tensor_once_in_the_dtype_asked():
    from safetensors import safe_open

    from trt_lookahead.model.checkpoint import weight_bytes

    with safe_open(str(STORIES / "model.safetensors"), framework="pt") as f:
        elements = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # noqa: SIM118
    assert weight_bytes(STORIES, "float32") == 4 * elements and weight_bytes(STORIES, "bfloat16") == 2 * elements


def test_write_outputs_writes_json_markdown_and_pngs(tmp_path):
    result = _result(_synthetic_records())
    paths = bench.write_outputs(result, tmp_path / "out", step_cost_ms={"1": 10.0, "16": 14.0})
    names = sorted(p.name for p in paths)
    assert names == sorted(
        ["results.json", "results.md", "compression_speedup.png", "accepted_per_step.png", "step_latency.png"]
    )
    assert json.loads((tmp_path / "out" / "results.json").read_text())["results"] == result["results"]
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


# ---------------------------------------------------------------------------------------------
# end to end on stories260K


@pytest.fixture(scope="module")
def stories_set(tmp_path_factory):
    path = tmp_path_factory.mktemp("sets") / "stories.jsonl"
    return _jsonl(path, [{"prompt": "Once upon a time"}, {"prompt": "Lily and Tom went to the park. They"}])


@pytest.mark.slow  # our rows and transformers' peers end to end (seconds)
def test_bench_cli_on_stories260k(stories_set, tmp_path, tuning, capsys):
    tuning_file.write_tuning_entry(checkpoint_tuning_key(STORIES, "float32"), cheap_entry("7/5/7"),
                                   tuning)
    out = tmp_path / "out"
    code = main([
        "bench", "--model", str(STORIES), "--dataset", str(stories_set), "--limit", "2", "--max-new-tokens", "24",
        "--configs", "greedy,4/3/4,auto", "--peers", "hf-greedy,hf-prompt-lookup", "--out", str(out), "--json",
        "--tuning-file", str(tuning),
    ])
    captured = capsys.readouterr()
    assert code == 0
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert set(result) >= {"model", "backend", "dtype", "machine", "results"} and result["weights"] == "float"
    assert set(result["machine"]) >= {"cpu", "threads", "load"}
    rows = {r["config"]: r for r in result["results"]}
    assert list(rows) == ["greedy", "4/3/4", "auto", "hf-greedy", "hf-prompt-lookup"]
    assert rows["auto"]["resolved"] == "auto (up to 7/5/7)" and rows["auto"]["T"] == 56
    for label in ("greedy", "4/3/4", "auto"):
        row = rows[label]
        assert row["exact"] == 1.0 and row["prompts"] == 2, label  # float32 lookahead is exact
        assert row["generated_tokens"] == rows["greedy"]["generated_tokens"]
        assert row["steps"] == sum(row["accepted_histogram"].values()) + row["prompts"]
        assert row["host_ms_per_step"] is not None and row["peak_rss_mb"] > 0 and row["speedup"] > 0
    assert rows["greedy"]["compression"] == 1.0 and rows["auto"]["compression"] > 1.0
    # transformers on the same checkpoint and ids: greedy agrees with ours in float32
    assert rows["hf-greedy"]["exact"] == 1.0 and rows["hf-greedy"]["compression"] == 1.0
    assert rows["hf-prompt-lookup"]["exact"] == 1.0 and rows["hf-prompt-lookup"]["compression"] >= 1.0
    assert len(result["runs"]) == 2 * 5
    assert (out / "results.md").read_text().count("| stories |") == 5
    assert sorted(p.name for p in out.glob("*.png")) == [
        "accepted_per_step.png", "compression_speedup.png", "step_latency.png"
    ]


def test_bench_concurrency_on_stories260k(stories_set, tmp_path, tuning, capsys):
    tuning_file.write_tuning_entry(checkpoint_tuning_key(STORIES, "float32"), cheap_entry("7/5/7"),
                                   tuning)
    out = tmp_path / "conc"
    code = main([
        "bench", "--model", str(STORIES), "--dataset", str(stories_set), "--limit", "3", "--max-new-tokens", "16",
        "--concurrency", "1,3", "--requests", "2", "--out", str(out), "--json", "--tuning-file", str(tuning),
        "--prefill", "separate,4",
    ])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["kind"] == "concurrency" and result["max_batch"] == 3 and set(result["machine"]) >= {"cpu", "load"}
    runs = {(r["prefill"], r["mode"], r["concurrency"]): r for r in result["levels"]}
    assert list(runs) == [(p, m, c) for c in (1, 3) for p in ("separate", "4") for m in ("greedy", "auto", "serial")]
    for (prefill, mode, streams), r in runs.items():
        assert r["requests"] == 2 * streams and r["output_tokens"] > 0 and r["tokens_per_second"] > 0
        # batched, one at a time, prefilled in chunks: every answer equals greedy's alone with separate prefill
        assert r["exact"] == 1.0, (prefill, mode, streams)
        assert r["ttft_p95_ms"] >= r["ttft_p50_ms"] > 0 and r["itl_p95_ms"] >= r["itl_p50_ms"] >= 0
        assert r["peak_rss_mb"] > 0 and r["host_ms_per_request_step"] > 0 and r["load"]
    levels = {(mode, streams): r for (prefill, mode, streams), r in runs.items() if prefill == "separate"}
    assert result["auto_up_to"] == "7/5/7" and sum(levels[("auto", 3)]["configs"].values()) > 0
    assert levels[("serial", 3)]["mean_rows_per_step"] == 1.0  # one request at a time
    assert levels[("greedy", 3)]["mean_rows_per_step"] > 1.0  # the streams shared steps
    assert levels[("auto", 1)]["compression"] > 1.0  # cheap wide steps: the policy used lookahead
    assert (out / "results.md").read_text().count("| greedy |") == 4
    assert sorted(p.name for p in out.glob("*.png")) == ["concurrency.png"]


def test_bench_runs_a_config_wider_than_the_cached_engine_as_generate_does(stories_set, tmp_path):
    # issue 39 item 9: "does not fit the engine built for 8/5/8 ... rebuild the engine" on the default path, where
    # `generate --lookahead_config 15,5,15` runs on torch (runtime.checkpoint_backend): one rule for both
    cache = tmp_path / "cache"
    out = subprocess.run(
        [sys.executable, "-m", "trt_lookahead.cli", "bench", "--model", str(STORIES), "--dataset", str(stories_set),
         "--limit", "1", "--max-new-tokens", "8", "--configs", "greedy,15/5/15", "--json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TRT_LOOKAHEAD_CACHE": str(cache)},
    )
    assert out.returncode == 0, out.stderr
    assert "runs on torch (15/5/15 is wider than the standard cached engine's 8/5/8" in out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {r["config"]: r for r in result["results"]}
    assert result["backend"] == "torch" and list(rows) == ["greedy", "15/5/15"]
    assert rows["15/5/15"]["exact"] == 1.0 and rows["15/5/15"]["generated_tokens"] == rows["greedy"]["generated_tokens"]
    assert not (cache / "engines").exists()  # no engine built only to be refused


def test_run_bench_closes_the_runtime_it_opened_also_when_the_run_fails(stories_set, tuning):
    """run_bench opens its runtime through `open_runtime` and closes that one, done or failing: it is never handed
    a caller's runtime to close (it used to close the one it was given)."""
    plan = bench.plan_bench(str(STORIES), datasets=str(stories_set), limit=1, max_new_tokens=4, configs="greedy")
    opened: list[LookaheadRuntime] = []

    def open_runtime(max_seq_len: int | None = plan.max_seq_len) -> LookaheadRuntime:
        opened.append(LookaheadRuntime.from_pretrained(STORIES, backend="torch", max_seq_len=max_seq_len,
                                                       tuning_file=tuning))
        return opened[-1]

    result = bench.run_bench(open_runtime, plan, progress=False, warmup=False)
    assert [r["config"] for r in result["results"]] == ["greedy"] and len(opened) == 1
    with pytest.raises(SchedulerClosed):
        opened[0].generate("Once", max_new_tokens=2)
    with pytest.raises(UserError, match="max_seq_len"):  # the prompt does not fit: the run fails
        bench.run_bench(lambda: open_runtime(max_seq_len=4), plan, progress=False, warmup=False)
    with pytest.raises(SchedulerClosed):
        opened[1].generate("Once", max_new_tokens=2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dataset", "gsm8k", "--concurrency", "0,4"], "--concurrency takes positive integers"),
        (["--dataset", "gsm8k", "--concurrency", "1,x"], "--concurrency takes a comma list"),
        (["--dataset", "gsm8k", "--concurrency", "2", "--modes", "fast"], "--modes: unknown"),
        (["--dataset", "gsm8k", "--concurrency", "2", "--prefill", "separate,sideways"], "prefill takes separate"),
        (["--dataset", "nope"], "neither a built-in set"),
        (["--dataset", "gsm8k", "--configs", "greedy,4/x/4"], "--configs entry"),
        (["--dataset", "gsm8k", "--peers", "llama.cpp"], "unknown peer"),
        (["--dataset", "gsm8k", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
        (["--dataset", "gsm8k", "--limit", "1"], "no chat template"),
    ],
)
def test_bench_bad_input_is_one_error_line(argv, message, capsys):
    assert main(["bench", "--model", str(STORIES), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]


@pytest.mark.slow
def test_bench_smollm2_chat_sets_and_peers(tuning):
    key = checkpoint_tuning_key("smollm2-135m-instruct", "float32")
    tuning_file.write_tuning_entry(key, cheap_entry("greedy"), tuning)  # auto is greedy here
    plan = bench.plan_bench(
        "smollm2-135m-instruct", datasets="mt_bench,humaneval", limit=1, max_new_tokens=32,
        configs="greedy,4/3/4,auto", peers="hf-greedy,hf-prompt-lookup",
    )
    result = bench.run_bench(lambda: LookaheadRuntime.from_pretrained(
        plan.model_path, lookahead="greedy", max_seq_len=plan.max_seq_len, tuning_file=tuning), plan, progress=False)
    rows = {(r["dataset"], r["config"]): r for r in result["results"]}
    assert result["stop_token_ids"] == [2]
    for dataset in ("mt_bench", "humaneval"):
        assert rows[(dataset, "4/3/4")]["exact"] == 1.0
        assert rows[(dataset, "auto")]["resolved"] == "greedy"
        assert rows[(dataset, "hf-greedy")]["generated_tokens"] == rows[(dataset, "greedy")]["generated_tokens"]
