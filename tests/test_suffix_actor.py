"""The shared suffix-drafter actor behind its engine-side proxy, on a real local Ray.

The proxy must draft exactly what an in-process ``SuffixDrafter`` drafts on the same token streams
(one round trip per step), share the global tree between clients (replicas), and survive the actor
being killed: empty drafts while it is down, then a resync of the live requests once Ray restarts it.
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
        if hasattr(drafter, "prepare"):
            drafter.prepare(asks)
        for a, d in zip(asks, drafter.propose(asks)):
            drafts.append((a.req_id, d.token_ids, d.parents, [round(p, 9) for p in d.probs], d.match_len))
        for i in list(pos):
            out = streams[i][1]
            drafter.accept(f"{rid_prefix}{i}", out[pos[i]:pos[i] + steps])
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
        assert d.source == "suffix-global" and d.token_ids == output[6:6 + len(d)] and len(d) > 0
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
        (prompt, output), = _streams(1, seed=2)
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
        assert _retrying(ray_local, lambda: actor.request_ids.remote(remote.client)) == ["a"]  # the live request came back
        # and it holds the full context, so drafts equal a fresh in-process drafter's request-tree draft
        fresh = SuffixDrafter()
        fresh.begin("a", prompt + output[:12])
        assert remote.speculate("a", 8).token_ids == fresh.speculate("a", 8).token_ids
    finally:
        ray_local.kill(actor)
