"""Model drafter labels for trace replay, teacher-forced and batched: each position's draft by the
drafter's own ``propose``, labelled with the number of its tokens the target would accept.

One target forward over a trace's prompt and output (``P + O``) fills a KV-cache slot with exact
committed K/V (plus hidden-state taps for EAGLE-3); it is copied to ``batch`` slots, and positions
are drafted ``batch`` at a time by the drafter's own ``propose`` (its real code: depth, confidence
stop, chain or tree) with each slot's length set to the position's committed length. Slots take
positions in decreasing order, so the scratch rows a draft writes past its committed length are
never read by a later (shorter) position. The only difference from online drafting is
floating-point: committed K/V come from one prefill instead of the engine's successive verify
forwards (use fp32 when comparing token for token).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..drafters.base import Draft, DraftRequest
from ..drafters.eagle3 import Eagle3Drafter, _ReqState
from ..model.kv_cache import KVCache
from .replay import longest_match


def _fill_slots(cache: KVCache, n: int, batch: int) -> None:
    """Copy slot 0's first ``n`` K/V rows to slots 1..batch-1 and set every length to ``n`` (the
    target's cache or the EAGLE-3 head's: per layer ``[slots, kv, len, hd]``)."""
    for kc, vc in zip(cache.k, cache.v):
        kc[1:batch, :, :n] = kc[0:1, :, :n]
        vc[1:batch, :, :n] = vc[0:1, :, :n]
    for s in range(batch):
        cache.lengths[s] = n


def _ensure_cache(model, batch: int, need: int):
    c = model.cache
    if c is None or c.slots < batch or c.max_len < need:
        model.setup_cache(max(batch, c.slots if c else 0), max(need, c.max_len if c else 0))
    return model.cache


@torch.inference_mode()
def model_drafter_labels(
    drafter,
    prompt: Sequence[int],
    output: Sequence[int],
    budgets: Sequence[int],
    batch: int = 8,
    return_drafts: bool = False,
):
    """``(y, lens[, drafts])``: per position t (index t; 0 unused) the model drafter's accepted
    length against ``output[t:]`` and its draft length, teacher-forced and batched (module doc).

    Supports ``ModelDrafter`` (layer-skip self-drafting: shared target cache; separate draft model:
    its own cache) and ``Eagle3Drafter``. Takes over the drafting model's KV cache (resized to at
    least ``batch`` slots): do not share the model with a running engine.
    """
    N = len(output)
    y = np.zeros(N, np.int32)
    lens = np.zeros(N, np.int32)
    drafts: dict[int, Draft] = {}
    ts = [t for t in range(N - 1, 0, -1) if budgets[t] > 0]
    if not ts:
        return (y, lens, drafts) if return_drafts else (y, lens)
    seq = [int(x) for x in list(prompt) + list(output)]
    P = len(prompt)
    batch = max(1, min(batch, len(ts)))
    is_eagle = isinstance(drafter, Eagle3Drafter)
    model = drafter.target if is_eagle else drafter.model
    room = getattr(drafter, "draft_room", getattr(drafter, "depth", 8)) + 2
    cache = _ensure_cache(model, batch, len(seq) + room)
    dev = model.device
    prefix = seq[:-1]  # committed K/V up to the largest position's context
    cache.truncate(0, 0)
    taps_idx = tuple(sorted(set(drafter.needs_taps))) if is_eagle else ()
    out = model(torch.tensor([prefix], device=dev), [0], taps=taps_idx, last_only=True)
    if is_eagle:
        head = drafter.head
        hc = head.cache
        if hc is None or hc.slots < batch or hc.max_len < len(seq) + room:
            head.setup_cache(max(batch, hc.slots if hc else 0), max(len(seq) + room, hc.max_len if hc else 0))
        hc = head.cache
        fused_taps = torch.cat([out.taps[taps_idx.index(t)][0] for t in drafter.needs_taps], dim=-1)
        hc.truncate(0, 0)
        # the head observes (tap at position j, token j+1) pairs, as the engine feeds it
        prenorm, hlogits = head(
            torch.tensor([seq[1 : len(prefix) + 1]], device=head.device),
            head.fuse(drafter._order_taps(fused_taps))[None],
            [0],
        )
        _fill_slots(hc, len(prefix), batch)
    _fill_slots(cache, len(prefix), batch)
    for g in range(0, len(ts), batch):
        group = ts[g : g + batch]
        asks = []
        for b, t in enumerate(group):
            L = P + t
            cache.lengths[b] = min(cache.lengths[b], L - 1)  # decreasing t per slot: a truncate
            rid = f"pos-{t}"
            if is_eagle:
                hc.lengths[b] = min(hc.lengths[b], L - 1)
                drafter._reqs[rid] = _ReqState(
                    b, prenorm[0, L - 2], torch.log_softmax(hlogits[0, L - 2].float(), -1), seq[L - 1]
                )
            asks.append(DraftRequest(rid, b, seq[:L], int(budgets[t])))
        for t, ask, d in zip(group, asks, drafter.propose(asks)):
            d = d.truncated(ask.max_tokens)
            y[t] = longest_match(d, output, t)
            lens[t] = len(d)
            if return_drafts:
                drafts[t] = d
        if is_eagle:
            for ask in asks:
                drafter._reqs.pop(ask.req_id, None)
    return (y, lens, drafts) if return_drafts else (y, lens)
