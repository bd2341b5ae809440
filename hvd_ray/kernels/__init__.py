"""Triton kernels for the verify step and KV compaction, each with the torch reference it falls back to.

* ``verify_greedy``    greedy acceptance of chain drafts, ``[B, K+1, V]`` logits -> accepted lengths, bonus tokens
* ``verify_rejection`` speculative sampling of chain drafts (residual distribution), on caller-drawn uniforms
* ``verify_tree``      greedy tree verification: the longest accepted path per sequence
* ``compact_kv``       move the accepted path's KV entries into contiguous cache positions, in place

Each public function runs its Triton kernel when its input lives on a CUDA device (and Triton
imports), otherwise its ``*_torch`` reference; ``HVD_RAY_KERNELS=torch`` forces the references.
``hvd_ray.verification`` and ``KVCache.compact`` call these on CUDA only, so CPU behaviour is the
engine's own torch code. ``python -m hvd_ray.kernels.check_gpu`` checks and times them on a GPU.

Importing the package is cheap (Triton loads on first use). It lives inside ``hvd_ray``: a top-level
``kernels`` would shadow Hugging Face's unrelated ``kernels`` distribution, which transformers imports.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "verify_greedy": "greedy_accept",
    "verify_greedy_torch": "greedy_accept",
    "verify_greedy_triton": "greedy_accept",
    "verify_rejection": "rejection",
    "verify_rejection_torch": "rejection",
    "verify_rejection_triton": "rejection",
    "verify_tree": "tree_accept",
    "verify_tree_torch": "tree_accept",
    "verify_tree_triton": "tree_accept",
    "compact_kv": "kv_compact",
    "compact_kv_torch": "kv_compact",
    "compact_kv_triton": "kv_compact",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
