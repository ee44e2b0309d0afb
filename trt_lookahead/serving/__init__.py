"""Serving: the OpenAI-compatible HTTP server of `trt-lookahead serve` (openai_api.py over openai_protocol.py
and metrics.py), and Triton Inference Server: the request/response schema (schema.py), the model
repository writer (repository.py, templates/) and the tritonserver runner (server.py); docs/design.md section 7.

May import trt_lookahead.runtime and everything below it, never trt_lookahead.cli.
"""

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # `serve --max-body-bytes`: a larger request body is answered 413
GRACEFUL_SHUTDOWN_SECONDS = 15  # `serve --shutdown-grace`: on SIGTERM/SIGINT, running requests get this long
MAX_SHUTDOWN_GRACE = 3600  # `serve --shutdown-grace` at most an hour
