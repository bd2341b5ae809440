"""The DIMR search space: one score in [0, 1] per skippable sub-layer, decoded into a mask.

There are 2·(L−1) scores (layer 0 is always kept). :func:`decode` keeps sub-layers in descending
score order whenever they still fit the budget and skips the rest, so *every* point of the space is
a mask that meets the budget (kept fraction of measured block time ≤ budget, as full as the budget
allows): no rejected or penalised trials. Random search draws scores uniformly; TPE learns which
sub-layers deserve high scores.

**Warm start.** Uniformly random masks at a tight budget are very poor, so the search is seeded
with masks that rank sub-layers by single-drop sensitivity (and sensitivity per unit of time) plus
noisy copies (:func:`screen_seeds`), and with the hand-written layer-skip heuristic
(:func:`prior_scores`).
"""

from __future__ import annotations

import random

from .budget import SubLayerCosts
from .mask import SUBS, SlimMask, SubLayer


def param_name(sub: SubLayer) -> str:
    """A sub-layer's search parameter name, e.g. ``mlp07`` (kind, then the layer in two digits)."""
    return f"{sub[1]}{sub[0]:02d}"


def parse_param(name: str) -> SubLayer:
    """The sub-layer of a parameter name (the inverse of :func:`param_name`)."""
    kind, layer = name[:-2], name[-2:]
    if kind not in SUBS or not layer.isdigit():
        raise ValueError(f"bad sub-layer parameter {name!r}")
    return int(layer), kind


def decode(scores: dict[str, float], costs: SubLayerCosts, budget: float) -> SlimMask:
    """Scores -> the mask that keeps high-score sub-layers while they fit ``budget`` (see module doc)."""
    L = costs.n_layers
    total = costs.block_total
    used = sum(costs.cost((0, k)) for k in SUBS)
    if used / total > budget + 1e-12:
        raise ValueError(f"budget {budget} is below layer 0's share of block time ({used / total:.3f})")
    cands = SlimMask.candidates(L)
    order = sorted(cands, key=lambda c: (-scores[param_name(c)], c))
    skip = []
    for c in order:
        if (used + costs.cost(c)) / total <= budget + 1e-12:
            used += costs.cost(c)
        else:
            skip.append(c)
    return SlimMask(L, tuple(skip))


def prior_scores(n_layers: int) -> dict[str, float]:
    """The hand-written layer-skip heuristic as a point of the space (one warm-start trial).

    MLPs rank above attention, and within a kind the layers far from the upper middle (~0.6 L,
    where ``drafters.layerskip.default_skip`` skips attention) rank higher.
    """
    c = 0.6 * n_layers
    return {
        param_name((i, k)): (0.5 if k == "mlp" else 0.0) + 0.5 * abs(i - c) / n_layers
        for i, k in SlimMask.candidates(n_layers)
    }


def screen_seeds(
    sens: dict[str, float], costs: SubLayerCosts, n: int, seed: int = 0, noise: float = 0.15
) -> list[dict[str, float]]:
    """Warm-start points from single-drop sensitivities ``sens`` (objective with only that sub-layer
    skipped): rank by sensitivity and by sensitivity per unit of measured time (the knapsack
    ratio), then ``n − 2`` copies of those with Gaussian noise on the normalised ranks."""
    names = list(sens)

    def ranked(key) -> dict[str, float]:
        order = sorted(names, key=key)
        return {k: (i + 1) / (len(order) + 1) for i, k in enumerate(order)}

    base = [ranked(lambda k: sens[k]), ranked(lambda k: sens[k] / costs.cost(parse_param(k)))]
    rng = random.Random(seed)
    out = list(base)
    while len(out) < n:
        b = base[len(out) % 2]
        out.append({k: min(1.0, max(0.0, v + rng.gauss(0.0, noise))) for k, v in b.items()})
    return out[:n]


def random_scores(n_layers: int, rng: random.Random) -> dict[str, float]:
    """A uniformly random point of the space (the random-mask baseline)."""
    return {param_name(c): rng.random() for c in SlimMask.candidates(n_layers)}
