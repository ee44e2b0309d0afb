"""The C kernels built for this machine: the shared library that gives onnxruntime its MaskedAttention kernel
(onnxruntime_attention.c: the nodes of onnx_op.decompose(native=True); docs/design.md section 6.4), its RotaryQKV
(onnxruntime_rotary.c: onnx_rotary.native_rotary), its SwiGLU (onnxruntime_swiglu.c: onnx_swiglu.native_swiglu)
and, on a CPU with AVX2, FMA and F16C, its QuantizedMatMul
(onnxruntime_quantized.c: engine/quantize.py native_products; 6.9; with VNNI byte products where the CPU has
them, the same bits), registered by onnxruntime_ops.c.

    built = native_library()                      # Built(path, None, quantized), or Built(None, why not)
    options.register_custom_ops_library(str(built.path))
    plain = build_library(("-mno-avx512f", "-mno-avxvnni"))  # the same sources for less of this CPU (tests)

Compiled once per machine by the system C compiler ($CC, else cc) into the cache dir's kernels/ folder, under a name
keyed by the sources, the compiler (its command, arguments included, and version), the flags and this CPU's
instruction-set flags (the library is built for this CPU, -march=native: a cache dir shared with another kind of
CPU builds its own). Written under a temporary name and renamed, so processes that build at once race harmlessly.
Without a compiler, or where the build fails or the cache dir cannot be written, there is no library and the
engines run the standard-op decomposition (the reason in `why`).
Imports files (the cache dir) and the standard library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trt_lookahead.files import cache_dir

SOURCE = Path(__file__).with_name("onnxruntime_attention.c")
# compiled together into one library: the registration, the kernels, and the header they share
SOURCES = (Path(__file__).with_name("onnxruntime_ops.c"), SOURCE, Path(__file__).with_name("onnxruntime_rotary.c"),
           Path(__file__).with_name("onnxruntime_swiglu.c"), Path(__file__).with_name("onnxruntime_quantized.c"))
HEADER = Path(__file__).with_name("onnxruntime_api.h")
# what the sources include, in the cache key
HEADERS = (HEADER, Path(__file__).with_name("onnxruntime_vector.h"),
           Path(__file__).with_name("onnxruntime_quantized_tile.h"))
# -ffp-contract=off: no multiply-add is fused on one code path and not on another (the kernel's row invariance)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-fvisibility=hidden")
BUILD_TIMEOUT_S = 120
KERNELS = "kernels"  # the cache dir's subfolder of built libraries


@dataclass(frozen=True)
class Built:
    path: Path | None  # the shared library, or None
    why: str | None = None  # why there is none
    quantized: bool = False  # the library holds QuantizedMatMul (this CPU has AVX2, FMA and F16C)


def _cpu_flags() -> str:
    """This CPU's instruction-set flags (Linux), else the machine's name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> list[str] | None:
    command = shlex.split(os.environ.get("CC", "cc"))
    return command if command and shutil.which(command[0]) else None


@functools.cache
def native_library() -> Built:
    """The built library (once per process; see the module docstring). Without one, says why on stderr, once."""
    built = build_library()
    if built.path is None:
        print("trt-lookahead: float32 attention runs as standard onnxruntime ops and quantized products as "
              f"MatMulNBits, slower: {built.why}", file=sys.stderr)
    return built


def build_library(extra_flags: tuple[str, ...] = ()) -> Built:
    """The library compiled with FLAGS and then `extra_flags` (e.g. -mno-... to build the code paths of a CPU with
    fewer instruction sets), cached under its own name; nothing is printed."""
    built = _compile((*FLAGS, *extra_flags))
    if built.path is None:
        return built
    try:  # the library says whether it was built with QuantizedMatMul (onnxruntime_ops.c)
        quantized = bool(ctypes.CDLL(str(built.path)).trt_lookahead_quantized_matmul())
    except (OSError, AttributeError) as exc:
        return Built(None, f"the built library {built.path} does not load ({exc})")
    return Built(built.path, quantized=quantized)


def _compile(flags: tuple[str, ...]) -> Built:
    compiler = _compiler()
    if compiler is None:
        return Built(None, f"no C compiler ({os.environ.get('CC', 'cc')!r} not found)")
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                                 check=True).stdout.splitlines()[0]
        sources = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        return Built(None, f"cannot run the C compiler or read the kernels' sources ({exc})")
    named = [shlex.join(compiler), version, " ".join(flags), _cpu_flags()]
    key = hashlib.sha256(b"\0".join([*sources, *(text.encode() for text in named)]))
    folder = cache_dir() / KERNELS
    path = folder / f"onnxruntime_kernels-{key.hexdigest()[:16]}.so"
    if path.is_file():
        return Built(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".build-", suffix=".so")
        os.close(fd)
    except OSError as exc:
        return Built(None, f"the cache dir {folder} is not writable ({exc})")
    try:
        done = subprocess.run([*compiler, *flags, "-I", str(HEADER.parent), "-o", tmp, *map(str, SOURCES), "-lm"],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            names = ", ".join(path.name for path in SOURCES)
            return Built(None, f"{compiler[0]} failed on {names}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)
        return Built(path)
    except (OSError, subprocess.SubprocessError) as exc:
        return Built(None, f"building the kernels failed ({exc})")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
