"""The torch Llama and its checkpoint loader against transformers' LlamaForCausalLM (float32 parity)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.model.checkpoint import load_llama, load_llama_deferred, read_config, read_deferred
from trt_lookahead.model.llama import (
    Linear,
    Llama,
    ModelConfig,
    auto_weight_layout,
    onednn_linear_available,
    rope_inv_freq,
    sdpa_attention,
    sdpa_attention_static,
    static_attention_mask,
)

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
PROMPT = [1, 403, 407, 261, 378, 505, 263, 260, 345, 411, 280, 306, 263, 417, 300, 45]


def hf_model(path: Path, dtype=torch.float32) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def run(model: Llama, ids, positions=None, cache=None, cache_len=0, mask=None, slots=None, rows=256, **kw):
    ids = torch.as_tensor(ids)
    T = len(ids)
    positions = torch.arange(cache_len, cache_len + T) if positions is None else torch.as_tensor(positions)
    k, v = cache if cache is not None else model.new_cache(rows)
    mask = causal(T) if mask is None else torch.as_tensor(np.array(mask))
    with torch.inference_mode():
        return model(ids, positions, k, v, torch.tensor(cache_len), mask, slots, **kw), (k, v)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # stories260K runs fastest on one thread


@pytest.fixture(scope="module")
def stories():
    model, cfg = load_llama(STORIES, weight_layout="auto")  # the executor's layout (out_in: tiny model)
    return model, cfg, hf_model(STORIES)


# -- parity -----------------------------------------------------------------------------------------


def test_stories_config(stories):
    _, cfg, hf = stories
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 5, 8, 4, 8)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (172, 512, True)
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,) and cfg.rope_scaling is None
    assert torch.equal(rope_inv_freq(cfg), hf.model.rotary_emb.inv_freq)


def test_prefill_logits_match_transformers(stories):
    model, _, hf = stories
    logits, _ = run(model, PROMPT)
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert logits.shape == ref.shape == (len(PROMPT), 512)
    assert (logits - ref).abs().max().item() < 1e-4
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def lookahead_step(vocab: int, p: int, seed: int = 0):
    layout = StepLayout(LookaheadConfig(4, 3, 4))
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(3, vocab, layout.step_tokens))
    positions = torch.from_numpy(p + layout.rel_positions)
    return layout, ids, positions


def hf_step_logits(hf: LlamaForCausalLM, prompt: list[int], layout: StepLayout, ids, positions) -> torch.Tensor:
    """transformers' logits of a step after `prompt`: DynamicCache and a 4D mask built from layout.mask."""
    T, P = layout.step_tokens, len(prompt)
    hf_cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf(torch.tensor([prompt]), past_key_values=hf_cache, use_cache=True)
        allow = torch.cat([torch.ones(T, P, dtype=torch.bool), torch.from_numpy(layout.mask.copy())], 1)
        mask4d = torch.zeros(1, 1, T, P + T).masked_fill(~allow, torch.finfo(torch.float32).min)
        return hf(ids[None], attention_mask=mask4d, position_ids=positions[None], past_key_values=hf_cache).logits[0]


def test_masked_step_matches_transformers_4d_mask(stories):
    """A lookahead-shaped step after a cached prompt == transformers with a 4D mask and DynamicCache."""
    model, cfg, hf = stories
    P = len(PROMPT)
    _, cache = run(model, PROMPT)
    layout, ids, positions = lookahead_step(cfg.vocab_size, P)
    logits, _ = run(model, ids, positions, cache, cache_len=P, mask=layout.mask)

    assert (logits - hf_step_logits(hf, PROMPT, layout, ids, positions)).abs().max().item() < 1e-4
    # output_slots: only those rows, same values
    slots = torch.from_numpy(layout.output_slots)
    _, cache2 = run(model, PROMPT)
    part, _ = run(model, ids, positions, cache2, cache_len=P, mask=layout.mask, slots=slots)
    assert part.shape == (len(slots), cfg.vocab_size)
    assert (part - logits[slots]).abs().max().item() < 1e-5


def test_step_kv_rows_equal_prefill_kv(stories):
    """The step writes its K/V at rows p..p+T-1; a causal step equals prefilling the whole sequence."""
    model, _, _ = stories
    whole, (k_all, v_all) = run(model, PROMPT)
    _, cache = run(model, PROMPT[:10])
    tail, (k, v) = run(model, PROMPT[10:], cache=cache, cache_len=10)
    n = len(PROMPT)
    assert torch.allclose(k[:, :n], k_all[:, :n], atol=1e-5) and torch.allclose(v[:, :n], v_all[:, :n], atol=1e-5)
    assert torch.allclose(tail, whole[10:], atol=1e-4)
    assert not k[:, n:].any()  # nothing written past the step rows


def test_static_attention_equals_dynamic(stories):
    model, cfg, _ = stories
    P = len(PROMPT)
    layout, ids, positions = lookahead_step(cfg.vocab_size, P, seed=3)
    outs = []
    for attention in (sdpa_attention, sdpa_attention_static):
        _, cache = run(model, PROMPT, attention=attention)
        logits, _ = run(model, ids, positions, cache, cache_len=P, mask=layout.mask, attention=attention)
        outs.append(logits)
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5


def test_static_attention_mask_layout():
    step = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    m = static_attention_mask(torch.tensor(2), step, 7)
    expect = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(m, expect)


def test_attention_seam_is_replaceable(stories):
    """Every layer calls the one attention function with (q [T,Hq,D], k/v cache [S,Hkv,D], p, step mask)."""
    model, cfg, _ = stories
    calls = []

    def spy(q, k_cache, v_cache, cache_len, step_mask):
        calls.append((tuple(q.shape), tuple(k_cache.shape), int(cache_len), tuple(step_mask.shape)))
        return sdpa_attention(q, k_cache, v_cache, cache_len, step_mask)

    ref, _ = run(model, PROMPT[:5])
    logits, _ = run(model, PROMPT[:5], attention=spy, rows=64)
    assert torch.equal(logits, ref)
    assert calls == [((5, 8, 8), (64, 4, 8), 0, (5, 5))] * cfg.num_layers
    calls.clear()
    default = model.attention
    model.attention = spy
    try:
        run(model, PROMPT[:2], rows=64)
    finally:
        model.attention = default
    assert len(calls) == cfg.num_layers


def tiny_hf_config(**overrides) -> LlamaConfig:
    kw = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def save_random(tmp_path: Path, cfg: LlamaConfig, seed: int = 0) -> tuple[Path, LlamaForCausalLM]:
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a mixed-up norm weight shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    return tmp_path, hf


LAYOUTS = ["out_in", "in_out"] + (["onednn"] if onednn_linear_available() else [])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_llama3_rope_untied_matches_transformers(tmp_path, bias, layout):
    hf_cfg = tiny_hf_config(attention_bias=bias, mlp_bias=bias)
    path, hf = save_random(tmp_path, hf_cfg)
    model, cfg = load_llama(path, weight_layout=layout)
    assert cfg.rope_scaling["rope_type"] == "llama3" and not cfg.tie_word_embeddings
    assert cfg.attention_bias == cfg.mlp_bias == bias
    assert model.weight_layout == layout
    assert not torch.equal(model.output.dense_weight(), model.tok_embeddings.weight)
    plain = rope_inv_freq(ModelConfig(**{**cfg.to_dict(), "rope_scaling": None, "eos_token_ids": ()}))
    assert not torch.allclose(model.inv_freq, plain)  # the scaling really changes frequencies
    assert torch.equal(model.inv_freq, hf.model.rotary_emb.inv_freq)

    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 97, 150).tolist()  # past original_max_position_embeddings
    logits, cache = run(model, prompt)
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4

    layout, ids, positions = lookahead_step(97, len(prompt), seed=2)
    P = len(prompt)
    step, _ = run(model, ids, positions, cache, cache_len=P, mask=layout.mask)
    assert (step - hf_step_logits(hf, prompt, layout, ids, positions)).abs().max().item() < 1e-4


def test_config_formats_agree():
    """transformers-4 style (rope_theta + rope_scaling{type}) and 5 style (rope_parameters) read the same."""
    v5 = tiny_hf_config().to_dict()
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4["rope_theta"] = 500000.0
    v4["rope_scaling"] = {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    a, b = ModelConfig.from_hf(v5), ModelConfig.from_hf(v4)
    assert a == b and a.rope_scaling == b.rope_scaling
    assert torch.equal(rope_inv_freq(a), rope_inv_freq(b))
    linear = ModelConfig.from_hf({**v4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert torch.allclose(rope_inv_freq(linear) * 2, rope_inv_freq(ModelConfig.from_hf({**v4, "rope_scaling": None})))
    with pytest.raises(UserError, match="RoPE type 'yarn'"):
        ModelConfig.from_hf({**v4, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(UserError, match="hidden_act"):
        ModelConfig.from_hf({**v4, "hidden_act": "gelu"})
    with pytest.raises(UserError, match="wrong type"):
        ModelConfig.from_hf({**v4, "hidden_size": "big"})
    eos = ModelConfig.from_hf({**v4, "eos_token_id": [5, 7]})
    assert eos.eos_token_ids == (5, 7)


def test_weight_layouts_agree(stories):
    plain, _ = load_llama(STORIES)
    assert plain.weight_layout == "out_in" and plain.output.weight is plain.tok_embeddings.weight
    for dtype in (torch.float32, torch.bfloat16):  # bfloat16 oneDNN needs AVX-512 or AVX-NE-CONVERT
        assert auto_weight_layout("cpu", dtype) == ("onednn" if onednn_linear_available(dtype) else "out_in")
    assert auto_weight_layout("cuda", torch.float32) == "out_in"
    ref, _ = run(plain, PROMPT)
    for layout in LAYOUTS[1:]:
        plain.set_weight_layout(layout)
        assert plain.weight_layout == layout and plain.output.weight is not plain.tok_embeddings.weight
        assert torch.equal(plain.output.dense_weight(), plain.tok_embeddings.weight)
        logits, _ = run(plain, PROMPT)
        assert (logits - ref).abs().max().item() < 1e-5, layout
    plain.set_weight_layout("out_in")
    assert plain.output.weight is plain.tok_embeddings.weight  # tied again
    assert torch.equal(run(plain, PROMPT)[0], ref)
    with pytest.raises(UserError, match="weight layout"):
        load_llama(STORIES, weight_layout="columns")


@pytest.mark.skipif(not onednn_linear_available(), reason="this torch has no oneDNN packed linear (non-x86 build)")
def test_onednn_linear_is_batch_invariant():
    """A row's projection is bit-identical whether it is fed alone or with 15 others (unlike MKL sgemm)."""
    torch.manual_seed(0)
    lin = Linear(576, 1536, bias=False)
    x = torch.randn(16, 576)
    lin.set_layout("onednn")
    with torch.inference_mode():
        assert torch.equal(lin(x[:1])[0], lin(x)[0])
        assert torch.equal(lin(x[5:6])[0], lin(x)[5])


def test_sharded_checkpoint_loads_like_single(tmp_path):
    path, hf = save_random(tmp_path / "single", tiny_hf_config())
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a, _ = load_llama(path)
    b, _ = load_llama(tmp_path / "sharded")
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(ta, tb)


@pytest.mark.parametrize("bias", [False, True])
def test_a_deferred_load_reads_each_projection_only_when_asked(tmp_path, bias):
    """load_llama_deferred: every bias-free projection (an untied lm_head included) is a fake tensor until its reader
    is called, which returns the checkpoint's own tensors in float32, q/k/v and gate/up concatenated, read across
    shards; the rest is read now; read_deferred makes the model load_llama's, logits bit for bit."""
    hf_cfg = tiny_hf_config(attention_bias=bias, mlp_bias=bias)
    _, hf = save_random(tmp_path / "single", hf_cfg)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "sharded", max_shard_size="50KB")  # fused parts across shards
    path = tmp_path / "sharded"
    assert len(list(path.glob("model-*.safetensors"))) > 1
    eager, cfg = load_llama(path)
    model, _, deferred = load_llama_deferred(path, 0)
    layers = [f"layers.{i}." for i in range(cfg.num_layers)]
    projections = [f"{p}attention.{n}.weight" for p in layers for n in ("wqkv", "wo")]
    projections += [f"{p}feed_forward.{n}.weight" for p in layers for n in ("w13", "w2")]
    assert set(deferred) == ({"output.weight"} if bias else {"output.weight", *projections})
    params = dict(eager.named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param, FakeTensor) == (name in deferred), name
        if name not in deferred:
            assert torch.equal(param, params[name]), name
    source = hf.model.layers[1]
    parts = [source.self_attn.q_proj, source.self_attn.k_proj, source.self_attn.v_proj]
    want = torch.cat([m.weight.detach().to(torch.bfloat16).float() for m in parts])
    if not bias:
        assert torch.equal(deferred["layers.1.attention.wqkv.weight"](), want)
        gate_up = [source.mlp.gate_proj.weight, source.mlp.up_proj.weight]
        want = torch.cat([w.detach().to(torch.bfloat16).float() for w in gate_up])
        assert torch.equal(deferred["layers.1.feed_forward.w13.weight"](), want)
    assert torch.equal(deferred["output.weight"](), hf.lm_head.weight.detach().to(torch.bfloat16).float())
    assert isinstance(model.output.weight, FakeTensor)  # a reader returns a tensor and keeps none

    model.set_submodule("layers.0.attention.wo", eager.layers[0].attention.wo)  # as a build replaces projections
    read_deferred(model, deferred)
    assert not any(isinstance(p, FakeTensor) for p in model.parameters())
    prompt = list(range(3, 40))
    assert torch.equal(run(model, prompt)[0], run(eager, prompt)[0])


def test_a_deferred_projection_is_read_only_from_min_bytes_and_never_a_tied_head():
    """min_bytes spares the small projections; a tied lm_head is the embedding, which is read at once."""
    model, cfg, deferred = load_llama_deferred(STORIES, 64 * 172 * 4)  # w13 and w2 have 2 * 172 * 64, 64 * 172
    assert cfg.tie_word_embeddings and "output.weight" not in deferred
    mlp = {f"layers.{i}.feed_forward.{n}.weight" for i in range(cfg.num_layers) for n in ("w13", "w2")}
    assert set(deferred) == mlp
    assert model.output.weight is model.tok_embeddings.weight and not isinstance(model.output.weight, FakeTensor)


def test_a_deferred_weight_whose_file_went_bad_is_one_clear_error(tmp_path):
    """A reader opens the checkpoint anew: a weight file truncated after the load raises UserError naming it."""
    path = copy_stories(tmp_path)
    _, _, deferred = load_llama_deferred(path, 0)
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(UserError, match=r"weight file .*model\.safetensors is unreadable.*re-download it"):
        deferred["layers.0.attention.wqkv.weight"]()


def test_bfloat16_and_float16_load(stories):
    model32, _, _ = stories
    ref, _ = run(model32, PROMPT)
    for dtype, tol in (("bfloat16", 0.5), ("float16", 0.05)):
        model, _ = load_llama(STORIES, dtype=dtype)
        assert model.dtype == getattr(torch, dtype) and model.inv_freq.dtype == torch.float32
        logits, (k, _) = run(model, PROMPT)
        assert k.dtype == model.dtype and logits.dtype == model.dtype
        assert (logits.float() - ref).abs().max().item() < tol
    with pytest.raises(UserError, match="unsupported dtype"):
        load_llama(STORIES, dtype="int8")


# -- checkpoint errors ------------------------------------------------------------------------------


def copy_stories(tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(STORIES, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def rewrite_weights(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _missing_dir(p: Path) -> Path:
    return p / "nope"


def _a_file(p: Path) -> Path:
    return p / "config.json"


def _no_config(p: Path) -> Path:
    (p / "config.json").unlink()
    return p


def _bad_json(p: Path) -> Path:
    (p / "config.json").write_text('{"model_type": "llama", ')
    return p


def _json_list(p: Path) -> Path:
    (p / "config.json").write_text("[1, 2]")
    return p


def _mistral(p: Path) -> Path:
    edit_config(p, model_type="mistral", architectures=["MistralForCausalLM"])
    return p


def _gpt2_arch(p: Path) -> Path:
    edit_config(p, architectures=["GPT2LMHeadModel"])
    return p


def _pickle(p: Path) -> Path:
    (p / "model.safetensors").rename(p / "pytorch_model.bin")
    return p


def _pt(p: Path) -> Path:
    (p / "model.safetensors").rename(p / "consolidated.00.pt")
    return p


def _gguf(p: Path) -> Path:
    (p / "model.safetensors").rename(p / "model.Q4_1.gguf")
    return p


def _no_weights(p: Path) -> Path:
    (p / "model.safetensors").unlink()
    return p


def _truncated(p: Path) -> Path:
    data = (p / "model.safetensors").read_bytes()
    (p / "model.safetensors").write_bytes(data[: len(data) // 2])
    return p


def _garbage(p: Path) -> Path:
    (p / "model.safetensors").write_bytes(b"\x00" * 3)
    return p


def _missing_tensor(p: Path) -> Path:
    rewrite_weights(p, lambda t: t.pop("model.layers.3.mlp.up_proj.weight"))
    return p


def _shape_mismatch(p: Path) -> Path:
    edit_config(p, intermediate_size=128)
    return p


def _untied_without_head(p: Path) -> Path:
    edit_config(p, tie_word_embeddings=False)
    return p


def _missing_shard(p: Path) -> Path:
    (p / "model.safetensors").rename(p / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "model.norm.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
        }
    }
    (p / "model.safetensors.index.json").write_text(json.dumps(index))
    return p


def _bad_index(p: Path) -> Path:
    (p / "model.safetensors.index.json").write_text("{}")
    return p


def _bad_heads(p: Path) -> Path:
    edit_config(p, num_key_value_heads=3)
    return p


def _nan_weight(p: Path) -> Path:
    rewrite_weights(p, lambda t: t["model.layers.2.mlp.down_proj.weight"].__setitem__((5, 7), float("nan")))
    return p


def _infinite_weights(p: Path) -> Path:
    rewrite_weights(p, lambda t: t["model.embed_tokens.weight"][3, :2].copy_(torch.tensor([float("inf"), -1e39])))
    return p


def _no_hidden(p: Path) -> Path:
    cfg = json.loads((p / "config.json").read_text())
    del cfg["hidden_size"]
    (p / "config.json").write_text(json.dumps(cfg))
    return p


CASES = {
    _missing_dir: r"does not exist",
    _a_file: r"is a file, not a directory",
    _no_config: r"has no config\.json",
    _bad_json: r"config\.json is not valid JSON",
    _json_list: r"not an object",
    _mistral: r"not a Llama checkpoint \(model_type 'mistral'",
    _gpt2_arch: r"not a Llama checkpoint.*GPT2LMHeadModel",
    _pickle: r"pickle weights \(pytorch_model\.bin\).*convert them to safetensors",
    _pt: r"pickle weights \(consolidated\.00\.pt\).*convert",
    _gguf: r"GGUF weights.*convert",
    _no_weights: r"has no model\.safetensors",
    _truncated: r"model\.safetensors is unreadable.*truncated or corrupt",
    _garbage: r"model\.safetensors is unreadable",
    _missing_tensor: r"lacks tensor\(s\) model\.layers\.3\.mlp\.up_proj\.weight",
    _shape_mismatch: r"model\.safetensors has shape \[\d+, \d+\] but config\.json implies \[\d+, \d+\]",
    _untied_without_head: r"lacks tensor\(s\) lm_head\.weight",
    _missing_shard: r"missing weight shard\(s\) model-00002-of-00002\.safetensors",
    _bad_index: r"model\.safetensors\.index\.json is malformed",
    _bad_heads: r"not a multiple of its 3 key/value heads",
    _no_hidden: r"config\.json has no 'hidden_size'",
    _nan_weight: r"weight model\.layers\.2\.mlp\.down_proj\.weight in .*model\.safetensors holds 1 NaN or infinite "
                 r"value\(s\); the checkpoint is corrupt: re-download",
    _infinite_weights: r"weight model\.embed_tokens\.weight in .*model\.safetensors holds 2 NaN or infinite value",
}


@pytest.mark.parametrize("breaker", list(CASES), ids=[f.__name__.strip("_") for f in CASES])
def test_broken_checkpoints_raise_one_clear_user_error(tmp_path, breaker):
    path = breaker(copy_stories(tmp_path))
    with pytest.raises(UserError, match=CASES[breaker]) as info:
        load_llama(path)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400
    assert str(tmp_path) in message


def test_weights_past_float16s_range_are_refused_in_float16_only(tmp_path):
    """A finite weight beyond float16's largest (65504) would become an infinity in a float16 model: refused, naming
    the weight, its magnitude and the dtypes that hold it; float32 and bfloat16 load it as it is."""
    path = copy_stories(tmp_path)
    rewrite_weights(path, lambda t: t["model.layers.1.self_attn.o_proj.weight"].__setitem__((0, 0), -7e4))
    with pytest.raises(UserError, match=r"weight model\.layers\.1\.self_attn\.o_proj\.weight in .* holds 1 "
                       r"value\(s\) past float16's range \(largest magnitude 7e\+04\); run it in float32 or bfloat16"):
        load_llama(path, dtype="float16")
    for dtype in ("float32", "bfloat16"):
        model, _ = load_llama(path, dtype=dtype)
        assert model.layers[1].attention.wo.weight.float().abs().max().item() == pytest.approx(7e4, rel=1e-2)


def test_a_deferred_weight_holding_a_nan_is_refused_when_read(tmp_path):
    """A quantized build reads its projections later (load_llama_deferred): a NaN in one is refused then, by name,
    and the projections without one still read."""
    path = copy_stories(tmp_path)
    rewrite_weights(path, lambda t: t["model.layers.0.self_attn.v_proj.weight"].__setitem__((1, 2), float("nan")))
    _, _, deferred = load_llama_deferred(path, 0)
    with pytest.raises(UserError, match=r"weight model\.layers\.0\.self_attn\.v_proj\.weight in .* holds 1 NaN"):
        deferred["layers.0.attention.wqkv.weight"]()
    assert torch.isfinite(deferred["layers.1.attention.wqkv.weight"]()).all()


def test_a_weight_file_larger_than_memory_names_the_file_and_the_fix(tmp_path):
    """The safetensors library maps a weight file copy-on-write, and Linux's default overcommit refuses such a map
    larger than memory and swap (a GGUF 8B's float32 conversion was one 27 GiB file on a 24 GiB machine): one
    message names the file, its size and the fix. The file: a well-formed header of one byte tensor twice that size,
    its data sparse."""
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() != "0":
        pytest.skip("a mapping is refused for its size under Linux's default (heuristic) overcommit only")
    meminfo = {key: int(value.split()[0]) * 1024 for key, value in
               (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}
    size = 2 * (meminfo["MemTotal"] + meminfo["SwapTotal"])
    header = json.dumps({"pad": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    path = copy_stories(tmp_path)
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + size)
    with pytest.raises(UserError, match=r"model\.safetensors \([\d.]+ GiB\) cannot be mapped here .*in shards"):
        load_llama(path)


def tokenizer_case(tmp_path: Path, case: str) -> Path:
    """A checkpoint dir whose tokenizer files make load_tokenizer take each of its paths."""
    if case == "smollm2":
        from trt_lookahead.model.fetch import resolve_model

        return resolve_model("smollm2-135m-instruct")
    if case == "stories":
        return STORIES
    path = copy_stories(tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    if case == "no-tokenizer-config":
        (path / "tokenizer_config.json").unlink()
        return path
    named = {"backend": "TokenizersBackend", "llama-class": "LlamaTokenizer"}[case]
    chat = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": named,
                                                            "chat_template": chat}))
    return path


@pytest.mark.parametrize("case", ["stories", "backend", "llama-class", "no-tokenizer-config",
                                  pytest.param("smollm2", marks=pytest.mark.slow)])
def test_the_tokenizer_is_the_one_auto_tokenizer_loads(tmp_path, case):
    """load_tokenizer names the tokenizer class itself when tokenizer_config.json names the plain tokenizer.json one
    (skipping the model config AutoTokenizer reads, and the model code that imports); whichever path it takes, the
    tokenizer is AutoTokenizer's: same class, special tokens, ids, texts and chat prompts."""
    from transformers import AutoTokenizer

    from trt_lookahead.model.checkpoint import load_tokenizer

    path = tokenizer_case(tmp_path, case)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(auto)
    for attribute in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                      "model_max_length", "padding_side", "chat_template"):
        assert getattr(ours, attribute) == getattr(auto, attribute), attribute
    assert len(ours) == len(auto) and ours.get_vocab() == auto.get_vocab()
    texts = ["Once upon a time,  there was a cat.", " leading space", "def f(x):\n    return x  # 12345",
             "<s>Hi</s> there <|im_end|>", "naïve café ✓ 日本語", ""]
    for text in texts:
        for special in (True, False):
            ids = auto.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    if auto.chat_template:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[0]}]
        for prompt in (True, False):
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == \
                auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def test_read_config_accepts_the_fixture():
    assert read_config(STORIES).vocab_size == 512


# -- SmolLM2 (slow) ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_logits_match_transformers():
    try:
        from trt_lookahead.model.fetch import resolve_model
    except ImportError:
        pytest.skip("trt_lookahead.model.fetch (resolve_model) does not exist yet")
    path = resolve_model("smollm2-135m-instruct")
    model, cfg = load_llama(path, weight_layout="auto")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    hf = hf_model(path)
    prompt = [1604, 3987, 46477, 24, 94, 727, 198, 5248, 314, 253, 1345, 2036]
    logits, cache = run(model, prompt, rows=128)
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (logits - ref).abs().max().item() < 2e-3
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    layout, ids, positions = lookahead_step(cfg.vocab_size, len(prompt))
    T, P = layout.step_tokens, len(prompt)
    step, _ = run(model, ids, positions, cache, cache_len=P, mask=layout.mask)
    hf_cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf(torch.tensor([prompt]), past_key_values=hf_cache, use_cache=True)
        allow = torch.cat([torch.ones(T, P, dtype=torch.bool), torch.from_numpy(layout.mask.copy())], 1)
        mask4d = torch.zeros(1, 1, T, P + T).masked_fill(~allow, torch.finfo(torch.float32).min)
        ref = hf(ids[None], attention_mask=mask4d, position_ids=positions[None], past_key_values=hf_cache).logits[0]
    assert (step - ref).abs().max().item() < 2e-3


def test_bfloat16_auto_layout_runs_where_onednn_cannot(tmp_path, capsys):
    # issue 10: on AVX2-only CPUs (like this dev machine) the auto layout picked oneDNN for bfloat16 after
    # probing it in float32 only, and generate died in mkldnn_reorder_linear_weight
    from trt_lookahead.cli import main

    model, _ = save_random(tmp_path / "wide", tiny_hf_config(hidden_size=256, vocab_size=512))  # auto may pick onednn
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copyfile(STORIES / name, model / name)
    loaded, _ = load_llama(model, dtype="bfloat16", weight_layout="auto")
    assert loaded.weight_layout == ("onednn" if onednn_linear_available(torch.bfloat16) else "out_in")
    code = main(["generate", "--model", str(model), "--dtype", "bfloat16", "--prompt", "Once upon a time",
                 "--max-new-tokens", "6", "--greedy", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out)["generated_tokens"] == 6
    if not onednn_linear_available(torch.bfloat16):
        with pytest.raises(ValueError, match="bfloat16"):
            loaded.set_weight_layout("onednn")
