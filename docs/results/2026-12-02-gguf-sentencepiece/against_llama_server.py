"""The record's one-off: a GGUF's tokenizer and greedy answers, ours against a llama-server running the same file.

    llama-server -m FILE.gguf --port 18089 -t 1 -c 512 &
    python against_llama_server.py FILE.gguf [int4]      # int4: our --weights int4 engine of the file, else float32

Every prompt's ids (POST /tokenize, BOS added, special tokens parsed) against build_tokenizer's from the file's
metadata, with the file's merges and with merges derived from the scores; then 64 greedy tokens from each side.
Texts: the hand-made ones below and the first 30 lines' strings of each ../shared/data/*.jsonl.
"""
import json
import pathlib
import sys
import urllib.request

import gguf

from trt_lookahead.model.gguf_convert import build_tokenizer, read_metadata
from trt_lookahead.runtime import LookaheadRuntime

URL = "http://127.0.0.1:18089"
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park.", "One day, a big bear",
           "Sam had a red ball"]
TEXTS = ["a  b", " leading", "trailing  ", "   ", "", "tab\there", "x\n\n  y", "héllo ✓ 日本語 🙂", "<s>Hi</s> there",
         "Once upon a time,\nthere was a little girl named Lily.", "def f(x):\n    return x  # two spaces", "A" * 50]


def post(path: str, body: dict) -> dict:
    request = urllib.request.Request(URL + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request).read())


def llama_ids(text: str) -> list[int]:
    return post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]


path = sys.argv[1]
meta = read_metadata(gguf.GGUFReader(path))
ours = build_tokenizer(meta)
# a SentencePiece file may list no merges (then they come from the scores); a byte-level one always lists them
spm = meta["tokenizer.ggml.model"] == "llama"
derived = build_tokenizer({key: value for key, value in meta.items() if key != "tokenizer.ggml.merges" or not spm})
texts = list(TEXTS)
for data in sorted(pathlib.Path(__file__).parents[4].joinpath("shared", "data").rglob("*.jsonl")):
    for line in data.read_text().splitlines()[:30]:
        texts += [v for v in json.loads(line).values() if isinstance(v, str)]
wrong = [t for t in texts if ours.encode(t).ids != llama_ids(t)]
wrong_derived = [t for t in texts if derived.encode(t).ids != llama_ids(t)]
print(f"{len(texts)} texts: ids unlike llama-server's {len(wrong)}" +
      (f", with merges from the scores {len(wrong_derived)}" if spm else ""))
options = {"weights": "int4"} if sys.argv[2:] == ["int4"] else {"backend": "torch"}
with LookaheadRuntime.from_pretrained(path, **options) as rt:
    for prompt in PROMPTS:
        mine = rt.generate(prompt, max_new_tokens=64, lookahead="greedy").token_ids
        theirs = post("/completion", {"prompt": prompt, "n_predict": 64, "temperature": 0, "top_k": 1,
                                      "cache_prompt": False, "return_tokens": True})["tokens"]
        pairs = enumerate(zip(mine, theirs, strict=False))
        same = next((i for i, (a, b) in pairs if a != b), min(len(mine), len(theirs)))
        print(f"{prompt!r}: prompt ids equal {list(rt.encode(prompt)) == llama_ids(prompt)}, greedy tokens equal "
              f"for {same} of {len(mine)} / {len(theirs)}")
