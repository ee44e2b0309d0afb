"""Profile the executor's step against the memory limit: ms per step, limit, kernels per layer by category.

    python scripts/profile_step.py --out DIR [--device cpu|cuda] [--shape tiny|llama-1b|llama-7b]
                                   [--dtype float32|bfloat16] [--weights float|int8|int4] [--budget-seconds S]
                                   [--iters N] [--cache-len 512] [--max-seq-len 1024] [--threads 1]

The first lent GPU must run, from the repository root (nothing to install; the package is imported from this
checkout, as scripts/gpu_check.py does):

    python scripts/profile_step.py --out docs/gpu/<date>-<gpu>/profile_7b --device cuda --shape llama-7b
    python scripts/profile_step.py --out docs/gpu/<date>-<gpu>/profile_1b --device cuda --shape llama-1b

and issue 44's int4 step is the first with `--weights int4`: every projection and the lm_head hold random int4
blocks of 32 (`random_blocks`), the step runs the executor's quantized product (on a GPU of compute capability
9.0+ in bfloat16 kernels/quantized_words.py's, the executor holding them in QuantizedLinear's words layout; else
kernels/invariant.py's), and the limit counts the bytes as the executor holds them.

Per variant x T in STEP_TOKENS x batch in BATCHES, one cell of profile_step.json:
    fast           BatchedTorchExecutor(exact=False): the padded step (CUDA graph on a GPU, eager on the CPU);
                   its attention is SDPA (PaddedAttention)
    fast_compiled  the same step compiled (torch.compile), once the executor takes COMPILE_PARAMETER;
                   "not available" until then
    fast_triton    the fast step with attention="triton": its Triton attention kernel reads only each slot's keys
                   (CUDA only; "skipped" with the reason on the CPU, where it would time the interpreter)
    fast_compiled_triton  both: the compiled step around the Triton attention (CUDA only)
    exact          exact=True: the padded step on kernels/invariant.py's row-invariant Triton kernels on a GPU; on
                   the CPU the packed exact step (the padded one runs interpreted Triton there, seconds a step)
    sdpa           "not available": variant fast is the SDPA step (the executor's default attention="sdpa")
Then `seq_len`: the same context (cache_len SEQ_LEN_CACHE tokens) read by the fast steps (SEQ_LEN_VARIANTS) at
two max_seq_len (SEQ_LEN_PAIRS: 8192 and 512 on CUDA, where the issue's goal is step times within 5%; small ones
on the CPU, its plumbing), B = 1, T in SEQ_LEN_STEP_TOKENS: ms at each and their ratio.
Each cell: ms per step (CUDA events around the bucket's CUDA-graph replay on a GPU, plus the wall time of the
whole `step` call; perf_counter medians on the CPU), the limit = (weight bytes + KV bytes of cache_len + T rows)
/ the bandwidth measured by a large device copy on the same device, ms / limit, graph breaks and compile seconds
(null until compiled), and kernels per layer by category (CATEGORIES) from torch.profiler: one eager step,
each kernel (GPU) or kernel-launching leaf op (CPU) classified by RULES from its op or kernel name and the
Python function that called torch (`classify`), counted inside the model's layers / per layer and outside them.
The peer: HF transformers' LlamaForCausalLM of the same shape with a static cache (`torch.compile` on CUDA,
eager on the CPU), ms per forward of T new tokens (causal) after cache_len tokens.

The JSON is rewritten after every cell, so a run cut short keeps what it measured; a cell or section that the
--budget-seconds would not cover is "skipped" with the reason. On the CPU only the tiny shape runs (the padded
step's plumbing and its kernel counts).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import os
import re
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the package from this checkout, installed or not (as gpu_check.py)
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402  the shapes, random Llamas, step configs, timing and JSON writing of the GPU check

REPORT = "profile_step.json"
SCHEMA = 1
SHAPES = cast(dict[str, dict[str, Any]], {"tiny": gpu_check.SMALL_GQA, **gpu_check.SHAPES})
STEP_TOKENS = (1, 16, 56, 120)
CONFIGS = {1: "1,2,0", 16: "4,3,4", 56: "7,5,7", 120: "15,5,15"}  # the W,N,G layout of each T = (W + G)(N - 1)
BATCHES = gpu_check.BATCHES
VARIANTS = ("fast", "fast_compiled", "fast_triton", "fast_compiled_triton", "exact", "sdpa")
TRITON_ATTENTION = "triton"  # the executor's `attention` choice of the *_triton variants (default "sdpa")
COMPILED_VARIANTS = ("fast_compiled", "fast_compiled_triton")
TRITON_VARIANTS = ("fast_triton", "fast_compiled_triton")
# the same context at a long and a short max_seq_len (the fast step must read the context, not max_seq_len)
SEQ_LEN_VARIANTS = ("fast", "fast_triton")
SEQ_LEN_PAIRS = {"cuda": (8192, 512), "cpu": (256, 64)}
SEQ_LEN_CACHE = {"cuda": 384, "cpu": 32}
SEQ_LEN_STEP_TOKENS = (1, 16)
SEQ_LEN_GOAL = 1.05  # the goal: the long max_seq_len's step within 5% of the short one's
COMPILE_PARAMETER = "compile"  # the BatchedTorchExecutor argument that would turn the compiled step on
DEFAULTS = {  # per device: dtype, budget (s), timed iterations, warm-up iterations
    "cuda": {"dtype": "bfloat16", "budget": 330.0, "iters": 20, "warmup": 3},
    "cpu": {"dtype": "float32", "budget": 60.0, "iters": 3, "warmup": 0},  # the first step warms up
}
HF_COMPILE_GUESS_S = 90.0  # what the first compiled HF forward is assumed to take before one was measured
SCOPE, LAYER = "scope:", "profile_step.layer"  # profiler annotations: the Python caller of a torch call; a layer

CATEGORIES = ("GEMM", "attention", "norm", "RoPE", "KV write", "copy/cast", "elementwise", "fused", "argmax", "other")
# (category, name pattern, scope pattern): the first rule whose patterns both match (None: anything) classifies a
# kernel; name = the outermost aten op that launched it, or the kernel's own name when no op did (Triton);
# scope = the qualified name of the Python function that called torch (everything an attention seam or a norm
# calls, its casts and layout copies included, counts as that)
RULES: tuple[tuple[str, str | None, str | None], ...] = (
    ("fused", r"triton_(poi|red|per|tem)_fused", None),  # inductor's generated kernels
    ("attention", r"scaled_dot_product|flash|fmha|_padded_attention_kernel|_combine_kernel|lookahead_attention"
                  r"|softmax", None),
    ("attention", None, r"(^|\.)(attend|sdpa_attention\w*|static_attention_mask|padded_attention|key_rows"
                        r"|eager_attention_forward)$|^(PaddedAttention|RowAttention|BlockedAttention)\."
                        r"|^invariant_attention\."),
    ("GEMM", r"aten::(mm|addmm|bmm|baddbmm|matmul|_?mkldnn\w*|_mkl\w*|_weight_int\w*)$|^\w+::\w*linear|gemm"
             r"|gemv|cutlass|cublas|xmma|nvjet|_linear_kernel|_quantized_kernel|_span_sum_kernel", None),
    ("norm", r"rms_norm|layer_norm|aten::rsqrt$", None),
    ("norm", None, r"(^|\.)(RMSNorm\.forward|LlamaRMSNorm\.forward|rms_norm)$"),
    ("RoPE", r"(?<![a-z])rope|rotary", None),
    ("RoPE", None, r"(^|\.)(apply_rope|rope|apply_rotary_pos_emb|rotate_half|LlamaRotaryEmbedding\.forward)$"),
    ("KV write", r"index_copy|index_put|scatter", None),
    ("argmax", r"argmax|argmin|topk|aten::max$|aten::sort$", None),
    ("argmax", None, r"(^|\.)(select_rows_torch|first_max_ids|top_k_ids)$"),
    ("copy/cast", r"copy|aten::to$|clone|contiguous|aten::cat$|index_select|gather|embedding|aten::roll$|fill_"
                  r"|zero_|aten::(zeros|ones|full)$|[Mm]emcpy|[Mm]emset|CatArray", None),
    ("elementwise", r"^aten::|elementwise|reduce_kernel|vectorized|unrolled|triton_", None),
)
# aten ops that launch no kernel of their own (views, metadata, allocation, no-op conversions)
NO_KERNEL = re.compile(
    r"aten::(view|_unsafe_view|reshape|_reshape_alias|as_strided|transpose|t|permute|expand|expand_as|unsqueeze"
    r"|squeeze|slice|select|split|split_with_sizes|narrow|detach|detach_|alias|empty|empty_like|empty_strided"
    r"|new_empty|new_empty_strided|resize_|lift_fresh|unbind|chunk|flatten|unflatten|resolve_conj|resolve_neg"
    r"|item|_local_scalar_dense|result_type|to|contiguous|is_nonzero|numpy_T|dim|size|stride|view_as"
    r"|set_|_has_compatible_shallow_copy_type|is_same_size|broadcast_tensors|align_as|type_as)$"
)
OP_NAME = re.compile(r"\w+::\w")
_COMPILED_RULES = tuple((category, None if name is None else re.compile(name), None if scope is None else
                         re.compile(scope)) for category, name, scope in RULES)

Emit = Callable[[], None]


def is_op(event: Any) -> bool:
    """A dispatcher op's profiler event (aten::mm, mkldnn::_linear_pointwise), not an annotation or a kernel."""
    return OP_NAME.match(event.name) is not None and not event.name.startswith("profiler::")


def classify(name: str, scope: str = "") -> str:
    """The category (CATEGORIES) of a kernel launched by op or kernel `name`, called from Python function `scope`."""
    for category, name_re, scope_re in _COMPILED_RULES:
        if (name_re is None or name_re.search(name)) and (scope_re is None or scope_re.search(scope)):
            return category
    return "other"


# -- arguments ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="profile_step.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for profile_step.json")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--shape", choices=tuple(SHAPES), help="model shape (default: llama-7b on cuda, tiny on cpu)")
    parser.add_argument("--budget-seconds", type=float, help="wall-clock budget (default: 330 on cuda, 60 on cpu)")
    parser.add_argument("--iters", type=int, help="timed steps per cell (default: 20 on cuda, 3 on cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="model dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--weights", choices=("float", "int8", "int4"), default="float",
                        help="the projections' weights: the model's dtype, or random blocks of 32 (a QuantizedLinear "
                             "each, kernels/invariant.py's product; CUDA only): issue 44's int4 step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1)")
    parser.add_argument("--cache-len", type=int, default=gpu_check.CACHED_TOKENS, help="cached tokens before the step")
    parser.add_argument("--max-seq-len", type=int, default=gpu_check.CACHE_ROOM,
                        help="the executor's max_seq_len (its padded step holds max_seq_len + T rows a slot)")
    args = parser.parse_args(argv)
    defaults = DEFAULTS[args.device]
    args.shape = args.shape or ("llama-7b" if args.device == "cuda" else "tiny")
    args.budget_seconds = defaults["budget"] if args.budget_seconds is None else args.budget_seconds
    args.iters = defaults["iters"] if args.iters is None else args.iters
    args.warmup, args.dtype = defaults["warmup"], args.dtype or defaults["dtype"]
    if args.budget_seconds <= 0:
        parser.error(f"--budget-seconds must be positive, got {args.budget_seconds:g}")
    if not 1 <= args.cache_len <= args.max_seq_len:
        parser.error(f"--cache-len must be in 1 .. --max-seq-len ({args.max_seq_len}), got {args.cache_len}")
    for name in ("iters", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.weights != "float" and args.device != "cuda":
        parser.error(f"--weights {args.weights} profiles the GPU's quantized product; use --device cuda")
    if args.device == "cpu" and args.shape != "tiny":
        parser.error(f"--shape {args.shape} on the CPU would take minutes a step; use --shape tiny on the CPU "
                     "or --device cuda")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file; give a folder")
    return args


# -- budget and report ----------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget; `fits(kind)`: whether what the last `kind` item took (or `guess`) still fits."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.monotonic()
        self.took: dict[str, float] = {}

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def skip_reason(self, kind: str, guess: float = 0.0, reserve: float = 0.0) -> str | None:
        """Why a `kind` item must be skipped (it would not end `reserve` s before the budget's end), or None."""
        need = self.took.get(kind, guess)
        if self.left() - reserve <= max(need, 0.0):
            return (f"budget: {self.left():.0f} s of {self.seconds:.0f} s left ({reserve:.0f} s kept for the peer), "
                    f"a {kind} takes ~{need:.0f} s")
        return None

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.took[kind] = max(self.took.get(kind, 0.0), time.monotonic() - start)


def model_bytes(model: Any, batch: int, T: int, cache_len: int) -> dict[str, int]:
    """What one step must read at least: every projection's weight as held (a quantized one's codes, scales, zero
    points and mins), the lm_head's (the embedding table when tied; of the embedding itself a step reads a few rows)
    and the norms', and the K and V of cache_len + T rows of each of `batch` slots in every layer."""
    from trt_lookahead.model.llama import Linear, QuantizedLinear, RMSNorm

    held: dict[int, int] = {}  # by tensor, so a weight shared (tied) counts once
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            tensors = [module.codes, module.scales, module.zero_points, module.mins]
        elif isinstance(module, (Linear, RMSNorm)):
            tensors = [module.weight]
        else:
            continue
        for t in tensors:
            if t is not None:
                held[id(t)] = t.numel() * t.element_size()
    cfg = model.cfg
    kv = batch * cfg.num_layers * 2 * (cache_len + T) * cfg.kv_size
    return {"weight_bytes": sum(held.values()), "kv_bytes": kv * model.dtype.itemsize}


def new_report(args: argparse.Namespace) -> dict[str, Any]:
    not_asked = {"status": "skipped", "seconds": 0.0, "error": "not reached"}
    return {
        "schema": SCHEMA, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "device": args.device,
        "shape": args.shape, "shape_config": SHAPES[args.shape], "dtype": args.dtype, "weights": args.weights,
        "cache_len": args.cache_len,
        "max_seq_len": args.max_seq_len, "step_tokens": list(STEP_TOKENS), "batches": list(BATCHES),
        "configs": CONFIGS, "iters": args.iters, "budget_seconds": args.budget_seconds,
        "timing": ("CUDA events around the bucket's CUDA-graph replay (ms) and perf_counter around step() (wall_ms),"
                   " medians" if args.device == "cuda" else "perf_counter around step(), median"),
        "started": gpu_check._utc(), "finished": None, "machine": {}, "bandwidth": dict(not_asked),
        "variants": {}, "steps": {**not_asked, "cells": []}, "peer": {**not_asked, "cells": []},
        "seq_len": {**not_asked, "max_seq_lens": list(SEQ_LEN_PAIRS[args.device]),
                    "cache_len": SEQ_LEN_CACHE[args.device], "cells": []},
    }


# -- measurements ---------------------------------------------------------------------------------------


def measure_bandwidth(device: str) -> dict[str, Any]:
    """GB/s of a large device-to-device copy (bytes read + bytes written per second), median of repeats."""
    import torch

    size = (2 << 30) if device == "cuda" else (256 << 20)
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)
    ms = event_ms(copy, 10, 2)["ms"] if device == "cuda" else wall_ms(copy, 5, 1)
    return {"gb_per_s": round(2 * size / (ms * 1e-3) / 1e9, 1), "copy_bytes": size, "median_ms": ms,
            "method": f"{size >> 20} MiB tensor copy_ on {device} (read + write)"}


def wall_ms(fn: Callable[[], Any], iters: int, warmup: int, before: Callable[[], Any] = lambda: None) -> float:
    """Median ms of `fn` by perf_counter (`before` runs first each time, untimed)."""
    for _ in range(warmup):
        before()
        fn()
    times = []
    for _ in range(iters):
        before()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 4)


def event_ms(fn: Callable[[], Any], iters: int, warmup: int, before: Callable[[], Any] = lambda: None
             ) -> dict[str, float]:
    """Median and min ms of `fn` by CUDA events around each call (`before` runs first each time, untimed)."""
    import torch

    for _ in range(warmup):
        before()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": round(statistics.median(times), 4), "min_ms": round(min(times), 4)}


def step_batch(B: int, T: int, cache_len: int):
    """The timed step: B rows of layout CONFIGS[T] after cache_len tokens, slots 0 .. B-1."""
    import numpy as np

    from trt_lookahead.lookahead.config import LookaheadConfig
    from trt_lookahead.lookahead.executor import StepBatch
    from trt_lookahead.lookahead.layout import StepLayout

    layout = StepLayout(LookaheadConfig.parse(CONFIGS[T]))
    assert layout.step_tokens == T, (CONFIGS[T], layout.step_tokens)
    return StepBatch(slots=np.arange(B), input_ids=np.full((B, T), 5),
                     positions=np.tile(cache_len + layout.rel_positions, (B, 1)),
                     step_config=np.tile(np.array(gpu_check.config_tuple(CONFIGS[T]), np.int32), (B, 1)),
                     output_slots=np.tile(layout.output_slots, (B, 1)))


def variant_status(device: str) -> dict[str, dict[str, Any]]:
    """Which variants this checkout and device can run, and how each cell is stepped."""
    import torch

    from trt_lookahead.backends.torch import BatchedTorchExecutor, invariant_kernels_reason

    compiled = COMPILE_PARAMETER in inspect.signature(BatchedTorchExecutor).parameters
    cuda = device == "cuda"
    # on the CPU the Triton kernel runs only interpreted (TRITON_INTERPRET=1), seconds a step: that times the
    # interpreter, not the step, and would spend the budget the other variants need
    triton_reason = "CUDA only: interpreted on the CPU it times the Triton interpreter, not the step" if not cuda \
        else invariant_kernels_reason(torch.device(device))
    triton = {"status": "ok", "what": f"BatchedTorchExecutor(attention={TRITON_ATTENTION!r}), padded step, CUDA "
                                      "graph"} \
        if triton_reason is None else {"status": "skipped", "error": f"attention={TRITON_ATTENTION!r}: {triton_reason}"}
    return {
        "fast_triton": triton,
        "fast_compiled_triton": {"status": "ok", "what": f"BatchedTorchExecutor({COMPILE_PARAMETER}=True, "
                                                         f"attention={TRITON_ATTENTION!r}), CUDA graph"} if cuda
        else {"status": "skipped", "error": "CUDA only: the compiled step around interpreted Triton would take "
                                            "minutes on the CPU"},
        "fast": {"status": "ok", "what": f"BatchedTorchExecutor(exact=False), padded step, SDPA attention, "
                                         f"{'CUDA graph' if cuda else 'eager'}"},
        "fast_compiled": {"status": "ok", "what": f"BatchedTorchExecutor({COMPILE_PARAMETER}=True)"} if compiled
        else {"status": "not available", "error": f"BatchedTorchExecutor has no `{COMPILE_PARAMETER}` argument: "
                                                  "the package has no compiled step yet (issue 40 item 1)"},
        "exact": {"status": "ok", "what": "BatchedTorchExecutor(exact=True), padded step on kernels/invariant.py, "
                                          "CUDA graph" if cuda else
                  "BatchedTorchExecutor(exact=True, padded=False): the CPU's packed exact step (the padded exact "
                  "step runs interpreted Triton on the CPU, seconds a step)"},
        "sdpa": {"status": "not available", "error": "the same cells as variant fast: the executor's default "
                                                     "attention='sdpa' is the SDPA step (PaddedAttention)"},
    }


def make_executor(model, variant: str, B: int, T: int, args: argparse.Namespace, graph: bool):
    from trt_lookahead.backends.torch import BatchedTorchExecutor

    device = args.device
    cuda = device == "cuda"
    kwargs: dict[str, Any] = {"padded": cuda or variant != "exact", "cuda_graph": cuda and graph,
                              "exact": variant == "exact"}
    if variant in COMPILED_VARIANTS:
        kwargs[COMPILE_PARAMETER] = True
    if variant in TRITON_VARIANTS:
        kwargs["attention"] = TRITON_ATTENTION
    return BatchedTorchExecutor(model, B, args.max_seq_len, T, device, **kwargs)


def prefill(executor, B: int, cache_len: int) -> None:
    import numpy as np

    from trt_lookahead.lookahead.sampling import SamplingParams

    prompt = np.arange(3, 3 + cache_len) % executor.vocab_size
    for slot in range(B):
        executor.prefill(slot, prompt, SamplingParams())


def graph_breaks() -> int:
    """Graph breaks torch._dynamo counted so far in this process."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def time_cell(model, variant: str, B: int, T: int, args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """ms of one step of `variant` at B x T (and graph breaks, compile seconds when compiled), and the executor
    when `profile_cell` can reuse it (eager: on the CPU), else None."""
    import torch

    cell: dict[str, Any] = {"graph_breaks": None, "compile_seconds": None}
    breaks = graph_breaks()
    executor = make_executor(model, variant, B, T, args, graph=True)
    start = time.monotonic()
    prefill(executor, B, args.cache_len)
    cell["prefill_s"] = round(time.monotonic() - start, 3)
    batch = step_batch(B, T, args.cache_len)
    step = functools.partial(executor.step, batch)
    start = time.monotonic()
    step()  # the first step of a bucket captures its CUDA graph (and compiles, where compiled)
    cell["first_step_s"] = round(time.monotonic() - start, 3)
    cell["wall_ms"] = wall_ms(step, args.iters, args.warmup)
    if variant in COMPILED_VARIANTS:  # compile seconds: the first step less a steady one
        cell["graph_breaks"] = graph_breaks() - breaks
        cell["compile_seconds"] = round(cell["first_step_s"] - cell["wall_ms"] / 1e3, 2)
    if args.device == "cuda":
        # the bucket's captured graph alone (no host staging, no token copy); BatchedTorchExecutor has no public
        # hook for it, so this reads the private _graph at the bucket and width the step ran (greedy, no top-k)
        graph, _ = executor._graph(*executor.step_shape(B, T), False, 0)
        cell.update(event_ms(graph.replay, args.iters, args.warmup))
    else:
        cell["ms"] = cell["wall_ms"]
        return cell, executor
    del executor
    torch.cuda.empty_cache()
    return cell, None


@contextmanager
def scoped(model) -> Iterator[None]:
    """While profiling: every torch call annotated with its Python caller (SCOPE + qualified name), every layer
    of `model` (ours: .layers; transformers': .model.layers) annotated as LAYER."""
    import torch
    from torch.autograd.profiler import record_function
    from torch.overrides import TorchFunctionMode

    torch_dir = os.path.dirname(torch.__file__)

    class Scopes(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            frame: FrameType | None = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
                frame = frame.f_back
            with record_function(SCOPE + (frame.f_code.co_qualname if frame is not None else "")):
                return func(*args, **(kwargs or {}))

    layers = getattr(model, "layers", None) or model.model.layers
    open_ranges: list[Any] = []

    def enter(module, inputs) -> None:
        open_ranges.append(record_function(LAYER).__enter__())

    def leave(module, inputs, output) -> None:
        open_ranges.pop().__exit__(None, None, None)

    handles = [h for layer in layers for h in (layer.register_forward_pre_hook(enter),
                                               layer.register_forward_hook(leave))]
    try:
        with Scopes():
            yield
    finally:
        for handle in handles:
            handle.remove()


def kernel_counts(events: list[Any], layers: int, cuda: bool) -> dict[str, Any]:
    """Kernels per layer and outside the layers by category, from a profiled step's events.

    CUDA: each kernel attached to an event (else placed by the time of its launch call). CPU: each dispatcher op
    (aten::, mkldnn::, ..) that launches work itself (no counted op below it, not a view or allocation: NO_KERNEL).
    Named by its outermost op (or the kernel, when no op launched it), scoped by the innermost SCOPE annotation
    above it.
    """
    from torch.autograd import DeviceType

    inside: Counter[str] = Counter()
    outside: Counter[str] = Counter()
    named: Counter[tuple[str, str]] = Counter()  # (category, op or kernel name) inside the layers

    def chain(event) -> list[Any]:
        out = []
        while event is not None:
            out.append(event)
            event = event.cpu_parent
        return out

    def counted_leaf(event) -> bool:
        return (is_op(event) and not NO_KERNEL.fullmatch(event.name)
                and not any(counted_below(child) for child in event.cpu_children))

    def counted_below(event) -> bool:
        return counted_leaf(event) or any(counted_below(child) for child in event.cpu_children)

    for event in events:
        if event.device_type != DeviceType.CPU:
            continue
        names = [kernel.name for kernel in event.kernels] if cuda else [event.name] if counted_leaf(event) else []
        if not names:
            continue
        above = chain(event)
        ops = [e for e in above if is_op(e)]
        scope = next((e.name[len(SCOPE):] for e in above if e.name.startswith(SCOPE)), "")
        in_layer = any(e.name == LAYER for e in above)
        for name in names:
            label = ops[-1].name if ops else name
            category = classify(label, scope)
            (inside if in_layer else outside)[category] += 1
            if in_layer:
                leaf = "" if cuda or name == label else f" > {name}"
                named[category, f"{label}{leaf}" + (f" ({scope})" if scope else "")] += 1
    placed = unplaced = 0
    if cuda:  # kernels no op or annotation took (a Triton launch may carry none): placed by their launch call's time
        layer_spans = [(e.time_range.start, e.time_range.end) for e in events if e.name == LAYER]
        launches = {e.id: e for e in events if e.device_type == DeviceType.CPU and "aunch" in e.name}
        taken = {e.id for e in events if e.device_type == DeviceType.CPU and e.kernels}
        for event in events:
            if event.device_type != DeviceType.CUDA or getattr(event, "linked_correlation_id", 0) in taken:
                continue
            launch = launches.get(event.id)
            at = None if launch is None else launch.time_range.start
            in_layer = at is not None and any(start <= at <= end for start, end in layer_spans)
            category = classify(event.name)
            (inside if in_layer else outside)[category] += 1
            if in_layer:
                named[category, event.name] += 1
            placed, unplaced = placed + (launch is not None), unplaced + (launch is None)
    return {**({"kernels_placed_by_launch_time": placed, "kernels_without_launch": unplaced} if cuda else {}),
            "kernels_per_layer": {c: round(inside[c] / layers, 2) for c in CATEGORIES if inside[c]},
            "kernels_per_layer_by_op": {c: {n: round(k / layers, 2) for (c_, n), k in sorted(named.items()) if c_ == c}
                                        for c in CATEGORIES if inside[c]},
            "kernels_outside_layers": {c: outside[c] for c in CATEGORIES if outside[c]},
            "kernels_per_step": sum(inside.values()) + sum(outside.values())}


def profile_cell(model, variant: str, B: int, T: int, args: argparse.Namespace, executor: Any = None
                 ) -> dict[str, Any]:
    """Kernels of one eager step of `variant` at B x T (an eager executor: a graph replay hides its kernels), on
    `executor` (prefilled, warm) or a new one."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    batch = step_batch(B, T, args.cache_len)
    if executor is None:
        executor = make_executor(model, variant, B, T, args, graph=False)
        prefill(executor, B, args.cache_len)
        executor.step(batch)  # warm-up: kernels compiled, caches built
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    # the compiled step is profiled without the annotations: a torch-function mode and layer hooks around a
    # compiled graph make dynamo recompile (or fail under fullgraph), so its kernels are counted per step only
    compiled = variant in COMPILED_VARIANTS
    with profile(activities=activities) as prof, contextlib.nullcontext() if compiled else scoped(model):
        executor.step(batch)
        if args.device == "cuda":
            torch.cuda.synchronize()
    del executor
    counts = kernel_counts(list(prof.events()), model.cfg.num_layers, args.device == "cuda")
    return {**counts, "kernels_counted": "per step (no layer annotations in a compiled graph)"} if compiled else counts


def build_model(args: argparse.Namespace, variant: str):
    """The shape's random-weight Llama (the CPU's exact variant: the row-invariant weight layout), its projections in
    random blocks with --weights int8|int4."""
    if args.device == "cuda" and args.shape != "tiny" and args.dtype == "bfloat16":
        model = gpu_check.gpu_llama(SHAPES[args.shape])
    else:
        model = gpu_check.random_llama(SHAPES[args.shape], args.dtype, args.device)
    if args.weights != "float":
        return random_blocks(model, 8 if args.weights == "int8" else 4)
    return model.set_weight_layout("auto") if args.device == "cpu" and variant == "exact" else model


def random_blocks(model: Any, bits: int) -> Any:
    """The model with every bias-free projection and the lm_head (what engine/quantize.py `quantize_model` turns
    into a QuantizedLinear) holding random blocks of `bits` instead, drawn on its device: a profile times the
    bytes and kernels of a quantized step, and quantizing a 7B model's weights on the host would take minutes."""
    from bench_quantized_gpu import quantized_weight

    from trt_lookahead.model.llama import Linear, QuantizedLinear

    for name, module in list(model.named_modules()):
        if isinstance(module, Linear) and module.bias is None:
            codes, scales, zeros = quantized_weight(module.out_features, module.in_features, bits,
                                                    str(module.weight.device))
            model.set_submodule(name, QuantizedLinear(codes, scales, zeros, None, bits, module.in_features))
    return model


def section_steps(args: argparse.Namespace, report: dict[str, Any], budget: Budget, emit: Emit) -> None:
    import torch

    steps = report["steps"]
    steps.update(status="ok", error=None)
    start = time.monotonic()
    cells: list[dict[str, Any]] = steps["cells"]
    bandwidth = report["bandwidth"].get("gb_per_s")
    failures = []
    # one model for every variant (the CPU's exact one: its own, in the row-invariant weight layout); cells in
    # order of size, so a spent budget skips the largest B x T of every variant
    runnable = [v for v in VARIANTS if report["variants"][v]["status"] == "ok"]
    shared = build_model(args, "fast")
    models = {v: build_model(args, v) if args.device == "cpu" and v == "exact" else shared for v in runnable}
    reserve = HF_COMPILE_GUESS_S if args.device == "cuda" else 0.0
    for B in BATCHES:
        for T in STEP_TOKENS:
            for variant in VARIANTS:
                state = report["variants"][variant]
                cell: dict[str, Any] = {"variant": variant, "T": T, "B": B, "config": CONFIGS[T]}
                cells.append(cell)
                if variant not in models:
                    cell.update(status=state["status"], error=state["error"])
                    continue
                model = models[variant]
                cell.update(model_bytes(model, B, T, args.cache_len))
                reason = budget.skip_reason(f"{variant} cell", reserve=reserve)
                if reason:
                    cell.update(status="skipped", error=reason)
                    emit()
                    continue
                try:
                    with budget.timed(f"{variant} cell"), torch.inference_mode():
                        timed, executor = time_cell(model, variant, B, T, args)
                        cell.update(timed)
                        cell.update(model_bytes(model, B, T, args.cache_len))  # as the executor holds them (words)
                        if bandwidth:
                            cell["limit_ms"] = round((cell["weight_bytes"] + cell["kv_bytes"]) / (bandwidth * 1e6), 4)
                            cell["ratio"] = round(cell["ms"] / cell["limit_ms"], 3)
                        try:
                            cell.update(profile_cell(model, variant, B, T, args, executor))
                        except Exception as exc:  # the timing stands without its kernel counts
                            cell["kernels_error"] = f"{type(exc).__name__}: {exc}"[:500]
                        del executor
                    cell["status"] = "ok"
                except Exception as exc:  # one failed cell is data; the next one runs
                    cell.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500],
                                traceback=traceback.format_exc()[-2000:])
                    failures.append(f"{variant} T={T} B={B}")
                steps["seconds"] = round(time.monotonic() - start, 1)
                emit()
    del shared, models
    if args.device == "cuda":
        torch.cuda.empty_cache()
    if failures:
        steps.update(status="failed", error=f"{len(failures)} cells failed: {', '.join(failures)}")


def section_seq_len(args: argparse.Namespace, report: dict[str, Any], budget: Budget, emit: Emit) -> None:
    """The same context read at a long and a short max_seq_len (SEQ_LEN_PAIRS): ms of each, and long / short."""
    import torch

    section = report["seq_len"]
    section.update(status="ok", error=None)
    start = time.monotonic()
    cells: list[dict[str, Any]] = section["cells"]
    lengths = SEQ_LEN_PAIRS[args.device]
    reserve = HF_COMPILE_GUESS_S if args.device == "cuda" else 0.0
    model = build_model(args, "fast")
    failures = []
    for variant in SEQ_LEN_VARIANTS:
        state = report["variants"][variant]
        for T in SEQ_LEN_STEP_TOKENS:
            cell: dict[str, Any] = {"variant": variant, "T": T, "B": 1, "config": CONFIGS[T], "ms": {}}
            cells.append(cell)
            if state["status"] != "ok":
                cell.update(status=state["status"], error=state["error"])
                continue
            for length in lengths:
                reason = budget.skip_reason("seq_len step", reserve=reserve)
                if reason:
                    cell.update(status="skipped", error=reason)
                    break
                at = argparse.Namespace(**{**vars(args), "max_seq_len": length, "cache_len": section["cache_len"]})
                try:
                    with budget.timed("seq_len step"), torch.inference_mode():
                        cell["ms"][str(length)] = time_cell(model, variant, 1, T, at)[0]["ms"]
                except Exception as exc:  # one failed timing is data; the next one runs
                    cell.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
                    failures.append(f"{variant} T={T} max_seq_len {length}")
                    break
            else:
                long, short = (cell["ms"][str(length)] for length in lengths)
                cell.update(status="ok", ratio=round(long / short, 3), within_goal=long / short <= SEQ_LEN_GOAL)
            section["seconds"] = round(time.monotonic() - start, 1)
            emit()
    del model
    if failures:
        section.update(status="failed", error=f"{len(failures)} timings failed: {', '.join(failures)}")


# -- the peer: transformers' Llama ----------------------------------------------------------------------


def hf_llama(args: argparse.Namespace):
    """transformers' LlamaForCausalLM of the shape, random weights, eval, on the device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SHAPES[args.shape]
    theta = shape.get("rope_theta", 10000.0)
    # transformers >= 5 takes rope_parameters, older ones rope_theta
    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
            if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters else {"rope_theta": theta})
    config = LlamaConfig(
        hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"], vocab_size=shape["vocab_size"],
        max_position_embeddings=max(shape.get("max_position_embeddings", 0), args.max_seq_len + max(STEP_TOKENS)),
        tie_word_embeddings=shape.get("tie_word_embeddings", False), **rope)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False)


def hf_static_cache(model, B: int, rows: int):
    """A StaticCache of `rows` rows for B sequences, whichever signature this transformers has."""
    from transformers import StaticCache

    kwargs: dict[str, Any] = {"config": model.config, "max_cache_len": rows}
    parameters = inspect.signature(StaticCache.__init__).parameters
    for name, value in (("max_batch_size", B), ("batch_size", B), ("device", model.device), ("dtype", model.dtype)):
        if name in parameters:
            kwargs[name] = value
    return StaticCache(**kwargs)


def hf_cell(model, forward: Callable[..., Any], B: int, T: int, args: argparse.Namespace) -> dict[str, Any]:
    """ms of `forward` (the model's, compiled or not) on B x T new tokens after cache_len cached ones."""
    import torch

    dev = args.device
    cache = hf_static_cache(model, B, args.max_seq_len + T)
    prompt = torch.arange(3, 3 + args.cache_len, device=dev).repeat(B, 1)
    model(prompt, past_key_values=cache, cache_position=torch.arange(args.cache_len, device=dev), use_cache=True)
    ids = torch.full((B, T), 5, device=dev)
    positions = torch.arange(args.cache_len, args.cache_len + T, device=dev)
    # transformers >= 5 appends at each layer's cumulative_length: back to cache_len before every call
    lengths = [layer.cumulative_length for layer in getattr(cache, "layers", [])
               if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]

    def rewind() -> None:
        for length in lengths:
            length.fill_(args.cache_len)

    def step() -> Any:
        return forward(ids, past_key_values=cache, cache_position=positions, use_cache=True).logits

    first = time.monotonic()
    rewind()
    step()  # compiles, where compiled
    cell: dict[str, Any] = {"first_call_s": round(time.monotonic() - first, 3)}
    if dev == "cuda":
        cell.update(event_ms(step, args.iters, args.warmup, rewind))
    else:
        cell["ms"] = wall_ms(step, args.iters, args.warmup, rewind)
    return cell


def section_peer(args: argparse.Namespace, report: dict[str, Any], budget: Budget, emit: Emit) -> None:
    import torch

    peer = report["peer"]
    try:
        import transformers
    except ImportError as exc:
        peer.update(status="not available", error=f"transformers is not importable here: {exc}")
        return
    compiled = args.device == "cuda"
    peer.update(status="ok", error=None, library=f"transformers {transformers.__version__}", compiled=compiled,
                what=("LlamaForCausalLM, StaticCache, torch.compile(mode='reduce-overhead', fullgraph=True)"
                      if compiled else "LlamaForCausalLM, StaticCache, eager") +
                     "; logits at every one of the T tokens, causal mask")
    start = time.monotonic()
    model = hf_llama(args)
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compiled else model.forward
    cells: list[dict[str, Any]] = peer["cells"]
    for B in BATCHES:
        for T in STEP_TOKENS:
            cell: dict[str, Any] = {"T": T, "B": B}
            cells.append(cell)
            reason = budget.skip_reason("peer cell", HF_COMPILE_GUESS_S if compiled else 0.0)
            if reason:
                cell.update(status="skipped", error=reason)
                emit()
                continue
            try:
                with budget.timed("peer cell"), torch.inference_mode():
                    cell.update(hf_cell(model, forward, B, T, args))
                cell["status"] = "ok"
            except Exception as exc:
                cell.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
            peer["seconds"] = round(time.monotonic() - start, 1)
            emit()
    if any(c["status"] == "error" for c in cells):
        peer.update(status="failed", error="; ".join(f"T={c['T']} B={c['B']}: {c['error']}" for c in cells
                                                     if c["status"] == "error")[:1500])


# -- driver ---------------------------------------------------------------------------------------------


def machine(device: str) -> dict[str, Any]:
    import torch

    from trt_lookahead.bench.machine import machine_info

    if device == "cuda":
        return gpu_check.machine()
    return {**machine_info(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_seconds)
    report = new_report(args)

    def emit() -> None:
        gpu_check.write_json(args.out / REPORT, report)

    report["machine"] = machine(args.device)
    emit()
    start = time.monotonic()
    try:
        report["bandwidth"] = {"status": "ok", **measure_bandwidth(args.device)}
    except Exception as exc:
        report["bandwidth"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    report["bandwidth"]["seconds"] = round(time.monotonic() - start, 1)
    report["variants"] = variant_status(args.device)
    emit()
    for name, section in (("steps", section_steps), ("seq_len", section_seq_len), ("peer", section_peer)):
        try:
            section(args, report, budget, emit)
        except Exception as exc:  # a section's failure is recorded; the next section runs
            report[name].update(status="error", error=f"{type(exc).__name__}: {exc}"[:500],
                                traceback=traceback.format_exc()[-3000:])
        emit()
    report["finished"] = gpu_check._utc()
    report["seconds"] = round(time.monotonic() - budget.start, 1)
    emit()
    return report


def summary(report: dict[str, Any]) -> str:
    """A short text table of the cells and the fast step's kernels per layer."""
    weights = "" if report["weights"] == "float" else f", {report['weights']} weights"
    lines = [f"profile_step: {report['shape']} {report['dtype']}{weights} on {report['device']}, cache_len "
             f"{report['cache_len']}, bandwidth {report['bandwidth'].get('gb_per_s', '?')} GB/s, "
             f"{report.get('seconds', '?')} s",
             f"{'variant':<14}{'T':>4}{'B':>3}{'ms':>10}{'limit ms':>10}{'ratio':>8}  kernels/layer"]
    for cell in report["steps"]["cells"]:
        if cell.get("status") != "ok":
            if cell["T"] == STEP_TOKENS[0] and cell["B"] == BATCHES[0]:
                lines.append(f"{cell['variant']:<14} {cell['status']}: {cell.get('error')}")
            continue
        per_layer = sum(cell.get("kernels_per_layer", {}).values())
        lines.append(f"{cell['variant']:<14}{cell['T']:>4}{cell['B']:>3}{cell['ms']:>10.3f}"
                     f"{cell.get('limit_ms', float('nan')):>10.4f}{cell.get('ratio', float('nan')):>8.1f}"
                     f"  {per_layer:g}")
    fast = next((c for c in report["steps"]["cells"] if c["variant"] == "fast" and c.get("status") == "ok"), None)
    if fast:
        lines.append(f"fast T={fast['T']} B={fast['B']} kernels per layer: {fast['kernels_per_layer']}; "
                     f"outside the layers: {fast['kernels_outside_layers']}")
    for cell in report["seq_len"]["cells"]:
        if cell.get("status") == "ok":
            lines.append(f"seq_len {cell['variant']} T={cell['T']}: " + ", ".join(
                f"max_seq_len {k} {v:.3f} ms" for k, v in cell["ms"].items()) + f"; long/short {cell['ratio']}")
    peer = report["peer"]
    ok = [c for c in peer.get("cells", []) if c.get("status") == "ok"]
    skipped = sum(c.get("status") == "skipped" for c in peer.get("cells", []))
    lines.append(f"peer ({peer.get('library', '-')}): {peer['status']}"
                 + "".join(f"; T={c['T']} B={c['B']} {c['ms']:.3f} ms" for c in ok)
                 + (f"; {skipped} cells skipped (budget)" if skipped else ""))
    skipped = sum(c.get("status") == "skipped" for c in report["steps"]["cells"])
    if skipped:
        lines.append(f"steps: {skipped} cells skipped (budget)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        reason = gpu_check.gpu_reason()
        if reason is not None:
            print(f"error: --device cuda but {reason}; run on a GPU machine or pass --device cpu", file=sys.stderr)
            return 2
    if args.device == "cpu":
        import torch

        torch.set_num_threads(args.threads)  # these runs share their cores: one thread unless asked
    report = run(args)
    print(summary(report))
    bad = [name for name in ("bandwidth", "steps", "seq_len", "peer") if report[name]["status"] in ("failed", "error")]
    print(f"[profile_step] wrote {args.out / REPORT}; {'not ok: ' + ', '.join(bad) if bad else 'ok'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
