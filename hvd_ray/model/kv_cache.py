"""The KV cache: one preallocated slot per sequence, explicit per-slot lengths (a rollback is
``lengths[slot] = n``), the record of whose tokens a slot holds (prefix reuse) and of which slots hold
copies of one prefix (cascade attention)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from .config import ModelConfig


class KVCache:
    """Per-layer K/V tensors ``[slots, kv_heads, max_len, head_dim]`` plus per-slot lengths.

    ``lengths`` is a plain Python list: the engine reads and writes it every step, and list access
    is far cheaper than touching a tensor. Entries past ``lengths[slot]`` are garbage by contract.

    ``tokens[slot]``: the token ids whose K/V the slot's first rows hold, where the engine recorded
    them (a finished request's prompt and output: prefix reuse). Forwards only append past
    ``lengths``, so the record stays true until ``truncate`` or ``compact`` rewinds the slot, and
    those cut it; it lives here, not in an engine, so engines that share a model stay correct.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_heads: int | None = None,
    ):
        shape = (slots, kv_heads or cfg.n_kv_heads, max_len, cfg.head_dim)  # a TP rank holds only its heads
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.lengths = [0] * slots
        self.tokens: list[list[int]] = [[] for _ in range(slots)]
        self.max_len = max_len
        # origin[slot] = (lineage, n): the slot's first n rows are bitwise copies of the rows every
        # other slot of that lineage holds there (``copy_prefix``), so a batch's rows of one lineage
        # can attend over those rows once (``cascade_attend``); None: the slot's rows are its own
        self.origin: list[tuple[int, int] | None] = [None] * slots
        self._lineages = itertools.count()

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def truncate(self, slot: int, length: int) -> None:
        """Roll back a slot to an earlier length (drops rejected draft tokens)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length
        if len(self.tokens[slot]) > length:
            del self.tokens[slot][length:]
        self.rewritten(slot, length)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot ``dst`` becomes the first ``n`` rows of slot ``src`` (and their token record)."""
        if not 0 <= n <= self.lengths[src]:
            raise ValueError(f"slot {src} holds {self.lengths[src]} rows, not {n}")
        for kc, vc in zip(self.k, self.v):
            kc[dst, :, :n] = kc[src, :, :n]
            vc[dst, :, :n] = vc[src, :, :n]
        self.lengths[dst] = n
        self.tokens[dst] = self.tokens[src][:n]
        if self.origin[src] is None:
            self.origin[src] = (next(self._lineages), self.lengths[src])
        lineage, shared = self.origin[src]
        self.origin[dst] = (lineage, min(shared, n))

    def rewritten(self, slot: int, start: int) -> None:
        """Rows from ``start`` on are (to be) written anew: the slot's copy of its lineage ends there
        (at 0 it has none: fresh rows)."""
        o = self.origin[slot]
        if o is not None and o[1] > start:
            self.origin[slot] = (o[0], start) if start > 0 else None

    def compact(self, slot: int, start: int, keep: Sequence[int]) -> None:
        """Move entries at ``start + keep[i]`` to ``start + i`` and set the length to ``start + len(keep)``.

        Used after tree verification: the accepted path is scattered through the draft's cache
        positions and must become contiguous. ``keep`` is increasing, so a gather-then-write is safe.
        """
        n = len(keep)
        if len(self.tokens[slot]) > start:
            del self.tokens[slot][start:]
        self.rewritten(slot, start)
        if list(keep) != list(range(n)) and self.k[0].device.type == "cuda":
            from ..kernels import compact_kv  # Triton: in place, one launch per layer, no gathered copy

            compact_kv(self.k, self.v, [slot], [start], [keep])
        elif list(keep) != list(range(n)):
            src = torch.tensor(keep, device=self.k[0].device) + start
            for kc, vc in zip(self.k, self.v):
                kc[slot, :, start : start + n] = kc[slot, :, src]
                vc[slot, :, start : start + n] = vc[slot, :, src]
        self.lengths[slot] = start + n
