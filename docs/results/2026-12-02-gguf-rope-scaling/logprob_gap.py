"""The record's one-off: how far llama-server's log-probabilities of the next token lie from float64's
(transformers on the HF checkpoint the GGUF was written from), for the first 3 of against_llama_server.py's
prompts cut at PROMPT_TOKENS: the largest gap over llama-server's top 5.

    llama-server -m FILE.gguf --port 18089 -t 2 -c 512 &
    python logprob_gap.py FILE.gguf HF_DIR PROMPT_TOKENS
"""
import json
import pathlib
import sys
import urllib.request

import gguf
import torch
from transformers import AutoModelForCausalLM

from trt_lookahead.model.gguf_convert import build_tokenizer, read_metadata

URL = "http://127.0.0.1:18089"
DATA = pathlib.Path(__file__).parents[4] / "shared" / "data" / "humaneval.jsonl"


def post(path: str, body: dict) -> dict:
    request = urllib.request.Request(URL + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request).read())


path, hf_dir, prompt_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
texts = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()]
tokenizer = build_tokenizer(read_metadata(gguf.GGUFReader(path)))
model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
for k in range(3):
    ids = tokenizer.encode("".join(texts[k * 10:k * 10 + 10])).ids[:prompt_tokens]
    top = post("/completion", {"prompt": ids, "n_predict": 1, "temperature": 0, "top_k": 1, "cache_prompt": False,
                               "n_probs": 5, "post_sampling_probs": False})["completion_probabilities"][0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
    gap = max(abs(logp[t["id"]].item() - t["logprob"]) for t in top["top_logprobs"])
    print(f"{pathlib.Path(path).name}, prompt {k} ({len(ids)} ids): largest log-probability gap {gap:.1e}")
