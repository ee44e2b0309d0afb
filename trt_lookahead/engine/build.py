"""`trt-lookahead build`: a Llama checkpoint -> an engine dir at fixed (W, N, G) (docs/design.md section 6.5).

    request = build_request(model, output, lookahead=LookaheadConfig(4, 3, 4), max_seq_len=1024)
    summary = build(request)   # or None: the output already holds this build

The build happens in a temporary directory beside the output and is renamed into place only after
the graphs pass onnx.checker and a smoke step under onnxruntime matches the torch executor; an
interrupted build leaves nothing half-written, and a different engine is never replaced without force.
The engine dir's layout and names are engine/format.py's; the graphs come from engine/export.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trt_lookahead.engine import tensorrt_plan
from trt_lookahead.engine.export import OPSET, export_graph, fix_tokens, plugin_contract, save_graphs
from trt_lookahead.engine.format import (
    ATTENTION_MODES,
    CONFIG_FILE,
    DEFAULT_BUILD_SEQ_LEN,
    DTYPES,
    FORMAT_KEY,
    FORMAT_VERSION,
    INPUTS,
    OUTPUTS,
    PLAN_FILE,
    PREFILL_GRAPH,
    STEP_GRAPH,
    TARGETS,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    file_checksums,
    is_engine_dir,
    plan_command,
    write_engine_config,
)
from trt_lookahead.errors import UserError, as_int
from trt_lookahead.files import check_output_dir, remove_stale_work_dirs, replace_dir, work_dir
from trt_lookahead.lookahead.config import DEFAULT_LOOKAHEAD, LookaheadConfig
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams

if TYPE_CHECKING:
    from trt_lookahead.model.llama import Llama, ModelConfig


@dataclass(frozen=True)
class BuildRequest:
    """A validated build: made by `build_request`, run by `build`."""

    model_dir: Path
    output: Path
    lookahead: LookaheadConfig
    max_seq_len: int
    max_input_len: int
    dtype: str
    attention: str
    target: str
    force: bool

    def key(self, weights_sha256: str) -> dict[str, Any]:
        """What identifies a build: equal keys mean an existing engine dir already is this build."""
        return {
            "format": FORMAT_VERSION, "weights_sha256": weights_sha256, "lookahead": str(self.lookahead),
            "max_seq_len": self.max_seq_len, "max_input_len": self.max_input_len, "dtype": self.dtype,
            "attention": self.attention, "target": self.target,
        }


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _choice(what: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise UserError(f"unknown {what} {value!r}; use one of {', '.join(allowed)}")
    return value


def build_request(
    model: str | os.PathLike,
    output: str | os.PathLike,
    *,
    lookahead: LookaheadConfig = DEFAULT_LOOKAHEAD,
    max_seq_len: int | None = None,
    max_input_len: int | None = None,
    dtype: str = "float32",
    attention: str = "plugin",
    target: str = "onnx",
    force: bool = False,
) -> BuildRequest:
    """Validate a build before any work (UserError with one clear line); `model` is a dir or a known name.

    max_seq_len defaults to min(the model's context, DEFAULT_BUILD_SEQ_LEN); max_input_len to max_seq_len.
    """
    from trt_lookahead.model.checkpoint import check_max_seq_len, read_config
    from trt_lookahead.model.fetch import resolve_model

    dtype = _choice("dtype", str(dtype).lower(), DTYPES)
    attention, target = _choice("attention", attention, ATTENTION_MODES), _choice("target", target, TARGETS)
    output = check_output_dir(output, "--output")
    model_dir = resolve_model(model)
    context = read_config(model_dir).max_position_embeddings
    max_seq_len = check_max_seq_len(max_seq_len, context, DEFAULT_BUILD_SEQ_LEN)
    max_input_len = max_seq_len if max_input_len is None else as_int("max_input_len", max_input_len)
    if max_input_len < 1:
        raise UserError(f"max_input_len {max_input_len} is impossible; a prompt has at least one token")
    if max_seq_len < max_input_len:
        raise UserError(
            f"max_seq_len {max_seq_len} is below the prompt limit max_input_len {max_input_len}; "
            "max_seq_len counts the prompt plus the generated tokens, so give max_seq_len >= max_input_len"
        )
    return BuildRequest(model_dir, output, lookahead, max_seq_len, max_input_len, dtype, attention, target, force)


def _existing_build(output: Path) -> dict | None:
    try:
        return json.loads((output / CONFIG_FILE).read_text(encoding="utf-8")).get("build_key")
    except (OSError, ValueError, AttributeError):
        return None


def _check_replaceable(output: Path, key: dict[str, Any], force: bool) -> bool:
    """Whether `output` already is this build (nothing to do); UserError unless it may be (re)placed.

    Only an empty dir or an engine dir (the marker in its config.json) is ever replaced, and a different
    engine only with force: anything else is refused, naming what is there, whatever the flags.
    """
    if not output.exists():
        return False
    entries = sorted(p.name for p in output.iterdir())
    if entries and not is_engine_dir(output):
        shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
        raise UserError(
            f"{output} already exists and is not an engine dir (it holds {shown}); build only replaces engine "
            "dirs, even with --force: choose another --output"
        )
    if entries and _existing_build(output) == key:
        return True
    if entries and not force:
        raise UserError(
            f"{output} already exists and holds a different engine; pass --force to replace it or choose another "
            "--output"
        )
    return False


@contextlib.contextmanager
def _interrupted_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt (as SIGINT does), so every exit path cleans up."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def build(request: BuildRequest) -> dict[str, Any] | None:
    """Build the engine dir; returns a summary (seconds, size_mb, tensorrt_remaining), or None when the
    output already holds this very build. Refuses (UserError) to replace anything but an engine dir, and
    a different engine without force. The build is written beside the output and renamed into place; it
    is removed on every failure, SIGINT, SIGTERM and SIGHUP included (a SIGKILLed one on the next build)."""
    from trt_lookahead.model.checkpoint import read_config, weights_sha256

    cfg = read_config(request.model_dir)
    weights_sha = weights_sha256(request.model_dir)
    key = request.key(weights_sha)
    output = request.output.absolute()
    remove_stale_work_dirs(output)
    if _check_replaceable(output, key, request.force):
        _log(f"{request.output} already holds this engine (same model, config and targets); nothing to do")
        return None
    output.parent.mkdir(parents=True, exist_ok=True)
    work = work_dir(output)
    with _interrupted_by_signals():
        try:
            work.mkdir()
            summary = _build_engine_dir(request, cfg, weights_sha, key, work)
            replace_dir(work, output)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    _log(f"engine dir ready: {request.output} ({summary['size_mb']:.1f} MB, built in {summary['seconds']:.1f} s)")
    return summary


def _build_engine_dir(request: BuildRequest, cfg: ModelConfig, weights_sha: str, key: dict, out: Path) -> dict:
    """Write and check every file of the engine dir into `out`; returns a summary for the log."""
    import onnx
    import torch

    from trt_lookahead import __version__
    from trt_lookahead.model.checkpoint import load_llama

    start = time.perf_counter()
    lookahead = request.lookahead
    T = lookahead.step_tokens
    rows = request.max_seq_len + T
    steps = 6 if request.target == "tensorrt" else 5
    _log(f"[1/{steps}] loading {request.model_dir} ({request.dtype})")
    model, _ = load_llama(request.model_dir, dtype=request.dtype)

    _log(f"[2/{steps}] exporting the network (attention={request.attention}): prefill graph with "
         f"1..{request.max_input_len} tokens, step graph pinned at T={T} ({lookahead})")
    layout = StepLayout(lookahead)
    prefill = export_graph(model, request.attention, rows, max(request.max_input_len, T))
    save_graphs({STEP_GRAPH: fix_tokens(prefill, T), PREFILL_GRAPH: prefill}, out)
    del prefill

    _log(f"[3/{steps}] copying the tokenizer and checking the graphs with onnx.checker")
    tokenizer_files = [name for name in TOKENIZER_FILES if (request.model_dir / name).is_file()]
    if not any(name in tokenizer_files for name in ("tokenizer.json", "tokenizer.model")):
        raise UserError(
            f"{request.model_dir} has no tokenizer (tokenizer.json); copy the model's tokenizer files into it"
        )
    for name in tokenizer_files:
        shutil.copyfile(request.model_dir / name, out / name)
    for name in (STEP_GRAPH, PREFILL_GRAPH):
        onnx.checker.check_model(str(out / name), full_check=False)

    config = {
        FORMAT_KEY: FORMAT_VERSION,
        "model": {"source": str(request.model_dir), "weights_sha256": weights_sha, **cfg.to_dict()},
        "eos_token_id": list(cfg.eos_token_ids),
        "dtype": request.dtype,
        "max_seq_len": request.max_seq_len,
        "max_input_len": request.max_input_len,
        "lookahead": {"W": lookahead.W, "N": lookahead.N, "G": lookahead.G},
        "step_tokens": T,
        "output_slots": layout.output_slots.tolist(),
        "cache_rows": rows,
        "cache_layout": "[num_kv_heads, cache_rows, head_dim] per layer",
        "attention": request.attention,
        "plugin": plugin_contract() if request.attention == "plugin" else None,
        "graphs": {"step": STEP_GRAPH, "prefill": PREFILL_GRAPH},
        "weights": WEIGHTS_FILE,
        "inputs": [*INPUTS, f"key_cache_0..{cfg.num_layers - 1}", f"value_cache_0..{cfg.num_layers - 1}"],
        "outputs": list(OUTPUTS),
        "opset": OPSET,
        "tokenizer_files": tokenizer_files,
        "build_key": key,
        "built_with": {"trt_lookahead": __version__, "torch": torch.__version__, "onnx": onnx.__version__},
        "targets": {"onnx": {"built": True}},
    }
    write_engine_config(out, config)

    _log(f"[4/{steps}] smoke step under onnxruntime against the torch executor")
    config["targets"]["onnx"]["smoke_check"] = smoke_check(out, model, lookahead, request.max_seq_len)
    del model

    if request.target == "tensorrt":
        _log(f"[5/{steps}] TensorRT plan")
        config["targets"]["tensorrt"] = tensorrt_target(out, request)
    config["files"] = file_checksums(out)
    _log(f"[{steps}/{steps}] writing config.json")
    config["build_seconds"] = round(time.perf_counter() - start, 2)
    write_engine_config(out, config)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return {"seconds": time.perf_counter() - start, "size_mb": size / 2**20,
            "tensorrt_remaining": config["targets"].get("tensorrt", {}).get("remaining")}


SMOKE_PROMPT_TOKENS = 12


def smoke_check(engine_dir: Path, model: Llama, lookahead: LookaheadConfig, max_seq_len: int) -> dict[str, Any]:
    """Prefill + two steps under onnxruntime and under the torch executor; the tokens must agree.

    Returns what was compared. Raises UserError on a mismatch (float32), or records the match rate
    (bfloat16 / float16, where rounding may differ); a dtype onnxruntime's CPU kernels cannot run is
    recorded as not checked, with the reason.
    """
    import numpy as np
    import torch

    from trt_lookahead.backends.onnxruntime import OnnxRuntimeUnsupported
    from trt_lookahead.backends.open import open_engine
    from trt_lookahead.backends.torch import TorchExecutor

    layout = StepLayout(lookahead)
    rng = np.random.default_rng(0)
    vocab = model.cfg.vocab_size
    prompt = rng.integers(0, vocab, min(SMOKE_PROMPT_TOKENS, max_seq_len - 1))
    try:
        engine = open_engine(engine_dir, backend="onnxruntime", threads=1, verify=False)  # checksums come last
        ours = engine.make_executor(layout)
    except OnnxRuntimeUnsupported as exc:
        _log(f"      not run: {exc}")
        return {"ran": False, "reason": str(exc)}
    theirs = TorchExecutor(model, layout.mask, max_seq_len, output_slots=layout.output_slots)
    slots = layout.output_slots
    agree = total = 0
    for ex in (ours, theirs):
        ex.reset(SamplingParams())
    first = (ours.prefill(prompt), theirs.prefill(prompt))
    agree, total = int(first[0] == first[1]), 1
    x = first[1]
    for _ in range(2):
        ids = rng.integers(0, vocab, layout.step_tokens)
        ids[0] = x
        positions = len(prompt) + layout.rel_positions
        a, b = ours.step(ids, positions), theirs.step(ids, positions)
        agree += int((a[slots] == b[slots]).sum())
        total += len(slots)
        ours.commit(np.array([0]))
        theirs.commit(np.array([0]))
        prompt = np.append(prompt, x)
        x = b[0]
    result = {"ran": True, "tokens_compared": total, "tokens_equal": agree, "match_rate": round(agree / total, 4)}
    _log(f"      onnxruntime vs torch: {agree}/{total} next tokens equal")
    if model.dtype == torch.float32 and agree != total:
        raise UserError(
            f"the exported graphs disagree with the torch model ({agree}/{total} tokens equal in float32); "
            "this is a bug in the export: please report it with the model and the build command"
        )
    return result


def tensorrt_target(out: Path, request: BuildRequest) -> dict[str, Any]:
    """Build engine.plan where TensorRT and a GPU exist; else record exactly what remains to run."""
    from trt_lookahead.backends.devices import tensorrt_unavailable_reason

    missing = tensorrt_unavailable_reason()
    if missing is None:
        return tensorrt_plan.build_plan(out, verify=False)  # the entry as the plan build records it (version, profiles)
    final = request.output
    command = plan_command(final)
    remaining = (
        f"TensorRT plan not built here ({missing}). Everything else is in {final}. "
        f"On a GPU host with TensorRT >= 10.9 and triton installed, run:\n    {command}\n"
        f"It parses {PREFILL_GRAPH} with the LookaheadAttention plugin registered, builds the strongly typed "
        f"network with its optimisation profiles (prefill 1..{request.max_input_len} tokens, step "
        f"T={request.lookahead.step_tokens}, single token), writes {PLAN_FILE} and records it in config.json."
    )
    _log("      " + remaining.splitlines()[0])
    return {"built": False, "reason": missing, "command": command, "remaining": remaining}
