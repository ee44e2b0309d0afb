"""Session setup that must happen before any test module imports triton."""

import os

import pytest

from trt_lookahead.backends.devices import gpu_count

# Triton decides at decoration time whether a @triton.jit function is interpreted; without a GPU the
# kernel tests run under the interpreter on CPU tensors.
if gpu_count() == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module (tiny models run fastest so); the old count is restored."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
