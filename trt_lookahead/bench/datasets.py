"""Benchmark prompt sets: the three built-in sets shipped in trt_lookahead/data/ or any JSONL file.

A row carries `prompt` (raw text, continued as is: HumanEval), or `turns` (MT-Bench: turn 1 is used)
or `question` (GSM8K), which are sent as one user message through the model's chat template with the
generation prompt. A `messages` list of {"role", "content"} is accepted too. Provenance and licenses of
the shipped files: trt_lookahead/bench/data/SOURCE.md.

    ds = load_dataset("humaneval", limit=8)
    ids = encode_row(tokenizer, ds.rows[0])          # token ids, as the runtime would encode them
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trt_lookahead.errors import UserError

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN: dict[str, str] = {
    "mt_bench": "mt_bench.jsonl",
    "humaneval": "humaneval.jsonl",
    "gsm8k": "gsm8k_test.jsonl",
}
_ALIASES = {"mt-bench": "mt_bench", "mtbench": "mt_bench", "human_eval": "humaneval", "gsm8k_test": "gsm8k"}


@dataclass(frozen=True)
class PromptRow:
    """One prompt: raw `text` (continued as is) or chat `messages` (formatted with the chat template)."""

    id: str
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages or ()]


@dataclass(frozen=True)
class Dataset:
    name: str  # built-in name or the file's stem
    path: Path
    rows: tuple[PromptRow, ...]

    def __len__(self) -> int:
        return len(self.rows)


def dataset_names(spec: str) -> list[str]:
    """Split a comma list of dataset names / paths (`mt_bench,humaneval`)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise UserError("no dataset given; use mt_bench, humaneval, gsm8k or a JSONL path (comma list ok)")
    return names


def resolve_dataset_path(name_or_path: str) -> tuple[str, Path]:
    """(display name, file) of a built-in name or an existing JSONL path."""
    key = _ALIASES.get(name_or_path.strip().lower(), name_or_path.strip().lower())
    if key in BUILTIN:
        return key, DATA_DIR / BUILTIN[key]
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path.stem, path
    raise UserError(
        f"dataset {name_or_path!r} is neither a built-in set ({', '.join(BUILTIN)}) nor an existing JSONL file"
    )


def parse_row(obj: Any, where: str) -> PromptRow:
    """A PromptRow from one decoded JSONL object (see the module docstring for the accepted fields)."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: a row must be a JSON object, got {type(obj).__name__}")
    row_id = next((str(obj[k]) for k in ("id", "task_id", "question_id") if k in obj), None) or where.rsplit(":", 1)[-1]
    for field in ("prompt", "question"):
        if field in obj and not isinstance(obj[field], str):
            raise UserError(f"{where}: `{field}` must be a string, got {type(obj[field]).__name__}")
    if "prompt" in obj:
        return PromptRow(row_id, text=obj["prompt"])
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise UserError(f"{where}: `turns` must be a non-empty list of strings")
        return PromptRow(row_id, messages=(("user", turns[0]),))
    if "question" in obj:
        return PromptRow(row_id, messages=(("user", obj["question"]),))
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        ):
            raise UserError(f"{where}: `messages` must be a non-empty list of {{'role', 'content'}} strings")
        return PromptRow(row_id, messages=tuple((m["role"], m["content"]) for m in msgs))
    raise UserError(f"{where}: the row has none of `prompt` (raw text), `turns`, `question` or `messages`")


def load_dataset(name_or_path: str, limit: int | None = None) -> Dataset:
    """The first `limit` rows (all if None) of a built-in set or a JSONL file; blank lines are skipped."""
    if limit is not None and limit <= 0:
        raise UserError(f"--limit must be positive, got {limit}")
    name, path = resolve_dataset_path(name_or_path)
    rows: list[PromptRow] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig")  # a byte order mark (Windows editors) is not text
            except UnicodeDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line); "
                                "a dataset is JSONL, one UTF-8 JSON object per line") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            rows.append(parse_row(obj, f"{path.name}:{lineno}"))
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise UserError(f"dataset {path} has no rows")
    return Dataset(name, path, tuple(rows))


def encode_row(tokenizer: Any, row: PromptRow) -> list[int]:
    """Token ids of a row, exactly as LookaheadRuntime.encode would give them (same ids for every method)."""
    if not row.is_chat:
        return [int(t) for t in tokenizer(row.text, verbose=False)["input_ids"]]
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"prompt {row.id} is a chat prompt (turns/question) but the model has no chat template; "
            "use a model with one, or a dataset whose rows carry raw `prompt` text"
        )
    ids = tokenizer.apply_chat_template(row.chat_messages(), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
