"""Draft-source selection policies: the base, the τ rule, an oracle, and fixed baselines (the
cost-aware rule is ``cost_policy.py``).

Every policy makes its decision in :meth:`Policy.decide` from a :class:`StepView` (φ_t plus the
draft lengths), so the same code runs

* online, as the engine's ``policy(request, engine)`` hook: :meth:`Policy.__call__` drafts from the
  suffix drafter first (the τ rule needs the cache draft's features before choosing), builds φ_t
  with :func:`~hvd_ray.selection.features.features` and returns the engine's
  :class:`~hvd_ray.engine.Choice` — the drafter to use, the cache draft already made (so the engine
  need not draft it twice) and ŷ_t for the step record;
* offline, in trace replay (the simulated decoding run behind the history features) and in
  :func:`~hvd_ray.traces.simulate.simulate` (MAT / forwards per 1k tokens / estimated cost of each
  policy on labelled traces).

Choices are ``"cache"`` (verify the suffix draft), ``"model"`` (ask the model drafter),
``"none"`` (plain decoding step) and, for the cost policy with ``union``, ``"union"`` (both drafts as
one tree in one forward).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..drafters.base import Draft
from ..engine.costs import VERIFY_COST, interpolate
from ..engine.policy import Choice, DraftPolicy
from .features import VocabFlags, features, history_from_steps

if TYPE_CHECKING:  # pragma: no cover
    from ..engine.engine import Engine
    from ..engine.request import Request
    from .predictor import YieldPredictor

CACHE, MODEL, NONE, UNION = "cache", "model", "none", "union"

# One layer-skip draft token, relative to a 1-token target forward (8 attention sub-layers skipped).
LAYERSKIP_TOKEN_COST = 0.86
# A cache draft predicted to be taken (nearly) whole at the model drafter's budget is extended to
# the cache drafter's own length (SuffixDecoding: up to 64 tokens, by match length; ``extended``).
CONFIDENT = 0.75
LONG_MATCH = 16  # cache drafts from matches at least this long are calibrated apart (repeats)
SHADOW_WAIT = 8  # cache drafts per request waiting for the output to cover them (CostPolicy.shadow)


@dataclass
class StepView:
    """What a policy sees at one step. ``cache_len`` is the cache draft cut to the model drafter's
    budget (the draft φ_t describes), ``cache_long`` the cache drafter's own adaptive draft length
    (>= ``cache_len``; 0: the same); ``model_len`` is the model draft's nominal length
    (``min(depth, budget)``: it is not drafted yet); ``batch`` the requests sharing this step's
    forward; ``y_*`` are oracle labels (offline only). ``take`` is the policy's answer: how many
    cache draft tokens to verify (None: all of ``cache_long``)."""

    phi: np.ndarray
    cache_len: int
    model_len: int
    y_cache: int | None = None
    y_model: int | None = None
    cache_long: int = 0
    batch: int = 1
    take: int | None = None
    cache_probs: Sequence[float] = ()  # the long cache draft's per-token probabilities (tree counts)
    take_union: int | None = None  # with a union: how many cache draft tokens join the model's draft
    context: int = 0  # tokens the request's verify forward attends over (its prompt and output so far)


def verify_cost(k: int, table: dict[int, float] = VERIFY_COST) -> float:
    """Cost of one target forward over ``k`` tokens: piecewise-linear in ``table``, extrapolated
    with the last segment's slope."""
    return interpolate(table, k)


def draft_budget(req: Request, engine: Engine) -> int:
    """The engine's draft budget for ``req`` this step (the cap it truncates every draft to)."""
    return engine.draft_budget(req)


def model_curve(m: float, k: float) -> list[float]:
    """P(the model draft's first j tokens are all accepted), j = 1..k, for a draft of ``k`` tokens
    of which ``m`` are accepted on average: one per-token rate ``a`` with ``a + a^2 + ... + a^k = m``
    (the mean is all the policy measures of the model drafter)."""
    k = max(1, round(k))
    if m >= k:
        return [1.0] * k
    lo, hi = 0.0, 1.0
    for _ in range(30):  # the sum grows with a: bisect
        mid = (lo + hi) / 2
        if sum(mid**j for j in range(1, k + 1)) < m:
            lo = mid
        else:
            hi = mid
    return [lo**j for j in range(1, k + 1)]


def union_yield(cache: Sequence[float], model: Sequence[float]) -> float:
    """Expected accepted tokens of two drafts verified as one tree (the deeper accepted path), from
    each one's P(first j tokens accepted): P(either) per depth, taking the two as independent. Past
    the depth where they part the two are disjoint (both cannot match the target), so the union is
    worth a little more than this; before it they are one path, where this overrates the union,
    but there the union verifies no extra tokens. (Where they part is known only once the model has
    drafted; the choice is made before.)"""
    n = max(len(cache), len(model))
    pc = list(cache) + [0.0] * (n - len(cache))
    pm = list(model) + [0.0] * (n - len(model))
    return sum(1.0 - (1.0 - a) * (1.0 - b) for a, b in zip(pc, pm))


def extended(y: float, L0: int, take: int) -> float:
    """Expected accepted tokens of a cache draft's first ``take`` tokens from ``y``, the estimate
    for its first ``L0``: past ``L0`` the draft carries on only when confident (``CONFIDENT``), each
    further token accepted at ``a = (min(y, L0) + 1) / (L0 + 2)`` if all before it were (Laplace's
    rule of succession: a one-token window taken whole says little about the eight tokens after it,
    a 16-token one much). At the window's own rate (1.0 on a one-token window), 9-token drafts from
    1-2 token windows were rated 7-9 tokens in multi-turn chat here and got 0-2."""
    base = min(y, L0, take)
    if take <= L0 or L0 == 0:
        return base
    seen = min(y, L0)
    if seen / L0 < CONFIDENT:
        return base
    a = (seen + 1) / (L0 + 2)
    return base + a * (1 - a ** (take - L0)) / (1 - a)


def matched(draft: Draft, truth: Sequence[int]) -> int:
    """Tokens of ``draft`` (chain or tree) that greedy verification against ``truth`` accepts:
    the deepest draft path that equals a prefix of ``truth``."""
    depth: list[int] = []  # matched depth of each node (0 = not matched)
    best = 0
    for tok, par in zip(draft.token_ids, draft.parents):
        d = 0
        pd = 0 if par < 0 else depth[par]
        if (par < 0 or pd > 0) and pd < len(truth) and truth[pd] == tok:
            d = pd + 1
        depth.append(d)
        best = max(best, d)
    return best


def nominal(draft: Draft, n: int) -> Draft:
    """The first ``n`` tokens of a cache draft, rescored as the cache drafter scores a draft it was
    asked to stop at ``n`` (score = sum of its tokens' probabilities), so φ_t describes the draft
    the predictor was trained on."""
    if len(draft) <= n:
        return draft
    cut = draft.truncated(n)
    cut.score = float(sum(cut.probs)) if cut.probs else cut.score
    return cut


def unextended(draft: Draft, cache) -> int:
    """The length ``cache`` would have drafted from ``draft``'s match without its
    ``max_spec_offset`` (a drafter configured to reach past its match, as HVD's is): φ_t describes
    that draft, the one trace replay labels with SuffixDecoding's settings."""
    cfg = getattr(cache, "config", None)
    if cfg is None or not getattr(cfg, "max_spec_offset", 0):
        return len(draft)
    return int(draft.match_len * cfg.max_spec_factor + 1e-6)


class Policy(DraftPolicy, abc.ABC):
    """Base: ``decide`` picks a source; ``__call__`` is the engine hook (``engine.policy.DraftPolicy``).

    ``cache`` is the engine's ``SuffixDrafter``, ``model`` its model drafter (or None), ``flags``
    the tokenizer's :class:`VocabFlags` (policies that read φ need it).
    """

    name = "policy"
    needs_phi = True

    def __init__(self, cache=None, model=None, flags: VocabFlags | None = None):
        self.cache, self.model, self.flags = cache, model, flags

    @property
    def model_depth(self) -> int:
        return int(getattr(self.model, "depth", 0)) if self.model is not None else 0

    @abc.abstractmethod
    def decide(self, view: StepView) -> tuple[str, float | None]:
        """(source, predicted accepted length or None) for one step."""

    # ------------------------------------------------------------------ online
    def observe(self, req: Request, engine: Engine) -> tuple[StepView, Draft, Draft]:
        """Draft from the cache at its own adaptive length and build φ_t on that draft cut to the
        model drafter's budget, exactly as trace replay does. Returns (view, nominal, long draft)."""
        budget = engine.draft_budget(req)
        long_budget = max(budget, engine.draft_budget(req, self.cache))
        long = self.cache.speculate(req.req_id, long_budget)
        draft = nominal(long, min(budget, unextended(long, self.cache)))
        phi = (
            features(
                draft,
                prompt_len=len(req.prompt),
                generated=len(req.output),
                max_tokens=req.params.max_tokens,
                last_token=req.tokens[-1],
                history=history_from_steps(req.stats.steps),
                flags=self.flags,
            )
            if self.needs_phi
            else np.zeros(0, np.float32)
        )
        model_len = min(self.model_depth, budget) if self.model is not None else 0
        view = StepView(
            phi,
            len(draft),
            model_len,
            cache_long=len(long),
            batch=getattr(engine, "decoding_batch", 1),
            cache_probs=long.probs,
            context=len(req.prompt) + len(req.output),
        )
        return view, draft, long

    def __call__(self, req: Request, engine: Engine) -> Choice:
        view, _, long = self.observe(req, engine)
        return self._choice(*self.decide(view), long, view.take)

    def cache_choice(self, req: Request, engine: Engine) -> Choice:
        """The cache draft as the cache drafter alone makes it (without the reach past the match
        HVD's drafter is configured with: drafted with offset 0, the match chosen is plain suffix
        decoding's; a remote drafter's prefetched draft is cut to its match-sized length instead):
        ``SpeculationCheck``'s cache arm, which decodes a batch as suffix decoding does, with no
        decision made."""
        draft = self.cache.speculate(req.req_id, engine.draft_budget(req, self.cache), offset=0.0)
        return Choice(self.cache, draft.truncated(unextended(draft, self.cache)))

    def _choice(
        self, choice: str, predicted: float | None, draft: Draft, take: int | None = None, take_union: int | None = None
    ) -> Choice:
        if choice == CACHE:
            return Choice(self.cache, draft if take is None else draft.truncated(take), predicted)
        if choice == UNION and self.model is not None:
            return Choice(self.model, None, predicted, also=draft.truncated(take_union or len(draft)))
        if choice == MODEL and self.model is not None:
            return Choice(self.model, None, predicted)
        return Choice(None, None, predicted)


class AlwaysCache(Policy):
    name = "always-cache"
    needs_phi = False

    def decide(self, view):
        return CACHE, None


class AlwaysModel(Policy):
    name = "always-model"
    needs_phi = False

    def decide(self, view):
        return MODEL, None

    def __call__(self, req, engine):  # no need to draft from the cache at all
        return Choice(self.model, None, None)


class ScoreRule(Policy):
    """Verify the cache draft when its own score (expected accepted length by tree counts) exceeds
    ``tau``, else the model draft. No predictor; the default decoding run behind replay's history
    features."""

    name = "score-rule"

    def __init__(self, cache=None, model=None, flags=None, tau: float = 6.0):
        super().__init__(cache, model, flags)
        self.tau = tau

    def decide(self, view):
        score = float(view.phi[0])
        return (CACHE if view.cache_len > 0 and score > self.tau else MODEL), score


class TauPolicy(Policy):
    """The paper's rule: verify the cache draft when ŷ_t = g_θ(φ_t) > τ, else the model draft."""

    name = "tau"

    def __init__(self, predictor: YieldPredictor, cache=None, model=None, flags=None, tau: float = 6.0):
        super().__init__(cache, model, flags)
        self.predictor, self.tau = predictor, tau

    def decide(self, view):
        if view.cache_len == 0:
            return MODEL, 0.0
        y = float(self.predictor.predict(view.phi))
        return (CACHE if y > self.tau else MODEL), y


class OraclePolicy(Policy):
    """Offline only: the source whose draft the target accepts more of (ties go to the cache,
    whose drafting is free). Reads the labels, so it has no online form."""

    name = "oracle"
    needs_phi = False

    def decide(self, view):
        if view.y_cache is None or view.y_model is None:
            raise ValueError("OraclePolicy needs labels (offline simulation only)")
        if view.cache_len > 0 and view.y_cache >= view.y_model:
            return CACHE, float(view.y_cache)
        return (MODEL if view.model_len > 0 else NONE), float(view.y_cache)

    def __call__(self, req, engine):
        raise RuntimeError("OraclePolicy is for offline comparison (it reads the labels)")


__all__ = [
    "AlwaysCache",
    "AlwaysModel",
    "CACHE",
    "LAYERSKIP_TOKEN_COST",
    "MODEL",
    "NONE",
    "UNION",
    "OraclePolicy",
    "Policy",
    "ScoreRule",
    "StepView",
    "TauPolicy",
    "VERIFY_COST",
    "draft_budget",
    "matched",
    "nominal",
    "verify_cost",
]
