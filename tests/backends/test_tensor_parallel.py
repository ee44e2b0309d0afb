"""backends/tensor_parallel.py: shards by heads, refusals, and two gloo ranks on the CPU (one process each, as
`tests/support/tensor_parallel_worker.py` runs them) whose lookahead answers equal their greedy, batched or alone,
whose slot logits keep their bits batched, and whose logits are the whole model's to float rounding."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trt_lookahead.backends.tensor_parallel import (
    GATHER,
    TWO_PHASE,
    Link,
    check_degree,
    load_shard,
    reduce_form,
    reduce_seconds,
    shard_config,
    shard_llama,
)
from trt_lookahead.errors import UserError
from trt_lookahead.files import free_port
from trt_lookahead.model.checkpoint import load_llama
from trt_lookahead.model.llama import Llama, ModelConfig

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
WORKER = Path(__file__).parents[1] / "support" / "tensor_parallel_worker.py"
GQA = ModelConfig(hidden_size=32, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=4, intermediate_size=64,
                  vocab_size=64)


def test_two_shards_hold_the_heads_mlp_and_vocabulary_between_them():
    """stories260K (8 query heads over 4 KV heads, head_dim 8, MLP 172, vocab 512) at degree 2: rank r holds query
    heads 4r .. 4r + 3 and KV heads 2r, 2r + 1; the halves put together are the model's weights."""
    model, cfg = load_llama(STORIES)
    shards = [shard_llama(model, rank, 2).model for rank in (0, 1)]
    assert shards[0].cfg == dataclasses.replace(cfg, num_heads=4, num_kv_heads=2, intermediate_size=86,
                                                tie_word_embeddings=False)
    D, q, kv = 8, cfg.q_size, cfg.kv_size
    for i, layer in enumerate(model.layers):
        parts = [s.layers[i] for s in shards]
        wqkv = [p.attention.wqkv.weight for p in parts]  # [4 q heads; 2 k heads; 2 v heads] of 8 rows each
        full = layer.attention.wqkv.dense_weight()
        assert torch.equal(torch.cat([w[: 4 * D] for w in wqkv]), full[:q])
        assert torch.equal(torch.cat([w[4 * D : 6 * D] for w in wqkv]), full[q : q + kv])
        assert torch.equal(torch.cat([w[6 * D :] for w in wqkv]), full[q + kv :])
        assert torch.equal(torch.cat([p.attention.wo.weight for p in parts], 1), layer.attention.wo.dense_weight())
        w13 = [p.feed_forward.w13.weight for p in parts]  # [gate half; up half]
        full13 = layer.feed_forward.w13.dense_weight()
        assert torch.equal(torch.cat([w[:86] for w in w13] + [w[86:] for w in w13]), full13)
        w2 = torch.cat([p.feed_forward.w2.weight for p in parts], 1)
        assert torch.equal(w2, layer.feed_forward.w2.dense_weight())
    assert torch.equal(torch.cat([s.output.weight for s in shards]), model.tok_embeddings.weight)  # tied head
    assert all(torch.equal(s.tok_embeddings.weight, model.tok_embeddings.weight) for s in shards)


def test_fewer_kv_heads_than_ranks_are_replicated_to_the_query_heads_that_read_them():
    """8 query heads over 2 KV heads at degree 4: rank r holds query heads 2r, 2r + 1, which read KV head r // 2."""
    torch.manual_seed(0)
    model = Llama(GQA).eval().requires_grad_(False)
    assert shard_config(GQA, 4).num_kv_heads == 1
    D, q, kv = GQA.head_dim, GQA.q_size, GQA.kv_size
    full = model.layers[0].attention.wqkv.weight
    for rank in range(4):
        wqkv = shard_llama(model, rank, 4).model.layers[0].attention.wqkv.weight  # [2 q heads; 1 k; 1 v]
        head = rank // 2
        assert torch.equal(wqkv[: 2 * D], full[2 * rank * D : (2 * rank + 2) * D])
        assert torch.equal(wqkv[2 * D : 3 * D], full[q + head * D : q + (head + 1) * D])
        assert torch.equal(wqkv[3 * D :], full[q + kv + head * D : q + kv + (head + 1) * D])


def random_checkpoint(tmp_path: Path) -> Path:
    """stories260K's config with 2 KV heads and its own lm_head, random weights by HF names: at degree 4 each
    KV head is replicated to two ranks, and the head is read from its own tensor."""
    from safetensors.torch import save_file

    from trt_lookahead.model.checkpoint import expected_tensors, hf_key, read_config

    path = tmp_path / "gqa"
    path.mkdir()
    config = json.loads((STORIES / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 2, "tie_word_embeddings": False}))
    generator = torch.Generator().manual_seed(0)
    tensors = {hf_key(name): torch.randn(shape, generator=generator)
               for name, shape in expected_tensors(read_config(path)).items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("checkpoint", ["stories260K", "gqa-untied"])
def test_a_rank_reads_its_shard_from_the_checkpoint_as_the_loaded_model_shards(tmp_path, checkpoint, world):
    """load_shard reads each split weight's rows or columns alone; its shard has the bits of shard_llama's cut of
    the whole loaded model, every tensor (tied head: the embedding's rows; untied: the head's own)."""
    path = STORIES if checkpoint == "stories260K" else random_checkpoint(tmp_path)
    model, _ = load_llama(path)
    for rank in range(world):
        read = load_shard(str(path), "float32", rank, world, weight_layout="out_in").model.state_dict()
        cut = shard_llama(model, rank, world).model.state_dict()
        assert read.keys() == cut.keys()
        assert all(torch.equal(read[name], cut[name]) for name in cut), rank


def test_degrees_a_model_cannot_take_are_refused_naming_what_does_not_divide():
    cfg = load_llama(STORIES)[1]
    with pytest.raises(UserError, match=r"tensor_parallel 3 cannot split 8 attention heads, 4 key/value heads .*, "
                                        r"an MLP of 172, a vocabulary of 512: use a degree that divides them"):
        check_degree(cfg, 3)
    with pytest.raises(UserError, match="tensor_parallel 8 cannot split an MLP of 172: use"):
        check_degree(cfg, 8)  # 8 heads over 4 KV heads split (KV replicated), 172 = 8 x 21.5 does not
    for bad in (0, -2, True, 2.0):
        with pytest.raises(UserError, match="tensor_parallel must be a positive integer"):
            check_degree(cfg, bad)
    with pytest.raises(UserError, match="does not split projection biases yet"):
        check_degree(dataclasses.replace(GQA, attention_bias=True), 2)
    check_degree(GQA, 8)  # 8 query heads, KV heads replicated 4 ways


def run_ranks(tmp_path: Path, mode: str = "run", world: int = 2) -> tuple[dict, list[subprocess.CompletedProcess]]:
    """Every rank as a process on a free port; (rank 0's JSON, or {} where it writes none; each rank's process)."""
    out, port = tmp_path / "rank0.json", str(free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), port, str(out), mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    done = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return (json.loads(out.read_text()) if out.exists() else {}), done


def test_two_ranks_answer_as_their_greedy_with_a_slots_bits_alone_or_batched(tmp_path):
    result, done = run_ranks(tmp_path)
    assert all(p.returncode == 0 for p in done), [p.stderr[-2000:] for p in done]
    assert result["lookahead"] == result["greedy"] and result["batched"] == result["greedy"]
    assert all(len(tokens) == 40 for tokens in result["greedy"])
    assert result["alone_equals_batched"]  # the exact reduction: a row's sum never depends on its companions
    # the whole model's logits (TP = 1) to float32 rounding of partial sums added in another order
    assert result["max_abs_vs_whole"] <= 1e-4 * result["max_abs_whole"]


@pytest.mark.parametrize("world", [2, 4])
def test_both_exact_reductions_add_the_partials_in_rank_order_on_every_rank(tmp_path, world):
    """GATHER, TWO_PHASE and the form chosen by size each give every rank the partials added in rank order, bit for
    bit (partials spread over 2^-10 .. 2^10, so another order would show), for 2- and 3-dimensional partials and
    one whose columns do not split over 4 ranks (TWO_PHASE then gathers)."""
    _, done = run_ranks(tmp_path, "reduce", world)
    assert all(p.returncode == 0 for p in done), [p.stderr[-2000:] for p in done]
    checks = [json.loads((tmp_path / f"rank0.json.rank{rank}").read_text()) for rank in range(world)]
    assert checks == [[True] * 12] * world


def test_the_cheaper_exact_reduction_is_chosen_by_size():
    """GATHER moves W - 1 partials into each rank in one collective and adds W; TWO_PHASE 2 (W - 1) / W in two and
    adds one. On a link of 10 us and 450 GB/s with 3 TB/s memory at 8 ranks, two phases pay from 10 us / (5.25 /
    450 GB/s + 7 / 3 TB/s) = 0.71 MB; at 2 ranks with adds free, never (the same bytes, one more latency); one
    rank: no collective."""
    nvlink = Link(latency=10e-6, bandwidth=450e9, memory=3e12)
    assert reduce_form(64 << 10, 8, nvlink) == GATHER and reduce_form(4 << 20, 8, nvlink) == TWO_PHASE
    crossing = next(n << 10 for n in range(1, 4096) if reduce_form(n << 10, 8, nvlink) == TWO_PHASE)
    assert 0.70e6 < crossing < 0.72e6
    assert reduce_form(1 << 30, 2, Link(latency=1e-6, bandwidth=1e9, memory=float("inf"))) == GATHER
    assert reduce_seconds(GATHER, 1e6, 1, nvlink) == 0.0 and reduce_form(1e9, 8, None) == GATHER


def test_messages_of_any_size_reach_the_other_rank_whole(tmp_path):
    """A step's arguments in one broadcast, a pickle that fills it exactly, one byte more (a second broadcast), and
    256 KiB: each arrives as sent."""
    result, done = run_ranks(tmp_path, "messages")
    assert all(p.returncode == 0 for p in done), [p.stderr[-2000:] for p in done]
    assert result == {"sent": 4} and json.loads((tmp_path / "rank0.json.rank1").read_text()) == [True] * 4


def test_a_lost_rank_ends_rank_0s_next_call_with_an_error_not_a_hang(tmp_path):
    """The first call after a rank is gone fails with gloo's error, named; every later one fails at once, with no
    collective tried (a server answers its requests with the error instead of waiting out the timeout each)."""
    result, done = run_ranks(tmp_path, "die")
    assert done[0].returncode == 0 and len(result["errors"]) == 3, result
    first, *later = result["errors"]
    assert first["error"].startswith("RuntimeError: tensor parallelism: ") and "restart the runtime" in first["error"]
    assert "peer" in first["error"] or "closed" in first["error"]  # gloo's own words, kept in the message
    assert all(e["error"] == first["error"] and e["seconds"] < 1.0 for e in later)


# -- the runtime starts and stops the ranks ----------------------------------------------------------------------


def test_a_runtime_on_two_ranks_answers_as_its_greedy_and_stops_its_ranks():
    """from_pretrained(tensor_parallel=2): this process is rank 0, one rank process more; lookahead, `auto` and three
    requests at once answer as greedy (exact step); close() ends the rank process."""
    from concurrent.futures import ThreadPoolExecutor

    from trt_lookahead.runtime import LookaheadRuntime

    prompts = ["Once upon a time", "The little dog ran to the", "Lily and Ben went to the park"]
    with LookaheadRuntime.from_pretrained(STORIES, tensor_parallel=2, exact=True) as rt:
        followers = rt.executor.followers
        assert rt.backend == "torch" and rt.exact and len(followers) == 1 and followers[0].poll() is None
        assert rt.executor.model.cfg.num_heads == 4  # rank 0's shard: half the heads
        greedy = [rt.generate(p, max_new_tokens=32, lookahead="greedy").token_ids for p in prompts]
        for config in (None, "auto"):
            assert [rt.generate(p, max_new_tokens=32, lookahead=config).token_ids for p in prompts] == greedy
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(lambda p: rt.generate(p, max_new_tokens=32).token_ids, prompts)) == greedy
    assert followers[0].returncode == 0


def test_a_killed_rank_process_is_named_with_its_status():
    """A rank process killed under a running runtime: the next request fails with one error naming rank 1 and its
    exit status (SIGKILL: -9), and so does every later one, at once; close() still returns."""
    from trt_lookahead.runtime import LookaheadRuntime

    with LookaheadRuntime.from_pretrained(STORIES, tensor_parallel=2, exact=True) as rt:
        rt.generate("Once upon a time", max_new_tokens=8)
        rt.executor.followers[0].kill()
        for _ in range(2):
            with pytest.raises(Exception, match=r"rank 1 exited with status -9.*restart the runtime"):
                rt.generate("Once upon a time", max_new_tokens=8)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tensor_parallel": 3}, "tensor_parallel 3 cannot split 8 attention heads"),
    ({"tensor_parallel": 0}, "tensor_parallel must be a positive integer"),
    ({"tensor_parallel": 2, "backend": "onnxruntime"},
     r"drop --backend other than torch, or --tensor-parallel \(tensor_parallel\)$"),
    ({"tensor_parallel": 2, "weights": "int4"}, "on float weights for now; drop --weights/--activations"),
    ({"tensor_parallel": 2, "device": "cuda"}, "drop --device cuda \\(NCCL\\)"),
])
def test_tensor_parallel_runs_refuse_what_they_cannot_run_before_loading(kwargs, message):
    from trt_lookahead.runtime import LookaheadRuntime

    with pytest.raises(UserError, match=message):
        LookaheadRuntime.from_pretrained(STORIES, **kwargs)


def test_a_rank_that_cannot_start_is_one_error_with_the_end_of_its_stderr(tmp_path, monkeypatch):
    """A rank process that exits before it is ready (here: its interpreter refuses to start) is a UserError naming
    it, its status and its last stderr lines; no group is left formed in this process."""
    import torch.distributed as dist

    from trt_lookahead.runtime import LookaheadRuntime

    refuse = "import sys\nsys.stderr.write('no room for this rank\\n')\nsys.exit(3)\n"  # fatal in site: status 1
    (tmp_path / "sitecustomize.py").write_text(refuse)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the rank processes' interpreter only: this one has started
    with pytest.raises(UserError, match=r"tensor-parallel rank 1 exited while loading \(status 1\):\nno room for"):
        LookaheadRuntime.from_pretrained(STORIES, tensor_parallel=2, exact=True)
    assert not dist.is_initialized()
