"""Trace replay: rebuild the drafters' state at every position of a recorded greedy generation,
draft, and label each draft with the number of its tokens the target would accept.

For a trace with prompt ``P`` and output ``O`` (``N`` tokens), position ``t`` (1 <= t < N) is the
decoding step that starts when the output holds ``t`` tokens: the context is ``P + O[:t]`` and a
draft proposes ``O[t:]``. Greedy verification accepts the longest draft prefix that matches the
target's own greedy continuation, which *is* the recorded ``O[t:]`` — so the label needs no target
forward (for a tree draft: the longest root path matching it).

**Cache drafter state, exactly as serving has it.** One real ``SuffixDrafter`` per worker, driven
through its public lifecycle for the replayed trace (``begin(prompt)``, ``accept`` token by token,
``end``), so the request tree is ``P + O[:t]`` and — with ``global_live`` — the global tree also
holds the request's own output so far. The global tree holds the outputs of traces with a smaller
``seq`` (arrival order), bounded by ``max_cached_requests`` (oldest evicted first): this is serving
the traces one at a time in arrival order. Traces are labelled in ``seq`` order within a batch;
:class:`GlobalReplay` adds the earlier outputs a batch needs (rebuilding from the bound's window
when a batch starts before the worker's current point), so batches can be labelled in parallel
by different workers at the cost of one global-tree build per batch. Concurrent serving (other
requests' partial outputs in the global tree) is not modelled.

**Draft budget.** As the engine computes it: ``min(max_draft, max_tokens - t - 1)`` with
``max_tokens`` from the trace's ``decoding`` JSON (its output length when absent). The online
engine must run with ``num_draft_tokens == max_draft`` for the labels to describe it.

**History features.** φ_t includes features of the request's earlier steps (recent accepted
lengths, the rate of choosing the cache). They come from a simulated decoding run along the trace
under a documented policy (default :class:`~hvd_ray.selection.policy.ScoreRule` with τ = 6:
verify the cache draft when its own score > 6, else the model draft): from t = 1, a step at t
accepts ``y_cache[t]`` or ``y_model[t]`` tokens plus the bonus token, so the next step starts at
``t + accepted + 1``. Every position is labelled (``step_start`` marks the run's steps); a position
between two step starts gets the history of the steps *completed* by then (the step in flight over
it is left out: its accepted length would tell how far the continuation at t matches, which no
decoding-time state knows). ``--sim-predictor`` replaces the rule with the
τ rule on a trained predictor (a second, self-consistent round).

**Model drafter labels** come from ``model_labels.py`` (teacher-forced and batched); the
labelling worker that runs both per trace is ``labeler.py``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from ..drafters.base import Draft
from ..drafters.suffix import SuffixConfig, SuffixDrafter
from ..selection.features import VocabFlags, features
from ..selection.policy import CACHE, MODEL, Policy, ScoreRule, StepView
from .records import Trace


def longest_match(draft: Draft, output: Sequence[int], t: int) -> int:
    """Length of the longest root path of ``draft`` equal to ``output[t:]`` (greedy acceptance)."""
    toks, parents = draft.token_ids, draft.parents
    n = len(output) - t
    if draft.is_chain:
        k = 0
        for tok in toks:
            if k >= n or tok != output[t + k]:
                break
            k += 1
        return k
    depth = {-1: 0}
    best = 0
    for i, (tok, par) in enumerate(zip(toks, parents)):
        d = depth.get(par)
        if d is not None and d < n and tok == output[t + d]:
            depth[i] = d + 1
            best = max(best, d + 1)
    return best


# ---------------------------------------------------------------------------------------------
# cache drafter
class GlobalReplay:
    """A ``SuffixDrafter`` whose global tree holds the outputs of traces before a given ``seq``.

    ``history``: every trace's ``(seq, output)`` (any order). :meth:`drafter_before` returns the
    drafter with the global tree holding the outputs of traces with smaller ``seq`` (the last
    ``max_cached_requests`` of them), advancing incrementally when called with increasing ``seq``.
    """

    def __init__(self, history: Sequence[tuple[int, Sequence[int]]], config: SuffixConfig):
        self.config = config
        hist = sorted((int(s), list(o)) for s, o in history)
        self._seqs = [s for s, _ in hist]
        self._outs = [o for _, o in hist]
        self.drafter: SuffixDrafter | None = None
        self._next = 0  # index of the next history output not yet in the drafter
        self.rebuilds = 0

    def _add(self, i: int) -> None:
        # What begin + accept* + end leave in the global tree (with or without global_live): a
        # cache slot (evicting the oldest beyond the bound), then the output. No request tree.
        d, rid = self.drafter, f"seq-{self._seqs[i]}"
        d.add_to_global(rid, self._outs[i])

    def drafter_before(self, seq: int) -> SuffixDrafter:
        i = bisect.bisect_left(self._seqs, seq)
        if self.drafter is None or self._next > i:
            self.drafter = SuffixDrafter(self.config)
            lim = self.config.max_cached_requests
            self._next = max(0, i - lim) if lim > 0 else (i if lim == 0 else 0)
            self.rebuilds += 1
        while self._next < i:
            self._add(self._next)
            self._next += 1
        return self.drafter

    def done(self, seq: int) -> None:
        """The trace ``seq`` was replayed through the drafter: its output is in the tree now."""
        i = bisect.bisect_left(self._seqs, seq)
        if i < len(self._seqs) and self._seqs[i] == seq and self._next == i:
            self._next = i + 1


def budgets_for(trace: Trace, max_draft: int) -> np.ndarray:
    """The engine's draft budget at each t (index = t)."""
    t = np.arange(len(trace.output))
    return np.clip(np.minimum(max_draft, trace.max_tokens - t - 1), 0, None).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# one trace
def replay_trace(
    trace: Trace,
    drafter: SuffixDrafter,
    flags: VocabFlags,
    *,
    max_draft: int,
    y_model: np.ndarray | None = None,
    model_len: np.ndarray | None = None,
    model_depth: int = 0,
    sim: Policy | None = None,
    drafts: dict | None = None,
    regime: str = "cold",
    rid: str | None = None,
) -> dict[str, list]:
    """Label every position of ``trace`` with the cache drafter in its serving state (the
    drafter's global tree must already hold the earlier traces; the trace goes through
    begin/accept/end as request ``rid``, default ``trace.rid``). Returns ``LABEL_SCHEMA`` columns,
    ``regime`` filled in. ``drafts``, if given, collects the cache draft at each t (tests)."""
    P, out = trace.prompt, trace.output
    N = len(out)
    if y_model is None:
        y_model = np.zeros(N, np.int32)
        model_len = np.zeros(N, np.int32)
    sim = sim or ScoreRule()
    budgets = budgets_for(trace, max_draft)
    cols: dict[str, list] = {
        k: []
        for k in (
            "t",
            "remaining",
            "budget",
            "step_start",
            "sim_cache",
            "phi",
            "cache_len",
            "cache_score",
            "cache_source",
            "y_cache",
            "model_len",
            "y_model",
        )
    }
    rid = rid or trace.rid
    drafter.begin(rid, P)
    if N:
        drafter.accept(rid, out[:1])
    hist: list[tuple[bool, int]] = []
    next_step = 1
    for t in range(1, N):
        budget = int(budgets[t])
        draft = drafter.speculate(rid, budget)
        yc = longest_match(draft, out, t)
        start = t == next_step
        # history = the run's steps completed by t: between step starts, the step in flight (which
        # covers t) is left out, since its outcome reveals how far the continuation matched
        phi = features(
            draft,
            prompt_len=len(P),
            generated=t,
            max_tokens=trace.max_tokens,
            last_token=out[t - 1],
            history=hist if start else hist[:-1],
            flags=flags,
        )
        sim_cache = None
        if start:
            view = StepView(phi, len(draft), min(model_depth, budget), yc, int(y_model[t]))
            choice, _ = sim.decide(view)
            sim_cache = choice == CACHE
            acc = yc if sim_cache else int(y_model[t]) if (choice == MODEL and model_depth > 0) else 0
            hist.append((sim_cache, acc))
            next_step = t + acc + 1
        if drafts is not None:
            drafts[t] = draft
        for k, v in (
            ("t", t),
            ("remaining", N - t),
            ("budget", budget),
            ("step_start", start),
            ("sim_cache", sim_cache),
            ("phi", phi),
            ("cache_len", len(draft)),
            ("cache_score", float(draft.score)),
            ("cache_source", draft.source),
            ("y_cache", yc),
            ("model_len", int(model_len[t])),
            ("y_model", int(y_model[t])),
        ):
            cols[k].append(v)
        drafter.accept(rid, out[t : t + 1])
    drafter.end(rid)
    n = len(cols["t"])
    cols.update(
        prompt_id=[trace.prompt_id] * n,
        workload=[trace.workload] * n,
        split=[trace.split] * n,
        seq=[trace.seq] * n,
        regime=[regime] * n,
    )
    return cols
