"""Draft-source selection policies: the τ rule, a cost-aware rule, an oracle, and fixed baselines.

Every policy makes its decision in :meth:`Policy.decide` from a :class:`StepView` (φ_t plus the
draft lengths), so the same code runs

* online, as the engine's ``policy(request, engine)`` hook: :meth:`Policy.__call__` drafts from the
  suffix drafter first (the τ rule needs the cache draft's features before choosing), builds φ_t
  with :func:`~hvd_ray.selection.features.features` and returns the engine's
  :class:`~hvd_ray.engine.Choice` — the drafter to use, the cache draft already made (so the engine
  need not draft it twice) and ŷ_t for the step record;
* offline, in trace replay (the simulated decoding run behind the history features) and in
  :func:`simulate` (MAT / forwards per 1k tokens / estimated cost of each policy on labelled
  traces).

Choices are ``"cache"`` (verify the suffix draft), ``"model"`` (ask the model drafter) and
``"none"`` (plain decoding step).
"""

from __future__ import annotations

import abc
import bisect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..drafters.base import Draft
from ..engine.engine import Choice
from .features import VocabFlags, features, history_from_steps, with_history

if TYPE_CHECKING:  # pragma: no cover
    from ..engine.engine import Engine
    from ..engine.request import Request
    from .predictor import YieldPredictor

CACHE, MODEL, NONE = "cache", "model", "none"

# One target forward scoring k tokens, relative to k = 1 (DESIGN.md: SmolLM2-135M, bf16, 2 threads).
VERIFY_COST = {1: 1.00, 8: 1.20, 16: 1.32, 32: 1.71}
# One layer-skip draft token, relative to a 1-token target forward (8 attention sub-layers skipped).
LAYERSKIP_TOKEN_COST = 0.86


@dataclass
class StepView:
    """What a policy sees at one step. ``model_len`` is the model draft's nominal length
    (``min(depth, budget)``: it is not drafted yet); ``y_*`` are oracle labels (offline only)."""

    phi: np.ndarray
    cache_len: int
    model_len: int
    y_cache: int | None = None
    y_model: int | None = None


def verify_cost(k: int, table: dict[int, float] = VERIFY_COST) -> float:
    """Cost of one target forward over ``k`` tokens: piecewise-linear in ``table``, extrapolated
    with the last segment's slope."""
    ks = sorted(table)
    if k <= ks[0]:
        return table[ks[0]]
    i = bisect.bisect_left(ks, k)
    if i < len(ks) and ks[i] == k:
        return table[k]
    a, b = (ks[i - 1], ks[i]) if i < len(ks) else (ks[-2], ks[-1])
    return table[a] + (table[b] - table[a]) * (k - a) / (b - a)


def draft_budget(req: "Request", engine: "Engine") -> int:
    """The engine's draft budget for ``req`` this step (the cap it truncates every draft to)."""
    return engine.draft_budget(req)


class Policy(abc.ABC):
    """Base: ``decide`` picks a source; ``__call__`` is the engine hook.

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
    def observe(self, req: "Request", engine: "Engine") -> tuple[StepView, Draft]:
        """Draft from the cache and build φ_t exactly as trace replay does."""
        budget = draft_budget(req, engine)
        draft = self.cache.speculate(req.req_id, budget)
        phi = (features(draft, prompt_len=len(req.prompt), generated=len(req.output),
                        max_tokens=req.params.max_tokens, last_token=req.tokens[-1],
                        history=history_from_steps(req.stats.steps), flags=self.flags)
               if self.needs_phi else np.zeros(0, np.float32))
        model_len = min(self.model_depth, budget) if self.model is not None else 0
        return StepView(phi, len(draft), model_len), draft

    def __call__(self, req: "Request", engine: "Engine") -> Choice:
        view, draft = self.observe(req, engine)
        return self._choice(*self.decide(view), draft)

    def _choice(self, choice: str, predicted: float | None, draft: Draft) -> Choice:
        if choice == CACHE:
            return Choice(self.cache, draft, predicted)
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

    def __init__(self, predictor: "YieldPredictor", cache=None, model=None, flags=None,
                 tau: float = 6.0):
        super().__init__(cache, model, flags)
        self.predictor, self.tau = predictor, tau

    def decide(self, view):
        if view.cache_len == 0:
            return MODEL, 0.0
        y = float(self.predictor.predict(view.phi))
        return (CACHE if y > self.tau else MODEL), y


class CostPolicy(Policy):
    """Most expected tokens per unit of step time among cache draft, model draft and no draft.

    cache: ``(min(ŷ, len) + 1) / verify_cost(1 + len)`` (suffix drafting is ~free);
    model: ``(min(m, k) + 1) / (verify_cost(1 + k) + k * model_token_cost)`` with ``k`` the model
    draft's nominal length and ``m`` its mean accepted length (``model_accept``; default: the
    predictor artifact's training-set mean of ``y_model``, else 1.0); none: ``1 / verify_cost(1)``.

    Online the model side calibrates itself from the engine's step records (``adapt`` = weight of
    each new measurement in an exponential average; 0 keeps the priors, as offline simulation does):
    the model drafts' mean accepted length, their actual length (drafters may stop early) and their
    drafting time in units of a one-token target forward (timed from the verify forwards). The
    priors only matter until the first model steps; an optimistic prior makes the policy try the
    model drafter and learn what it is worth here, on this hardware.

    The model's acceptance and draft length are judged per request: each request starts from the
    prior (worth ``prior_steps`` model steps; the nominal length for drafts) and moves to its own
    means as its model steps come in. A global average would let one workload (long function-calling
    prompts the head drafts poorly, or one chat draft cut to nothing by the head's confidence floor)
    price the model out for the next (code, where it pays), and a priced-out drafter is never
    re-measured.
    The cache side is calibrated per tree (request / global): measured accepted over predicted.
    """

    name = "cost"

    def __init__(self, predictor: "YieldPredictor", cache=None, model=None, flags=None, *,
                 cost_table: dict[int, float] = VERIFY_COST, model_token_cost: float = LAYERSKIP_TOKEN_COST,
                 model_accept: float | None = None, adapt: float = 0.05, prior_steps: float = 2.0):
        super().__init__(cache, model, flags)
        self.predictor, self.table, self.model_token_cost = predictor, dict(cost_table), model_token_cost
        if model_accept is None:
            model_accept = float(getattr(predictor, "meta", {}).get("model_mean_accept", 1.0))
        if not 0.0 <= adapt <= 1.0:
            raise ValueError(f"adapt must be in [0, 1], got {adapt}")
        self.model_accept, self.adapt = model_accept, adapt
        self.prior_accept, self.prior_steps = model_accept, prior_steps
        self._per_req: OrderedDict[str, list[float]] = OrderedDict()  # req -> [model steps, accepted, drafted]
        # cache side: measured accepted / predicted on verified cache drafts, per tree (request /
        # global), so a predictor that is biased on this workload is corrected online
        self.cache_scale: dict[str, float] = {}
        self._cache_sums: dict[str, list[float]] = {}
        self.model_len_seen: float | None = None  # measured mean model-draft length
        self.model_draft_cost: float | None = None  # measured drafting time per model draft, in forwards
        self.forward_s: float | None = None  # measured time of a one-token target forward

    def rates(self, view: StepView, y: float, tree: str | None = None,
              model_accept: float | None = None, model_len: float | None = None) -> dict[str, float]:
        r = {NONE: 1.0 / verify_cost(1, self.table)}
        if view.cache_len > 0:
            y = max(y, 0.0) * self.cache_scale.get(tree, 1.0)
            r[CACHE] = (min(y, view.cache_len) + 1) / verify_cost(1 + view.cache_len, self.table)
        k = view.model_len
        if k > 0:
            seen = model_len if model_len is not None else self.model_len_seen
            kk = min(seen, k) if seen is not None else k
            draft = self.model_draft_cost if self.model_draft_cost is not None else k * self.model_token_cost
            m = self.model_accept if model_accept is None else model_accept
            r[MODEL] = (min(m, kk) + 1) / (verify_cost(1 + kk, self.table) + draft)
        return r

    def learn(self, rec) -> None:
        """Fold one measured step (``engine.request.StepRecord``) into the model-side estimates."""
        a = self.adapt
        if a == 0.0:
            return
        ema = lambda old, x: x if old is None else (1 - a) * old + a * x  # noqa: E731
        if rec.verify_s > 0:
            self.forward_s = ema(self.forward_s, rec.verify_s / verify_cost(1 + rec.drafted, self.table))
        if rec.source.startswith("suffix") and rec.predicted is not None and rec.drafted > 0:
            sums = self._cache_sums.setdefault(rec.source, [0.0, 0.0])  # EMAs of accepted, predicted
            sums[0] = (1 - a) * sums[0] + a * rec.accepted
            sums[1] = (1 - a) * sums[1] + a * min(max(rec.predicted, 0.0), rec.drafted)
            if sums[1] > 0.05:
                self.cache_scale[rec.source] = min(4.0, max(0.25, sums[0] / sums[1]))
        if self.model is not None and rec.source == getattr(self.model, "name", None):
            self.model_accept = ema(self.model_accept, float(rec.accepted))
            self.model_len_seen = ema(self.model_len_seen, float(rec.drafted))
            if self.forward_s:
                # Start from the prior and clip outliers: the first model draft of a request also
                # runs the head over the whole prompt (EAGLE-3's lazy catch-up); taken at face value
                # that one step would price the model drafter out for good, and it would never be
                # tried (and re-measured) again.
                cur = self.model_draft_cost
                if cur is None:
                    cur = max(1.0, self.model_len_seen) * self.model_token_cost
                self.model_draft_cost = ema(cur, min(rec.draft_s / self.forward_s, 3.0 * cur))

    def decide(self, view, tree: str | None = None, model_accept: float | None = None,
               model_len: float | None = None):
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
        if rec is not None and self.model is not None and rec.source == getattr(self.model, "name", None):
            st[0] += 1
            st[1] += rec.accepted
            st[2] += rec.drafted
        if self.adapt == 0.0:
            return self.model_accept, None
        w = self.prior_steps + st[0]
        return (self.prior_steps * self.prior_accept + st[1]) / w, (self.prior_steps * nominal + st[2]) / w

    def __call__(self, req, engine):
        rec = req.stats.steps[-1] if req.stats.steps else None  # each record is seen once
        if rec is not None:
            self.learn(rec)
        view, draft = self.observe(req, engine)
        m, m_len = self.request_model(req.req_id, view.model_len, rec)
        return self._choice(*self.decide(view, draft.source, m, m_len), draft)


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


# ---------------------------------------------------------------------------------------------
# Offline comparison on labelled traces
@dataclass
class TraceLabels:
    """One trace's labels indexed by position t (index 0 unused: t = 0 is prefill)."""

    n: int  # output length
    phi: np.ndarray  # [n, F]
    cache_len: np.ndarray
    y_cache: np.ndarray
    model_len: np.ndarray  # the model draft actually made at t
    y_model: np.ndarray
    budget: np.ndarray


@dataclass
class SimResult:
    traces: int = 0
    tokens: int = 0  # generated tokens (the prefill's first token included)
    steps: int = 0  # decode (verify) forwards
    cache_steps: int = 0
    model_steps: int = 0
    accepted: int = 0  # draft tokens accepted (within the trace)
    cost: float = 0.0  # decode cost in units of a 1-token target forward (verify + model drafting)
    predicted: list[float] = field(default_factory=list)

    def add(self, o: "SimResult") -> None:
        for k in ("traces", "tokens", "steps", "cache_steps", "model_steps", "accepted", "cost"):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        self.predicted += o.predicted

    def summary(self) -> dict:
        """MAT as the engine reports it (tokens per decode forward); forwards per 1k generated
        tokens with prefill counted; decode cost per decode token and the implied speed-up over
        plain greedy decoding (cost 1 per token) under the verify-cost table."""
        decode_tokens = self.tokens - self.traces
        return {
            "traces": self.traces,
            "tokens": self.tokens,
            "steps": self.steps,
            "mean_accepted_per_forward": decode_tokens / self.steps if self.steps else 0.0,
            "forwards_per_1k_tokens": 1000.0 * (self.steps + self.traces) / self.tokens if self.tokens else 0.0,
            "cache_share": self.cache_steps / self.steps if self.steps else 0.0,
            "model_share": self.model_steps / self.steps if self.steps else 0.0,
            "cost_per_token": self.cost / decode_tokens if decode_tokens else 0.0,
            "est_speedup_vs_greedy": decode_tokens / self.cost if self.cost else 0.0,
        }


def simulate_trace(lab: TraceLabels, policy: Policy, *, model_depth: int,
                   model_token_cost: float = LAYERSKIP_TOKEN_COST,
                   cost_table: dict[int, float] = VERIFY_COST, path: list | None = None) -> SimResult:
    """Decode one trace with ``policy``: from t = 1, each step verifies the chosen draft and gains
    its label plus the bonus token. History features are recomputed for this run; ``model_depth``
    is the model drafter's depth (0: none was labelled), giving the nominal ``model_len``.
    ``path``, if given, collects ``(t, choice, accepted)`` per step."""
    res = SimResult(traces=int(lab.n > 0), tokens=min(lab.n, 1))
    hist: list[tuple[bool, int]] = []
    t = 1
    while t < lab.n:
        view = StepView(with_history(lab.phi[t], hist) if policy.needs_phi else lab.phi[t],
                        int(lab.cache_len[t]), min(model_depth, int(lab.budget[t])),
                        int(lab.y_cache[t]), int(lab.y_model[t]))
        choice, pred = policy.decide(view)
        if choice == CACHE:
            acc, k = int(lab.y_cache[t]), int(lab.cache_len[t])
            res.cache_steps += 1
            res.cost += verify_cost(1 + k, cost_table)
        elif choice == MODEL and model_depth > 0:
            acc, k = int(lab.y_model[t]), int(lab.model_len[t])
            res.model_steps += 1
            res.cost += verify_cost(1 + k, cost_table) + k * model_token_cost
        else:
            choice, acc = NONE, 0
            res.cost += verify_cost(1, cost_table)
        if pred is not None:
            res.predicted.append(pred)
        hist.append((choice == CACHE, acc))
        if path is not None:
            path.append((t, choice, acc))
        gained = min(acc + 1, lab.n - t)
        res.accepted += gained - 1
        res.tokens += gained
        res.steps += 1
        t += acc + 1
    return res


def simulate(traces: Sequence[TraceLabels], policy: Policy, **kw) -> dict:
    """Summed :func:`simulate_trace` over ``traces`` (see :meth:`SimResult.summary`)."""
    total = SimResult()
    for lab in traces:
        total.add(simulate_trace(lab, policy, **kw))
    return total.summary()


def trace_labels_from_table(table) -> list[TraceLabels]:
    """Group a label table (pyarrow, ``LABEL_SCHEMA``) into per-trace arrays."""
    cols = {c: table.column(c).to_numpy() for c in
            ("seq", "t", "remaining", "cache_len", "y_cache", "model_len", "y_model", "budget")}
    phi = np.asarray(table.column("phi").combine_chunks().flatten().to_numpy(zero_copy_only=False),
                     np.float32).reshape(table.num_rows, -1) if table.num_rows else np.zeros((0, 0), np.float32)
    order = np.lexsort((cols["t"], cols["seq"]))
    out = []
    seqs = cols["seq"][order]
    bounds = np.flatnonzero(np.diff(seqs)) + 1
    for idx in np.split(order, bounds):
        if not len(idx):
            continue
        t = cols["t"][idx]
        n = int(t[0] + cols["remaining"][idx][0])
        arr = lambda c: _scatter(n, t, cols[c][idx])  # noqa: E731
        P = np.zeros((n, phi.shape[1]), np.float32)
        P[t] = phi[idx]
        out.append(TraceLabels(n, P, arr("cache_len"), arr("y_cache"), arr("model_len"), arr("y_model"),
                               arr("budget")))
    return out


def _scatter(n: int, t: np.ndarray, v: np.ndarray) -> np.ndarray:
    out = np.zeros(n, np.int64)
    out[t] = v
    return out


__all__ = ["AlwaysCache", "AlwaysModel", "CACHE", "CostPolicy", "LAYERSKIP_TOKEN_COST", "MODEL",
           "NONE", "OraclePolicy", "Policy", "ScoreRule", "SimResult", "StepView", "TauPolicy",
           "TraceLabels", "VERIFY_COST", "draft_budget", "simulate", "simulate_trace",
           "trace_labels_from_table", "verify_cost"]
