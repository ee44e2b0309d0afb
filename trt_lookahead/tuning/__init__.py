"""`auto`: choosing (W, N, G) for this machine, model, dtype, backend and workload. file.py is the tuning
file (a leaf); tune.py measures a runtime and chooses.

Takes a runtime object from its caller: tuning imports trt_lookahead.runtime only under TYPE_CHECKING
(for precise types), never at run time; it may import bench, engine, backends, model, lookahead, files
and errors.
"""
