"""The TensorRT executor's host-side checks that run without TensorRT (the rest needs a GPU and TensorRT).

TensorRT cannot be installed on the CPU machines, so `bind` is driven by a small stand-in for
IExecutionContext that answers as TensorRT's does: False for an unknown tensor name or a shape outside
the profile, never an exception.
"""

import pytest

from trt_lookahead.backends.tensorrt import bind


class Context:
    """set_input_shape / set_tensor_address / infer_shapes of an IExecutionContext with a fixed I/O set."""

    def __init__(self, inputs: dict[str, int], outputs: set[str]) -> None:
        self.inputs, self.outputs = inputs, outputs  # input name -> largest token count of the profile
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        if name not in self.inputs or not 1 <= shape[0] <= self.inputs[name]:
            return False
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        if (name not in self.inputs and name not in self.outputs) or address % 256:
            return False
        self.addresses[name] = address
        return True

    def infer_shapes(self) -> list[str]:
        return sorted(set(self.inputs) - set(self.shapes))


def context() -> Context:
    return Context({"input_ids": 16, "positions": 16}, {"next_ids"})


def test_bind_sets_every_shape_and_address():
    ctx = context()
    bind(ctx, {"input_ids": (16,), "positions": (16,)}, {"input_ids": 256, "positions": 512, "next_ids": 768})
    assert ctx.shapes == {"input_ids": (16,), "positions": (16,)}
    assert ctx.addresses == {"input_ids": 256, "positions": 512, "next_ids": 768}


@pytest.mark.parametrize("shapes,addresses,message", [
    ({"input_id": (16,)}, {}, "shape (16,) for input 'input_id'"),
    ({"input_ids": (17,), "positions": (16,)}, {}, "shape (17,) for input 'input_ids'"),
    ({"input_ids": (16,), "positions": (16,)}, {"logits": 256}, "address of tensor 'logits'"),
    ({"input_ids": (16,), "positions": (16,)}, {"next_ids": 100}, "address of tensor 'next_ids'"),
    ({"input_ids": (16,)}, {}, "could not infer the shapes of ['positions']"),
])
def test_bind_names_what_tensorrt_refused(shapes, addresses, message):
    with pytest.raises(RuntimeError) as info:
        bind(context(), shapes, addresses)
    assert message in str(info.value)
