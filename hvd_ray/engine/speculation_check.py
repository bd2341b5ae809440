"""Which way of drafting a batch step pays, measured per batch size (``SpeculationCheck``).

The engine asks it, for every decode step of two rows or more, whether to take the policy's
per-request drafts, the cache drafter's drafts as they are, or none, and tells it each step's
tokens and seconds afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

POLICY, CACHE, PLAIN = "policy", "cache", "plain"
ARMS = (CACHE, POLICY, PLAIN)  # every arm, in the order of preference on a tie


class SpeculationCheck:
    """Which way of drafting pays at this batch size, measured rather than predicted.

    Three arms: ``policy`` (the cost policy's per-request choices, sized together by
    ``costs.batch_lengths``), ``cache`` (every row's cache draft as the cache drafter made it, exactly
    as that drafter alone decodes) and ``plain`` (no drafts). Under load the policy's per-request
    estimates are argmaxes over noisy numbers, and a batch pays for every draft it does not accept and
    for the model drafter's time, so the engine keeps, per batch size, the emitted tokens per second of
    whole steps (drafting included) of each arm and takes the fastest: HVD under load is then at least
    its own cache drafter, less the exploration (why, measured: docs/results-http.md).

    Some steps go to the arms not preferred (every fourth to one still short of ``min_steps`` until
    one batch size has them all measured; see ``preferred`` for the sizes after it), so every rate
    stays measured as load and prompts change: drafted arms every ``explore_drafts``-th step, taking
    turns (they pay again as soon as the cache warms), plain steps every ``explore_plain``-th (a
    plain step's rate barely moves, and a forced one forgoes a draft). Lone requests are left to the
    policy (its per-request choice already weighs a plain step). Decisions depend only on the timings
    fed in, so TP ranks fed rank 0's agree.

    An arm's rate is its tokens over its seconds, both sums discounted by ``adapt`` per step at that
    batch size (not per step of the arm), so every arm follows load and prompts at the same pace and
    an arm retried rarely does not keep its weight on its first, cold steps. One step counts for at
    most ``outlier`` times the arm's average step time (a drafted step that also runs EAGLE-3 over a
    new prompt, a one-off catch-up, would otherwise hold its arm down until re-measured). Plain is
    preferred only when it measures ``margin`` faster than the best drafted arm (about a drafted
    arm's step-to-step noise); the second drafted arm must measure ``switch`` faster than the first
    (the cache's, which decodes faster than noisy per-request choices under load)."""

    def __init__(
        self,
        explore_plain: int = 64,
        explore_drafts: int = 16,
        adapt: float = 0.03,
        min_steps: int = 3,
        margin: float = 0.1,
        switch: float = 0.15,
        arms: Sequence[str] = ARMS,
        outlier: float = 3.0,
    ):
        if not arms or arms[0] == PLAIN or len(set(arms)) != len(arms) or not set(arms) <= {POLICY, CACHE, PLAIN}:
            raise ValueError(
                f"arms: distinct ones of {POLICY!r}, {CACHE!r}, {PLAIN!r}, a drafted one first; got {list(arms)}"
            )
        self.explore_plain, self.explore_drafts = explore_plain, explore_drafts
        self.adapt, self.min_steps, self.margin, self.switch, self.outlier = adapt, min_steps, margin, switch, outlier
        self.names = tuple(arms)
        # (batch, arm) -> [tokens, seconds, weight (discounted sums), steps, the batch's clock at the last]
        self.arms: dict[tuple[int, str], list[float]] = {}
        self.steps: dict[int, int] = {}  # steps decided per batch size (the schedule)
        self.clock: dict[int, int] = {}  # steps recorded per batch size (the discount)
        self.done: set[int] = set()  # batch sizes with every arm measured (``record`` keeps it)

    def rate(self, batch: int, arm: str) -> float | None:
        got = self.arms.get((batch, arm))
        return got[0] / got[1] if got and got[3] >= self.min_steps else None

    def preferred(self, batch: int) -> str:
        """The arm measured fastest at ``batch`` rows (ties: the first). Until every arm is measured
        there, the nearest batch size's where they are: a size seen for a few steps only, as a queue
        fills or drains, decides as its neighbours do rather than spend its steps measuring every
        arm anew (at concurrency 16 that warm-up, at each size on the way down, took half the steps)."""
        done = tuple(self.done)  # one atomic copy: ``summary`` reads it from the server's stats thread
        if batch not in done and done:
            batch = min(done, key=lambda b: (abs(b - batch), -b))
        best = self.names[0]
        top = self.rate(batch, best)
        if top is None:
            return best
        for arm in self.names[1:]:
            r = self.rate(batch, arm)
            if r is not None and r > top * (1 + (self.margin if arm == PLAIN else self.switch)):
                best, top = arm, r
        return best

    def arm(self, batch: int) -> str:
        """This step's arm for a ``batch``-row decode."""
        if batch < 2:
            return POLICY
        n = self.steps[batch] = self.steps.get(batch, 0) + 1
        best = self.preferred(batch)
        others = [a for a in self.names if a != best]
        short = [a for a in others if self.arms.get((batch, a), [0, 0, 0, 0])[3] < self.min_steps]
        if short and not self.done:  # the first sizes seen: measure them
            return short[0] if n % 4 == 0 else best
        if PLAIN in others and n % self.explore_plain == 0:
            return PLAIN
        drafted = [a for a in others if a != PLAIN]
        if drafted and n % self.explore_drafts == 0:
            return drafted[(n // self.explore_drafts) % len(drafted)]
        return best

    def summary(self) -> dict[str, dict]:
        """Per batch size (a string key, for JSON): the arm taken now and each arm's measured tokens
        per second (None until ``min_steps``) and steps, for operators (``GET /stats``)."""
        out: dict[str, dict] = {}
        for (batch, arm), got in sorted(list(self.arms.items())):  # list(): one atomic copy (a reader thread)
            if str(batch) not in out:
                out[str(batch)] = {"preferred": self.preferred(batch), "arms": {}}
            entry, rate = out[str(batch)], self.rate(batch, arm)
            entry["arms"][arm] = {"tokens_per_s": None if rate is None else round(rate, 1), "steps": int(got[3])}
        return out

    def record(self, batch: int, arm: str, tokens: int, seconds: float) -> None:
        if batch < 2 or seconds <= 0:
            return
        now = self.clock[batch] = self.clock.get(batch, 0) + 1
        got = self.arms.setdefault((batch, arm), [0.0, 0.0, 0.0, 0, now])
        if got[3]:
            seconds = min(seconds, self.outlier * got[1] / got[2])
        keep = (1 - self.adapt) ** (now - got[4])
        got[0] = keep * got[0] + tokens
        got[1] = keep * got[1] + seconds
        got[2] = keep * got[2] + 1
        got[3] += 1
        got[4] = now
        if got[3] == self.min_steps and all(self.rate(batch, x) is not None for x in self.names):
            self.done.add(batch)
