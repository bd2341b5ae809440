"""KV compaction after tree verification: move the accepted path's cache entries into place.

The verify forward writes node ``j`` of a draft at cache position ``start + j``; the accepted path
``keep`` (node indices, increasing, ``keep[0] == 0``) is scattered through them and must become
positions ``start .. start + len(keep) - 1``. Caches are ``KVCache``'s per-layer tensors
``[slots, kv_heads, max_len, head_dim]``. Reference: ``KVCache.compact``'s gather-then-write.

The kernel runs one program per (sequence, kv head) per layer and copies the rows in increasing
``i``: since ``keep`` increases, ``keep[j] >= j``, so destination ``i`` is never a source read later
and the copy is safe in place without the gathered temporary the torch path allocates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._triton import block_size, jit, require_triton, tl, use_triton


def _plan(
    slots: Sequence[int], starts: Sequence[int], keeps: Sequence[Sequence[int]], cache: torch.Tensor
) -> list[tuple[int, int, list[int]]]:
    """Validate and drop no-op entries (``keep == range(len(keep))`` moves nothing)."""
    if not len(slots) == len(starts) == len(keeps):
        raise ValueError("slots, starts and keeps must have the same length")
    S, _, L, _ = cache.shape
    plan = []
    for slot, start, keep in zip(slots, starts, keeps):
        keep = [int(i) for i in keep]
        if not 0 <= slot < S:
            raise ValueError(f"slot {slot} outside a cache of {S} slots")
        if any(b <= a for a, b in zip(keep, keep[1:])) or (keep and keep[0] < 0):
            raise ValueError(f"keep must be increasing and non-negative, got {keep}")
        if keep and not 0 <= start + keep[-1] < L:
            raise ValueError(f"position {start + keep[-1]} outside a cache of length {L}")
        if keep != list(range(len(keep))):
            plan.append((int(slot), int(start), keep))
    return plan


def compact_kv_torch(
    k: Sequence[torch.Tensor],
    v: Sequence[torch.Tensor],
    slots: Sequence[int],
    starts: Sequence[int],
    keeps: Sequence[Sequence[int]],
) -> None:
    """Reference: for every slot, ``cache[slot, :, start + i] = cache[slot, :, start + keep[i]]``."""
    for slot, start, keep in _plan(slots, starts, keeps, k[0]):
        n = len(keep)
        src = torch.tensor(keep, device=k[0].device) + start
        for kc, vc in zip(k, v):
            kc[slot, :, start : start + n] = kc[slot, :, src]
            vc[slot, :, start : start + n] = vc[slot, :, src]


@jit
def _kv_compact_kernel(
    k_ptr, v_ptr, s_slot, s_head, s_pos, slots_ptr, starts_ptr, keep_ptr, s_keep, nkeep_ptr, D, BLOCK_D: tl.constexpr
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    start = tl.load(starts_ptr + b).to(tl.int64)
    n = tl.load(nkeep_ptr + b).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    base = slot * s_slot + h * s_head
    for i in range(0, n):  # in order: a destination is never a later source (keep[j] >= j)
        src = tl.load(keep_ptr + b * s_keep + i).to(tl.int64)
        if src != i:
            rk = tl.load(k_ptr + base + (start + src) * s_pos + d, mask=dm)
            rv = tl.load(v_ptr + base + (start + src) * s_pos + d, mask=dm)
            tl.store(k_ptr + base + (start + i) * s_pos + d, rk, mask=dm)
            tl.store(v_ptr + base + (start + i) * s_pos + d, rv, mask=dm)


def compact_kv_triton(
    k: Sequence[torch.Tensor],
    v: Sequence[torch.Tensor],
    slots: Sequence[int],
    starts: Sequence[int],
    keeps: Sequence[Sequence[int]],
) -> None:
    """The Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``): one launch per layer, in place."""
    require_triton(k[0])
    plan = _plan(slots, starts, keeps, k[0])
    if not plan:
        return
    dev = k[0].device
    width = max(len(keep) for _, _, keep in plan)
    meta = torch.tensor([[s, st, len(kp)] + kp + [0] * (width - len(kp)) for s, st, kp in plan], dtype=torch.long).to(
        dev, non_blocking=True
    )  # one host-to-device copy
    slots_t, starts_t, nkeep_t, keep_t = (
        meta[:, 0].contiguous(),
        meta[:, 1].contiguous(),
        meta[:, 2].contiguous(),
        meta[:, 3:].contiguous(),
    )
    _, H, _, D = k[0].shape
    for kc, vc in zip(k, v):
        if kc.shape != k[0].shape or vc.shape != kc.shape or kc.stride() != vc.stride() or kc.stride(-1) != 1:
            raise ValueError("every layer's K and V cache must share one shape and a unit last stride")
        _kv_compact_kernel[(len(plan), H)](
            kc,
            vc,
            kc.stride(0),
            kc.stride(1),
            kc.stride(2),
            slots_t,
            starts_t,
            keep_t,
            keep_t.stride(0),
            nkeep_t,
            D,
            BLOCK_D=block_size(D, 1 << 12),
            num_warps=1 if D <= 128 else 4,
        )


def compact_kv(
    k: Sequence[torch.Tensor],
    v: Sequence[torch.Tensor],
    slots: Sequence[int],
    starts: Sequence[int],
    keeps: Sequence[Sequence[int]],
) -> None:
    """Compact the accepted entries of every ``(slot, start, keep)`` in place: Triton on CUDA, else torch."""
    if use_triton(k[0]):
        compact_kv_triton(k, v, slots, starts, keeps)
    else:
        compact_kv_torch(k, v, slots, starts, keeps)
