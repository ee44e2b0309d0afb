"""The model: a compact torch Llama whose KV cache is passed in (llama.py), Hugging Face checkpoint
loading and the tokenizer (checkpoint.py), GGUF conversion (gguf_convert.py) and `fetch-model` (fetch.py).

Owns the network and its weights, nothing about lookahead. May import trt_lookahead.lookahead,
trt_lookahead.files and trt_lookahead.errors.
"""
