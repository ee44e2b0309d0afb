"""The runtime: a model, its tokenizer and one batched executor behind generate / stream (threads) and
agenerate / astream (asyncio), with in-flight batching by one scheduler thread.

    rt = LookaheadRuntime.from_pretrained("smollm2-135m-instruct", lookahead="auto", max_batch=8)
    out = rt.generate([{"role": "user", "content": "Hi"}], max_new_tokens=64)

Files by job: runtime.py (LookaheadRuntime, its requests, results and streams), text.py (prompts to ids, ids to
text, stop strings), load.py (a checkpoint or engine dir -> executor, backend, tree, cached engine, the `auto`
policy), tuning_file.py (the tuning file `auto` reads at load), scheduler.py (the step loop). This module only
re-exports.

May import trt_lookahead.backends, engine, model, kernels, lookahead, bench.machine, files and errors; never
tuning (above it: `tune` and `serve --tune` write the tuning file, the runtime only reads it; nothing is tuned
inside a request), serving or cli, not even for types (pyproject.toml's import-linter contracts).
"""

from trt_lookahead.runtime.load import (
    BACKEND_CHOICES,
    DEFAULT_MAX_SEQ_LEN,
    cached_checkpoint_engine,
    check_tensor_parallel,
    checkpoint_backend,
    checkpoint_tree,
    checkpoint_tuning_key,
    engine_cover,
    refuse_weights_on_engine,
)
from trt_lookahead.runtime.runtime import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_QUEUE,
    ChunkStream,
    GenerationOutput,
    LookaheadRuntime,
    Request,
    StreamChunk,
    check_pool_scope,
    check_threads,
)
from trt_lookahead.runtime.text import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    PROMPT_CHARS_MARGIN,
    ChatTemplateError,
    Prompt,
    PromptTooLong,
)

__all__ = [
    "BACKEND_CHOICES", "DEFAULT_MAX_NEW_TOKENS", "DEFAULT_MAX_QUEUE", "DEFAULT_MAX_SEQ_LEN", "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS", "PROMPT_CHARS_MARGIN", "ChatTemplateError", "ChunkStream", "GenerationOutput",
    "LookaheadRuntime", "Prompt", "PromptTooLong", "Request", "StreamChunk", "cached_checkpoint_engine",
    "check_pool_scope", "check_tensor_parallel", "check_threads", "checkpoint_backend", "checkpoint_tree",
    "checkpoint_tuning_key", "engine_cover", "refuse_weights_on_engine",
]
