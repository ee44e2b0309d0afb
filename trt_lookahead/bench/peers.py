"""The peers `bench --peers` measures beside our rows: transformers' LlamaForCausalLM `generate` on the same
checkpoint, greedy (`hf-greedy`) and prompt lookup with PROMPT_LOOKUP_TOKENS drafted tokens (`hf-prompt-lookup`).

Steps are forward calls, counted by a subclass of LlamaForCausalLM; decode time starts at the first
forward's tokens, as ours does (docs/design.md section 8).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PEERS = ("hf-greedy", "hf-prompt-lookup")
PROMPT_LOOKUP_TOKENS = 10


def describe(peer: str) -> str:
    """What a peer row ran, for the `resolved` column."""
    return f"transformers prompt lookup {PROMPT_LOOKUP_TOKENS}" if peer == "hf-prompt-lookup" else "transformers"


class HFPeers:
    """transformers' LlamaForCausalLM on the same checkpoint: greedy and prompt-lookup `generate`."""

    def __init__(self, path: Path, dtype: str, stop_token_ids: Sequence[int], device: str = "cpu") -> None:
        """`device`: where transformers runs, the device our runtime ran on (so both are timed on one processor)."""
        import torch
        from transformers import LlamaForCausalLM

        class CountingLlama(LlamaForCausalLM):
            """Counts forward passes (one per decoding step, prefill included) on our own subclass."""

            forward_calls = 0

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                self.forward_calls += 1
                return super().forward(*args, **kwargs)

        self.torch = torch
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.model = CountingLlama.from_pretrained(str(path), dtype=torch_dtype, device_map=device).eval()
        self.stop = [int(t) for t in stop_token_ids]
        self.pad = self.stop[0] if self.stop else 0

    def generate(self, ids: Sequence[int], max_new_tokens: int, peer: str) -> dict[str, Any]:
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch
        times: dict[str, Any] = {"first": None, "first_count": 0, "end": None, "puts": 0}

        class Clock(BaseStreamer):
            def put(self, value: Any) -> None:
                times["puts"] += 1
                if times["puts"] == 2:  # the first put is the prompt, the second the first forward's tokens
                    times["first"] = time.perf_counter()
                    times["first_count"] = int(value.numel())

            def end(self) -> None:
                times["end"] = time.perf_counter()

        kwargs: dict[str, Any] = {}
        if peer == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.model.device)
        self.model.forward_calls = 0
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=self.stop or None,
                pad_token_id=self.pad,
                streamer=Clock(),
                **kwargs,
            )
        end = times["end"] or time.perf_counter()
        first = times["first"] or end
        tokens = out[0, input_ids.shape[1] :].tolist()
        return {
            "token_ids": tokens,
            "steps": int(self.model.forward_calls),
            "prefill_seconds": first - start,
            "decode_seconds": end - first,
            "decoded_tokens": max(len(tokens) - times["first_count"], 0),
        }
