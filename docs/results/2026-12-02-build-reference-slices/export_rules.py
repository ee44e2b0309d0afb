"""Time of export_graph and of each onnxscript rewrite rule it runs, at a deferred-weights checkpoint.

Measurement instrumentation only: wraps onnxscript's RewriteRule.try_rewrite in this process to count the
rules that fire and time every rule's matching.
    python export_rules.py CHECKPOINT_DIR
"""

from __future__ import annotations

import collections
import sys
import time

from onnxscript.rewriter import _rewrite_rule
from onnxscript.rewriter.rules import common

from trt_lookahead.engine.build import DEFERRED_BYTES
from trt_lookahead.engine.export import export_graph
from trt_lookahead.model.checkpoint import load_llama_deferred

names = {id(rule): name for name in common.__all__
         for rule in (getattr(getattr(common, name), "rules", None) or [getattr(common, name)])}
fired: collections.Counter[str] = collections.Counter()
spent: collections.Counter[str] = collections.Counter()
try_rewrite = _rewrite_rule.RewriteRule.try_rewrite


def timed(self, *args, **kwargs):
    start = time.perf_counter()
    result = try_rewrite(self, *args, **kwargs)
    name = names.get(id(self), self.name)
    spent[name] += time.perf_counter() - start
    fired[name] += result is not None
    return result


_rewrite_rule.RewriteRule.try_rewrite = timed
model, _, deferred = load_llama_deferred(sys.argv[1], DEFERRED_BYTES)
start = time.perf_counter()
graph, _ = export_graph(model, "plugin", 2048 + 64, 64, None, deferred)
print(f"{sys.argv[1]}: export_graph {time.perf_counter() - start:.1f} s, {len(graph.graph.node)} nodes, "
      f"rewrite rules {sum(spent.values()):.1f} s")
for name, seconds in spent.most_common(6):
    print(f"  {seconds:7.3f} s  fired {fired[name]:4d}  {name}")
