"""The one interface every draft source speaks.

A draft is a tree of candidate tokens hanging off the last token of the context. A chain is the
special case ``parents == [-1, 0, 1, ...]``. Parents always come before their children, so the
verifier can lay the draft out in the order given.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Draft:
    """Candidate tokens proposed for one request at one step.

    ``parents[i]`` is the index of token i's parent in ``token_ids``, or -1 when it hangs off the
    last context token. ``probs[i]`` is the drafter's own probability for token i (the suffix tree's
    path probability, a model's softmax probability). ``dists`` holds full draft distributions for
    chain drafts that were *sampled* from a model, which rejection sampling needs; deterministic
    drafts (greedy, top-k, suffix tree) leave it ``None``. ``setup_s``: seconds the drafter spent on
    this request alone before drafting (EAGLE-3 catching up on the tokens since it last drafted): the
    engine charges them to this request, not to the others in the same batched ``propose``.
    """

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: str = ""
    dists: torch.Tensor | None = None
    setup_s: float = field(default=0.0, compare=False)  # a timing, not part of what was drafted
    marks: list[bool] | None = None  # a union's nodes that lie on its second draft (``union``)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: Sequence[float] | None = None, **kw) -> Draft:
        tokens = list(tokens)
        probs = list(probs) if probs is not None else [1.0] * len(tokens)
        return cls(tokens, list(range(-1, len(tokens) - 1)), probs, **kw)

    def truncated(self, n: int) -> Draft:
        """The first ``n`` tokens (a prefix in tree order is still a valid tree)."""
        dists = self.dists[:n] if self.dists is not None else None
        return Draft(
            self.token_ids[:n],
            self.parents[:n],
            self.probs[:n],
            self.score,
            self.match_len,
            self.source,
            dists,
            self.setup_s,
            self.marks[:n] if self.marks is not None else None,
        )

    def kept(self, nodes: Sequence[int]) -> Draft:
        """The draft with only ``nodes`` (ascending, each with its parent), e.g. less the subtrees a
        grammar refuses."""
        new = {old: i for i, old in enumerate(nodes)}
        return Draft(
            [self.token_ids[i] for i in nodes],
            [new[self.parents[i]] if self.parents[i] >= 0 else -1 for i in nodes],
            [self.probs[i] for i in nodes] if self.probs else [],
            self.score,
            self.match_len,
            self.source,
            self.dists[list(nodes)] if self.dists is not None else None,
            self.setup_s,
            [self.marks[i] for i in nodes] if self.marks is not None else None,
        )

    @classmethod
    def union(cls, first: Draft, second: Draft, source: str = "union") -> Draft:
        """Both drafts as one tree (a trie: a path the two share is one path), so one forward
        verifies both for the tokens they differ in. ``marks[i]``: node i lies on ``second``. Drafts
        sampled from a model (``dists``) cannot join: their rejection test needs a chain."""
        if first.dists is not None or second.dists is not None:
            raise ValueError("a sampled draft (with dists) cannot join a union tree")
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        node: dict[tuple[int, int], int] = {}  # (parent, token) -> index in the union
        marks: list[bool] = []
        for part, mark in ((first, False), (second, True)):
            where: list[int] = []  # the part's node i -> its index in the union
            for tok, par, p in zip(part.token_ids, part.parents, part.probs or [0.0] * len(part)):
                key = (where[par] if par >= 0 else -1, tok)
                i = node.get(key)
                if i is None:
                    i = node[key] = len(tokens)
                    tokens.append(tok)
                    parents.append(key[0])
                    probs.append(p)
                    marks.append(mark)
                else:
                    probs[i] = max(probs[i], p)
                    marks[i] = marks[i] or mark
                where.append(i)
        return cls(
            tokens, parents, probs, first.score, first.match_len, source, None, first.setup_s + second.setup_s, marks
        )


@dataclass
class DraftRequest:
    """What a drafter is told about one request when asked to draft for it."""

    req_id: str
    slot: int  # the request's slot in the target's KV cache
    tokens: list[int]  # prompt + generated so far; the last one is not yet in the target's cache
    max_tokens: int  # draft budget for this step


class Drafter(abc.ABC):
    """What the decoding loop needs from a draft source; every drafter subclasses it.

    ``begin`` sees the prompt, ``accept`` every token emitted after it (drafters with per-request
    state stay in sync), ``end`` releases it. ``propose`` drafts for the whole batch at once so model
    drafters can batch their forwards. Drafters that read the target's hidden states (EAGLE-3) name
    the layers in ``needs_taps``; the engine then calls ``observe_target(req_id, next_tokens, taps)``
    after every target forward with ``taps[i]`` (the fused residual streams at one committed
    position) paired with ``next_tokens[i]`` (the token that follows that position).

    Only ``propose`` is required: the other hooks default to doing nothing, so a drafter without
    per-request state, hidden-state taps or a remote side overrides only what it uses and callers
    call every hook unconditionally.
    """

    name: str
    needs_taps: tuple[int, ...] = ()  # target layers whose residual streams observe_target receives
    adaptive_length: bool = False  # sizes its own drafts (a cache drafter): the engine's cache budget

    def begin(self, req_id: str, prompt: Sequence[int], slot: int) -> None:
        """A request starts in KV slot ``slot`` with ``prompt``."""

    def reuse_prefix(self, req_id: str, n: int) -> None:
        """Called after ``begin`` when the target's K/V of the prompt's first ``n`` tokens was left in
        the slot by an earlier request (prefix reuse): the prefill, and so ``observe_target``,
        starts at position ``n``."""

    def accept(self, req_id: str, tokens: Sequence[int]) -> None:
        """``tokens`` were emitted for the request (after verification)."""

    def observe_target(self, req_id: str, next_tokens: Sequence[int], taps: torch.Tensor) -> None:
        """The target's taps at committed positions (only called when ``needs_taps`` is set)."""

    def end(self, req_id: str) -> None:
        """The request is over: release whatever the drafter keeps for it."""

    def prepare(self, reqs: Sequence[DraftRequest]) -> None:
        """Once per engine step, before any ``propose``, with the whole batch (a remote drafter
        fetches every draft in one round trip)."""

    @abc.abstractmethod
    def propose(self, reqs: Sequence[DraftRequest]) -> list[Draft]:
        """One draft per request, in order, each at most ``max_tokens`` long."""

    def flush(self) -> None:
        """The engine loop is idle: finish background work (e.g. sync with a shared actor)."""

    def live_requests(self) -> int:
        """Requests begun and not yet ended (serving checks that none leak); 0 when none are kept."""
        return 0

    def stats(self) -> dict:
        """Drafter-specific figures for the replica's stats endpoint."""
        return {}
