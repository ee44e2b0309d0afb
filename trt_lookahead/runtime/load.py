"""Loading: a checkpoint dir, a known model name or an engine dir -> the parts a LookaheadRuntime runs on.

    model = load_model("smollm2-135m-instruct", backend=None, dtype="float32", asked=None, ...)
    model.tokenizer, model.executor, model.backend, model.max_lookahead, ...

Which backend runs a checkpoint and why (`checkpoint_backend`), the engine a checkpoint's onnxruntime path builds
once and caches (`cached_checkpoint_engine`, sized by `engine_cover`), the draft tree (`checkpoint_tree`), and
the eos ids. Imports the layers below the runtime only; runtime.py imports this module, never the reverse.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trt_lookahead.engine.format import DEFAULT_MAX_BATCH, is_engine_dir
from trt_lookahead.errors import UserError, as_int
from trt_lookahead.lookahead.config import DEFAULT, DEFAULT_LOOKAHEAD, LookaheadConfig
from trt_lookahead.lookahead.executor import Executor, check_kv_memory
from trt_lookahead.lookahead.policy import NGRAMS, TOP, AutoPolicy, auto_cover
from trt_lookahead.lookahead.tree import DEFAULT_TREE, TreeTemplate, resolve_tree
from trt_lookahead.runtime.tuning_file import read_tuning_file, tuning_key

if TYPE_CHECKING:  # torch-free at import: the model is loaded lazily
    from trt_lookahead.model.llama import ModelConfig

DEFAULT_MAX_SEQ_LEN = 4096
BACKEND_CHOICES = ("torch", "onnxruntime", "tensorrt")
TORCH_STEP_ON_ENGINE = ("compile=True and attention='triton' (--compile, --attention triton) set the torch executor's "
                        "step (experimental): it runs a checkpoint on --backend torch, not an engine dir or another "
                        "backend; drop them or the backend")
EXACT_ON_ENGINE = ("exact=True runs a checkpoint on the torch executor; onnxruntime runs exact steps only on an "
                   "engine dir built with `trt-lookahead build --exact`: drop --backend onnxruntime, or pass such an "
                   "engine")
TREE_ON_ENGINE = "an engine dir verifies the tree it was built with (`trt-lookahead build --tree`): drop --tree"
DEVICES = ("cpu", "cuda")
DEVICE_ON_ENGINE = ("an engine dir runs where its backend runs (onnxruntime: the CPU; tensorrt: the GPU): drop "
                    "--device")


@dataclass(frozen=True)
class LoadedModel:
    """What a runtime runs on: a tokenizer, one batched executor, and what they were loaded from."""

    tokenizer: Any
    executor: Executor
    max_seq_len: int
    stop_token_ids: list[int]
    backend: str
    dtype: str
    model_path: Path  # the checkpoint (a cached engine answers for its checkpoint) or the engine dir
    max_lookahead: LookaheadConfig | None  # an engine's built config: requests must fit inside it
    why: str | None = None  # a checkpoint: why this backend runs it (said once the runtime is up)
    device: str = "cpu"  # where the torch executor runs a checkpoint ("cpu" or "cuda")
    weights: str | None = None  # a quantized engine's weights and activations ("int4", "int4+int8"); None: float


def refuse_weights_on_engine(weights: str, activations: str | None) -> None:
    """UserError if --weights or --activations were asked for an engine dir: its build set both."""
    if weights != "float" or activations is not None:
        raise UserError("an engine dir's weights were set by its build (`trt-lookahead build --weights "
                        "--activations`): drop --weights and --activations, or build another engine")


def load_model(
    path_or_name: str | Path, *, backend: str | None, dtype: str, asked: LookaheadConfig | None,
    max_seq_len: int | None, max_batch: int | None, verify: bool, exact: bool | None,
    tree: str | TreeTemplate | None, compile: bool = False, attention: str = "sdpa", device: str | None = None,
    weights: str = "float", activations: str | None = None, tensor_parallel: int = 1,
) -> LoadedModel:
    """Load a HF Llama checkpoint dir, a known model name, or an engine dir (arguments as
    LookaheadRuntime.from_pretrained documents them; `asked`: the fixed config the runtime will default to, if
    any, so that a checkpoint's backend, tree and cached engine cover it); for a checkpoint, `why` says which
    backend runs it and why."""
    from trt_lookahead.engine.quantize import check_scheme
    from trt_lookahead.model.fetch import resolve_model

    path = resolve_model(str(path_or_name))
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
        raise UserError(f"max_batch must be a positive integer (request slots), got {max_batch!r}")
    if tensor_parallel != 1 or isinstance(tensor_parallel, bool):
        return _tensor_parallel(path, backend, dtype, asked, max_seq_len, max_batch, exact, tree, compile, attention,
                                device, weights, activations, tensor_parallel)
    torch_step = compile or attention != "sdpa"
    if torch_step and (is_engine_dir(path) or backend not in (None, "torch")):
        raise UserError(TORCH_STEP_ON_ENGINE)
    if is_engine_dir(path):
        if tree not in (None, "off", DEFAULT):
            raise UserError(TREE_ON_ENGINE)
        if device is not None:
            raise UserError(DEVICE_ON_ENGINE)
        refuse_weights_on_engine(weights, activations)
        return _from_engine(path, backend or "onnxruntime", dtype, max_seq_len, max_batch, verify, exact=exact)
    device = checkpoint_device(device)
    if device == "cuda" and weights != "float":  # weight-only: the GPU's product dequantizes inside a float GEMM
        if activations not in (None, "float"):
            raise UserError(f"--activations {activations} is the CPU engines' (MatMulNBits); on CUDA quantized "
                            "weights multiply float activations: drop --activations")
        activations = "float"
    weights, activations = check_scheme(weights, activations)
    quantized = weights != "float"
    if quantized and exact and activations == "float" and device == "cpu":
        raise UserError("exact steps on quantized weights come with int8 activations, whose engine is exact: add "
                        "--activations int8, or drop --exact")
    if quantized and exact is False and activations != "float":
        raise UserError(f"--activations {activations} (the default with --weights) runs only on the exact graph: "
                        "add --activations float for the fast one, or drop --no-exact")
    backend, why = checkpoint_backend("torch" if torch_step else backend, dtype, asked, None if quantized else exact,
                                      device, weights)
    template = checkpoint_tree(tree, asked, backend)
    if backend == "onnxruntime":
        cached = cached_checkpoint_engine(path, dtype, max_seq_len, max_batch, asked, template, weights, activations)
        model = _from_engine(cached, backend, dtype, max_seq_len, max_batch, verify, model_path=path)
    else:
        model = _from_checkpoint(path, dtype, max_seq_len, max_batch or DEFAULT_MAX_BATCH, exact, template, compile,
                                 attention, device, weights)
    return dataclasses.replace(model, why=why)


def _from_checkpoint(path: Path, dtype: str, max_seq_len: int | None, max_batch: int, exact: bool | None,
                     tree: TreeTemplate | None, compile: bool = False, attention: str = "sdpa",
                     device: str = "cpu", weights: str = "float") -> LoadedModel:
    from trt_lookahead.backends.torch import BatchedTorchExecutor
    from trt_lookahead.engine.quantize import quantize_model
    from trt_lookahead.model.checkpoint import (
        check_max_seq_len,
        load_llama,
        load_llama_deferred,
        load_tokenizer,
        parse_dtype,
    )

    if weights == "float":
        # compile: nn.Linear's dense weights, which inductor lowers (it cannot lower oneDNN's packed ones)
        model, config = load_llama(path, dtype=dtype, weight_layout="out_in" if compile else "auto", device=device)
    else:  # quantized from float32 on the host (a GGUF grid survives no lower precision) one projection at a time
        model, config, deferred = load_llama_deferred(path, 0)
        quantize_model(model, weights, parse_dtype(dtype), deferred)
        model = model.to(device)
    seq_len = check_max_seq_len(max_seq_len, config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    try:
        executor = BatchedTorchExecutor(model, max_batch, seq_len, exact=exact, tree=tree, compile=compile,
                                        attention=attention)
    except ValueError as exc:  # exact=True without row-invariant projections; attention='triton' without CUDA
        raise UserError(str(exc)) from exc
    return LoadedModel(load_tokenizer(path), executor, seq_len, _stop_token_ids(path), "torch", dtype, path,
                       max_lookahead=None, device=device,
                       weights=weights_label(weights, "float"))


def check_tensor_parallel(path: Path, world: int, backend: str | None = None, device: str | None = None,
                          weights: str = "float", activations: str | None = None, compile: bool = False,
                          attention: str = "sdpa") -> ModelConfig:
    """The checkpoint's config if `world` ranks can run it with these settings, else one UserError naming what to
    drop or which degree the model takes; reads config.json only."""
    from trt_lookahead.backends.tensor_parallel import check_degree
    from trt_lookahead.model.checkpoint import read_config

    if is_engine_dir(path):
        raise UserError("tensor_parallel shards a checkpoint (--model), not an engine dir")
    unsupported = [what for what, asked_for in (
        ("--backend other than torch", backend not in (None, "", "torch")), ("--device cuda (NCCL)", device == "cuda"),
        ("--weights/--activations", weights != "float" or activations not in (None, "float")), ("--compile", compile),
        ("--attention triton", attention != "sdpa")) if asked_for]
    if unsupported:
        raise UserError(f"tensor_parallel {world} runs the CPU torch executor on float weights for now; drop "
                        f"{', '.join(unsupported)}, or --tensor-parallel (tensor_parallel)")
    config = read_config(path)
    check_degree(config, world)
    return config


def _tensor_parallel(path: Path, backend: str | None, dtype: str, asked: LookaheadConfig | None,
                     max_seq_len: int | None, max_batch: int | None, exact: bool | None,
                     tree: str | TreeTemplate | None, compile: bool, attention: str, device: str | None,
                     weights: str, activations: str | None, world: int) -> LoadedModel:
    """A checkpoint on `world` ranks (backends/tensor_parallel.py, docs/design.md 5.3): this process is rank 0 and
    starts the others; the CPU torch executor only, for now. Every refusal comes before anything is loaded."""
    from trt_lookahead.backends.tensor_parallel import RankSpec, open_leader
    from trt_lookahead.model.checkpoint import check_max_seq_len, load_tokenizer

    config = check_tensor_parallel(path, world, backend, device, weights, activations, compile, attention)
    seq_len = check_max_seq_len(max_seq_len, config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    template = checkpoint_tree(tree, asked, "torch")
    spec = RankSpec(str(path), dtype, max_batch or DEFAULT_MAX_BATCH, seq_len, exact,
                    None if template is None else template.parents)
    try:
        executor = open_leader(spec, world)
    except ValueError as exc:  # exact=True where the projections are not row-invariant
        raise UserError(str(exc)) from exc
    return LoadedModel(load_tokenizer(path), executor, seq_len, _stop_token_ids(path), "torch", dtype, path,
                       max_lookahead=None,
                       why=f"tensor_parallel {world}: the torch executor sharded over {world} ranks (gloo)")


def _from_engine(path: Path, backend: str, dtype: str, max_seq_len: int | None, max_batch: int | None, verify: bool,
                 model_path: Path | None = None, exact: bool | None = None) -> LoadedModel:
    """An engine dir; `model_path`: the checkpoint of a cached engine (its tokenizer files as they are now, and the
    name it answers for: the tuning key), else the engine dir itself."""
    from trt_lookahead.backends.open import open_engine
    from trt_lookahead.model.checkpoint import load_tokenizer

    engine = open_engine(path, backend=backend, dtype=dtype, max_seq_len=max_seq_len, max_batch=max_batch,
                         verify=verify, exact=exact)
    source = model_path or path
    return LoadedModel(load_tokenizer(source), engine.executor(), engine.max_seq_len, _stop_token_ids(source),
                       backend, engine.dtype, source, max_lookahead=engine.lookahead,
                       weights=weights_label(engine.config.quantization, engine.config.activations))


def weights_label(weights: str, activations: str) -> str | None:
    """How a tuning key and a status line name quantized weights: "int4", or "int4+int8" with int8 activations;
    None for float weights."""
    if weights == "float":
        return None
    return weights if activations == "float" else f"{weights}+{activations}"


def _stop_token_ids(path: Path) -> list[int]:
    """eos ids from generation_config.json and config.json (an int or a list in either)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
            values = value if isinstance(value, list) else [] if value is None else [value]
            ids.extend(as_int("eos_token_id", t) for t in values)
        except (OSError, ValueError, AttributeError) as exc:
            raise UserError(f"{file} is unreadable or malformed ({exc}); restore it from the original files") from exc
    return ids


BACKEND_CHOICES = ("torch", "onnxruntime", "tensorrt")


def engine_cover(asked: LookaheadConfig | None = None) -> LookaheadConfig:
    """The W, N, G a checkpoint's cached engine is built for: DEFAULT_LOOKAHEAD, TOP/5/TOP (the widest `auto` takes
    on it) and the config asked for explicitly (None: the standard engine)."""
    standard = [DEFAULT_LOOKAHEAD, LookaheadConfig(TOP, max(NGRAMS), TOP)]
    return LookaheadConfig.cover([*standard, *([asked] if asked else [])])


def checkpoint_tree(spec: str | TreeTemplate | None, asked: LookaheadConfig | None, backend: str
                    ) -> TreeTemplate | None:
    """The draft tree a checkpoint runs with (DEFAULT: DEFAULT_TREE; docs/design.md 2.7), sized for the config
    asked for, else for every config `auto` may use; on onnxruntime for its cached engine (`engine_cover`)."""
    if backend == "onnxruntime":
        sized = engine_cover(asked)
    else:
        sized = asked if asked and asked.G else LookaheadConfig.cover([DEFAULT_LOOKAHEAD, auto_cover()])
    try:
        return resolve_tree(DEFAULT_TREE if spec == DEFAULT else spec, sized)
    except UserError as exc:
        if backend != "onnxruntime":
            raise
        raise UserError(f"{exc} ({sized} is the checkpoint's cached engine; on --backend torch a tree only needs "
                        "the slots of the config asked for)") from None


def checkpoint_tuning_key(path: str | Path, dtype: str, backend: str | None = None,
                          asked: LookaheadConfig | None = None, device: str | None = None) -> str:
    """The tuning file's key `auto` reads for a checkpoint's default runtime on `backend` (None: its default) and
    `device` (None: its default)."""
    device = checkpoint_device(device)
    backend = checkpoint_backend(backend, dtype, asked, device=device)[0]
    return tuning_key(path, dtype, tuned_backend(backend, device), tree=checkpoint_tree(DEFAULT, asked, backend))


def tuned_backend(backend: str, device: str) -> str:
    """A tuning key's backend: the backend, and the device where it is not the CPU (costs differ by device)."""
    return backend if device == "cpu" else f"{backend}-{device}"


def checkpoint_device(device: str | None) -> str:
    """Where a checkpoint runs: `device` ("cpu" or "cuda"), or by default CUDA where this process sees a GPU (its
    CUDA graphs outrun any CPU path), else the CPU; UserError for one it cannot use."""
    from trt_lookahead.backends.devices import gpu_count

    if device is None:
        return "cuda" if gpu_count() else "cpu"
    if device not in DEVICES:
        raise UserError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not gpu_count():
        raise UserError("device 'cuda' asked for, but this process sees no CUDA device; use --device cpu")
    return device


def checkpoint_backend(
    backend: str | None, dtype: str, asked: LookaheadConfig | None = None, exact: bool | None = None,
    device: str = "cpu", weights: str = "float",
) -> tuple[str, str]:
    """(the backend that runs a checkpoint, why): on CUDA the torch executor (quantized `weights` too: its product
    dequantizes inside the GEMM, docs/design.md 6.9); on the CPU onnxruntime on a cached engine for float32 (the
    fastest CPU path, 6.8) and for quantized `weights` (MatMulNBits, 6.9), torch for other dtypes, for a config
    wider than the standard cached engine (so the default never builds a second one unasked), for exact=True, or
    when asked; UserError for one that cannot."""
    if weights != "float" and device == "cuda":
        if backend not in (None, "torch"):
            raise UserError(f"--weights {weights} on CUDA runs on the torch executor, not {backend}: drop --backend, "
                            "or use --device cpu")
        return "torch", f"{weights} weights on CUDA: the torch executor, each weight dequantized inside its product"
    if weights != "float":
        given = [flag for flag, bad in ((f"--backend {backend}", backend not in (None, "onnxruntime")),
                                        (f"--dtype {dtype}", dtype != "float32")) if bad]
        if given:
            raise UserError(f"--weights {weights} on the CPU runs a checkpoint as a float32 onnxruntime engine "
                            f"(MatMulNBits; the torch executor's quantized product is a GPU kernel): drop "
                            f"{' and '.join(given)}, or run it on a GPU (--device cuda)")
        return "onnxruntime", f"{weights} weights: an onnxruntime engine (MatMulNBits), built once and cached"
    if exact and backend not in (None, "torch"):
        raise UserError(EXACT_ON_ENGINE)
    if device == "cuda":
        if backend not in (None, "torch"):
            raise UserError(f"a checkpoint runs on CUDA through the torch executor, not {backend}: drop --backend, "
                            "or use --device cpu")
        return "torch", "on CUDA: the torch executor's CUDA graphs" if backend is None else "asked for"
    if backend is None:
        if exact:
            return "torch", "exact=True: the row-invariant step runs on the torch executor (docs/design.md 4.2)"
        if dtype != "float32":
            return "torch", f"the default for {dtype}: onnxruntime engines run float32 only"
        if asked is not None and engine_cover(asked) != engine_cover():
            return "torch", (f"{asked} is wider than the standard cached engine's {engine_cover()}; "
                             "--backend onnxruntime builds an engine for it once")
        return "onnxruntime", "the default for float32: a compiled engine, built once and cached; --backend torch"
    if backend not in BACKEND_CHOICES[:2]:
        raise UserError(f"backend {backend!r} runs engine dirs: build one with `trt-lookahead build --target "
                        f"{backend}`; a checkpoint runs on {' or '.join(BACKEND_CHOICES[:2])}")
    if backend == "onnxruntime" and dtype != "float32":
        raise UserError(f"the onnxruntime backend runs float32 engines on the CPU, not {dtype}; use --backend torch")
    return backend, "asked for"


def cached_checkpoint_engine(path: Path, dtype: str, max_seq_len: int | None, max_batch: int | None,
                             asked: LookaheadConfig | None = None, tree: TreeTemplate | None = None,
                             weights: str = "float", activations: str | None = None) -> Path:
    """The cached engine dir (engine/cache.py) a checkpoint runs on with onnxruntime, built first if needed.

    One shape serves a checkpoint's usual requests, so one engine is built per checkpoint and dtype: W, N, G
    from `engine_cover` (a larger per-request config is refused, naming it); max_seq_len and max_batch cover
    the defaults and what was asked for (the graph's batch and cache length are dynamic: an executor opened
    for less keeps less).
    """
    from trt_lookahead.engine.cache import cached_engine
    from trt_lookahead.model.checkpoint import check_max_seq_len, read_config

    cover, config = engine_cover(asked), read_config(path)
    context = config.max_position_embeddings
    seq_len = max(check_max_seq_len(max_seq_len, context, DEFAULT_MAX_SEQ_LEN), min(context, DEFAULT_MAX_SEQ_LEN))
    slots = max(max_batch or DEFAULT_MAX_BATCH, DEFAULT_MAX_BATCH)
    # the executor checks this too, but only after a build that may itself not fit: refuse before building
    check_kv_memory((config.num_layers, slots, config.num_kv_heads, seq_len + cover.step_tokens, config.head_dim),
                    4, seq_len, slots)
    engine, _ = cached_engine(path, dtype=dtype, lookahead=cover, max_seq_len=seq_len, max_batch=slots, tree=tree,
                              weights=weights, activations=activations)
    return engine


def loaded_tuning_key(model: LoadedModel) -> str:
    """The tuning file's key of a loaded model: its model, dtype, backend, this machine (torch's threads now) and
    its executor's draft tree."""
    return tuning_key(model.model_path, model.dtype, tuned_backend(model.backend, model.device), weights=model.weights,
                      tree=getattr(model.executor, "tree", None))


def auto_policy(model: LoadedModel, tuning_file: str | Path | None, announce: bool) -> AutoPolicy:
    """What `auto` requests run on: the tuning entry for this model, dtype, backend, tree and machine (never tuned
    here: `trt-lookahead tune` and `serve --tune` write entries), else the built-in priors up to the ladder's widest
    config that fits the executor (said once on stderr, now if `announce`: `auto` was asked for by name)."""
    entries = read_tuning_file(None if tuning_file is None else Path(tuning_file))["entries"]
    entry = entries.get(loaded_tuning_key(model))
    if entry is not None:
        return AutoPolicy.from_entry(entry)
    auto = AutoPolicy.untuned(model.executor.step_tokens, model.max_lookahead)
    if announce:
        auto.announce()
    return auto
