"""TorchExecutor: the executor contract (lookahead/executor.py) on the torch `Llama`, CPU or CUDA.

    ex = TorchExecutor(model, step_mask, max_seq_len, output_slots=None, device="cpu")
    ex.reset(SamplingParams())            # new request (greedy, or seeded sampling)
    x = ex.prefill(prompt_ids)            # KV rows 0..P-1, returns the next token; cache_len = P
    ids = ex.step(input_ids, positions)   # [T] int64; valid at output_slots, -1 elsewhere
    ex.commit(slots)                      # KV of step slots -> rows cache_len, ...; cache_len += len(slots)

All buffers are allocated once: KV for max_seq_len + T rows, the step inputs, the mask. Token
selection (argmax, or the seeded Gumbel-max draw of `lookahead.sampling`) runs inside the step in
torch (kernels/sampling_torch.py holds its twins); the draw of slot i is keyed
by positions[i], the absolute position of the token whose logits it reads, and the prefill draw by
P - 1. On CUDA the fixed-shape step (static attention over all rows, masked from cache_len held in a
device tensor) is captured once per sampling mode in a CUDA graph and replayed; on CPU it runs eagerly
with keys sliced to cache_len + T rows (docs/design.md section 5).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from trt_lookahead.kernels.sampling_torch import sample_tokens_torch, vocab_salts
from trt_lookahead.lookahead.executor import check_commit, check_kv_memory, check_prompt, check_room
from trt_lookahead.lookahead.sampling import MASK32, SamplingParams
from trt_lookahead.model.llama import Llama, sdpa_attention, sdpa_attention_static


class TorchExecutor:
    """Executor contract on a torch `Llama`; see the module docstring."""

    def __init__(
        self,
        model: Llama,
        step_mask: np.ndarray,
        max_seq_len: int,
        output_slots: np.ndarray | None = None,
        device: str | torch.device = "cpu",
        *,
        static_attention: bool | None = None,
        cuda_graph: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        if model.device.type != self.device.type or (
            self.device.index is not None and model.device.index != self.device.index
        ):
            raise ValueError(f"model is on {model.device} but the executor was asked for {self.device}")
        mask = np.array(step_mask, dtype=bool)  # a writable copy
        if mask.ndim != 2 or mask.shape[0] != mask.shape[1] or not mask.diagonal().all():
            raise ValueError(f"step_mask must be a square [T, T] bool array whose diagonal is set, got {mask.shape}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.model = model
        self.config = model.cfg
        self.vocab_size = model.cfg.vocab_size
        self.max_seq_len = int(max_seq_len)
        self.step_tokens = T = mask.shape[0]
        slots = np.arange(T) if output_slots is None else np.unique(np.asarray(output_slots, np.int64))
        if len(slots) == 0 or slots[0] < 0 or slots[-1] >= T:
            raise ValueError(f"output_slots must be non-empty step slots in [0, {T}), got {output_slots}")
        self.output_slots = slots
        is_cuda = self.device.type == "cuda"
        self.static_attention = is_cuda if static_attention is None else static_attention
        self.cuda_graph = is_cuda if cuda_graph is None else cuda_graph
        if self.cuda_graph and not (is_cuda and self.static_attention):
            raise ValueError("cuda_graph needs device='cuda' and static attention")

        dev = self.device
        if not is_cuda:
            check_kv_memory(model.cache_shape(self.max_seq_len + T), model.dtype.itemsize, self.max_seq_len)
        self.k_cache, self.v_cache = model.new_cache(self.max_seq_len + T, dev)
        self._mask = torch.from_numpy(mask).to(dev)
        self._all_slots = output_slots is None
        self._out_slots = torch.from_numpy(slots).to(dev)
        self._salts = vocab_salts(self.vocab_size, dev)
        # per-step values live in one device buffer [ids | positions | p]; the host writes them through a
        # numpy view (CPU) or a pinned staging copy (CUDA) and never freezes them into a graph
        self._d_in = torch.zeros(2 * T + 1, dtype=torch.int64, device=dev)
        self._ids, self._pos, self._d_cache_len = self._d_in[:T], self._d_in[T : 2 * T], self._d_in[2 * T]
        self._seed = torch.zeros((), dtype=torch.int64, device=dev)
        self._temperature = torch.ones((), dtype=torch.float64, device=dev)
        self._top_p = torch.ones((), dtype=torch.float64, device=dev)
        self._h_in = torch.zeros(2 * T + 1, dtype=torch.int64, pin_memory=is_cuda) if is_cuda else self._d_in
        self._h_in_np = self._h_in.numpy()
        if is_cuda:
            self._h_out = torch.zeros(len(slots), dtype=torch.int64, pin_memory=True)
        self._result = np.full(T, -1, np.int64)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._attention = sdpa_attention_static if self.static_attention else sdpa_attention
        self._cache_len = 0
        self.reset(SamplingParams())

    # -- contract ---------------------------------------------------------------------------------

    @property
    def cache_len(self) -> int:
        """Tokens whose KV is committed (rows 0..cache_len-1)."""
        return self._cache_len

    @torch.inference_mode()
    def reset(self, sampling: SamplingParams | None = None) -> None:
        self.sampling = sampling = sampling or SamplingParams()
        # what selects a captured graph: greedy, else top-k and whether top-p is on
        self._mode = (True, 0, False) if sampling.greedy else (False, sampling.top_k, sampling.top_p < 1.0)
        self._seed.fill_(sampling.seed & MASK32)
        self._temperature.fill_(sampling.temperature if not sampling.greedy else 1.0)
        self._top_p.fill_(sampling.top_p)
        self._cache_len = 0

    @torch.inference_mode()
    def prefill(self, prompt_ids: np.ndarray) -> int:
        ids = check_prompt(prompt_ids, self.max_seq_len, self.vocab_size)
        P = len(ids)
        dev = self.device
        ids_t = torch.from_numpy(ids).to(dev)
        pos_t = torch.arange(P, device=dev)
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril_()
        last = torch.tensor([P - 1], device=dev)
        self._cache_len = 0
        logits = self.model(
            ids_t,
            pos_t,
            self.k_cache,
            self.v_cache,
            torch.zeros((), dtype=torch.int64, device=dev),
            causal,
            last,
            attention=sdpa_attention,
        )
        token = self._select(logits, last)
        self._cache_len = P
        return int(token[0])

    @torch.inference_mode()
    def step(self, input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        check_room(self._cache_len, self.max_seq_len)
        T = self.step_tokens
        h = self._h_in_np
        h[:T] = input_ids
        h[T : 2 * T] = positions
        h[2 * T] = self._cache_len
        if self.device.type == "cuda":
            self._d_in.copy_(self._h_in, non_blocking=True)
            if self.cuda_graph:
                graph, tokens = self._graph()
                graph.replay()
            else:
                tokens = self._run_step()
            self._h_out.copy_(tokens, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            chosen = self._h_out.numpy()
        else:
            chosen = self._run_step().numpy()
        if self._all_slots:
            return chosen.copy()
        out = self._result.copy()
        out[self.output_slots] = chosen
        return out

    @torch.inference_mode()
    def commit(self, slots: np.ndarray) -> None:
        slots = check_commit(slots, self.step_tokens, self._cache_len, self.max_seq_len)
        k = len(slots)
        if k == 0:
            return
        if not np.array_equal(slots, np.arange(k)):  # rows already in place otherwise (greedy: [0])
            src = torch.from_numpy(slots + self._cache_len).to(self.device)
            dst = torch.arange(self._cache_len, self._cache_len + k, device=self.device)
            for cache in (self.k_cache, self.v_cache):
                cache.index_copy_(1, dst, cache.index_select(1, src))
        self._cache_len += k

    # -- internals --------------------------------------------------------------------------------

    def _select(self, logits: Tensor, slots: Tensor) -> Tensor:
        mode = self._mode
        if mode[0]:
            return torch.argmax(logits, dim=-1)
        positions = self._pos.index_select(0, slots) if slots is self._out_slots else slots
        top_p = self._top_p if mode[2] else None
        return sample_tokens_torch(logits, positions, mode[1], top_p, self._temperature, self._seed, self._salts)

    def _run_step(self) -> Tensor:
        logits = self.model(
            self._ids,
            self._pos,
            self.k_cache,
            self.v_cache,
            self._d_cache_len,
            self._mask,
            None if self._all_slots else self._out_slots,
            attention=self._attention,
        )
        return self._select(logits, self._out_slots)

    def _graph(self) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """The CUDA graph of `_run_step` for the current sampling mode (captured on first use)."""
        entry = self._graphs.get(self._mode)
        if entry is None:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: writes only scratch KV rows p..p+T-1
                    self._run_step()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                tokens = self._run_step()
            entry = self._graphs[self._mode] = (graph, tokens)
        return entry
