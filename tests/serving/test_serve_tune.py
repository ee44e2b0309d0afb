"""`trt-lookahead serve --tune`: tunes `auto` before the server is ready, stores the entry, then serves with it.

A real `serve` subprocess on stories260K (torch, one thread) with a tiny tuning budget and a tuning file of the
test's own; its log (stdout and stderr) is read until the ready line.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="serve needs the serve extra (pip install 'trt-lookahead[serve]')")

from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.serving.server import _die_with_parent

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
READY = re.compile(r", lookahead (.+?), max_seq_len .* on http://127\.0\.0\.1:(\d+)/v1")
TUNED = "trt-lookahead serve: --tune: tuned in"

pytestmark = pytest.mark.server


def test_serve_tune_stores_an_entry_before_the_ready_line_and_serves_auto_with_it(tmp_path):
    tuning, log = tmp_path / "tuning.json", tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trt_lookahead.cli", "serve", "--port", "0", "--model", str(STORIES),
             "--backend", "torch", "--threads", "1", "--max-batch", "2", "--max-seq-len", "256",
             "--lookahead_config", "auto", "--tune", "--tune-budget-seconds", "3", "--tuning-file", str(tuning)],
            stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
        )
        try:
            deadline = time.monotonic() + 300
            while not (ready := READY.search(text := log.read_text(errors="replace"))):
                assert proc.poll() is None and time.monotonic() < deadline, f"serve did not start:\n{text[-3000:]}"
                time.sleep(0.2)
            entries = json.loads(tuning.read_text())["entries"]  # written before the ready line
            (key, entry), = entries.items()
            assert "|backend=torch|" in key and " t1|tree=" in key  # what the server's runtime runs: its key
            assert entry["budget_seconds"] == 3 and entry["verified"]["prompts"] >= 1
            assert "--tune: tuning `auto` for stories260K on this machine before serving, about 3 s" in text
            assert text.index(TUNED) < ready.start() and f"stored in {tuning}" in text
            assert "built-in priors" not in text  # the server's runtime read the entry
            ceiling = LookaheadConfig.from_label(entry["config"])
            assert ready.group(1) == ("greedy" if ceiling.is_greedy else f"auto (up to {ceiling})")
            url = f"http://127.0.0.1:{ready.group(2)}/health"
            for _ in range(100):  # the ready line comes just before uvicorn accepts
                try:
                    with urllib.request.urlopen(url, timeout=10) as response:
                        assert response.status == 200
                        break
                except OSError:
                    time.sleep(0.1)
            else:
                pytest.fail(f"{url} never answered")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    assert code == 0, log.read_text(errors="replace")[-3000:]


@pytest.mark.parametrize("budget", ["0", "inf", "nan"])
def test_serve_tune_with_a_bad_budget_is_one_error_line_before_anything_runs(tmp_path, capsys, budget):
    from trt_lookahead.cli import main

    tuning = tmp_path / "tuning.json"
    code = main(["serve", "--port", "0", "--model", str(STORIES), "--tune", "--tune-budget-seconds", budget,
                 "--tuning-file", str(tuning)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: --tune-budget-seconds "), err
    assert not tuning.exists()
