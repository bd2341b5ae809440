"""Suffix-tree drafting in a separate CPU actor, shared by every model replica.

The actor (:class:`SuffixDrafterService`) owns the request trees of all live requests and the global
tree of past outputs, so what one replica generated helps every other replica's drafts. A replica
talks to it through :class:`RemoteSuffixDrafter`, which speaks the engine's ``Drafter`` protocol:

* one actor call per engine step for the whole batch: ``begin``/``accept``/``end`` are buffered
  locally and shipped with the step's draft requests (``prepare`` / ``propose``);
* the client keeps each live request's context (prompt + emitted tokens), so when the actor dies
  and Ray restarts it (empty), the client re-sends the live requests and carries on;
* while the actor is unreachable the client returns empty drafts and the request goes on with the
  model drafter (an HVD policy picks it when the cache has nothing) or plain decoding: drafts only
  change speed, never output, so no request fails. The global history is lost with the actor.

``wait_s`` / ``calls`` measure the time the replica spends blocked on the actor (benchmarks/http.md).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Hashable, Sequence

import ray

from ..drafters.base import Draft, DraftRequest
from ..drafters.suffix import SuffixConfig, SuffixDrafter

logger = logging.getLogger("ray.serve")

ACTOR_NAMESPACE = "hvd_ray"
_UNKNOWN = None  # the service's reply for a request it does not know (it restarted since begin)


class SuffixDrafterService:
    """The actor body: a plain :class:`SuffixDrafter` keyed by ``(client, request id)``."""

    def __init__(self, config: dict | None = None) -> None:
        self.drafter = SuffixDrafter(SuffixConfig(**(config or {})))
        self.incarnation = uuid.uuid4().hex  # changes when Ray restarts the actor

    def step(self, client: str, ops: list[tuple], asks: list[tuple[str, int]]) -> tuple[str, list]:
        """Apply buffered ``ops`` (("begin", rid, tokens) | ("accept", rid, tokens) | ("end", rid)),
        then draft for ``asks`` ((rid, budget)). Unknown requests are skipped / answered ``None``."""
        d = self.drafter
        for op in ops:
            key = (client, op[1])
            if op[0] == "begin":
                if key in d._req:
                    d.end(key)
                d.begin(key, op[2])
            elif key not in d._req:
                continue
            elif op[0] == "accept":
                d.accept(key, op[2])
            else:
                d.end(key)
        out = []
        for rid, budget in asks:
            key = (client, rid)
            if key not in d._req:
                out.append(_UNKNOWN)
                continue
            dr = d.speculate(key, budget)
            out.append((dr.token_ids, dr.parents, dr.probs, dr.score, dr.match_len, dr.source))
        return self.incarnation, out

    def resync(self, client: str, live: dict[str, list[int]]) -> str:
        """Forget ``client``'s requests and start its live ones again from their full context."""
        d = self.drafter
        for key in [k for k in d._req if k[0] == client]:
            d.end(key)
        for rid, tokens in live.items():
            d.begin((client, rid), tokens)
        return self.incarnation

    def stats(self) -> dict:
        d = self.drafter
        return {"requests": len(d._req), "cached_requests": len(d.cached_requests),
                "global_tokens": d.global_tree.num_tokens, "incarnation": self.incarnation}

    def request_ids(self, client: str) -> list[str]:
        return [k[1] for k in self.drafter._req if k[0] == client]


def service_actor(name: str = "hvd-suffix-drafter", config: dict | None = None, num_cpus: float = 0.1):
    """The named, detached service actor (created by the first replica, found by the others).
    Ray restarts it whenever it dies; calls in flight then fail and the clients resync."""
    cls = ray.remote(SuffixDrafterService)
    return cls.options(name=name, namespace=ACTOR_NAMESPACE, get_if_exists=True, lifetime="detached",
                       num_cpus=num_cpus, max_restarts=-1, max_task_retries=0,
                       max_concurrency=1).remote(config)


class RemoteSuffixDrafter:
    """The engine-side proxy of :class:`SuffixDrafterService` (see the module docstring)."""

    name = "suffix"
    needs_taps: tuple[int, ...] = ()

    def __init__(self, actor, *, timeout_s: float = 2.0, retry_s: float = 0.5,
                 start_timeout_s: float = 120.0) -> None:
        self.actor = actor
        self.client = uuid.uuid4().hex[:12]
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self._ctx: dict[Hashable, list[int]] = {}  # live request -> prompt + emitted tokens
        self._ops: list[tuple] = []
        self._ready: dict[Hashable, Draft] = {}  # drafts fetched by prepare() for this step
        self._incarnation: str | None = None
        self._down_until = 0.0  # while unreachable: no calls before this time
        self._resync = False
        self.calls = 0
        self.wait_s = 0.0
        self.failures = 0
        try:  # wait for the actor to be up (the first replica creates it: a process start)
            self._incarnation = ray.get(actor.stats.remote(), timeout=start_timeout_s)["incarnation"]
        except Exception as e:  # noqa: BLE001 - serve anyway; calls retry and resync when it appears
            logger.warning("suffix drafter actor not ready after %.0f s (%s)", start_timeout_s, type(e).__name__)
            self._resync = True

    # ------------------------------------------------------------------ the Drafter protocol
    def begin(self, req_id: Hashable, prompt: Sequence[int], slot: int | None = None) -> None:
        self._ctx[req_id] = list(prompt)
        self._ops.append(("begin", req_id, list(prompt)))

    def accept(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        self._ctx[req_id].extend(tokens)
        self._ops.append(("accept", req_id, list(tokens)))

    def observe_target(self, req_id: Hashable, next_tokens: Sequence[int], taps) -> None:
        """No-op: suffix drafting never reads hidden states."""

    def end(self, req_id: Hashable) -> None:
        self._ctx.pop(req_id, None)
        self._ready.pop(req_id, None)
        self._ops.append(("end", req_id))

    def prepare(self, reqs: Sequence[DraftRequest]) -> None:
        """Fetch this step's drafts for the whole batch in one call (the engine calls this first;
        ``speculate`` then answers from them, so a selection policy costs no extra round trips)."""
        self._ready = dict(zip((r.req_id for r in reqs), self._call([(r.req_id, r.max_tokens) for r in reqs])))

    def propose(self, reqs: Sequence[DraftRequest]) -> list[Draft]:
        missing = [r for r in reqs if r.req_id not in self._ready]
        if missing:
            self._ready.update(zip((r.req_id for r in missing),
                                   self._call([(r.req_id, r.max_tokens) for r in missing])))
        return [self._ready.pop(r.req_id).truncated(r.max_tokens) for r in reqs]

    def speculate(self, req_id: Hashable, max_tokens: int | None = None) -> Draft:
        d = self._ready.pop(req_id, None)
        if d is None:
            d = self._call([(req_id, max_tokens if max_tokens is not None else 64)])[0]
        return d if max_tokens is None else d.truncated(max_tokens)

    def flush(self) -> None:
        """Ship buffered updates now (the engine loop calls this when it goes idle, so the actor
        drops finished requests without waiting for the next step)."""
        if self._ops:
            self._call([])

    # ------------------------------------------------------------------ the actor round trip
    def _call(self, asks: list[tuple[Hashable, int]], retry: bool = True) -> list[Draft]:
        empty = [Draft(source="suffix-unavailable") for _ in asks]
        now = time.perf_counter()
        if now < self._down_until:
            self._ops.clear()  # the next successful call resyncs from the contexts instead
            return empty
        t0 = now
        try:
            if self._resync:
                self._incarnation = ray.get(self.actor.resync.remote(self.client, self._ctx),
                                            timeout=self.timeout_s)
                self._ops.clear()
                self._resync = False
            ops, self._ops = self._ops, []
            inc, replies = ray.get(self.actor.step.remote(self.client, ops, asks), timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - actor died / restarting / timed out: draft nothing
            self.failures += 1
            self._resync = True
            self._down_until = time.perf_counter() + self.retry_s
            logger.warning("suffix drafter actor unavailable (%s); decoding goes on without cache drafts",
                           type(e).__name__)
            return empty
        finally:
            self.calls += 1
            self.wait_s += time.perf_counter() - t0
        if (self._incarnation is not None and inc != self._incarnation) or _UNKNOWN in replies:
            # the actor restarted and its trees are gone: resync, then ask once more
            self._incarnation, self._resync = None, True
            return self._call(asks, retry=False) if retry else empty
        self._incarnation = inc
        return [Draft(list(r[0]), list(r[1]), list(r[2]), r[3], r[4], r[5]) for r in replies]

    def stats(self) -> dict:
        return {"calls": self.calls, "wait_s": self.wait_s, "failures": self.failures,
                "live_requests": len(self._ctx)}
