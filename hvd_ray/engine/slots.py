"""KV-cache slots and prefix reuse: which free slot a new prompt takes, and how much of its K/V is
already there. A finished request's K/V stays in its slot (``KVCache.tokens`` records whose); an
agent re-sends its conversation each turn and a retry re-sends its prompt, so a new prompt that
continues a record prefills only the rest (vLLM's prefix caching does the same, by block)."""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Sequence

from ..model.kv_cache import KVCache
from .request import SamplingParams

# Fewer shared tokens than this (e.g. only a chat template's system prompt) are prefilled again: the
# rest of a prompt after a prefix attends through a mask, a little slower per token than a fresh
# causal prefill, so a short shared prefix does not pay for the copy.
MIN_REUSE = 32


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n <= 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:  # one C-level comparison: the usual case is a whole earlier turn
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slice equality
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def check_fits(
    prompt: Sequence[int], params: SamplingParams, num_draft_tokens: int, max_len: int, vocab_size: int | None = None
) -> list[int]:
    """The prompt as a list of ints; rejects one that is not token ids (in ``[0, vocab_size)``), is
    empty, or could outgrow its KV slot (prompt + output + one draft). A bad id would otherwise fail
    the batch's shared forward, and with it every request in the batch."""
    try:
        prompt = [operator.index(t) for t in prompt]  # ints, numpy ints, 0-d integer tensors
    except TypeError:
        raise ValueError(
            "the prompt must be a sequence of token ids (ints), e.g. a tokenizer's "
            "input_ids, not a tokenizer's output or text"
        ) from None
    if not prompt:
        raise ValueError("the prompt is empty")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if len(prompt) + params.max_tokens + num_draft_tokens + 1 > max_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"context this engine was set up for ({max_len} tokens)"
        )
    return prompt


def choose_slot(cache: KVCache, free_slots: deque[int], prompt: list[int], prefix_reuse: bool) -> tuple[int, int]:
    """A free slot for ``prompt`` (taken out of ``free_slots``), holding the K/V of its first ``n``
    tokens: (slot, n). The free slot whose recorded tokens share the longest prefix with it (at least ``MIN_REUSE``)
    is taken when the prompt continues its whole record (an agent's next turn, a retry);
    when they part earlier, the shared rows are copied into the longest-free slot instead, so
    the record stays for whoever continues it. Else the longest-free slot, empty. At least the
    last prompt token is computed again (its logits give the first output token)."""
    src, reused = None, MIN_REUSE - 1
    if prefix_reuse:
        for slot in free_slots:
            n = common_prefix(cache.tokens[slot], prompt, min(cache.lengths[slot], len(prompt) - 1))
            if n > reused:
                src, reused = slot, n
    if src is not None and (reused >= len(cache.tokens[src]) - 1 or len(free_slots) == 1):
        free_slots.remove(src)
        cache.truncate(src, reused)
        return src, reused
    dst = next(s for s in free_slots if s != src)
    free_slots.remove(dst)
    if src is None:
        cache.truncate(dst, 0)
        return dst, 0
    cache.copy_prefix(src, dst, reused)
    return dst, reused
