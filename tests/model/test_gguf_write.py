"""The GGUF writer (model/gguf_convert.write_gguf) and its cache (bench/servers.cached_gguf): stories260K written
as a GGUF and read back with gguf.GGUFReader and our own GGUF reader gives its tensors bit for bit; a byte-level
BPE tokenizer's keys read back into the same tokenizer, and a SentencePiece one into llama.cpp's tokenization."""

import json
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from trt_lookahead.bench.servers import cached_gguf
from trt_lookahead.errors import UserError
from trt_lookahead.model.gguf_convert import (
    build_config,
    build_tokenizer,
    dequantized,
    gguf_tensor_name,
    gguf_tensors,
    hf_tensor_name,
    llama3_pre_tokenizer,
    llama3_rope_factors,
    read_metadata,
    rope_scaling_from_factors,
    tokenizer_metadata,
    write_gguf,
)
from trt_lookahead.model.llama import ModelConfig

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"


def read_back(path: Path) -> tuple[dict, dict, dict[str, np.ndarray]]:
    """Metadata, the HF config and the float32 HF tensors of a GGUF, through our GGUF -> HF converter."""
    reader = gguf.GGUFReader(str(path))
    meta = read_metadata(reader)
    config = build_config(meta, [t.name for t in reader.tensors])
    tensors = {name: dequantized(t, config) for name, t in gguf_tensors(reader, config).items()}
    return meta, config, tensors


def test_a_conversion_writes_the_file_safetensors_writes(tmp_path):
    """convert_gguf_to_hf writes model.safetensors a tensor at a time (write_safetensors); the file is byte for
    byte the one the safetensors library writes holding every tensor at once, and a permuted q/k and float16 data
    come out as the reader's dequantization says."""
    from safetensors.numpy import save_file

    from trt_lookahead.model.gguf_convert import convert_gguf_to_hf

    path = write_gguf(STORIES, tmp_path / "stories.gguf", "float16")
    convert_gguf_to_hf(path, tmp_path / "converted", progress=False)
    _, _, tensors = read_back(path)
    save_file(dict(sorted(tensors.items())), str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    written = (tmp_path / "converted" / "model.safetensors").read_bytes()
    assert written == (tmp_path / "reference.safetensors").read_bytes()
    source = load_file(str(STORIES / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert np.array_equal(load_file(str(tmp_path / "converted" / "model.safetensors"))[q],
                          source[q].astype(np.float16).astype(np.float32))


def test_write_safetensors_writes_float16_as_safetensors_does(tmp_path):
    """write_safetensors with dtype float16 (scripts/build_memory.py's checkpoints): the bytes safetensors writes."""
    from safetensors.numpy import save_file

    from trt_lookahead.model.gguf_convert import write_safetensors

    rng = np.random.default_rng(0)
    tensors = {"b.weight": rng.standard_normal((3, 5)).astype(np.float16), "a": np.ones(7, np.float16)}
    write_safetensors(tmp_path / "ours.safetensors", {k: v.shape for k, v in tensors.items()}, tensors.__getitem__,
                      metadata={"format": "pt"}, dtype="float16")
    save_file(dict(sorted(tensors.items())), str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_float32_round_trip_is_bit_identical(tmp_path):
    path = write_gguf(STORIES, tmp_path / "stories.gguf", "float32")
    meta, config, tensors = read_back(path)
    source = load_file(str(STORIES / "model.safetensors"))
    assert set(tensors) == set(source)
    for name, array in source.items():
        assert tensors[name].dtype == np.float32
        assert np.array_equal(tensors[name].view(np.uint32), array.view(np.uint32)), name
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types == {"F32"} and meta["general.file_type"] == gguf.LlamaFileType.ALL_F32
    hf = json.loads((STORIES / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == hf[key], key
    assert meta["tokenizer.ggml.model"] == "llama" and len(meta["tokenizer.ggml.tokens"]) == 512
    assert meta["tokenizer.ggml.tokens"][:3] == ["<unk>", "<s>", "</s>"]
    assert meta["tokenizer.ggml.token_type"][:3] == [3, 3, 3]  # control


def test_bfloat16_holds_torch_rounding(tmp_path):
    path = write_gguf(STORIES, tmp_path / "stories-bf16.gguf", "bfloat16")
    _, _, tensors = read_back(path)
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors} == {"BF16"}
    for name, array in load_file(str(STORIES / "model.safetensors")).items():
        rounded = torch.from_numpy(array).to(torch.bfloat16).float().numpy()
        assert np.array_equal(tensors[name].view(np.uint32), rounded.view(np.uint32)), name


def test_tensor_names_are_inverse():
    for name in ["token_embd.weight", "output_norm.weight", "output.weight", "blk.3.attn_q.weight",
                 "blk.3.attn_k.weight", "blk.0.ffn_down.weight", "blk.11.attn_norm.weight", "blk.2.attn_v.bias"]:
        hf = hf_tensor_name(name)
        assert hf is not None and gguf_tensor_name(hf) == name
    with pytest.raises(UserError, match="no GGUF counterpart"):
        gguf_tensor_name("model.layers.0.mlp.experts.weight")


def bpe_model(tmp_path: Path, llama3: bool = False) -> tuple[Path, object]:
    """(stories260K with a byte-level BPE tokenizer trained here, the tokenizer): a checkpoint whose GGUF our
    converter reads back. Digits split as SmolLM2's, no BOS; or (llama3) split by Llama 3's regex, BOS added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = llama3_pre_tokenizer() if llama3 else pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = ["def add(a, b):\n    return a + b  # 12 apples", "The quick brown fox jumps over 3 lazy dogs."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = tmp_path / "bpe"
    shutil.copytree(STORIES, model)
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "add_bos_token": llama3,
                                                             "bos_token": "<|endoftext|>",
                                                             "chat_template": "{{ messages }}"}))
    return model, tok


# llama.cpp's ids for bpe_model(llama3=True)'s tokenizer written as a GGUF (its embedding cut to the vocabulary, so
# that llama.cpp loads it): llama-server b11434's POST /tokenize, BOS added, special tokens parsed
LLAMA_CPP_LLAMA3_IDS = {
    "it's  12345\n\n x": [0, 74, 85, 8, 84, 222, 222, 263, 20, 21, 22, 200, 200, 222, 89],
    "HELLO'S World!!\n": [0, 41, 38, 45, 45, 48, 8, 52, 222, 56, 80, 83, 77, 69, 2, 2, 200],
    "   leading": [0, 260, 222, 77, 70, 66, 69, 74, 79, 72],
    "tabs\tand  spaces   ": [0, 85, 66, 67, 84, 199, 66, 79, 69, 222, 222, 84, 81, 66, 68, 271, 300],
    "I'LL we've 1234567": [0, 42, 8, 45, 45, 222, 88, 70, 8, 87, 70, 222, 263, 20, 21, 22, 23, 24],
    "a\r\n\r\nb": [0, 66, 203, 200, 203, 200, 67],
    "¿Qué?  ¡Sí!": [0, 128, 125, 50, 86, 129, 104, 32, 222, 222, 128, 96, 52, 129, 257, 2],
    "The 42 brown foxes<|im_end|>": [0, 302, 222, 21, 19, 313, 306, 271, 1],
}


@pytest.mark.parametrize(("llama3", "pre"), [(False, "smollm"), (True, "llama-bpe")])
def test_byte_level_tokenizer_keys_rebuild_the_same_tokenizer(tmp_path, llama3, pre):
    """A byte-level BPE tokenizer written as GGUF keys and rebuilt by the GGUF reader encodes and decodes as the
    original does, with the BOS its add_bos_token asks for; its split has llama.cpp's name."""
    model, tok = bpe_model(tmp_path, llama3)
    meta = tokenizer_metadata(model)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == pre
    assert meta["tokenizer.ggml.eos_token_id"] == 1 and meta["tokenizer.chat_template"] == "{{ messages }}"
    path = write_gguf(model, tmp_path / "bpe.gguf")
    rebuilt = build_tokenizer(read_metadata(gguf.GGUFReader(str(path))))
    for text in ["def add(x, y):\n    return x + y", "The 42 brown foxes<|im_end|>", "naïve café 2024",
                 "it's  12345\n\n x"]:
        ids = tok.encode(text).ids
        assert rebuilt.encode(text).ids == [0] * llama3 + ids
        assert rebuilt.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
    for text, ids in LLAMA_CPP_LLAMA3_IDS.items() if llama3 else ():
        assert rebuilt.encode(text).ids == ids, text


def with_tensor(source: Path, out: Path, name: str, data: np.ndarray) -> Path:
    """A copy of the float GGUF `source` with the tensor `name` replaced by `data`, or added (as llama.cpp's converter
    adds rope_freqs); `data`'s numpy dtype gives its GGML type."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), arch="llama")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, data if tensor.name == name else np.array(tensor.data))
    if name not in {tensor.name for tensor in reader.tensors}:
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def converter_rope_freqs(scaling: dict, dim: int, base: float) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors) for a `llama3` rope_scaling, written
    out here as it is there, one 0-d float32 tensor at a time: the reference our writer and reader must agree with."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(("scaling", "head_dim", "theta"), [
    (LLAMA31, 128, 500000.0),  # Llama 3.1 8B / 70B / 405B
    ({**LLAMA31, "factor": 32.0}, 64, 500000.0),  # Llama 3.2 1B
    ({**LLAMA31, "factor": 32.0}, 128, 500000.0),  # Llama 3.2 3B
    ({**LLAMA31, "factor": 4.0, "high_freq_factor": 3.0, "original_max_position_embeddings": 4096}, 96, 10000.0),
])
def test_llama3_rope_tables_are_read_back_as_their_parameters(scaling, head_dim, theta):
    table = converter_rope_freqs(scaling, head_dim, theta)
    assert np.array_equal(llama3_rope_factors(scaling, head_dim, theta).view(np.uint32), table.view(np.uint32))
    assert rope_scaling_from_factors(table, head_dim, theta) == scaling
    if scaling == LLAMA31:  # the docstring's worked example
        assert (table == 1).sum() == 29 and (table == 8).sum() == 29


def test_rope_tables_other_than_llama3_are_refused():
    """All ones is no scaling, one divisor everywhere is linear; a table whose smoothed band is no straight line in
    the frequency, holds fewer than two points, or is not the wrong size is refused by name."""
    ones, fours = np.ones(4, np.float32), np.full(4, 4, np.float32)
    assert rope_scaling_from_factors(ones, 8, 1e4) is None
    assert rope_scaling_from_factors(fours, 8, 1e4) == {"rope_type": "linear", "factor": 4.0}
    table = converter_rope_freqs(LLAMA31, 128, 500000.0)
    bent = table.copy()
    bent[31] *= 1.01
    for bad in (bent, np.array([1, 1, 3.5, 8], np.float32), np.array([1, 3.5, 2, 8], np.float32)):
        with pytest.raises(UserError, match=r"'rope_freqs.weight' scales RoPE .* other than Llama 3's .*--model DIR"):
            rope_scaling_from_factors(bad, len(bad) * 2, 500000.0)
    with pytest.raises(UserError, match="has 64 entries; a head of 64 dims needs 32"):
        rope_scaling_from_factors(table, 64, 500000.0)


def rope_meta(rope: dict[str, object]) -> dict:
    """A head_dim-8 Llama's metadata with these `llama.rope.*` keys."""
    meta = {"general.architecture": "llama", "llama.block_count": 1, "llama.context_length": 64,
            "llama.embedding_length": 32, "llama.feed_forward_length": 64, "llama.attention.head_count": 4,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 10}
    return {**meta, **{f"llama.rope.{key}": value for key, value in rope.items()}}


def test_rope_scaling_metadata_becomes_the_config():
    """llama.cpp's `rope.scaling.type` linear (its factor) and a rope_freqs table are the HF config's rope_scaling;
    YaRN, and both at once, are refused by name."""
    linear = build_config(rope_meta({"scaling.type": "linear", "scaling.factor": 2.0}), [])
    assert linear["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert ModelConfig.from_hf(linear).rope_scaling == linear["rope_scaling"]
    assert build_config(rope_meta({"scaling.type": "linear", "scaling.factor": 1.0}), [])["rope_scaling"] is None
    scaling = {**LLAMA31, "high_freq_factor": 16.0, "original_max_position_embeddings": 256}
    table = converter_rope_freqs(scaling, 8, 500.0)  # wavelengths 6.3 (kept), 30 and 140 (smoothed), 664 (divided)
    llama3 = build_config(rope_meta({"freq_base": 500.0}), [], table)
    assert llama3["rope_scaling"] == scaling and llama3["rope_parameters"] == {"rope_theta": 500.0, **scaling}
    assert ModelConfig.from_hf(llama3).rope_scaling == scaling and ModelConfig.from_hf(llama3).rope_theta == 500
    with pytest.raises(UserError, match=r"GGUF uses RoPE scaling 'yarn'; only Llama 3's .* and linear"):
        build_config(rope_meta({"scaling.type": "yarn", "scaling.factor": 4.0}), [])
    with pytest.raises(UserError, match="scales RoPE twice"):
        build_config(rope_meta({"scaling.type": "linear", "scaling.factor": 2.0, "freq_base": 500.0}), [], table)


# llama-server b11434's greedy ids (docs/results/2026-12-02-gguf-rope-scaling/llama_server_ids.py) for SCALED_PROMPT
# on stories260K written as a GGUF with each scaling below: its positions reach 340, where they matter. llama3's
# stop before a near-tie: its 27th token is 448 in float64 (transformers), ahead of llama-server's 465 by 3e-4 in
# log-probability, less than llama-server's log-probabilities lie from float64's on these files (6e-4 to 6e-3).
SCALED_PROMPT = [1] + [(37 * i) % 509 + 3 for i in range(299)]
LLAMA_CPP_SCALED_IDS = {
    "llama3": [419, 426, 436, 436, 336, 432, 410, 465, 434, 415, 432, 436, 336, 432, 436, 336, 432, 410, 465, 434,
               415, 432, 436, 336, 432, 410],
    "linear": [421, 422, 426, 436, 436, 410, 13, 434, 260, 416, 411, 412, 421, 422, 286, 261, 419, 355, 261, 419,
               355, 261, 282, 276, 411, 412, 356, 420, 277, 420, 277, 420, 412, 271, 433, 269, 262, 415, 303, 428],
}
SCALINGS = {"llama3": {**LLAMA31, "high_freq_factor": 64.0, "original_max_position_embeddings": 2048},
            "linear": {"rope_type": "linear", "factor": 4.0}}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_a_scaled_rope_goes_to_gguf_and_back(tmp_path, monkeypatch, kind):
    """A checkpoint whose config scales RoPE (Llama 3's rule, or linear) is written as llama.cpp's converter writes
    it (a rope_freqs table equal to the converter's, or rope.scaling.type/factor); read back, the config holds the
    same parameters, and `--model FILE.gguf` answers as llama-server does on that file, which the unscaled model
    does not."""
    from trt_lookahead.model.fetch import resolve_model
    from trt_lookahead.runtime import LookaheadRuntime

    monkeypatch.setenv("TRT_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    model = tmp_path / kind
    shutil.copytree(STORIES, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_scaling": SCALINGS[kind]}))
    path = write_gguf(model, tmp_path / f"{kind}.gguf")
    reader = gguf.GGUFReader(str(path))
    tables = {t.name: np.array(t.data) for t in reader.tensors if t.name.startswith("rope")}
    if kind == "llama3":
        expected = converter_rope_freqs(SCALINGS[kind], 8, 10000.0)
        assert tables.keys() == {"rope_freqs.weight"}
        assert np.array_equal(tables["rope_freqs.weight"].view(np.uint32), expected.view(np.uint32))
    else:
        meta = read_metadata(reader)
        assert not tables and meta["llama.rope.scaling.type"] == "linear" and meta["llama.rope.scaling.factor"] == 4
    back = json.loads((resolve_model(str(path)) / "config.json").read_text())
    assert back["rope_scaling"] == SCALINGS[kind]
    with LookaheadRuntime.from_pretrained(str(path), backend="torch") as rt:
        ids = rt.generate(SCALED_PROMPT, max_new_tokens=len(LLAMA_CPP_SCALED_IDS[kind]), lookahead="greedy").token_ids
    assert ids == LLAMA_CPP_SCALED_IDS[kind]
    with LookaheadRuntime.from_pretrained(str(STORIES), backend="torch") as rt:
        assert rt.generate(SCALED_PROMPT, max_new_tokens=len(ids), lookahead="greedy").token_ids != ids


def test_a_tensor_type_that_cannot_be_dequantized_is_refused_before_anything_is_written(tmp_path):
    """A weight in a GGML type the gguf package cannot dequantize (here I8) is one UserError naming the tensor, its
    type and the fix, raised before model.safetensors is begun."""
    from trt_lookahead.model.gguf_convert import convert_gguf_to_hf

    path = write_gguf(STORIES, tmp_path / "stories.gguf")
    reader = gguf.GGUFReader(str(path))
    (q,) = [t for t in reader.tensors if t.name == "blk.1.attn_q.weight"]
    bad = with_tensor(path, tmp_path / "i8.gguf", q.name, np.zeros(np.array(q.data).shape, np.int8))
    with pytest.raises(UserError, match=r"GGUF tensor blk.1.attn_q.weight is I8, .* llama-quantize"):
        convert_gguf_to_hf(bad, tmp_path / "from-i8", progress=False)
    assert not (tmp_path / "from-i8" / "model.safetensors").exists()


@pytest.mark.filterwarnings("error")
def test_a_nan_in_a_gguf_tensor_is_refused_and_leaves_no_weight_file(tmp_path, monkeypatch, capsys):
    """A GGUF whose tensor dequantizes to a NaN (here an F32 weight holding one) is one UserError naming the tensor,
    and the conversion leaves neither a half-written model.safetensors nor the config.json that marks it done;
    `generate --model FILE.gguf` says the same in one line (exit 2) and leaves nothing in the cache."""
    from trt_lookahead.cli import main
    from trt_lookahead.model.gguf_convert import convert_gguf_to_hf

    path = write_gguf(STORIES, tmp_path / "stories.gguf")
    reader = gguf.GGUFReader(str(path))
    (up,) = [t for t in reader.tensors if t.name == "blk.2.ffn_up.weight"]
    data = np.array(up.data)
    data[4, 1] = np.nan
    bad = with_tensor(path, tmp_path / "nan.gguf", up.name, data)
    with pytest.raises(UserError, match=r"GGUF tensor blk\.2\.ffn_up\.weight holds 1 NaN or infinite value\(s\) "
                       r"once dequantized; the file is corrupt"):
        convert_gguf_to_hf(bad, tmp_path / "from-nan", progress=False)
    assert sorted(p.name for p in (tmp_path / "from-nan").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    monkeypatch.setenv("TRT_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    capsys.readouterr()
    assert main(["generate", "--model", str(bad), "--prompt", "Once", "--max-new-tokens", "4"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "GGUF tensor blk.2.ffn_up.weight holds 1 NaN" in errors[0]
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_longrope_tables_are_refused(tmp_path):
    """Phi-3's LongRoPE tables (rope_factors_long/short) cannot be said by a Llama config: refused by name before
    anything is written, unless they are all ones."""
    from trt_lookahead.model.gguf_convert import convert_gguf_to_hf

    path = write_gguf(STORIES, tmp_path / "stories.gguf")
    ones = with_tensor(path, tmp_path / "ones.gguf", "rope_factors_long.weight", np.ones(4, np.float32))
    convert_gguf_to_hf(ones, tmp_path / "from-ones", progress=False)
    assert (tmp_path / "from-ones" / "model.safetensors").is_file()
    scaled = with_tensor(path, tmp_path / "scaled.gguf", "rope_factors_long.weight",
                         np.array([1, 1, 3.5, 8], np.float32))
    with pytest.raises(UserError, match=r"'rope_factors_long.weight' scales RoPE per frequency \(LongRoPE\)"):
        convert_gguf_to_hf(scaled, tmp_path / "from-scaled", progress=False)
    assert not (tmp_path / "from-scaled" / "model.safetensors").exists()


# llama.cpp's ids for stories260K written as a GGUF (write_gguf): llama-server b11434's POST /tokenize
# {"content": text, "add_special": true, "parse_special": true} on that file. Spaces are not collapsed (the checkpoint's
# own tokenizer.json collapses runs of them, a normalization a GGUF does not carry), and a space goes before the text
# and after each special token, whether or not one is there.
LLAMA_CPP_IDS = {
    "": [1],
    "a  b": [1, 261, 410, 268],
    " leading": [1, 410, 278, 411, 380, 299],
    "trailing  ": [1, 259, 420, 412, 290, 299, 410, 410],
    "x\n\n  y": [1, 410, 444, 13, 13, 410, 348],
    "<s>Hi</s> there": [1, 1, 320, 417, 2, 410, 383],
    "héllo ✓ 日本語 🙂": [1, 270, 485, 306, 414, 410, 229, 159, 150, 410, 233, 154, 168, 233, 159, 175, 235, 173,
                       161, 410, 243, 162, 156, 133],
    "def f(x):\n    return x  # two spaces": [1, 279, 411, 431, 272, 489, 444, 488, 467, 13, 410, 410, 410, 410,
                                             276, 413, 425, 420, 416, 410, 444, 410, 410, 38, 259, 424, 414, 262,
                                             427, 412, 331, 419],
}


def test_a_sentencepiece_gguf_tokenizes_as_llama_cpp_and_answers_as_its_checkpoint(tmp_path, monkeypatch):
    """stories260K's SentencePiece BPE vocabulary as a GGUF (tokenizer.ggml.model `llama`, as Llama 2's and Mistral's
    files): read back, it gives llama.cpp's ids for the file, with the merges the file lists and with merges derived
    from the scores (llama.cpp's converter writes none for a tokenizer.model); on text without runs of spaces it gives
    the checkpoint's own tokenizer's ids; decoding gives the text back; and `--model FILE.gguf` answers as the
    checkpoint."""
    from transformers import AutoTokenizer

    from trt_lookahead.model.fetch import resolve_model
    from trt_lookahead.runtime import LookaheadRuntime

    monkeypatch.setenv("TRT_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    path = write_gguf(STORIES, tmp_path / "stories.gguf")
    meta = read_metadata(gguf.GGUFReader(str(path)))
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.merges"]
    rebuilt = build_tokenizer(meta)
    derived = build_tokenizer({key: value for key, value in meta.items() if key != "tokenizer.ggml.merges"})
    for text, ids in LLAMA_CPP_IDS.items():
        assert rebuilt.encode(text).ids == ids and derived.encode(text).ids == ids, text
        if "<s>" not in text:  # (a special token in the text is followed by a space of llama.cpp's)
            assert rebuilt.decode(ids) == text, text
    original = AutoTokenizer.from_pretrained(STORIES)
    converted = AutoTokenizer.from_pretrained(resolve_model(str(path)))
    texts = ["Once upon a time, there was a little girl named Lily.\nShe liked to play.", "The cat sat on the mat!",
             "Numbers 12, 345 and 6789; naïve café über straße", "Tom said: \"Let's go to the park\" and ran."]
    for text in texts:
        ids = original(text)["input_ids"]
        assert ids[0] == 1 and converted(text)["input_ids"] == derived.encode(text).ids == ids, text
    prompts = ["Once upon a time", "The little dog"]
    with LookaheadRuntime.from_pretrained(str(path), backend="torch") as rt:
        from_file = [rt.generate(p, max_new_tokens=16, lookahead="greedy").text for p in prompts]
    with LookaheadRuntime.from_pretrained(str(STORIES), backend="torch") as rt:
        assert [rt.generate(p, max_new_tokens=16, lookahead="greedy").text for p in prompts] == from_file


def test_a_large_conversion_is_written_in_shards_found_again_in_the_cache(tmp_path, monkeypatch):
    """A conversion whose weights pass SHARD_BYTES (an 8B GGUF's float32 are 32 GB, which the safetensors library
    cannot map on a machine without swap) is written in shards of at most that size (a larger tensor alone) with
    transformers' index, loads as the one-file conversion bit for bit, and is found again in the cache."""
    from trt_lookahead.model import gguf_convert
    from trt_lookahead.model.checkpoint import load_llama
    from trt_lookahead.model.fetch import resolve_model

    path = write_gguf(STORIES, tmp_path / "stories.gguf", "float32")
    whole = gguf_convert.convert_gguf_to_hf(path, tmp_path / "whole", progress=False)
    assert "model.safetensors" in whole.files
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 200_000)
    monkeypatch.setenv("TRT_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    converted = resolve_model(str(path))
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    shards = sorted(converted.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (converted / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == [shard.name for shard in shards]
    sizes = {name: array.nbytes for shard in shards for name, array in load_file(str(shard)).items()}
    assert sizes.keys() == index["weight_map"].keys() and sum(sizes.values()) == index["metadata"]["total_size"]
    for shard in shards:
        held = [sizes[name] for name, file in index["weight_map"].items() if file == shard.name]
        assert sum(held) <= 200_000 or len(held) == 1
    a, _ = load_llama(whole.out_dir)
    b, _ = load_llama(converted)
    for (name, x), (other, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert name == other and torch.equal(x, y)
    stamp = shards[0].stat().st_mtime_ns
    assert resolve_model(str(path)) == converted and shards[0].stat().st_mtime_ns == stamp  # not converted again


def test_a_gguf_file_as_model_is_converted_once_into_the_cache(tmp_path, monkeypatch, capsys):
    """--model FILE.gguf: converted once into <cache>/models/<stem>-<sha16>/, found there by the file's content
    afterwards (another file, another dir); the checkpoint holds the file's numbers, so it answers as the checkpoint
    the file was written from. A file that is no GGUF is one UserError and leaves nothing in the cache."""
    from trt_lookahead.model.fetch import resolve_model
    from trt_lookahead.runtime import LookaheadRuntime

    monkeypatch.setenv("TRT_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    model, _ = bpe_model(tmp_path)
    path = write_gguf(model, tmp_path / "my model.gguf")
    converted = resolve_model(str(path))
    assert converted.parent == tmp_path / "cache" / "models" and converted.name.startswith("my-model-")
    ours, source = load_file(str(converted / "model.safetensors")), load_file(str(model / "model.safetensors"))
    assert ours.keys() == source.keys() and all(np.array_equal(ours[k], source[k]) for k in source)
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert "checking my model.gguf (sha256)" in capsys.readouterr().err
    assert resolve_model(path) == converted and (converted / "model.safetensors").stat().st_mtime_ns == stamp
    assert "(sha256)" not in capsys.readouterr().err  # the unchanged file's digest is remembered, not reread
    prompts = ["def add(a, b):", "The quick brown fox"]
    with LookaheadRuntime.from_pretrained(str(path), backend="torch") as rt:
        from_file = [rt.generate(p, max_new_tokens=12, lookahead="greedy").token_ids for p in prompts]
    with LookaheadRuntime.from_pretrained(str(model), backend="torch") as rt:
        assert [rt.generate(p, max_new_tokens=12, lookahead="greedy").token_ids for p in prompts] == from_file
    other = write_gguf(model, tmp_path / "other.gguf", "bfloat16")
    assert resolve_model(other).name.startswith("other-") and resolve_model(other) != converted
    bad, cut = tmp_path / "bad.gguf", tmp_path / "cut.gguf"
    bad.write_text("not a GGUF")
    cut.write_bytes(path.read_bytes()[: path.stat().st_size * 9 // 10])  # a download that stopped in the tensors
    for broken in (bad, cut):
        with pytest.raises(UserError, match=f"cannot read GGUF {broken} .*: the file is not a GGUF or is cut short"):
            resolve_model(broken)
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir() if not p.name.endswith(".lock")) == sorted(
        [converted.name, resolve_model(other).name])


def test_unknown_pre_tokenizer_is_a_clear_error(tmp_path):
    model = tmp_path / "odd"
    shutil.copytree(STORIES, model)
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["model"]["byte_fallback"] = False
    (model / "tokenizer.json").write_text(json.dumps(tok))  # Metaspace without byte fallback: neither kind
    with pytest.raises(UserError, match=r"pre-tokenizer .* has no llama.cpp name"):
        tokenizer_metadata(model)


def test_cached_gguf_is_written_once_and_keyed_by_content(tmp_path):
    model = tmp_path / "stories260K"
    shutil.copytree(STORIES, model)
    cache = tmp_path / "cache"
    first = cached_gguf(model, "float32", cache)
    stamp = first.stat().st_mtime_ns
    assert cached_gguf(model, "float32", cache) == first and first.stat().st_mtime_ns == stamp
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    second = cached_gguf(model, "float32", cache)
    assert second != first and second.is_file()
    assert read_back(second)[1]["rms_norm_eps"] == 1e-6
    assert cached_gguf(model, "bfloat16", cache) not in (first, second)
    assert not [p for p in (cache / "gguf").iterdir() if p.name.endswith(".tmp")]
