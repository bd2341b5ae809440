"""Attention over the KV cache: the kernels (``attend``'s batched matmuls, SDPA's fused kernel, and
``cascade_attend`` for rows sharing a prefix copy), which one a forward takes on this CPU, and how a
batch's rows are cut into runs of consecutive slots."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """Grouped-query attention as two batched matmuls: q [B, T, H, D], k/v [B, KV, S, D] -> [B, T, H*D].

    The query heads that share a KV head are folded into the row dimension, so K/V are never
    repeated or copied (the cache is head-major, so a slot range is a plain batched-matmul operand).
    Computed in the cache's dtype (fp32 on a CPU without bf16 instructions, where bf16 batched
    matmuls are slower than fp32 ones; a bf16 CPU cache takes ``sdpa_attend``, except for decode
    forwards where this is faster, ``bf16_decode_sdpa``) with an fp32 softmax; for decode-sized T
    it beats SDPA's CPU kernel on most CPUs (measured: docs/results-engine.md).
    ``bias`` [B, 1, G*T, S] is 0 / -inf (see ``mask_bias``) or None.
    """
    B, T, H, D = q.shape
    KV = k.shape[1]
    G = H // KV
    qg = q.to(k.dtype).reshape(B, T, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B, KV, G * T, D)
    scores = torch.matmul(qg * (D**-0.5), k.transpose(2, 3)).float()  # [B, KV, G*T, S]
    if bias is not None:
        scores = scores + bias
    out = torch.matmul(scores.softmax(-1).to(v.dtype), v)  # [B, KV, G*T, D]
    return out.view(B, KV, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D).to(q.dtype)


def sdpa_attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """``attend`` over a bf16 cache on a CPU with bf16 dot-product instructions: SDPA's fused
    kernel (fp32 accumulation and softmax) reads the cache as it is stored, half the bytes of fp32
    copies. ``mask`` bool [B, 1, T, S] (True = attend) or None.

    Decode attention is memory-bound, so reading half the bytes pays on a CPU whose SDPA kernel is
    fast for one query (measured: docs/results-engine.md)."""
    B, T, H, D = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).to(k.dtype), k, v, attn_mask=mask, enable_gqa=H != k.shape[1]
    )
    return out.transpose(1, 2).reshape(B, T, H * D).to(q.dtype)


def _attend_lse(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` [B, KV, L, D] (already scaled by ``D**-0.5``) over ``k``/``v`` [B, KV, S, D]
    with an additive ``bias`` [B, 1, L, S] (or None): (output [B, KV, L, D] in fp32, log-sum-exp of
    the scores [B, KV, L, 1]). On CPU this is SDPA's own fused kernel, which returns the
    log-sum-exp; elsewhere two matmuls."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=None if bias is None else bias.to(q.dtype), scale=1.0
        )
        return out.float(), lse.float().unsqueeze(-1)
    s = torch.matmul(q, k.transpose(2, 3)).float()
    if bias is not None:
        s = s + bias
    lse = s.logsumexp(-1, keepdim=True)
    return torch.matmul((s - lse).exp().to(v.dtype), v).float(), lse


def cascade_attend(
    q: Tensor, kp: Tensor, vp: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, real: Tensor | None = None
) -> Tensor:
    """``attend`` for rows that share their first keys: ``kp``/``vp`` [KV, n, D], one copy of the
    shared keys, then each row's own ``k``/``v`` [R, KV, S, D] (``bias`` [R, 1, G*T, S] as in
    ``attend``, or None). ``q`` [R, T, H, D]; ``real``: the indices in ``R*T`` (row-major) of the
    queries that are tokens, not padding (None: all). Returns [queries, H*D] for those.

    Every row's queries meet the shared keys in one pass per KV head: the rows' copies of a long
    shared prompt (an agent's tool list) are read once per forward, not once per row. The two parts
    are merged exactly by their log-sum-exps (as FlashAttention merges blocks); only the summation
    order differs from attending over each row's keys."""
    R, T, H, D = q.shape
    KV = kp.shape[0]
    G = H // KV
    qs = q.to(kp.dtype) * (D**-0.5)
    flat = qs.reshape(R * T, KV, G, D)
    if real is not None:
        flat = flat.index_select(0, real)
    N = flat.shape[0]
    o1, l1 = _attend_lse(flat.permute(1, 0, 2, 3).reshape(1, KV, N * G, D), kp.unsqueeze(0), vp.unsqueeze(0), None)
    o1, l1 = (x.reshape(KV, N, G, -1).transpose(0, 1) for x in (o1, l1))  # [N, KV, G, .]
    o2, l2 = _attend_lse(qs.reshape(R, T, KV, G, D).permute(0, 2, 3, 1, 4).reshape(R, KV, G * T, D), k, v, bias)
    o2, l2 = (x.reshape(R, KV, G, T, -1).permute(0, 3, 1, 2, 4).reshape(R * T, KV, G, -1) for x in (o2, l2))
    if real is not None:
        o2, l2 = o2.index_select(0, real), l2.index_select(0, real)
    m = torch.maximum(l1, l2)
    a1, a2 = (l1 - m).exp_(), (l2 - m).exp_()
    return ((o1 * a1 + o2 * a2) / (a1 + a2)).reshape(N, H * D).to(q.dtype)


def bf16_decode_sdpa(keys: int) -> bool:
    """Whether a decode forward (one new token per row) reading ``keys`` cached positions in all
    (rows x span) over a bf16 CPU cache attends through ``sdpa_attend``, else ``attend`` in bf16
    (forwards of several tokens a row always take SDPA). ``HVD_BF16_ATTENTION=sdpa|attend`` decides,
    else (``auto``) SDPA below the crossover timed once per process (:func:`_sdpa_crossover`).
    It depends on the CPU: where SDPA's one-query kernel is fast (a Xeon with AMX) SDPA wins at any
    length; where its cost per key is high (an AMD EPYC Zen 4: ``avx512_bf16``, no AMX) ``attend``
    wins past a short context. Verify forwards keep SDPA: through ``attend`` they were faster alone
    but slower in serving (measured: docs/results-engine.md)."""
    choice = os.environ.get("HVD_BF16_ATTENTION", "auto")
    if choice not in ("auto", "sdpa", "attend"):
        raise ValueError(f"HVD_BF16_ATTENTION must be auto, sdpa or attend, got {choice!r}")
    return keys < _sdpa_crossover() if choice == "auto" else choice == "sdpa"


@functools.cache
def _sdpa_crossover() -> float:
    """Keys (rows x span) of a decode forward from which ``attend`` beats ``sdpa_attend`` on this CPU:
    both timed at one query over 64 and 1,024 keys (interleaved, medians, the process's torch
    threads, once per process), each fitted as a line in the keys; inf where SDPA is never slower."""
    import time

    g = torch.Generator().manual_seed(0)
    fit: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for S in (64, 1024):
            q = torch.randn(1, 1, 9, 64, generator=g).bfloat16()
            k, v = (torch.randn(1, 3, S, 64, generator=g).bfloat16() for _ in range(2))
            runs: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(7):
                for sdpa in (True, False):
                    t0 = time.perf_counter()
                    for _ in range(3):
                        sdpa_attend(q, k, v, None) if sdpa else attend(q, k, v, None)
                    runs[sdpa].append(time.perf_counter() - t0)
            for sdpa in runs:
                fit[sdpa].append(sorted(runs[sdpa])[3])
    (s0, s1), (a0, a1) = fit[True], fit[False]
    slope_s, slope_a = (s1 - s0) / 960, (a1 - a0) / 960
    if slope_s <= slope_a:
        return math.inf if s1 <= a1 else 0.0
    return max(0.0, 64 + (a0 - s0) / (slope_s - slope_a))


def run_bias(bias: Tensor, T: int, w: int) -> Tensor:
    """``mask_bias`` rows [n, 1, G*T, S] (or ``sdpa_attend``'s bool rows [n, 1, T, S]) cut to the
    first ``w`` queries of each group."""
    if w == T:
        return bias
    if bias.dtype == torch.bool:
        return bias[:, :, :w]
    n, _, GT, S = bias.shape
    return bias.view(n, 1, GT // T, T, S)[:, :, :, :w].reshape(n, 1, GT // T * w, S)


def mask_bias(mask: Tensor, groups: int) -> Tensor:
    """Bool mask [B, 1, T, S] -> additive fp32 bias [B, 1, G*T, S] in ``attend``'s row order.

    Built once per forward rather than once per layer."""
    B, _, T, S = mask.shape
    m = mask.unsqueeze(2).expand(B, 1, groups, T, S).reshape(B, 1, groups * T, S)
    return torch.zeros(m.shape, device=mask.device).masked_fill_(~m, float("-inf"))


# Rows whose slots hold copies of a shared prefix at least this long attend over it once per forward
# (``cascade_attend``); below it the extra kernels per layer cost more than the shared reads save.
CASCADE_MIN = 256

# A row joins the run before it only while padding the run's rows to one key span wastes at most this
# many (key, query) pairs: a run attends over its longest row's span, so one run over short and long
# contexts pads the short ones, while a further run costs only a few small kernels per layer on CPU
# (on a GPU their launches may make a higher bound pay). Measured: docs/results-http.md.
SPAN_WASTE = 512


def slot_runs(
    slots: Sequence[int], starts: Sequence[int], widths: Sequence[int]
) -> list[tuple[int, int, int, int, int]]:
    """``slots`` cut into runs of consecutive cache slots whose rows have the same width and similar
    spans (``SPAN_WASTE``): ``(first slot, last slot + 1, first row, key span, width)`` each, the
    span being the run's longest prefix + its width."""
    runs: list[list[int]] = []  # [first slot, end slot, first row, span, width, sum of the rows' spans]
    for row, (s, st, w) in enumerate(zip(slots, starts, widths)):
        span = st + w
        if runs and s == runs[-1][1] and w == runs[-1][4]:
            first, end, _, top, _, total = runs[-1]
            if ((end - first + 1) * max(top, span) - total - span) * w <= SPAN_WASTE:
                runs[-1][1] += 1
                runs[-1][3] = max(top, span)
                runs[-1][5] += span
                continue
        runs.append([s, s + 1, row, span, w, span])
    return [tuple(r[:5]) for r in runs]


# From this many new tokens on, a single sequence after a prefix in its slot attends with SDPA's fused
# kernel: the rest of a prompt after a reused prefix, and a lone request's longest chain drafts, where
# SDPA is the faster; below, the two are level. After a kept prefix shorter than 1.5x the new tokens
# it runs causal with padded queries (``pad_queries``), else with a lower-right mask (``prefix_prefill``).
PREFIX_SDPA_MIN = 64
