"""Prefix reuse: a new request whose prompt starts with a finished request's tokens takes that
request's KV slot and prefills only the rest (engine/engine.py). Outputs must not change: fp32,
the real default model and real prompts, compared with the same engine without reuse."""

from __future__ import annotations

import pytest
import torch
from conftest import MAX_NEW

from hvd_ray.build import EngineSpec, build_engine
from hvd_ray.engine import SamplingParams
from hvd_ray.model.kv_cache import KVCache


def test_the_cache_forgets_what_truncate_and_compact_rewrite(target):
    model, _ = target
    cache = KVCache(model.cfg, 2, 32, torch.float32, torch.device("cpu"))
    cache.lengths[0] = 10
    cache.tokens[0] = list(range(10))
    cache.truncate(0, 7)
    assert cache.tokens[0] == list(range(7))
    cache.lengths[0] = 10
    cache.compact(0, 5, [0, 2])
    assert cache.tokens[0] == list(range(5)) and cache.lengths[0] == 7
    cache.k[0][0, :, :5] = 1.0
    cache.copy_prefix(0, 1, 4)
    assert cache.lengths[1] == 4 and cache.tokens[1] == list(range(4)) and cache.tokens[0] == list(range(5))
    assert bool((cache.k[0][1, :, :4] == 1.0).all())
    cache.truncate(0, 0)
    assert cache.tokens[0] == [] and cache.tokens[1] == list(range(4))


def _follow_up(tok) -> list[int]:
    return tok("\n\nPlease give that again, shorter.\n", add_special_tokens=False)["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["none", "eagle3", "hvd"])
def test_agent_turns_and_retries_reuse_their_slot_and_decode_the_same(drafter, target, prompts):
    """Two conversations at batch 2; their second turns (prompt + answer + a follow-up) arrive in the
    other order and each lands in its own first turn's slot; then a retry of the first prompt.
    EAGLE-3 (hvd's model drafter) sees taps only from the reused length on."""
    model, tok = target
    firsts_in = [prompts[0], prompts[5]]  # code, chat
    params = SamplingParams(max_tokens=MAX_NEW)

    def run(reuse: bool):
        spec = EngineSpec(drafter=drafter, max_batch=2, max_len=1024, num_draft_tokens=6, prefix_reuse=reuse)
        eng = build_engine(spec, model, tok)
        firsts = eng.generate(firsts_in, params)
        turns = [p + r.output + _follow_up(tok) for p, r in zip(firsts_in, firsts)][::-1]
        seconds = eng.generate(turns, params)
        retry = eng.generate([firsts_in[0]], params)
        return firsts, seconds, retry

    firsts, seconds, retry = run(True)
    _, seconds0, retry0 = run(False)
    assert [r.output for r in seconds] == [r.output for r in seconds0]
    assert retry[0].output == retry0[0].output
    assert all(r.stats.cached_tokens == 0 for r in seconds0 + retry0)
    for first, r in zip(firsts[::-1], seconds):
        # the slot held the first turn's prompt and output but its last (pending) token
        assert r.stats.cached_tokens == len(first.prompt) + len(first.output) - 1
    assert retry[0].stats.cached_tokens == len(firsts_in[0]) - 1  # all but the last prompt token


@pytest.mark.slow
def test_engines_sharing_a_model_never_reuse_what_another_overwrote(target, prompts):
    """The record of whose K/V a slot holds lives in the model's cache, so an engine on the same
    model that overwrote the slot leaves a true record (its own tokens) behind."""
    from hvd_ray.engine.slots import MIN_REUSE, common_prefix

    model, tok = target
    params = SamplingParams(max_tokens=MAX_NEW)
    a = build_engine(EngineSpec(max_batch=1, max_len=1024), model, tok)
    b = build_engine(EngineSpec(max_batch=1, max_len=1024), model, tok)
    p = max(prompts, key=len)
    first = a.generate([p], params)[0]
    half = p[: len(p) // 2]
    assert len(half) >= MIN_REUSE
    other = b.generate([half], params)[0]  # slot 0 now holds half of that prompt and another answer
    turn = p + first.output + _follow_up(tok)
    got = a.generate([turn], params)[0]
    assert got.stats.cached_tokens == common_prefix(half + other.output[:-1], turn, len(turn) - 1) < len(p)
    fresh = build_engine(EngineSpec(max_batch=1, max_len=1024, prefix_reuse=False), model, tok)
    assert got.output == fresh.generate([turn], params)[0].output


@pytest.mark.parametrize("kept", ["short", "long"])
def test_the_rest_of_a_long_prompt_after_a_kept_prefix_scores_as_a_fresh_prefill(target, prompts, kept):
    """A long rest (>= PREFIX_SDPA_MIN tokens) attends through SDPA: after a short kept prefix as a
    causal prefill with zero queries in the prefix's rows, after a long one with a lower-right
    causal mask (the padding would cost more there)."""
    from hvd_ray.model.attention import PREFIX_SDPA_MIN

    model, _ = target
    m = model.with_own_cache()
    m.setup_cache(1, 1024)
    ids = max(prompts, key=len)
    P = 40 if kept == "short" else len(ids) - PREFIX_SDPA_MIN
    assert len(ids) - P >= PREFIX_SDPA_MIN and (2 * P < 3 * (len(ids) - P)) == (kept == "short")
    fresh = m(torch.tensor([ids]), [0]).logits[0]
    m.cache.truncate(0, 0)
    m(torch.tensor([ids[:P]]), [0])
    rest = m(torch.tensor([ids[P:]]), [0]).logits[0]
    torch.testing.assert_close(rest, fresh[P:], rtol=1e-4, atol=1e-4)
    assert torch.equal(rest.argmax(-1), fresh[P:].argmax(-1))


@pytest.mark.slow
def test_reuse_slots_keep_a_retry_in_store_while_others_run(target, prompts):
    """max_batch 1 with 2 reuse slots: three requests one at a time (never two running), then the
    first again finds its K/V. The third shares the first's system prompt: its rows are copied to
    another slot rather than the first's record cut."""
    model, tok = target
    params = SamplingParams(max_tokens=MAX_NEW)
    eng = build_engine(EngineSpec(max_batch=1, reuse_slots=2, max_len=1024), model.with_own_cache(), tok)
    assert eng.slots == 3 and len(eng.free_slots) == 3
    reqs = [eng.add_request(p, params) for p in (prompts[8], prompts[0], prompts[9])]
    while eng.has_unfinished():
        eng.step()
        assert len(eng.running) <= 1
    retry = eng.generate([prompts[8]], params)[0]
    assert retry.stats.cached_tokens == len(prompts[8]) - 1 and retry.output == reqs[0].output
    alone = build_engine(EngineSpec(max_batch=1, max_len=1024), model.with_own_cache(), tok)
    for p in (prompts[8], prompts[0], prompts[9]):
        alone.generate([p], params)
    # one slot: it holds the last request (the shared function-calling system prompt at most)
    assert alone.slots == 1 and alone.generate([prompts[8]], params)[0].stats.cached_tokens < len(prompts[8]) // 2


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["none", "hvd"])
def test_concurrent_requests_copy_a_shared_prompt_prefix_from_a_running_one(drafter, target, prompts):
    """Agents send one tool list with every call. A request prefilled in the same step as another
    with the same system prompt, or arriving while one runs, copies those K/V from it instead of
    recomputing them (no finished request's slot holds them yet); outputs equal the same engine's
    without reuse."""
    from hvd_ray.engine.slots import MIN_REUSE, common_prefix

    model, tok = target
    params = SamplingParams(max_tokens=MAX_NEW)
    later = prompts[8] + _follow_up(tok)  # e.g. the same agent's next call

    def run(reuse: bool):
        spec = EngineSpec(drafter=drafter, max_batch=3, max_len=1024, num_draft_tokens=6, prefix_reuse=reuse)
        eng = build_engine(spec, model, tok)
        first = [eng.add_request(p, params) for p in (prompts[8], prompts[9])]  # admitted in one step
        eng.step()
        eng.step()
        assert not any(r.finished for r in first)
        third = eng.add_request(later, params)
        while eng.has_unfinished():
            eng.step()
        return [*first, third]

    reqs, alone = run(True), run(False)
    assert [r.output for r in reqs] == [r.output for r in alone]
    assert all(r.stats.cached_tokens == 0 for r in alone)
    shared = common_prefix(prompts[8], prompts[9], len(prompts[9]) - 1)
    assert shared >= MIN_REUSE  # the function-calling system prompt
    assert [r.stats.cached_tokens for r in reqs] == [0, shared, len(prompts[8])]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["none", "suffix"])
def test_rows_sharing_a_long_prefix_attend_over_it_once_and_decode_the_same(drafter, target, prompts, monkeypatch):
    """Three agent calls sharing a 2,000-token tool list and a chat prompt at batch 4: the later two
    calls copy the first's K/V, and the three rows then attend over the shared rows once per forward
    (``cascade_attend``) while the chat row in the same forward attends over its own, also when they
    verify drafts of different lengths (packed rows); greedy outputs equal the same engine's without
    reuse, where every row attends over its own, and plain greedy decoding's."""
    from hvd_ray.model.attention import CASCADE_MIN
    from hvd_ray.model.transformer import Attention
    from hvd_ray.workloads import render
    from hvd_ray.workloads.agent import agent_prompts

    model, tok = target
    calls = [tok(render(p, tok), add_special_tokens=False)["input_ids"] for p in agent_prompts()[:3]]
    calls.append(prompts[4])  # a chat prompt: its row attends over its own K/V beside the group
    cascaded = []
    inner = Attention._cascade
    monkeypatch.setattr(
        Attention,
        "_cascade",
        staticmethod(
            lambda q, kc, vc, ctx: cascaded.append((ctx.cascade, ctx.valid, ctx.rest)) or inner(q, kc, vc, ctx)
        ),
    )

    def run(drafter: str, reuse: bool):
        spec = EngineSpec(drafter=drafter, max_batch=4, max_len=2560, num_draft_tokens=6, prefix_reuse=reuse)
        return build_engine(spec, model.with_own_cache(), tok).generate(calls, SamplingParams(max_tokens=MAX_NEW))

    shared = run(drafter, True)
    assert [r.output for r in shared] == [r.output for r in run(drafter, False)]
    if drafter != "none":
        assert [r.output for r in shared] == [r.output for r in run("none", False)]
    assert [r.stats.cached_tokens > CASCADE_MIN for r in shared] == [False, True, True, False]
    assert cascaded and all(len(rows) >= 2 and n > CASCADE_MIN for c, *_ in cascaded for rows, _, n, *_ in c)
    assert any(rest is not None for *_, rest in cascaded)  # the chat row beside the group
    if drafter != "none":  # some steps verified drafts of different lengths: packed rows
        assert any(valid is not None for _, valid, _ in cascaded)
