"""The batched executor contract (docs/design.md section 5) and the argument checks every backend shares.

One step runs B request slots x T tokens. Row b belongs to KV slot slots[b]; its layout is
step_config[b] = (W, N, G) (docs/design.md section 2) padded to T, or (0, 0, 0) for a causal row.

    x = ex.prefill(slot, prompt_ids, sampling)   # KV rows [0, P) of the slot, its sampling set; next token
    ex.claim(slot, sampling)                     # or: the slot holds a request of cache_len 0 and this
                                                 #   sampling; its prompt then arrives as causal step rows
    out = ex.step(StepBatch(...))                # [B, T] int64 next tokens, valid at output_slots, -1 elsewhere;
                                                 #   with top_ids given, also the top-k next ids there
    ex.commit(slot, rows)                        # keep the KV of these step rows of the slot's last step
    ex.release(slot)                             # the slot is free (cache_len 0)

A row's pads (slots past its layout's real tokens) hold any valid id at position cache_len; an executor
may skip them. Token i of row b is chosen with the slot's sampling parameters, keyed by positions[b, i]
(lookahead/sampling.py). A row's results never depend on the other rows of the step. When the batch
carries `top_ids` [B, T, k], the executor also writes there the k most likely next ids (by the raw
logits, most likely first) at each output slot, for recycled drafts (lookahead/recycle.py); other entries
are left as they are.

Chunked prefill (runtime/scheduler.py) feeds a claimed slot's prompt as causal rows: the next c prompt
tokens at positions cache_len .. cache_len+c-1, then, where the step is wider than c, pad tokens at the
positions that follow (a causal row's T tokens are all real, and a causal token never sees a later one, so
the pads change nothing); the commit keeps rows 0 .. c-1 only. The last chunk's output at slot c-1 is the
prompt's next token, chosen as `prefill` chooses it (keyed by position P-1).

What a step costs is the policy's business (lookahead/policy.py), but only the executor knows how it lays rows out:
`pads_rows` says a step of B rows runs as B x its widest row (the engines' SlotExecutor, the padded torch step),
else as its real tokens (the packed torch step); `priced_tokens` turns a step's row widths into the M of c(M, B).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.sampling import SamplingParams

CAUSAL = (0, 0, 0)  # the step_config of a causal row (kernels/mask.py's, which this layer cannot import)


@dataclass
class StepBatch:
    """One batched step; see the module docstring."""

    slots: np.ndarray  # [B] int64, distinct KV slots
    input_ids: np.ndarray  # [B, T] int64
    positions: np.ndarray  # [B, T] int64 absolute positions (pads: the row's cache_len)
    step_config: np.ndarray  # [B, 3] int32 (W, N, G) of each row; (0, 0, 0) = a causal row
    output_slots: np.ndarray  # [B, K] int64 step slots read per row (padded by repeating the last)
    top_ids: np.ndarray | None = None  # [B, T, k] int64 out: the k likeliest next ids at output slots (recycling)

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])


class Executor(Protocol):
    vocab_size: int
    max_seq_len: int  # prompt + generated tokens a slot can hold
    max_batch: int  # KV slots
    step_tokens: int  # the largest T a row may have

    @property
    def pads_rows(self) -> bool:
        """A step of B rows costs B x its widest row's tokens (else the sum of its rows' real tokens)."""
        ...

    def prefill(self, slot: int, prompt_ids: np.ndarray, sampling: SamplingParams) -> int: ...

    def claim(self, slot: int, sampling: SamplingParams) -> None: ...

    def step(self, batch: StepBatch) -> np.ndarray: ...

    def commit(self, slot: int, rows: np.ndarray) -> None: ...

    def release(self, slot: int) -> None: ...

    def cache_len(self, slot: int) -> int: ...


def priced_tokens(widths: Sequence[int], pads_rows: bool) -> int:
    """The M a step of rows with these real tokens is priced at: their sum, or rows x the widest where the
    executor pads rows (the shape `tune` measures: B rows of T tokens, M = B T)."""
    if not widths:
        return 0
    return len(widths) * max(widths) if pads_rows else sum(widths)


def row_tokens(step_config: np.ndarray, tokens: int) -> np.ndarray:
    """[B] real tokens per row: (W + G)(N - 1), or all `tokens` of a causal row (W = 0)."""
    config = np.asarray(step_config, np.int64).reshape(-1, 3)
    real = (config[:, 0] + config[:, 2]) * (config[:, 1] - 1)
    return np.where(config[:, 0] == 0, tokens, real)


def check_slot(slot: int, max_batch: int) -> int:
    """The slot as an int; ValueError if it is not one of the executor's slots."""
    if isinstance(slot, bool) or not isinstance(slot, int | np.integer) or not 0 <= slot < max_batch:
        raise ValueError(f"KV slot {slot!r} does not exist: slots are 0 .. {max_batch - 1}")
    return int(slot)


def check_prompt(prompt_ids: np.ndarray, max_seq_len: int, vocab_size: int) -> np.ndarray:
    """The prompt as a flat int64 array; ValueError if it is empty, too long or outside the vocabulary."""
    ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if not 1 <= len(ids) <= max_seq_len:
        raise ValueError(f"prompt of {len(ids)} tokens does not fit: need 1 <= length <= max_seq_len={max_seq_len}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    return ids


def check_batch(batch: StepBatch, max_batch: int, step_tokens: int, vocab_size: int) -> np.ndarray:
    """ValueError unless `batch` is a valid step for these sizes; returns the real tokens of each row."""
    shape = np.shape(batch.input_ids)
    if len(shape) != 2 or not 1 <= shape[0] <= max_batch or not 1 <= shape[1] <= step_tokens:
        raise ValueError(
            f"a step holds 1 .. {max_batch} rows of 1 .. {step_tokens} tokens; got input_ids of shape {shape}"
        )
    B, T = shape
    for name, want in (("slots", (B,)), ("positions", (B, T)), ("step_config", (B, 3))):
        if np.shape(getattr(batch, name)) != want:
            raise ValueError(f"StepBatch.{name} must have shape {want}, got {np.shape(getattr(batch, name))}")
    out = np.asarray(batch.output_slots)
    if out.ndim != 2 or out.shape[0] != B or out.shape[1] < 1:
        raise ValueError(f"StepBatch.output_slots must have shape ({B}, K >= 1), got {out.shape}")
    slots = np.asarray(batch.slots)
    if len(np.unique(slots)) != B or slots.min() < 0 or slots.max() >= max_batch:
        raise ValueError(f"step rows need distinct KV slots in [0, {max_batch}), got {slots.tolist()}")
    config = np.asarray(batch.step_config, np.int64)
    W, N, G = config[:, 0], config[:, 1], config[:, 2]
    real = row_tokens(config, T)
    causal = (W == 0) & (N == 0) & (G == 0)
    bad = ~causal & ((W < 1) | (N < 2) | (G < 0) | (real > T))
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        raise ValueError(f"row {b}: step_config {config[b].tolist()} is not a layout of at most {T} tokens")
    if out.min() < 0 or (out >= real[:, None]).any():
        raise ValueError("output_slots must name real step slots of their row")
    top = batch.top_ids
    if top is not None and (top.ndim != 3 or top.shape[:2] != (B, T) or not 1 <= top.shape[2] <= vocab_size):
        raise ValueError(f"StepBatch.top_ids must have shape ({B}, {T}, k), 1 <= k <= {vocab_size}; got {top.shape}")
    ids = np.asarray(batch.input_ids)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"input ids must lie in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    return real


def check_room(cache_len: int, max_seq_len: int) -> None:
    """ValueError if no step fits any more: the cache already holds max_seq_len tokens or more."""
    if cache_len > max_seq_len:
        raise ValueError(f"KV cache full: {cache_len} tokens cached, max_seq_len={max_seq_len}")


def check_commit(rows: np.ndarray, step_tokens: int, cache_len: int, max_seq_len: int) -> np.ndarray:
    """The committed step rows as a flat int64 array; ValueError if outside the step or past the cache."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if len(rows) and (rows.min() < 0 or rows.max() >= step_tokens):
        raise ValueError(f"commit rows must be real slots of the last step, [0, {step_tokens}); got {rows.tolist()}")
    if cache_len + len(rows) > max_seq_len:
        raise ValueError(f"commit of {len(rows)} tokens at cache_len {cache_len} overflows max_seq_len={max_seq_len}")
    return rows


def check_kv_memory(shape: tuple[int, ...], itemsize: int, max_seq_len: int, max_batch: int = 1) -> None:
    """UserError, before allocating, if the K and V caches of `shape` cannot fit in the memory this process can
    still have (`available_memory`: a container's limit included, not the machine's total)."""
    needed = 2 * itemsize * int(np.prod(shape, dtype=object))
    available = available_memory()
    if needed > available:
        raise UserError(
            f"max_seq_len {max_seq_len} needs a KV cache of {needed / 2**30:.1f} GiB{_slots(max_batch)}, more than the "
            f"{available / 2**30:.1f} GiB available of this machine's {_total_memory() / 2**30:.1f} GiB of memory; "
            f"{_lower(max_batch)}"
        )


def zeroed_pages(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """A zero-filled host array in fresh pages of an anonymous mapping: a page takes memory at its first write, so
    a KV cache costs memory and start-up time as its slots fill, not for all its rows up front, whatever the
    process's heap held before (np.zeros' calloc may take freed heap memory and clear it, writing every byte).
    MemoryError if the mapping is refused."""
    count = int(np.prod(shape, dtype=object))
    try:
        pages = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize))
    except OSError as exc:  # ENOMEM: more than the kernel lets this process map
        raise MemoryError(str(exc)) from None
    return np.frombuffer(pages, dtype, count).reshape(shape)  # the array keeps the mapping; unmapped with it


@contextlib.contextmanager
def kv_allocation(max_seq_len: int, max_batch: int) -> Iterator[None]:
    """Turns a failed allocation of the KV cache (numpy's MemoryError, torch's "can't allocate" RuntimeError, a
    CUDA out-of-memory) into the UserError that names what to lower."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:
        if not isinstance(exc, MemoryError) and "alloc" not in str(exc).lower() and "out of memory" not in str(exc):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"the KV cache of max_seq_len {max_seq_len}{_slots(max_batch)} cannot be allocated ({first}); "
                        f"{_lower(max_batch)}") from None


def _slots(max_batch: int) -> str:
    return f" for {max_batch} request slots (max_batch)" if max_batch > 1 else ""


def _lower(max_batch: int) -> str:
    return "lower max_seq_len" + (" or max_batch" if max_batch > 1 else "")


def available_memory() -> int:
    """Bytes this process can still allocate: the least of the machine's memory, /proc/meminfo's MemAvailable and
    what each enclosing cgroup (v2 or v1) allows: its limit less its usage, page cache it may drop counted free."""
    total = _total_memory()
    meminfo = _read_fields(Path("/proc/meminfo"))
    found = [total, *([meminfo["MemAvailable"] * 1024] if "MemAvailable" in meminfo else [])]
    return min(found + [room for room in _cgroup_rooms() if room < total])


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_rooms() -> list[int]:
    """Limit less usage of each memory cgroup this process is in, its own and its ancestors' up to where the
    cgroup file system is mounted (any of them may be the limited one); none without a limit or a cgroup fs."""
    groups: dict[str, Path] = {}  # "" (v2) or "memory" (v1) -> the process's group in that hierarchy
    for line in _read_text(Path("/proc/self/cgroup")).splitlines():
        _, controllers, name = line.split(":", 2)
        for kind in ("",) if controllers == "" else controllers.split(","):
            if kind in ("", "memory"):
                groups[kind] = Path(name)
    rooms = []
    for line in _read_text(Path("/proc/self/mountinfo")).splitlines():
        mount, _, fs = line.partition(" - ")
        fields, fs_fields = mount.split(), fs.split()
        if len(fields) < 5 or len(fs_fields) < 3:
            continue
        if fs_fields[0] == "cgroup2":
            kind = ""
        elif fs_fields[0] == "cgroup" and "memory" in fs_fields[2].split(","):
            kind = "memory"
        else:
            continue
        if kind not in groups:
            continue
        root, top, group = Path(fields[3]), Path(fields[4]), groups[kind]
        if group != root and root not in group.parents:
            continue  # the process's group is outside what this mount shows
        place = top / group.relative_to(root)
        while True:
            room = _cgroup_room(place, v2=kind == "")
            if room is not None:
                rooms.append(room)
            if place == top:
                break
            place = place.parent
    return rooms


def _cgroup_room(place: Path, v2: bool) -> int | None:
    """What the cgroup at `place` still allows (None: no limit, or not readable)."""
    stat = _read_fields(place / "memory.stat")
    if v2:
        limit_text, usage_text, cache = _read_text(place / "memory.max"), _read_text(place / "memory.current"), \
            stat.get("inactive_file", 0)
    else:
        limit_text = str(stat.get("hierarchical_memory_limit", ""))
        usage_text, cache = _read_text(place / "memory.usage_in_bytes"), stat.get("total_inactive_file", 0)
    try:
        limit, usage = int(limit_text), int(usage_text)
    except ValueError:  # "max" (no limit), or no such file
        return None
    return max(0, limit - usage + cache)


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _read_fields(path: Path) -> dict[str, int]:
    """`name value` (or `name: value kB`) lines -> {name: value}."""
    fields = {}
    for line in _read_text(path).splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            fields[parts[0]] = int(parts[1])
    return fields
