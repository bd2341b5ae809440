"""How one forward attends: the ``StepContext`` a forward plans once and every layer's attention
reads. The plan picks the kernel for this device and cache (``attention.py``'s kernels), builds the
mask, packs rows of different real lengths, groups rows whose slots share a prefix copy (cascade
attention) and cuts the rest into runs of consecutive slots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .attention import (
    CASCADE_MIN,
    PREFIX_SDPA_MIN,
    attend,
    bf16_decode_sdpa,
    mask_bias,
    run_bias,
    sdpa_attend,
    slot_runs,
)
from .config import ModelConfig
from .kv_cache import KVCache


@dataclass
class StepContext:
    cache: KVCache
    cos: Tensor
    sin: Tensor
    mask: Tensor | None  # additive attention bias (mask_bias; bool with sdpa), None = attend to everything
    span: int
    contiguous: tuple[int, int] | None
    fresh_prefill: bool = False
    prefix_prefill: Tensor | None = None  # bool [T, S] lower-right causal: a long chunk after a kept prefix
    pad_queries: int = 0  # a long chunk after a short kept prefix: that many zero queries make it causal
    runs: list[tuple[int, int, int, int]] = field(default_factory=list)  # slot_runs
    head_idx: Tensor | None = None
    slots_t: Tensor | None = None
    slot_idx: Tensor | None = None
    write_pos: Tensor | None = None
    valid: Tensor | None = None  # packed rows: flat indices of the real tokens in [B * T]
    padded: tuple[int, int] = (0, 0)  # (B, T) of the padded layout
    sdpa: bool = False  # a bf16 cache on CPU, unless a decode forward where attend is faster (bf16_decode_sdpa)
    # rows that attend over a shared prefix once (cascade_attend): (rows, a slot holding the prefix,
    # its length, the rows' slots, the own part's bias, their real queries, where their outputs go);
    # the other rows: ``rest`` (attending per run: ``runs``), outputs to ``rest_dest``
    cascade: list[tuple] = field(default_factory=list)
    rest: Tensor | None = None
    rest_mask: Tensor | None = None
    rest_dest: Tensor | None = None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        return (sdpa_attend if self.sdpa else attend)(q, k, v, mask)

    def attend_runs(self, q: Tensor, kc: Tensor, vc: Tensor, mask: Tensor | None, T: int) -> list[Tensor]:
        """Each run of consecutive slots (``runs``, over ``q``'s rows in order) attending over its
        rows' cache views: a run of rows of real length w attends with its w queries only."""
        return [
            self.attend(
                q[r : r + b - a, :w],
                kc[a:b, :, :span],
                vc[a:b, :, :span],
                None if mask is None else run_bias(mask[r : r + b - a, ..., :span], T, w),
            )
            for a, b, r, span, w in self.runs
        ]


def plan_step(
    cache: KVCache,
    cfg: ModelConfig,
    slots: Sequence[int],
    starts: Sequence[int],
    start_t: Tensor,
    n_new: Sequence[int],
    T: int,
    cos: Tensor,
    sin: Tensor,
    attn_mask: Tensor | None,
) -> StepContext:
    """The kernel, mask and row layout of a forward of ``T`` new tokens per row after ``starts``
    (``start_t`` as a tensor) in ``slots``, ``n_new[b]`` of row b real; see ``Transformer.forward``.

    A bf16 cache on CPU attends through SDPA's kernel, except decode forwards past the crossover
    where ``attend`` is faster (``bf16_decode_sdpa``). One sequence after a kept prefix, from
    ``PREFIX_SDPA_MIN`` new tokens on, takes SDPA's fused kernel too: causal with zero queries for
    a short kept prefix (``pad_queries``), else with a lower-right mask (``prefix_prefill``)."""
    B, dev = len(slots), start_t.device
    span = max(starts) + T
    contiguous = (slots[0], starts[0]) if B == 1 else None
    sdpa = dev.type == "cpu" and cache.k[0].dtype == torch.bfloat16 and (T > 1 or bf16_decode_sdpa(B * span))
    mask = prefix = None
    pad = 0
    if contiguous is not None and starts[0] > 0 and attn_mask is None and T >= PREFIX_SDPA_MIN:
        if 2 * starts[0] < 3 * T:
            pad = starts[0]
        else:
            prefix = torch.ones(T, span, dtype=torch.bool, device=dev).tril(starts[0])
    elif attn_mask is not None or T > 1 or B > 1:
        kpos = torch.arange(span, device=dev)
        rel = kpos[None, :] - start_t[:, None]  # [B, S]: key position relative to the new tokens
        if attn_mask is None:
            new = rel[:, None, :] <= torch.arange(T, device=dev)[None, :, None]  # causal
        else:
            # A token always sees itself, so no row is fully masked (that would give NaNs).
            own = attn_mask.to(dev) | torch.eye(T, dtype=torch.bool, device=dev)
            new = own.gather(2, rel.clamp(0, T - 1)[:, None, :].expand(B, T, span))
        mask = ((rel < 0)[:, None, :] | (new & (rel < T)[:, None, :])).unsqueeze(1)
        if not sdpa:
            mask = mask_bias(mask, cfg.n_heads // cfg.n_kv_heads)
    fresh = contiguous is not None and starts[0] == 0 and attn_mask is None and T > 1
    ctx = StepContext(cache, cos, sin, mask, span, contiguous, fresh, prefix, pad_queries=pad, sdpa=sdpa)
    if B > 1 and sum(n_new) < B * T:  # ragged rows: pack the real tokens
        real = torch.arange(T, device=dev)[None, :] < torch.tensor(n_new, device=dev)[:, None]
        ctx.valid, ctx.padded = real.view(-1).nonzero().squeeze(1), (B, T)
    return ctx


def plan_rows(
    ctx: StepContext,
    cfg: ModelConfig,
    slots: Sequence[int],
    starts: Sequence[int],
    start_t: Tensor,
    n_new: Sequence[int],
    T: int,
    attn_mask: Tensor | None,
) -> None:
    """How a batch's rows read the cache: cascade groups over shared prefix copies (plain masks
    only), then runs of consecutive slots for the rest, and the K/V write indices."""
    B, dev, cache = len(slots), start_t.device, ctx.cache
    if ctx.contiguous is None and attn_mask is None:
        _plan_cascade(ctx, cfg, slots, starts, n_new if ctx.valid is not None else [T] * B, T)
    if ctx.rest is not None:  # the rows outside the cascade groups, in their order
        rest = ctx.rest.tolist()
        widths = n_new if ctx.valid is not None else [T] * B
        ctx.runs = slot_runs([slots[b] for b in rest], [starts[b] for b in rest], [widths[b] for b in rest])
    elif ctx.contiguous is None:
        ctx.runs = slot_runs(slots, starts, n_new if ctx.valid is not None else [T] * B)
    if ctx.contiguous is None:  # every row writes its K/V through these, cascade rows or not
        ctx.slots_t = torch.tensor(list(slots), device=dev)
        ctx.slot_idx = ctx.slots_t[:, None].expand(B, T)
        ctx.write_pos = start_t[:, None] + torch.arange(T, device=dev)
        ctx.head_idx = torch.arange(cache.k[0].shape[1], device=dev)[None, :, None]


def _plan_cascade(
    ctx: StepContext, cfg: ModelConfig, slots: Sequence[int], starts: Sequence[int], widths: list[int], T: int
) -> None:
    """Group the batch's rows whose slots hold copies of one prefix of at least ``CASCADE_MIN``
    rows (``KVCache.origin``, within every group row's context) for ``cascade_attend``, with
    where each row's real queries sit and where their outputs go (packed rows: packed)."""
    cache, dev = ctx.cache, ctx.cos.device
    groups: dict[int, list[int]] = {}
    for b, s in enumerate(slots):
        if cache.origin[s] is not None:
            groups.setdefault(cache.origin[s][0], []).append(b)
    plan = []
    for rows in groups.values():
        n = min(min(cache.origin[slots[b]][1], starts[b]) for b in rows) if len(rows) > 1 else 0
        if n >= CASCADE_MIN:
            plan.append((rows, n))
    if not plan:
        return
    B = len(slots)
    packed = {f: i for i, f in enumerate(ctx.valid.tolist())} if ctx.valid is not None else None

    def dest(rows: list[int]) -> Tensor:
        flat = [b * T + t for b in rows for t in range(widths[b])]
        return torch.tensor(flat if packed is None else [packed[f] for f in flat], device=dev)

    G = cfg.n_heads // cfg.n_kv_heads
    grouped = set()
    for rows, n in plan:
        idx = torch.tensor(rows, device=dev)
        bias = None
        if ctx.mask is not None:
            m = ctx.mask.index_select(0, idx)[..., n:]
            bias = mask_bias(m, G) if m.dtype == torch.bool else m
        own = [slots[b] for b in rows]
        consecutive = own == list(range(own[0], own[0] + len(own)))
        slot_t = range(own[0], own[0] + len(own)) if consecutive else torch.tensor(own, device=dev)
        real = None
        if any(widths[b] < T for b in rows):
            real = torch.tensor([i * T + t for i, b in enumerate(rows) for t in range(widths[b])], device=dev)
        ctx.cascade.append((idx, own[0], n, slot_t, bias, real, dest(rows)))
        grouped.update(rows)
    rest = [b for b in range(B) if b not in grouped]
    if rest:
        ctx.rest = torch.tensor(rest, device=dev)
        ctx.rest_mask = None if ctx.mask is None else ctx.mask.index_select(0, ctx.rest)
        ctx.rest_dest = dest(rest)
