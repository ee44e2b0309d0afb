"""The record's one-off behind tests/model/test_gguf_write.py's LLAMA_CPP_SCALED_IDS: llama-server's greedy ids for
one prompt of ids on stories260K written as a GGUF with its RoPE scaled (the config the test writes).

    llama-server -m FILE.gguf --port 18089 -t 2 -c 512 &
    python llama_server_ids.py
"""
import json
import urllib.request

PROMPT = [1] + [(37 * i) % 509 + 3 for i in range(299)]
body = {"prompt": PROMPT, "n_predict": 40, "temperature": 0, "top_k": 1, "cache_prompt": False, "return_tokens": True}
request = urllib.request.Request("http://127.0.0.1:18089/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
print(json.loads(urllib.request.urlopen(request).read())["tokens"])
