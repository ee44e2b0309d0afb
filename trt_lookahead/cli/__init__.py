"""The `trt-lookahead` command line: argparse for every command in one place (main.py) and one handler per
command (commands.py) that turns the parsed arguments into typed calls of the domain modules.

The top layer: may import everything; nothing imports it. Domain modules never see an argparse Namespace.
"""

from trt_lookahead.cli.main import main

__all__ = ["main"]
