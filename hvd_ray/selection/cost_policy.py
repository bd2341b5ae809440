"""The cost rule: per step, the draft (cache, model, both as one tree, or none) with the most
expected tokens per unit of measured step time, its yield estimates calibrated online.

Built on :class:`~hvd_ray.selection.policy.Policy` (the base, the τ rule and the baselines); the
engine reaches it through ``engine.policy.DraftPolicy``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING

from ..drafters.base import Draft
from ..engine.costs import VERIFY_COST, StepCosts
from ..verification.tree import tree_depths
from .policy import (
    CACHE,
    LAYERSKIP_TOKEN_COST,
    LONG_MATCH,
    MODEL,
    NONE,
    SHADOW_WAIT,
    UNION,
    Policy,
    StepView,
    extended,
    matched,
    model_curve,
    union_yield,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..engine.request import Request
    from .predictor import YieldPredictor


class CostPolicy(Policy):
    """Most expected tokens per unit of step time among cache draft, model draft and no draft.

    Step time comes from ``costs`` (:class:`~hvd_ray.engine.costs.StepCosts`: the engine's forward
    timed on this hardware at start-up; a plain table offline). In a batch of ``B = view.batch``
    requests a rate is the batch's: ``(B + ŷ_L) / cost(B + L)`` for this request drafting ``L``
    tokens and the others none (a packed forward: each row pays for its own tokens), so a draft
    has to pay for its width against ``B`` plain tokens, not one. At ``B = 1``, as follows.

    cache: ``(ŷ_L + 1) / cost(1 + L)`` for the best length ``L`` of the cache draft (suffix drafting
    is ~free), where ``ŷ_L = min(ŷ·s, L)`` and, when ``ŷ·s`` says the draft is taken (nearly) whole at
    the model budget (>= ``CONFIDENT``), the draft carries on to the cache drafter's own adaptive
    length (SuffixDecoding's up-to-64-token drafts on long matches) at a rate the window's length
    vouches for (``extended``);
    model: ``(min(m, k) + 1) / (cost(1 + k) + drafting)`` with ``k`` the model draft's nominal length
    and ``m`` its mean accepted length (``model_accept``; default: the predictor artifact's
    training-set mean of ``y_model``, else 1.0); none: ``1 / cost(1)``.

    Online the model side calibrates itself from the engine's step records (``adapt`` = weight of
    each new measurement in an exponential average; 0 keeps the priors, as offline simulation does):
    the model drafts' mean accepted length, their actual length (drafters may stop early) and their
    drafting time in units of a one-token target forward (timed from the verify forwards). The
    priors only matter until the first model steps; an optimistic prior makes the policy try the
    model drafter and learn what it is worth here, on this hardware.

    The model's acceptance and draft length are judged per request: each request starts from the
    prior (worth ``prior_steps`` model steps; the nominal length for drafts) and moves to its own
    means as its model steps come in. A global average would let one workload price the model out
    for the next, and a priced-out drafter is never re-measured.

    The cache side has two estimates, each calibrated online per tree (request / global) and match
    length (``LONG_MATCH``: a long match is usually a repeat): the predictor's ``ŷ`` times ``s``
    (measured accepted over predicted), and the draft's own tree probabilities (their sum over the
    first ``L`` tokens) times ``r`` (measured accepted over that sum). Per bucket the policy uses
    the one with the smaller recent squared error: the predictor where it was trained (cold
    histories), the tree where it was not (a warm history repeating an answer, where ŷ stays low or
    even negative while whole drafts are accepted). Both are measured on *every* step, not only on
    steps that verified a cache draft: the cache draft made to decide is compared with the tokens
    the step emitted (exact for greedy decoding; a lower bound when it matched them all), so a tree
    that fell out of favour after one bad draft is re-measured at once instead of never again.

    ``union`` (a lone request only): a fourth choice, both drafts as one tree in one forward. Its
    yield is ``union_yield`` of the cache draft's and the model draft's per-depth acceptance (the
    cache's estimate spread over its tree probabilities, the model's mean as a constant per-token
    rate); it pays where the cache draft is doubtful and the model draft is cheap: the cache part
    costs verified tokens only, no drafting and no second forward. The model side learns from a
    union step what its own draft got (``StepRecord.union``).
    """

    name = "cost"

    def __init__(
        self,
        predictor: YieldPredictor,
        cache=None,
        model=None,
        flags=None,
        *,
        cost_table: dict[int, float] | StepCosts = VERIFY_COST,
        model_token_cost: float = LAYERSKIP_TOKEN_COST,
        model_accept: float | None = None,
        adapt: float = 0.05,
        prior_steps: float = 2.0,
        union: bool = False,
    ):
        super().__init__(cache, model, flags)
        self.union = union
        self.costs = cost_table if isinstance(cost_table, StepCosts) else StepCosts(dict(cost_table))
        self.table = self.costs.table
        self.predictor, self.model_token_cost = predictor, model_token_cost
        if model_accept is None:
            model_accept = float(getattr(predictor, "meta", {}).get("model_mean_accept", 1.0))
        if not 0.0 <= adapt <= 1.0:
            raise ValueError(f"adapt must be in [0, 1], got {adapt}")
        self.model_accept, self.adapt = model_accept, adapt
        self.prior_accept, self.prior_steps = model_accept, prior_steps
        self._per_req: OrderedDict[str, list[float]] = OrderedDict()  # req -> [model steps, accepted, drafted]
        # cache side: measured accepted / predicted, per tree and match length (``cache_key``)
        self.cache_scale: dict[str, float] = {}  # s: predictor scale
        self.tree_scale: dict[str, float] = {}  # r: tree-probability scale
        self._cache_sums: dict[str, list[float]] = {}
        self._tree_sums: dict[str, list[float]] = {}
        self._errors: dict[str, list[float]] = {}  # EMA squared error of [predictor, tree]
        # the cache drafts of a live request's recent decisions, waiting to be scored (``shadow``):
        # (draft, ŷ, key, output length then, take, nominal length, depth)
        self._shadow: OrderedDict[str, list[tuple]] = OrderedDict()
        self.model_len_seen: float | None = None  # measured mean model-draft length
        self.model_draft_cost: float | None = None  # measured drafting time per model draft, in forwards
        self.forward_s: float | None = None  # measured time of a one-token target forward
        self._batch = 1
        # a benchmark sets a list here to audit the cache side: one (request id, output position,
        # ŷ, calibrated estimate, nominal length, long draft) per decision with a cache draft
        self.audit: list | None = None

    @staticmethod
    def cache_key(source: str | None, match_len: int = 0, generated: int | None = None) -> str | None:
        """The calibration bucket of a cache draft: its tree, and whether its match is long or
        covers the whole output so far (at least 4 tokens of it): the request is repeating an answer
        (a retry, an agent re-sending context) and the draft is usually taken whole."""
        if source is None:
            return None
        repeat = generated is not None and 4 <= generated <= match_len
        return f"{source}/long" if match_len >= LONG_MATCH or repeat else source

    def uses_tree(self, key: str | None) -> bool:
        """Whether the tree-probability estimate is the one to use for this bucket: where it has
        erred less lately; in a long-match bucket (out of the predictor's training range, where
        ŷ swings from below 0 to 7 over drafts that are all taken whole) unless the predictor has
        erred less than half as much."""
        err = self._errors.get(key)
        if key is not None and key.endswith("/long"):
            return err is None or not err[0] < 0.5 * err[1]
        return err is not None and key in self.tree_scale and err[1] < err[0]

    def by_tree(self, view: StepView, y: float, key: str | None) -> bool:
        """Whether to rate this cache draft by its tree probabilities: where they have been the
        better estimate (``uses_tree``), and wherever the predictor says nothing (``y <= 0``: below
        its training range it is not an estimate; such drafts were taken for 1.1 tokens on average
        at batch 8, about what their tree probabilities said, while rated at 0 they were declined)."""
        return bool(view.cache_probs) and (y <= 0 or self.uses_tree(key))

    def tree_yield(self, view: StepView, take: int, key: str | None) -> float:
        return min(float(take), self.tree_scale.get(key, 1.0) * float(sum(view.cache_probs[:take])))

    def cache_yield(self, y: float, view: StepView, take: int, key: str | None = None) -> float:
        """Expected accepted tokens of the first ``take`` tokens of the cache draft, from ``y`` (the
        calibrated estimate for the draft cut to ``view.cache_len``) or, where it has been the
        better estimate, from the draft's calibrated tree probabilities. Past ``view.cache_len`` (the
        window both were calibrated on) a draft carries on only when it is confident (``extended``),
        or in a long-match bucket (a repeat, where the tree's probabilities hold over the whole draft)."""
        L0 = view.cache_len
        if self.by_tree(view, y, key):
            if take <= L0 or L0 == 0 or (key or "").endswith("/long"):
                return self.tree_yield(view, take, key)
            y = self.tree_yield(view, L0, key)
        return extended(y, L0, take)

    def rates(
        self,
        view: StepView,
        y: float,
        tree: str | None = None,
        model_accept: float | None = None,
        model_len: float | None = None,
    ) -> dict[str, float]:
        # the batch's tokens per unit of forward time, this row drafting and the others not (a packed
        # forward: each row pays for its own tokens); at batch 1, this row's own rate
        B = max(1, view.batch)
        c = lambda width: self.costs.batch(B, B - 1 + width, view.context)  # noqa: E731
        r = {NONE: B / c(1)}
        if view.cache_len > 0:
            y = max(y, 0.0) * self.cache_scale.get(tree, 1.0)
            best = None
            for take in self._takes(view, short=B > 1):
                rate = (B + self.cache_yield(y, view, take, tree)) / c(1 + take)
                if best is None or rate > best[0]:
                    best = (rate, take)
            r[CACHE] = best[0]
            view.take = best[1]
        k = view.model_len
        if k > 0:
            seen = model_len if model_len is not None else self.model_len_seen
            kk = min(seen, k) if seen is not None else k
            draft = self.model_draft_cost if self.model_draft_cost is not None else k * self.model_token_cost
            m = self.model_accept if model_accept is None else model_accept
            r[MODEL] = (B + min(m, kk)) / (c(1 + kk) + draft)
            if self.union and B == 1 and view.cache_len > 0:
                curve = model_curve(m, kk)
                best = None
                for take in self._takes(view, short=True):  # a short prefix too: it costs no drafting here
                    rate = (1 + union_yield(self.cache_curve(y, view, take, tree), curve)) / (c(1 + take + kk) + draft)
                    if best is None or rate > best[0]:
                        best = (rate, take)
                r[UNION] = best[0]
                view.take_union = best[1]
        return r

    @staticmethod
    def _takes(view: StepView, short: bool) -> list[int]:
        """The cache draft lengths the policy prices: the nominal and the longest draft, powers of two
        between them and, with ``short`` (under load; in a union), a prefix of 1 or 2 tokens (a
        doubtful draft may pay for a token or two)."""
        longest = max(view.cache_long, view.cache_len)
        few = {n for n in (1, 2) if n < view.cache_len} if short else set()
        return sorted({view.cache_len, longest} | few | {n for n in (4, 8, 16, 32) if view.cache_len < n < longest})

    def cache_curve(self, y: float, view: StepView, take: int, key: str | None) -> list[float]:
        """P(the cache draft's first j tokens are all accepted), j = 1..take: its expected yield
        (``cache_yield``; ``y`` calibrated) spread over the depths as its tree probabilities (each a
        path's probability, so falling along the draft) fall, each at most 1."""
        probs = [float(p) for p in view.cache_probs[:take]]
        mass = sum(probs)
        if mass <= 0:
            return []
        k = self.cache_yield(y, view, take, key) / mass
        return [min(1.0, p * k) for p in probs]

    def model_step(self, rec) -> tuple[int, int] | None:
        """(accepted, drafted) of the model drafter's own draft in step ``rec``: a model step's, or
        the model part of a union step's; None for other steps and for a draft the batch's sizing cut
        (it says little about the drafter, and would talk the next cut down)."""
        if self.model is None or rec.capped:
            return None
        if rec.source == self.model.name:
            return rec.accepted, rec.drafted
        if rec.union is not None:
            return rec.union[1], rec.union[0]
        return None

    def learn(self, rec) -> None:
        """Fold one measured step (``engine.request.StepRecord``) into the model-side estimates."""
        a = self.adapt
        if a == 0.0:
            return
        ema = lambda old, x: x if old is None else (1 - a) * old + a * x  # noqa: E731
        if rec.verify_s > 0:
            self.forward_s = ema(
                self.forward_s, rec.verify_s / self.costs.per_row(1 + rec.drafted, self._batch, rec.context)
            )
        own = self.model_step(rec)
        if own is not None:
            self.model_accept = ema(self.model_accept, float(own[0]))
            self.model_len_seen = ema(self.model_len_seen, float(own[1]))
            if self.forward_s:
                # Start from the prior and clip outliers: the first model draft of a request also
                # runs the head over its prompt (EAGLE-3's lazy catch-up, charged to this request
                # alone: Draft.setup_s); taken at face value that one step would price the model
                # drafter out for good, and it would never be tried (and re-measured) again.
                cur = self.model_draft_cost
                if cur is None:
                    cur = max(1.0, self.model_len_seen) * self.model_token_cost
                self.model_draft_cost = ema(cur, min(rec.draft_s / self.forward_s, 3.0 * cur))

    def learn_cache(
        self,
        key: str,
        accepted: float,
        predicted: float,
        tree_mass: float | None = None,
        nominal: tuple[float, float] | None = None,
    ) -> None:
        """Fold one cache-draft outcome into its bucket: ``accepted`` tokens where the (uncalibrated)
        prediction was ``predicted`` and the draft's tree probabilities summed to ``tree_mass``.
        ``nominal``: (accepted, tree mass) within the window ŷ describes, when the draft reached
        past it: both estimates learn and are scored there. (The tree's scale once learned over the
        whole draft: a long draft's probabilities sum to far more than the few tokens a cold draft
        keeps, so the scale fell to ~0.1 and rated the short drafts that pay under load at a quarter
        of what they yield.) Each estimate is scored (squared error) before it learns."""
        a = self.adapt
        if a == 0.0 or key is None:
            return
        if tree_mass is not None:
            got, mass = nominal if nominal is not None else (accepted, tree_mass)
            err = self._errors.setdefault(key, [0.0, 0.0])
            by_pred = min(predicted * self.cache_scale.get(key, 1.0), max(predicted, mass, got))
            by_tree = mass * self.tree_scale.get(key, 1.0)
            err[0] = (1 - a) * err[0] + a * (got - by_pred) ** 2
            err[1] = (1 - a) * err[1] + a * (got - by_tree) ** 2
            tsums = self._tree_sums.setdefault(key, [0.0, 0.0])
            tsums[0] = (1 - a) * tsums[0] + a * got
            tsums[1] = (1 - a) * tsums[1] + a * mass
            accepted = got
            if tsums[1] > 0.05:
                # (> 1 is real: a live request counts in its own global-tree base, halving its probabilities)
                self.tree_scale[key] = min(4.0, max(0.01, tsums[0] / tsums[1]))
        sums = self._cache_sums.setdefault(key, [0.0, 0.0])  # EMAs of accepted, predicted
        sums[0] = (1 - a) * sums[0] + a * accepted
        sums[1] = (1 - a) * sums[1] + a * predicted
        if sums[1] > 0.05:
            self.cache_scale[key] = min(16.0, max(0.1, sums[0] / sums[1]))

    def shadow(self, req: Request, rec) -> None:
        """Score the cache drafts earlier decisions saw against the tokens emitted since (see the
        class docstring): the verified tokens on a cache step, a shadow label on any other. A draft
        is scored over its whole length once the output leaves it or covers it, and waits until then
        (at most ``SHADOW_WAIT`` per request; older ones are scored on what was emitted): scored on
        the one or two tokens a model step emits, where tree probabilities are near 1, the tree's
        scale would overrate long drafts, and a batch's drafts are cut by exactly that estimate."""
        pending = self._shadow.get(req.req_id)
        if not pending or rec is None:
            return
        waiting = []
        for i, seen in enumerate(reversed(pending)):  # newest first: the oldest are cut at the limit
            draft, y, key, n0, take, L0, depth = seen
            emitted = req.output[n0:]
            got = matched(draft, emitted)
            if got < len(emitted) or len(emitted) >= depth:  # left it or covered it: score it whole
                window = len(draft)
            elif i < SHADOW_WAIT:
                waiting.append(seen)
                continue
            else:
                window = min(len(draft), len(emitted))
            if window > 0:
                w0 = min(window, L0)
                self.learn_cache(
                    key,
                    float(got),
                    min(max(y, 0.0), float(w0)),
                    float(sum(draft.probs[:window])),
                    nominal=(float(min(got, w0)), float(sum(draft.probs[:w0]))),
                )
        self._shadow[req.req_id] = waiting[::-1]

    def decide(self, view, tree: str | None = None, model_accept: float | None = None, model_len: float | None = None):
        y = float(self.predictor.predict(view.phi)) if view.cache_len > 0 else 0.0
        r = self.rates(view, y, tree, model_accept, model_len)
        return max(r, key=r.get), y

    def request_model(self, req_id: str, nominal: int, rec=None) -> tuple[float, float | None]:
        """The model drafter's expected (acceptance, draft length) for one request, after folding in
        ``rec`` (its latest step record, if any): the prior (acceptance) and ``nominal`` (length),
        each worth ``prior_steps`` model steps, averaged with the request's own model steps. The
        length is None when the policy does not adapt (the global estimate applies)."""
        st = self._per_req.get(req_id)
        if st is None:
            st = self._per_req[req_id] = [0.0, 0.0, 0.0]  # model steps, accepted, drafted
            while len(self._per_req) > 4096:  # finished requests age out
                self._per_req.popitem(last=False)
        own = self.model_step(rec) if rec is not None else None
        if own is not None:
            st[0] += 1
            st[1] += own[0]
            st[2] += own[1]
        if self.adapt == 0.0:
            return self.model_accept, None
        w = self.prior_steps + st[0]
        return (self.prior_steps * self.prior_accept + st[1]) / w, (self.prior_steps * nominal + st[2]) / w

    def __call__(self, req, engine):
        rec = req.stats.steps[-1] if req.stats.steps else None  # each record is seen once
        self._batch = getattr(engine, "decoding_batch", 1)
        if rec is not None:
            self.learn(rec)
        self.shadow(req, rec)
        view, draft, long = self.observe(req, engine)
        m, m_len = self.request_model(req.req_id, view.model_len, rec)
        key = self.cache_key(draft.source, draft.match_len, len(req.output))
        choice, y = self.decide(view, key, m, m_len)
        if len(long) and self.audit is not None:
            est = self.cache_yield(max(y, 0.0) * self.cache_scale.get(key, 1.0), view, view.cache_len, key)
            self.audit.append((req.req_id, len(req.output), y, est, view.cache_len, long))
        self.remember(req.req_id, long, y, key, len(req.output), view)
        out = self._choice(choice, y, long, view.take, view.take_union)
        if view.batch > 1:  # a lone request's draft is already sized (view.take)
            out.gains = self.gains(choice, view, y, key, m)
        return out

    def remember(self, req_id: str, long: Draft, y: float, key: str | None, generated: int, view: StepView) -> None:
        """Keep the cache draft a decision saw (``long``, made when the output was ``generated``
        tokens long) until the tokens emitted after it can score it (:meth:`shadow`)."""
        if not len(long):
            return
        self._shadow.setdefault(req_id, []).append(
            (long, y, key, generated, view.take, view.cache_len, max(tree_depths(long.parents)))
        )
        self._shadow.move_to_end(req_id)
        while len(self._shadow) > 1024:  # finished requests age out
            self._shadow.popitem(last=False)

    def gains(self, choice: str, view: StepView, y: float, key: str | None, model_accept: float) -> list[float]:
        """Expected accepted tokens of the chosen draft cut to 0, 1, 2, ... tokens (the engine
        sizes the batch's drafts together from these: ``engine.costs.batch_lengths``)."""
        if choice == CACHE:
            y = max(y, 0.0) * self.cache_scale.get(key, 1.0)
            take = view.take if view.take is not None else max(view.cache_long, view.cache_len)
            if self.by_tree(view, y, key):  # tree_yield at every length, one pass
                r = self.tree_scale.get(key, 1.0)
                mass = [0.0, *itertools.accumulate(float(p) for p in view.cache_probs[:take])]
                out = [min(float(j), r * mass[min(j, len(mass) - 1)]) for j in range(take + 1)]
                L0 = view.cache_len
                if (key or "").endswith("/long") or take <= L0:
                    return out
                return out[: L0 + 1] + [extended(out[L0], L0, j) for j in range(L0 + 1, take + 1)]
            return [self.cache_yield(y, view, j, key) for j in range(take + 1)]
        if choice == MODEL and self.model is not None:
            return [min(model_accept, float(j)) for j in range(view.model_len + 1)]
        return [0.0]
