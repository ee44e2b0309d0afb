"""Which accelerators this process can use: CUDA devices and TensorRT. The one availability check that
code and tests use."""

from __future__ import annotations

from types import ModuleType


def gpu_count() -> int:
    """CUDA devices visible through cuda-python's runtime API, else through torch (0 where neither sees one).

    cuda-python is asked first: the CPU torch wheel always says none, and it does not import torch.
    """
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            import torch
        except ImportError:
            return 0
        return int(torch.cuda.device_count())
    err, count = runtime.cudaGetDeviceCount()
    return int(count) if err == runtime.cudaError_t.cudaSuccess else 0


def import_tensorrt() -> ModuleType:
    """The `tensorrt` module (imported lazily: everything else runs without it)."""
    import tensorrt

    return tensorrt


def tensorrt_unavailable_reason() -> str | None:
    """Why TensorRT cannot build or run here, or None when it can."""
    try:
        import_tensorrt()
    except ImportError as exc:
        return f"`import tensorrt` fails: {exc}"
    if gpu_count() == 0:
        return "no CUDA device (cuda-python's cudaGetDeviceCount found none)"
    return None
