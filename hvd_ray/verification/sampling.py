"""Distribution-preserving speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Every function here emits tokens whose distribution is exactly the target's, whatever the draft:
a draft only changes how many tokens one target forward yields. ``target_probs[j]`` is the
target's (filtered) distribution for the token after node j (node 0 = last context token, node
i+1 = draft token i). Randomness comes only from the ``generator`` passed in, which must live on
the probabilities' device, so a seeded generator replays a request exactly.

Each call makes a fixed, small number of host syncs (one ``tolist`` for the accept decisions, one
for the sampled token) instead of one per draft token.

A request with a seed is verified differently (``gumbel_scores``): each output position's draw is
a Gumbel-max keyed by (seed, position), so its tokens do not depend on the drafts at all and a
seeded request replays exactly, with or without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .tree import tree_children


class NonFiniteProbabilities(ValueError):
    """A request's sampling distribution holds NaN or inf (e.g. logits overflowed under 1/T): its
    draw would be garbage or raise deep inside torch, so the request fails here, alone."""


def _as_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)


def target_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """The distribution plain sampling draws from: logits / T, then min-p (tokens below ``min_p``
    times the top token's probability dropped), then top-k, then top-p, renormalised.

    Verification must use exactly the distribution normal sampling would use, or speculative output
    would differ in distribution from non-speculative output; both go through this function.
    ``temperature <= 0`` means greedy: a one-hot on the (first) argmax. ``top_k <= 0`` and
    ``top_p >= 1`` disable those filters. Ties at the k-th logit are all kept (as in HF). Works on
    any ``[..., V]`` shape and returns float32.
    """
    logits = logits.float()
    if temperature <= 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    x = logits / temperature
    vocab = x.shape[-1]
    if min_p > 0:
        p = x.softmax(-1)
        x = x.masked_fill(p < min_p * p.amax(-1, keepdim=True), float("-inf"))
    if 0 < top_k < vocab:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False  # the top token is always kept (also when
        # top_p rounds to 0 in float32, e.g. 5e-324)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(-1)
    if not bool(torch.isfinite(probs).all()):
        raise NonFiniteProbabilities(
            f"the sampling distribution is not finite (temperature {temperature}, top_k {top_k}, top_p {top_p})"
        )
    return probs


def _position_seed(seed: int, position: int) -> int:
    """A generator seed for one output position of a seeded request (splitmix64 of the pair)."""
    x = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def gumbel_scores(probs: torch.Tensor, seed: int, positions: Sequence[int]) -> torch.Tensor:
    """``log(probs) + g`` per row, with Gumbel noise ``g`` drawn from ``(seed, positions[row])``: a
    row's argmax is a draw from it (Gumbel-max). The noise of output position t is the same whatever
    the draft, the batch or the drafter, so verifying a draft becomes a greedy walk over these
    argmaxes, and a seeded request emits the same tokens with and without speculation. For a draft
    of fixed tokens this accepts as often as rejection sampling: a token is taken with its probability."""
    noise = torch.empty_like(probs, dtype=torch.float32)
    drawn: dict[int, torch.Tensor] = {}
    for i, pos in enumerate(positions):
        if pos not in drawn:
            g = torch.Generator(device=probs.device)
            g.manual_seed(_position_seed(seed, pos))
            u = torch.rand(probs.shape[-1], generator=g, device=probs.device)
            drawn[pos] = -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))
        noise[i] = drawn[pos]
    return probs.float().log() + noise


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs [..., V]``; returns a long tensor of shape ``[...]``."""
    flat = probs.reshape(-1, probs.shape[-1])
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def _sample_residual(residual: torch.Tensor, fallback: torch.Tensor, generator: torch.Generator | None) -> int:
    """Sample from ``residual``; if rounding left it with no mass, from ``fallback`` (no sync)."""
    residual = torch.where(residual.sum() > 0, residual, fallback)
    return int(sample(residual, generator))


def rejection_sample_chain(
    target_probs: torch.Tensor,
    draft_tokens: Sequence[int] | torch.Tensor,
    draft_dists: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Standard speculative sampling of a chain draft.

    Token ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
    rejection the replacement is drawn from ``normalise(max(0, p_i - q_i))``; if all ``n`` are
    accepted the bonus token is drawn from ``p_n``. ``draft_dists [n, V]`` are the distributions the
    draft was sampled from; ``None`` means a deterministic draft (``q`` one-hot on the draft token:
    accept with probability ``p(x)``, residual = ``p`` without ``x``).

    Returns ``(num_accepted, next_token)``; the step emits ``draft[:num_accepted] + [next_token]``.
    """
    draft = _as_list(draft_tokens)
    n = len(draft)
    if target_probs.shape[0] != n + 1:
        raise ValueError(f"need {n + 1} target rows, got {target_probs.shape[0]}")
    if draft_dists is not None and draft_dists.shape[0] != n:
        raise ValueError(f"need {n} draft distributions, got {draft_dists.shape[0]}")
    dev = target_probs.device
    if dev.type == "cuda":
        # Triton kernel (kernels/rejection.py): the same accept draws from the generator, then one
        # uniform for an inverse-CDF draw instead of torch.multinomial; one host sync in all.
        from ..kernels import verify_rejection

        accept_u = torch.rand(n, generator=generator, device=dev)
        sample_u = torch.rand(1, generator=generator, device=dev)
        q = None if draft_dists is None else draft_dists.to(dev)[None]
        acc, tok = verify_rejection(
            target_probs[None], torch.tensor([draft], dtype=torch.long).reshape(1, n), [n], accept_u[None], sample_u, q
        )
        return tuple(torch.stack([acc, tok]).view(-1).tolist())
    k = n
    if n:
        rows = torch.arange(n, device=dev)
        tok = torch.tensor(draft, device=dev)
        p_x = target_probs[rows, tok].float()
        q_x = (
            draft_dists[rows, tok.to(draft_dists.device)].float().to(dev)
            if draft_dists is not None
            else torch.ones_like(p_x)
        )
        u = torch.rand(n, generator=generator, device=dev)
        # u < p/q  <=>  u*q < p; also right when q(x) = 0 (accept iff p(x) > 0).
        accept = (u * q_x < p_x).tolist()
        k = accept.index(False) if False in accept else n
    p = target_probs[k].float()
    if k == n:
        return n, int(sample(p, generator))
    if draft_dists is None:
        residual = p.clone()
        residual[draft[k]] = 0.0
    else:
        residual = (p - draft_dists[k].to(dev).float()).clamp_min(0.0)
    return k, _sample_residual(residual, p, generator)


def rejection_sample_tree(
    target_probs: torch.Tensor,
    draft_tokens: Sequence[int] | torch.Tensor,
    parents: Sequence[int],
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Speculative sampling of a deterministic tree draft (suffix tree, top-k children).

    At the current node its children are tried in draft order. With ``p'`` the current residual
    (the node's target distribution with already rejected children's tokens removed, renormalised),
    child ``c`` is accepted with probability ``p'(c)``: this is recursive rejection sampling for
    deterministic candidates without replacement, and the emitted token is distributed exactly as
    ``p``. An accepted child becomes the current node; if all children are rejected the next token
    is drawn from the residual; at a leaf it is drawn from the leaf's ``p``. A duplicate sibling
    token has no residual mass left, so it is simply never accepted.

    Returns ``(accepted_nodes, next_token)`` with ``accepted_nodes`` the draft indices of the
    accepted path, root side first.
    """
    draft = _as_list(draft_tokens)
    n = len(draft)
    if len(parents) != n or target_probs.shape[0] != n + 1:
        raise ValueError("need len(parents) == len(draft) and len(draft) + 1 target rows")
    children = tree_children(parents)
    dev = target_probs.device
    mass = target_probs.sum(-1, dtype=torch.float32).tolist()  # rows may be unnormalised
    cand: list[float] = []
    u: list[float] = []
    if n:
        parent_nodes = torch.tensor([p + 1 for p in parents], device=dev)
        tok = torch.tensor(draft, device=dev)
        cand_t = target_probs[parent_nodes, tok].float()
        u_t = torch.rand(n, generator=generator, device=dev)
        cand, u = torch.stack([cand_t, u_t]).tolist()

    path: list[int] = []
    node = 0
    while True:
        left = mass[node]  # unnormalised mass of the residual at this node
        tried: list[int] = []
        chosen = None
        for c in children[node]:
            pc = 0.0 if draft[c] in tried else cand[c]
            if u[c] * left < pc:  # u < p'(c) = pc / left
                chosen = c
                break
            left -= pc
            tried.append(draft[c])
        if chosen is None:
            break
        path.append(chosen)
        node = chosen + 1

    p = target_probs[node].float()
    if not tried:
        return path, int(sample(p, generator))
    residual = p.clone()
    residual[torch.tensor(tried, device=dev)] = 0.0
    return path, _sample_residual(residual, p, generator)
