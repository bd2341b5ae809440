"""What a target forward costs on this machine, measured once at start-up.

The cost policy trades a draft's expected yield against the time of verifying it, and that time is
a property of the hardware, not of the model: on a GPU (and on a CPU with bf16 instructions) a
forward over 8 tokens costs little more than one over 1 token; on an AVX2-only CPU in bf16 it costs
3.7x, and in fp32 1.8x (a lone token takes a cheaper matrix-vector path). A static table is right on
one machine and wrong on the next, so the engine times its own forwards.

``StepCosts(n)`` is the time of one forward over ``n`` new tokens in total (all rows of the batch
together) relative to a 1-token forward, piecewise-linear between the measured widths and
extrapolated with the last segment's slope.
"""

from __future__ import annotations

import bisect
import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..model.tp import rank0_values

WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)


def interpolate(table: dict[int, float], k: float) -> float:
    """``table`` (width -> relative cost) at ``k``: piecewise-linear, the last slope beyond it."""
    ks = sorted(table)
    if k <= ks[0]:
        return table[ks[0]]
    i = bisect.bisect_left(ks, k)
    if i < len(ks) and ks[i] == k:
        return table[ks[i]]
    a, b = (ks[i - 1], ks[i]) if i < len(ks) else (ks[-2], ks[-1])
    return table[a] + (table[b] - table[a]) * (k - a) / (b - a)


@dataclass
class StepCosts:
    """Relative forward cost by total new tokens (``table``) and the 1-token forward in seconds."""

    table: dict[int, float]
    forward_s: float = 0.0
    measured: bool = False
    raw_s: dict[int, float] = field(default_factory=dict)

    def __call__(self, tokens: float) -> float:
        return interpolate(self.table, tokens)

    def per_row(self, width: int, batch: int = 1) -> float:
        """One row's share of a forward where ``batch`` rows each score ``width`` tokens, relative
        to a lone 1-token forward: what drafting ``width - 1`` tokens costs a request at this load
        (rows of a batch pay together, so long drafts stop paying as the batch grows)."""
        batch = max(1, batch)
        return self(batch * width) / batch


def batch_cap(lengths: Sequence[int], gains: Sequence[Sequence[float]], costs: "StepCosts") -> int:
    """The draft length every row of a batch is cut to this step.

    A batched verify forward pads every row to the longest draft, so its cost is
    ``costs(B * (1 + k))`` for the longest kept draft ``k``, whatever the other rows hold: one
    request verifying 32 tokens makes seven plain-decoding neighbours pay for 33 each. ``gains[r][j]``
    is row ``r``'s expected accepted tokens with its draft cut to ``j`` tokens (``gains[r][0] = 0``).
    Returns the cap with the most expected tokens per unit of forward time (ties: the shorter)."""
    B = len(lengths)
    best = (-1.0, 0)
    for k in range(max(lengths, default=0) + 1):
        got = sum(g[min(n, k, len(g) - 1)] for g, n in zip(gains, lengths))
        value = (B + got) / costs(B * (1 + k))
        if value > best[0] * (1 + 1e-9):
            best = (value, k)
    return best[1]


class SpeculationCheck:
    """Whether speculating pays at this batch size, measured rather than predicted.

    The cost policy sizes a batch's drafts from estimated gains (``batch_cap``); when those are
    too high (a batch's cap is the argmax over noisy estimates, so it picks the over-estimated
    ones), the batch pays for drafts it does not accept and decodes slower than without any. So the
    engine keeps, per batch size, the emitted tokens per second of whole steps (drafting included)
    taken with the policy's drafts and of steps taken with none, and decodes plainly at a batch
    size where the drafted steps measure slower. Some steps go to the arm not preferred (every
    fourth until it has ``min_steps``), so both rates stay measured as load and prompts change:
    drafts are retried often (every ``explore_drafts``-th step: they pay again as soon as the cache
    warms), plain steps seldom (``explore_plain``: a plain step's rate barely moves, and a forced
    one forgoes a draft that may be worth ten tokens). Lone requests are left to the policy (its
    per-request choice already weighs a plain step). Decisions depend only on the timings fed in,
    so TP ranks fed rank 0's agree."""

    def __init__(self, explore_plain: int = 64, explore_drafts: int = 8, adapt: float = 0.1, min_steps: int = 3):
        self.explore_plain, self.explore_drafts = explore_plain, explore_drafts
        self.adapt, self.min_steps = adapt, min_steps
        self.arms: dict[tuple[int, bool], list[float]] = {}  # (batch, drafted) -> [tokens, seconds, steps]
        self.steps: dict[int, int] = {}

    def rate(self, batch: int, drafted: bool) -> float | None:
        arm = self.arms.get((batch, drafted))
        return arm[0] / arm[1] if arm and arm[2] >= self.min_steps and arm[1] > 0 else None

    def prefers_plain(self, batch: int) -> bool:
        spec, plain = self.rate(batch, True), self.rate(batch, False)
        return spec is not None and plain is not None and plain > spec

    def plain(self, batch: int) -> bool:
        """Whether this step of a ``batch``-row decode goes without drafts."""
        if batch < 2:
            return False
        n = self.steps[batch] = self.steps.get(batch, 0) + 1
        prefer = self.prefers_plain(batch)
        other = self.arms.get((batch, prefer), [0, 0, 0])[2]  # steps the other arm has been measured
        every = 4 if other < self.min_steps else self.explore_drafts if prefer else self.explore_plain
        return prefer != (n % every == 0)

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        if batch < 2 or seconds <= 0:
            return
        arm = self.arms.setdefault((batch, drafted), [0.0, 0.0, 0])
        a = self.adapt if arm[2] else 1.0
        arm[0] = (1 - a) * arm[0] + a * tokens
        arm[1] = (1 - a) * arm[1] + a * seconds
        arm[2] += 1


def measure_step_costs(model, widths=WIDTHS, prefix: int = 64, reps: int = 5) -> StepCosts:
    """Time one forward over ``k`` new tokens after a ``prefix``-token context, for each ``k`` in
    ``widths``, in a scratch KV cache so the model's own cache is untouched. Cached on the model:
    engines that share a model share its costs.

    A busy or frequency-scaling CPU makes single timings jump by 30 % or more, and a table with a
    spike at one width misprices every draft from there on (the policy then declines drafts that
    pay). So the widths are timed in ``reps`` interleaved rounds (drift hits all widths alike), each
    width's median is kept, and the table is the monotone least-squares fit of those medians
    (scikit-learn's isotonic regression), not their running maximum."""
    key = (str(model.device), str(model.dtype), torch.get_num_threads(), tuple(widths), prefix)
    cached = getattr(model, "_step_costs", {})
    if key in cached:
        return cached[key]
    saved = model.cache
    room = model.cfg.max_position
    widths = [k for k in widths if prefix + k <= room] or [1]
    prefix = min(prefix, room - max(widths))
    vocab = model.cfg.vocab_size
    try:
        model.setup_cache(1, prefix + max(widths))
        ctx = (torch.arange(prefix, device=model.device) * 7 % vocab).unsqueeze(0)
        new = (torch.arange(max(widths), device=model.device) * 13 % vocab).unsqueeze(0)
        with torch.inference_mode():
            model(ctx, [0], last_only=True)
            times: dict[int, list[float]] = {k: [] for k in widths}
            for rnd in range(reps + 1):  # round 0 warms every shape up and is not kept
                for k in widths:
                    model.cache.truncate(0, prefix)
                    if model.device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model(new[:, :k], [0])
                    if model.device.type == "cuda":
                        torch.cuda.synchronize()
                    if rnd:
                        times[k].append(time.perf_counter() - t0)
    finally:
        model.cache = saved
    raw = {k: statistics.median(ts) for k, ts in times.items()}
    raw = dict(zip(raw, rank0_values(model, list(raw.values()))))  # one table on every TP rank
    fit = monotone(raw)
    one = fit[min(fit)]
    costs = StepCosts({k: v / one for k, v in fit.items()}, one, True, raw)
    cached[key] = costs
    model._step_costs = cached
    return costs


def monotone(raw: dict[int, float]) -> dict[int, float]:
    """The non-decreasing least-squares fit of ``raw`` (width -> seconds): a forward over more
    tokens never costs less, and noise is averaged out instead of carried forward."""
    from sklearn.isotonic import IsotonicRegression

    ks = sorted(raw)
    if len(ks) < 2:
        return dict(raw)
    fitted = IsotonicRegression(increasing=True).fit_transform(ks, [raw[k] for k in ks])
    return {k: float(v) for k, v in zip(ks, fitted)}


__all__ = ["SpeculationCheck", "StepCosts", "batch_cap", "WIDTHS", "interpolate", "measure_step_costs", "monotone"]
