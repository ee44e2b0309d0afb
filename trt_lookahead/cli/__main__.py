import sys

from trt_lookahead.cli.main import main

sys.exit(main())
