"""`trt-lookahead generate --model <3B GGUF> --weights int4` into a fresh cache (conversion, build, decode) under
scripts/build_memory.py's sampler; as run, from the repository root, after build_memory.py --shape llama-3b --gguf
had written the GGUF. Prints generate's JSON line, then the sampler's."""

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[3] / "scripts"))
import build_memory

CHECKPOINTS = Path("/work/notes/s64/ckpt")
with tempfile.TemporaryDirectory(dir=CHECKPOINTS) as cache:
    env = {**os.environ, "TRT_LOOKAHEAD_CACHE": cache}
    command = [".venv/bin/trt-lookahead", "generate", "--model", str(CHECKPOINTS / "llama-3b-f16.gguf"),
               "--weights", "int4", "--prompt", "Once upon a time", "--max-new-tokens", "16", "--json"]
    result = build_memory.measured_build(command, 21000, env)
print(json.dumps(result, indent=1))
