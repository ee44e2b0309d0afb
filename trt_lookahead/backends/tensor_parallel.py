"""Tensor parallelism over torch.distributed: a Llama sharded by heads across ranks, exact by construction.

    ex = open_leader(RankSpec("models/x", "float32", 8, 2048, exact=True), world=2)  # this process is rank 0; it
    ...                                       # starts ranks 1 .. as processes (`python -m` this module) and
    ex.close()                                # drives them: the runtime's executor (runtime/load.py)

    group = init_group(rank, world, port)                     # gloo over 127.0.0.1, collectives time out
    shard = load_shard("models/x", "float32", rank, world, group=group)  # this rank's heads, FFN columns and
                                                              # vocab rows, read alone (shard_llama: of a model)
    ex = BatchedTorchExecutor(shard.model, 4, 512, 16, exact=True, collectives=shard.collectives)  # every rank
    ex = LeaderExecutor(ex, group)    # rank 0: each call reaches the followers first; the runtime drives it
    follow(ex, group)                 # ranks 1 ..: run rank 0's calls until it closes

Shards of rank r of W (Megatron-style): wqkv column-parallel (query heads r * Hq / W onwards and the KV heads they
read: Hkv / W of them, or where Hkv < W the one they share, replicated), wo row-parallel (those heads' input
dims), w13 column-parallel (gate and up rows r * F / W onwards), w2 row-parallel, the lm_head split by vocab rows;
embeddings and norms replicated. The KV cache follows the heads (the executor sizes it from the shard's config).

After wo and w2 each rank holds a partial sum [M, H]. `exact_all_reduce` adds the partials in rank order on every
rank: a row's sum depends on its own partials only, never on how many rows the step holds (a ring or tree
all-reduce may chunk and order a message by its size), and every rank holds the same bits. It has two forms of
the same additions: GATHER (all-gather the partials, add them) and TWO_PHASE (an all-to-all hands rank j every
rank's j-th 1/W of the columns, it adds those in rank order, an all-gather returns the sums), which moves
2 (W - 1) / W of a partial into each rank instead of W - 1 at the price of a second collective; each call takes
the cheaper for its size on the group's link (`reduce_form`), and since the bits are the same, a choice by size
cannot change a row's logits. After the lm_head the vocab slices are all-gathered, so every rank chooses the same
token. With row-invariant products on each rank (the exact step) a slot's logits are then the same bits alone,
batched or in greedy decoding, at a given degree W (docs/design.md 5.3). Rank 0 runs the scheduler, the pool and
the host algorithm; the others follow its executor calls (one broadcast a forward, carrying the calls without
one made since), so their forwards meet in the same collectives. A rank that dies ends the others' next
collective with an error, one that hangs with the group's timeout; the leader then fails that call and every
later one at once (restart the runtime).

Imports torch (torch.distributed), model (the Llama, the checkpoint), backends.torch and files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import pickle
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trt_lookahead.backends.torch import BatchedTorchExecutor
from trt_lookahead.errors import UserError
from trt_lookahead.files import free_port
from trt_lookahead.lookahead.tree import TreeTemplate
from trt_lookahead.model.checkpoint import HEAD, parse_dtype, read_config, read_tensors, to_state_dict, weight_files
from trt_lookahead.model.llama import Block, Linear, Llama, ModelConfig

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)  # a rank silent this long ends the others' collective
START_TIMEOUT = 300.0  # seconds for every follower to load its shard and say "ready"
STOP_TIMEOUT = 30.0  # seconds a follower gets to leave after the leader's stop, then it is killed
LOST_WAIT = 2.0  # seconds a failed collective waits for a rank process to be seen exiting (`lost`)
STOP = "stop"  # the leader's last broadcast: followers return
READY = "ready"  # a follower's one stdout line once its executor is built
# calls that change a slot without a forward: rank 0 runs them at once and sends them with the next call that runs
# a forward (a step and the commit before it: one message)
DEFERRED = frozenset({"claim", "commit", "release"})
MESSAGE_BYTES = 1 << 16  # one broadcast carries a message this long (8 bytes of length first); a longer one, two
GATHER, TWO_PHASE = "gather", "two_phase"  # exact_all_reduce's two forms (module docstring)


@dataclass(frozen=True)
class Link:
    """What a collective costs between a group's ranks: seconds to start one, bytes a second into each rank, and
    bytes a second of the memory its adds read."""

    latency: float
    bandwidth: float
    memory: float


# gloo over loopback, measured on a 2-core AMD EPYC VM (all_gather of 1 KB .. 4 MB at 2 ranks, and the adds;
# docs/results/2026-11-30-cpu-auto-probes.md): GATHER wins there but for partials of megabytes
LINKS = {"gloo": Link(latency=0.9e-3, bandwidth=0.55e9, memory=9e9)}


def reduce_seconds(form: str, nbytes: float, world: int, link: Link) -> float:
    """The time of one exact reduction of partials of `nbytes` bytes over `world` ranks, by the form's moves:
    GATHER one collective bringing W - 1 partials into each rank, W partials read by the adds; TWO_PHASE two
    collectives of (W - 1) / W of a partial each, one partial's worth read by the adds."""
    if world == 1:
        return 0.0
    if form == GATHER:
        return link.latency + (world - 1) * nbytes / link.bandwidth + world * nbytes / link.memory
    return 2 * link.latency + 2 * (world - 1) / world * nbytes / link.bandwidth + nbytes / link.memory


def reduce_form(nbytes: float, world: int, link: Link | None) -> str:
    """The cheaper form for partials of `nbytes` bytes (GATHER on a tie, or where the link is unknown). A function of
    the size alone, so every rank takes the same form for the same collective."""
    if link is None or reduce_seconds(TWO_PHASE, nbytes, world, link) >= reduce_seconds(GATHER, nbytes, world, link):
        return GATHER
    return TWO_PHASE


def init_group(rank: int, world: int, port: int, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> Any:
    """This process's gloo group of `world` ranks rendezvousing on 127.0.0.1:`port` (the default group)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)
    return dist.group.WORLD


def check_degree(cfg: ModelConfig, world: int) -> None:
    """UserError naming what a tensor-parallel degree cannot split in this model, before anything is loaded."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise UserError(f"tensor_parallel must be a positive integer (ranks), got {world!r}")
    problems = []
    if cfg.num_heads % world:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % world and world % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} key/value heads (neither divisible by the degree nor dividing it)")
    if cfg.intermediate_size % world:
        problems.append(f"an MLP of {cfg.intermediate_size}")
    if cfg.vocab_size % world:
        problems.append(f"a vocabulary of {cfg.vocab_size}")
    if problems:
        raise UserError(f"tensor_parallel {world} cannot split {', '.join(problems)}: use a degree that divides "
                        "them (1, 2, 4, ... as the model allows)")
    if cfg.attention_bias or cfg.mlp_bias:
        raise UserError("tensor parallelism does not split projection biases yet; this model has them: use "
                        "tensor_parallel 1")


@dataclass(frozen=True)
class Shard:
    """One rank's model and the collectives that follow its projections (`Ops.after`)."""

    model: Llama
    collectives: dict[nn.Module, Callable[[Tensor], Tensor]]


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """A rank's model config: its share of the heads and the MLP (the vocabulary stays whole: the embedding is)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world,
                               num_kv_heads=max(cfg.num_kv_heads // world, 1),
                               intermediate_size=cfg.intermediate_size // world, tie_word_embeddings=False)


@dataclass(frozen=True)
class RankSlices:
    """A rank's part of each split weight, as the checkpoint lays them out (every size from `rank_slices`)."""

    q: slice  # rows of q_proj, columns of o_proj: its query heads
    kv: slice  # rows of k_proj and v_proj: the KV heads those query heads read
    ffn: slice  # rows of gate_proj and up_proj, columns of down_proj
    vocab: slice  # rows of the lm_head


def rank_slices(cfg: ModelConfig, rank: int, world: int) -> RankSlices:
    """Rank `rank` of `world`'s slices (see the module docstring)."""
    local = shard_config(cfg, world)
    D, F, V = cfg.head_dim, local.intermediate_size, cfg.vocab_size // world
    q0 = rank * local.num_heads  # the first query head
    kv0 = q0 // (cfg.num_heads // cfg.num_kv_heads)  # the first KV head they read
    return RankSlices(q=slice(q0 * D, (q0 + local.num_heads) * D), kv=slice(kv0 * D, (kv0 + local.num_kv_heads) * D),
                      ffn=slice(rank * F, (rank + 1) * F), vocab=slice(rank * V, (rank + 1) * V))


def shard_llama(model: Llama, rank: int, world: int, group: Any = None) -> Shard:
    """Rank `rank`'s shard of a loaded `model` (see the module docstring), on the model's device and dtype."""
    cfg = model.cfg
    check_degree(cfg, world)
    part = rank_slices(cfg, rank, world)
    q, kv, f = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    # replicated: the embedding and the norms
    state = {name: t for name, t in model.state_dict().items() if "norm" in name or name.startswith("tok_embeddings")}
    for i, layer in enumerate(cast("list[Block]", model.layers)):
        p = f"layers.{i}."
        wqkv = layer.attention.wqkv.dense_weight()
        state[p + "attention.wqkv.weight"] = torch.cat([wqkv[:q][part.q], wqkv[q : q + kv][part.kv],
                                                        wqkv[q + kv :][part.kv]])
        state[p + "attention.wo.weight"] = layer.attention.wo.dense_weight()[:, part.q]
        w13 = layer.feed_forward.w13.dense_weight()
        state[p + "feed_forward.w13.weight"] = torch.cat([w13[:f][part.ffn], w13[f:][part.ffn]])
        state[p + "feed_forward.w2.weight"] = layer.feed_forward.w2.dense_weight()[:, part.ffn]
    state["output.weight"] = model.output.dense_weight()[part.vocab]
    return _assemble(cfg, world, state, model.dtype, model.device, model.weight_layout, group)


def load_shard(path: str, dtype: str, rank: int, world: int, weight_layout: str = "auto",
               group: Any = None) -> Shard:
    """Rank `rank`'s shard read from the checkpoint at `path` on the CPU: each split weight only its rank's rows or
    columns (the rest stays in the file), the embedding and norms whole."""
    cfg = read_config(path)
    check_degree(cfg, world)
    part = rank_slices(cfg, rank, world)
    parts: dict[str, tuple[int, slice]] = {} if cfg.tie_word_embeddings else {HEAD: (0, part.vocab)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        parts[p + "self_attn.q_proj.weight"], parts[p + "self_attn.o_proj.weight"] = (0, part.q), (1, part.q)
        parts[p + "self_attn.k_proj.weight"] = parts[p + "self_attn.v_proj.weight"] = (0, part.kv)
        parts[p + "mlp.gate_proj.weight"] = parts[p + "mlp.up_proj.weight"] = (0, part.ffn)
        parts[p + "mlp.down_proj.weight"] = (1, part.ffn)
    torch_dtype = parse_dtype(dtype)
    hf = read_tensors(weight_files(Path(path)), cfg, torch_dtype, parts)
    if cfg.tie_word_embeddings:  # the head is the embedding's rows
        hf[HEAD] = hf["embed_tokens.weight"][part.vocab]
    local = shard_config(cfg, world)  # untied: to_state_dict takes the head's slice as the output
    return _assemble(cfg, world, to_state_dict(hf, local), torch_dtype, torch.device("cpu"), weight_layout, group)


def _assemble(cfg: ModelConfig, world: int, state: dict[str, Tensor], dtype: torch.dtype, device: torch.device,
              weight_layout: str, group: Any) -> Shard:
    """The shard module holding `state` (the shard's weights by this package's names) and its collectives."""
    with torch.device("meta"):
        shard = Llama(shard_config(cfg, world), dtype=dtype)
        shard.output = Linear(cfg.hidden_size, cfg.vocab_size // world, bias=False, dtype=dtype)
    shard.load_state_dict({name: t.detach().clone() for name, t in state.items()}, assign=True, strict=True)
    shard = shard.to(device).eval().requires_grad_(False)
    try:
        shard.set_weight_layout(weight_layout)
    except ValueError as exc:
        raise UserError(str(exc)) from exc

    def reduce(x: Tensor) -> Tensor:
        return exact_all_reduce(x, group)

    def gather(x: Tensor) -> Tensor:
        return torch.cat(all_gathered(x, group), dim=-1)

    collectives: dict[nn.Module, Callable[[Tensor], Tensor]] = {shard.output: gather}
    for block in cast("list[Block]", shard.layers):
        collectives[block.attention.wo] = collectives[block.feed_forward.w2] = reduce
    return Shard(shard, collectives)


def all_gathered(x: Tensor, group: Any = None) -> list[Tensor]:
    """Every rank's x, in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return parts


def exact_all_reduce(x: Tensor, group: Any = None, form: str | None = None) -> Tensor:
    """The ranks' partial sums x [..., H] added in rank order, element by element, the same bits on every rank and
    in either form (module docstring): `form` GATHER or TWO_PHASE, None for the cheaper on the group's link by x's
    size (TWO_PHASE needs H a multiple of the ranks: else GATHER)."""
    world = dist.get_world_size(group)
    if form is None:
        form = reduce_form(x.numel() * x.element_size(), world, LINKS.get(str(dist.get_backend(group))))
    if form == TWO_PHASE and x.shape[-1] % world == 0:
        return _two_phase(x, group, world)
    first, *rest = all_gathered(x, group)
    for part in rest:
        first = first + part
    return first


def _two_phase(x: Tensor, group: Any, world: int) -> Tensor:
    """TWO_PHASE: rank j adds every rank's j-th 1/W of the columns in rank order, then all hold all the sums."""
    rows, chunk = x.numel() // x.shape[-1], x.shape[-1] // world
    send = x.reshape(rows, world, chunk).transpose(0, 1).contiguous()  # [W, rows, chunk]: part j goes to rank j
    received = torch.empty_like(send)  # [W, rows, chunk]: part i is rank i's partial of this rank's columns
    dist.all_to_all_single(received, send, group=group)
    total = received[0]
    for part in received[1:]:
        total = total + part
    return torch.stack(all_gathered(total, group), 1).reshape(x.shape)  # [rows, W, chunk] -> [..., H]


def send_message(message: Any, group: Any = None) -> None:
    """Rank 0: `message` to every rank (pickled) in one broadcast of MESSAGE_BYTES, or two if it is longer."""
    data = pickle.dumps(message)
    head = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)  # only the length and the message are read
    head[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    fits = len(data) <= MESSAGE_BYTES - 8
    if fits:
        head[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(head, src=0, group=group)
    if not fits:
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=group)


def receive_message(group: Any = None) -> Any:
    """A follower: rank 0's next `send_message`."""
    head = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
    dist.broadcast(head, src=0, group=group)
    size = int.from_bytes(head[:8].numpy().tobytes(), "little")
    if size <= MESSAGE_BYTES - 8:
        return pickle.loads(head[8 : 8 + size].numpy().tobytes())
    body = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(body, src=0, group=group)
    return pickle.loads(body.numpy().tobytes())


class LeaderExecutor:
    """Rank 0's executor: each call that changes the cache or runs a forward reaches the followers (`follow`) before
    it runs here, so every rank runs the same calls in the same order; one that runs no forward (DEFERRED) travels
    with the next one that does, so a step and the commit before it are one message. Reads (cache_len,
    step_tokens, pads_rows, ...) are rank 0's own. `close` releases the followers."""

    def __init__(self, executor: Any, group: Any = None, followers: list[subprocess.Popen] | None = None,
                 logs: list[Any] | None = None) -> None:
        self.executor, self.group = executor, group
        self.followers = followers or []  # the rank processes this leader started (open_leader), ended by close
        self.logs = logs or []  # their stderr files, rank 1 first
        self._closed = False
        self._failed: str | None = None  # why the group stopped working: every later call fails at once
        self._pending: list[tuple[str, tuple[Any, ...]]] = []  # DEFERRED calls the followers have not had yet

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executor, name)

    def _both(self, name: str, *args: Any) -> Any:
        if self._failed:
            raise RuntimeError(self._failed)
        self._pending.append((name, args))
        try:
            if name not in DEFERRED:
                calls, self._pending = self._pending, []
                send_message(calls, self.group)
            return getattr(self.executor, name)(*args)
        except RuntimeError as exc:  # a collective failed, or rank 0 failed between them: the ranks are out of step
            self._failed = (f"tensor parallelism: {name} failed on rank 0 ({str(exc)[:300]}); {self.lost()}, so "
                            "every later step fails too: restart the runtime")
            raise RuntimeError(self._failed) from exc

    def lost(self) -> str:
        """Which rank processes this leader started have exited (status, stderr's last lines), or that none has."""
        deadline = time.monotonic() + LOST_WAIT
        gone = []
        for rank, proc in enumerate(self.followers, 1):
            with contextlib.suppress(subprocess.TimeoutExpired):  # one dying now: its exit follows the socket's close
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.returncode is not None:
                tail = _tail(self.logs[rank - 1], 300).strip().replace("\n", " | ") if rank <= len(self.logs) else ""
                gone.append(f"rank {rank} exited with status {proc.returncode}" + (f" ({tail})" if tail else ""))
        if gone:
            return "; ".join(gone)
        if self.followers:
            return "no rank process exited: one is stalled past the collective timeout, or the ranks fell out of step"
        return "a rank was lost or the ranks fell out of step"

    def claim(self, slot: int, sampling: Any) -> None:
        return self._both("claim", slot, sampling)

    def prefill(self, slot: int, prompt_ids: Any, sampling: Any) -> int:
        return self._both("prefill", slot, prompt_ids, sampling)

    def prefill_logits(self, slot: int, prompt_ids: Any, sampling: Any) -> Tensor:
        return self._both("prefill_logits", slot, prompt_ids, sampling)

    def step(self, batch: Any) -> Any:
        return self._both("step", batch)

    def step_logits(self, batch: Any) -> Tensor:
        return self._both("step_logits", batch)

    def commit(self, slot: int, rows: Any) -> None:
        return self._both("commit", slot, rows)

    def release(self, slot: int) -> None:
        return self._both("release", slot)

    def close(self) -> None:
        """Release the followers; the rank processes this leader started exit (killed after STOP_TIMEOUT)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):  # a follower already gone: the others are stopped below
            send_message([(STOP, ())], self.group)
        for proc in self.followers:
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()
        if self.followers and dist.is_initialized():
            dist.destroy_process_group()


def follow(executor: Any, group: Any = None) -> None:
    """A follower rank: run rank 0's executor calls on this rank's executor, in order, until rank 0 closes. A call
    rank 0's own checks refuse (ValueError) is refused here the same way, before any collective, and the loop goes
    on."""
    while True:
        for name, args in receive_message(group):
            if name == STOP:
                return
            try:
                getattr(executor, name)(*args)
            except ValueError:
                continue


# -- ranks as processes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds the same way: the checkpoint, dtype, executor sizes, exactness and draft tree."""

    path: str
    dtype: str
    max_batch: int
    max_seq_len: int
    exact: bool | None = None
    tree: tuple[int, ...] | None = None  # the draft tree's parents (TreeTemplate), None: linear candidates
    threads: int | None = None  # torch threads per rank (None: as they are)


def build_rank(spec: RankSpec, rank: int, world: int, group: Any = None) -> BatchedTorchExecutor:
    """Rank `rank`'s executor: its shard read from the checkpoint, the CPU step over it with the collectives."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    shard = load_shard(spec.path, spec.dtype, rank, world, group=group)
    tree = None if spec.tree is None else TreeTemplate(spec.tree)
    return BatchedTorchExecutor(shard.model, spec.max_batch, spec.max_seq_len, exact=spec.exact, tree=tree,
                                collectives=shard.collectives)


def open_leader(spec: RankSpec, world: int) -> LeaderExecutor:
    """This process as rank 0 of `world`: its executor built first (its exactness, resolved here, is every rank's),
    ranks 1 .. started as processes with the same spec, the group formed once each has said it is ready. A rank
    that fails to start is one UserError with the end of its stderr; the others are stopped."""
    if dist.is_initialized():
        raise UserError("this process already holds a tensor-parallel runtime (one group a process): close it first")
    threads = spec.threads or max(1, torch.get_num_threads() // world)
    executor = build_rank(dataclasses.replace(spec, threads=threads), 0, world)
    spec = dataclasses.replace(spec, exact=executor.exact, threads=threads)
    port = free_port()
    # the ranks import this process's trt_lookahead (a Triton stub finds it by a path of its own, not PYTHONPATH)
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}
    # stderr to files, not pipes: never full, so never blocking a rank; kept open while the ranks run (`lost`)
    logs = [tempfile.TemporaryFile("w+") for _ in range(1, world)]  # noqa: SIM115 - the leader closes them
    followers = [subprocess.Popen([sys.executable, "-m", __name__, str(rank), str(world), str(port),
                                   json.dumps(asdict(spec))], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
                 for rank, log in enumerate(logs, 1)]
    try:
        _wait_ready(followers, logs)
        init_group(0, world, port)
    except BaseException:
        for proc in followers:
            proc.kill()
            proc.wait()
        for log in logs:
            log.close()
        raise
    return LeaderExecutor(executor, None, followers, logs)


def _wait_ready(followers: list[subprocess.Popen], logs: list[Any]) -> None:
    """Until every follower has printed READY; UserError naming one that exited (with its stderr's end, from
    `logs`) or was silent too long."""
    waiting = {proc.stdout: (rank, proc) for rank, proc in enumerate(followers, 1) if proc.stdout is not None}
    deadline = time.monotonic() + START_TIMEOUT
    with selectors.DefaultSelector() as selector:
        for stream in waiting:
            selector.register(stream, selectors.EVENT_READ)
        while waiting:
            left = deadline - time.monotonic()
            events = selector.select(timeout=left) if left > 0 else []
            if not events:
                rank = next(iter(waiting.values()))[0]
                raise UserError(f"tensor-parallel rank {rank} was not ready after {START_TIMEOUT:.0f} s; check the "
                                "machine's memory and load")
            for key, _ in events:
                rank, proc = waiting[key.fileobj]  # type: ignore[index]
                line = proc.stdout.readline() if proc.stdout else ""
                if line.strip() == READY:
                    selector.unregister(key.fileobj)
                    del waiting[key.fileobj]  # type: ignore[arg-type]
                elif not line:  # it exited
                    proc.wait()
                    raise UserError(f"tensor-parallel rank {rank} exited while loading (status {proc.returncode}):\n"
                                    f"{_tail(logs[rank - 1], 1500)}")


def _tail(log: Any, chars: int) -> str:
    """The last `chars` characters written to a rank's stderr file (its last lines)."""
    log.seek(0)
    return log.read()[-chars:]


def _follower(argv: list[str]) -> None:
    """`python -m trt_lookahead.backends.tensor_parallel RANK WORLD PORT SPEC`: build, say ready, follow rank 0."""
    rank, world, port = int(argv[0]), int(argv[1]), int(argv[2])
    raw = json.loads(argv[3])
    spec = RankSpec(**{**raw, "tree": None if raw["tree"] is None else tuple(raw["tree"])})
    executor = build_rank(spec, rank, world)
    print(READY, flush=True)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - nobody reads the pipe after READY: never let it fill
    group = init_group(rank, world, port)
    follow(executor, group)
    end_rank()


def end_rank(code: int = 0, left: Callable[[], object] | None = None) -> NoReturn:
    """Leave the group, call `left` (a rank's last word, if any), and end this rank's process at once with `code`.
    Not through the interpreter's teardown: with a gloo group gone, a transport thread can still be joinable when
    the C++ runtime's destructors run, and the process aborts ("terminate called without an active exception")
    after its work is done."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if left is not None:
        left()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _follower(sys.argv[1:])
