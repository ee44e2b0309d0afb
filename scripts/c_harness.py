"""A C timing loop around one of the package's kernel sources, compiled as the package compiles the kernels
(kernels/onnxruntime_library.py FLAGS, less the shared-library ones): what scripts/bench_attention_kernel.py and
scripts/bench_quantized_kernel.py run.

    binary = build_harness(HARNESS, source, Path(tmp))   # HARNESS #includes SOURCE_FILE; SystemExit if it fails
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the package from this checkout, installed or not
    sys.path.insert(0, str(ROOT))

from trt_lookahead.kernels.onnxruntime_library import FLAGS, HEADER  # noqa: E402


def build_harness(harness: str, source: Path, folder: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The timing loop `harness` (its `SOURCE_FILE` the kernel's source) compiled in `folder`, the package's flags
    then `extra_flags`; SystemExit with the compiler's message where there is no compiler or the source does not
    compile."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise SystemExit("no C compiler: set CC or install cc")
    flags = [f for f in FLAGS if f not in ("-fPIC", "-shared", "-fvisibility=hidden")] + list(extra_flags)
    code, binary = folder / "harness.c", folder / "harness"
    code.write_text(harness.replace("SOURCE_FILE", f'"{source.resolve()}"'), encoding="utf-8")
    built = subprocess.run([compiler, *flags, "-I", str(HEADER.parent), "-o", str(binary), str(code), "-lm"],
                           capture_output=True, text=True)
    if built.returncode:
        raise SystemExit(f"{source} does not compile with the timing loop:\n{built.stderr.strip()}")
    return binary
