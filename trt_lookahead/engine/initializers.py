"""An exported graph's initializers on their way to the engine dir: the larger ones *held* (an external-data
reference to `HELD` in the proto, the data in `Weights`: views of the model's tensors or the quantized blocks, not
copies, or a function that reads a weight still in the checkpoint) until `save_graph` writes each to the weights
file; a build so holds the weights once, or, quantized, one float weight at a time (docs/design.md 6.5).
Needs numpy and onnx, not torch (the runtime reads quantized graphs through engine/quantize.py, which uses these).

    proto, weights = export_graph(model, "plugin", cache_rows=1040, max_tokens=64)   # engine/export.py
    proto.graph.initializer.append(held_initializer("w.q4", codes, weights))
    save_graph(proto, Path("engine/model.onnx"), weights)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from trt_lookahead.engine.format import WEIGHTS_FILE

if TYPE_CHECKING:
    import numpy as np

INLINE_BYTES = 1024  # initializers smaller than this stay inside the graph file
HELD = "held in memory"  # the external-data location of an initializer whose data `Weights` holds until saved

# a held initializer's name -> its data, or a function reading it (called each time it is wanted: never kept)
Weights = dict[str, Union["np.ndarray", Callable[[], "np.ndarray"]]]


def held_initializer(name: str, array: np.ndarray, weights: Weights) -> Any:
    """An initializer of `array`'s dtype and shape whose data `weights` holds (no copy) until `save_graph`."""
    import onnx

    weights[name] = array
    tensor = onnx.TensorProto(name=name, dims=array.shape, data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype),
                              data_location=onnx.TensorProto.EXTERNAL)
    tensor.external_data.add(key="location", value=HELD)
    return tensor


def is_held(tensor: Any) -> bool:
    return any(entry.key == "location" and entry.value == HELD for entry in tensor.external_data)


def initializer_array(tensor: Any, weights: Weights) -> np.ndarray:
    """An initializer's data: the array `weights` holds for it (read now where `weights` holds a reader), or its
    own."""
    from onnx import numpy_helper

    if not is_held(tensor):
        return numpy_helper.to_array(tensor)
    data = weights[tensor.name]
    return data() if callable(data) else data


def save_graph(proto, path: Path, weights: Weights, weights_file: str = WEIGHTS_FILE) -> None:
    """Save the graph with its larger initializers, held ones included, in `weights_file` beside it, 64-byte aligned;
    smaller ones inside the graph file."""
    import numpy as np
    import onnx

    with open(path.parent / weights_file, "wb") as data:
        for tensor in proto.graph.initializer:
            held = is_held(tensor)
            array = np.ascontiguousarray(initializer_array(tensor, weights))
            raw = array.reshape(-1).view(np.uint8)  # the bytes, not a copy (little-endian, as ONNX's raw_data)
            if len(raw) < INLINE_BYTES:
                if held:
                    tensor.ClearField("external_data")
                    tensor.ClearField("data_location")
                    tensor.raw_data = raw.tobytes()
                continue
            offset = data.tell()
            data.write(raw.data)
            data.write(b"\0" * (-data.tell() % 64))  # keep every tensor 64-byte aligned
            for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                          "external_data"):
                tensor.ClearField(field)
            for key, value in (("location", weights_file), ("offset", offset), ("length", len(raw))):
                tensor.external_data.add(key=key, value=str(value))
            tensor.data_location = onnx.TensorProto.EXTERNAL
    onnx.save_model(proto, str(path))


def saved_initializers(graph: Path) -> dict[str, np.ndarray]:
    """A saved graph's initializers -> their data: those in a file beside it (`save_graph`'s weights file) mapped
    there copy-on-write (file pages, which the kernel can drop and read again, not the process's own memory), the
    small ones inside the graph file read."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(graph), load_external_data=False)
    files: dict[str, np.ndarray] = {}
    arrays = {}
    for tensor in proto.graph.initializer:
        entries = {entry.key: entry.value for entry in tensor.external_data}
        if "location" not in entries:
            arrays[tensor.name] = np.array(numpy_helper.to_array(tensor))  # writable, as the mapped ones are
            continue
        location = entries["location"]
        if location not in files:
            files[location] = np.memmap(graph.parent / location, np.uint8, mode="c")
        start = int(entries["offset"])
        data = files[location][start : start + int(entries["length"])]
        arrays[tensor.name] = data.view(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).reshape(tensor.dims)
    return arrays
