"""NgramPool: the host-side n-gram store that feeds the verification branch.

Keyed by an n-gram's first token; each key keeps at most `capacity` continuations (the N-1 tokens
after the key) in recency order. Re-inserting a continuation refreshes it; a new one beyond the
capacity evicts the oldest. Candidates for a key are its most recent entries, newest first.
Each entry remembers where it came from (prompt, output or window) for the decoder's statistics.

SharedPool: the n-grams of every request of one runtime (prompts and accepted outputs), bounded by a total
entry budget with LRU eviction over keys; a request reads it after its own pool. See docs/design.md 3.4.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PROMPT, OUTPUT, WINDOW, SHARED = "prompt", "output", "window", "shared"
POOL_SCOPES = ("shared", "request")  # runtime-wide and per request; "request" never reads nor feeds a SharedPool
DEFAULT_SHARED_ENTRIES = 1 << 18  # n-grams over all N: ~50 MB of Python tuples at N <= 5
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


class SharedPool:
    """N-grams of many requests, per (N, first token), at most `per_key` each; `budget` entries in all, LRU keys.

    Not thread-safe: one thread owns it (the runtime's scheduler thread runs every request's host code).
    """

    def __init__(self, budget: int = DEFAULT_SHARED_ENTRIES, per_key: int = 8) -> None:
        if budget < 0 or per_key < 1:
            raise ValueError(f"a shared pool needs budget >= 0 and per_key >= 1, got {budget}, {per_key}")
        self.budget = budget
        self.per_key = per_key
        self._keys: dict[tuple[int, int], dict[Continuation, None]] = {}  # insertion order = key recency
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def _touch(self, n: int, key: int) -> dict[Continuation, None] | None:
        """The key's entries, made the most recently used key (None if absent)."""
        entries = self._keys.pop((n, key), None)
        if entries is not None:
            self._keys[(n, key)] = entries
        return entries

    def insert(self, key: int, continuation: Continuation) -> None:
        """Add or refresh one n-gram (N = 1 + len(continuation)); evicts least recently used keys past the budget."""
        if self.budget == 0:
            return
        entries = self._touch(len(continuation) + 1, key)
        if entries is None:
            entries = self._keys[(len(continuation) + 1, key)] = {}
        if continuation in entries:
            del entries[continuation]  # re-inserted below as the newest
        elif len(entries) >= self.per_key:
            del entries[next(iter(entries))]
        else:
            self._size += 1
        entries[continuation] = None
        while self._size > self.budget:  # amortized O(1): each key is evicted once per insertion
            oldest = next(iter(self._keys))
            self._size -= len(self._keys.pop(oldest))

    def insert_sequence(self, tokens: Sequence[int], n: int, start: int = 0) -> None:
        """Insert every n-gram of `tokens` that ends at index `start` or later."""
        for i in range(max(0, start - n + 1), len(tokens) - n + 1):
            self.insert(tokens[i], tuple(tokens[i + 1 : i + n]))

    def candidates(self, n: int, key: int, limit: int) -> list[Continuation]:
        """Up to `limit` continuations of length n - 1 for `key`, newest first."""
        entries = self._touch(n, key) if limit > 0 else None
        return list(entries)[::-1][:limit] if entries else []
