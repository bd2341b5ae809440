"""Greedy acceptance of a batch of chain drafts in one kernel launch.

``logits [B, K+1, V]`` (row j: the target's prediction after node j; node 0 is the last context
token) and ``drafts [B, K]`` padded to ``K`` with true lengths ``draft_lens [B]`` give, per
sequence, the longest prefix with ``draft[j] == argmax(logits[j])`` and the bonus token (the argmax
after that prefix). Reference: ``verify_greedy_torch`` (which ``hvd_ray.verification`` runs off CUDA).

The kernel runs one program per sequence that walks the rows in order and stops at the first
mismatch: only the rows it needs are read, once, tile by tile, and no ``[B, K+1]`` argmax (let alone
a ``[B, K+1, V]`` comparison) is written. Ties resolve to the first maximum, like ``torch.argmax``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._triton import block_size, jit, nonempty, require_triton, row_argmax, tl, use_triton


def _check(logits: torch.Tensor, drafts: torch.Tensor, draft_lens) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, K+1, V], got shape {tuple(logits.shape)}")
    B, K1, _ = logits.shape
    drafts = torch.as_tensor(drafts, device=logits.device).reshape(B, K1 - 1)
    lens = torch.as_tensor(draft_lens, device=logits.device).reshape(B)
    return drafts, lens


def verify_greedy_torch(
    logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference, any device, no host sync; ``(accepted [B], bonus [B])``, long. Padding
    (past ``draft_lens``) is never accepted."""
    drafts, lens = _check(logits, drafts, draft_lens)
    K = logits.shape[1] - 1
    best = logits.argmax(-1)  # [B, K+1]
    valid = torch.arange(K, device=best.device) < lens[:, None]
    matches = (best[:, :K] == drafts) & valid  # [B, K]
    accepted = matches.long().cumprod(1).sum(1)  # [B]
    bonus = best.gather(1, accepted[:, None]).squeeze(1)
    return accepted, bonus


@jit
def _greedy_accept_kernel(
    logits_ptr, s_lb, s_lk, drafts_ptr, s_db, lens_ptr, acc_ptr, bonus_ptr, V, BLOCK_V: tl.constexpr
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + b).to(tl.int32)
    j = 0
    stop = n + 1
    best = 0
    while j < stop:
        best = row_argmax(logits_ptr + b * s_lb + j * s_lk, V, BLOCK_V)
        d = tl.load(drafts_ptr + b * s_db + j, mask=j < n, other=-1)
        if (j < n) & (d == best):
            j += 1
        else:
            stop = j
    tl.store(acc_ptr + b, j.to(tl.int64))
    tl.store(bonus_ptr + b, best.to(tl.int64))


def verify_greedy_triton(
    logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor | Sequence[int], block_v: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``); same contract as the reference."""
    require_triton(logits)
    drafts, lens = _check(logits, drafts, draft_lens)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    B, _, V = logits.shape
    acc = torch.empty(B, dtype=torch.long, device=logits.device)
    bonus = torch.empty(B, dtype=torch.long, device=logits.device)
    if B == 0:
        return acc, bonus
    drafts = drafts.contiguous()
    _greedy_accept_kernel[(B,)](
        logits,
        logits.stride(0),
        logits.stride(1),
        nonempty(drafts),
        drafts.stride(0),
        lens.contiguous(),
        acc,
        bonus,
        V,
        BLOCK_V=block_v or block_size(V, 2048),
        num_warps=8 if V >= 8192 else 4,
    )
    return acc, bonus


def verify_greedy(
    logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted draft lengths and bonus tokens, ``(accepted [B], bonus [B])``: Triton on CUDA, else torch."""
    if use_triton(logits):
        return verify_greedy_triton(logits, drafts, draft_lens)
    return verify_greedy_torch(logits, drafts, draft_lens)
