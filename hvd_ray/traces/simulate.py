"""Offline policy comparison: decode labelled traces under a selection policy, without a model.

Each trace's labels (``LABEL_SCHEMA``, from replay.py) say, at every position, how long the cache and
model drafts were and how many of their tokens the target accepted; :func:`simulate_trace` walks a
decoding run choosing with :meth:`~hvd_ray.selection.policy.Policy.decide` and prices it with the
verify-cost table, so policies are compared on MAT, forwards per 1k tokens and estimated cost
without running the target. A union step (both drafts as one tree) gains the larger of the two
labels, exactly what greedy verification of the tree accepts, and pays for both drafts' tokens
(an upper bound: a path the two share is verified once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..engine.costs import VERIFY_COST
from ..selection.features import with_history
from ..selection.policy import (
    CACHE,
    LAYERSKIP_TOKEN_COST,
    MODEL,
    NONE,
    UNION,
    Policy,
    StepView,
    verify_cost,
)


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
    union_steps: int = 0  # both drafts as one tree (CostPolicy's ``union``)
    accepted: int = 0  # draft tokens accepted (within the trace)
    cost: float = 0.0  # decode cost in units of a 1-token target forward (verify + model drafting)
    predicted: list[float] = field(default_factory=list)

    def add(self, o: SimResult) -> None:
        for k in ("traces", "tokens", "steps", "cache_steps", "model_steps", "union_steps", "accepted", "cost"):
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
            "union_share": self.union_steps / self.steps if self.steps else 0.0,
            "cost_per_token": self.cost / decode_tokens if decode_tokens else 0.0,
            "est_speedup_vs_greedy": decode_tokens / self.cost if self.cost else 0.0,
        }


def simulate_trace(
    lab: TraceLabels,
    policy: Policy,
    *,
    model_depth: int,
    model_token_cost: float = LAYERSKIP_TOKEN_COST,
    cost_table: dict[int, float] = VERIFY_COST,
    path: list | None = None,
) -> SimResult:
    """Decode one trace with ``policy``: from t = 1, each step verifies the chosen draft and gains
    its label plus the bonus token. History features are recomputed for this run; ``model_depth``
    is the model drafter's depth (0: none was labelled), giving the nominal ``model_len``.
    ``path``, if given, collects ``(t, choice, accepted)`` per step."""
    res = SimResult(traces=int(lab.n > 0), tokens=min(lab.n, 1))
    hist: list[tuple[bool, int]] = []
    t = 1
    while t < lab.n:
        view = StepView(
            with_history(lab.phi[t], hist) if policy.needs_phi else lab.phi[t],
            int(lab.cache_len[t]),
            min(model_depth, int(lab.budget[t])),
            int(lab.y_cache[t]),
            int(lab.y_model[t]),
        )
        choice, pred = policy.decide(view)
        if choice == CACHE:
            acc, k = int(lab.y_cache[t]), int(lab.cache_len[t])
            res.cache_steps += 1
            res.cost += verify_cost(1 + k, cost_table)
        elif choice == UNION and model_depth > 0:  # the deeper accepted path of the two; their tokens, both
            k_c = min(int(lab.cache_len[t]), view.take_union or int(lab.cache_len[t]))
            acc, k = max(min(int(lab.y_cache[t]), k_c), int(lab.y_model[t])), k_c + int(lab.model_len[t])
            res.union_steps += 1
            res.cost += verify_cost(1 + k, cost_table) + int(lab.model_len[t]) * model_token_cost
        elif choice == MODEL and model_depth > 0:
            acc, k = int(lab.y_model[t]), int(lab.model_len[t])
            res.model_steps += 1
            res.cost += verify_cost(1 + k, cost_table) + k * model_token_cost
        else:
            choice, acc = NONE, 0
            res.cost += verify_cost(1, cost_table)
        if pred is not None:
            res.predicted.append(pred)
        hist.append((choice == CACHE, acc))  # (a union step counts as a model step in φ's history)
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
    cols = {
        c: table.column(c).to_numpy()
        for c in ("seq", "t", "remaining", "cache_len", "y_cache", "model_len", "y_model", "budget")
    }
    phi = (
        np.asarray(table.column("phi").combine_chunks().flatten().to_numpy(zero_copy_only=False), np.float32).reshape(
            table.num_rows, -1
        )
        if table.num_rows
        else np.zeros((0, 0), np.float32)
    )
    order = np.lexsort((cols["t"], cols["seq"]))
    out = []
    seqs = cols["seq"][order]
    bounds = np.flatnonzero(np.diff(seqs)) + 1
    for idx in np.split(order, bounds):
        if not len(idx):
            continue
        t = cols["t"][idx]
        n = int(t[0] + cols["remaining"][idx][0])
        P = np.zeros((n, phi.shape[1]), np.float32)
        P[t] = phi[idx]
        cache_len, y_cache, model_len, y_model, budget = (
            _scatter(n, t, cols[c][idx]) for c in ("cache_len", "y_cache", "model_len", "y_model", "budget")
        )
        out.append(TraceLabels(n, P, cache_len, y_cache, model_len, y_model, budget))
    return out


def _scatter(n: int, t: np.ndarray, v: np.ndarray) -> np.ndarray:
    out = np.zeros(n, np.int64)
    out[t] = v
    return out


__all__ = ["SimResult", "TraceLabels", "simulate", "simulate_trace", "trace_labels_from_table"]
