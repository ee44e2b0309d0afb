"""Measuring: `bench` (greedy and lookahead side by side, with the measures of docs/design.md section 8),
the transformers peers (peers.py), the prompt sets (datasets.py and data/), the plots and the machine
description.

Measures a runtime object that its caller builds and passes in: bench imports trt_lookahead.runtime only
under TYPE_CHECKING. May import engine, backends, model, lookahead, files and errors.
"""
