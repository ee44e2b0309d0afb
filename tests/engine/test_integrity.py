"""Engine dirs that were damaged, edited or half-written: a clear one-line error, never a traceback or other text.

Regression tests for issue 10: checksums verified on load (and the opt-out), config.json checked field by
field and against its graphs, `build --force` replacing only engine dirs, interrupted builds cleaned up.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trt_lookahead.engine.format import CONFIG_DIGEST, config_digest, is_engine_dir
from trt_lookahead.files import DIGESTS_FILE, write_bytes_atomic

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
PROMPT = "Once upon a time"

pytestmark = pytest.mark.export  # builds engine dirs


def cli(*argv: str, cache: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`trt-lookahead ...` in a subprocess with its own cache dir (where verdicts are remembered)."""
    env = {**os.environ, "TRT_LOOKAHEAD_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "trt_lookahead.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=timeout)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    return lines[0]


def generate(engine: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return cli("generate", "--engine", str(engine), "--prompt", PROMPT, "--max-new-tokens", "16", "--json",
               "--threads", "1", *extra, cache=cache)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """stories260K at 2,2,1 with the default max_seq_len (min(context 512, 2048)), and its reference text."""
    root = tmp_path_factory.mktemp("integrity")
    out = root / "engine"
    built = cli("build", "--model", str(STORIES), "--output", str(out), "--lookahead_config", "2,2,1",
                "--max_input_len", "64", cache=root / "cache")
    assert built.returncode == 0, built.stderr[-2000:]
    first = generate(out, root / "cache")
    assert first.returncode == 0, first.stderr[-2000:]
    return out, json.loads(first.stdout)


def damaged(engine_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(engine_dir, copy)
    return copy


def test_the_default_build_fits_the_models_context_and_records_its_checksums(engine):
    # issue 10: --max_seq_len defaulted to 2048 and failed on every model with a shorter context
    engine_dir, _ = engine
    config = json.loads((engine_dir / "config.json").read_text())
    assert config["max_seq_len"] == 512
    assert config[CONFIG_DIGEST] == config_digest(config)
    assert {"weights.bin", "model.onnx", "tokenizer.json"} <= set(config["files"])


def test_flipped_bytes_in_the_weights_are_refused_naming_the_file(engine, tmp_path):
    # issue 10: xor of 4096 bytes at 1000 ran silently with different text
    engine_dir, _ = engine
    copy = damaged(engine_dir, tmp_path)
    with open(copy / "weights.bin", "r+b") as f:
        f.seek(1000)
        block = f.read(4096)
        f.seek(1000)
        f.write(bytes(b ^ 255 for b in block))
    line = one_error_line(generate(copy, tmp_path / "cache"))
    assert str(copy / "weights.bin") in line and "sha256" in line and "--no-verify" in line
    opted_out = generate(copy, tmp_path / "cache", "--no-verify")  # the user verifies elsewhere: it runs
    assert opted_out.returncode == 0, opted_out.stderr[-2000:]


def test_a_verified_engine_is_remembered_and_any_change_is_checked_again(engine, tmp_path):
    engine_dir, reference = engine
    copy, cache = damaged(engine_dir, tmp_path), tmp_path / "cache"
    assert json.loads(generate(copy, cache).stdout)["token_ids"] == reference["token_ids"]
    remembered = json.loads((cache / DIGESTS_FILE).read_text())
    files = json.loads((copy / "config.json").read_text())["files"]
    for name, entry in files.items():  # size, mtime, ctime and the matching sha256 of every file
        stat = (copy / name).stat()
        assert remembered[str((copy / name).resolve())] == [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns,
                                                             entry["sha256"]]
    # same size, mtime put back: the changed ctime still sends the file through the hash
    weights = copy / "weights.bin"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[5000] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert "weights.bin" in one_error_line(generate(copy, cache))


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("weights.bin", lambda p: os.truncate(p, 5000)),
        ("weights.bin", lambda p: os.truncate(p, 0)),
        ("weights.bin", os.remove),
        ("model.onnx", lambda p: os.truncate(p, 20000)),
        ("tokenizer.json", lambda p: Path(p).write_text("garbage")),
    ],
)
def test_truncated_empty_or_missing_files_get_one_line_naming_them(engine, tmp_path, name, damage):
    engine_dir, _ = engine
    copy = damaged(engine_dir, tmp_path)
    damage(copy / name)
    assert name in one_error_line(generate(copy, tmp_path / "cache"))
    assert one_error_line(generate(copy, tmp_path / "cache", "--no-verify"))  # opted out: still no traceback


LIES = {  # config.json field -> a lie; issue 10 saw tracebacks, "range() arg 3", broadcast errors or silent runs
    "cache_rows": 10, "model.num_kv_heads": 3, "model.num_layers": 1, "model.vocab_size": 100000,
    "model.head_dim": 5, "max_seq_len": 1000, "max_input_len": 0, "lookahead": None, "model": [],
    "eos_token_id": "x", "step_tokens": 7, "graphs.model": "../x", "dtype": "float64",
}


def lie(config: dict, key: str, value) -> dict:
    *path, last = key.split(".")
    target = config
    for part in path:
        target = target[part]
    target[last] = value
    return config


@pytest.mark.parametrize("key", sorted(LIES))
def test_an_edited_config_json_is_refused_with_or_without_verification(engine, tmp_path, key):
    engine_dir, _ = engine
    copy = damaged(engine_dir, tmp_path)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(lie(config, key, LIES[key])))
    assert "config.json was changed after the build" in one_error_line(generate(copy, tmp_path / "cache"))
    assert one_error_line(generate(copy, tmp_path / "cache", "--no-verify"))


def test_a_consistent_lie_is_caught_by_the_graph_itself(engine, tmp_path):
    # the vocabulary size edited (and the digest recomputed): the graph's logits still have the built one
    engine_dir, _ = engine
    copy = damaged(engine_dir, tmp_path)
    config = json.loads((copy / "config.json").read_text())
    config["model"]["vocab_size"] = 1000
    config[CONFIG_DIGEST] = config_digest(config)
    (copy / "config.json").write_text(json.dumps(config))
    line = one_error_line(generate(copy, tmp_path / "cache", "--no-verify"))
    assert "does not match its config.json" in line and "logits" in line


def test_force_never_replaces_a_directory_that_is_not_an_engine(tmp_path):
    # issue 10: `build --output d --force` destroyed d/notes.txt
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for flags in ((), ("--force",)):
        result = cli("build", "--model", str(STORIES), "--output", str(out), "--lookahead_config", "2,2,1", *flags,
                     cache=tmp_path / "cache")
        line = one_error_line(result)
        assert "not an engine dir" in line and "notes.txt" in line and "pass --force" not in line
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["mine"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--lookahead_config", "300,30,300"], "above the limit of 1024"),  # issue 10: grew to 19 GB
        (["--output", "{file}/engine"], "is a file"),
        (["--output", "{file}"], "is a file"),
    ],
)
def test_impossible_builds_are_refused_before_any_work(tmp_path, argv, words):
    (tmp_path / "file").write_text("x")
    argv = [a.format(file=tmp_path / "file") for a in argv]
    base = ["build", "--model", str(STORIES), "--output", str(tmp_path / "out")]
    line = one_error_line(cli(*base, *argv, cache=tmp_path / "cache", timeout=120))
    assert words in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def _signal_a_build(tmp_path, signum) -> tuple[int, str]:
    """Start a build, send `signum` once its work dir exists; returns (returncode, stderr)."""
    env = {**os.environ, "TRT_LOOKAHEAD_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "trt_lookahead.cli", "build", "--model", str(STORIES),
                             "--output", str(tmp_path / "out"), "--lookahead_config", "2,2,1"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith(".out.building-") for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_build_leaves_nothing_behind(tmp_path, signum):
    # issue 10: SIGTERM left `.NAME.building-PID` behind. stories260K builds in about a second, so on a
    # loaded machine the signal can land after the build finished: then the engine is whole; try again.
    for _ in range(5):
        returncode, err = _signal_a_build(tmp_path, signum)
        left = sorted(p.name for p in tmp_path.iterdir() if p.name != "cache")
        if returncode == 130:
            break
        assert left == ["out"] and is_engine_dir(tmp_path / "out"), (returncode, left, err[-2000:])
        shutil.rmtree(tmp_path / "out")
    assert returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err[-2000:]
    assert left == []


def test_what_a_killed_build_left_is_removed_by_the_next_one(engine, tmp_path):
    engine_dir, _ = engine
    gone = subprocess.Popen(["true"])  # a PID that has exited
    gone.wait()
    stale = tmp_path / f".out.building-{gone.pid}"
    stale.mkdir()
    (stale / "weights.bin").write_bytes(b"half")
    shutil.copytree(engine_dir, tmp_path / "out")  # the same build: nothing to do, but the leftovers go
    result = cli("build", "--model", str(STORIES), "--output", str(tmp_path / "out"), "--lookahead_config", "2,2,1",
                 "--max_input_len", "64", "--force", cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-2000:]
    assert not stale.exists()


def test_an_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    """engine.plan and config.json are written beside and renamed: a failed rename keeps the old state and
    leaves no temporary behind."""
    target = tmp_path / "engine.plan"
    write_bytes_atomic(target, b"old")
    write_bytes_atomic(target, b"new plan")
    assert target.read_bytes() == b"new plan"
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "keep").write_text("keep")
    with pytest.raises(OSError):
        write_bytes_atomic(blocked, b"data")  # the rename onto a non-empty directory fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked", "engine.plan"]
    assert (blocked / "keep").read_text() == "keep"


# -- fuzz: random byte damage to an engine dir (issue 10) ---------------------------------------------

FILES = ["config.json", "weights.bin", "model.onnx", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json", "tokenizer.model"]
DAMAGE = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**20), st.integers(1, 4096), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 2**20)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("replace"), st.binary(max_size=64)),
    st.tuples(st.just("delete")),
)


def apply(file: Path, damage: tuple) -> None:
    kind, *args = damage
    data = bytearray(file.read_bytes())
    if kind == "flip" and data:
        start, length, mask = args[0] % len(data), args[1], args[2]
        data[start : start + length] = bytes(b ^ mask for b in data[start : start + length])
    elif kind == "truncate":
        del data[args[0] % (len(data) + 1) :]
    elif kind == "append":
        data += args[0]
    elif kind == "replace":
        data = bytearray(args[0])
    if kind == "delete":
        file.unlink()
    else:
        file.write_bytes(bytes(data))


@pytest.mark.slow
def test_random_damage_gives_a_clear_error_never_other_text(engine, tmp_path_factory, cli_worker, record_property):
    engine_dir, reference = engine
    ran = {"refused": 0, "same text": 0, "ran with --no-verify": 0}

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(damage=st.lists(st.tuples(st.sampled_from(FILES), DAMAGE), min_size=1, max_size=3),
           verify=st.booleans())
    def case(damage: list, verify: bool) -> None:
        copy = tmp_path_factory.mktemp("damaged") / "engine"
        shutil.copytree(engine_dir, copy)
        for name, what in damage:
            if (copy / name).exists():
                apply(copy / name, what)
        argv = ["generate", "--engine", str(copy), "--prompt", PROMPT, "--max-new-tokens", "16", "--json",
                "--threads", "1", *(() if verify else ("--no-verify",))]
        code, out, err = cli_worker.run(argv)
        assert "Traceback" not in err, f"{damage}\n{err}"
        if code == 0 and verify:  # everything verified: exactly the undamaged engine's tokens
            assert json.loads(out.strip().splitlines()[-1])["token_ids"] == reference["token_ids"], damage
        if code != 0:
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), f"{damage} -> {code}\n{err}"
        ran["refused" if code else "same text" if verify else "ran with --no-verify"] += 1
        shutil.rmtree(copy.parent)

    case()
    record_property("cases", ran)
    print(f"{ran} cases")
    assert ran["refused"] >= 20
