"""The file layer under hostile conditions (issue 39 items 7, 8 and 10): a read-only cache, a damaged cache, an
unwritable tuning file, a memory limit, damaged engine and checkpoint files. Each is run through the real CLI in
a subprocess (its own cache dir, native output captured at the file-descriptor level): a command that can work
works, one that cannot prints exactly one `error:` line naming the problem and the fix, and exits 2.

Read-only directories are real read-only bind mounts (`unshare -rm`: a private mount namespace, as root or not),
since chmod does not stop root from writing.
"""

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trt_lookahead.cli import main
from trt_lookahead.engine.cache import ENGINES
from trt_lookahead.engine.format import CONFIG_FILE, load_engine_config

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
GENERATE = ["generate", "--model", str(STORIES), "--prompt", "Once upon a time", "--max-new-tokens", "6"]
CLI_TIMEOUT = 300  # seconds: a build of stories260K's engine takes tens of seconds on 2 cores
# a shell that makes "$0" a read-only bind mount in a private mount namespace, then runs the command after it
READ_ONLY = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'


def cli(argv: list[str], cache: Path, read_only: Path | None = None, timeout: float = CLI_TIMEOUT, **popen
        ) -> subprocess.CompletedProcess:
    """`trt-lookahead *argv` with TRT_LOOKAHEAD_CACHE=cache, with `read_only` mounted read-only for it."""
    command = [sys.executable, "-m", "trt_lookahead.cli", *argv]
    if read_only is not None:
        command = ["unshare", "-rm", "sh", "-c", READ_ONLY, str(read_only), *command]
    env = {**os.environ, "TRT_LOOKAHEAD_CACHE": str(cache)}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, **popen)


def one_error(out: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a refused command (exit 2; stderr holds nothing else but our own notes)."""
    lines = [x for x in out.stderr.strip().splitlines() if not x.startswith("trt-lookahead: ")]
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


def _read_only_mounts() -> str | None:
    """Why read-only bind mounts cannot be made here (None: they can, and really stop writes)."""
    if shutil.which("unshare") is None:
        return "no unshare(1) to make a read-only bind mount"
    probe = Path(os.environ.get("TMPDIR", "/tmp"))
    out = subprocess.run(["unshare", "-rm", "sh", "-c", READ_ONLY, str(probe), "sh", "-c", 'touch "$0/.ro-probe"',
                          str(probe)], capture_output=True, text=True, timeout=30)
    (probe / ".ro-probe").unlink(missing_ok=True)
    if out.returncode == 0:
        return "a read-only bind mount did not stop a write"
    if "Read-only file system" not in out.stderr:
        return f"no private mount namespace here ({out.stderr.strip()})"
    return None


NO_READ_ONLY = _read_only_mounts()
needs_read_only = pytest.mark.skipif(NO_READ_ONLY is not None, reason=str(NO_READ_ONLY))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """A cache dir holding stories260K's standard cached engine (built by `generate`), and the text generated."""
    cache = tmp_path_factory.mktemp("built") / "cache"
    out = cli(GENERATE, cache)
    assert out.returncode == 0 and "building the engine" in out.stderr, out.stderr
    return cache, out.stdout


def engine_of(cache: Path) -> Path:
    (engine,) = [p for p in (cache / ENGINES).iterdir() if p.is_dir() and not p.name.startswith(".")]
    return engine


def copy_of(cache: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    return copy


# item 7 ---------------------------------------------------------------------------------------------------------


@pytest.mark.export
@needs_read_only
def test_a_read_only_cache_that_holds_the_engine_is_used_as_it_is(built, tmp_path):
    # issue 39 item 7: "--output <cache>/engines/pending cannot be created ... choose another --output"
    cache = copy_of(built[0], tmp_path)
    for lock in (cache / ENGINES).glob(".*.lock"):
        lock.unlink()  # a cache copied onto a read-only volume need not carry the lock files
    before = sorted(p.relative_to(cache) for p in cache.rglob("*"))
    out = cli(GENERATE, cache, read_only=cache)
    assert out.returncode == 0, out.stderr
    assert out.stdout == built[1] and "building" not in out.stderr
    assert sorted(p.relative_to(cache) for p in cache.rglob("*")) == before


@needs_read_only
def test_a_read_only_cache_without_the_engine_names_the_fix(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    line = one_error(cli(GENERATE, cache, read_only=cache))
    assert "read-only" in line and "TRT_LOOKAHEAD_CACHE" in line and "trt-lookahead build" in line, line
    assert "pending" not in line and "--output" not in line.split("trt-lookahead build")[0]
    assert list(cache.iterdir()) == []


# item 8 ---------------------------------------------------------------------------------------------------------


@pytest.mark.export
def test_a_file_where_the_cached_engine_belongs_is_rebuilt(built, tmp_path):
    # issue 39 item 8: NotADirectoryError; docs/engine-format.md says a damaged cached engine is rebuilt
    cache = copy_of(built[0], tmp_path)
    engine = engine_of(cache)
    shutil.rmtree(engine)
    engine.write_text("not an engine")
    out = cli(GENERATE, cache)
    assert out.returncode == 0 and "holds a file, not an engine dir" in out.stderr, out.stderr
    assert out.stdout == built[1]
    assert load_engine_config(engine).max_batch >= 1  # a whole engine dir again


@pytest.mark.export
def test_a_directory_where_the_cache_lock_belongs_is_one_error_line(built, tmp_path):
    # issue 39 item 8: IsADirectoryError
    cache = copy_of(built[0], tmp_path)
    engine = engine_of(cache)
    lock = engine.with_name(f".{engine.name}.lock")
    lock.unlink(missing_ok=True)
    lock.mkdir()
    out = cli(GENERATE, cache)  # a usable engine needs no lock
    assert out.returncode == 0 and out.stdout == built[1], out.stderr
    shutil.rmtree(engine)  # now a build is needed, and the lock with it
    line = one_error(cli(GENERATE, cache))
    assert str(lock) in line and "is a directory" in line and "remove it" in line, line


@pytest.mark.parametrize("where", ["under a file", "a directory", "another file"])
def test_tune_checks_its_tuning_file_before_measuring(capsys, tmp_path, where):
    # issue 39 item 8: FileExistsError/NotADirectoryError only after the whole measurement; and a file that is not
    # a tuning file (the checkpoint's config.json given by mistake) was measured for, then overwritten
    (tmp_path / "file").write_text("x")
    shutil.copy(STORIES / "config.json", tmp_path / "config.json")
    path = {"under a file": tmp_path / "file" / "tuning.json", "a directory": tmp_path,
            "another file": tmp_path / "config.json"}[where]
    code = main(["tune", "--model", str(STORIES), "--budget-seconds", "5", "--tuning-file", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: --tuning-file "), err  # no progress lines
    assert (tmp_path / "config.json").read_bytes() == (STORIES / "config.json").read_bytes()


@needs_read_only
def test_tune_on_a_read_only_directory_is_refused_before_measuring(tmp_path):
    place = tmp_path / "ro"
    place.mkdir()
    out = cli(["tune", "--model", str(STORIES), "--budget-seconds", "5", "--tuning-file", str(place / "t.json")],
              tmp_path / "cache", read_only=place)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr  # no model loaded, nothing measured
    assert "not writable" in one_error(out) and str(place) in out.stderr


def _memory_cgroup(tmp_path: Path, limit: int) -> Path | None:
    """A new memory cgroup limited to `limit` bytes (v2 or v1), or None where this process cannot make one."""
    for root, max_file in ((Path("/sys/fs/cgroup"), "memory.max"),
                           (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes")):
        if not (root / max_file).exists() and not (root / "cgroup.procs").exists():
            continue
        group = root / f"trt-lookahead-test-{os.getpid()}-{tmp_path.name}"
        try:
            group.mkdir()
            (group / max_file).write_text(str(limit))
        except OSError:
            if group.is_dir():
                group.rmdir()
            continue
        if (group / max_file).exists():
            return group
        group.rmdir()
    return None


def test_serve_beyond_the_memory_limit_is_refused_before_allocating(tmp_path):
    # issue 39 item 8: check_kv_memory compared with total RAM, so a container's limit gave torch's "can't
    # allocate" (or the OOM killer); a cgroup limit of 2 GiB, and KV for 6000 slots of 512 tokens needs about 4
    limit = 2 << 30
    group = _memory_cgroup(tmp_path, limit)
    if group is None:
        pytest.skip("cannot make a memory cgroup here (needs write access to /sys/fs/cgroup)")
    try:
        join = f'echo $$ > {group}/cgroup.procs && exec "$@"'
        out = subprocess.run(
            ["sh", "-c", join, "sh", sys.executable, "-m", "trt_lookahead.cli", "serve", "--model", str(STORIES),
             "--max-batch", "6000", "--port", "0"],
            capture_output=True, text=True, timeout=120, env={**os.environ, "TRT_LOOKAHEAD_CACHE": str(tmp_path)},
        )
        line = one_error(out)
        assert "max_batch" in line and "available" in line and "GiB" in line, line
        assert not (tmp_path / ENGINES).exists()  # refused before building the engine it could not run
        peak = group / ("memory.peak" if (group / "memory.peak").exists() else "memory.max_usage_in_bytes")
        if peak.exists():
            assert int(peak.read_text()) < limit // 2  # nothing near the KV cache's size was allocated
    finally:
        group.rmdir()


def _address_space(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_a_kv_cache_that_cannot_be_allocated_is_one_error_line(tmp_path):
    # a limit check_kv_memory cannot see (an address-space limit): torch's "can't allocate memory" RuntimeError
    # becomes the UserError naming max_batch; 20000 slots of stories260K's KV need 8 GB, the limit allows 6 GiB
    out = cli(["serve", "--model", str(STORIES), "--backend", "torch", "--max-batch", "20000", "--port", "0"],
              tmp_path, preexec_fn=_address_space(6 << 30))
    line = one_error(out)
    assert "cannot be allocated" in line and "max_batch" in line and "max_seq_len" in line, line


# item 10: the CLI's messages -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_served_model_name_is_refused(tmp_path, name):
    # issue 39 item 10: accepted (a server that would run until stopped: the time limit ends it if it starts)
    out = cli(["serve", "--model", str(STORIES), "--served-model-name", name, "--port", "0"], tmp_path, timeout=60)
    assert "--served-model-name is empty" in one_error(out)
    assert not (tmp_path / ENGINES).exists()  # before loading the model


def one_error_from_main(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if not x.startswith("trt-lookahead: ")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _break_a_reshape(graph: Path) -> None:
    """Make a Reshape's target shape wrong in a way that loads (shape inference cannot see it) but fails to run:
    one scalar of the Concat that builds it, one larger."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(graph), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    made = {out: node for node in model.graph.node for out in node.output}
    for node in model.graph.node:
        concat = made.get(node.input[1]) if node.op_type == "Reshape" else None
        if concat is None or concat.op_type != "Concat":
            continue
        for name in concat.input:
            if name in inits and numpy_helper.to_array(inits[name]).size == 1:
                value = numpy_helper.to_array(inits[name])
                if value.ravel()[0] > 1:
                    inits[name].CopyFrom(numpy_helper.from_array(value + 1, name))
                    onnx.save(model, str(graph))
                    return
    raise AssertionError("no Reshape built from a Concat with a constant dimension in the graph")


@pytest.mark.export
def test_a_damaged_engine_under_no_verify_prints_no_native_log(built, tmp_path):
    # issue 39 item 10: onnxruntime's native warnings and error log came before (here: with a traceback) the line
    engine = tmp_path / "engine"
    shutil.copytree(engine_of(built[0]), engine)
    _break_a_reshape(load_engine_config(engine, verify=False).graph)
    out = cli(["generate", "--engine", str(engine), "--prompt", "Once", "--max-new-tokens", "4", "--no-verify"],
              tmp_path / "cache")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr  # nothing but the error line
    assert "rebuild the engine" in one_error(out)


def test_a_checkpoint_without_tokenizer_json_names_it_before_building(tmp_path):
    # issue 39 item 10: "`tiktoken` is required", and only after building the engine
    model = tmp_path / "model"
    shutil.copytree(STORIES, model)
    (model / "tokenizer.json").unlink()
    cache = tmp_path / "cache"
    line = one_error(cli(["generate", "--model", str(model), "--prompt", "Once", "--max-new-tokens", "2"], cache))
    assert "no tokenizer.json" in line and "copy tokenizer.json" in line and "tiktoken" not in line, line
    assert not (cache / ENGINES).exists()  # said before any build


@pytest.mark.export
def test_a_truncated_engine_config_is_named_not_valid_json(capsys, built, tmp_path):
    # issue 39 item 10: "is not an engine dir (no engine config.json)"
    engine = tmp_path / "engine"
    shutil.copytree(engine_of(built[0]), engine)
    text = (engine / CONFIG_FILE).read_text()
    json.loads(text)
    (engine / CONFIG_FILE).write_text(text[: len(text) // 2])
    line = one_error_from_main(capsys, ["generate", "--engine", str(engine), "--prompt", "Once"])
    assert f"{engine / CONFIG_FILE} is not valid JSON" in line and "rebuild the engine" in line, line
