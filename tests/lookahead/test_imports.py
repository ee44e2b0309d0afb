"""The algorithm layer is numpy only: importing it loads none of the heavy frameworks."""

import json
import subprocess
import sys

HEAVY = ("torch", "onnx", "onnxruntime", "tensorrt", "triton", "transformers")


def loaded_after_import(modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` a fresh interpreter has loaded after importing the whole lookahead package."""
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import trt_lookahead.lookahead as package\n"
        "for m in pkgutil.iter_modules(package.__path__):\n"
        "    importlib.import_module(f'trt_lookahead.lookahead.{m.name}')\n"
        f"print(json.dumps([m for m in {modules!r} if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_lookahead_imports_no_torch_onnx_tensorrt_or_triton():
    assert loaded_after_import(HEAVY) == []
    assert loaded_after_import(("numpy", *HEAVY)) == ["numpy"]  # the probe does see what is loaded
