"""The record's one-off: where ours and llama-server's greedy answers part (against_llama_server.py's prompts),
each side's token's log-probability in float64 (transformers on the HF checkpoint the GGUF was written from).

    llama-server -m SCALED.gguf --port 18089 -t 2 -c 512 &
    python near_ties.py SCALED.gguf HF_DIR
"""
import json
import pathlib
import sys
import urllib.request

import gguf
import torch
from transformers import AutoModelForCausalLM

from trt_lookahead.model.gguf_convert import build_tokenizer, read_metadata
from trt_lookahead.runtime import LookaheadRuntime

URL = "http://127.0.0.1:18089"
DATA = pathlib.Path(__file__).parents[4] / "shared" / "data" / "humaneval.jsonl"


def post(path: str, body: dict) -> dict:
    request = urllib.request.Request(URL + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request).read())


path, hf_dir = sys.argv[1], sys.argv[2]
texts = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()]
tokenizer = build_tokenizer(read_metadata(gguf.GGUFReader(path)))
model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
with LookaheadRuntime.from_pretrained(path, backend="torch", max_seq_len=482) as rt:
    for k in range(4):
        ids = tokenizer.encode("".join(texts[k * 10:k * 10 + 10])).ids[:300]
        mine = rt.generate(ids, max_new_tokens=150, lookahead="greedy").token_ids
        theirs = post("/completion", {"prompt": ids, "n_predict": 150, "temperature": 0, "top_k": 1,
                                      "cache_prompt": False, "return_tokens": True})["tokens"]
        i = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
        if i is None:
            print(f"prompt {k}: equal")
            continue
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids + mine[:i]])).logits[0, -1], -1)
        print(f"prompt {k}, token {i}: ours {mine[i]} {logp[mine[i]].item():.5f}, "
              f"llama-server's {theirs[i]} {logp[theirs[i]].item():.5f} (float64 log-probabilities)")
