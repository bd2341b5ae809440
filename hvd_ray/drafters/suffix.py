"""SuffixDecoding-style cache drafter over the suffix trees of ``suffix_tree.py``.

``SuffixDrafter`` keeps one tree per active request (prompt + generated tokens) and one global tree
over the outputs of recent requests (live ones included, as they grow). Matching is free wherever a
sequence's active nodes already sit on the context's suffixes (always in the request tree; in the
global tree for the part of the context the live output covers); only suffixes that reach back
into the prompt are walked from the root. Match lengths are tried longest-first and skipped when a
score upper bound cannot beat the best so far, so a step evaluates a handful of candidates.

Ties go as in arctic-inference: the longer match wins, and the request tree beats the global one.
Deliberate differences: ties between equally frequent tokens go to the smaller id; a context
shorter than ``max_depth`` may match in full; an empty draft reports ``match_len`` 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from hvd_ray.drafters.base import Draft, Drafter, DraftRequest
from hvd_ray.drafters.suffix_tree import SpecParams, SuffixTree, materialize, search

__all__ = ["SuffixConfig", "SuffixTree", "SuffixDrafter"]


@dataclass
class SuffixConfig:
    """Drafter settings (SuffixDecoding paper / arctic-inference defaults)."""

    max_depth: int = 64
    max_spec_tokens: int = 64
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    use_tree_spec: bool = False
    max_cached_requests: int = 10000  # global tree size in requests; 0 disables it, < 0 unbounded
    global_live: bool = True  # add active outputs to the global tree as they grow


class SuffixDrafter(Drafter):
    """Parameter-free cache drafter: per-request tree + bounded global tree of past outputs."""

    name = "suffix"
    adaptive_length = True  # sizes its drafts by its match (the engine's cache budget)

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = c = config or SuffixConfig()
        self._params = SpecParams(
            c.max_spec_tokens, c.max_spec_factor, c.max_spec_offset, c.min_token_prob, c.use_tree_spec
        )
        self.global_tree = SuffixTree(c.max_depth)
        self._req: dict[Hashable, SuffixTree] = {}
        self._pending: dict[Hashable, list[int]] = {}  # outputs held back when not global_live
        self._cached: dict[Hashable, None] = {}  # ids in the global tree, oldest first

    # ----------------------------------------------------------- request lifecycle
    def begin(self, req_id: Hashable, prompt: Sequence[int], slot: int | None = None) -> None:
        """Build the request tree from the prompt (``slot``, the KV slot, is not needed here)."""
        if req_id in self._req:
            raise ValueError(f"request {req_id!r} is already active")
        t = SuffixTree(self.config.max_depth)
        t.extend(0, prompt)
        self._req[req_id] = t
        if self.config.global_live:
            self._cache(req_id)
        else:
            self._pending[req_id] = []

    def accept(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        self._req[req_id].extend(0, tokens)
        if not self.config.global_live:
            self._pending[req_id].extend(tokens)
        elif req_id in self._cached:  # (it may have been evicted while live)
            self.global_tree.extend(req_id, tokens)

    def end(self, req_id: Hashable) -> None:
        del self._req[req_id]
        pending = self._pending.pop(req_id, None)
        if pending is not None and self._cache(req_id):
            self.global_tree.extend(req_id, pending)

    def _cache(self, req_id: Hashable) -> bool:
        """Give ``req_id`` a (fresh) global-tree slot, evicting the oldest beyond the bound."""
        limit = self.config.max_cached_requests
        if limit == 0:
            return False
        if req_id in self._cached:
            self.evict(req_id)
        self._cached[req_id] = None
        self.global_tree.add_seq(req_id)
        while 0 < limit < len(self._cached):
            self.evict(next(iter(self._cached)))
        return True

    def add_to_global(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Put a finished output into the global tree (trace replay rebuilds it this way)."""
        if self._cache(req_id):
            self.global_tree.extend(req_id, tokens)

    def evict(self, req_id: Hashable) -> None:
        del self._cached[req_id]
        self.global_tree.remove(req_id)

    def is_live(self, req_id: Hashable) -> bool:
        return req_id in self._req

    def live_ids(self) -> list[Hashable]:
        return list(self._req)

    def live_requests(self) -> int:
        """Requests begun and not yet ended (serving checks that none leak)."""
        return len(self._req)

    @property
    def cached_requests(self) -> list[Hashable]:
        return list(self._cached)

    def context(self, req_id: Hashable) -> list[int]:
        return self._req[req_id].seq(0)

    # ----------------------------------------------------------- drafting
    def speculate(self, req_id: Hashable, max_tokens: int | None = None, offset: float | None = None) -> Draft:
        """The best draft for ``req_id`` from its own tree or the global one; ``offset`` overrides the
        config's ``max_spec_offset`` for this draft (HVD's cache arm drafts as plain suffix decoding)."""
        p = self._params
        if (max_tokens is not None and max_tokens < p.max_spec_tokens) or (offset is not None and offset != p.offset):
            c = self.config
            p = SpecParams(
                min(max_tokens, p.max_spec_tokens) if max_tokens is not None else p.max_spec_tokens,
                c.max_spec_factor,
                c.max_spec_offset if offset is None else offset,
                c.min_token_prob,
                c.use_tree_spec,
            )
        t = self._req[req_id]
        ctx = t.seq(0)
        if not ctx or p.max_spec_tokens <= 0:
            return Draft(source="suffix-request")
        hit = search(t, ctx, t.active(0), p, 0.0)
        g = self.global_tree
        if self._cached:
            ghit = search(
                g,
                ctx,
                g.active(req_id) if self.config.global_live else None,
                p,
                hit[0] if hit is not None else 0.0,
            )
            if ghit is not None:
                return materialize(ghit, p, "suffix-global")
        return materialize(hit, p, "suffix-request")

    def propose(self, reqs: Sequence[DraftRequest]) -> list[Draft]:
        """One :meth:`speculate` per request; the context is the drafter's own copy, not
        ``DraftRequest.tokens``."""
        return [self.speculate(r.req_id, r.max_tokens) for r in reqs]
