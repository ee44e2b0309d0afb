"""Engine dirs (docs/design.md section 6): the format (format.py, a leaf: names, config.json, checksums),
the ONNX export (export.py), the graph's initializers on their way to weights.bin (initializers.py), quantized
weights (quantize.py), the build with its smoke check (build.py) and the TensorRT plan (tensorrt_plan.py).

format.py may import trt_lookahead.lookahead, files and errors only, so backends read engine dirs without
the build; initializers.py adds format; quantize.py adds initializers, model and kernels (neither imports torch
at load: the backends read quantized graphs through quantize.py); export.py adds model and kernels; build.py and
tensorrt_plan.py may also import backends.
"""
