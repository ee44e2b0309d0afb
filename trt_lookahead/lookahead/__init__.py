"""The lookahead algorithm, host side and numpy only: configs, the step layout and mask, the n-gram pool,
seeded sampling, the executor contract, the per-request decoder (decoder.py), the batch stepper that runs
it for every row of a step (stepper.py) and the draft tree (templates and draft sources). Research
scaffolding (ablation switches, the single-request driver, model-free oracle executors) is test support,
in tests/support/.

Owns everything that decides which tokens are fed and which are accepted (docs/design.md sections 2-5).
May import numpy, trt_lookahead.errors and the leaf helpers of trt_lookahead.files only: never torch, onnx,
onnxruntime, tensorrt or triton (an import-linter contract checks this), so the algorithm runs and is tested
without a model.
"""
