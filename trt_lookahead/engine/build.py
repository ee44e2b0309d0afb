"""`trt-lookahead build`: a Llama checkpoint -> an engine dir for steps of up to max_batch rows of at most
the built (W, N, G) (docs/design.md section 6.5).

    request = build_request(model, output, lookahead=LookaheadConfig(4, 3, 4), max_seq_len=1024, max_batch=8)
    summary = build(request)   # or None: the output already holds this build

The build happens in a temporary directory beside the output and is renamed into place only after
the graph passes onnx.checker and a smoke check under onnxruntime (batched prefill and steps of mixed rows)
matches the torch model run row by row; an interrupted build leaves nothing half-written, and a different
engine is never replaced without force. The engine dir's layout and names are engine/format.py's; the
graph comes from engine/export.py.
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
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from trt_lookahead.engine import tensorrt_plan
from trt_lookahead.engine.export import GRAPH_REVISION, OPSET, export_graph, plugin_contract
from trt_lookahead.engine.format import (
    ATTENTION_MODES,
    CONFIG_FILE,
    DEFAULT_BUILD_SEQ_LEN,
    DEFAULT_MAX_BATCH,
    DTYPES,
    FORMAT_VERSION,
    GRAPH_FILE,
    INPUTS,
    OUTPUTS,
    PLAN_FILE,
    TARGETS,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    EngineConfig,
    cache_names,
    file_checksums,
    is_engine_dir,
    load_engine_config,
    plan_command,
    write_engine_config,
)
from trt_lookahead.engine.initializers import save_graph, saved_initializers
from trt_lookahead.engine.quantize import (
    BLOCKS_REVISION,
    BlockNames,
    MinsTerm,
    QuantizedWeight,
    check_scheme,
    quantize_activations,
    quantize_graph,
    quantized_linear,
)
from trt_lookahead.errors import UserError, as_int
from trt_lookahead.files import check_output_dir, remove_stale_work_dirs, replace_dir, work_dir
from trt_lookahead.lookahead.config import DEFAULT, DEFAULT_LOOKAHEAD, LookaheadConfig
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.tree import DEFAULT_TREE, TreeTemplate, resolve_tree

if TYPE_CHECKING:
    from trt_lookahead.model.llama import Llama, ModelConfig, QuantizedLinear


@dataclass(frozen=True)
class BuildRequest:
    """A validated build: made by `build_request`, run by `build`."""

    model_dir: Path
    output: Path
    lookahead: LookaheadConfig
    max_seq_len: int
    max_input_len: int
    max_batch: int
    dtype: str
    attention: str
    target: str
    force: bool
    exact: bool = False  # the row-invariant attention graph on onnxruntime (docs/design.md section 4.2)
    tree: TreeTemplate | None = None  # the verification slots' draft tree (docs/design.md 2.7); None: linear
    weights: str = "float"  # the projections' weights: float, int8 or int4 blocks (engine/quantize.py)
    activations: str = "float"  # what quantized projections multiply: float, or int8 blocks (engine/quantize.py)

    def key(self, weights_sha256: str) -> dict[str, Any]:
        """What identifies a build: equal keys mean an existing engine dir already is this build."""
        return {
            "format": FORMAT_VERSION, "graph": GRAPH_REVISION, "weights_sha256": weights_sha256,
            "lookahead": str(self.lookahead), "max_seq_len": self.max_seq_len, "max_input_len": self.max_input_len,
            "max_batch": self.max_batch,
            "dtype": self.dtype, "attention": self.attention, "target": self.target, "exact": self.exact,
            "tree": None if self.tree is None else list(self.tree.parents), "weights": self.weights,
            "activations": self.activations, **({} if self.weights == "float" else {"blocks": BLOCKS_REVISION}),
        }


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress(done: int, steps: int, message: str) -> None:
    """One line per build step, led by a bar of the steps so far: `[##.....] 2/5 exporting ...`."""
    _log(f"[{'#' * (done * 10 // steps):.<10}] {done}/{steps} {message}")


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
    max_batch: int = DEFAULT_MAX_BATCH,
    dtype: str = "float32",
    attention: str = "plugin",
    target: str = "onnx",
    force: bool = False,
    exact: bool = False,
    tree: str | TreeTemplate | None = DEFAULT,
    check_output: bool = True,
    weights: str = "float",
    activations: str | None = None,
) -> BuildRequest:
    """Validate a build before any work (UserError with one clear line); `model` is a dir or a known name.

    check_output=False leaves `output` unchecked: the engine cache checks its own dir only when it must build.

    max_seq_len defaults to min(the model's context, DEFAULT_BUILD_SEQ_LEN); max_input_len to max_seq_len.
    """
    from trt_lookahead.model.checkpoint import check_max_seq_len, read_config
    from trt_lookahead.model.fetch import resolve_model

    dtype = _choice("dtype", str(dtype).lower(), DTYPES)
    attention, target = _choice("attention", attention, ATTENTION_MODES), _choice("target", target, TARGETS)
    output = check_output_dir(output, "--output") if check_output else Path(output)
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
    max_batch = as_int("max_batch", max_batch)
    if max_batch < 1:
        raise UserError(f"max_batch {max_batch} is impossible; an engine runs at least one row per step")
    weights, activations = check_scheme(weights, activations)
    if weights != "float" and (dtype != "float32" or target != "onnx"):
        raise UserError(f"--weights {weights} builds a float32 engine for onnxruntime's CPU kernels (MatMulNBits); "
                        "drop --dtype and --target tensorrt, or build with --weights float")
    if activations != "float":  # int8 codes magnify any rounding difference: only the row-invariant graph is exact
        exact = True
        _check_exact(model_dir, lookahead, dtype, attention, target,
                     f"--weights {weights} --activations {activations} (the default for quantized weights: an exact "
                     "graph)", "add --activations float (the fast graph, on MatMulNBits' slower float path)")
    elif exact:
        _check_exact(model_dir, lookahead, dtype, attention, target, "--exact", "drop --exact")
    # the default: the `auto` tree wherever the engine can verify one (docs/design.md 2.7)
    carries = lookahead.G and attention == "plugin"
    template = resolve_tree((DEFAULT_TREE if carries else None) if tree == DEFAULT else tree, lookahead)
    if template is not None:
        template = template.prefix(lookahead.G * lookahead.levels)  # the engine's slots: its first G(N-1) nodes
        if attention != "plugin":
            raise UserError("--tree cannot build this engine: its mask is the LookaheadAttention node's "
                            "(--attention plugin)")
    return BuildRequest(model_dir, output, lookahead, max_seq_len, max_input_len, max_batch, dtype, attention, target,
                        force, exact, template, weights, activations)


def _check_exact(model_dir: Path, lookahead: LookaheadConfig, dtype: str, attention: str, target: str,
                 asked: str, otherwise: str) -> None:
    """UserError naming why an exact engine, which `asked` builds, cannot be built, each reason with its fix, and
    `otherwise`, the way to a graph that is not exact (docs/design.md section 4.2)."""
    from trt_lookahead.kernels.onnx_op import EXACT_MAX_TOKENS
    from trt_lookahead.model.checkpoint import read_config

    cfg = read_config(model_dir)
    problems = [
        (dtype != "float32", f"it runs float32, not {dtype} (--dtype float32)"),
        (attention != "plugin", f"its attention is the LookaheadAttention node, not {attention} (--attention plugin)"),
        (target != "onnx", "it runs on onnxruntime; TensorRT has no exact step (--target onnx)"),
        (lookahead.step_tokens > EXACT_MAX_TOKENS,
         f"its steps hold at most {EXACT_MAX_TOKENS} tokens, and {lookahead} has T = {lookahead.step_tokens} (a "
         f"--lookahead_config with T <= {EXACT_MAX_TOKENS})"),
        (cfg.num_heads == cfg.num_kv_heads, "it needs grouped-query attention (query heads > KV heads), which this "
                                            "model has not"),
    ]
    broken = [why for bad, why in problems if bad]
    if broken:
        raise UserError(f"{asked} cannot build this engine: {'; '.join(broken)}; or {otherwise}")


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
    """SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt, so every exit path cleans up; a failure after one of
    them is the interruption too (safetensors' loader turns a KeyboardInterrupt raised inside it into a
    ValueError)."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return
    received: list[str] = []

    def interrupt(signum: int, _frame: Any) -> None:
        received.append(signal.Signals(signum).name)
        raise KeyboardInterrupt(received[-1])

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    except Exception as exc:
        if received:
            raise KeyboardInterrupt(received[0]) from exc
        raise
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
    from trt_lookahead.model.checkpoint import load_llama, load_llama_deferred, read_deferred

    start = time.perf_counter()
    lookahead = request.lookahead
    T = lookahead.step_tokens
    rows = request.max_seq_len + T
    steps = 6 if request.target == "tensorrt" else 5
    quantized = request.weights != "float"
    _progress(1, steps, f"loading {request.model_dir} ({request.dtype}"
              f"{', projections read as they are quantized' if quantized else ''})")
    if quantized:  # a projection is read from the checkpoint only when its blocks are made (design 6.5)
        model, _, deferred = load_llama_deferred(request.model_dir, DEFERRED_BYTES)
    else:
        (model, _), deferred = load_llama(request.model_dir, dtype=request.dtype), {}

    tokens = max(request.max_input_len, T)  # a row's most tokens: a prefill chunk or a step
    _progress(2, steps, f"exporting the network (attention={request.attention}): batch 1..{request.max_batch}, "
              f"1..{tokens} tokens per row ({lookahead}: T={T})")
    layout = StepLayout(lookahead)
    # weights: the model's own tensors, and the deferred projections' readers
    graph, weights = export_graph(model, request.attention, rows, tokens, request.tree, deferred)
    grids: dict[str, int] = {}  # quantized projections by where their blocks come from (QuantizedWeight.grid)
    if quantized:  # each float projection read, quantized and let go in turn
        reference = partial(quantize_like_graph, model, activations=request.activations)
        graph, used = quantize_graph(graph, request.weights, request.activations, weights, reference)
        grids = dict(Counter(blocks.grid for blocks in used.values()))
        projections = list(used)
        del used
        read_deferred(model, deferred)  # the smoke check runs the model: a projection left float is read now
        _log(f"      quantized projections by block source: {grids} (int8 / int4: quantized here; Q4_K, Q5_1, "
             "Q5_0+Q8_0, ...: the checkpoint's own GGUF blocks, kept)")
    save_graph(graph, out / GRAPH_FILE, weights)
    del graph, weights
    if quantized:  # the reference's blocks read from weights.bin from now on, as the smoke check's session reads them
        map_saved_blocks(model, projections, out / GRAPH_FILE)

    _progress(3, steps, "copying the tokenizer and checking the graph with onnx.checker")
    tokenizer_files = [name for name in TOKENIZER_FILES if (request.model_dir / name).is_file()]
    if not any(name in tokenizer_files for name in ("tokenizer.json", "tokenizer.model")):
        raise UserError(
            f"{request.model_dir} has no tokenizer (tokenizer.json); copy the model's tokenizer files into it"
        )
    for name in tokenizer_files:
        shutil.copyfile(request.model_dir / name, out / name)
    onnx.checker.check_model(str(out / GRAPH_FILE), full_check=False)

    engine = EngineConfig(
        path=out, lookahead=lookahead, step_tokens=T, max_batch=request.max_batch, max_seq_len=request.max_seq_len,
        max_input_len=request.max_input_len, cache_rows=rows, dtype=request.dtype, attention=request.attention,
        vocab_size=cfg.vocab_size, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        exact=request.exact, tree=request.tree, quantization=request.weights,
        activations=request.activations,
        raw={  # what config.json records beyond the typed fields
            "model": {"source": str(request.model_dir), "weights_sha256": weights_sha, **cfg.to_dict()},
            "eos_token_id": list(cfg.eos_token_ids),
            "output_slots": layout.output_slots.tolist(),
            "cache_layout": "[batch, num_kv_heads, cache_rows, head_dim] per layer; an executor keeps max_batch "
                            "slots and binds the first B",
            "weight_blocks": grids,
            "plugin": plugin_contract() if request.attention == "plugin" else None,
            "graphs": {"model": GRAPH_FILE},
            "weights": WEIGHTS_FILE,
            "inputs": [*INPUTS, f"key_cache_0..{cfg.num_layers - 1}", f"value_cache_0..{cfg.num_layers - 1}"],
            "outputs": list(OUTPUTS),
            "dims": {"batch": f"1..{request.max_batch}", "tokens": f"1..{tokens}",
                     "rows": "output rows per batch row"},
            "opset": OPSET,
            "tokenizer_files": tokenizer_files,
            "build_key": key,
            "built_with": {"trt_lookahead": __version__, "torch": torch.__version__, "onnx": onnx.__version__},
            "targets": {"onnx": {"built": True}},
        },
    )
    config = engine.to_raw()
    write_engine_config(out, config)

    _progress(4, steps, "smoke check under onnxruntime (batched rows) against the torch model row by row")
    config["targets"]["onnx"]["smoke_check"] = smoke_check(out, model, lookahead, strict=request.activations == "float")
    del model

    if request.target == "tensorrt":
        _progress(5, steps, "TensorRT plan")
        config["targets"]["tensorrt"] = tensorrt_target(out, request)
    config["files"] = file_checksums(out)
    _progress(steps, steps, "writing config.json")
    config["build_seconds"] = round(time.perf_counter() - start, 2)
    write_engine_config(out, config)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return {"seconds": time.perf_counter() - start, "size_mb": size / 2**20,
            "tensorrt_remaining": config["targets"].get("tensorrt", {}).get("remaining")}


def quantize_like_graph(model: Llama, name: str, blocks: QuantizedWeight, activations: str) -> None:
    """Make the torch model multiply the projection `name` (the graph's initializer name) as the quantized graph does
    (the smoke check's reference): a QuantizedLinear holding the graph's blocks (`quantized_linear`: no copy) takes
    the projection's place, so its float weight is let go, with int8 activations quantized before it; a tied lm_head
    so gets its own, the embedding staying the float one the graph's lookup reads. quantize_graph's `on_blocks`."""
    module = quantized_linear(blocks)
    if activations == "int8":
        module.register_forward_pre_hook(lambda _, args: (quantize_activations(args[0]), *args[1:]))
    model.set_submodule(_module_name(name), module)


def map_saved_blocks(model: Llama, projections: list[str], graph: Path) -> None:
    """Point the blocks of each `quantize_like_graph` projection (`projections`: the graph's weight names) at the saved
    graph's copy in its weights file, mapped (`saved_initializers`): the same numbers, in file pages the kernel can
    drop and reread, so the build's own copy is let go (docs/design.md 6.5)."""
    import torch

    saved = saved_initializers(graph)
    for name in projections:
        module = cast("QuantizedLinear", model.get_submodule(_module_name(name)))
        held = BlockNames.of(name, module.bits)
        arrays = {"codes": saved[held.codes], "scales": saved[held.scales], "zero_points": saved[held.zero_points]}
        if module.mins is not None:
            arrays["mins"] = saved[MinsTerm.of(held.codes).mins].T  # the graph holds them transposed
        for attr, array in arrays.items():
            setattr(module, attr, torch.from_numpy(array).reshape(getattr(module, attr).shape))


def _module_name(weight: str) -> str:
    """The model's module a graph weight's name is ('model.layers.0.attention.wo.weight' -> 'layers.0.attention.wo')."""
    return weight.removeprefix("model.").removesuffix(".weight")


# a quantized build reads a projection weight this large only when it quantizes it (load_llama_deferred): the
# exporter's optimizer reads the contents of initializers of up to 1024 elements (it merges equal ones), never of these
DEFERRED_BYTES = 16 * 1024
SMOKE_PROMPT_LENGTHS = (12, 7, 1)  # one batch row each: different cache lengths in every step
SMOKE_FLOOR = 0.5  # the least share of equal tokens of a graph checked not strictly (int8 activations)


def smoke_check(engine_dir: Path, model: Llama, lookahead: LookaheadConfig, strict: bool = True) -> dict[str, Any]:
    """Run the engine's graph under onnxruntime on batches of mixed rows and compare each row's next tokens
    with the torch model run on that row alone, with its own cache.

    A causal prefill of three prompts of different lengths in one batch (shorter ones padded), then two
    steps whose rows are the built config, a greedy row and a causal row, committing one token per row in
    between. Raises UserError on a mismatch (float32 and `strict`), or records the match rate (bfloat16 / float16,
    where rounding may differ; int8 activations, not `strict`, where a rounding-level difference upstream moves an
    activation's int8 code, so near ties flip, and a rate under SMOKE_FLOOR is a broken graph); a dtype
    onnxruntime's CPU kernels cannot run is recorded as not checked, with the reason.
    """
    import numpy as np
    import torch

    from trt_lookahead.backends.onnxruntime import OnnxRuntimeEngine, OnnxRuntimeUnsupported, SessionSettings

    try:
        engine = OnnxRuntimeEngine(load_engine_config(engine_dir, verify=False),  # checksums come last
                                   settings=SessionSettings(threads=1))
        session = engine.session()
    except OnnxRuntimeUnsupported as exc:
        _log(f"      not run: {exc}")
        return {"ran": False, "reason": str(exc)}
    config = engine.config
    T, L, vocab = config.step_tokens, config.num_layers, config.vocab_size
    B = len(SMOKE_PROMPT_LENGTHS)
    lengths = np.minimum(SMOKE_PROMPT_LENGTHS, max(1, config.max_seq_len - 2))  # room for the two steps
    P = int(lengths.max())
    steps = min(2, config.max_seq_len - P)
    # caches of the rows the check writes (a prompt, a token a step) and a step's: the graph's cache rows are
    # dynamic, and full ones (max_seq_len + T rows per layer and row) would be most of a large model's check
    S = min(config.cache_rows, P + steps + T)
    rng = np.random.default_rng(0)
    ours = np.zeros((2, L, B, config.num_kv_heads, S, config.head_dim), np.dtype(config.dtype))  # K, V
    theirs = [model.new_cache(S) for _ in range(B)]  # per row: its own [L, S, Hkv, D] K and V
    cache_len = np.zeros(B, np.int64)
    agree = total = 0

    def compare(ids, positions, step_config, masks, output_slots, real) -> None:
        """One batched graph run against the model per row; commits the first `real[b]` tokens of row b."""
        nonlocal agree, total
        feeds = {"input_ids": ids, "positions": positions, "cache_len": cache_len, "step_config": step_config,
                 "output_slots": output_slots}
        feeds = {name: np.asarray(value, np.int32) for name, value in feeds.items()}
        feeds |= dict(zip(cache_names(L), [*ours[0], *ours[1]], strict=True))
        next_ids, _, keys, values = session.run(None, feeds)
        for b in range(B):
            p, n = int(cache_len[b]), int(real[b])
            with torch.no_grad():
                logits = model(torch.as_tensor(ids[b]), torch.as_tensor(positions[b]), *theirs[b], torch.tensor(p),
                               torch.tensor(masks[b]), torch.as_tensor(output_slots[b]))
            agree += int((logits.argmax(-1).numpy() == next_ids[b]).sum())
            total += len(output_slots[b])
            ours[0, :, b, :, p : p + n] = keys[:, b, :, :n]
            ours[1, :, b, :, p : p + n] = values[:, b, :, :n]
        cache_len[:] += real

    compare(rng.integers(0, vocab, (B, P)), np.tile(np.arange(P), (B, 1)), np.zeros((B, 3)),
            [np.tril(np.ones((P, P), bool))] * B, (lengths - 1)[:, None], lengths)
    configs = (lookahead, LookaheadConfig.greedy())  # rows 0 and 1; row 2 is causal (0, 0, 0)
    layouts = [StepLayout(c, padded_tokens=T, tree=config.tree) for c in configs]
    step_config = np.array([(c.W, c.N, c.G) for c in configs] + [(0, 0, 0)])
    rel_positions = np.array([lay.rel_positions for lay in layouts] + [np.arange(T)])
    masks = [lay.mask for lay in layouts] + [np.tril(np.ones((T, T), bool))]
    slots = [lay.output_slots for lay in layouts] + [np.arange(T)]
    K = max(len(x) for x in slots)
    output_slots = np.array([np.pad(x, (0, K - len(x)), mode="edge") for x in slots])  # repeat the last slot
    for _ in range(steps):
        compare(rng.integers(0, vocab, (B, T)), cache_len[:, None] + rel_positions, step_config, masks,
                output_slots, np.ones(B, np.int64))
    result = {"ran": True, "tokens_compared": total, "tokens_equal": agree, "match_rate": round(agree / total, 4)}
    _log(f"      onnxruntime vs torch: {agree}/{total} next tokens equal")
    if model.dtype == torch.float32 and (agree != total if strict else agree < SMOKE_FLOOR * total):
        raise UserError(
            f"the exported graph disagrees with the torch model ({agree}/{total} tokens equal in float32); "
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
        f"It parses {GRAPH_FILE} with the LookaheadAttention plugin registered, builds the strongly typed "
        f"network with its optimisation profiles (prefill: one row of 1..{request.max_input_len} tokens; steps: "
        f"one per batch bucket up to {request.max_batch} rows and T of 1 or {request.lookahead.step_tokens}), "
        f"writes {PLAN_FILE} and records it in config.json."
    )
    _log("      " + remaining.splitlines()[0])
    return {"built": False, "reason": missing, "command": command, "remaining": remaining}
