"""Stochastic acceptance of a batch of chain drafts (speculative sampling), seeded.

Per sequence ``b`` with draft ``x_0..x_{n-1}`` (``n = draft_lens[b]``), target distributions
``p_0..p_n = target_probs[b]`` and draft distributions ``q_i = draft_probs[b, i]`` (``None``: a
deterministic draft, ``q_i`` one-hot on ``x_i``): token ``x_i`` is accepted while
``accept_u[b, i] * q_i(x_i) < p_i(x_i)``, exactly the rule and the float32 arithmetic of
``hvd_ray.verification.rejection_sample_chain``. At the first rejection ``k`` the next token is drawn
from the residual ``max(0, p_k - q_k)`` (``p_k`` without ``x_k`` for a deterministic draft; ``p_k``
itself if rounding left the residual empty); if all ``n`` are accepted, from ``p_n``.

Randomness: the caller passes the uniforms in (``accept_u [B, K]``, ``sample_u [B]``, in [0, 1)),
drawn with the request's seeded ``torch.Generator``; kernel and reference consume the same numbers,
so "equal to the reference" is checkable exactly and a seed replays a request on either path. (A
counter-based RNG inside the kernel would tie reproducibility to Triton's Philox, which torch cannot
mirror on CPU.) The draw from the final distribution is an inverse CDF: the first token whose float64
running sum of weights exceeds ``sample_u * total``, never a zero-weight token. The kernel and the
reference add the same float32 weights in float64 but in a different order, so they could disagree
only when the threshold falls within ~1e-16 of a CDF step: in practice never.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._triton import block_size, jit, nonempty, require_triton, tl, use_triton


def _check(target_probs, drafts, draft_lens, accept_u, sample_u, draft_probs):
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, K+1, V], got shape {tuple(target_probs.shape)}")
    B, K1, V = target_probs.shape
    dev = target_probs.device
    drafts = torch.as_tensor(drafts, device=dev).reshape(B, K1 - 1)
    lens = torch.as_tensor(draft_lens, device=dev).reshape(B)
    accept_u = torch.as_tensor(accept_u, device=dev, dtype=torch.float32).reshape(B, K1 - 1)
    sample_u = torch.as_tensor(sample_u, device=dev, dtype=torch.float32).reshape(B)
    if draft_probs is not None and tuple(draft_probs.shape) != (B, K1 - 1, V):
        raise ValueError(f"draft_probs must be [B, K, V] = {(B, K1 - 1, V)}, got {tuple(draft_probs.shape)}")
    return drafts, lens, accept_u, sample_u


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise draw from unnormalised ``weights [B, V]`` (>= 0, each row with mass) at uniforms ``u [B]``."""
    cdf = weights.double().cumsum(-1)
    thr = u.double() * cdf[:, -1]
    idx = (cdf <= thr[:, None]).sum(-1)
    last = torch.where(weights > 0, torch.arange(weights.shape[-1], device=weights.device), -1).amax(-1)
    return torch.minimum(idx, last)


def verify_rejection_torch(
    target_probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_lens: torch.Tensor | Sequence[int],
    accept_u: torch.Tensor,
    sample_u: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (vectorised torch, any device): ``(accepted [B], next_token [B])``, long."""
    drafts, lens, accept_u, sample_u = _check(target_probs, drafts, draft_lens, accept_u, sample_u, draft_probs)
    B, K1, V = target_probs.shape
    K = K1 - 1
    dev = target_probs.device
    rows = torch.arange(B, device=dev)
    safe = drafts.clamp(0, V - 1)
    p_x = target_probs[:, :K].float().gather(2, safe[..., None]).squeeze(-1)
    q_x = (
        draft_probs.float().gather(2, safe[..., None]).squeeze(-1) if draft_probs is not None else torch.ones_like(p_x)
    )
    valid = torch.arange(K, device=dev) < lens[:, None]
    accepted = ((accept_u * q_x < p_x) & valid).long().cumprod(1).sum(1)
    p = target_probs[rows, accepted].float()  # [B, V]
    rejected = accepted < lens
    if draft_probs is not None:
        q = draft_probs[rows, accepted.clamp(max=max(K - 1, 0))].float() if K else torch.zeros_like(p)
        residual = (p - q).clamp_min(0.0)
    else:
        x = (
            safe.gather(1, accepted.clamp(max=max(K - 1, 0))[:, None])
            if K
            else torch.zeros(B, 1, dtype=torch.long, device=dev)
        )
        residual = p.scatter(1, x, 0.0)
    w = torch.where(rejected[:, None], residual, p)
    w = torch.where((w.double().sum(-1) > 0)[:, None], w, p)  # empty residual: fall back to p
    return accepted, inverse_cdf(w, sample_u)


@jit
def _weight(p_row, q_row, idx, V, x, resid, HAS_Q: tl.constexpr):
    """float32 weights of tokens ``idx`` in the next token's distribution: the residual if ``resid``, else p."""
    m = idx < V
    p = tl.load(p_row + idx, mask=m, other=0.0).to(tl.float32)
    if HAS_Q:
        live = m & ((idx * 0 + resid.to(tl.int32)) > 0)  # no q row to read unless drawing from the residual
        q = tl.load(q_row + idx, mask=live, other=0.0).to(tl.float32)
        r = tl.maximum(p - q, 0.0)
    else:
        r = tl.where(idx == x, 0.0, p)
    return tl.where(resid, r, p)


@jit
def _rejection_kernel(
    p_ptr,
    s_pb,
    s_pk,
    q_ptr,
    s_qb,
    s_qk,
    drafts_ptr,
    s_db,
    lens_ptr,
    au_ptr,
    s_ab,
    su_ptr,
    acc_ptr,
    tok_ptr,
    V,
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + b).to(tl.int32)
    j = 0
    stop = n
    while j < stop:  # accept/reject: one scalar load of p (and q) per draft token
        x = tl.load(drafts_ptr + b * s_db + j)
        ok = (x >= 0) & (x < V)
        px = tl.load(p_ptr + b * s_pb + j * s_pk + x, mask=ok, other=0.0).to(tl.float32)
        if HAS_Q:
            qx = tl.load(q_ptr + b * s_qb + j * s_qk + x, mask=ok, other=1.0).to(tl.float32)
        else:
            qx = 1.0
        u = tl.load(au_ptr + b * s_ab + j)
        if u * qx < px:
            j += 1
        else:
            stop = j
    rejected = j < n
    x = tl.load(drafts_ptr + b * s_db + j, mask=rejected, other=-1)
    p_row = p_ptr + b * s_pb + j * s_pk
    q_row = q_ptr + b * s_qb + j * s_qk
    offs = tl.arange(0, BLOCK_V)
    # pass 1: the mass to draw from (the residual's; if rounding emptied it, p's)
    mass = tl.zeros([BLOCK_V], tl.float64)
    for start in range(0, V, BLOCK_V):
        mass += _weight(p_row, q_row, start + offs, V, x, rejected, HAS_Q).to(tl.float64)
    total = tl.sum(mass, 0)
    resid = rejected & (total > 0.0)
    if rejected & (total <= 0.0):
        mass = tl.zeros([BLOCK_V], tl.float64)
        for start in range(0, V, BLOCK_V):
            mass += _weight(p_row, q_row, start + offs, V, x, resid, HAS_Q).to(tl.float64)
        total = tl.sum(mass, 0)
    thr = tl.load(su_ptr + b).to(tl.float64) * total
    # pass 2: the running sum, tile by tile; the draw is the number of tokens whose CDF is <= thr
    carry = tl.sum(tl.zeros([BLOCK_V], tl.float64), 0)
    count = 0
    last = -1
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        w = _weight(p_row, q_row, idx, V, x, resid, HAS_Q)
        cdf = tl.cumsum(w.to(tl.float64), 0) + carry
        count += tl.sum(((cdf <= thr) & (idx < V)).to(tl.int32), 0)
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, idx, -1), 0))
        carry = tl.max(cdf, 0)
    tl.store(acc_ptr + b, j.to(tl.int64))
    tl.store(tok_ptr + b, tl.minimum(count, last).to(tl.int64))


def verify_rejection_triton(
    target_probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_lens: torch.Tensor | Sequence[int],
    accept_u: torch.Tensor,
    sample_u: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``); same contract as the reference."""
    require_triton(target_probs)
    drafts, lens, accept_u, sample_u = _check(target_probs, drafts, draft_lens, accept_u, sample_u, draft_probs)
    p = target_probs if target_probs.stride(-1) == 1 else target_probs.contiguous()
    B, _, V = p.shape
    dev = p.device
    acc = torch.empty(B, dtype=torch.long, device=dev)
    tok = torch.empty(B, dtype=torch.long, device=dev)
    if B == 0:
        return acc, tok
    K = p.shape[1] - 1
    q = p if draft_probs is None else draft_probs.contiguous()
    s_qb, s_qk = (q.stride(0), q.stride(1)) if K else (0, 0)
    drafts, accept_u = drafts.contiguous(), accept_u.contiguous()
    _rejection_kernel[(B,)](
        p,
        p.stride(0),
        p.stride(1),
        nonempty(q),
        s_qb,
        s_qk,
        nonempty(drafts),
        K,
        lens.contiguous(),
        nonempty(accept_u),
        K,
        sample_u.contiguous(),
        acc,
        tok,
        V,
        HAS_Q=draft_probs is not None,
        BLOCK_V=block_v or block_size(V, 1024),
        num_warps=8 if V >= 8192 else 4,
    )
    return acc, tok


def verify_rejection(
    target_probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_lens: torch.Tensor | Sequence[int],
    accept_u: torch.Tensor,
    sample_u: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted [B], next_token [B])`` of speculative sampling: Triton on CUDA, else torch."""
    if use_triton(target_probs):
        return verify_rejection_triton(target_probs, drafts, draft_lens, accept_u, sample_u, draft_probs)
    return verify_rejection_torch(target_probs, drafts, draft_lens, accept_u, sample_u, draft_probs)
