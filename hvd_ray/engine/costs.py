"""What a target forward costs on this machine, measured once at start-up.

The cost policy trades a draft's expected yield against the time of verifying it, and that time is
a property of the hardware, not of the model: on a GPU (and on a CPU with bf16 instructions) a
forward over 8 tokens costs little more than one over 1 token; on an AVX2-only CPU it costs several
times as much (a lone token takes a cheaper matrix-vector path; docs/results-engine.md). A static
table is right on one machine and wrong on the next, so the engine times its own forwards.

``StepCosts(n)`` is the time of one forward over ``n`` new tokens in total (all rows of the batch
together) relative to a 1-token forward, piecewise-linear between the measured widths and
extrapolated with the last segment's slope.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from ..model.tp import rank0_values

WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)
# One target forward scoring k tokens, relative to k = 1 (docs/design.md: SmolLM2-135M, bf16, 2 threads,
# an Intel box with bf16 instructions): a GPU-like curve, where long drafts are nearly free. Offline
# simulation's default; online, the cost policy uses the costs the engine times on its own hardware.
VERIFY_COST = {1: 1.00, 8: 1.20, 16: 1.32, 32: 1.71}


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

    ``rows[B]`` is what each further row of a ``B``-row batch adds besides its tokens (its attention
    over its own context, its K/V reads, its share of the step's bookkeeping), learned per batch size
    from the engine's own batched steps (``observe``): the table, timed on one short sequence, prices
    a plain 8-row step at ~1.4 one-token forwards where it took ~2.4 on a 2-core CPU, and so rated every
    extra verified token at nearly twice its real share of a step. It is learned per batch size
    because it grows with it (here ~0 per row at 2 rows, ~0.14 at 8): one average over all sizes,
    pulled down by the small batches of a draining queue, priced batch 8 at 1.46. A batch size not
    measured yet takes the nearest measured one's, else ``row`` (a prior, 0 by default)."""

    table: dict[int, float]
    forward_s: float = 0.0
    measured: bool = False
    raw_s: dict[int, float] = field(default_factory=dict)
    row: float = 0.0
    adapt: float = 0.05
    rows: dict[int, float] = field(default_factory=dict)
    # The same table timed after a long context (``long_prefix`` tokens; ``prefix`` for ``table``).
    # Each verified token attends over the whole context, so width costs more there: in bf16 here a
    # 32-token forward cost 1.46 one-token forwards after 64 tokens and 2.3 after 4,000, and the
    # short table alone let the union and long cache drafts overpay on 3.5-5k-token prompts.
    long_table: dict[int, float] = field(default_factory=dict)
    long_forward_s: float = 0.0
    prefix: int = 0
    long_prefix: int = 0
    # What the tables' width costs are worth now: a forward over k tokens costs
    # ``1 + width_scale * (table(k) - 1)``, re-fitted from the lone verify forwards the engine times
    # (``observe``). The tables are timed once at start-up, and a replica started while the CPU
    # was busy (another replica starting, a test suite) priced an 8-token forward at 2.58 one-token
    # ones where a quiet box gives 1.28, for its whole life: it then declined drafts that pay.
    width_scale: float = 1.0
    # exponentially weighted sums over lone verify forwards: weight, x, y, x^2, x*y, where x is the
    # width's cost by the tables, less 1, and y the forward's seconds at the tables' context
    fit: list[float] = field(default_factory=lambda: [0.0] * 5)
    fit_decay: float = 0.02
    refit: bool = True  # False: keep the start-up tables' width costs (a benchmark's baseline)

    def __call__(self, tokens: float, context: int = 0) -> float:
        """A forward over ``tokens`` new tokens after ``context`` tokens, relative to a 1-token one
        after as many: seconds linear in the context, through the two measured tables (and beyond),
        the width's share scaled by ``width_scale``."""
        return 1.0 + self.width_scale * (self.timed(tokens, context) - 1.0)

    def one_s(self, context: int = 0) -> float:
        """The start-up tables' 1-token forward after ``context`` tokens, in seconds."""
        if not self.long_table or context <= self.prefix or self.long_prefix <= self.prefix:
            return self.forward_s
        f = (context - self.prefix) / (self.long_prefix - self.prefix)
        one = (1 - f) * self.forward_s + f * self.long_forward_s
        return one if one > 0 else self.forward_s  # (extrapolated past a noisy pair of timings)

    def timed(self, tokens: float, context: int = 0) -> float:
        """``__call__`` as the start-up tables have it (no ``width_scale``)."""
        short = interpolate(self.table, tokens)
        if not self.long_table or context <= self.prefix or self.long_prefix <= self.prefix:
            return short
        f = (context - self.prefix) / (self.long_prefix - self.prefix)
        a, b = (1 - f) * self.forward_s, f * self.long_forward_s
        one = a + b
        if one <= 0:  # (extrapolated past a noisy pair of timings)
            return short
        return max(1.0, (a * short + b * interpolate(self.long_table, tokens)) / one)

    def row_at(self, batch: int) -> float:
        """Each further row's cost in a ``batch``-row forward (the nearest measured batch size's)."""
        if not self.rows:
            return self.row
        if batch in self.rows:
            return self.rows[batch]
        return self.rows[min(self.rows, key=lambda b: (abs(b - batch), -b))]

    def batch(self, rows: int, tokens: float, context: int = 0) -> float:
        """A (packed) forward of ``rows`` rows scoring ``tokens`` tokens in all; a lone row's after
        its ``context`` tokens (a batch's rows' contexts are in its learned ``rows`` term)."""
        return self(tokens, context if rows == 1 else 0) + self.row_at(rows) * max(0, rows - 1)

    def per_row(self, width: int, batch: int = 1, context: int = 0) -> float:
        """One row's share of a (packed) forward where it scores ``width`` tokens and the other
        ``batch - 1`` rows one each, relative to a lone 1-token forward."""
        batch = max(1, batch)
        return self.batch(batch, batch - 1 + width, context) / batch

    def observe(self, rows: int, tokens: int, seconds: float, context: int = 0) -> None:
        """Fold one measured verify forward in (needs the measured 1-token time). A batch's goes
        into ``rows[rows]``: a batch size's first forward sets it, later ones move it by ``adapt``.
        A lone row's (after ``context`` tokens) re-fits ``width_scale``: seconds against the tables'
        width cost by weighted least squares, ``y = a + a * width_scale * x``, once the recent
        forwards span enough widths to tell slope from noise; the 1-token time ``a`` is fitted with
        it, so a box that got slower or faster overall does not read as a change of shape."""
        if seconds <= 0 or self.forward_s <= 0:
            return
        if rows == 1:
            self._fit_width(self.timed(tokens, context) - 1.0, seconds * self.forward_s / self.one_s(context))
            return
        seen = min(4.0, max(0.0, (seconds / self.forward_s - self(tokens)) / (rows - 1)))
        old = self.rows.get(rows)
        self.rows[rows] = seen if old is None else (1 - self.adapt) * old + self.adapt * seen

    def _fit_width(self, x: float, y: float) -> None:
        if not self.refit:
            return
        d = self.fit_decay
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            self.fit[i] = (1 - d) * self.fit[i] + v
        w, sx, sy, sxx, sxy = self.fit
        if w < WIDTH_FIT_MIN_WEIGHT:
            return
        var = sxx / w - (sx / w) ** 2
        if var < WIDTH_FIT_MIN_VAR:  # the recent forwards were all about one width: no slope to read
            return
        slope = (sxy / w - sx / w * sy / w) / var
        a = sy / w - slope * sx / w
        if a > 0:
            self.width_scale = min(WIDTH_SCALE_MAX, max(WIDTH_SCALE_MIN, slope / a))


# ``StepCosts.width_scale``'s fit: at least this much weight (~16 lone steps) and a spread of widths
# (variance of the tables' relative cost; bf16 here: 2-token 1.03, 17-token 1.32, 33-token 1.7);
# the scale stays within a factor 10 of the start-up tables (a busy start-up here: ~0.17)
WIDTH_FIT_MIN_WEIGHT = 16.0
WIDTH_FIT_MIN_VAR = 0.1**2
WIDTH_SCALE_MIN, WIDTH_SCALE_MAX = 0.1, 10.0


def batch_lengths(lengths: Sequence[int], gains: Sequence[Sequence[float]], costs: StepCosts) -> list[int]:
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


def measure_step_costs(
    model, widths=WIDTHS, prefix: int = 64, reps: int = 5, long_prefix: int = 2048, file: str | None = None
) -> StepCosts:
    """Time one forward over ``k`` new tokens after a ``prefix``-token context, for each ``k`` in
    ``widths``, in a scratch KV cache so the model's own cache is untouched; and again after a
    ``long_prefix``-token one (``StepCosts.long_table``; 0: not). Cached on the model: engines that
    share a model share its costs.

    ``file``: a JSON file of tables timed before, by this or another process on the same kind of
    machine (``step_costs_key``: architecture, dtype, device, threads, CPU model, widths). A matching
    entry is used as is; else the table is timed and added. Replicas then start without the timing
    (about a minute in fp32 on 2 cores), and one started on a busy node (a scale-out under load)
    prices steps from a quiet node's table instead of its own inflated one. Not with tensor
    parallelism: every rank must take part in the timing's broadcast.

    A busy or frequency-scaling CPU makes single timings jump by 30 % or more, and a table with a
    spike at one width misprices every draft from there on (the policy then declines drafts that
    pay). So the widths are timed in ``reps`` interleaved rounds (drift hits all widths alike), each
    width's median is kept, and the table is the monotone least-squares fit of those medians
    (scikit-learn's isotonic regression), not their running maximum."""
    key = (str(model.device), str(model.dtype), torch.get_num_threads(), tuple(widths), prefix, long_prefix)
    cached = getattr(model, "_step_costs", {})
    if key in cached:
        return cached[key]
    shared = file if file and getattr(model, "tp_size", 1) == 1 else None
    entry = step_costs_key(model, widths, prefix, long_prefix)
    costs = read_step_costs(shared, entry) if shared else None
    if costs is None:
        costs = _time_widths(model, widths, prefix, reps)
        room = model.cfg.max_position - max(costs.table)
        if long_prefix > costs.prefix and room > costs.prefix:
            long = _time_widths(model, list(costs.table), min(long_prefix, room), reps)
            costs.long_table, costs.long_forward_s, costs.long_prefix = long.table, long.forward_s, long.prefix
        if shared:
            write_step_costs(shared, entry, costs)
    cached[key] = costs
    model._step_costs = cached
    return costs


# what a step-costs file keeps of a StepCosts: the timed tables (the online fits start afresh)
_SAVED = ("table", "forward_s", "raw_s", "long_table", "long_forward_s", "prefix", "long_prefix")


def step_costs_key(model, widths, prefix: int, long_prefix: int) -> str:
    """What a timed table is valid for: the architecture (not the weights: a forward's cost does not
    depend on them), dtype, device, torch threads, the CPU model, and the timing's shape."""
    arch = hashlib.sha256(json.dumps(asdict(model.cfg), sort_keys=True, default=str).encode())
    return "|".join(
        [
            arch.hexdigest()[:16],
            str(model.dtype),
            str(model.device),
            f"threads={torch.get_num_threads()}",
            cpu_name(),
            "widths=" + ",".join(map(str, widths)),
            f"prefix={prefix}/{long_prefix}",
        ]
    )


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s model name): what a timed table, and a benchmark's figures,
    are valid for."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_step_costs(file: str, key: str) -> StepCosts | None:
    """The table ``file`` holds under ``key`` (None: no file, no entry, or not a step-costs file)."""
    try:
        with open(file) as f:
            saved = json.load(f)[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ints = lambda d: {int(k): float(v) for k, v in d.items()}  # noqa: E731 - JSON keys are strings
    return StepCosts(
        ints(saved["table"]),
        saved["forward_s"],
        True,
        ints(saved["raw_s"]),
        long_table=ints(saved["long_table"]),
        long_forward_s=saved["long_forward_s"],
        prefix=saved["prefix"],
        long_prefix=saved["long_prefix"],
    )


def write_step_costs(file: str, key: str, costs: StepCosts) -> None:
    """Add ``costs`` to ``file`` under ``key``, atomically (replicas starting together may write)."""
    try:
        with open(file) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        entries = {}
    entries[key] = {name: getattr(costs, name) for name in _SAVED}
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    tmp = f"{file}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(entries, f, indent=1)
    os.replace(tmp, file)


def _time_widths(model, widths, prefix: int, reps: int) -> StepCosts:
    """One relative table, timed after ``prefix`` tokens (``measure_step_costs``)."""
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
    return StepCosts({k: v / one for k, v in fit.items()}, one, True, raw, prefix=prefix)


def monotone(raw: dict[int, float]) -> dict[int, float]:
    """The non-decreasing least-squares fit of ``raw`` (width -> seconds): a forward over more
    tokens never costs less, and noise is averaged out instead of carried forward."""
    from sklearn.isotonic import IsotonicRegression

    ks = sorted(raw)
    if len(ks) < 2:
        return dict(raw)
    fitted = IsotonicRegression(increasing=True).fit_transform(ks, [raw[k] for k in ks])
    return {k: float(v) for k, v in zip(ks, fitted)}


__all__ = [
    "StepCosts",
    "batch_lengths",
    "cpu_name",
    "WIDTHS",
    "interpolate",
    "measure_step_costs",
    "monotone",
    "read_step_costs",
    "step_costs_key",
    "write_step_costs",
]
