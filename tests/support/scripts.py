"""The repository's scripts as tests use them: imported as modules, or run as a user runs them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py imported as a module named `name`."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python scripts/<name>.py *args` from the repository root."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
