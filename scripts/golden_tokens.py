"""Golden token records: the token ids the public API gives for a fixed set of prompts and request options.

    python scripts/golden_tokens.py --out before.json            # on one commit
    python scripts/golden_tokens.py --out after.json             # on another
    python scripts/golden_tokens.py --compare before.json after.json

A restructuring that must leave behaviour unchanged is checked by comparing two records: every case's ids
must be equal. Cases cover stories260K (float32 and bfloat16, torch and onnxruntime, exact, the draft tree,
both pool scopes, greedy, fixed configs and `auto`, seeded sampling, stop strings) and a few SmolLM2 prompts
from ../shared/data (`--smollm2`). `auto` reads a tuning file in a temporary dir (none), and its tokens are greedy's
by construction: the record shows that they stay so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "tests" / "fixtures" / "stories260K"
DATA = ROOT.parent / "shared" / "data"
STORY_PROMPTS = ("Once upon a time", "Lily and Ben went to the park. They", "The cat sat on the", "Tim had a red ball")
RUNTIMES: list[tuple[str, dict[str, Any]]] = [
    ("torch-f32", {"backend": "torch", "dtype": "float32"}),
    ("torch-f32-notree", {"backend": "torch", "dtype": "float32", "tree": None}),
    ("torch-bf16-exact", {"backend": "torch", "dtype": "bfloat16", "exact": True}),
    ("torch-f32-request-pool", {"backend": "torch", "dtype": "float32", "pool_scope": "request"}),
    ("onnxruntime-f32", {"backend": "onnxruntime", "dtype": "float32"}),
]
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("greedy", {"lookahead": "greedy"}),
    ("4,3,4", {"lookahead": "4,3,4"}),
    ("7,5,7", {"lookahead": "7,5,7"}),
    ("auto", {"lookahead": "auto"}),
    ("default", {}),
    ("sampled", {"lookahead": "4,3,4", "temperature": 0.8, "top_p": 0.9, "seed": 7}),
    ("stop", {"lookahead": "4,3,4", "stop": [" the"]}),
]


def _record(model: Path, runtimes: list[tuple[str, dict[str, Any]]], prompts: list[Any], new: int,
            tuning: Path) -> dict[str, Any]:
    from trt_lookahead.runtime import LookaheadRuntime

    out: dict[str, Any] = {}
    for name, kwargs in runtimes:
        with LookaheadRuntime.from_pretrained(str(model), lookahead="7,5,7", max_seq_len=512,
                                              tuning_file=tuning, **kwargs) as rt:
            for label, options in REQUESTS:
                for i, prompt in enumerate(prompts):
                    result = rt.generate(prompt, new, **options)
                    out[f"{model.name}|{name}|{label}|{i}"] = {"ids": result.token_ids, "text": result.text,
                                                               "finish": result.finish_reason}
            print(f"golden: {model.name} {name} done", file=sys.stderr, flush=True)
    return out


def record(smollm2: bool, tuning: Path) -> dict[str, Any]:
    os.environ["TRT_LOOKAHEAD_TUNE_BUDGET"] = "20"  # only where a version still tunes on first use of `auto`
    out = _record(STORIES, RUNTIMES, list(STORY_PROMPTS), 48, tuning)
    if smollm2:
        from trt_lookahead.model.fetch import resolve_model

        rows = [json.loads(line) for line in (DATA / "humaneval.jsonl").read_text().splitlines()[:2]]
        prompts = [r.get("prompt") or r.get("text") for r in rows]
        out |= _record(resolve_model("smollm2-135m-instruct"), RUNTIMES[:1] + RUNTIMES[4:], prompts, 64, tuning)
    return out


def compare(before: Path, after: Path) -> int:
    a, b = (json.loads(p.read_text()) for p in (before, after))
    missing = sorted(set(a) ^ set(b))
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    print(f"{len(set(a) & set(b))} cases in both; {len(differ)} differ; {len(missing)} in one record only")
    for key in differ[:20] + missing[:20]:
        print("  ", key)
    return 1 if differ or missing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smollm2", action="store_true", help="also two HumanEval prompts on SmolLM2 (slow)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("--out FILE or --compare BEFORE AFTER")
    with tempfile.TemporaryDirectory() as tmp:
        data = record(args.smollm2, Path(tmp) / "tuning.json")
    args.out.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
    print(f"golden: {len(data)} cases -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
