"""A float32 checkpoint of a Llama's layer shapes (scripts/build_memory.py's SHAPES) whose weights are what a
llama.cpp Q4_K_M file of it dequantizes to: random Q4_K / Q6_K super-blocks packed as llama.cpp lays them out,
read back by the gguf package. attn_q, attn_k, attn_output, ffn_gate, ffn_up Q4_K; attn_v and ffn_down Q6_K in
every other layer and Q4_K in the rest; the (tied) embedding Q6_K; norms 1. Used for `trt-lookahead build
--weights int4` before and after the GGUF block readers' change (the build's time is the readers' on such
weights; a GGUF file would only add the conversion, which is the same in both).

    python k_quant_checkpoint.py --shape llama-1b --out /tmp/k/llama-1b-q4km
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from build_memory import DONOR, SHAPES

from trt_lookahead.model.checkpoint import expected_tensors, hf_key
from trt_lookahead.model.gguf_convert import write_weights
from trt_lookahead.model.llama import ModelConfig


def q4_k(rng: np.random.Generator, supers: int, scale: float) -> np.ndarray:
    """raw Q4_K super-blocks [supers, 144]: d, dmin float16, 12 bytes of 6-bit sc and m, 128 bytes of nibbles"""
    d = rng.uniform(0.5, 1.0, supers).astype(np.float16) * np.float16(scale / 8)
    dmin = rng.uniform(0.5, 1.0, supers).astype(np.float16) * np.float16(scale / 8)
    sc, m = rng.integers(1, 64, (supers, 8)), rng.integers(0, 64, (supers, 8))
    sc[:, 3], m[:, 5] = 63, 63
    q = rng.integers(0, 16, (supers, 8, 32))
    scales = np.zeros((supers, 12), np.uint8)
    scales[:, :4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    low = (q & 15).reshape(supers, 4, 2, 32)
    nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(supers, 128).astype(np.uint8)
    return np.concatenate([d.view(np.uint8).reshape(supers, 2), dmin.view(np.uint8).reshape(supers, 2), scales,
                           nibbles], -1)


def q6_k(rng: np.random.Generator, supers: int, scale: float) -> np.ndarray:
    """raw Q6_K super-blocks [supers, 210]: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d"""
    bits = rng.integers(0, 256, (supers, 192), dtype=np.uint8)
    sc = rng.integers(-128, 128, (supers, 16)).astype(np.int8).view(np.uint8)
    d = (rng.uniform(0.5, 1.0, supers) * scale / 32 / 128).astype(np.float16)
    return np.concatenate([bits, sc, d.view(np.uint8).reshape(supers, 2)], -1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = {**json.loads((DONOR / "config.json").read_text()), **SHAPES[args.shape], "tie_word_embeddings": True,
              "torch_dtype": "float32", "max_position_embeddings": 2048}
    config.pop("head_dim", None)
    shapes = {hf_key(key): dims for key, dims in expected_tensors(ModelConfig.from_hf(config)).items()}
    args.out.mkdir(parents=True, exist_ok=True)
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (DONOR / file).is_file():
            shutil.copyfile(DONOR / file, args.out / file)
    rng = np.random.default_rng(0)
    types: dict[str, int] = {}

    def read(name: str) -> np.ndarray:
        dims = shapes[name]
        if len(dims) == 1:
            return np.ones(dims, np.float32)
        layer = int(name.split(".")[2]) if ".layers." in name else -1
        six = "embed" in name or (("v_proj" in name or "down_proj" in name) and layer % 2 == 0)
        kind = T.Q6_K if six else T.Q4_K
        types[kind.name] = types.get(kind.name, 0) + 1
        supers = int(np.prod(dims)) // 256
        raw = (q6_k if six else q4_k)(rng, supers, 1 / np.sqrt(dims[1]))
        return np.asarray(quants.dequantize(raw, kind), np.float32).reshape(dims)

    write_weights(args.out, shapes, read, metadata={"format": "pt"})  # in shards of 4 GB: safetensors maps each
    (args.out / "config.json").write_text(json.dumps(config, indent=1))  # last: the checkpoint is complete
    print(json.dumps({"shape": args.shape, "tensor_types": types}))


if __name__ == "__main__":
    main()
