"""DIMR: routing masks for the VIA-SD slim verifier, the KL-type cost, the compute budget, the search.

``SlimMask`` / ``load_mask`` / ``save_mask`` (mask.py) are the stable interface the tiered
verifier consumes (``resolve_mask`` turns a mask name, artifact or spec into ``SlimTier``'s list);
the rest is the offline search (jobs/search_slim.py): cost.py (the KL-type cost), budget.py (measured
sub-layer times), calibration.py (the calibration set), evaluator.py (scoring a mask), space.py (the
budget-meeting search space), greedy.py (the greedy baseline), samplers.py (TPE interleaved with
random trials) and search.py (the search on Ray Tune).
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
