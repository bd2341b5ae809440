"""The live oracle policy: the selection upper bound measured at run time (``oracle`` method)."""

from __future__ import annotations

from ..drafters.base import Draft, DraftRequest
from ..engine.policy import Choice
from ..selection.policy import Policy, matched


class LiveOracle(Policy):
    """Selection upper bound at run time: drafts from both sources and picks the draft the target
    accepts more of, read off greedy's output for the prompt (``reference``; set per prompt).
    Ties go to the cache, whose drafting is free — the offline ``OraclePolicy``'s rule."""

    name = "oracle"
    needs_phi = False

    def __init__(self, cache, model, flags=None):
        super().__init__(cache, model, flags)
        self.reference: list[int] = []

    def decide(self, view):  # pragma: no cover - the engine hook below decides with the drafts in hand
        raise RuntimeError("LiveOracle decides in __call__")

    def __call__(self, req, engine) -> Choice:
        budget = engine.draft_budget(req)
        truth = self.reference[len(req.output) :]
        long_budget = max(budget, engine.draft_budget(req, self.cache))
        cache = self.cache.speculate(req.req_id, long_budget).truncated(long_budget)
        model = (
            self.model.propose([DraftRequest(req.req_id, req.slot, req.tokens, budget)])[0].truncated(budget)
            if self.model is not None and budget > 0
            else Draft()
        )
        y_c, y_m = matched(cache, truth), matched(model, truth)
        if len(cache) and y_c >= y_m:
            return Choice(self.cache, cache, float(y_c))
        if len(model):
            return Choice(self.model, model, float(y_m))
        return Choice(None, None, 0.0)
