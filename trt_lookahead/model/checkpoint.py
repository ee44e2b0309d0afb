"""Load a Hugging Face Llama checkpoint (config.json + safetensors) into `Llama`, without transformers.

    model, cfg = load_llama("path/to/checkpoint", dtype="float32")   # or "bfloat16" / "float16"
    tokenizer = load_tokenizer("path/to/checkpoint")                 # also an engine dir's copy

Reads `model.safetensors`, or the shards named by `model.safetensors.index.json`. Every problem with
the directory raises one `UserError` that names the problem and the fix: a missing directory,
missing or malformed config.json, a non-Llama architecture, pickle (*.bin / *.pt) or GGUF weights
(convert to safetensors), missing or truncated weight files, missing tensors, shape mismatches,
NaN or infinite weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from trt_lookahead.errors import UserError, as_int
from trt_lookahead.files import file_digests
from trt_lookahead.model.llama import WEIGHT_LAYOUTS, Linear, Llama, ModelConfig

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_FILE = "model.safetensors.index.json"
HEAD = "lm_head.weight"
# tokenizer_config.json classes AutoTokenizer loads a Llama's tokenizer.json with as it is (PreTrainedTokenizerFast,
# TokenizersBackend in transformers 5)
PLAIN_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
CONVERT_HINT = (
    "convert it once with transformers: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT, "
    "safe_serialization=True), and copy the tokenizer files along"
)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif str(dtype).lower() in DTYPES:
        return DTYPES[str(dtype).lower()]
    raise UserError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")


def read_config(path: str | os.PathLike) -> ModelConfig:
    """Validate `path` as a Llama checkpoint directory and return its ModelConfig."""
    root = Path(path)
    if not root.exists():
        raise UserError(f"model directory {root} does not exist; pass a local Hugging Face Llama checkpoint directory")
    if not root.is_dir():
        raise UserError(
            f"model path {root} is a file, not a directory; pass the checkpoint directory that holds config.json"
        )
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise UserError(
            f"{root} has no config.json; a Hugging Face checkpoint directory needs config.json beside its weights"
        )
    try:
        hf = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{cfg_path} is not valid JSON ({exc}); restore it from the original checkpoint") from exc
    if not isinstance(hf, dict):
        raise UserError(f"{cfg_path} holds a JSON {type(hf).__name__}, not an object; restore the original config.json")
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    is_llama = model_type == "llama" if model_type is not None else any(str(a).startswith("Llama") for a in archs)
    if not is_llama or any(not str(a).startswith("Llama") for a in archs):
        what = f"model_type {model_type!r}" + (f", architectures {archs}" if archs else "")
        raise UserError(
            f"{root} is not a Llama checkpoint ({what}); only Llama-architecture models "
            "(model_type 'llama', LlamaForCausalLM) are supported"
        )
    try:
        return ModelConfig.from_hf(hf)
    except UserError as exc:
        raise UserError(f"{cfg_path}: {exc}") from exc


def weight_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, or a UserError saying what is there instead."""
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(
                f"{index} is malformed ({exc!r}); restore it from the original checkpoint or re-download it"
            ) from exc
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise UserError(
                f"{root} is missing weight shard(s) {', '.join(missing)} listed in {INDEX_FILE}; "
                "re-download the checkpoint"
            )
        return [root / n for n in names]
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(root.glob("*.safetensors"))
    if others:
        return others
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise UserError(
            f"{root} holds pickle weights ({', '.join(pickles)}), which are not loaded (unsafe, slow); "
            f"convert them to safetensors: {CONVERT_HINT}"
        )
    ggufs = sorted(p.name for p in root.glob("*.gguf"))
    if ggufs:
        raise UserError(
            f"{root} holds GGUF weights ({', '.join(ggufs)}) but no safetensors; pass the .gguf file itself to "
            "--model (converted once into the cache)"
        )
    raise UserError(f"{root} has no model.safetensors (nor {INDEX_FILE}); re-download or re-convert the checkpoint")


def weights_sha256(root: str | os.PathLike) -> str:
    """One checksum over a checkpoint's weight files: the model's identity an engine dir records (each file's
    digest remembered while it is unchanged: files.file_digests)."""
    return hashlib.sha256("".join(file_digests(weight_files(Path(root)))).encode()).hexdigest()


def check_max_seq_len(requested: int | None, context: int, default: int) -> int:
    """`requested` (prompt + generated tokens), or min(context, default) for None; UserError if it is below 2
    or beyond the model's context."""
    if requested is None:
        return min(context, default)
    if as_int("max_seq_len", requested) < 2:
        raise UserError(f"max_seq_len {requested} is too small; give at least 2 (prompt + one new token)")
    if requested > context:
        raise UserError(f"max_seq_len {requested} exceeds the model's context of {context}; ask for at most {context}")
    return int(requested)


def _tokenizer_class(root: Path) -> Any:
    """The transformers class that loads `root`'s tokenizer: AutoTokenizer, or the class it would choose when the
    tokenizer_config names the plain tokenizer.json one. Named directly, that skips AutoTokenizer's model config
    (AutoConfig imports transformers' model code: seconds of every start)."""
    try:
        config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):  # not a tokenizer config: AutoTokenizer names the problem
        config = {}
    plain = config.get("tokenizer_class") in PLAIN_TOKENIZER_CLASSES and "auto_map" not in config
    if plain and (root / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a checkpoint or engine dir (as transformers' AutoTokenizer loads it), or a UserError if it
    has none."""
    root = Path(path)
    if not any((root / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise UserError(f"{root} has no tokenizer (tokenizer.json); copy the model's tokenizer files into it")
    tokenizer_class = _tokenizer_class(root)  # imports transformers, which sets its logger's level: before ours
    library_log = logging.getLogger("transformers")
    level = library_log.level
    library_log.setLevel(logging.ERROR)  # its fallback warnings would precede our one error line
    try:
        return tokenizer_class.from_pretrained(str(root))
    except Exception as exc:  # transformers and tokenizers raise many types for a corrupt file
        if not (root / "tokenizer.json").is_file():  # the slow fallback's own complaint (tiktoken, ...) misleads
            raise UserError(
                f"{root} has no tokenizer.json, and its other tokenizer files cannot be read without it "
                f"({type(exc).__name__}); copy tokenizer.json from the original checkpoint into {root}"
            ) from exc
        raise UserError(
            f"the tokenizer files in {root} cannot be read ({type(exc).__name__}: {exc}); restore them from the "
            "original checkpoint"
        ) from exc
    finally:
        library_log.setLevel(level)


def hf_key(name: str) -> str:
    """The HF LlamaForCausalLM key of a name from `expected_tensors`."""
    return name if name == HEAD else f"model.{name}"


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a HF Llama checkpoint with this config -> shape: the decoder's without its 'model.'
    prefix, and lm_head.weight only when it is not tied to the embedding."""
    h, q, kv, f = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes[HEAD] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, out, inp in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            shapes[f"{p}self_attn.{name}.weight"] = (out, inp)
            if cfg.attention_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        for name, out, inp in (("gate_proj", f, h), ("up_proj", f, h), ("down_proj", h, f)):
            shapes[f"{p}mlp.{name}.weight"] = (out, inp)
            if cfg.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = (out,)
    return shapes


def weight_bytes(path: str | os.PathLike, dtype: str) -> int:
    """Bytes of the checkpoint's weights in `dtype` (a tied head counted once): what a step reads at least once."""
    shapes = expected_tensors(read_config(path)).values()
    return sum(math.prod(shape) for shape in shapes) * parse_dtype(dtype).itemsize


def check_weights(path: str | os.PathLike) -> None:
    """UserError naming the problem if the checkpoint's weight files lack a tensor its config.json requires, hold
    one of another shape, or cannot be read (headers only: nothing is loaded)."""
    _locate_tensors(weight_files(Path(path)), read_config(path))


def _locate_tensors(files: list[Path], cfg: ModelConfig) -> dict[str, tuple[Path, str]]:
    """Where every expected tensor is (HF names without the decoder prefix -> (file, key)), checking presence and
    shape from the files' headers."""
    wanted = expected_tensors(cfg)
    located: dict[str, tuple[Path, str]] = {}
    for file in files:
        with _opened(file) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = key.removeprefix("model.")
                if name not in wanted:
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != wanted[name]:
                    raise UserError(
                        f"tensor {key} in {file} has shape {list(shape)} but config.json implies "
                        f"{list(wanted[name])}; the weights and config.json do not match"
                    )
                located[name] = (file, key)
    missing = [n for n in wanted if n not in located]
    if missing:
        shown = ", ".join(hf_key(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise UserError(
            f"checkpoint {files[0].parent} lacks tensor(s) {shown}{more} that its config.json requires; "
            "the weights do not belong to this config or are incomplete: re-download the checkpoint"
        )
    return located


def read_tensors(files: list[Path], cfg: ModelConfig, dtype: torch.dtype,
                 parts: Mapping[str, tuple[int, slice]] | None = None,
                 names: Collection[str] | None = None) -> dict[str, Tensor]:
    """Read every expected tensor (HF names without the decoder prefix), or only those in `names`, checking the
    presence and shape of all first. A name in `parts` is read as only its (dim, slice) of rows (0) or columns (1):
    the rest stays in the file (a tensor-parallel rank's shard)."""
    parts = parts or {}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, (file, key) in _locate_tensors(files, cfg).items():
        if names is None or name in names:
            by_file.setdefault(file, []).append((name, key))
    out: dict[str, Tensor] = {}
    for file, items in by_file.items():
        with _opened(file) as f:
            for name, key in items:
                if name in parts:
                    dim, kept = parts[name]
                    tensor = f.get_slice(key)[kept] if dim == 0 else f.get_slice(key)[:, kept]
                else:
                    tensor = f.get_tensor(key)
                out[name] = tensor.to(dtype)
                _check_finite(tensor, out[name], key, file)
    return out


def non_finite(weight: Tensor) -> int:
    """How many of a float `weight`'s values are NaN or infinite: 0 after one aminmax pass (NaN and infinities
    reach the min or max; no mask is made, so every weight read can afford it), counted only where that finds one."""
    if not weight.numel():
        return 0
    low, high = torch.aminmax(weight)
    if bool(torch.isfinite(low) & torch.isfinite(high)):
        return 0
    return int((~torch.isfinite(weight)).sum())


def _check_finite(raw: Tensor, converted: Tensor, key: str, file: Path) -> None:
    """UserError if weight `key` of `file`, read as `raw` and held as `converted`, has a NaN or an infinity: the
    file's own (a corrupt checkpoint: every token would come out wrong, silently) or the conversion's (values past
    float16's range)."""
    count = non_finite(converted)
    if not count:
        return
    what = f"weight {key} in {file}"
    if not non_finite(raw):
        raise UserError(f"{what} holds {count} value(s) past {str(converted.dtype).removeprefix('torch.')}'s range "
                        f"(largest magnitude {float(raw.abs().max()):.4g}); run it in float32 or bfloat16 (--dtype)")
    raise UserError(f"{what} holds {count} NaN or infinite value(s); the checkpoint is corrupt: re-download or "
                    "re-convert it")


@contextlib.contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """safe_open(file), a read failure inside raised as one UserError naming the file. safe_open maps the file
    copy-on-write, which a system may refuse for a file larger than its memory and swap: that says so."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise UserError(f"weight file {file} is unreadable ({exc}); it is probably truncated or corrupt: "
                        "re-download it") from exc
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        raise UserError(f"weight file {file} ({file.stat().st_size / 2**30:.1f} GiB) cannot be mapped here ({exc}): "
                        "the safetensors library maps a file copy-on-write, which this system refuses beyond its "
                        "memory and swap; save the checkpoint in shards of a few GB (transformers: "
                        "save_pretrained(dir, max_shard_size='4GB')), or add swap") from exc


def fused_parts(cfg: ModelConfig) -> dict[str, list[str]]:
    """This package's `Llama` state dict names -> the HF tensors (names without the decoder prefix) each one is:
    q/k/v and gate/up concatenated along the rows, in that order; a tied lm_head is the embedding."""
    parts = {"tok_embeddings.weight": ["embed_tokens.weight"], "norm.weight": ["norm.weight"],
             "output.weight": ["embed_tokens.weight" if cfg.tie_word_embeddings else HEAD]}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        parts[p + "attention_norm.weight"] = [p + "input_layernorm.weight"]
        parts[p + "ffn_norm.weight"] = [p + "post_attention_layernorm.weight"]
        for kind in ["weight"] + (["bias"] if cfg.attention_bias else []):
            parts[f"{p}attention.wqkv.{kind}"] = [f"{p}self_attn.{n}_proj.{kind}" for n in "qkv"]
            parts[f"{p}attention.wo.{kind}"] = [f"{p}self_attn.o_proj.{kind}"]
        for kind in ["weight"] + (["bias"] if cfg.mlp_bias else []):
            parts[f"{p}feed_forward.w13.{kind}"] = [f"{p}mlp.gate_proj.{kind}", f"{p}mlp.up_proj.{kind}"]
            parts[f"{p}feed_forward.w2.{kind}"] = [f"{p}mlp.down_proj.{kind}"]
    return parts


def _fused(tensors: list[Tensor]) -> Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def to_state_dict(hf: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF tensor names -> this package's `Llama` state dict (q/k/v and gate/up fused: `fused_parts`)."""
    return {name: _fused([hf[n] for n in names]) for name, names in fused_parts(cfg).items()}


def load_llama(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    weight_layout: str = "out_in",
) -> tuple[Llama, ModelConfig]:
    """Load a HF Llama checkpoint directory as (`Llama` in eval mode on `device`, its `ModelConfig`).

    weight_layout: 'out_in' (nn.Linear's [out, in], lm_head tied as in the checkpoint: the layout to
    export or to move between devices), or 'auto' for running the torch executor: 'onednn' on x86
    CPUs (oneDNN-packed weights: row-invariant, and faster from hidden >= 256), else 'out_in';
    'in_out' and 'onednn' may be named too. See `llama.auto_weight_layout`.
    """
    torch_dtype = parse_dtype(dtype)
    layouts = ("auto", *WEIGHT_LAYOUTS)
    if weight_layout not in layouts:
        raise UserError(f"weight layout {weight_layout!r} is not one of {', '.join(layouts)}")
    cfg = read_config(path)
    files = weight_files(Path(path))
    hf = read_tensors(files, cfg, torch_dtype)
    with torch.device("meta"):
        model = Llama(cfg, dtype=torch_dtype)
    model.load_state_dict(to_state_dict(hf, cfg), assign=True, strict=True)
    model.tie_weights()
    model = model.to(device).eval().requires_grad_(False)
    try:
        model.set_weight_layout(weight_layout)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return model, cfg


Reader = Callable[[], Tensor]  # reads one weight from the checkpoint when called


def load_llama_deferred(path: str | Path, min_bytes: int) -> tuple[Llama, ModelConfig, dict[str, Reader]]:
    """`load_llama(path)`'s float32 model with its bias-free projections of `min_bytes` or more not read: each such
    weight is a FakeTensor (torch's: a shape and dtype, no data), and -> {its name: a function reading it from the
    checkpoint as float32}, for a quantized build to read one projection at a time (docs/design.md 6.5). The model
    exports (engine/export.py); it runs once `read_deferred` has read every fake weight still in it. A tied lm_head
    is the embedding, read now."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = read_config(path)
    files = weight_files(Path(path))
    located = _locate_tensors(files, cfg)
    parts = fused_parts(cfg)
    with torch.device("meta"):
        model = Llama(cfg, dtype=torch.float32)
    deferred: dict[str, Reader] = {
        f"{name}.weight": partial(_read_fused, [located[n] for n in parts[f"{name}.weight"]], module.weight.shape)
        for name, module in model.named_modules()
        if isinstance(module, Linear) and module.bias is None and module.weight.numel() * 4 >= min_bytes
        and parts[f"{name}.weight"] != parts["tok_embeddings.weight"]
    }
    hf = read_tensors(files, cfg, torch.float32,
                      names={n for name, names in parts.items() if name not in deferred for n in names})
    with FakeTensorMode():
        fakes = {name: torch.empty(model.get_parameter(name).shape) for name in deferred}
    state = {name: fakes[name] if name in deferred else _fused([hf[n] for n in names]) for name, names in parts.items()}
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    return model.eval().requires_grad_(False), cfg, deferred


def _read_fused(sources: list[tuple[Path, str]], shape: torch.Size) -> Tensor:
    """The (file, key) tensors concatenated along their rows into a float32 tensor of `shape` (their shapes were
    checked at the load), each part copied in as it is read."""
    out = torch.empty(shape, dtype=torch.float32)
    row = 0
    for file, key in sources:
        with _opened(file) as f:
            part = f.get_tensor(key)
        out[row : row + len(part)].copy_(part)
        _check_finite(part, out[row : row + len(part)], key, file)
        row += len(part)
    return out


def read_deferred(model: Llama, deferred: Mapping[str, Reader]) -> None:
    """Read every weight of a `load_llama_deferred` model that is still fake (a projection nothing replaced)."""
    from torch._subclasses.fake_tensor import FakeTensor

    for name, read in deferred.items():
        module, _, attr = name.rpartition(".")
        owner = model.get_submodule(module)
        if isinstance(getattr(owner, attr, None), FakeTensor):
            setattr(owner, attr, torch.nn.Parameter(read(), requires_grad=False))
