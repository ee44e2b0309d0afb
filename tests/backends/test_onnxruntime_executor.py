"""The onnxruntime executor on built engine dirs: same tokens as the torch executor (float32), refusals.

stories260K engines are built once per module; SmolLM2-135M runs only in @slow tests.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from trt_lookahead.backends.open import open_engine
from trt_lookahead.backends.torch import TorchExecutor
from trt_lookahead.cli import main
from trt_lookahead.engine.format import FORMAT_VERSION, load_engine_config
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.decoder import LookaheadDecoder
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.model.checkpoint import load_llama

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
MAX_SEQ_LEN = 256
PROMPTS = [[1], [1, 403, 407, 261, 378], [1, 88, 314, 54, 291, 400, 265, 284, 69, 42, 290, 273]]

pytestmark = pytest.mark.export  # every test here builds or reads engine dirs


def build(out: Path, config: str, *extra, model=STORIES, max_seq_len=MAX_SEQ_LEN, max_input_len=64) -> Path:
    argv = ["build", "--model", str(model), "--output", str(out), "--lookahead_config", config,
            "--max_seq_len", str(max_seq_len), "--max_input_len", str(max_input_len), *extra]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("engines")
    return {
        "plugin": build(root / "plugin-4-3-4", "4,3,4"),
        "native": build(root / "native-4-3-4", "4,3,4", "--attention", "native"),
    }


@pytest.fixture(scope="module")
def stories():
    model, _ = load_llama(STORIES)
    return model


def generate(executor, layout, prompt, max_new_tokens=48, sampling=None):
    decoder = LookaheadDecoder(executor, layout, stop_tokens=[], seed=0)
    return decoder.generate(prompt, max_new_tokens, sampling).token_ids


def torch_executor(model, layout):
    return TorchExecutor(model, layout.mask, MAX_SEQ_LEN, output_slots=layout.output_slots)


@pytest.mark.parametrize("mode", ["plugin", "native"])
@pytest.mark.parametrize("config", ["4,3,4", "2,2,1", "3,3,0", "greedy"])
def test_same_tokens_as_the_torch_executor(engines, stories, mode, config):
    """The engine's own config, smaller configs padded to its T, and greedy (T = 1) all match torch."""
    engine = open_engine(engines[mode])
    cfg = LookaheadConfig.greedy() if config == "greedy" else LookaheadConfig.parse(config)
    padded = None if cfg.is_greedy else engine.step_tokens
    layout = StepLayout(cfg, padded_tokens=padded)
    unpadded = StepLayout(cfg)
    ours, theirs = engine.make_executor(layout), torch_executor(stories, unpadded)
    for prompt in PROMPTS:
        expected = generate(theirs, unpadded, prompt)
        assert generate(ours, layout, prompt) == expected, (mode, config, prompt)
    greedy = torch_executor(stories, StepLayout(LookaheadConfig.greedy()))
    assert generate(greedy, StepLayout(LookaheadConfig.greedy()), PROMPTS[1]) == generate(ours, layout, PROMPTS[1])


def test_step_outputs_and_commit_match_torch_slot_by_slot(engines, stories):
    engine = open_engine(engines["plugin"])
    layout = StepLayout(LookaheadConfig(4, 3, 4))
    ours, theirs = engine.make_executor(layout), torch_executor(stories, layout)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 512, 40)
    assert ours.prefill(prompt) == theirs.prefill(prompt)
    p = len(prompt)
    for _ in range(4):
        ids = rng.integers(0, 512, layout.step_tokens)
        a, b = ours.step(ids, p + layout.rel_positions), theirs.step(ids, p + layout.rel_positions)
        assert np.array_equal(a, b)
        assert (a[layout.output_slots] >= 0).all()
        slots = np.array([0, *layout.candidate_slots[1][:1]])  # x_t plus one draft: a two-token commit
        ours.commit(slots)
        theirs.commit(slots)
        p += len(slots)
    assert ours.cache_len == theirs.cache_len == p


def test_long_prompt_is_prefilled_in_chunks(engines, stories):
    """max_input_len is 64: a 150-token prompt runs through the prefill graph in three pieces."""
    engine = open_engine(engines["plugin"])
    layout = StepLayout(LookaheadConfig(4, 3, 4))
    prompt = np.random.default_rng(2).integers(0, 512, 150).tolist()
    expected = generate(torch_executor(stories, layout), layout, prompt, 32)
    assert generate(engine.make_executor(layout), layout, prompt, 32) == expected


@pytest.mark.parametrize("seed", [0, 3])
def test_seeded_sampling_matches_the_torch_executor(engines, stories, seed):
    engine = open_engine(engines["plugin"])
    layout = StepLayout(LookaheadConfig(4, 3, 4))
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=seed)
    expected = generate(torch_executor(stories, layout), layout, PROMPTS[1], 40, sampling)
    assert generate(engine.make_executor(layout), layout, PROMPTS[1], 40, sampling) == expected


def test_runtime_generates_from_the_engine_dir(engines):
    from trt_lookahead.runtime import LookaheadRuntime

    checkpoint = LookaheadRuntime.from_pretrained(STORIES, lookahead="4,3,4", max_seq_len=MAX_SEQ_LEN)
    engine = LookaheadRuntime.from_pretrained(engines["plugin"])
    assert engine.backend == "onnxruntime"
    for config in ("4,3,4", "2,2,1", "greedy"):
        a = engine.generate("Once upon a time", max_new_tokens=40, lookahead=config)
        b = checkpoint.generate("Once upon a time", max_new_tokens=40, lookahead=config)
        assert a.token_ids == b.token_ids and a.text == b.text


def test_requests_that_do_not_fit_are_refused_naming_what_differs(engines, tmp_path):
    path = engines["plugin"]
    with pytest.raises(UserError, match=r"W=5 > 4"):
        open_engine(path, lookahead=LookaheadConfig(5, 3, 4))
    with pytest.raises(UserError, match=r"N=4 > 3.*G=6 > 4"):
        open_engine(path, lookahead=LookaheadConfig(4, 4, 6))
    with pytest.raises(UserError, match="holds float32 weights"):
        open_engine(path, dtype="bfloat16")
    with pytest.raises(UserError, match="max_seq_len 4096 exceeds the engine's 256"):
        open_engine(path, max_seq_len=4096)
    open_engine(path, model=STORIES)  # built from it
    other = tmp_path / "other"
    shutil.copytree(STORIES, other)
    (other / "model.safetensors").write_bytes((STORIES / "model.safetensors").read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(UserError, match="built from another model"):
        open_engine(path, model=other)
    engine = open_engine(path)
    with pytest.raises(UserError, match="does not fit engine"):
        engine.make_executor(StepLayout(LookaheadConfig(2, 2, 1)))  # 3 slots, not padded to 16
    with pytest.raises(ValueError, match="does not fit the engine built for 4/3/4"):
        engine.make_executor(StepLayout(LookaheadConfig(3, 4, 0), padded_tokens=16))  # N=4 > 3


def test_not_an_engine_dir_and_incomplete_engines_are_refused(engines, tmp_path):
    with pytest.raises(UserError, match="not a trt-lookahead engine dir"):
        load_engine_config(STORIES)
    copy = tmp_path / "broken"
    shutil.copytree(engines["plugin"], copy)
    (copy / "step.onnx").unlink()
    with pytest.raises(UserError, match=r"incomplete.*step\.onnx"):
        load_engine_config(copy)
    config = json.loads((copy / "config.json").read_text())
    assert config["trt_lookahead_engine"] == FORMAT_VERSION


@pytest.mark.slow
def test_smollm2_engine_matches_the_torch_executor(tmp_path):
    from trt_lookahead.model.fetch import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    engine_dir = build(tmp_path / "smollm2", "4,3,4", model=path, max_seq_len=512, max_input_len=256)
    model, _ = load_llama(path)
    engine = open_engine(engine_dir)
    prompts = [[1, 504, 3458, 282, 260, 1345, 30], list(range(100, 160))]
    for config in ("4,3,4", "greedy"):
        cfg = LookaheadConfig.greedy() if config == "greedy" else LookaheadConfig.parse(config)
        layout = StepLayout(cfg, padded_tokens=None if cfg.is_greedy else engine.step_tokens)
        ours = engine.make_executor(layout)
        theirs = TorchExecutor(model, StepLayout(cfg).mask, 512, output_slots=StepLayout(cfg).output_slots)
        for prompt in prompts:
            assert generate(ours, layout, prompt, 32) == generate(theirs, StepLayout(cfg), prompt, 32), (config, prompt)
