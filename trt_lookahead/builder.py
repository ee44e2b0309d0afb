"""`trt-lookahead build`: a Llama checkpoint -> an engine dir at fixed (W, N, G).

    trt-lookahead build --model M --output engines/NAME --lookahead_config 4,3,4 --max_seq_len 1024
        [--max_input_len 512] [--dtype float32|bfloat16|float16] [--attention plugin|native]
        [--target onnx|tensorrt] [--force]

engines/NAME/
    config.json         format version, model dims, dtype, lengths, W/N/G and T, attention mode, I/O,
                        file checksums, what was built for which target and how it was checked
    step.onnx           the step graph at fixed T = (W+G)(N-1)
    prefill.onnx        the same network with a dynamic token count (prefill, T = 1 greedy steps;
                        TensorRT builds all its profiles from this one)
    weights.bin         the weights, once, as external data of both graphs
    tokenizer files, generation_config.json
    engine.plan         TensorRT only, built where TensorRT and a GPU exist

Graph I/O (both graphs; the cache layout is [Hkv, S, D] per layer, S = max_seq_len + T):

    input_ids int32 [T]   positions int32 [T]   cache_len int32 [1]   step_config int32 [3] (W, N, G; 0 = causal)
    output_slots int32 [K]   key_cache_{l}, value_cache_{l} [Hkv, S, D] for each layer l
    -> next_ids int32 [K] (argmax)   logits float32 [K, V]   present_keys, present_values [L, Hkv, T, D]

The caches are read-only inputs: a step attends over rows 0..cache_len-1 plus its own T tokens and
returns their K/V; the executor commits the accepted rows (no in-graph copy of the whole cache).
Attention is the LookaheadAttention node (--attention plugin, plugins/onnx_op.py) or the standard
ONNX Attention-23 op (--attention native) over keys [cache rows ; step rows] with a boolean [T, S+T]
mask computed in the graph from cache_len and step_config. The native form passes no past_key /
past_value: onnxruntime 1.31's CPU kernel refuses past_key without a present_key output, and the
present (a copy of the whole cache) is not wanted; the concatenation costs the same copy.

The build happens in a temporary directory beside the output and is renamed into place only after
the graphs pass onnx.checker and a smoke step under onnxruntime matches the torch executor.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trt_lookahead.config import LookaheadConfig
from trt_lookahead.errors import UserError

FORMAT_KEY = "trt_lookahead_engine"
FORMAT_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_MODES = ("plugin", "native")
TARGETS = ("onnx", "tensorrt")
OPSET = 23
STEP_GRAPH, PREFILL_GRAPH, WEIGHTS_FILE, PLAN_FILE = "step.onnx", "prefill.onnx", "weights.bin", "engine.plan"
INPUTS = ("input_ids", "positions", "cache_len", "step_config", "output_slots")
OUTPUTS = ("next_ids", "logits", "present_keys", "present_values")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json",
)
_INLINE_BYTES = 1024  # initializers smaller than this stay inside the graph files


def cache_names(layers: int) -> list[str]:
    return [f"key_cache_{i}" for i in range(layers)] + [f"value_cache_{i}" for i in range(layers)]


# -- the engine dir's config ----------------------------------------------------------------------


@dataclass(frozen=True)
class EngineConfig:
    """config.json of an engine dir (see the module docstring); `raw` keeps every recorded field."""

    path: Path
    raw: dict

    @property
    def lookahead(self) -> LookaheadConfig:
        return LookaheadConfig(**self.raw["lookahead"])

    @property
    def tokens_per_step(self) -> int:
        return int(self.raw["tokens_per_step"])

    @property
    def max_seq_len(self) -> int:
        return int(self.raw["max_seq_len"])

    @property
    def max_input_len(self) -> int:
        return int(self.raw["max_input_len"])

    @property
    def cache_rows(self) -> int:
        return int(self.raw["cache_rows"])

    @property
    def dtype(self) -> str:
        return self.raw["dtype"]

    @property
    def attention(self) -> str:
        return self.raw["attention"]

    @property
    def model(self) -> dict:
        return self.raw["model"]

    @property
    def layers(self) -> int:
        return int(self.model["num_layers"])

    @property
    def targets(self) -> dict:
        return self.raw["targets"]

    def graph(self, which: str) -> Path:
        return self.path / self.raw["graphs"][which]

    def check_request(self, *, lookahead: LookaheadConfig | None = None, dtype: str | None = None,
                      max_seq_len: int | None = None, model_sha256: str | None = None) -> None:
        """Raise UserError naming every way a request differs from what this engine was built for."""
        problems = []
        if lookahead is not None:
            try:
                lookahead.check_fits(self.lookahead)
            except ValueError as exc:
                problems.append(str(exc))
        if dtype is not None and dtype != self.dtype:
            problems.append(f"dtype {dtype} was asked for but the engine holds {self.dtype} weights "
                            f"(pass --dtype {self.dtype} or rebuild)")
        if max_seq_len is not None and max_seq_len > self.max_seq_len:
            problems.append(f"max_seq_len {max_seq_len} exceeds the engine's {self.max_seq_len} "
                            "(rebuild with a larger one)")
        if model_sha256 is not None and model_sha256 != self.model.get("weights_sha256"):
            problems.append(f"the engine was built from another model ({self.model.get('source')})")
        if problems:
            raise UserError(f"engine {self.path} does not fit the request: " + "; ".join(problems))


def load_engine_config(path: str | os.PathLike) -> EngineConfig:
    """Read and validate an engine dir's config.json (UserError naming what is wrong)."""
    root = Path(path)
    file = root / "config.json"
    if not file.is_file():
        raise UserError(f"{root} is not an engine dir (no config.json); build one with `trt-lookahead build`")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{file} is not valid JSON ({exc}); rebuild the engine") from exc
    if not isinstance(raw, dict) or FORMAT_KEY not in raw:
        raise UserError(f"{root} is a model checkpoint or another tool's output, not a trt-lookahead engine dir")
    version = raw[FORMAT_KEY]
    if version != FORMAT_VERSION:
        raise UserError(
            f"engine {root} has format version {version!r} but this trt-lookahead reads version {FORMAT_VERSION}; "
            "rebuild it with `trt-lookahead build --force`"
        )
    missing = [name for name in raw.get("graphs", {}).values() if not (root / name).is_file()]
    if "graphs" not in raw or missing:
        raise UserError(f"engine {root} is incomplete (missing {', '.join(missing) or 'graphs'}); rebuild it")
    return EngineConfig(root, raw)


# -- exporting the graphs ---------------------------------------------------------------------------


def _graph_module(model, attention: str):
    """The export wrapper: one forward of the shared `Llama` against read-only per-layer caches.

    It drives the model through its public forward and attention seam: the model writes each layer's
    step K/V into a [T]-row scratch cache (cache_len 0), so the seam hands the attention function the
    step's own K/V, and the function pairs them with that layer's real cache (graph inputs).
    """
    import torch

    from trt_lookahead.plugins import onnx_op, reference

    cfg = model.cfg
    layers, kv_heads, head_dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    scale = reference.default_scale(head_dim)
    attrs = onnx_op.node_attributes(cfg.num_heads, kv_heads, head_dim, scale)

    def step_mask(tokens, step_config):
        idx = torch.arange(tokens)
        rows, cols = idx[:, None], idx[None, :]
        window, ngram, verify = step_config.long().unbind(0)
        lookahead = reference.visible(rows, cols, window.clamp_min(1), ngram.clamp_min(2), verify)
        causal = window == 0
        return (causal & (cols <= rows)) | (~causal & lookahead)

    class StepGraph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, positions, cache_len, step_config, output_slots, caches):
            tokens = input_ids.shape[0]
            key_caches, value_caches = caches[:layers], caches[layers:]
            scratch_k = torch.zeros(layers, tokens, kv_heads, head_dim, dtype=model.dtype)
            scratch_v = torch.zeros_like(scratch_k)
            if attention == "native":
                prefix = torch.arange(key_caches[0].shape[1])[None, :] < cache_len.long()
                full_mask = torch.cat([prefix.expand(tokens, -1), step_mask(tokens, step_config)], 1)
            presents = []

            def attend(q, k_new, v_new, _zero, _mask):
                layer = len(presents)
                presents.append((k_new, v_new))
                kc, vc = key_caches[layer], value_caches[layer]
                if attention == "native":  # keys = [cache rows ; step rows], no past/present (see docstring)
                    keys = torch.cat([kc, k_new.transpose(0, 1)], 1)[None]
                    values = torch.cat([vc, v_new.transpose(0, 1)], 1)[None]
                    y = torch.onnx.ops.attention(q.transpose(0, 1)[None], keys, values, full_mask, scale=scale)[0]
                    return y[0].transpose(0, 1)
                if torch.onnx.is_in_onnx_export():
                    return torch.onnx.ops.symbolic(
                        f"{reference.OP_DOMAIN}::{reference.OP_NAME}",
                        [q, k_new, v_new, kc, vc, cache_len, step_config], attrs,
                        dtype=q.dtype, shape=q.shape, version=reference.OP_VERSION,
                    )
                return reference.lookahead_attention(q, k_new, v_new, kc, vc, cache_len, step_config, scale=scale)

            zero = torch.zeros((), dtype=torch.long)
            placeholder = torch.ones(1, 1, dtype=torch.bool)
            logits = model(input_ids, positions, scratch_k, scratch_v, zero, placeholder, output_slots.long(),
                           attention=attend)
            keys = torch.stack([k for k, _ in presents]).transpose(1, 2)  # [L, Hkv, T, D]
            values = torch.stack([v for _, v in presents]).transpose(1, 2)
            return logits.argmax(-1).to(torch.int32), logits.float(), keys, values

    return StepGraph().eval()


def example_inputs(model, tokens: int, cache_rows: int) -> tuple:
    """Arguments of the graph module: `tokens` step tokens against an empty cache of `cache_rows` rows."""
    import torch

    cfg = model.cfg
    cache = [torch.zeros(cfg.num_kv_heads, cache_rows, cfg.head_dim, dtype=model.dtype)
             for _ in range(2 * cfg.num_layers)]
    return (torch.zeros(tokens, dtype=torch.int32), torch.arange(tokens, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
            torch.arange(tokens, dtype=torch.int32), cache)


def export_graph(model, attention: str, cache_rows: int, max_tokens: int):
    """Export the network with a dynamic token count 1..max_tokens (the prefill graph). -> onnx.ModelProto.

    Dimension names: `tokens` (input_ids, positions, the present K/V) and `rows` (output_slots and the
    outputs read from them).
    """
    import torch

    module = _graph_module(model, attention)
    args = example_inputs(model, min(8, max(2, max_tokens)), cache_rows)
    names = [*INPUTS, *cache_names(model.cfg.num_layers)]
    tokens = torch.export.Dim("tokens", min=1, max=max_tokens)
    rows = torch.export.Dim("rows", min=1, max=max_tokens)
    dynamic = ({0: tokens}, {0: tokens}, None, None, {0: rows}, [None] * (2 * model.cfg.num_layers))
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, input_names=names, output_names=list(OUTPUTS), dynamo=True, opset_version=OPSET,
            dynamic_shapes=dynamic, optimize=True, verbose=False,
        )
    proto = program.model_proto
    _strip_metadata(proto)
    graph = proto.graph
    inputs = {i.name: i for i in graph.input}
    _rename_dims(proto, {_dim(inputs["input_ids"], 0).dim_param: "tokens",
                         _dim(inputs["output_slots"], 0).dim_param: "rows"})
    if attention == "plugin":
        from trt_lookahead.plugins import onnx_op

        del proto.opset_import[:]
        proto.opset_import.extend(onnx_op.opset_imports(OPSET))
    return proto


def fix_tokens(proto, tokens: int):
    """A copy of the dynamic graph with the token count pinned to `tokens` (the step graph)."""
    import onnx

    fixed = onnx.ModelProto()
    fixed.CopyFrom(proto)
    for value in [*fixed.graph.input, *fixed.graph.output, *fixed.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == "tokens":
                dim.dim_value = tokens
    return fixed


def _dim(value, index: int):
    return value.type.tensor_type.shape.dim[index]


def _rename_dims(proto, names: dict[str, str]) -> None:
    for value in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]


def _strip_metadata(proto) -> None:
    """Drop the exporter's per-node stack traces and class paths (they name this machine's files)."""
    for node in proto.graph.node:
        del node.metadata_props[:]
    del proto.metadata_props[:]


def save_graphs(graphs: dict[str, Any], out_dir: Path, weights_file: str = WEIGHTS_FILE) -> None:
    """Save each named graph beside one shared external-data file (equal initializers stored once)."""
    import onnx
    from onnx.external_data_helper import set_external_data

    stored: dict[tuple[str, bytes], tuple[int, int]] = {}
    with open(out_dir / weights_file, "wb") as data:
        for filename, proto in graphs.items():
            for tensor in proto.graph.initializer:
                raw = tensor.raw_data or onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor)).raw_data
                if len(raw) < _INLINE_BYTES:
                    continue
                key = (tensor.name, hashlib.sha256(raw).digest())
                if key not in stored:
                    offset = data.tell()
                    data.write(raw)
                    data.write(b"\0" * (-data.tell() % 64))  # keep every tensor 64-byte aligned
                    stored[key] = (offset, len(raw))
                offset, length = stored[key]
                set_external_data(tensor, location=weights_file, offset=offset, length=length)
                tensor.ClearField("raw_data")
                for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    tensor.ClearField(field)
                tensor.data_location = onnx.TensorProto.EXTERNAL
            onnx.save_model(proto, str(out_dir / filename))


# -- the build command ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildRequest:
    model_dir: Path
    output: Path
    lookahead: LookaheadConfig
    max_seq_len: int
    max_input_len: int
    dtype: str
    attention: str
    target: str
    force: bool

    def key(self, weights_sha256: str) -> dict:
        """What identifies a build: equal keys mean an existing engine dir already is this build."""
        return {
            "format": FORMAT_VERSION, "weights_sha256": weights_sha256, "lookahead": str(self.lookahead),
            "max_seq_len": self.max_seq_len, "max_input_len": self.max_input_len, "dtype": self.dtype,
            "attention": self.attention, "target": self.target,
        }


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_request(args) -> BuildRequest:
    """Validate the build arguments (UserError with one clear line)."""
    from trt_lookahead.models.fetch import resolve_model

    dtype = str(args.dtype).lower()
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {args.dtype!r}; use one of {', '.join(DTYPES)}")
    lookahead = LookaheadConfig.parse(args.lookahead_config) if args.lookahead_config else LookaheadConfig(4, 3, 4)
    max_seq_len = int(args.max_seq_len)
    max_input_len = int(args.max_input_len) if args.max_input_len is not None else max_seq_len
    if max_input_len < 1:
        raise UserError(f"max_input_len {max_input_len} is impossible; a prompt has at least one token")
    if max_seq_len < max_input_len:
        raise UserError(
            f"max_seq_len {max_seq_len} is below the prompt limit max_input_len {max_input_len}; "
            "max_seq_len counts the prompt plus the generated tokens, so give max_seq_len >= max_input_len"
        )
    output = Path(args.output)
    model_dir = resolve_model(args.model)
    return BuildRequest(model_dir, output, lookahead, max_seq_len, max_input_len, dtype,
                        getattr(args, "attention", "plugin") or "plugin", getattr(args, "target", "onnx") or "onnx",
                        bool(getattr(args, "force", False)))


def weights_sha256(model_dir: Path) -> str:
    """One checksum over a checkpoint's weight files (what config.json records as the model's identity)."""
    from trt_lookahead.models.checkpoint import weight_files
    from trt_lookahead.models.fetch import sha256_file

    return hashlib.sha256("".join(sha256_file(f) for f in weight_files(Path(model_dir))).encode()).hexdigest()


def _existing_build(output: Path) -> dict | None:
    try:
        return json.loads((output / "config.json").read_text(encoding="utf-8")).get("build_key")
    except (OSError, ValueError, AttributeError):
        return None


def run_build(args) -> int:
    request = parse_request(args)
    from trt_lookahead.models.checkpoint import read_config, weight_files

    cfg = read_config(request.model_dir)
    if request.max_seq_len > cfg.max_position_embeddings:
        raise UserError(
            f"max_seq_len {request.max_seq_len} exceeds the model's context of {cfg.max_position_embeddings}; "
            f"ask for at most {cfg.max_position_embeddings}"
        )
    files = weight_files(request.model_dir)
    weights_sha = weights_sha256(request.model_dir)
    key = request.key(weights_sha)
    output = request.output
    if output.exists() and not request.force:
        if _existing_build(output) == key:
            _log(f"{output} already holds this engine (same model, config and targets); nothing to do")
            return 0
        what = "a different engine" if _existing_build(output) is not None else "something that is not this engine"
        raise UserError(
            f"{output} already exists and holds {what}; pass --force to replace it or choose another --output"
        )
    if output.exists() and not output.is_dir():
        raise UserError(f"{output} exists and is a file; choose another --output")
    output.parent.mkdir(parents=True, exist_ok=True)
    work = output.parent / f".{output.name}.building-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        summary = build_engine_dir(request, cfg, files, weights_sha, key, work)
        _replace(work, output)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    _log(f"engine dir ready: {output} ({summary['size_mb']:.1f} MB, built in {summary['seconds']:.1f} s)")
    remaining = summary.get("tensorrt_remaining")
    if remaining:
        print(remaining)
    return 0


def _replace(work: Path, output: Path) -> None:
    """Rename the finished build into place; an old engine dir is moved aside first and removed after."""
    old = None
    if output.exists():
        old = output.parent / f".{output.name}.old-{os.getpid()}"
        output.rename(old)
    work.rename(output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_engine_dir(request: BuildRequest, cfg, files: list[Path], weights_sha: str, key: dict, out: Path) -> dict:
    """Write and check every file of the engine dir into `out`; returns a summary for the log."""
    import onnx
    import torch

    from trt_lookahead.layout import StepLayout
    from trt_lookahead.models.checkpoint import load_llama

    start = time.perf_counter()
    lookahead = request.lookahead
    T = lookahead.tokens_per_step
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
        "tokens_per_step": T,
        "output_slots": layout.output_slots.tolist(),
        "cache_rows": rows,
        "cache_layout": "[num_kv_heads, cache_rows, head_dim] per layer",
        "attention": request.attention,
        "plugin": _plugin_contract() if request.attention == "plugin" else None,
        "graphs": {"step": STEP_GRAPH, "prefill": PREFILL_GRAPH},
        "weights": WEIGHTS_FILE,
        "inputs": [*INPUTS, f"key_cache_0..{cfg.num_layers - 1}", f"value_cache_0..{cfg.num_layers - 1}"],
        "outputs": list(OUTPUTS),
        "opset": OPSET,
        "tokenizer_files": tokenizer_files,
        "build_key": key,
        "built_with": {"trt_lookahead": _version(), "torch": torch.__version__, "onnx": onnx.__version__},
        "targets": {"onnx": {"built": True}},
    }
    _write_config(out, config)

    _log(f"[4/{steps}] smoke step under onnxruntime against the torch executor")
    config["targets"]["onnx"]["smoke_check"] = smoke_check(out, model, lookahead, request.max_seq_len)
    del model

    if request.target == "tensorrt":
        _log(f"[5/{steps}] TensorRT plan")
        config["targets"]["tensorrt"] = tensorrt_target(out, request)
    config["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                       for p in sorted(out.iterdir()) if p.is_file() and p.name != "config.json"}
    _log(f"[{steps}/{steps}] writing config.json")
    config["build_seconds"] = round(time.perf_counter() - start, 2)
    _write_config(out, config)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return {"seconds": time.perf_counter() - start, "size_mb": size / 2**20,
            "tensorrt_remaining": config["targets"].get("tensorrt", {}).get("remaining")}


def _plugin_contract() -> dict:
    from trt_lookahead.plugins import onnx_op, reference

    return {"op_type": reference.OP_NAME, "domain": reference.OP_DOMAIN, "version": reference.OP_VERSION,
            "plugin_namespace": reference.OP_DOMAIN, "plugin_version": onnx_op.PLUGIN_VERSION, "aot": 1}


def _write_config(out: Path, config: dict) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _sha256(path: Path) -> str:
    from trt_lookahead.models.fetch import sha256_file

    return sha256_file(path)


def _version() -> str:
    from trt_lookahead import __version__

    return __version__


SMOKE_PROMPT_TOKENS = 12


def smoke_check(engine_dir: Path, model, lookahead: LookaheadConfig, max_seq_len: int) -> dict:
    """Prefill + two steps under onnxruntime and under the torch executor; the tokens must agree.

    Returns what was compared. Raises UserError on a mismatch (float32), or records the match rate
    (bfloat16 / float16, where rounding may differ); a dtype onnxruntime's CPU kernels cannot run is
    recorded as not checked, with the reason.
    """
    import numpy as np
    import torch

    from trt_lookahead.executors.onnxruntime import OnnxRuntimeUnsupported, open_engine
    from trt_lookahead.executors.torch import TorchExecutor
    from trt_lookahead.layout import StepLayout
    from trt_lookahead.sampling import SamplingParams

    layout = StepLayout(lookahead)
    rng = np.random.default_rng(0)
    vocab = model.cfg.vocab_size
    prompt = rng.integers(0, vocab, min(SMOKE_PROMPT_TOKENS, max_seq_len - 1))
    try:
        engine = open_engine(engine_dir, backend="onnxruntime", threads=1)
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
        ids = rng.integers(0, vocab, layout.tokens)
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


def tensorrt_target(out: Path, request: BuildRequest) -> dict:
    """Build engine.plan where TensorRT and a GPU exist; else record exactly what remains to run."""
    from trt_lookahead.executors import tensorrt as trt_executor

    missing = trt_executor.unavailable_reason()
    if missing is None:
        seconds = trt_executor.build_plan(out)
        return {"built": True, "plan": PLAN_FILE, "build_seconds": round(seconds, 2)}
    final = request.output
    command = f"python -m trt_lookahead.executors.tensorrt {final}"
    remaining = (
        f"TensorRT plan not built here ({missing}). Everything else is in {final}. "
        f"On a GPU host with TensorRT >= 10.9 and triton installed, run:\n    {command}\n"
        f"It parses {PREFILL_GRAPH} with the LookaheadAttention plugin registered, builds the strongly typed "
        f"network with its optimisation profiles (prefill 1..{request.max_input_len} tokens, step "
        f"T={request.lookahead.tokens_per_step}, single token), writes {PLAN_FILE} and records it in config.json."
    )
    _log("      " + remaining.splitlines()[0])
    return {"built": False, "reason": missing, "command": command, "remaining": remaining}
