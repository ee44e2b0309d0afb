"""Prometheus metrics of `trt-lookahead serve` (prometheus-client, one registry per server, GET /metrics).

    trt_lookahead_requests_total{endpoint, outcome}   outcome: stop, length (finish reasons), cancelled (the
                                                      client went away, mid-upload too), invalid (4xx: 400,
                                                      404, 408, 413), overloaded (429), error (5xx: 500, 503
                                                      at shutdown); every request counted once, whatever
                                                      its end
    trt_lookahead_prompt_tokens_total, trt_lookahead_generation_tokens_total
    trt_lookahead_steps_total                         forward passes that emitted tokens, prefill included
    trt_lookahead_accepted_tokens_per_step            histogram: tokens each decode step emitted (greedy: 1)
    trt_lookahead_queue_length                        requests waiting for a slot
    trt_lookahead_running_requests                    the running batch: requests holding a slot
    trt_lookahead_time_to_first_token_seconds         arrival -> the prefill's token made (queueing included)
    trt_lookahead_inter_token_latency_seconds         gap between blocks / tokens in the block, once per token
    trt_lookahead_model_info{model, backend, dtype, weights, lookahead, max_seq_len, max_batch, max_queue, prefill}

Measures as docs/design.md section 8 defines them: the ITL histogram's sum over its count is the decode time
per token as the server sees it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from trt_lookahead.runtime import StreamChunk

PREFIX = "trt_lookahead"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5)
STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)


class ServerMetrics:
    """The server's metrics in a registry of their own; `queue_length` and `running` are read at each scrape."""

    def __init__(self, queue_length: Callable[[], float], running: Callable[[], float], info: dict[str, str]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of started requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=r)
        self.steps = Counter(f"{PREFIX}_steps", "Forward passes that emitted tokens, the prefill included", registry=r)
        self.accepted = Histogram(f"{PREFIX}_accepted_tokens_per_step", "Tokens emitted per decode step",
                                  buckets=STEP_BUCKETS, registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Gap between blocks per token of the block",
                             buckets=ITL_BUCKETS, registry=r)
        Gauge(f"{PREFIX}_queue_length", "Requests waiting for a slot", registry=r).set_function(queue_length)
        Gauge(f"{PREFIX}_running_requests", "Requests holding a slot (the running batch)",
              registry=r).set_function(running)
        Info(f"{PREFIX}_model", "The served model", registry=r).info(info)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def trace(self, endpoint: str) -> RequestTrace:
        return RequestTrace(self, endpoint)


class RequestTrace:
    """One request's observations: its chunks as the server reads them, then the outcome (once)."""

    def __init__(self, metrics: ServerMetrics, endpoint: str) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.arrived = time.perf_counter()
        self.last: float | None = None
        self.outcome: str | None = None

    def started(self, prompt_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(prompt_tokens)

    def chunk(self, chunk: StreamChunk) -> None:
        tokens = len(chunk.token_ids)
        if not tokens:
            return
        now = time.perf_counter()
        m = self.metrics
        m.steps.inc()
        m.generation_tokens.inc(tokens)
        if self.last is None:
            m.ttft.observe(now - self.arrived)
        else:
            m.accepted.observe(tokens)
            for _ in range(tokens):
                m.itl.observe((now - self.last) / tokens)
        self.last = now

    def finish(self, outcome: str) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.metrics.requests.labels(self.endpoint, outcome).inc()
