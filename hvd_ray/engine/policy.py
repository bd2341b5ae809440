"""What the engine asks of a draft policy, and what a policy answers.

A policy (``selection/policy.py``: HVD's rules) chooses, per request and step, which source drafts.
The engine reads only what :class:`DraftPolicy` declares: the choice itself (``__call__``), and for a
policy that prices its drafts, its ``costs`` (the engine then sizes a batch's drafts together and
measures which way of drafting pays at each batch size) and its ``cache`` drafter with
``cache_choice`` (the cache arm of that measure). A plain function ``(request, engine) -> choice``
is a policy too (:func:`as_policy`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..drafters.base import Draft, Drafter

if TYPE_CHECKING:
    from .costs import StepCosts
    from .request import Request

Engine = Any  # ``engine.Engine``, which imports this module: named here only for the reader


@dataclass
class Choice:
    """A policy's decision for one request and step: which source drafts, optionally the draft
    itself (when the policy had to draft to decide), the predicted accepted length, and ``gains``:
    the expected accepted tokens with the draft cut to 0, 1, 2, ... tokens (a policy that prices its
    drafts gives them, so the engine can size the batch's drafts together: ``costs.batch_lengths``);
    ``also``: a draft already made (the cache's) that joins ``drafter``'s in one tree, verified in
    the same forward (a lone request's union step: ``selection.cost_policy.CostPolicy``)."""

    drafter: Drafter | None
    draft: Draft | None = None
    predicted: float | None = None
    gains: Sequence[float] | None = None
    also: Draft | None = None  # a cache draft to verify with ``drafter``'s as one tree (``Draft.union``)


def as_choice(x: Choice | Drafter | None) -> Choice:
    return x if isinstance(x, Choice) else Choice(x)


class DraftPolicy(abc.ABC):
    """The engine's view of a policy. ``costs``: the step costs it prices drafts with (None: it does
    not, and the engine neither sizes drafts together nor measures arms); ``cache``: its cache drafter
    (None: no cache arm)."""

    costs: StepCosts | None = None
    cache: Drafter | None = None

    @abc.abstractmethod
    def __call__(self, req: Request, engine: Engine) -> Choice | Drafter | None:
        """The source that drafts for ``req`` this step (or a :class:`Choice` with more)."""

    def cache_choice(self, req: Request, engine: Engine) -> Choice:
        """The cache arm: the cache drafter drafts as it would alone (the engine asks it within its
        budget). The engine asks only a policy with a ``cache``."""
        return Choice(self.cache)


class FunctionPolicy(DraftPolicy):
    """A function ``(request, engine) -> Choice | Drafter | None`` as a policy."""

    def __init__(self, fn: Callable[[Request, Engine], Choice | Drafter | None]):
        self.fn = fn

    def __call__(self, req: Request, engine: Engine) -> Choice | Drafter | None:
        return self.fn(req, engine)


def as_policy(policy: DraftPolicy | Callable | None) -> DraftPolicy | None:
    if policy is None or isinstance(policy, DraftPolicy):
        return policy
    return FunctionPolicy(policy)
