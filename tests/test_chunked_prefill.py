"""Chunked prefill (``prefill_chunk``): while requests decode, a step computes at most that many
prompt tokens, so an arriving prompt is prefilled over several steps between the running streams'
decode forwards. Outputs must not change: fp32, the real default model and real prompts, compared
with the same engine prefilling whole prompts."""

from __future__ import annotations

import pytest
from conftest import MAX_NEW

from hvd_ray.build import EngineSpec, build_engine
from hvd_ray.engine import SamplingParams

pytestmark = pytest.mark.slow
CHUNK = 64


def _run(target, prompts, drafter: str, chunk: int | None, steps: list | None = None, stagger: bool = True):
    model, tok = target
    spec = EngineSpec(drafter=drafter, max_batch=2, max_len=1024, num_draft_tokens=6, prefill_chunk=chunk)
    eng = build_engine(spec, model.with_own_cache(), tok)
    # outputs of different lengths: requests finishing in lockstep would leave no stream decoding
    # beside the next prompts' prefill
    lengths = [MAX_NEW // (1 + i % 2) if stagger else MAX_NEW for i in range(len(prompts))]
    reqs = [eng.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, lengths)]
    while eng.has_unfinished():
        prefilling = sum(1 for r in eng.running if not r.finished and not r.output)
        eng.step()
        if steps is not None:
            steps.append(prefilling)
    return reqs


@pytest.mark.parametrize("drafter", ["none", "hvd"])
def test_prompts_prefilled_in_chunks_between_decode_steps_decode_the_same(drafter, target, prompts):
    """Two slots, five prompts of 130-600 tokens: each prompt after the first two arrives while
    another request decodes and is prefilled 64 tokens a step; greedy outputs equal whole-prompt
    prefill's (with ``hvd`` the suffix trees and the EAGLE-3 head, which observes the target's
    hidden states chunk by chunk)."""
    picked = [p for p in prompts if len(p) > 2 * CHUNK][:5]
    assert len(picked) == 5
    steps: list[int] = []
    chunked = _run(target, picked, drafter, CHUNK, steps)
    whole = _run(target, picked, drafter, None)
    assert [r.output for r in chunked] == [r.output for r in whole]
    assert all(r.finish_reason in ("stop", "length") for r in chunked)
    # later prompts took several steps to prefill, with a stream decoding beside them
    assert sum(1 for n in steps if n) >= 2
    if drafter == "none":  # a forward per decoded token either way: the later chunks are the extra ones
        assert sum(r.stats.target_forwards for r in chunked) > sum(r.stats.target_forwards for r in whole)
    assert all(r.stats.prefill_s > 0 for r in chunked)


def test_a_request_aborted_mid_prefill_frees_its_slot_and_the_rest_decode_the_same(target, prompts):
    """Aborting a request whose prompt is half computed ends it at the next step, frees its slot
    (whose computed part a later prompt may reuse), and leaves the other requests' outputs as
    whole-prompt prefill gives them."""
    model, tok = target
    picked = [p for p in prompts if len(p) > 4 * CHUNK][:3]
    spec = EngineSpec(drafter="none", max_batch=2, max_len=1024, prefill_chunk=CHUNK)
    eng = build_engine(spec, model.with_own_cache(), tok)
    reqs = [eng.add_request(picked[0], SamplingParams(max_tokens=MAX_NEW))]
    eng.step()  # its prefill, alone: the whole prompt
    reqs += [eng.add_request(p, SamplingParams(max_tokens=MAX_NEW)) for p in picked[1:]]
    eng.step()  # reqs[1] arrives beside reqs[0]'s decode: part of its prompt is computed
    assert reqs[0].output and not reqs[1].output and not reqs[1].finished
    assert 0 < model_cache_len(eng, reqs[1]) < len(picked[1])
    eng.abort(reqs[1].req_id)
    while eng.has_unfinished():
        eng.step()
    assert reqs[1].finish_reason == "abort" and not reqs[1].output
    assert sorted(eng.free_slots) == list(range(eng.slots))
    whole = _run(target, [picked[0], picked[2]], "none", None, stagger=False)
    assert [reqs[0].output, reqs[2].output] == [r.output for r in whole]


def model_cache_len(eng, req) -> int:
    return eng.model.cache.lengths[req.slot]


def test_prefill_chunk_must_be_positive(target):
    model, tok = target
    with pytest.raises(ValueError, match="prefill_chunk"):
        build_engine(EngineSpec(prefill_chunk=0), model.with_own_cache(), tok)


def test_the_prefill_benchmark_measures_streams_and_arrivals(target, prompts):
    """``jobs/benchmark.py prefill``'s loop on real prompts: every output token counted, delivery
    gaps ordered, and arrivals beside decoding streams timed against their own prefill."""
    from hvd_ray.bench.prefill_chunks import run

    model, tok = target
    spec = EngineSpec(drafter="none", max_batch=2, max_len=1024, prefill_chunk=CHUNK)
    eng = build_engine(spec, model.with_own_cache(), tok)
    r = run(eng, prompts[:6], SamplingParams(max_tokens=8, ignore_eos=True), 2)
    assert r["tok_s"] > 0 and r["arrivals"] >= 3
    assert 0 < r["gap_p50"] <= r["gap_p99"] <= r["gap_max"]
    assert 0 < r["prefill_p50"] and r["ttft_p50"] <= r["ttft_p99"] and r["ratio_p50"] >= 1


def test_the_where_benchmark_times_prefill_and_its_stalls_in_chunks(target, prompts):
    """``jobs/benchmark.py where`` wraps the engine's prefill: with chunks, its seconds are counted
    once per chunk, and as a stall only in steps where streams decoded."""
    import argparse

    from hvd_ray.bench import where_time
    from hvd_ray.build import add_spec_arguments

    model, tok = target
    ap = argparse.ArgumentParser()
    add_spec_arguments(ap)
    args = ap.parse_args(["--prefill-chunk", str(CHUNK)])
    args.dtype, args.max_tokens = "float32", 8
    picked = [p for p in prompts if len(p) > 2 * CHUNK][:4]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    r = where_time.in_process(args, "greedy", picked, params, 2)
    ph = r["phases"].s
    assert r["tokens"] == 8 * len(picked)
    assert 0 < ph["stall"] < ph["prefill"] and ph["forward"] > 0
