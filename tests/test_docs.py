"""README.md and the docs/ interface pages against the code and CLI they describe, so that neither can drift.

Every name a page's table lists is read back from the code's own constants (or from a real engine dir), never
written out here; every `trt-lookahead` command line of README.md is checked against the real CLI's --help, and
the cheapest one runs as written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import typing
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent  # the venv's bin: where .ci/run's install puts `trt-lookahead`
README_MAX_LINES = 320
HELP_TIMEOUT_S = 120
RUN_TIMEOUT_S = 300
USER_PAGES = ("usage.md", "openai.md", "triton.md", "engine-format.md", "tuning-file.md")


# -- reading markdown -----------------------------------------------------------------------------------------


def fenced_blocks(text: str, languages: tuple[str, ...] = ("bash",)) -> list[str]:
    """The bodies of the fenced code blocks of these languages, in order."""
    pattern = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
    return [m.group(2) for m in pattern.finditer(text) if m.group(1) in languages]


def section(text: str, title: str) -> str:
    """The text under the `## title` heading, up to the next heading of level 2 or 1."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |^# |\Z)", text, re.S | re.M)
    assert match, f"README.md has no section '## {title}'"
    return match.group(1)


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table: its rows (header first, the |---| line dropped), each a list of stripped cells."""
    found: list[list[list[str]]] = []
    rows: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            found.append(rows)
            rows = []
    return found


def table(text: str, first_header: str) -> list[list[str]]:
    """The one table whose first header cell is `first_header`; its rows without the header."""
    matches = [t for t in tables(text) if t[0][0] == first_header]
    assert len(matches) == 1, f"expected one table headed {first_header!r}, found {len(matches)}"
    return matches[0][1:]


def names(cell: str) -> list[str]:
    """The backticked names of a cell (`a`, `b` -> [a, b])."""
    return re.findall(r"`([^`]+)`", cell)


# -- README.md ----------------------------------------------------------------------------------------------


def command_lines(text: str) -> list[str]:
    """Every shell command line of the bash blocks, continuation lines joined, comments and output dropped."""
    lines = []
    for block in fenced_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def cli_calls(text: str) -> list[list[str]]:
    """The argument vectors of every `trt-lookahead` (or `.venv/bin/trt-lookahead`) call in README.md's shell
    blocks and in the ExecStart= lines of its systemd unit."""
    calls = []
    units = [line.split("=", 1)[1] for block in fenced_blocks(text, ("ini",)) for line in block.splitlines()
             if line.startswith("ExecStart=")]
    for line in [*command_lines(text), *units]:
        for part in line.split("&&"):
            argv = shlex.split(part, comments=True)
            if argv and Path(argv[0]).name == "trt-lookahead":
                calls.append(argv)
    return calls


def option_groups(help_text: str) -> list[set[str]]:
    """The long options of a --help text, each option's aliases as one set (--max-batch, --max_batch)."""
    groups = []
    for line in help_text.splitlines():
        match = re.match(r"^ {2}(-\S.*?)(?: {2,}|$)", line)
        if match:
            group = set(re.findall(r"--[A-Za-z][\w-]*", match.group(1)))
            if group and group != {"--help"}:
                groups.append(group)
    return groups


@cache
def cli_help(subcommand: str) -> str:
    """`trt-lookahead <subcommand> --help` of the installed CLI, wide so that no option line wraps."""
    done = subprocess.run([str(BIN / "trt-lookahead"), subcommand, "--help"], capture_output=True, text=True,
                          timeout=HELP_TIMEOUT_S, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, f"trt-lookahead {subcommand} --help failed:\n{done.stderr}"
    return done.stdout


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it under {README_MAX_LINES}"


def test_quick_start_is_what_ci_runs():
    """The quick start's install line and test command are the ones .ci/run runs on a fresh clone."""
    quick = fenced_blocks(section(README.read_text(encoding="utf-8"), "Quick start"))
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    install, tests = quick[0].strip(), quick[1].strip()
    ci_install = install.split(" && .venv/bin/trt-lookahead ")[0]
    assert ci_install != install, "the quick start's first block should install, then run trt-lookahead"
    assert ci_install in ci, f".ci/run does not install as README.md says: {ci_install}"
    assert tests in ci, f".ci/run does not run README.md's test command: {tests}"


def test_readme_commands_parse():
    """Every trt-lookahead call in README.md and the docs/ pages for users names a real subcommand and only
    options that subcommand has (docs/results/ keeps old campaigns' commands as they were run)."""
    pages = [README, *(DOCS / name for name in USER_PAGES)]
    calls = [argv for page in pages for argv in cli_calls(page.read_text(encoding="utf-8"))]
    assert len(cli_calls(README.read_text(encoding="utf-8"))) >= 10, "README.md's commands were not found"
    wrong = []
    for argv in calls:
        subcommand = argv[1]
        known = set().union(*option_groups(cli_help(subcommand)))
        for arg in argv[2:]:
            flag = arg.split("=", 1)[0]
            if flag.startswith("--") and flag not in known:
                wrong.append(f"{shlex.join(argv)}: {flag} is not an option of `trt-lookahead {subcommand}`")
    assert not wrong, "\n".join(wrong)


def test_serve_flag_table_matches_serve_help():
    """README.md's serve flag table lists every option `serve --help` has, and nothing else."""
    rows = table(section(README.read_text(encoding="utf-8"), "OpenAI-compatible server"), "flag")
    listed = {name.split()[0] for row in rows for name in names(row[0])}
    groups = option_groups(cli_help("serve"))
    missing = [sorted(g) for g in groups if not g & listed]
    unknown = listed - set().union(*groups)
    assert not missing and not unknown, f"serve options not in the table: {missing}; not serve options: {unknown}"


def test_readme_python_examples_name_real_things():
    """README.md's Python blocks compile, and every name they import from trt_lookahead exists there."""
    import ast
    import importlib

    blocks = fenced_blocks(README.read_text(encoding="utf-8"), ("python",))
    assert blocks
    missing = []
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trt_lookahead"):
                module = importlib.import_module(node.module or "")
                missing += [f"{node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
    assert missing == []


def test_readme_scripts_exist():
    """Every `python scripts/X.py` README.md tells a user to run is in the repository."""
    scripts = re.findall(r"python (scripts/\S+\.py)", README.read_text(encoding="utf-8"))
    assert scripts
    assert [s for s in scripts if not (ROOT / s).is_file()] == []


def test_links_resolve():
    """Every relative link of README.md and docs/**/*.md points to a file or folder that exists."""
    broken = []
    for page in [README, *DOCS.rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """README.md's generate command on the stories260K fixture, run as written from the repository root with
    the venv first on PATH and a fresh cache (so it builds the model's engine, as a first use does)."""
    line = next(x for x in command_lines(README.read_text(encoding="utf-8"))
                if x.startswith("trt-lookahead generate") and "tests/fixtures/stories260K" in x)
    cache_dir = tmp_path_factory.mktemp("cache")
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "TRT_LOOKAHEAD_CACHE": str(cache_dir)}
    done = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    return done, cache_dir


@pytest.mark.export
def test_readme_generate_runs_as_written(readme_run):
    done, _ = readme_run
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "generate printed no text"
    assert "Traceback" not in done.stderr


# -- docs/openai.md ----------------------------------------------------------------------------------------


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _nested_models(arg)]


def _field_policy(model: type[BaseModel]) -> dict[str, str]:
    """field -> how the server treats it, as docs/openai.md's cells write it."""
    policy = {name: "used" for name in model.model_fields}
    policy.update({name: "ignored" for name in getattr(model, "IGNORED", ())})
    for name, allowed in getattr(model, "OFF_ONLY", {}).items():
        values = ", ".join(f"`{json.dumps(a)}`" for a in allowed if a is not None)
        policy[name] = "off only" + (f": {values}" if values else "")
    return policy


def openai_policies() -> dict[str, dict[str, str]]:
    """object -> field -> treatment, for both endpoints' request models and the objects nested in them."""
    from trt_lookahead.serving import openai_protocol

    objects: dict[str, dict[str, str]] = {}
    nested: dict[str, type[BaseModel]] = {}
    for model in (openai_protocol.CompletionRequest, openai_protocol.ChatRequest):
        objects[model.ENDPOINT] = _field_policy(model)
        for name, field in model.model_fields.items():
            for sub in _nested_models(field.annotation):
                nested.setdefault(name, sub)
    objects.update({name: _field_policy(model) for name, model in nested.items()})
    return objects


def test_openai_field_tables_match_the_protocol_module():
    documented: dict[str, dict[str, str]] = {}
    for rows in tables((DOCS / "openai.md").read_text(encoding="utf-8")):
        header, body = rows[0], rows[1:]
        if header[0] != "field":
            continue
        for column, obj in enumerate(header[1:-1], start=1):
            documented[obj] = {names(row[0])[0]: row[column] for row in body if row[column] != "refused"}
    code = openai_policies()
    assert documented.keys() == code.keys()
    for obj, fields in code.items():
        assert documented[obj] == fields, f"docs/openai.md's `{obj}` column differs from openai_protocol.py"


# -- docs/triton.md -----------------------------------------------------------------------------------------


def test_triton_tables_match_the_schema():
    from trt_lookahead.serving import schema

    text = (DOCS / "triton.md").read_text(encoding="utf-8")
    for header, fields in (("input", schema.INPUTS), ("output", schema.OUTPUTS)):
        documented = [(names(r[0])[0], names(r[1])[0], r[2]) for r in table(text, header)]
        code = [(f.name, f.triton_type, "[" + ", ".join(str(d) for d in f.dims) + "]") for f in fields]
        assert documented == code, f"docs/triton.md's {header} table differs from serving/schema.py"


# -- docs/engine-format.md ---------------------------------------------------------------------------------


def test_engine_page_matches_the_format_module():
    from trt_lookahead.engine import format as engine_format

    text = (DOCS / "engine-format.md").read_text(encoding="utf-8")
    assert f"engine format version {engine_format.FORMAT_VERSION}" in text
    graph = {n for row in table(text, "name") for n in names(row[0])}
    caches = {re.sub(r"0$", "<l>", n) for n in engine_format.cache_names(1)}
    assert graph == {*engine_format.INPUTS, *engine_format.OUTPUTS, *caches}
    files = {n for row in table(text, "file") for n in names(row[0])}
    assert {engine_format.CONFIG_FILE, *engine_format.TOKENIZER_FILES} <= files


@pytest.mark.export
def test_engine_page_lists_a_real_engines_files_and_keys(readme_run):
    """The engine README.md's generate command built: its config.json keys and files are the page's."""
    from trt_lookahead.engine import format as engine_format

    done, cache_dir = readme_run
    assert done.returncode == 0, done.stderr
    (config,) = cache_dir.glob(f"engines/*/{engine_format.CONFIG_FILE}")
    text = (DOCS / "engine-format.md").read_text(encoding="utf-8")
    keys = {n for row in table(text, "field") for n in names(row[0])}
    assert keys == set(json.loads(config.read_text(encoding="utf-8")))
    files = {n for row in table(text, "file") for n in names(row[0])}
    assert {p.name for p in config.parent.iterdir()} <= files


# -- docs/tuning-file.md -----------------------------------------------------------------------------------


def tuning_code() -> tuple[ModuleType, type]:
    """Where the tuning file is defined: the module with TUNING_FILE, TUNING_VERSION and tuning_key, and the
    class whose to_entry() writes an entry. The one place to change if they move."""
    from trt_lookahead.runtime import tuning_file
    from trt_lookahead.tuning import tune

    return tuning_file, tune.TuneReport


def test_tuning_page_matches_the_tuning_file_module():
    module, report = tuning_code()
    text = (DOCS / "tuning-file.md").read_text(encoding="utf-8")
    assert f"`{module.TUNING_FILE}`" in text
    assert f'{{"version": {module.TUNING_VERSION}, "entries"' in text
    key = module.tuning_key("m", "float32", "onnxruntime", "cpu", tree="-1,0")
    (documented,) = re.findall(r"^KEY = (.*)$", text, re.M)
    assert [p.split("=")[0] for p in key.split("|")] == re.findall(r"(?:^|\|)(\w+)=", documented)
    required = {f.name: None for f in dataclasses.fields(report)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    entry_keys = set(report(**required).to_entry())
    assert {n for row in table(text, "field") for n in names(row[0])} == entry_keys
