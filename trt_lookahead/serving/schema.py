"""The Triton model's request inputs and response outputs, defined once (docs/design.md section 7).

repository.py writes config.pbtxt's `input` and `output` lists from these; templates/model.py reads
requests and builds responses with them. Input names follow TensorRT-LLM's `ensemble` model; every
input but text_input is optional, and each may also be sent as a request parameter of the same name.
Numbers travel as 64-bit types (TensorRT-LLM declares several as INT32/FP32): tritonserver converts a JSON
number into a narrower input with wrap-around (top_k 2**32+1 arrived as 1, temperature 1e39 as inf), so
model.py range-checks the 64-bit values (through SamplingParams and LookaheadConfig) instead.
`Lookahead.from_parts` (lookahead/config.py) is the rule both servers (Triton's model and `serve`) apply to a
request's (W, N, G).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trt_lookahead.lookahead.sampling import SamplingParams

_SAMPLING = SamplingParams()


@dataclass(frozen=True)
class Field:
    """One Triton tensor: its name, Triton type, dims and, for an input, the Python type a request sends."""

    name: str
    triton_type: str  # TYPE_STRING, TYPE_INT32, ...
    kind: type = str  # str, int, float or bool
    default: object = None  # None: required, or taken from the served config / repository setting
    dims: tuple[int, ...] = (1,)
    optional: bool = True

    @property
    def numpy_dtype(self) -> type:
        return NUMPY_TYPES[self.triton_type]

    def pbtxt(self) -> str:
        dims = ", ".join(str(d) for d in self.dims)
        optional = " optional: true" if self.optional else ""
        return f'{{ name: "{self.name}" data_type: {self.triton_type} dims: [ {dims} ]{optional} }}'


NUMPY_TYPES: dict[str, type] = {
    "TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_FP64": np.float64,
    "TYPE_BOOL": np.bool_, "TYPE_UINT64": np.uint64,
}
LOOKAHEAD_INPUTS = ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")  # W, N, G
INPUTS = (
    Field("text_input", "TYPE_STRING", str, optional=False),
    Field("max_tokens", "TYPE_INT64", int),  # default: the repository's default_max_tokens
    Field("stream", "TYPE_BOOL", bool, False),
    Field("temperature", "TYPE_FP64", float, _SAMPLING.temperature),
    Field("top_k", "TYPE_INT64", int, _SAMPLING.top_k),
    Field("top_p", "TYPE_FP64", float, _SAMPLING.top_p),
    Field("random_seed", "TYPE_UINT64", int, _SAMPLING.seed),
    Field("stop_words", "TYPE_STRING", str, (), dims=(-1,)),
    *(Field(name, "TYPE_INT64", int) for name in LOOKAHEAD_INPUTS),  # default: the served config's
    Field("pool_scope", "TYPE_STRING", str),  # "request": no shared n-gram pool; default: the repository's
)
CHAT = Field("chat", "TYPE_BOOL", bool, False)  # a request parameter only: wrap text_input in the chat template
OUTPUTS = (
    Field("text_output", "TYPE_STRING", optional=False),
    Field("prompt_tokens", "TYPE_INT32", int, optional=False),
    Field("generated_tokens", "TYPE_INT32", int, optional=False),
    Field("steps", "TYPE_INT32", int, optional=False),
    Field("finish_reason", "TYPE_STRING", optional=False),
)
INPUT = {f.name: f for f in (*INPUTS, CHAT)}
# request parameters a front end sets itself: the generate endpoint passes the body's "id" on as one
RESERVED_PARAMETERS = ("id",)


def pbtxt_list(fields: tuple[Field, ...]) -> str:
    """The body of config.pbtxt's `input [...]` or `output [...]` list."""
    return ",\n".join(f"  {f.pbtxt()}" for f in fields)
