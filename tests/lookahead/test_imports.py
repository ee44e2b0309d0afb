"""The algorithm layer is numpy only: importing it loads none of the heavy frameworks."""

import json
import subprocess
import sys

HEAVY = ("torch", "onnx", "onnxruntime", "tensorrt", "triton", "transformers")


def test_lookahead_imports_no_torch_onnx_tensorrt_or_triton():
    code = (
        "import json, sys\n"
        "import trt_lookahead.lookahead.decoder, trt_lookahead.lookahead.oracles\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
    # the check itself can fail: importing a torch-based module is seen
    code = code.replace("trt_lookahead.lookahead.oracles", "trt_lookahead.backends.torch")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch" in json.loads(out.stdout)
