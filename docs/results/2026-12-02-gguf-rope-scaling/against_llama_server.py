"""The record's one-off: greedy answers at long positions from a GGUF whose RoPE is scaled (Llama 3's rope_freqs
table, or linear), ours against a llama-server running the scaled file.

    llama-server -m SCALED.gguf --port 18089 -t 2 -c 2048 --no-warmup &
    python against_llama_server.py OURS.gguf PROMPT_TOKENS NEW_TOKENS

OURS.gguf is the server's file (then every answer should be equal) or the same weights unscaled (then they should
differ, showing the positions reached are long enough for the scaling to matter). Prompts: token ids (our
tokenizer's, so both sides read the same ids), humaneval's prompts from the k-th on, joined and cut at
PROMPT_TOKENS; 4 prompts.
"""
import json
import pathlib
import sys
import urllib.request

import gguf

from trt_lookahead.model.gguf_convert import build_tokenizer, read_metadata
from trt_lookahead.runtime import LookaheadRuntime

URL = "http://127.0.0.1:18089"
DATA = pathlib.Path(__file__).parents[4] / "shared" / "data" / "humaneval.jsonl"


def post(path: str, body: dict) -> dict:
    request = urllib.request.Request(URL + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request).read())


path, prompt_tokens, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
texts = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()]
tokenizer = build_tokenizer(read_metadata(gguf.GGUFReader(path)))
with LookaheadRuntime.from_pretrained(path, backend="torch", max_seq_len=prompt_tokens + new_tokens + 32) as rt:
    for k in range(4):
        ids = tokenizer.encode("".join(texts[k * 10:k * 10 + 10])).ids[:prompt_tokens]
        mine = rt.generate(ids, max_new_tokens=new_tokens, lookahead="greedy").token_ids
        theirs = post("/completion", {"prompt": ids, "n_predict": new_tokens, "temperature": 0, "top_k": 1,
                                      "cache_prompt": False, "return_tokens": True})["tokens"]
        pairs = enumerate(zip(mine, theirs, strict=False))
        same = next((i for i, (a, b) in pairs if a != b), min(len(mine), len(theirs)))
        print(f"prompt {k} ({len(ids)} ids): greedy tokens equal for {same} of {len(mine)} / {len(theirs)}")
