"""Serving: the OpenAI-compatible HTTP server of `trt-lookahead serve` (openai_api.py over openai_protocol.py
and metrics.py), and Triton Inference Server: the request/response schema (schema.py), the model
repository writer (repository.py, templates/) and the tritonserver runner (server.py); docs/design.md section 7.

May import trt_lookahead.runtime and everything below it, never trt_lookahead.cli.
"""
