"""NgramPool: the host-side n-gram store that feeds the verification branch.

Keyed by an n-gram's first token; each key keeps at most `capacity` continuations (the N-1 tokens
after the key) in recency order. Re-inserting a continuation refreshes it; a new one beyond the
capacity evicts the oldest. Candidates for a key are its most recent entries, newest first.
Each entry remembers where it came from (prompt, output or window) for the decoder's statistics.
See docs/design.md section 3.4.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PROMPT, OUTPUT, WINDOW = "prompt", "output", "window"
Continuation = tuple[int, ...]


class NgramPool:
    """At most `capacity` continuations of length n - 1 per first token, most recent first."""

    def __init__(self, n: int, capacity: int) -> None:
        if n < 2:
            raise ValueError(f"n-grams need n >= 2, got {n}")
        if capacity < 0:
            raise ValueError(f"pool capacity must be >= 0, got {capacity}")
        self.n = n
        self.capacity = capacity
        self._entries: dict[int, dict[Continuation, str]] = {}  # insertion order = recency

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._entries.values())

    def insert(self, key: int, continuation: Continuation, origin: str) -> None:
        """Add or refresh one n-gram (key, *continuation)."""
        if self.capacity == 0:
            return
        entries = self._entries.get(key)
        if entries is None:
            self._entries[key] = {continuation: origin}
            return
        if entries.pop(continuation, None) is None and len(entries) >= self.capacity:
            del entries[next(iter(entries))]  # the least recently inserted
        entries[continuation] = origin

    def insert_sequence(self, tokens: Sequence[int], origin: str, start: int = 0) -> None:
        """Insert every n-gram of `tokens` that ends at index `start` or later."""
        n = self.n
        for i in range(max(0, start - n + 1), len(tokens) - n + 1):
            self.insert(tokens[i], tuple(tokens[i + 1 : i + n]), origin)

    def insert_columns(self, keys: Iterable[int], continuations: Iterable[Continuation], origin: str) -> None:
        for key, continuation in zip(keys, continuations, strict=True):
            self.insert(key, continuation, origin)

    def candidates(self, key: int, limit: int) -> list[tuple[Continuation, str]]:
        """Up to `limit` (continuation, origin) pairs for `key`, newest first."""
        entries = self._entries.get(key)
        if not entries or limit <= 0:
            return []
        return list(entries.items())[::-1][:limit]
