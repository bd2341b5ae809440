"""The shared suffix-drafter actor behind its engine-side proxy, on a real local Ray.

The proxy must draft exactly what an in-process ``SuffixDrafter`` drafts on the same token streams
(one round trip per step), share the global tree between clients (replicas), and survive the actor
being killed: empty drafts while it is down, then a resync of the live requests once Ray restarts it.
The mirror proxy drafts locally and shares finished outputs through the actor in the background.
One actor per model and suffix config: another of either gets its own.
"""

from __future__ import annotations

import os
import random
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from hvd_ray.drafters.base import DraftRequest  # noqa: E402
from hvd_ray.drafters.suffix import SuffixDrafter  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    import ray

    started = False
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()


def _streams(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) pairs over a small vocabulary with repeats, so the trees have matches."""
    rng = random.Random(seed)
    motifs = [[rng.randrange(20) for _ in range(rng.randrange(3, 9))] for _ in range(6)]
    out = []
    for _ in range(n):
        seq = [t for _ in range(12) for t in rng.choice(motifs)] + [rng.randrange(20) for _ in range(5)]
        out.append((seq[:20], seq[20:]))
    return out


def _run(drafter, streams, rid_prefix: str, steps: int = 3) -> list:
    """Decode every stream a few tokens at a time in lockstep (a batch), drafting each step."""
    drafts = []
    pos = {i: 0 for i in range(len(streams))}
    for i, (prompt, _) in enumerate(streams):
        drafter.begin(f"{rid_prefix}{i}", prompt, i)
    while pos:
        asks = [DraftRequest(f"{rid_prefix}{i}", i, [], 8) for i in pos]
        drafter.prepare(asks)
        for a, d in zip(asks, drafter.propose(asks)):
            drafts.append((a.req_id, d.token_ids, d.parents, [round(p, 9) for p in d.probs], d.match_len))
        for i in list(pos):
            out = streams[i][1]
            drafter.accept(f"{rid_prefix}{i}", out[pos[i] : pos[i] + steps])
            pos[i] += steps
            if pos[i] >= len(out):
                drafter.end(f"{rid_prefix}{i}")
                del pos[i]
    return drafts


def test_remote_drafts_equal_in_process_drafts(ray_local):
    from hvd_ray.serving.suffix_actor import RemoteSuffixDrafter, service_actor

    actor = service_actor("test-suffix-equal")
    try:
        remote, local = RemoteSuffixDrafter(actor), SuffixDrafter()
        streams = _streams(6, seed=1)
        got, want = _run(remote, streams, "r"), _run(local, streams, "r")
        assert got == want and any(t for _, t, *_ in want)  # identical, and really drafting
        steps = len({d[0] for d in want})
        assert remote.calls <= len(want) // steps * 2 + 2  # about one round trip per step, not per request
        remote.flush()
        stats = ray_local.get(actor.stats.remote())
        assert stats["requests"] == 0 and stats["cached_requests"] == 6  # finished outputs stay global

        # a second client (another replica) drafts from the first one's outputs
        other = RemoteSuffixDrafter(actor)
        prompt, output = streams[0]
        other.begin("x", output[:6], 0)
        d = other.speculate("x", 8)
        assert d.source == "suffix-global" and d.token_ids == output[6 : 6 + len(d)] and len(d) > 0
    finally:
        ray_local.kill(actor)


def _retrying(ray, call, timeout: float = 60.0):
    """A direct call from the test, retried while Ray reports the restarting actor unavailable."""
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(call(), timeout=timeout)
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_killed_actor_degrades_to_no_drafts_then_resyncs(ray_local):
    from hvd_ray.serving.suffix_actor import RemoteSuffixDrafter, service_actor

    actor = service_actor("test-suffix-kill")
    try:
        remote = RemoteSuffixDrafter(actor, timeout_s=5.0, retry_s=0.2)
        ((prompt, output),) = _streams(1, seed=2)
        remote.begin("a", prompt + output[:10], 0)
        first = ray_local.get(actor.stats.remote())["incarnation"]
        assert len(remote.speculate("a", 8)) > 0

        ray_local.kill(actor, no_restart=False)  # Ray restarts it (max_restarts=-1), empty
        remote.accept("a", output[10:12])
        remote.speculate("a", 8)  # may still reach the dying actor, or fail: never raises
        deadline = time.monotonic() + 60
        while _retrying(ray_local, lambda: actor.stats.remote())["incarnation"] == first:
            assert time.monotonic() < deadline, "Ray did not restart the actor"
            time.sleep(0.2)
        drafts = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            d = remote.speculate("a", 8)  # never raises: empty while down, real once resynced
            drafts.append(d)
            if len(d) and d.source != "suffix-unavailable":
                break
            time.sleep(0.2)
        assert drafts[-1].token_ids, "the proxy never recovered after the actor restarted"
        stats = _retrying(ray_local, lambda: actor.stats.remote())
        assert stats["incarnation"] != first
        assert _retrying(ray_local, lambda: actor.request_ids.remote(remote.client)) == [
            "a"
        ]  # the live request came back
        # and it holds the full context, so drafts equal a fresh in-process drafter's request-tree draft
        fresh = SuffixDrafter()
        fresh.begin("a", prompt + output[:12])
        assert remote.speculate("a", 8).token_ids == fresh.speculate("a", 8).token_ids
    finally:
        ray_local.kill(actor)


def _sync_until(drafter, done, timeout: float = 60.0) -> None:
    """Let a mirror's background calls land (the test waits; the engine never does)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, drafter.stats()
        drafter.sync(timeout=0.2, pull_now=True)


def test_mirror_drafts_locally_and_shares_outputs_through_the_actor(ray_local):
    """Mirror mode: drafts equal an in-process drafter's (they are one), a finished output reaches
    another replica's global tree through the actor, and only outputs (not prompts) are shared."""
    from hvd_ray.serving.suffix_actor import MirroredSuffixDrafter, service_actor

    actor = service_actor("test-suffix-mirror")
    try:
        a, b = MirroredSuffixDrafter(actor), MirroredSuffixDrafter(actor)
        streams = _streams(4, seed=3)
        assert _run(a, streams, "r") == _run(SuffixDrafter(), streams, "r")
        assert a.live_requests() == 0 and a.published == 4
        _sync_until(a, lambda: not a._publishing)
        assert a.failures == 0 and ray_local.get(actor.stats.remote())["published"] == 4

        _sync_until(b, lambda: b.received == 4)
        assert len(b.cached_requests) == 4 and b.global_tree.num_tokens == sum(len(o) for _, o in streams)
        prompt, output = streams[0]
        b.begin("x", output[:6], 0)
        d = b.speculate("x", 8)
        assert d.source == "suffix-global" and len(d) > 0 and d.token_ids == output[6 : 6 + len(d)]
        _sync_until(a, lambda: a._pulling is None and a._cursor == 4)
        assert a.received == 0  # a client never pulls its own outputs back
    finally:
        ray_local.kill(actor)


def test_mirror_keeps_drafting_while_the_actor_restarts(ray_local):
    """Killing the actor costs a mirror only the sharing: drafts go on from the local trees, the
    failed calls are counted, and publishing works again on the restarted actor."""
    from hvd_ray.serving.suffix_actor import MirroredSuffixDrafter, service_actor

    actor = service_actor("test-suffix-mirror-kill")
    try:
        m = MirroredSuffixDrafter(actor)
        ((prompt, output),) = _streams(1, seed=4)
        first = ray_local.get(actor.stats.remote())["incarnation"]
        ray_local.kill(actor, no_restart=False)
        m.begin("a", prompt + output[:10], 0)
        want = SuffixDrafter()
        want.begin("a", prompt + output[:10])
        assert m.speculate("a", 8).token_ids == want.speculate("a", 8).token_ids != []
        m.end("a")  # publishes to a dead or restarting actor: must not raise
        _sync_until(m, lambda: not m._publishing)
        deadline = time.monotonic() + 60
        while _retrying(ray_local, lambda: actor.stats.remote())["incarnation"] == first:
            assert time.monotonic() < deadline, "Ray did not restart the actor"
            time.sleep(0.2)
        m.begin("b", prompt, 0)
        m.accept("b", output[:5])
        m.end("b")
        _sync_until(m, lambda: not m._publishing)
        assert _retrying(ray_local, lambda: actor.stats.remote())["published"] >= 1  # sharing resumed
        assert m.live_requests() == 0
    finally:
        ray_local.kill(actor)


def test_one_actor_per_model_and_config(ray_local):
    """Replicas of one model and config share an actor; another model or config (a redeploy, or a
    second application on the cluster) gets its own, so no replica drafts from another model's
    token ids or with stale settings. Actors no client calls any more are found and killed."""
    from hvd_ray.serving.suffix_actor import actor_name, service_actor, service_actors, stale_actors

    base = "test-suffix-identity"
    conf = {"max_depth": 32}
    try:
        a = service_actor(base, config=conf, model="model-a")
        same = service_actor(base, config=dict(conf), model="model-a")
        other_model = service_actor(base, config=conf, model="model-b")
        other_config = service_actor(base, config={"max_depth": 16}, model="model-a")
        actors = (a, same, other_model, other_config)
        inc = [ray_local.get(x.stats.remote(), timeout=60)["incarnation"] for x in actors]
        assert inc[0] == inc[1] and len(set(inc)) == 3
        assert ray_local.get(other_model.identity.remote())["model"] == "model-b"
        assert ray_local.get(other_config.identity.remote())["config"]["max_depth"] == 16
        assert actor_name(base, "m", {}) == actor_name(base, "m", {"max_depth": 64}) != actor_name(base, "m", conf)
        ray_local.get(a.publish.remote("c", [1, 2, 3]))
        assert ray_local.get(same.stats.remote())["published"] == 1
        assert ray_local.get(other_model.stats.remote())["published"] == 0  # trees are not shared

        names = {
            n: actor_name(base, m, c)
            for n, m, c in (
                ("a", "model-a", conf),
                ("model", "model-b", conf),
                ("config", "model-a", {"max_depth": 16}),
            )
        }
        assert set(service_actors(base)) == set(names.values())
        time.sleep(1.0)
        ray_local.get(a.pull.remote("c", 0, None))  # a client still uses `a`
        assert sorted(stale_actors(base, idle_s=0.5)) == sorted([names["model"], names["config"]])
        stale_actors(base, idle_s=0.5, kill=True)
        deadline = time.monotonic() + 30
        while set(service_actors(base)) != {names["a"]}:
            assert time.monotonic() < deadline, service_actors(base)
            time.sleep(0.2)
        assert ray_local.get(a.stats.remote())["incarnation"] == inc[0]
    finally:
        for actor in service_actors(base).values():
            ray_local.kill(actor)


@pytest.mark.slow
def test_hvd_replica_drafts_through_the_actor_and_stays_greedy(ray_local, default_folder):
    """The serving default (drafter hvd: suffix actor + shipped EAGLE-3 head, cost policy) returns
    plain greedy text in fp32, having drafted from both sources through one replica."""
    import asyncio

    import torch
    from transformers import AutoTokenizer

    from hvd_ray.engine import Engine, SamplingParams
    from hvd_ray.model.transformer import Transformer
    from hvd_ray.serving.replica import ModelReplica

    tok = AutoTokenizer.from_pretrained(default_folder)
    prompts = [
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        'Call get_weather(city="Paris") and then get_weather(city="Rome"). Calls:',
    ]
    ids = [tok(p)["input_ids"] for p in prompts]
    ref = Engine(
        Transformer.from_pretrained(default_folder, dtype=torch.float32),
        max_batch=2,
        max_len=512,
        eos_token_ids=[tok.eos_token_id],
    )
    want = [tok.decode(r.output, skip_special_tokens=True) for r in ref.generate(ids, SamplingParams(max_tokens=40))]
    del ref

    config = {
        "model": "default",
        "dtype": "float32",
        "drafter": "hvd",
        "policy": "cost",
        "max_batch": 2,
        "max_model_len": 512,
        "max_tokens": 64,
        "torch_threads": 2,
        "suffix_actor_name": "test-hvd-replica",
        "suffix_actor_mode": "remote",
    }  # the HTTP tests (tests/test_serving.py) run the default, mirror
    replica = ModelReplica.func_or_class(config)
    try:

        async def one(prompt: str) -> tuple[str, dict]:
            text, last = "", None
            async for ev in replica.generate({"prompt": prompt, "params": {"max_tokens": 40, "temperature": 0.0}}):
                assert ev["type"] != "error", ev
                text += ev.get("text", "")
                last = ev
            return text, last

        async def both():
            return await asyncio.gather(*(one(p) for p in prompts))

        results = asyncio.run(both())
        assert [t for t, _ in results] == want
        stats = replica.stats()
        assert stats["drafters"]["suffix"]["calls"] > 0 and stats["drafters"]["suffix"]["failures"] == 0
        assert 0.0 < stats["cache_chosen_rate"] < 1.0 or stats["cache_chosen_rate"] == 1.0
        assert sum(ev["stats"]["drafted"] for _, ev in results) > 0
    finally:
        replica.loop.shutdown()
        from hvd_ray.serving.suffix_actor import service_actors

        for actor in service_actors("test-hvd-replica").values():
            ray_local.kill(actor)
