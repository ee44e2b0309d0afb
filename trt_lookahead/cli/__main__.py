import sys

from trt_lookahead.cli.main import main

code = main()
if code == 130:
    # CPython marks a KeyboardInterrupt that escaped any exec'd string (dataclass or namedtuple creation during a
    # lazy import) as unhandled, and `python -m` then dies by SIGINT instead of exiting 130; running a string
    # resets that mark (pythonrun.c, run_eval_code_obj).
    exec("pass")
sys.exit(code)
