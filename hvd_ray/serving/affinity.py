"""Conversation affinity: a Serve request router that sends a request to the replica that served the
longest prefix of it, so an agent's next turn lands where its K/V (prefix reuse) and its output's
suffix tree already are, instead of being prefilled whole on a replica picked at random.

Requests are keyed by their text as the ingress hands it to the replicas (the chat messages, tools
and template arguments, or the completion prompt), cut into blocks of ``block_chars`` characters
hashed as a chain, so two requests share a block key exactly when they share everything up to the
block's end. Each block key remembers the replicas that were sent a request holding it (bounded,
least recently used first out). A request goes first to the replicas holding its longest prefix,
unless every candidate holds it (no preference) or the preferred ones' queues are ``imbalance``
requests longer than the shortest (load comes first); then power of two choices as Serve's default.
Ray Serve LLM's ``PrefixCacheAffinityRouter`` does the same for vLLM replicas (it cannot be imported
without vLLM); this one needs no actor: its table lives in the router (one per ingress replica).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica


def request_text(payload: dict[str, Any]) -> str:
    """The part of a replica payload that decides its prompt, as one string whose prefixes are the
    payloads' shared prefixes (a conversation's next turn extends its previous turn's string)."""
    head = json.dumps(
        [payload.get("tools"), payload.get("tool_choice"), payload.get("template_kwargs")],
        sort_keys=True,
        separators=(",", ":"),
    )
    if "messages" in payload:
        body = "".join(
            json.dumps(m, sort_keys=True, separators=(",", ":"), default=str) + "\x1e" for m in payload["messages"]
        )
    elif "prompt_token_ids" in payload:
        body = "".join(f"{t} " for t in payload["prompt_token_ids"])
    else:
        body = str(payload.get("prompt", ""))
    return head + "\x1d" + body


def block_keys(text: str, block_chars: int) -> list[bytes]:
    """Chained hashes of ``text``'s whole blocks: key ``i`` identifies ``text[: (i + 1) * block_chars]``."""
    keys, h = [], b""
    for i in range(len(text) // block_chars):
        h = hashlib.blake2b(h + text[i * block_chars : (i + 1) * block_chars].encode(), digest_size=16).digest()
        keys.append(h)
    return keys


class PrefixAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's power-of-two-choices router, preferring the replicas that hold a request's longest prefix."""

    def initialize_state(self, block_chars: int = 64, imbalance: int = 1, max_keys: int = 200_000) -> None:
        self.block_chars, self.imbalance, self.max_keys = block_chars, imbalance, max_keys
        self.holders: OrderedDict[bytes, set[ReplicaID]] = OrderedDict()
        self.preferred_routes = 0  # requests whose first choice was a replica holding their prefix

    def _keys(self, pending_request: PendingRequest | None) -> list[bytes]:
        if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], dict):
            return []
        return block_keys(request_text(pending_request.args[0]), self.block_chars)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        fallback = await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        for key in reversed(self._keys(pending_request)):  # the longest prefix some candidate holds
            held = [by_id[i] for i in self.holders.get(key, ()) if i in by_id]
            if held:
                break
        else:
            return fallback
        if len(held) == len(by_id):  # every replica holds it: no preference
            return fallback
        lens = {r.replica_id: n for r, n in await self._probe_queue_lens(candidate_replicas, 0) if n is not None}
        if lens and min(lens.get(r.replica_id, 0) for r in held) - min(lens.values()) > self.imbalance:
            return fallback
        self.preferred_routes += 1
        return [held, *fallback]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        for key in self._keys(pending_request):
            self.holders.setdefault(key, set()).add(replica_id)
            self.holders.move_to_end(key)
        while len(self.holders) > self.max_keys:
            self.holders.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for held in self.holders.values():
            held.discard(replica_id)
