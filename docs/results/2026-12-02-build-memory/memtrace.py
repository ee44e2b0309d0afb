"""The record's one-off: run a command, sample its resident memory (the process and its children) every 0.1 s,
and print each stderr line with the time, the memory then and the peak so far; last, the peak.

    python memtrace.py trt-lookahead generate --model FILE.gguf --weights int4 --prompt hi --max-new-tokens 4
"""
import os
import pathlib
import subprocess
import sys
import threading
import time


def rss_mb(pid: int) -> int:
    try:
        children = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        total = 0
        for each in [pid, *map(int, children)]:
            for line in pathlib.Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith("VmRSS"):
                    total += int(line.split()[1])
        return total // 1024
    except OSError:
        return 0


start = time.time()
process = subprocess.Popen(sys.argv[1:], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=os.environ)
peak = [0]


def sample() -> None:
    while process.poll() is None:
        peak[0] = max(peak[0], rss_mb(process.pid))
        time.sleep(0.1)


threading.Thread(target=sample, daemon=True).start()
assert process.stderr is not None
for line in process.stderr:
    print(f"{time.time() - start:6.1f}s rss {rss_mb(process.pid):6d} MB peak {peak[0]:6d} MB | {line.rstrip()[:120]}",
          flush=True)
process.wait()
print("final peak MB", peak[0])
