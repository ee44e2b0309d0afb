import json, os, sys, tempfile
sys.path.insert(0, "/work/main/scripts")
import build_memory
with tempfile.TemporaryDirectory(dir="/work/notes/s64/ckpt") as cache:
    env = {**os.environ, "TRT_LOOKAHEAD_CACHE": cache}
    cmd = ["/work/main/.venv/bin/trt-lookahead", "generate", "--model", "/work/notes/s64/ckpt/llama-3b-f16.gguf",
           "--weights", "int4", "--prompt", "Once upon a time", "--max-new-tokens", "16", "--json"]
    r = build_memory.measured_build(cmd, 21000, env)
print(json.dumps(r, indent=1))
