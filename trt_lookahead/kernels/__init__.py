"""LookaheadAttention and the token choice as kernels: the mask's closed form (mask.py), the torch
reference that defines the op (reference.py), the Triton kernel, the ONNX node and its standard-op
decomposition, the TensorRT plugin registration, torch twins of lookahead.sampling, the row-invariant
projections and norms of the exact CUDA step and the product of every GPU step by quantized weights (invariant.py),
the faster product by int4 weights in the tensor cores' registers on Hopper GPUs (quantized_words.py), the padded
step's attention kernel over each slot's own keys, row-invariant for the exact step or with the step mask in
registers for the fast one (padded_attention.py), the padded step's attention and those kernels as torch.library
custom ops, opaque to torch.compile (step_ops.py), and onnxruntime's CPU kernels in C, built for this machine by
onnxruntime_library.py: the float32 attention (onnxruntime_attention.c), each layer's QKV split and rotary
embedding as one node (onnxruntime_rotary.c, put in place by onnx_rotary.py), each layer's silu(gate) * up as
one node (onnxruntime_swiglu.c, by onnx_swiglu.py) and the row-invariant product of block-quantized weights and
int8 rows (onnxruntime_quantized.c); and the export's stacks of the layers' keys and values as one Concat of
standard ops (onnx_stack.py).

Owns what runs inside a compiled step (docs/design.md sections 2.6 and 6.4). May import
trt_lookahead.lookahead, trt_lookahead.files and trt_lookahead.errors; torch, onnx and triton are imported by
the module that needs them, tensorrt never (backends and the plan build pass its modules in).
"""
