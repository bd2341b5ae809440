"""Triton import guard, dispatch rule and the device helpers the kernels share.

The package must import (and its torch references run) where Triton is missing, e.g. off Linux:
then ``HAVE_TRITON`` is False, ``jit`` leaves functions undecorated and ``tl`` is a stub that only
answers the ``tl.constexpr`` annotations evaluated at definition time.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - Triton ships for Linux x86_64/aarch64 only
    triton = None

    class _Stub:
        constexpr = object

    tl = _Stub()
    HAVE_TRITON = False

#: ``HVD_RAY_KERNELS=torch`` forces the torch references even on CUDA (to bisect a wrong answer).
ENV_VAR = "HVD_RAY_KERNELS"


def jit(fn):
    return triton.jit(fn) if HAVE_TRITON else fn


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel for ``t``: it lives on CUDA, Triton imports, and nobody forced torch."""
    return t.is_cuda and HAVE_TRITON and os.environ.get(ENV_VAR, "auto") != "torch"


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: kernels then run on CPU tensors (how the tests run them)."""
    return HAVE_TRITON and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_triton(t: torch.Tensor) -> None:
    """Clear error for a forced Triton call that cannot run."""
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed; use the torch reference")
    if not t.is_cuda and not interpreting():
        raise RuntimeError(f"Triton kernels need CUDA tensors (got {t.device}) or TRITON_INTERPRET=1")


def nonempty(t: torch.Tensor) -> torch.Tensor:
    """``t``, or one zero of its dtype if it is empty (k = 0): never read, but a kernel argument
    should not be a null pointer."""
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)


def block_size(n: int, cap: int) -> int:
    """Power of two covering ``n`` (at least 16, at most ``cap``): the tile width along ``n``."""
    return max(16, min(cap, triton.next_power_of_2(max(int(n), 1))))


@jit
def row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    """First index of the maximum of ``row_ptr[0:V]``, like ``torch.argmax`` (NaN counts as the max).

    Each lane keeps its best value and index over the tiles it visits (strict ``>``, so the earliest
    tile wins a tie); the lanes are then reduced to the smallest index holding the maximum. Only one
    tile of the row is live at a time, so nothing of size V is materialised.
    """
    offs = tl.arange(0, BLOCK_V)
    best_val = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = offs  # an all -inf row answers 0, as torch does
    best_nan = offs < 0
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        is_nan = x != x
        upd = ((x > best_val) & ~best_nan) | (is_nan & ~best_nan)
        best_val = tl.where(upd, x, best_val)
        best_idx = tl.where(upd, idx, best_idx)
        best_nan = best_nan | is_nan
    big = 2147483647
    first_nan = tl.min(tl.where(best_nan, best_idx, big), 0)
    top = tl.max(tl.where(best_nan, float("-inf"), best_val), 0)
    first_top = tl.min(tl.where(best_val == top, best_idx, big), 0)
    return tl.where(first_nan < big, first_nan, first_top)
