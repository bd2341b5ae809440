"""One request's failure stays that request's: the engine fails it alone and the batch goes on
(real default model, fp32: the others' outputs stay token-identical to plain greedy decoding);
only a failed shared forward stops the replica's engine loop, and then every waiter hears so."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import MAX_NEW

slow = pytest.mark.slow


def _run(engine, prompts, params):
    reqs = [engine.add_request(p, sp, req_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return reqs, outs


def _poisoned() -> SamplingParams:  # noqa: F821
    """What `temperature: 1e-45` did before validation: 1/T overflows the logits to inf / NaN."""
    from hvd_ray.engine import SamplingParams

    sp = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=1)
    sp.temperature = 1e-45  # past __post_init__, which now turns it into greedy decoding
    return sp


@slow
def test_non_finite_sampling_fails_only_that_request(target, prompts, plain):
    from hvd_ray.drafters import make_drafter
    from hvd_ray.engine import Engine, SamplingParams
    from hvd_ray.verification.sampling import NonFiniteProbabilities, target_probs

    with pytest.raises(NonFiniteProbabilities):
        target_probs(torch.tensor([1.0, 2.0, 3.0]), temperature=1e-45)
    assert SamplingParams(temperature=1e-45).greedy  # the engine API decodes it greedily (the server refuses it)

    model, _ = target
    engine = Engine(model, drafters=[make_drafter("suffix", model)], max_batch=4, max_len=1024)
    greedy = SamplingParams(max_tokens=MAX_NEW)
    reqs, outs = _run(engine, [prompts[0], prompts[1], prompts[2], prompts[3]], [greedy, _poisoned(), greedy, greedy])
    bad = reqs[1]
    assert bad.finish_reason == "error" and "not finite" in bad.error
    errs = [o for o in outs if o.finish_reason == "error"]
    assert [o.req_id for o in errs] == ["r1"] and errs[0].error == bad.error
    assert [r.output for r in (reqs[0], reqs[2], reqs[3])] == [plain[0], plain[2], plain[3]]
    assert all(r.finish_reason in ("length", "stop") for r in (reqs[0], reqs[2], reqs[3]))
    assert len(engine.free_slots) == 4 and not engine.running  # the failed request's slot came back
    # the engine keeps serving: the same prompt decodes as before
    again, _ = _run(engine, [prompts[1]], [greedy])
    assert again[0].output == plain[1]


@slow
def test_a_drafter_failing_for_one_request_fails_only_that_request(target, prompts, plain):
    """A batched propose that raises is retried per request; the request that still breaks it
    fails, the others keep their drafts and their exact greedy output."""
    from hvd_ray.drafters.suffix import SuffixDrafter
    from hvd_ray.engine import Engine, SamplingParams

    class Faulty(SuffixDrafter):  # the real suffix drafter, with a fault injected for one request
        def propose(self, asks):
            if any(a.req_id == "r2" for a in asks) and len(self.calls) >= 3:
                raise RuntimeError("injected drafter fault")
            self.calls.append(len(asks))
            return super().propose(asks)

        def begin(self, req_id, prompt, slot=-1):
            if req_id == "r3":
                raise RuntimeError("injected begin fault")
            return super().begin(req_id, prompt, slot)

    model, _ = target
    drafter = Faulty()
    drafter.calls = []
    engine = Engine(model, drafters=[drafter], max_batch=4, max_len=1024)
    greedy = SamplingParams(max_tokens=MAX_NEW)
    reqs, outs = _run(engine, prompts[:4], [greedy] * 4)
    assert reqs[2].finish_reason == "error" and "injected drafter fault" in reqs[2].error
    assert reqs[3].finish_reason == "error" and "injected begin fault" in reqs[3].error
    assert reqs[0].output == plain[0] and reqs[1].output == plain[1]
    assert sorted(o.req_id for o in outs if o.finish_reason == "error") == ["r2", "r3"]
    assert 2 in drafter.calls  # the batch of r0, r1 still drafted together after r2 broke
    assert len(engine.free_slots) == 4 and drafter.live_requests() == 0


def test_engine_loop_failure_reaches_every_waiter(tiny_llama):
    """The shared forward raising stops the loop: requests in flight and queued get an error event,
    new ones are refused, and the replica reports unhealthy."""
    from hvd_ray.engine import Engine, SamplingParams
    from hvd_ray.model.transformer import Transformer
    from hvd_ray.serving.engine_loop import EngineLoop, Stream

    model = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    engine = Engine(model, max_batch=2, max_len=128)

    async def main():
        loop = asyncio.get_running_loop()
        el = EngineLoop(engine)
        ok = Stream(loop, asyncio.Queue())
        el.submit([1, 2, 3], SamplingParams(max_tokens=4), "ok", ok)
        first = await asyncio.wait_for(ok.queue.get(), 30)
        assert first["type"] == "tokens"
        while not first["finished"]:
            first = await asyncio.wait_for(ok.queue.get(), 30)
        assert el.stats()["healthy"]

        def boom(*a, **k):
            raise RuntimeError("injected forward fault")

        model.forward = boom
        streams = [Stream(loop, asyncio.Queue()) for _ in range(4)]  # 2 admitted, 2 queued for a slot
        for i, s in enumerate(streams):
            el.submit([1, 2, 3 + i], SamplingParams(max_tokens=50), f"r{i}", s)
        evs = [await asyncio.wait_for(s.queue.get(), 30) for s in streams]
        assert all(
            e["type"] == "error" and e["status"] == 500 and "injected forward fault" in e["message"] for e in evs
        ), evs
        assert not el.stats()["healthy"]
        with pytest.raises(RuntimeError, match="engine loop failed"):
            el.submit([1], SamplingParams(max_tokens=1), "late", Stream(loop, asyncio.Queue()))

    try:
        asyncio.run(main())
    finally:
        del model.forward
