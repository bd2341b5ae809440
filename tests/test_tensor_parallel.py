"""Tensor parallelism: TP=2 over gloo in real Ray rank actors must decode exactly like TP=1 (fp32).

A tiny Llama with even heads (4 query / 2 KV heads) for the engine-level checks (logits, greedy
outputs, requests joining, leaving and being aborted); the real default model (3 KV heads, sharded
2 + 1) with the suffix drafter through the serving replica.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from hvd_ray.engine import Engine, SamplingParams  # noqa: E402
from hvd_ray.model.config import load_hf_config  # noqa: E402
from hvd_ray.model.tp import apply_tensor_parallel, check_tp_size, split_range  # noqa: E402
from hvd_ray.model.transformer import Transformer  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 91, 7], [11, 12, 13, 11, 12, 13, 11, 12], [200, 3, 45, 45, 45, 9, 61, 300, 1], [42]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The in-process TP=1 references on one thread: on a shared, busy box two spinning OpenMP threads
    make a decode step over 10x slower (measured 45 s vs 3.4 s for the default model's 48 tokens)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ray_local(default_folder):  # default_folder: the model is provisioned before Ray starts
    import ray

    started = False
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()


def _tp_engine(folder, drafter: str = "none", step_timeout_s: float = 300.0, **kw):
    from hvd_ray.build import EngineSpec
    from hvd_ray.serving.tensor_parallel import TensorParallelEngine, TPEngineSpec

    spec = TPEngineSpec(
        model=str(folder),
        dtype="float32",
        torch_threads=1,
        timeout_s=60,
        step_timeout_s=step_timeout_s,
        engine=EngineSpec(drafter=drafter, max_batch=4, max_len=256, num_draft_tokens=6, **kw),
    )
    return TensorParallelEngine(spec, 2)


def _reference(folder) -> tuple[Transformer, list[list[int]]]:
    """TP=1: plain greedy of the unsharded model in this process."""
    model = Transformer.from_pretrained(folder, dtype=torch.float32)
    eng = Engine(model, max_batch=4, max_len=256, num_draft_tokens=0)
    return model, [r.output for r in eng.generate(PROMPTS, GREEDY)]


def test_split_and_invalid_sizes(tiny_llama):
    assert [split_range(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    assert [split_range(8, 3, r) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    cfg = load_hf_config(tiny_llama)  # 2 KV heads
    check_tp_size(cfg, 2)
    with pytest.raises(ValueError, match="exceeds the model's 2 KV heads"):
        check_tp_size(cfg, 3)
    with pytest.raises(ValueError, match="positive integer"):
        check_tp_size(cfg, 0)
    model = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        apply_tensor_parallel(model, 2, 2)
    with pytest.raises(RuntimeError, match="not initialised"):
        apply_tensor_parallel(model, 0, 2)  # no process group in this process

    from pydantic import ValidationError

    from hvd_ray.serving.config import ServingConfig
    from hvd_ray.serving.tensor_parallel import TensorParallelEngine, TPEngineSpec

    with pytest.raises(ValidationError):
        ServingConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="exceeds the model's 2 KV heads"):  # before any actor starts
        TensorParallelEngine(TPEngineSpec(model=str(tiny_llama)), 3)


def test_cli_rejects_bad_tp_size_before_starting_ray(default_folder, capsys):
    import ray

    from hvd_ray.cli import main

    was_running = ray.is_initialized()
    assert main(["generate", "--prompt", "hi", "--tensor-parallel-size", "4"]) == 2
    assert "exceeds the model's 3 KV heads" in capsys.readouterr().err
    assert ray.is_initialized() == was_running


def test_tp2_greedy_and_logits_match_tp1(ray_local, tiny_llama):
    model, want = _reference(tiny_llama)
    tp = _tp_engine(tiny_llama)
    try:
        assert tp.rank_info["kv_heads"] == 1  # each rank caches only its own KV head
        for p in PROMPTS[:2]:
            model.cache.truncate(0, 0)  # a fresh sequence, like the TP engine's scratch slot
            full = model(torch.tensor([p]), [0]).logits[0]
            torch.testing.assert_close(tp.logits(p), full, atol=1e-5, rtol=0)
        got = tp.generate(PROMPTS, GREEDY)
        assert [r.output for r in got] == want
        assert all(r.finish_reason == "length" and r.stats.target_forwards > 0 for r in got)
        assert not tp.has_unfinished() and len(tp.free_slots) == 4

        # the replica's pattern: requests join and leave between steps, one is aborted mid-way,
        # and a sampled request without a seed must not make the ranks diverge
        a = tp.add_request(PROMPTS[0], GREEDY, "a")
        b = tp.add_request(PROMPTS[1], GREEDY, "b")
        outs = tp.step() + tp.step()
        assert a.slot >= 0 and b.slot >= 0 and {o.req_id for o in outs} == {"a", "b"}
        tp.abort("b")
        assert b.finished
        s = tp.add_request(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.8, ignore_eos=True), "s")
        tp.add_request(PROMPTS[3], GREEDY, "gone")
        tp.abort("gone")  # aborted while waiting: never reaches a slot
        seen = []
        while tp.has_unfinished():
            seen += tp.step()
        assert any(o.req_id == "b" and o.finish_reason == "abort" for o in seen)
        assert not any(o.req_id == "gone" for o in seen)
        assert a.output == want[0] and len(s.output) == 10
    finally:
        tp.shutdown()


def test_a_hung_rank_fails_the_step_within_its_deadline(ray_local, tiny_llama):
    """Rank 1 stuck in a collective (a forward rank 0 never joins) cannot answer the step: instead
    of stalling the engine loop until the process-group timeout, the step raises a TimeoutError
    naming rank 1 at ``step_timeout_s`` and every rank actor is killed."""
    from ray.exceptions import RayActorError

    tp = _tp_engine(tiny_llama, step_timeout_s=3.0)
    workers = list(tp.workers)
    try:
        assert tp.step() == []  # answered by both ranks
        stuck = workers[1].logits.remote(PROMPTS[0])  # rank 1 alone: waits in the all-reduce for 60 s
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not answer within 3s"):
            tp.step()
        assert time.monotonic() - t0 < 3.0 + 5.0
        assert tp.closed and tp.workers == []
        with pytest.raises(RuntimeError, match="shut down"):
            tp.step()
        for ref in [stuck] + [w.address.remote() for w in workers]:
            with pytest.raises(RayActorError):
                ray_local.get(ref, timeout=30)
    finally:
        tp.shutdown()


def test_replica_tp2_default_model_matches_tp1(ray_local, default_folder):
    """The real default model (3 KV heads -> 2 + 1 per rank) through ModelReplica, fp32 greedy with
    HVD (suffix cache + EAGLE-3 head, the cost policy pricing steps with rank 0's timings) and the
    shipped slim tier on every rank, against TP=1 plain greedy: sharding, speculation and the slim
    pass together must change nothing."""
    from transformers import AutoTokenizer

    from hvd_ray.serving.replica import ModelReplica
    from hvd_ray.serving.tensor_parallel import TensorParallelEngine

    tok = AutoTokenizer.from_pretrained(default_folder)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ids = [tok(p)["input_ids"] for p in prompts]
    model = Transformer.from_pretrained(default_folder, dtype=torch.float32)
    ref = Engine(model, max_batch=2, max_len=256, eos_token_ids=[tok.eos_token_id])
    want = [tok.decode(r.output, skip_special_tokens=True) for r in ref.generate(ids, SamplingParams(max_tokens=24))]
    del model, ref

    config = {
        "model": "default",
        "dtype": "float32",
        "drafter": "hvd",
        "slim": "default",
        "max_batch": 2,
        "max_model_len": 256,
        "max_tokens": 64,
        "torch_threads": 1,
        "tensor_parallel_size": 2,
        "tp_ray_actor_options": {"num_cpus": 1},
    }
    replica = ModelReplica.func_or_class(config)
    try:
        assert isinstance(replica.engine, TensorParallelEngine)
        assert replica.engine.rank_info["kv_heads"] == 2  # rank 0's share of 3 KV heads

        async def one(prompt: str) -> tuple[str, dict]:
            req = {"prompt": prompt, "params": {"max_tokens": 24, "temperature": 0.0}}
            text, last = "", None
            async for ev in replica.generate(req):
                assert ev["type"] != "error", ev
                text += ev.get("text", "")
                last = ev
            return text, last

        async def both():
            return await asyncio.gather(*(one(p) for p in prompts))  # decoded together

        results = asyncio.run(both())
        assert [t for t, _ in results] == want
        assert all(ev["type"] == "finish" and ev["stats"]["target_forwards"] > 0 for _, ev in results)
        assert sum(ev["stats"]["drafted"] for _, ev in results) > 0  # the drafters really drafted
        assert sum(ev["stats"]["slim_forwards"] for _, ev in results) > 0  # and the slim tier ran
        assert replica.stats()["finished"] == 2
    finally:
        replica.loop.shutdown()
        replica.engine.shutdown()
