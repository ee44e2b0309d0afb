"""SmolLM2-135M-Instruct (fetched from PyPI on first use): lookahead == greedy on one prompt of each set."""

import json
from pathlib import Path

import pytest
import torch

from trt_lookahead.runtime import LookaheadRuntime

DATA = Path(__file__).parents[2] / "trt_lookahead" / "bench" / "data"
SETS = {"mt_bench": "mt_bench.jsonl", "humaneval": "humaneval.jsonl", "gsm8k": "gsm8k_test.jsonl"}

pytestmark = pytest.mark.slow


def first_prompt(name: str):
    row = json.loads((DATA / SETS[name]).read_text().splitlines()[0])
    if "turns" in row:
        return [{"role": "user", "content": row["turns"][0]}]
    if "question" in row:
        return [{"role": "user", "content": row["question"]}]
    return row["prompt"]


# the default backend (onnxruntime, its cached engine: configs up to 8,5,8) and torch (any config)
CONFIGS = {"onnxruntime": ("4,3,4", "8,5,8"), "torch": ("4,3,4", "15,5,15")}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def smollm2(request):
    torch.set_num_threads(2)
    backend = None if request.param == "onnxruntime" else request.param
    with LookaheadRuntime.from_pretrained("smollm2-135m-instruct", backend=backend, max_seq_len=1024) as rt:
        assert rt.backend == request.param
        yield rt


@pytest.mark.parametrize("dataset", sorted(SETS))
def test_lookahead_equals_greedy_on_smollm2(smollm2, dataset):
    prompt = first_prompt(dataset)
    greedy = smollm2.generate(prompt, max_new_tokens=64, lookahead="greedy")
    assert greedy.generated_tokens > 8 and greedy.text.strip()
    for config in CONFIGS[smollm2.backend]:
        ahead = smollm2.generate(prompt, max_new_tokens=64, lookahead=config)
        assert ahead.token_ids == greedy.token_ids, (dataset, config)
        assert ahead.steps <= greedy.steps


def test_smollm2_chat_answer_is_the_documented_one(smollm2):
    # transformers' greedy answer of the same GGUF weights (measured once, recorded here)
    out = smollm2.generate("What is the capital of France?", chat=True, max_new_tokens=20)
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
