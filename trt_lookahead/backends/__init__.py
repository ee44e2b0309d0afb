"""Executors: the executor contract (lookahead/executor.py) on the torch Llama (torch.py), on an engine
dir's ONNX graphs under onnxruntime (onnxruntime.py) and on its TensorRT plan (tensorrt.py); open.py
opens an engine dir for a backend, graphs.py holds what the engine backends share, devices.py says
which accelerators this process has, row_probe.py whether this CPU's BLAS is row-invariant (the exact step),
cpu_load.py what CPUs and memory other processes leave this one (whether onnxruntime's workers spin),
tensor_parallel.py a Llama sharded across torch.distributed ranks with exact collectives.

Owns running a model for one static step layout (docs/design.md section 5). May import engine.format,
model, kernels, lookahead, files and errors; never engine.build or engine.export.
"""
