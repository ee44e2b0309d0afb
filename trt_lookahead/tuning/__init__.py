"""`auto`'s measurements: `trt-lookahead tune` and `serve --tune` choose (W, N, G) and the policy's step cost and
priors for this machine, model, dtype, backend and workload (tune.py), and store them in the tuning file.

Above the runtime, never inside a request: tune builds runtimes of its own over a loaded model and measures on
them. The tuning file itself (runtime/tuning_file.py) and the auto ladder's constants and built-in priors
(lookahead/policy.py) live below the runtime, which reads them without importing this package. May import
runtime, bench, engine, backends, model, lookahead, files and errors; never serving or cli (pyproject.toml's
import-linter contracts).
"""
