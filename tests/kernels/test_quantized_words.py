"""QuantizedLinear's words layout (where set_layout puts each code, the weight it holds) and
kernels/quantized_words.py's product by it: against the float64 product by that weight, a row's bits whatever the
batch, the span rule and where the product runs; the padded step through it. Interpreted on the CPU (float32
weights holding the bfloat16 values a GPU's pairs hold); compiled where a GPU is (gpu_check)."""

from __future__ import annotations

import pytest
import torch

from trt_lookahead.backends.devices import gpu_count
from trt_lookahead.backends.torch import words_layout_applies
from trt_lookahead.kernels.quantized_words import words_kernel_reason, words_linear, words_span
from trt_lookahead.model.llama import QuantizedLinear

DEVICE = "cuda" if gpu_count() else "cpu"  # where the kernel runs (interpreted on the CPU)


def int4_buffers(n: int, k: int, seed: int, exact: bool = False):
    """Random int4 (codes, scales, zero points, mins) in MatMulNBits' layout; exact: scales powers of two and
    mins multiples of 1/64, so bfloat16 holds them and every weight exactly."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-k // 32)
    codes = torch.randint(0, 256, (n, blocks * 16), dtype=torch.uint8, generator=g)
    zeros = torch.randint(0, 256, (n, -(-blocks // 2)), dtype=torch.uint8, generator=g)
    if exact:
        scales = 2.0 ** -torch.randint(3, 7, (n, blocks), generator=g).float()  # weights below 4 in steps of 1/64
        mins = torch.randint(-64, 64, (n, blocks), generator=g).float() / 64
    else:
        scales = torch.rand(n, blocks, generator=g) / 16
        mins = torch.rand(n, blocks, generator=g) - 0.5
    return codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), mins.to(DEVICE)


def words(codes, scales, zeros, mins, k: int) -> QuantizedLinear:
    module = QuantizedLinear(codes, scales, zeros, mins, 4, k)
    module.set_layout("words")
    return module


def test_set_layout_puts_each_code_where_the_docstring_says():
    """Dim d of a step sits in word (d % 32) // 2, nibble d // 32 + 4 * (d % 2): dim 37 -> word 2, nibble 5;
    dim 127 (block 3, the last odd dim) -> word 15, nibble 7, the int32's sign bit. Each block's scale and offset
    -(128 + z) become one int32's low and high bfloat16 halves."""
    codes = torch.zeros(2, 64, dtype=torch.uint8)  # two outputs, K = 128: one step
    codes[0, 37 // 2] = 9 << 4  # dim 37: the high nibble of byte 18
    codes[1, 0] = 3  # dim 0
    codes[1, 33 // 2] = 5 << 4  # dim 33
    codes[1, 127 // 2] = 12 << 4  # dim 127
    zeros = torch.tensor([[0x21, 0x43], [0x00, 0xF0]], dtype=torch.uint8)  # blocks' z: (1, 2, 3, 4), (0, 0, 0, 15)
    module = words(codes, torch.tensor([[1.0, 2.0, 0.5, 4.0], [0.25, 1.0, 1.0, 1.0]]), zeros, None, 128)
    want = torch.zeros(2, 16, dtype=torch.int64)
    want[0, 2] = 9 << 20
    want[1, 0] = 3 | 5 << 20
    want[1, 15] = 12 << 28
    assert torch.equal(module.codes.long() & 0xFFFFFFFF, want)
    assert module.codes.dtype == torch.int32 and module.codes[1, 15] < 0
    assert module.scales.dtype == torch.int32 and module.zero_points is None and module.layout == "words"
    halves = module.scales.view(torch.bfloat16).view(2, 4, 2)
    assert halves[..., 0].tolist() == [[1.0, 2.0, 0.5, 4.0], [0.25, 1.0, 1.0, 1.0]]
    assert halves[..., 1].tolist() == [[-129, -130, -131, -132], [-128, -128, -128, -143]]
    # bfloat16 1.0 is 0x3F80 and -129.0 0xC301: the scale in the low half
    assert module.scales[0, 0].item() == 0xC3013F80 - 2**32


@pytest.mark.parametrize("k", [96, 128, 300])
def test_words_weight_is_the_blocks_weight_where_bfloat16_holds_it(k):
    """Scales, zero points and mins bfloat16 holds exactly: the words layout's weight is the blocks', every element
    (K = 96 and 300 pad the last step); a code read from the wrong dim moves an element by a scale."""
    codes, scales, zeros, mins = int4_buffers(7, k, seed=k, exact=True)
    for m in (None, mins):
        blocks = QuantizedLinear(codes, scales, zeros, m, 4, k).dense_weight()
        assert torch.equal(words(codes, scales, zeros, m, k).dense_weight(), blocks)


def test_words_weight_rounds_the_blocks_weight_to_bfloat16():
    codes, scales, zeros, mins = int4_buffers(9, 200, seed=1)
    blocks = QuantizedLinear(codes, scales, zeros, mins, 4, 200).dense_weight()
    got = words(codes, scales, zeros, mins, 200).dense_weight()
    # s and m rounded to bfloat16, then the weight: a few units of bfloat16's 2^-8 against the block's range
    scale = (scales * 15 + mins.abs()).repeat_interleave(32, 1)[:, :200]
    assert 0 < ((got - blocks).abs() / scale).max() < 2**-7


def test_set_layout_refuses_what_the_words_cannot_hold():
    codes, scales, zeros, _ = int4_buffers(4, 64, seed=2)
    int8 = QuantizedLinear(torch.zeros(4, 64, dtype=torch.uint8), scales, torch.zeros(4, 2, dtype=torch.uint8),
                           None, 8, 64)
    assert not int8.takes_layout("words")
    with pytest.raises(ValueError, match="int4 blocks of 32; this weight is int8"):
        int8.set_layout("words")
    module = words(codes, scales, zeros, None, 64)
    assert module.takes_layout("words") and not module.takes_layout("blocks")
    with pytest.raises(ValueError, match="cannot go back to blocks"):
        module.set_layout("blocks")
    with pytest.raises(ValueError, match="one of blocks, words"):
        module.set_layout("rows")
    module.set_layout("words")  # already: nothing to do
    assert module.layout == "words"


@pytest.mark.parametrize(("dtype", "k", "tile", "span", "tolerance"), [
    (torch.float32, 96, None, "auto", 1e-6),  # one step, K padded (a GPU's float32 dot: not tensor cores)
    (torch.float32, 1000, (64, 4, 3), 384, 1e-6),  # three spans of 3 steps: a half-used step, then one past K
    (torch.bfloat16, 512, (128, 8, 3), None, 8e-3),  # bfloat16 out: its rounding
])
def test_product_is_the_float64_product_by_the_layouts_weight(dtype, k, tile, span, tolerance):
    """70 outputs: a partial BLOCK_N; Q4_1 mins and zero points."""
    codes, scales, zeros, mins = int4_buffers(70, k, seed=3)
    for m in (None, mins):
        module = words(codes, scales, zeros, m, k)
        x = torch.randn(5, k, device=DEVICE).to(dtype)
        y = words_linear(x, module.codes, module.scales, module.mins,
                         *((tile,) if tile else ()), span=span)
        want = x.double() @ module.dense_weight().double().t()
        assert y.dtype == dtype and y.shape == (5, 70)
        assert ((y.double() - want).norm() / want.norm()).item() < tolerance


def test_a_row_has_the_same_bits_alone_and_in_any_batch(interpreted_float32_dot):
    """M = 1, 2 and 17 (two programs of 16 rows), three spans: row i's bits never depend on the rows beside it."""
    interpreted_float32_dot(torch.float32)  # the interpreter multiplies in float32
    codes, scales, zeros, mins = int4_buffers(64, 384, seed=4)
    module = words(codes, scales, zeros, mins, 384)
    args = (module.codes, module.scales, module.mins)
    x = torch.randn(17, 384, device=DEVICE).to(torch.bfloat16)
    together = words_linear(x, *args, span=128)
    for i in (0, 1, 16):
        assert torch.equal(words_linear(x[i : i + 1], *args, span=128)[0], together[i])
    assert torch.equal(words_linear(x[:2], *args, span=128), together[:2])


@pytest.mark.gpu
def test_a_programmatic_dependent_launch_waits_for_the_kernel_that_writes_its_rows():
    """Each call in a CUDA graph reads rows the kernel just before it wrote (x * i), launched as a programmatic
    dependent (it may start, and ask L2 for its weight, while that kernel still runs): the same bits as plain
    launches, the split product's span sums (launched so too) included."""
    if not gpu_count() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a CUDA device of compute capability 9.0 (programmatic dependent launch, wgmma)")
    codes, scales, zeros, mins = int4_buffers(4096, 4096, seed=6)
    module = words(codes, scales, zeros, mins, 4096)
    args = (module.codes, module.scales, module.mins)
    x = torch.randn(16, 4096, device=DEVICE).to(torch.bfloat16)
    for span in (None, 512):
        def calls(pdl: bool, span=span) -> list[torch.Tensor]:
            return [words_linear(x * i, *args, span=span, pdl=pdl) for i in range(1, 9)]

        plain = calls(False)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            calls(True)  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = calls(True)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(plain, outs, strict=True))


def test_refuses_a_span_that_splits_a_step_words_that_are_too_few_and_strided_scales():
    codes, scales, zeros, mins = int4_buffers(4, 256, seed=5)
    module = words(codes, scales, zeros, mins, 256)
    x = torch.ones(1, 256, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 128"):
        words_linear(x, module.codes, module.scales, None, span=96)
    with pytest.raises(ValueError, match="do not hold the input's 384 dims"):
        words_linear(torch.ones(1, 384, device=DEVICE), module.codes, module.scales, None)
    with pytest.raises(ValueError, match="24 words per output do not hold the input's 150 dims in whole steps"):
        words_linear(torch.ones(1, 150, device=DEVICE), module.codes[:, :24], module.scales, None)  # 192 codes
    with pytest.raises(ValueError, match="unit stride"):
        words_linear(x, module.codes, module.scales, module.mins.t().contiguous().t())


@pytest.mark.parametrize(("n", "k", "span"), [
    (12288, 4096, 1024),  # Llama-2-7B's QKV: 96 tiles of 128 outputs, four spans make 384 programs
    (4096, 4096, 512),  # its attention output: 32 tiles, eight spans
    (22016, 4096, 2048),  # gate and up: 172 tiles, two spans
    (4096, 11008, 1024),  # down: 32 tiles, eleven spans (the last a partial one)
    (32000, 4096, 2048),  # the lm_head: 250 tiles, two spans
    (40960, 4096, None),  # 320 tiles: all of K
    (576, 576, 128),  # SmolLM2's attention output: too few programs at any span, so the least
    (64, 128, None),  # one step: nothing to split
])
def test_span_makes_enough_programs_from_the_weights_shape_alone(n, k, span):
    assert words_span(n, k) == span


def test_the_kernel_reads_the_steps_the_layout_writes():
    """model/llama.py owns the layout and the kernel cannot import it (one layer): their step sizes must agree."""
    from trt_lookahead.kernels import quantized_words
    from trt_lookahead.model import llama

    assert quantized_words.STEP == llama.WORDS_STEP == 4 * llama.WORDS_BLOCK == 8 * llama.WORDS_PER_STEP


def test_where_the_product_runs():
    assert "not torch.float32" in words_kernel_reason(torch.device("cuda"), torch.float32)
    assert "runs on CUDA, not cpu" in words_kernel_reason(torch.device("cpu"), torch.bfloat16)
    assert not words_layout_applies(torch.device("cpu"), torch.bfloat16)
    if gpu_count():
        hopper = torch.cuda.get_device_capability() >= (9, 0)
        assert words_layout_applies(torch.device("cuda"), torch.bfloat16) == hopper


def test_the_padded_step_multiplies_by_the_words_weight():
    """A one-layer Llama on int4 weights in the words layout: the padded step's prompt logits (every projection
    kernels/quantized_words.py's product) are the packed step's (each projection F.linear by the layout's own
    dense weight), to bfloat16's rounding; a product reading the words as blocks would be far off."""
    import numpy as np

    from trt_lookahead.backends.torch import BatchedTorchExecutor
    from trt_lookahead.engine.quantize import quantize_model
    from trt_lookahead.lookahead.sampling import SamplingParams
    from trt_lookahead.model.llama import Llama, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32,
                      intermediate_size=256, vocab_size=300, max_position_embeddings=256)
    model = Llama(cfg).eval().requires_grad_(False)
    quantize_model(model, "int4", torch.bfloat16)
    model.set_quantized_layout("words")
    assert {m.layout for m in model.modules() if isinstance(m, QuantizedLinear)} == {"words"}
    prompt = np.random.default_rng(0).integers(0, 300, 20)
    logits = {}
    for padded in (True, False):
        ex = BatchedTorchExecutor(model.to(DEVICE), 1, 64, 8, DEVICE, padded=padded, cuda_graph=False, exact=False)
        logits[padded] = ex.prefill_logits(0, prompt, SamplingParams()).float().cpu()
    scale = logits[False].abs().max()
    assert ((logits[True] - logits[False]).abs().max() / scale).item() < 0.05
