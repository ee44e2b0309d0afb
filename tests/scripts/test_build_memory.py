"""scripts/build_memory.py: its sampler splits a real child's memory by the progress lines the child prints, and
stops a child past the limit."""

from __future__ import annotations

import sys

import pytest
from support.scripts import load_script

# a child that prints two progress lines, holding about 300 MB of touched memory after the second, with a zombie
# child of its own all along (whose /proc status has no memory lines)
CHILD = """
import subprocess, sys, time
zombie = subprocess.Popen([sys.executable, "-c", "pass"])
time.sleep(0.3)
print("[#.] 1/2 small", file=sys.stderr, flush=True)
time.sleep(0.5)
print("[##] 2/2 large", file=sys.stderr, flush=True)
block = bytearray(300 * 2**20)
block[::4096] = b"x" * len(block[::4096])
time.sleep(1.0)
"""


@pytest.fixture(scope="module")
def build_memory():
    return load_script("build_memory")


def test_the_sampler_splits_a_childs_memory_by_its_progress_lines(build_memory):
    result = build_memory.measured_build([sys.executable, "-c", CHILD])
    phases = {line: anon for line, _, anon, _ in result["phases"]}
    assert list(phases) == ["start", "[#.] 1/2 small", "[##] 2/2 large"] and result["rc"] == 0
    starts = [seconds for *_, seconds in result["phases"]]
    assert starts[0] == 0 and 0.2 < starts[1] < starts[2] and starts[2] - starts[1] >= 0.4  # the child's sleeps
    assert phases["[##] 2/2 large"] > phases["[#.] 1/2 small"] + 250  # MB: the block, anonymous
    assert result["peak_anon_mb"] == phases["[##] 2/2 large"] and not result["stopped"]


def test_a_child_past_the_limit_is_stopped(build_memory):
    result = build_memory.measured_build([sys.executable, "-c", CHILD], stop_above_mb=200)
    assert result["stopped"] and result["rc"] != 0 and result["peak_anon_mb"] > 200
