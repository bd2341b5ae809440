"""DIMR: routing masks for the VIA-SD slim verifier, the KL-type cost, the compute budget, the search.

``SlimMask`` / ``load_mask`` / ``save_mask`` (mask.py) are the stable interface the tiered
verifier consumes (``resolve_mask`` turns a mask name, artifact or spec into ``SlimTier``'s list);
cost.py, budget.py and search.py are the offline search (jobs/search_slim.py).
"""

from .mask import (
    MaskError,
    SlimMask,
    as_mask,
    describe_mask,
    load_mask,
    mask_folder,
    resolve_mask,
    save_mask,
    shipped_mask,
)

__all__ = [
    "MaskError",
    "SlimMask",
    "as_mask",
    "describe_mask",
    "load_mask",
    "mask_folder",
    "resolve_mask",
    "save_mask",
    "shipped_mask",
]
