"""Verification of one step's rows against the target's logits: each request's accepted draft path
and next token (greedy walk, its grammar and penalties per node, seeded Gumbel draws or rejection
sampling), the batch's greedy walk on the device, and a new request's first token."""

from __future__ import annotations

import torch

from ..drafters.base import Draft
from ..verification import greedy_walk, rejection_sample_chain, rejection_sample_tree, target_probs
from ..verification.sampling import gumbel_scores, sample
from ..verification.tree import tree_depths
from .request import Request


def first_tokens(reqs: list[Request], logits: torch.Tensor) -> list[int]:
    """Each new request's first output token from its prompt's last logits row (``logits[b]``)."""
    if all(r.params.greedy and r.processing is None for r in reqs):
        return logits.argmax(-1).tolist()
    toks = []
    for b, r in enumerate(reqs):
        p, row = r.params, logits[b : b + 1]
        if r.processing is not None:
            row = r.processing.apply(row, r.processing.prepare(Draft()))
        if p.greedy:
            toks.append(int(row[0].argmax()))
            continue
        probs = target_probs(row[0], p.temperature, p.top_k, p.top_p, p.min_p)
        if p.seed is not None:  # position 0's Gumbel draw (``verify_row``)
            toks.append(int(gumbel_scores(probs[None], p.seed, [0]).argmax()))
        else:
            toks.append(int(sample(probs, r.generator)))
    return toks


def verify_row(req: Request, d: Draft, logits: torch.Tensor, walk, best) -> tuple[list[int], int]:
    """The accepted draft path and the next token of one request from its rows of the forward
    (``walk``: its device greedy walk, ``best``: its argmax row, when the batch computed them)."""
    p = req.params
    if req.processing is not None:  # each node's own processed distribution (engine/processing.py)
        logits = req.processing.apply(logits, d)
        if p.greedy:
            return greedy_walk(logits.argmax(-1).tolist(), d.token_ids, d.parents)
    elif p.greedy:
        return walk if walk is not None else greedy_walk(best, d.token_ids, d.parents)
    probs = target_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)
    if p.seed is not None:  # reproducible: each output position's draw is keyed by (seed, position)
        at = [len(req.output) + depth for depth in tree_depths(d.parents)]
        return greedy_walk(gumbel_scores(probs, p.seed, at).argmax(-1).tolist(), d.token_ids, d.parents)
    if probs.is_cuda and d.is_chain:  # kernels/rejection.py: one pass, one host sync
        n_acc, nxt = rejection_sample_chain(probs, d.token_ids, None, req.generator)
        return list(range(n_acc)), nxt
    return rejection_sample_tree(probs, d.token_ids, d.parents, req.generator)


def device_walks(logits: torch.Tensor, drafts: list[Draft]) -> list[tuple[list[int], int]]:
    """Greedy verification of the whole batch on the logits' device with ``hvd_ray.kernels.verify_tree``
    (Triton on CUDA, its torch reference elsewhere): ``(accepted path, bonus token)`` per draft,
    what ``greedy_walk`` returns, without materialising the argmax of every row."""
    from ..kernels import verify_tree

    B, N = logits.shape[0], logits.shape[1] - 1
    toks = torch.zeros(B, N, dtype=torch.long)
    pars = torch.full((B, N), -1, dtype=torch.long)
    for b, d in enumerate(drafts):
        toks[b, : len(d)] = torch.tensor(d.token_ids, dtype=torch.long)
        pars[b, : len(d)] = torch.tensor(d.parents, dtype=torch.long)
    path, plen, bonus = verify_tree(logits, toks.to(logits.device), pars.to(logits.device), [len(d) for d in drafts])
    path, plen, bonus = path.tolist(), plen.tolist(), bonus.tolist()
    return [(path[b][: plen[b]], bonus[b]) for b in range(B)]
