"""Layer-skip self-drafting: the target drafts for itself with some sub-layers bypassed.

No extra weights and no extra KV cache: the slim view reads the target's exact K/V for committed
positions and scribbles past them, where the next verify forward overwrites (see ModelDrafter).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..model.transformer import SubLayer, Transformer
from .model_drafter import ModelDrafter


def default_skip(n_layers: int, n_attn: int | None = None) -> list[SubLayer]:
    """Skip attention sub-layers in the upper-middle of the stack.

    Skipping attention sub-layers keeps far more top-1 agreement than skipping whole layers at a
    similar saving (docs/design.md, "How we measure"); the first and last few layers matter most and
    are kept. A DIMR-searched mask (jobs/search_slim.py) replaces this default when one is configured.
    """
    n_attn = n_attn if n_attn is not None else max(1, n_layers * 4 // 15)
    lo, hi = n_layers // 3, n_layers - 2
    step = max(1, (hi - lo) // n_attn)
    return [(i, "attn") for i in range(lo, hi, step)][:n_attn]


def parse_skip(spec: str) -> list[SubLayer]:
    """``"attn:10-17,mlp:20"`` -> [(10, "attn"), ..., (17, "attn"), (20, "mlp")]."""
    out: list[SubLayer] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, rng = part.partition(":")
        if kind not in ("attn", "mlp", "layer") or not rng:
            raise ValueError(f"bad skip spec {part!r}; expected e.g. attn:10-17 or mlp:20 or layer:5")
        a, _, b = rng.partition("-")
        for i in range(int(a), int(b or a) + 1):
            out += [(i, "attn"), (i, "mlp")] if kind == "layer" else [(i, kind)]
    return out


class LayerSkipDrafter(ModelDrafter):
    def __init__(
        self, target: Transformer, skip: Iterable[SubLayer] | None = None, *, depth: int = 4, min_prob: float = 0.3
    ):
        skip = list(skip) if skip is not None else default_skip(target.cfg.n_layers)
        bad = [s for s in skip if not 0 <= s[0] < target.cfg.n_layers or s[1] not in ("attn", "mlp")]
        if bad:
            raise ValueError(f"invalid sub-layers to skip: {bad}")
        super().__init__(target, skip=skip, shares_target_cache=True, name="layerskip", depth=depth, min_prob=min_prob)
