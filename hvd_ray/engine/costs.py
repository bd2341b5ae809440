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
import heapq
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
    """Relative forward cost by total new tokens (``table``) and the 1-token forward in seconds.

    ``row`` is what each further row of a batch adds besides its tokens (its own attention over its
    own context, its share of the step's bookkeeping), learned from the engine's own batched steps
    (``observe``): the table, timed on one short sequence, prices a plain 8-row step at ~1.3
    one-token forwards where it takes ~3 on this CPU, and so rated every extra verified token at
    twice its real share of a step."""

    table: dict[int, float]
    forward_s: float = 0.0
    measured: bool = False
    raw_s: dict[int, float] = field(default_factory=dict)
    row: float = 0.0
    adapt: float = 0.05

    def __call__(self, tokens: float) -> float:
        return interpolate(self.table, tokens)

    def batch(self, rows: int, tokens: float) -> float:
        """A (packed) forward of ``rows`` rows scoring ``tokens`` tokens in all."""
        return self(tokens) + self.row * max(0, rows - 1)

    def per_row(self, width: int, batch: int = 1) -> float:
        """One row's share of a (packed) forward where it scores ``width`` tokens and the other
        ``batch - 1`` rows one each, relative to a lone 1-token forward."""
        batch = max(1, batch)
        return self.batch(batch, batch - 1 + width) / batch

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """Fold one measured batched verify forward into ``row`` (needs the measured 1-token time)."""
        if rows < 2 or seconds <= 0 or self.forward_s <= 0:
            return
        seen = max(0.0, (seconds / self.forward_s - self(tokens)) / (rows - 1))
        self.row = (1 - self.adapt) * self.row + self.adapt * min(seen, 4.0)


def batch_lengths(lengths: Sequence[int], gains: Sequence[Sequence[float]], costs: "StepCosts") -> list[int]:
    """Each row's draft length this step (at most ``lengths[r]``), for one verify forward.

    The forward packs its rows (``Transformer.forward``): a batch of ``B`` rows with drafts of
    ``n_r`` tokens costs ``costs.batch(B, B + sum(n_r))``, so a request pays for its own draft, not for the
    longest one in the batch. ``gains[r][j]`` is row ``r``'s expected accepted tokens with its draft
    cut to ``j`` tokens (``gains[r][0] = 0``). Draft tokens are taken one at a time, always the one
    that adds the most expected tokens among the rows' next ones, and the lengths kept are those
    of the prefix of that order with the most expected tokens per unit of forward time (ties: the
    shorter): one confident 32-token cache draft is verified beside seven plain rows, where a
    common cap for all rows would have cost 8 x 33 tokens."""
    B = len(lengths)
    heap: list[tuple[float, int, int]] = []

    def push(r: int, j: int) -> None:  # row r's (j + 1)-th draft token
        if j < lengths[r] and j + 1 < len(gains[r]):
            heapq.heappush(heap, (-(gains[r][j + 1] - gains[r][j]), r, j))

    for r in range(B):
        push(r, 0)
    order: list[int] = []
    got, best = 0.0, (B / costs.batch(B, B), 0)
    while heap:
        neg, r, j = heapq.heappop(heap)
        if neg >= 0:  # nothing left that adds anything (a longer forward never costs less)
            break
        got -= neg
        order.append(r)
        value = (B + got) / costs.batch(B, B + len(order))
        if value > best[0] * (1 + 1e-9):
            best = (value, len(order))
        push(r, j + 1)
    out = [0] * B
    for r in order[: best[1]]:
        out[r] += 1
    return out


class SpeculationCheck:
    """Whether speculating pays at this batch size, measured rather than predicted.

    The cost policy sizes a batch's drafts from estimated gains (``batch_lengths``); when those
    are too high (the lengths are an argmax over noisy estimates, so they pick the over-estimated
    ones), the batch pays for drafts it does not accept and decodes slower than without any. So the
    engine keeps, per batch size, the emitted tokens per second of whole steps (drafting included)
    taken with the policy's drafts and of steps taken with none, and decodes plainly at a batch
    size where the drafted steps measure slower. Some steps go to the arm not preferred (every
    fourth until it has ``min_steps``), so both rates stay measured as load and prompts change:
    drafts are retried often (every ``explore_drafts``-th step: they pay again as soon as the cache
    warms), plain steps seldom (``explore_plain``: a plain step's rate barely moves, and a forced
    one forgoes a draft that may be worth ten tokens). Lone requests are left to the policy (its
    per-request choice already weighs a plain step). Decisions depend only on the timings fed in,
    so TP ranks fed rank 0's agree.

    An arm's rate is the average of its steps' own rates (tokens / seconds of each step), not its
    tokens over its seconds: a drafted step that also runs EAGLE-3 over a new request's whole
    prompt (its one-off catch-up) can take seven plain steps' time, and in a ratio of sums that one
    step dragged the drafted arm below the plain one, where it then stayed, re-measured only every
    ``explore_drafts``-th step. For the same reason plain is preferred only when it measures
    ``margin`` faster: at batch 8 here the drafted arm's average moves by about that from one step
    to the next, and a close call costs little either way."""

    def __init__(self, explore_plain: int = 64, explore_drafts: int = 8, adapt: float = 0.1, min_steps: int = 3,
                 margin: float = 0.1):
        self.explore_plain, self.explore_drafts = explore_plain, explore_drafts
        self.adapt, self.min_steps, self.margin = adapt, min_steps, margin
        self.arms: dict[tuple[int, bool], list[float]] = {}  # (batch, drafted) -> [tokens/s, steps]
        self.steps: dict[int, int] = {}

    def rate(self, batch: int, drafted: bool) -> float | None:
        arm = self.arms.get((batch, drafted))
        return arm[0] if arm and arm[1] >= self.min_steps else None

    def prefers_plain(self, batch: int) -> bool:
        spec, plain = self.rate(batch, True), self.rate(batch, False)
        return spec is not None and plain is not None and plain > spec * (1 + self.margin)

    def plain(self, batch: int) -> bool:
        """Whether this step of a ``batch``-row decode goes without drafts."""
        if batch < 2:
            return False
        n = self.steps[batch] = self.steps.get(batch, 0) + 1
        prefer = self.prefers_plain(batch)
        other = self.arms.get((batch, prefer), [0, 0])[1]  # steps the other arm has been measured
        every = 4 if other < self.min_steps else self.explore_drafts if prefer else self.explore_plain
        return prefer != (n % every == 0)

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        if batch < 2 or seconds <= 0:
            return
        arm = self.arms.setdefault((batch, drafted), [0.0, 0])
        a = self.adapt if arm[1] else 1.0
        arm[0] = (1 - a) * arm[0] + a * tokens / seconds
        arm[1] += 1


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


__all__ = ["SpeculationCheck", "StepCosts", "batch_lengths", "WIDTHS", "interpolate", "measure_step_costs", "monotone"]
