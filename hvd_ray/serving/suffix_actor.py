"""Suffix-tree drafting shared by every model replica through one CPU actor.

The actor (:class:`SuffixDrafterService`) holds the global history of past outputs, so what one
replica generated helps every other replica's drafts. A replica reaches it in one of two modes
(``ServingConfig.suffix_actor_mode``):

``mirror`` (the default): :class:`MirroredSuffixDrafter` drafts from local trees (its requests' trees
and a local copy of the global tree). Finished outputs are published to the actor and other
replicas' outputs pulled from it in the background (``.remote()`` calls polled with
``ray.wait(timeout=0)``), so a decoding step never blocks on the actor. If the actor dies, drafting
goes on from the local trees; publishing resumes once Ray restarts it.

``remote``: :class:`RemoteSuffixDrafter`; the actor owns the request trees too, and the replica asks
it for the whole batch's drafts once per step:

* one actor call per engine step for the whole batch: ``begin``/``accept``/``end`` are buffered
  locally and shipped with the step's draft requests (``prepare`` / ``propose``);
* the client keeps each live request's context (prompt + emitted tokens), so when the actor dies
  and Ray restarts it (empty), the client re-sends the live requests and carries on;
* while the actor is unreachable the client returns empty drafts and the request goes on with the
  model drafter (an HVD policy picks it when the cache has nothing) or plain decoding: drafts only
  change speed, never output, so no request fails. The global history is lost with the actor.

The actor's name carries a digest of what its trees are valid for (model, suffix config, history):
a redeploy with another model or config gets a new actor (and two applications of different models
on one cluster get one each) instead of silently drafting from the old one's token ids. Detached
actors outlive their application: :func:`stale_actors` finds (and kills) those no client calls any more.

In both modes ``wait_s`` / ``calls`` measure the time the replica's engine loop spends on the actor
(blocked, or submitting and polling calls), which benchmarks/http.md reports as a share of step time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Hashable, Sequence
from itertools import islice

import ray

from ..drafters.base import Draft, Drafter, DraftRequest
from ..drafters.suffix import SuffixConfig, SuffixDrafter

logger = logging.getLogger("ray.serve")

ACTOR_NAMESPACE = "hvd_ray"
DEFAULT_NAME = "hvd-suffix-drafter"
_UNKNOWN = None  # the service's reply for a request it does not know (it restarted since begin)


class SuffixDrafterService:
    """The actor body: a plain :class:`SuffixDrafter` keyed by ``(client, request id)``."""

    def __init__(self, config: dict | None = None, history: str | None = None, identity: dict | None = None) -> None:
        self.drafter = SuffixDrafter(SuffixConfig(**(config or {})))
        self._identity = identity or actor_identity(None, config, history)
        self.last_call = time.monotonic()  # of a client call (stats() does not count): stale_actors reads it
        if history:  # past outputs from a trace folder (ServingConfig.suffix_history)
            from ..traces.history import past_outputs, warm_global_tree

            warm_global_tree([self.drafter], past_outputs(history))
        self.incarnation = uuid.uuid4().hex  # changes when Ray restarts the actor
        # the shared history mirrors pull: (sequence number, publishing client, output tokens)
        self.log: deque[tuple[int, str, list[int]]] = deque(maxlen=max(1, self.drafter.config.max_cached_requests))
        self.published = 0

    def publish(self, client: str, tokens: list[int]) -> int:
        """A finished request's output, from a mirroring replica: into the history log, and into
        this actor's global tree (so ``remote``-mode clients draft from it too)."""
        self.last_call = time.monotonic()
        seq = self.published
        self.published += 1
        self.log.append((seq, client, list(tokens)))
        self.drafter.add_to_global(("published", seq), tokens)
        return seq

    def pull(self, client: str, cursor: int, incarnation: str | None) -> tuple[str, int, list[list[int]]]:
        """Outputs other clients published since ``cursor`` (from the start if this actor is not the
        incarnation the client last saw), and the cursor to ask from next time."""
        self.last_call = time.monotonic()
        if incarnation != self.incarnation:
            cursor = 0
        newer = islice(self.log, max(0, len(self.log) - (self.published - cursor)), None)  # seq >= cursor
        return self.incarnation, self.published, [t for _, c, t in newer if c != client]

    def step(self, client: str, ops: list[tuple], asks: list[tuple[str, int]]) -> tuple[str, list]:
        """Apply buffered ``ops`` (("begin", rid, tokens) | ("accept", rid, tokens) | ("end", rid)),
        then draft for ``asks`` ((rid, budget)). Unknown requests are skipped / answered ``None``."""
        self.last_call = time.monotonic()
        d = self.drafter
        for op in ops:
            key = (client, op[1])
            if op[0] == "begin":
                if d.is_live(key):
                    d.end(key)
                d.begin(key, op[2])
            elif not d.is_live(key):
                continue
            elif op[0] == "accept":
                d.accept(key, op[2])
            else:
                d.end(key)
        out = []
        for rid, budget in asks:
            key = (client, rid)
            if not d.is_live(key):
                out.append(_UNKNOWN)
                continue
            dr = d.speculate(key, budget)
            out.append((dr.token_ids, dr.parents, dr.probs, dr.score, dr.match_len, dr.source))
        return self.incarnation, out

    def resync(self, client: str, live: dict[str, list[int]]) -> str:
        """Forget ``client``'s requests and start its live ones again from their full context."""
        self.last_call = time.monotonic()
        d = self.drafter
        for key in [k for k in d.live_ids() if k[0] == client]:
            d.end(key)
        for rid, tokens in live.items():
            d.begin((client, rid), tokens)
        return self.incarnation

    def stats(self) -> dict:
        d = self.drafter
        return {
            "requests": d.live_requests(),
            "cached_requests": len(d.cached_requests),
            "global_tokens": d.global_tree.num_tokens,
            "published": self.published,
            "incarnation": self.incarnation,
            "idle_s": time.monotonic() - self.last_call,
        }

    def identity(self) -> dict:
        """What this actor's trees are valid for: ``{"model", "config", "history", "digest"}``."""
        return dict(self._identity)

    def request_ids(self, client: str) -> list[str]:
        return [k[1] for k in self.drafter.live_ids() if k[0] == client]


def actor_identity(model: str | None, config: dict | None, history: str | None) -> dict:
    """The model, the full suffix config (defaults filled in) and the history, with their digest."""
    ident = {"model": model, "config": dataclasses.asdict(SuffixConfig(**(config or {}))), "history": history}
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return ident | {"digest": hashlib.sha256(blob).hexdigest()[:12]}


def actor_name(name: str, model: str | None = None, config: dict | None = None, history: str | None = None) -> str:
    """The service actor's full name: ``name`` plus the digest of :func:`actor_identity`."""
    return f"{name}-{actor_identity(model, config, history)['digest']}"


def service_actor(
    name: str = DEFAULT_NAME,
    config: dict | None = None,
    num_cpus: float = 0.1,
    history: str | None = None,
    *,
    model: str | None = None,
):
    """The named, detached service actor for this model / config / history (created by the first
    replica, found by the others); another identity gets another actor (:func:`actor_name`).
    Ray restarts it whenever it dies; calls in flight then fail and the clients resync."""
    ident = actor_identity(model, config, history)
    cls = ray.remote(SuffixDrafterService)
    return cls.options(
        name=f"{name}-{ident['digest']}",
        namespace=ACTOR_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=num_cpus,
        max_restarts=-1,
        max_task_retries=0,
        max_concurrency=1,
    ).remote(config, history, ident)


def service_actors(name: str = DEFAULT_NAME) -> dict[str, ray.actor.ActorHandle]:
    """The live service actors created under base ``name`` (one per identity), by full name."""
    found = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        full = a["name"]
        digest = full[len(name) + 1 :]
        if (
            a["namespace"] == ACTOR_NAMESPACE
            and full.startswith(f"{name}-")
            and len(digest) == 12
            and all(c in "0123456789abcdef" for c in digest)
        ):
            try:
                found[full] = ray.get_actor(full, namespace=ACTOR_NAMESPACE)
            except ValueError:  # gone since the listing
                pass
    return found


def stale_actors(
    name: str = DEFAULT_NAME, idle_s: float = 3600.0, *, kill: bool = False, timeout_s: float = 10.0
) -> list[str]:
    """Full names of the service actors under ``name`` that no client has called for ``idle_s``
    (an old deployment's, or a deleted application's: detached, they outlive it); ``kill``: kill them.
    A mirroring replica calls its actor every ``pull_interval_s``; a ``remote``-mode replica only
    while it decodes, so pick ``idle_s`` above its longest idle spell."""
    stale = []
    for full, actor in service_actors(name).items():
        try:
            idle = ray.get(actor.stats.remote(), timeout=timeout_s)["idle_s"]
        except Exception:  # noqa: BLE001 - restarting or busy: not known to be stale
            continue
        if idle >= idle_s:
            stale.append(full)
            if kill:
                ray.kill(actor)
    return stale


class RemoteSuffixDrafter(Drafter):
    """The engine-side proxy of :class:`SuffixDrafterService` (see the module docstring)."""

    name = "suffix"
    adaptive_length = True  # drafts sized by match length, as the in-process SuffixDrafter

    def __init__(
        self,
        actor,
        *,
        timeout_s: float = 2.0,
        retry_s: float = 0.5,
        start_timeout_s: float = 120.0,
        config: SuffixConfig | None = None,
    ) -> None:
        self.actor = actor
        self.config = config  # the settings the actor drafts with, when known (policies read them)
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

    # ------------------------------------------------------------------ the Drafter hooks
    def begin(self, req_id: Hashable, prompt: Sequence[int], slot: int | None = None) -> None:
        self._ctx[req_id] = list(prompt)
        self._ops.append(("begin", req_id, list(prompt)))

    def accept(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        self._ctx[req_id].extend(tokens)
        self._ops.append(("accept", req_id, list(tokens)))

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
            self._ready.update(
                zip((r.req_id for r in missing), self._call([(r.req_id, r.max_tokens) for r in missing]))
            )
        return [self._ready.pop(r.req_id).truncated(r.max_tokens) for r in reqs]

    def speculate(self, req_id: Hashable, max_tokens: int | None = None, offset: float | None = None) -> Draft:
        # (``offset`` is the actor's own: the batch's drafts were fetched in one call by ``prepare``)
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
                self._incarnation = ray.get(self.actor.resync.remote(self.client, self._ctx), timeout=self.timeout_s)
                self._ops.clear()
                self._resync = False
            ops, self._ops = self._ops, []
            inc, replies = ray.get(self.actor.step.remote(self.client, ops, asks), timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - actor died / restarting / timed out: draft nothing
            self.failures += 1
            self._resync = True
            self._down_until = time.perf_counter() + self.retry_s
            logger.warning(
                "suffix drafter actor unavailable (%s); decoding goes on without cache drafts", type(e).__name__
            )
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

    def live_requests(self) -> int:
        return len(self._ctx)

    def stats(self) -> dict:
        return {
            "mode": "remote",
            "calls": self.calls,
            "wait_s": self.wait_s,
            "failures": self.failures,
            "live_requests": len(self._ctx),
        }


class MirroredSuffixDrafter(SuffixDrafter):
    """A local :class:`SuffixDrafter` whose global tree also holds the other replicas' outputs,
    exchanged with the actor in the background (see the module docstring)."""

    def __init__(self, actor, config: SuffixConfig | None = None, *, pull_interval_s: float = 1.0) -> None:
        super().__init__(config)
        self.actor = actor
        self.client = uuid.uuid4().hex[:12]
        self.pull_interval_s = pull_interval_s
        self._prompt_len: dict[Hashable, int] = {}
        self._publishing: list = []  # refs of publish calls not yet seen to complete
        self._pulling = None  # the pull call in flight, if any
        self._last_pull = -float("inf")
        self._cursor, self._incarnation = 0, None
        self._pulled = 0  # key counter for pulled outputs in the local global tree
        self.calls = self.failures = self.published = self.received = 0
        self.wait_s = 0.0

    def begin(self, req_id: Hashable, prompt: Sequence[int], slot: int | None = None) -> None:
        super().begin(req_id, prompt, slot)
        self._prompt_len[req_id] = len(prompt)

    def end(self, req_id: Hashable) -> None:
        output = self.context(req_id)[self._prompt_len.pop(req_id) :]
        super().end(req_id)
        if output:
            t0 = time.perf_counter()
            self._publishing.append(self.actor.publish.remote(self.client, output))
            self.calls += 1
            self.published += 1
            self.wait_s += time.perf_counter() - t0

    def prepare(self, reqs: Sequence[DraftRequest]) -> None:
        """Once per engine step: fold in what the background calls brought, never waiting for them."""
        self.sync()

    def flush(self) -> None:
        """The engine loop is idle: keep the mirror fresh all the same."""
        self.sync()

    def sync(self, timeout: float = 0.0, pull_now: bool = False) -> None:
        """Reap finished publish calls, fold a finished pull into the local global tree, and start
        the next pull when one is due (tests: ``timeout`` > 0 waits that long for the pull,
        ``pull_now`` starts one regardless of the interval)."""
        t0 = time.perf_counter()
        if self._publishing:
            done, self._publishing = ray.wait(self._publishing, num_returns=len(self._publishing), timeout=0)
            for ref in done:
                try:
                    ray.get(ref, timeout=0)  # done: never waits
                except Exception as e:  # noqa: BLE001 - the actor died: that output is not shared
                    self._failed("publish", e)
        if self._pulling is not None:
            done, _ = ray.wait([self._pulling], timeout=timeout)
            if done:
                try:
                    inc, cursor, outputs = ray.get(self._pulling, timeout=0)  # done: never waits
                except Exception as e:  # noqa: BLE001 - the actor died: pull again later
                    self._failed("pull", e)
                else:
                    self._incarnation, self._cursor = inc, cursor
                    for tokens in outputs:
                        self._pulled += 1
                        self.add_to_global(("pulled", self._pulled), tokens)
                    self.received += len(outputs)
                self._pulling = None
        elif pull_now or t0 - self._last_pull >= self.pull_interval_s:
            self._last_pull = t0
            self._pulling = self.actor.pull.remote(self.client, self._cursor, self._incarnation)
            self.calls += 1
        self.wait_s += time.perf_counter() - t0

    def _failed(self, what: str, e: Exception) -> None:
        self.failures += 1
        logger.warning(
            "suffix drafter actor unavailable for %s (%s); drafting goes on from the local trees",
            what,
            type(e).__name__,
        )

    def stats(self) -> dict:
        return {
            "mode": "mirror",
            "calls": self.calls,
            "wait_s": self.wait_s,
            "failures": self.failures,
            "live_requests": self.live_requests(),
            "published": self.published,
            "received": self.received,
            "cached_requests": len(self.cached_requests),
        }
