"""The greedy baseline for DIMR: drop, one at a time, the sub-layer whose removal costs least."""

from __future__ import annotations

from collections.abc import Callable

from .budget import SubLayerCosts
from .mask import SlimMask, SubLayer
from .space import param_name


def greedy_search(
    evaluate: Callable[[list[SubLayer]], dict],
    costs: SubLayerCosts,
    budget: float,
    *,
    metric: str = "kl",
    recheck: int = 0,
    first: dict[SubLayer, float] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[SlimMask, dict]:
    """The greedy baseline: drop, one at a time, the sub-layer whose removal raises ``metric`` least.

    ``recheck = 0`` re-scores every remaining candidate each step (O(n²) evaluations); ``recheck = m``
    is lazy greedy: after the first full pass only the ``m`` candidates that were cheapest to drop
    in the previous step are re-scored. ``first`` supplies the first pass (single-drop ``metric``
    values, e.g. from the DIMR sensitivity screen) instead of evaluating it again.
    """
    L = costs.n_layers
    skip: list[SubLayer] = []
    last: dict[SubLayer, float] = {}
    evals = 0
    while costs.kept_fraction(skip) > budget + 1e-12:
        pool = [c for c in SlimMask.candidates(L) if c not in skip]
        if recheck and last:
            pool = sorted(pool, key=lambda c: last.get(c, float("inf")))[:recheck]
        for c in pool:
            if not skip and first is not None:
                last[c] = first[c]
            else:
                last[c] = evaluate(skip + [c])[metric]
                evals += 1
        best = min(pool, key=lambda c: last[c])
        value = last.pop(best)
        skip.append(best)
        if progress:
            progress(
                f"greedy: drop {param_name(best)} -> {metric}={value:.4f} "
                f"kept={costs.kept_fraction(skip):.3f} ({evals} evals)"
            )
    return SlimMask(L, tuple(skip)), {"evals": evals}
