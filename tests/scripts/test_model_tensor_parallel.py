"""scripts/model_tensor_parallel.py: the 70B paper model's arithmetic against published sizes and by hand."""

from __future__ import annotations

import argparse

import pytest
from support.scripts import load_script


@pytest.fixture(scope="module")
def model():
    return load_script("model_tensor_parallel")


def test_parameters_are_the_published_counts(model):
    """Llama-2-7B has 6,738,415,616 parameters (Hugging Face's count); Llama-3.1-70B 70.6e9."""
    llama2_7b = dict(hidden=4096, layers=32, heads=32, kv_heads=32, head_dim=128, ffn=11008, vocab=32000)
    assert model.parameters(llama2_7b) == 6_738_415_616
    assert round(model.parameters(model.LLAMA_70B) / 1e8) == 706


def test_one_collective_by_hand(model):
    """A 1-layer, 1-token toy at W = 2: S = 2 hidden x 2 bytes; each reduction's formula worked by hand."""
    toy = dict(hidden=1000, layers=1, heads=2, kv_heads=2, head_dim=500, ffn=2000, vocab=2000)
    args = argparse.Namespace(hbm_tbps=1.0, efficiency=1.0, link_gbps=1.0, latency_us=10.0, tflops=1e9, context=0)
    # S = 2,000 bytes; link 1 GB/s: 2 us a 2,000-byte hop; HBM 1 TB/s: 2 ns per S; the vocab gather: 2 us + 10 us
    gather = 10 + 2
    parts = {r: model.step_ms(toy, 2, 1, args, r)["reduce"] * 1e3 for r in model.REDUCTIONS}  # us
    assert parts["nccl"] == pytest.approx(2 * (10 + 2) + gather)  # latency + 2 (W - 1) / W x S / link
    assert parts["exact"] == pytest.approx(2 * (10 + 2 + 0.004) + gather)  # + (W - 1) S / link + W S / HBM
    assert parts["exact2"] == pytest.approx(2 * (20 + 2 + 0.002) + gather)  # 2 latency + ... + S / HBM
