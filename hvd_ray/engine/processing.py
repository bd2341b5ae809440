"""What a request's sampling parameters do to the target's logits, at every position a step verifies.

Speculative decoding is exact only if each verified position is judged by the distribution plain
decoding would sample there. Penalties, ``min_tokens`` and a grammar depend on the tokens before
the position, and in a draft tree those differ per node: node i's context is the output so far plus
the draft tokens on the path to i. :meth:`Processing.apply` processes all the rows of one request's
verify forward at once, each with its own path, so the greedy walk and rejection sampling see the
processed distribution at every node (``min_p``, which needs the temperature, is applied in
``verification.target_probs``). vLLM's order: grammar mask, ``logit_bias``, ``min_tokens``, then
repetition, frequency and presence penalties.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..drafters.base import Draft
from ..verification.tree import tree_depths
from .grammar import Constraint, apply_mask
from .request import SamplingParams


class Processing:
    """One request's logits processing: its parameters, its grammar state and its token counts."""

    def __init__(
        self,
        params: SamplingParams,
        prompt: Sequence[int],
        vocab_size: int,
        stop_ids: Iterable[int],
        constraint: Constraint | None,
    ):
        self.params, self.constraint, self.vocab = params, constraint, vocab_size
        p = params
        self.stops = torch.tensor(sorted(set(stop_ids) | set(p.stop_token_ids)), dtype=torch.long)
        self.bias = None
        if p.logit_bias:
            self.bias = torch.zeros(vocab_size)
            for t, b in p.logit_bias.items():
                if 0 <= t < vocab_size:
                    self.bias[t] = b
        self.counting = bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)
        self.counts = torch.zeros(vocab_size) if self.counting else None  # each token's count in the output
        self.in_prompt = None
        if p.repetition_penalty != 1.0:
            self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
            self.in_prompt[torch.tensor(list(prompt), dtype=torch.long)] = True
        self.emitted = 0
        self.bits: torch.Tensor | None = None  # this step's grammar masks (``prepare``)

    def prepare(self, draft: Draft, room: int = 0) -> Draft:
        """This step's draft, continued by what the grammar forces (up to ``room`` tokens in all),
        less what the grammar refuses; keeps the rows' grammar masks for :meth:`apply`."""
        self.bits = None
        if self.constraint is not None:
            draft, self.bits = self.constraint.prune(self.constraint.extend(draft, room))
        return draft

    def apply(self, logits: torch.Tensor, draft: Draft) -> torch.Tensor:
        """The processed float32 logits ``[len(draft) + 1, V]`` of one request's verified rows (row 0
        after the context, row i+1 after draft node i) for the draft :meth:`prepare` returned."""
        x = logits.float().clone()
        p, n = self.params, len(draft)
        if self.bits is not None:
            apply_mask(x, self.bits)
        if self.bias is not None:
            x += self.bias.to(x.device)
        if p.min_tokens:  # row j predicts output token ``emitted + depth(j)`` (the root's depth is 0)
            early = [j for j, d in enumerate(tree_depths(draft.parents)) if self.emitted + d < p.min_tokens]
            if early and len(self.stops):
                rows = torch.tensor(early, dtype=torch.long)
                x[rows[:, None], self.stops[None].to(x.device)] = float("-inf")
        if self.counting:
            counts = self.counts.to(x.device).expand(n + 1, -1).clone()
            if n:  # each row also counts the draft tokens on its path (ancestors of node j-1, and itself)
                rows, toks = [], []
                for i in range(n):
                    a = i
                    while a >= 0:
                        rows.append(i + 1)
                        toks.append(draft.token_ids[a])
                        a = draft.parents[a]
                counts.index_put_(
                    (torch.tensor(rows, device=x.device), torch.tensor(toks, device=x.device)),
                    torch.ones(len(rows), device=x.device),
                    accumulate=True,
                )
            if p.repetition_penalty != 1.0:
                seen = (counts > 0) | self.in_prompt.to(x.device)
                r = p.repetition_penalty
                x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
            if p.frequency_penalty:
                x -= p.frequency_penalty * counts
            if p.presence_penalty:
                x -= p.presence_penalty * (counts > 0).float()
        return x

    def advance(self, tokens: Sequence[int]) -> None:
        """The step's emitted tokens join the context of every later position."""
        if self.constraint is not None:
            self.constraint.advance(tokens)
        if self.counts is not None and tokens:
            self.counts.index_add_(0, torch.tensor(list(tokens), dtype=torch.long), torch.ones(len(tokens)))
        self.emitted += len(tokens)


def token_logprobs(
    logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], top: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """(log-probability of ``tokens[k]`` under row ``rows[k]``, the row's ``top`` most likely
    (token, log-probability)) per token, from the raw logits (before any processing, as vLLM's
    default)."""
    lp = logits[list(rows)].float().log_softmax(-1)
    chosen = lp[torch.arange(len(rows)), torch.tensor(list(tokens), dtype=torch.long)].tolist()
    if top:
        vals, idx = lp.topk(top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in rows]
    return list(zip(chosen, tops))
