"""Fuzzing the command line (issue 10): random argument vectors get a valid result or one `error:` line.

A case either exits 0 with its result (one JSON object for `generate --json`, the repository's path for
`triton-repo`), or exits 2 with exactly one line on stderr that starts with `error: `; never a
traceback, another exit code or a hang (each case runs under a time limit in a long-lived worker
process, see conftest.CliWorker). Values mix valid ones with hostile ones (negative, huge, NaN,
non-numbers, paths that are files or missing). `auto` and known model names are left out: they tune for
minutes or download.
"""

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

pytestmark = pytest.mark.slow  # a few hundred CLI runs: CI runs them, the quick check does not

NUMBERS = st.one_of(
    st.integers(-3, 20), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["0", "-0", "1e-320", "1e39", "inf", "-inf", "nan", "0x10", "1_000", "", " ", "٤", "abc"]),
)
TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=12)
CONFIGS = st.one_of(
    st.sampled_from(["4,3,4", "2,2,1", "1,2,0", "[7,5,7]", "1/3/3", "0,3,4", "4,1,4", "4,3,-1", "300,30,300",
                     "100000,100000,100000", "4,3", "a,b,c", "", "٤,3,4", "greedy"]),
    st.tuples(st.integers(-2, 40), st.integers(-2, 40), st.integers(-2, 40)).map(lambda t: ",".join(map(str, t))),
)


def value(strategy) -> st.SearchStrategy[str]:
    return strategy.map(str)


def paths(tmp: Path) -> st.SearchStrategy[str]:
    """Existing and hostile paths: the model, the scratch dir (a directory), a file, nothing, a file's child."""
    return st.sampled_from([str(STORIES), str(tmp), str(tmp / "file.txt"), str(tmp / "missing"),
                            str(tmp / "file.txt" / "below"), str(tmp / "latin1.txt")])


def options(flags: dict[str, st.SearchStrategy[str] | None]) -> st.SearchStrategy[list[str]]:
    """A random subset of `flags` in random order; a flag with None takes no value."""
    def render(chosen: list[tuple[str, str | None]]) -> list[str]:
        return [part for flag, v in chosen for part in ((flag,) if v is None else (flag, v))]

    items = [st.tuples(st.just(f), st.none() if s is None else s) for f, s in flags.items()]
    return st.lists(st.one_of(items), max_size=6, unique_by=lambda t: t[0]).map(render)


VALID_CONFIGS = st.sampled_from(["4,3,4", "2,2,1", "1,2,0", "[7,5,7]", "1/3/3", "greedy"])


def generate_argv(tmp: Path) -> st.SearchStrategy[list[str]]:
    """Valid runs (so successes are common) and anything-goes ones."""
    valid = {
        "--temperature": value(st.floats(0, 2)), "--top-k": value(st.integers(0, 100)),
        "--top-p": value(st.floats(0.05, 1)), "--seed": value(st.integers(0, 2**64 - 1)),
        "--lookahead_config": VALID_CONFIGS, "--max-seq-len": value(st.integers(64, 512)), "--threads": st.just("1"),
        "--dtype": st.sampled_from(["float32", "float16"]),
    }
    hostile = {
        "--temperature": value(NUMBERS), "--top-k": value(NUMBERS), "--top-p": value(NUMBERS),
        "--seed": value(NUMBERS), "--lookahead_config": CONFIGS, "--greedy": None, "--chat": None,
        "--max-seq-len": value(st.one_of(st.integers(-2, 600), NUMBERS)), "--threads": value(st.integers(-1, 2)),
        "--dtype": st.sampled_from(["float32", "float16", "float64", ""]),
        "--backend": st.sampled_from(["torch", "onnxruntime", "tensorrt", "cuda"]),
        "--no-verify": None, "--engine": paths(tmp),
    }
    source = st.one_of(st.tuples(st.just("--prompt"), TEXT), st.tuples(st.just("--prompt-file"), paths(tmp)))
    return st.one_of(
        st.tuples(st.just(str(STORIES)), st.tuples(st.just("--prompt"), TEXT), st.integers(1, 8).map(str),
                  options(valid)),
        st.tuples(st.one_of(st.just(str(STORIES)), paths(tmp)), source,
                  st.one_of(st.integers(-2, 12).map(str), value(NUMBERS)), options(hostile)),
    ).map(lambda t: ["generate", "--model", t[0], *t[1], "--max-new-tokens", t[2], *t[3], "--json"])


def triton_repo_argv(tmp: Path) -> st.SearchStrategy[list[str]]:
    """Valid repositories and anything-goes ones, always written under the scratch dir."""
    valid = {
        "--lookahead_config": VALID_CONFIGS.filter(lambda c: c != "greedy"), "--instances": value(st.integers(1, 4)),
        "--max_batch_size": value(st.integers(0, 8)), "--max_seq_len": value(st.integers(2, 512)),
        "--name": st.from_regex(r"[a-z][a-z0-9_.-]{0,7}", fullmatch=True), "--no-verify": None,
    }
    hostile = {
        "--lookahead_config": CONFIGS, "--instances": value(NUMBERS), "--max_batch_size": value(NUMBERS),
        "--max_seq_len": value(st.one_of(st.integers(-2, 600), NUMBERS)), "--dtype": st.sampled_from(["float32", "x"]),
        "--name": st.one_of(st.sampled_from(["m", "a/b", "..", ""]), TEXT), "--no-verify": None,
    }
    output = st.sampled_from([str(tmp / "repo"), str(tmp / "file.txt"), str(tmp / "file.txt" / "below"),
                              str(tmp / "new" / "repo")])  # never the fixture: a success writes there
    return st.one_of(
        st.tuples(st.just(str(STORIES)), st.sampled_from([str(tmp / "repo"), str(tmp / "new" / "repo")]),
                  options(valid)),
        st.tuples(paths(tmp), output, options(hostile)),
    ).map(lambda t: ["triton-repo", "--model", t[0], "--output", t[1], *t[2]])


def junk_argv() -> st.SearchStrategy[list[str]]:
    """Anything at all after a command that fails fast (never `tune`/`bench`/`build` with a usable model, never
    --help, which prints usage and exits 0)."""
    words = st.one_of(TEXT, st.sampled_from(["--model", "--engine", "--prompt", "--json", "--force", "--repo",
                                              "--http-port", "-1", "--", "-x", "--max-new-tokens"]))
    words = words.filter(lambda w: w != "-h" and not (len(w) > 2 and "--help".startswith(w)))  # help: exit 0
    command = st.sampled_from(["generate", "triton-serve", "triton-repo", "frobnicate", "--version", ""])
    return st.tuples(command, st.lists(words, max_size=6)).map(lambda t: [t[0], *t[1]])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "file.txt").write_text("Once upon a time")
    (root / "latin1.txt").write_bytes(b"caf\xe9")
    return root


def check(argv: list[str], code: int, out: str, err: str) -> None:
    """The contract every case must meet."""
    assert "Traceback" not in err, f"{argv}\n{err}"
    if code == 0:
        if argv[0] == "generate":
            record = json.loads(out.strip().splitlines()[-1])
            assert record["generated_tokens"] == len(record["token_ids"]) and isinstance(record["text"], str), argv
        else:
            name = argv[argv.index("--name") + 1] if "--name" in argv else "lookahead"
            assert (Path(out.strip()) / name / "config.pbtxt").is_file(), argv
        return
    lines = [x for x in err.strip().splitlines() if not x.startswith("trt-lookahead: ")]  # less info lines
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), f"{argv} -> {code}\n{err}"


def fuzz(cli_worker, strategy, record_property, examples: int, successes: int) -> None:
    ran = {"exit 0": 0, "exit 2": 0}

    @settings(FUZZ, max_examples=examples)
    @given(argv=strategy)
    def case(argv: list[str]) -> None:
        code, out, err = cli_worker.run(argv)
        check(argv, code, out, err)
        ran[f"exit {code}"] += 1

    case()
    record_property("cases", ran)
    print(f"{ran} cases")
    assert ran["exit 0"] >= successes and ran["exit 2"] >= 10  # both sides of the contract were exercised


def test_random_generate_arguments(cli_worker, scratch, record_property):
    # the cached engine that `--backend onnxruntime` runs stories260K on, built before the cases (a case is
    # given a few seconds, a build takes minutes)
    code, _, err = cli_worker.run(["generate", "--model", str(STORIES), "--backend", "onnxruntime", "--prompt", "Hi",
                                   "--max-new-tokens", "1", "--threads", "1"], timeout=1200)
    assert code == 0, err
    fuzz(cli_worker, generate_argv(scratch), record_property, examples=100, successes=5)


def test_random_triton_repo_arguments(cli_worker, scratch, record_property):
    fuzz(cli_worker, triton_repo_argv(scratch), record_property, examples=60, successes=5)


def test_random_argument_junk(cli_worker, record_property):
    fuzz(cli_worker, junk_argv(), record_property, examples=100, successes=0)
