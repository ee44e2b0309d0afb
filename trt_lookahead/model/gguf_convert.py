"""Convert a llama.cpp GGUF file (Llama architecture; byte-level BPE or SentencePiece BPE vocabulary) into a
Hugging Face Llama checkpoint directory: config.json, generation_config.json, model.safetensors (float32; shards of
SHARD_BYTES and their index for a larger model), tokenizer.json and tokenizer_config.json.

Our own code, not transformers' model loading: the `gguf` package reads the tensors and dequantizes
them (Q4_0/Q4_1/Q8_0/K-quants/F16/F32 ...), the `tokenizers` library builds the tokenizer.

What llama.cpp changes on the way from HF to GGUF, and which is undone here:
- the rows of attn_q / attn_k are permuted so that RoPE rotates interleaved pairs (2i, 2i+1) of each
  head; HF's `rotate_half` rotates (i, i + d/2). `unpermute_qk` is the inverse of llama.cpp's `permute`.
- the tokenizer becomes a bare vocabulary + merges list + a named pre-tokenizer (`tokenizer.ggml.pre`);
  `build_tokenizer` rebuilds the pipeline that name stands for (for `smollm`: every digit split off
  on its own, then GPT-2 byte-level splitting; for `llama-bpe`, Llama 3's regex). A SentencePiece
  vocabulary (`llama`: Llama 2, Mistral) keeps its pieces and scores, its merges often not; it is rebuilt to
  tokenize as llama.cpp does (merges from the scores, a space before the text and after each special token,
  byte fallback).
- RoPE scaling: linear is metadata, Llama 3's a table of per-frequency divisors (`rope_freqs`), from which
  `rope_scaling_from_factors` recovers the config's llama3 parameters (design.md 6.9, "GGUF RoPE scaling").

    info = convert_gguf_to_hf("model.gguf", "out_dir", progress=True)

It writes the weights one tensor at a time (`write_weights`): a conversion holds one dequantized tensor, not the
float32 model (a 7B GGUF's is 27 GB), in files of at most 4 GiB (SHARD_BYTES), which the safetensors library can map
where one 27 GB file passes what a system without swap lets it map.

And the way back, for llama.cpp's `llama-server` beside us in `bench --peers llama-server`: `write_gguf` writes a
checkpoint's tensors in one dtype (no quantization: the same numbers our runtime holds), q/k rows permuted to
GGUF order, with the tokenizer keys llama-server needs built from tokenizer.json:

    write_gguf("models/smollm2", "smollm2-f32.gguf", dtype="float32")  # read back: gguf_tensors, dequantized
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trt_lookahead.errors import UserError

# llama.cpp tensor names -> HF Llama names; `{}` is the layer index.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4
_TOKEN_BYTE = 6  # SentencePiece byte-fallback pieces <0xNN>
_SPACE = "\u2581"  # SentencePiece's spelling of a space

# tokenizer.ggml.pre values whose split is plain GPT-2 byte-level, or GPT-2 after isolating every digit.
_PRE_GPT2 = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
_PRE_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
# ... and those whose split is Llama 3's regex (then byte-level spelling without GPT-2's regex)
_PRE_LLAMA3 = {"llama3", "llama-v3", "llama-bpe"}
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
# RoPE tables llama.cpp may store: rope_freqs is read as the config's scaling (`rope_table`); LongRoPE's (Phi-3) are
# refused unless all ones
_ROPE_FREQS = "rope_freqs.weight"
_ROPE_FACTORS = {_ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight"}


@dataclass
class ConversionInfo:
    """What `convert_gguf_to_hf` wrote and how long it took."""

    out_dir: Path
    files: list[str]
    config: dict[str, Any]
    num_parameters: int
    tensor_types: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------
# metadata


def read_metadata(reader) -> dict[str, Any]:
    """Every key-value field of a `gguf.GGUFReader` as Python values (strings, numbers, lists)."""
    meta: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = fld.contents()
        if isinstance(value, np.generic):
            value = value.item()
        meta[key] = value
    return meta


def _f32_to_float(x: float) -> float:
    """The shortest decimal that rounds to the same float32 (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def build_config(meta: dict[str, Any], tensor_names: Sequence[str], rope_freqs: np.ndarray | None = None
                 ) -> dict[str, Any]:
    """HF `LlamaConfig` dict from GGUF metadata (`llama.*`, `tokenizer.ggml.*`), the tensor list and the file's
    `rope_freqs` table if it has one (`rope_table`)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UserError(f"GGUF architecture is {arch!r}; only 'llama' can be converted")

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        full = f"llama.{key}"
        if full in meta:
            return meta[full]
        if required and default is None:
            raise UserError(f"GGUF metadata lacks {full!r}; the file is incomplete or not a llama model")
        return default

    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    if isinstance(meta.get("llama.attention.head_count_kv"), list):
        raise UserError("GGUF has a per-layer KV head count; not supported")
    n_kv = int(get("attention.head_count_kv", n_heads))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UserError("GGUF has different key and value head sizes; not supported")
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UserError(f"GGUF rotates {rope_dim} of {head_dim} head dims (partial RoPE); not supported")
    if n_heads % n_kv:
        raise UserError(f"GGUF head counts {n_heads}/{n_kv} are not a valid GQA grouping")

    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab_size = int(get("vocab_size", len(tokens) or None))
    rope_theta = _f32_to_float(get("rope.freq_base", 10000.0, required=False))
    rope_scaling = _rope_scaling(get, rope_freqs, head_dim, rope_theta)
    eps = _f32_to_float(get("attention.layer_norm_rms_epsilon"))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id", eos)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": eps,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
        "rope_scaling": rope_scaling,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def _rope_scaling(get: Any, rope_freqs: np.ndarray | None, head_dim: int, theta: float) -> dict[str, Any] | None:
    """HF `rope_scaling` from llama.cpp's two ways of saying it: `rope.scaling.type` linear with its factor (the
    frequencies divided by it), or a `rope_freqs` table (`rope_scaling_from_factors`). YaRN and the rest are refused."""
    kind = get("rope.scaling.type", "none", required=False)
    if kind == "linear":
        factor = _f32_to_float(get("rope.scaling.factor"))
        by_type = None if factor == 1 else {"rope_type": "linear", "factor": factor}
    elif kind in ("none", None):
        by_type = None
    else:
        raise UserError(f"GGUF uses RoPE scaling {kind!r}; only Llama 3's (a rope_freqs table) and linear are "
                        "supported: run the model's HF checkpoint directory instead (--model DIR)")
    by_table = None if rope_freqs is None else rope_scaling_from_factors(rope_freqs, head_dim, theta)
    if by_type and by_table:
        raise UserError("GGUF scales RoPE twice (linear rope.scaling.type and a rope_freqs table); not supported: "
                        "run the model's HF checkpoint directory instead (--model DIR)")
    return by_type or by_table


def build_generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
    }


# ---------------------------------------------------------------------------------------------
# tensors


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `permute` (convert_hf_to_gguf.py): HF rotate_half row order -> interleaved pairs.

    Per head, row j < d/2 goes to 2j and row d/2 + j to 2j + 1. Given for tests and round trips.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk`: a GGUF attn_q/attn_k weight (or bias) back to HF's row order.

    `n_head` is the number of heads the rows belong to: attention heads for q, KV heads for k.
    """
    if w.shape[0] % (2 * n_head):
        raise ValueError(f"{w.shape[0]} rows do not split into {n_head} heads of even size")
    return np.ascontiguousarray(
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name for a GGUF tensor name; None for tensors that are deliberately dropped."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name in _ROPE_FACTORS:
        return None
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        rest = parts[2]
        if rest in _LAYER_TENSORS:
            return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[rest]}"
    raise UserError(f"GGUF tensor {gguf_name!r} has no HF Llama counterpart; the file is not a plain llama model")


# ---------------------------------------------------------------------------------------------
# RoPE scaling: llama.cpp's per-frequency divisors (`rope_freqs`) <-> HF's `llama3` parameters


def rope_table(reader) -> np.ndarray | None:
    """A GGUF's `rope_freqs` table (None if it has none), for `build_config`. A LongRoPE table that changes the
    frequencies is a UserError: no config this converter writes can say it."""
    table = None
    for t in reader.tensors:
        data = np.asarray(t.data, np.float32) if t.name in _ROPE_FACTORS else None
        if t.name == _ROPE_FREQS:
            table = data
        elif data is not None and not np.all(data == 1):
            raise UserError(f"GGUF tensor {t.name!r} scales RoPE per frequency (LongRoPE); converting that is not "
                            "supported: run the model's HF checkpoint directory instead (--model DIR)")
    return table


def llama3_rope_factors(scaling: dict[str, Any], head_dim: int, theta: float) -> np.ndarray:
    """The [head_dim / 2] float32 `rope_freqs` table llama.cpp's converter writes for HF `llama3` scaling: each
    frequency's divisor, 1 where the wavelength is below original / high_freq_factor, `factor` above
    original / low_freq_factor, and smoothly between (the same float32 operations as the converter). The model
    itself computes its frequencies as transformers does (llama.rope_inv_freq), which rounds otherwise than
    dividing by this table: the table is only what a GGUF holds."""
    import torch

    from trt_lookahead.model.llama import rope_default_inv_freq

    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / rope_default_inv_freq(theta, head_dim)  # [head_dim / 2] float32
    smooth = (old / wavelen - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    table = torch.where(wavelen < old / high, 1.0, torch.where(wavelen > old / low, factor, between))
    return table.numpy().astype(np.float32)


def _round_llama3(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with the context length an integer and the factors at 6 significant digits (8191.9999 -> 8192)."""
    return {**raw, **{k: float(f"{raw[k]:.6g}") for k in ("factor", "high_freq_factor")},
            "original_max_position_embeddings": round(raw["original_max_position_embeddings"])}


def rope_scaling_from_factors(table: np.ndarray, head_dim: int, theta: float) -> dict[str, Any] | None:
    """The HF `rope_scaling` a GGUF's `rope_freqs` table stands for: None when it is all ones, `linear` when one
    divisor serves every frequency, else `llama3`'s parameters. llama.cpp keeps only the table, so they are
    recovered from it: the lowest frequency's divisor is `factor`; between the two bands each divisor t gives
    s = (1/t - 1/factor) / (1 - 1/factor), which is linear in the frequency (s = a * freq / 2pi - b); a fit
    through those points, with low_freq_factor 1, gives high_freq_factor = 1 + 1/b and the original context
    a/b. The parameters are accepted only if they give the table back (`llama3_rope_factors`); anything else is
    refused by name. Worked example, Llama 3.1 8B (head_dim 128, theta 500000): 1 for the first 29 frequencies,
    8 for the last 29, 6 between -> factor 8, low 1, high 4, original context 8192."""
    t = np.asarray(table, np.float64)
    if t.shape != (head_dim // 2,):
        raise UserError(f"GGUF tensor 'rope_freqs.weight' has {t.size} entries; a head of {head_dim} dims needs "
                        f"{head_dim // 2}: the file is inconsistent")
    if np.all(t == 1):
        return None
    factor = float(t[-1])
    if np.all(t == factor) and factor > 0:
        return {"rope_type": "linear", "factor": factor}
    refusal = UserError("GGUF tensor 'rope_freqs.weight' scales RoPE per frequency in a way other than Llama 3's "
                        "(at least two frequencies smoothed between a band kept and a band divided by one factor); "
                        "converting it is not supported: run the model's HF checkpoint directory instead "
                        "(--model DIR)")
    middle = (t != 1) & (t != factor)
    if factor <= 1 or middle.sum() < 2:
        raise refusal
    from trt_lookahead.model.llama import rope_default_inv_freq

    x = rope_default_inv_freq(theta, head_dim).double().numpy() / (2 * math.pi)  # 1 / wavelength
    s = (1 / t - 1 / factor) / (1 - 1 / factor)
    a, minus_b = np.polyfit(x[middle], s[middle], 1)
    if not (a > 0 and minus_b < 0):
        raise refusal
    raw = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 1 - 1 / minus_b,
           "original_max_position_embeddings": -a / minus_b}
    for candidate in (_round_llama3(raw), raw):
        if np.allclose(llama3_rope_factors(candidate, head_dim, theta), t, rtol=1e-5, atol=0):
            return candidate
    raise refusal


def gguf_tensors(reader, config: dict[str, Any]) -> dict[str, Any]:
    """HF name -> the reader's tensor, in the checkpoint's order, each name and shape checked against the metadata's
    and each type against what the gguf package dequantizes, before any tensor is (a bad file fails at once)."""
    from gguf.quants import dequantize

    from trt_lookahead.model.checkpoint import expected_tensors, hf_key
    from trt_lookahead.model.llama import ModelConfig

    found = {name: t for t in reader.tensors if (name := hf_tensor_name(t.name)) is not None}
    shapes = {hf_key(name): shape for name, shape in expected_tensors(ModelConfig.from_hf(config)).items()}
    missing = sorted(set(shapes) - set(found))
    extra = sorted(set(found) - set(shapes))
    if missing or extra:
        raise UserError(f"GGUF tensors do not match its metadata: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in shapes.items():
        if hf_shape(found[name]) != shape:
            raise UserError(f"GGUF tensor for {name} has shape {hf_shape(found[name])}, metadata implies {shape}")
    for t in {t.tensor_type: t for t in found.values()}.values():  # one tensor of each type: its first row
        try:
            dequantize(t.data[:1] if t.data.ndim > 1 else t.data, t.tensor_type)
        except NotImplementedError:
            raise UserError(f"GGUF tensor {t.name} is {t.tensor_type.name}, which cannot be dequantized here; "
                            "requantize it with llama.cpp's llama-quantize (e.g. to Q4_K_M, Q8_0 or F16)") from None
    return {name: found[name] for name in shapes}


def hf_shape(t) -> tuple[int, ...]:
    """A GGUF tensor's shape as numpy and HF have it: GGUF lists dims innermost first, (rows, cols) is the reverse."""
    return tuple(int(d) for d in reversed([int(x) for x in t.shape]))


def dequantized(t, config: dict[str, Any]) -> np.ndarray:
    """One GGUF tensor as the HF checkpoint holds it: float32, its q/k rows unpermuted; UserError if it holds a NaN
    or an infinity (a corrupt file: the model would answer garbage)."""
    import torch
    from gguf.quants import dequantize

    from trt_lookahead.model.checkpoint import non_finite

    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(hf_shape(t))
    with warnings.catch_warnings():  # an F32 tensor is the file's read-only map, which the check only reads
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        count = non_finite(torch.from_numpy(w))
    if count:
        raise UserError(f"GGUF tensor {t.name} holds {count} NaN or infinite value(s) once dequantized; the file is "
                        "corrupt: download it again")
    if ".attn_q." in t.name:
        w = unpermute_qk(w, config["num_attention_heads"])
    elif ".attn_k." in t.name:
        w = unpermute_qk(w, config["num_key_value_heads"])
    return np.ascontiguousarray(w)


SAFETENSORS_DTYPES = {np.dtype("float32"): "F32", np.dtype("float16"): "F16"}  # numpy's names -> safetensors'
# A written checkpoint's most bytes in one weight file: the safetensors library maps a file copy-on-write, which a
# system without swap refuses for a file larger than its memory (an 8B model's float32 weights are 32 GB)
SHARD_BYTES = 4 << 30


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], read: Callable[[str], np.ndarray],
                      metadata: dict[str, str], progress: bool = False, dtype: str = "float32") -> None:
    """A safetensors file of the tensors `shapes` names, all of numpy `dtype` (float32 or float16), in name order,
    each `read(name)` only as it is written: no more than one tensor in memory, however large the model."""
    from tqdm import tqdm

    kind = np.dtype(dtype)
    names = sorted(shapes)
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        size = kind.itemsize * math.prod(shapes[name])
        header[name] = {"dtype": SAFETENSORS_DTYPES[kind], "shape": list(shapes[name]),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data 8-byte aligned, as the format asks
    try:
        with open(path, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            for name in tqdm(names, desc="write", unit="tensor", file=sys.stderr, disable=not progress):
                array = read(name)
                assert array.dtype == kind and array.shape == shapes[name] and array.flags.c_contiguous, name
                f.write(array.data)
    except BaseException:  # a tensor refused (or an interrupt): no file whose header promises what it lacks
        path.unlink(missing_ok=True)
        raise


def write_weights(out: Path, shapes: dict[str, tuple[int, ...]], read: Callable[[str], np.ndarray],
                  metadata: dict[str, str], progress: bool = False, dtype: str = "float32") -> list[str]:
    """A checkpoint's weights in `out` by `write_safetensors`: model.safetensors, or where they pass SHARD_BYTES,
    shards model-0000i-of-0000n.safetensors of at most SHARD_BYTES each (a larger tensor alone), in name order, and
    the index naming each tensor's shard (model.safetensors.index.json), as transformers writes a sharded
    checkpoint. -> the files written."""
    from trt_lookahead.model.checkpoint import INDEX_FILE

    itemsize = np.dtype(dtype).itemsize
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    held = 0  # the last shard's bytes
    for name in sorted(shapes):
        size = itemsize * math.prod(shapes[name])
        if shards[-1] and held + size > SHARD_BYTES:
            shards.append({})
            held = 0
        shards[-1][name] = shapes[name]
        held += size
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", shapes, read, metadata, progress, dtype)
        return ["model.safetensors"]
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for file, shard in zip(names, shards, strict=True):
        write_safetensors(out / file, shard, read, metadata, progress, dtype)
    total = sum(itemsize * math.prod(shape) for shape in shapes.values())
    weight_map = {name: file for file, shard in zip(names, shards, strict=True) for name in shard}
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return [*names, INDEX_FILE]


# ---------------------------------------------------------------------------------------------
# tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE tokens are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def smollm_pre_tokenizer():
    """llama.cpp's `smollm` split: each digit (\\p{N}) isolated, then GPT-2's byte-level regex.

    Written the way SmolLM2's own tokenizer.json writes it (Digits + ByteLevel).
    """
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def llama3_pre_tokenizer():
    """llama.cpp's `llama-bpe` split (Llama 3): its regex isolates each piece, then byte-level spelling, as Llama 3's
    tokenizer.json writes it."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


def build_tokenizer(meta: dict[str, Any]):
    """A `tokenizers.Tokenizer` for a GGUF vocabulary: byte-level BPE (`tokenizer.ggml.model` gpt2: SmolLM2, GPT-2)
    or SentencePiece BPE (`llama`: Llama 2, Mistral, TinyLlama), tokenizing as llama.cpp does."""
    from tokenizers import AddedToken

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise UserError("GGUF token_type list and token list differ in length")
    if kind == "gpt2":
        tok, spelled = _byte_level_tokenizer(meta, tokens)
    elif kind == "llama":
        tok, spelled = _sentencepiece_tokenizer(meta, tokens, types), tokens
    else:
        raise UserError(f"GGUF tokenizer model {kind!r} is not supported; byte-level BPE ('gpt2') and SentencePiece "
                        "BPE ('llama') are")
    kinds = list(zip(spelled, types, strict=True))
    control = [AddedToken(t, special=True, normalized=False) for t, ty in kinds if ty == _TOKEN_CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in kinds if ty == _TOKEN_USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise UserError("tokenizer vocabulary size differs from the GGUF's token list")
    return tok


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise UserError("GGUF vocabulary has duplicate tokens")
    return vocab


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    merges = []
    for m in meta.get("tokenizer.ggml.merges") or []:
        a, sep, b = m.partition(" ")
        if not sep or " " in b:
            raise UserError(f"GGUF merge {m!r} is not two tokens")
        merges.append((a, b))
    return merges


def _merges_by_score(tokens: list[str], types: list[int], scores: Sequence[float] | None) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies (a GGUF made from a tokenizer.model lists none): each split
    of a normal piece into two pieces of the vocabulary, the best-scored piece's first, as llama.cpp merges the
    adjacent pair whose join scores best. E.g. pieces a, b, c, ab (score -1) and abc (-2): (a, b), then (ab, c)."""
    if scores is None or len(scores) != len(tokens):
        raise UserError("GGUF SentencePiece vocabulary has neither merges nor a score per token; the file is "
                        "incomplete")
    vocab = set(tokens)
    ranked = sorted((-float(scores[i]), i, cut) for i, (piece, kind) in enumerate(zip(tokens, types, strict=True))
                    if kind == _TOKEN_NORMAL for cut in range(1, len(piece))
                    if piece[:cut] in vocab and piece[cut:] in vocab)
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]


def _byte_level_tokenizer(meta: dict[str, Any], tokens: list[str]) -> tuple[Any, list[str]]:
    """Byte-level BPE, and its tokens spelled in GPT-2's byte alphabet."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _PRE_DIGITS_THEN_GPT2:
        pre_tok = smollm_pre_tokenizer()
    elif pre in _PRE_LLAMA3:
        pre_tok = llama3_pre_tokenizer()
    elif pre in _PRE_GPT2:
        pre_tok = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        raise UserError(f"GGUF pre-tokenizer {pre!r} is not supported (known: smollm, llama-bpe, gpt2 and their "
                        "aliases)")
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        raise UserError("GGUF asks for a space prefix on a byte-level vocabulary; not supported")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    bpe = BPE(vocab=_vocab(spelled), merges=_merges(meta), dropout=None, unk_token=None, fuse_unk=False,
              byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.normalizer = None
    tok.pre_tokenizer = pre_tok
    adds = _specials_processor(meta, spelled)
    byte_level = processors.ByteLevel(trim_offsets=False)  # offsets only
    tok.post_processor = byte_level if adds is None else processors.Sequence([byte_level, adds])
    tok.decoder = decoders.ByteLevel()
    return tok, spelled


def _added_ids(meta: dict[str, Any]) -> tuple[int | None, int | None]:
    """The ids of the BOS and EOS a GGUF's tokenizer adds to a text (add_bos_token, add_eos_token), None where it
    adds none; llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say."""
    add_bos = meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return (int(bos) if add_bos and bos is not None else None, int(eos) if add_eos and eos is not None else None)


def _specials_processor(meta: dict[str, Any], tokens: Sequence[str]) -> Any:
    """A TemplateProcessing that adds `_added_ids` around each text (a pair: around each), or None."""
    from tokenizers import processors

    bos, eos = _added_ids(meta)
    if bos is None and eos is None:
        return None
    head = [] if bos is None else [tokens[bos]]
    tail = [] if eos is None else [tokens[eos]]
    second = [f"{t}:1" for t in head] + ["$B:1"] + [f"{t}:1" for t in tail]
    return processors.TemplateProcessing(single=" ".join([*head, "$A", *tail]),
                                         pair=" ".join([*head, "$A", *tail, *second]),
                                         special_tokens=sorted({(tokens[i], i) for i in (bos, eos) if i is not None}))


def _sentencepiece_tokenizer(meta: dict[str, Any], tokens: list[str], types: list[int]) -> Any:
    """SentencePiece BPE as llama.cpp runs it: spaces as U+2581, one before the text and after each special token
    (add_space_prefix, the default), pieces merged best score first, a character outside the vocabulary as its
    bytes' <0xNN> pieces, BOS (add_bos_token, the default) and EOS (add_eos_token) added. No normalization: a
    GGUF does not carry the SentencePiece model's (e.g. collapsing runs of spaces), and llama.cpp applies none."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    vocab = _vocab(tokens)
    merges = _merges(meta) or _merges_by_score(tokens, types, meta.get("tokenizer.ggml.scores"))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=None if unk is None else tokens[int(unk)],
                        fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # a normalizer, not Metaspace: that adds no space before text that starts with one, llama.cpp does
    spaces = normalizers.Replace(" ", _SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), spaces]) if prefix else spaces
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    tok.post_processor = _specials_processor(meta, tokens)
    return tok


def build_tokenizer_config(meta: dict[str, Any], max_length: int) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return None if i is None else tokens[int(i)]

    bos, eos = _added_ids(meta)
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bos is not None,
        "add_eos_token": eos is not None,
        "add_prefix_space": False,
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id") or token("eos_token_id"),
        "additional_special_tokens": [t for t, ty in zip(tokens, types, strict=False) if ty == _TOKEN_CONTROL],
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return cfg


# ---------------------------------------------------------------------------------------------
# the whole conversion


def _normalize_permissions(out: Path, files: Sequence[str]) -> None:
    """Ordinary file modes (safetensors writes 0600); the cache is meant to be read by other users' tools."""
    umask = os.umask(0)
    os.umask(umask)
    for name in files:
        os.chmod(out / name, 0o666 & ~umask)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> ConversionInfo:
    """Write a HF Llama checkpoint for `gguf_path` into `out_dir` (created; existing files overwritten)."""
    import gguf

    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as exc:  # gguf raises ValueError/struct.error/OSError on bad files
        raise UserError(f"cannot read GGUF {gguf_path} ({exc}): the file is not a GGUF or is cut short; download "
                        "it again, or check the path") from exc
    meta = read_metadata(reader)
    config = build_config(meta, [t.name for t in reader.tensors], rope_table(reader))

    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", build_tokenizer_config(meta, config["max_position_embeddings"]))

    tensors = gguf_tensors(reader, config)
    if progress:
        print(f"dequantizing into {out}", file=sys.stderr)
    shapes = {name: hf_shape(t) for name, t in tensors.items()}
    weights = write_weights(out, shapes, lambda name: dequantized(tensors[name], config), metadata={"format": "pt"},
                            progress=progress)
    n_params = sum(math.prod(shape) for shape in shapes.values())
    types = dict(Counter(t.tensor_type.name for t in tensors.values()))

    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", build_generation_config(config))
    files = ["config.json", "generation_config.json", *weights, "tokenizer.json", "tokenizer_config.json"]
    _normalize_permissions(out, files)
    return ConversionInfo(out, files, config, n_params, types, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# the way back: a checkpoint as a GGUF (write_gguf)

# our dtype -> (llama.cpp's file type, the tensors' GGML type)
GGUF_DTYPES = {"float32": ("ALL_F32", "F32"), "float16": ("MOSTLY_F16", "F16"), "bfloat16": ("MOSTLY_BF16", "BF16")}


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF name of a HF Llama tensor (the inverse of `hf_tensor_name`)."""
    globals_back = {name: gguf_name for gguf_name, name in _GLOBAL_TENSORS.items()}
    if hf_name in globals_back:
        return globals_back[hf_name]
    parts = hf_name.split(".", 3)  # model.layers.<i>.<rest>
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        layer_back = {name: gguf_rest for gguf_rest, name in _LAYER_TENSORS.items()}
        if parts[3] in layer_back:
            return f"blk.{parts[2]}.{layer_back[parts[3]]}"
    raise UserError(f"tensor {hf_name!r} has no GGUF counterpart; the checkpoint is not a plain Llama")


def _pre_tokenizer_name(pre: Any) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json pre-tokenizer (byte-level BPE); the inverse of the
    split `build_tokenizer` builds."""
    def is_byte_level(p: Any) -> bool:
        return isinstance(p, dict) and p.get("type") == "ByteLevel" and p.get("use_regex", True)

    if is_byte_level(pre):
        return "gpt2"
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else None
    if (isinstance(steps, list) and len(steps) == 2 and steps[0].get("type") == "Digits"
            and steps[0].get("individual_digits") and is_byte_level(steps[1])):
        return "smollm"
    if (isinstance(steps, list) and len(steps) == 2 and steps[0].get("type") == "Split"
            and (steps[0].get("pattern") or {}).get("Regex") == LLAMA3_SPLIT and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex", True)):
        return "llama-bpe"
    raise UserError(f"tokenizer.json's pre-tokenizer {json.dumps(pre)[:120]} has no llama.cpp name known here "
                    "(known: GPT-2 byte-level, digits then byte-level = smollm, Llama 3's split = llama-bpe)")


def tokenizer_metadata(model_dir: str | Path) -> dict[str, Any]:
    """The `tokenizer.ggml.*` keys (and the chat template) llama.cpp needs, from a checkpoint's tokenizer.json,
    tokenizer_config.json and config.json. Byte-level BPE becomes `gpt2` (its tokens kept spelled in GPT-2's
    byte alphabet, as llama.cpp's converter keeps them); SentencePiece-style BPE (Metaspace, byte fallback)
    becomes `llama`, scored by id (SentencePiece BPE vocabularies list pieces in merge order), which llama.cpp
    uses only to tokenize text: `bench` sends token ids."""
    root = Path(model_dir)
    try:
        tok = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
        tcfg_path = root / "tokenizer_config.json"
        tcfg = json.loads(tcfg_path.read_text(encoding="utf-8")) if tcfg_path.is_file() else {}
        cfg = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the tokenizer of {root} ({exc}); restore tokenizer.json and config.json") \
            from None
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"{root}/tokenizer.json is a {model.get('type')!r} tokenizer; only BPE can be written to GGUF")
    added = {int(a["id"]): a for a in tok.get("added_tokens") or []}
    size = max([*model["vocab"].values(), *added]) + 1
    tokens = [""] * size
    for text, i in model["vocab"].items():
        tokens[int(i)] = text
    for i, a in added.items():
        tokens[i] = a["content"]
    if "" in tokens:
        raise UserError(f"{root}/tokenizer.json leaves token id {tokens.index('')} undefined; it cannot become a GGUF")
    types = [_TOKEN_CONTROL if i in added and added[i].get("special") else
             _TOKEN_USER_DEFINED if i in added else _TOKEN_NORMAL for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    meta: dict[str, Any] = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges}
    if model.get("byte_fallback"):  # SentencePiece BPE
        meta["tokenizer.ggml.model"] = "llama"
        meta["tokenizer.ggml.scores"] = [0.0 if ty != _TOKEN_NORMAL else -float(i) for i, ty in enumerate(types)]
        types = [_TOKEN_BYTE if ty == _TOKEN_NORMAL and len(t) == 6 and t.startswith("<0x") and t.endswith(">")
                 else ty for t, ty in zip(tokens, types, strict=True)]
    else:
        meta["tokenizer.ggml.model"] = "gpt2"
        meta["tokenizer.ggml.pre"] = _pre_tokenizer_name(tok.get("pre_tokenizer"))
    meta["tokenizer.ggml.token_type"] = types

    def token_id(key: str, config_key: str) -> int | None:
        value = tcfg.get(key)
        text = value.get("content") if isinstance(value, dict) else value
        if isinstance(text, str) and text in tokens:
            return tokens.index(text)
        fallback = cfg.get(config_key)
        fallback = fallback[0] if isinstance(fallback, list) and fallback else fallback
        return None if fallback is None else int(fallback)

    for key, config_key, gguf_key in (("bos_token", "bos_token_id", "bos_token_id"),
                                      ("eos_token", "eos_token_id", "eos_token_id"),
                                      ("unk_token", "unk_token_id", "unknown_token_id"),
                                      ("pad_token", "pad_token_id", "padding_token_id")):
        found = token_id(key, config_key)
        if found is not None:
            meta[f"tokenizer.ggml.{gguf_key}"] = found
    meta["tokenizer.ggml.add_bos_token"] = bool(tcfg.get("add_bos_token", False))
    meta["tokenizer.ggml.add_eos_token"] = bool(tcfg.get("add_eos_token", False))
    if isinstance(tcfg.get("chat_template"), str):
        meta["tokenizer.chat_template"] = tcfg["chat_template"]
    return meta


def write_gguf(model_dir: str | Path, out_path: str | Path, dtype: str = "float32", progress: bool = False) -> Path:
    """Write the checkpoint at `model_dir` as a llama.cpp GGUF at `out_path`: every tensor in `dtype` (float32,
    float16 or bfloat16, rounded as torch rounds), q/k rows in GGUF order (`permute_qk`), Llama metadata from
    config.json and `tokenizer_metadata`. Not atomic: the caller writes to a temporary name and renames."""
    import gguf
    import torch

    from trt_lookahead.model.checkpoint import hf_key, parse_dtype, read_config, read_tensors, weight_files

    if dtype not in GGUF_DTYPES:
        raise UserError(f"no GGUF type for dtype {dtype!r}; use {', '.join(GGUF_DTYPES)}")
    root = Path(model_dir)
    cfg = read_config(root)
    meta = tokenizer_metadata(root)
    file_type, tensor_type = GGUF_DTYPES[dtype]
    raw = getattr(gguf.GGMLQuantizationType, tensor_type)

    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_name(root.name)
    writer.add_file_type(int(getattr(gguf.LlamaFileType, file_type)))
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    scaling = cfg.rope_scaling or {"rope_type": "default"}
    if scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif scaling["rope_type"] == "llama3":
        writer.add_tensor(_ROPE_FREQS, llama3_rope_factors(scaling, cfg.head_dim, cfg.rope_theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for key, value in meta.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)

    tensors = read_tensors(weight_files(root), cfg, parse_dtype(dtype))
    for name, tensor in tensors.items():
        hf_name = hf_key(name) if name.startswith("lm_head") else f"model.{name}"
        t = tensor.contiguous()
        array = t.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else t.numpy()
        if ".q_proj." in hf_name:
            array = permute_qk(array, cfg.num_heads)
        elif ".k_proj." in hf_name:
            array = permute_qk(array, cfg.num_kv_heads)
        writer.add_tensor(gguf_tensor_name(hf_name), np.ascontiguousarray(array), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=progress)
    writer.close()
    return Path(out_path)
