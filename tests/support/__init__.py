"""Test support: research scaffolding the package does not ship (importable as `support` from tests, since
pytest puts tests/ on sys.path for tests/conftest.py; scripts insert tests/ into sys.path themselves).

    ablation.py        `Switches` and `AblatedDecoder` (design 3.8's ablations), the single-request
                       `LookaheadDecoder`
    oracles.py         model-free executors (next-token logits a pure function of the prefix)
    torch_executor.py  `TorchExecutor`, the single-request contract of one layout over a batched torch executor

It may import anything in trt_lookahead; nothing in trt_lookahead imports it.
"""
