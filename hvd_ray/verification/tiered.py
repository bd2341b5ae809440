"""Three-tier verification (VIA-SD): drafter ``p`` -> slim verifier ``q'`` -> full target ``q``.

``q'`` is the target itself under a routing mask that skips layers or attention / MLP sub-layers
(``Transformer.forward(skip=...)``), sharing every weight. Each step runs ``q'`` once over
``[pending] + draft`` and grades every draft token by its confidence ratio ``q'(v) / max q'``
(``exp(logit_v - max logit)``, no softmax needed):

* ``>= accept``: the slim tier accepts the token;
* between the gates: ``q'`` regenerates it (its own argmax replaces the token, the draft ends);
* ``< escalate``: the full target ``q`` decides.

Gates are strict early in a generation and loose later (``TierThresholds.at``), since an early
error derails everything after it (a wrong function name, a wrong signature).

Two modes:

``tiered`` (lossy, the VIA-SD speed-up): tokens the slim tier settles are emitted without running
  ``q``. Only an escalation (or the drafter offering nothing, or the lag cap) costs a full forward,
  and there ``q`` verifies the whole draft (repaired by ``q'`` at its first disagreement) since the
  forward is paid anyway. Sampled requests (temperature > 0) take the lossless path: a lossy tier
  has no target distribution to preserve, and the lossless one preserves it exactly.
``lossless``: ``q`` verifies every step. ``q'`` only edits the draft: it cuts it at the first token
  that is not ``q'``'s own argmax and appends ``q'``'s argmax there (or after the full draft), so the
  draft gains the slim model's next token for free. Greedy output is token-identical to plain
  greedy; with sampling the draft stays a deterministic function of the context (the drafters
  here are deterministic, the repair token is ``q'``'s argmax, i.e. a proposal of probability 1),
  so the engine's rejection sampling of deterministic candidates keeps the target distribution.

KV cache (one cache, the target's own): the slim forward writes the *kept* sub-layers' K/V at the
draft positions of the target's slot; skipped layers' rows there are left stale. A full forward
rewrites every layer at its positions, so the full model's cache stays exact. In ``tiered`` mode a
token settled by ``q'`` leaves the skipped layers' rows at its position stale (and the kept layers
hold slim-stream K/V), so each request tracks ``Request.full_len``, the length up to which every
layer is exact: the next full forward truncates the cache back to it and re-feeds the tokens since
it together with the new draft, which catches every layer up in the same forward. ``max_lag`` caps
how far the slim tier may run ahead (it bounds both the drift and the width of that catch-up).
Tree drafts skip the slim tier (they are verified by ``q`` directly; lag is still caught up).

This module holds the tier's configuration and its pure decisions; the step that runs them is the
engine's one decoding step (``Engine._decode``: ``_slim_pass`` then the full verify forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model.transformer import SubLayer

MODES = ("lossless", "tiered")


@dataclass(frozen=True)
class TierThresholds:
    """Confidence-ratio gates ``q'(v) / max q'``. ``accept`` / ``escalate`` hold from output token
    ``early_tokens`` on; before that they move linearly from ``early_accept`` / ``early_escalate``."""

    accept: float = 0.6
    escalate: float = 0.3
    early_accept: float = 0.9
    early_escalate: float = 0.6
    early_tokens: int = 16
    own: float = 0.5  # q''s top probability needed to emit a token of its own (regenerated / bonus)

    def __post_init__(self) -> None:
        for a, e in ((self.accept, self.escalate), (self.early_accept, self.early_escalate)):
            if e > a:
                raise ValueError(f"escalate gate ({e}) must not exceed the accept gate ({a})")
        if self.early_tokens < 0:
            raise ValueError(f"early_tokens must be >= 0, got {self.early_tokens}")

    def at(self, position: int) -> tuple[float, float]:
        """(accept, escalate) gates for the token at output position ``position`` (0-based)."""
        if position >= self.early_tokens:
            return self.accept, self.escalate
        w = position / self.early_tokens
        return (
            self.early_accept + w * (self.accept - self.early_accept),
            self.early_escalate + w * (self.escalate - self.early_escalate),
        )


@dataclass
class SlimTier:
    """Engine configuration of the slim tier: the routing mask, the mode and the gates.

    ``mask`` is the resolved list of skipped ``(layer, "attn"|"mlp")`` sub-layers: names, artifacts
    and specs go through ``hvd_ray.dimr.resolve_mask`` first (it needs the drafters and DIMR, which
    verification does not import)."""

    mask: Sequence[SubLayer]
    mode: str = "lossless"
    thresholds: TierThresholds = field(default_factory=TierThresholds)
    max_lag: int = 32  # tiered: most tokens past the fully verified length before a full forward
    slim_empty: bool = True  # run q' on an empty draft too (its argmax becomes a one-token draft)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown slim mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.max_lag < 1:
            raise ValueError(f"max_lag must be >= 1, got {self.max_lag}")
        if isinstance(self.mask, (str, Path)) or self.mask is None:
            raise ValueError(
                f"SlimTier needs a resolved mask, got {self.mask!r}: "
                "pass it through hvd_ray.dimr.resolve_mask(mask, n_layers)"
            )
        self.mask = check_mask(self.mask)


def check_mask(mask: Sequence[SubLayer], n_layers: int | None = None) -> list[SubLayer]:
    """A slim mask as a sorted list of ``(layer, "attn"|"mlp")``, or ValueError: every layer
    exists (below ``n_layers`` when given), layer 0 is kept, something is skipped."""
    skip = [(int(i), str(k)) for i, k in mask]
    bad = [x for x in skip if x[0] < 0 or (n_layers is not None and x[0] >= n_layers) or x[1] not in ("attn", "mlp")]
    if bad:
        model = f"a {n_layers}-layer model" if n_layers is not None else "(layer, 'attn'|'mlp')"
        raise ValueError(f"invalid slim-verifier sub-layers {bad} for {model}")
    if any(i == 0 for i, _ in skip):
        raise ValueError("the slim verifier always keeps layer 0 (its K/V anchor every position)")
    if not skip:
        raise ValueError("an empty slim mask is the full model: use no slim tier instead")
    return sorted(set(skip))


# ------------------------------------------------------------------------------- decisions
def confidence_ratios(slim_logits: torch.Tensor, draft: Sequence[int]) -> list[float]:
    """``q'(draft[i]) / max q'`` at each draft position (rows ``0..n-1`` of ``[n+1, V]`` logits)."""
    n = len(draft)
    if not n:
        return []
    rows = slim_logits[:n].float()
    tok = torch.tensor(list(draft), device=rows.device)
    return (rows.gather(1, tok[:, None])[:, 0] - rows.max(-1).values).exp().tolist()


def repair(best: Sequence[int], draft: Sequence[int], budget: int) -> tuple[list[int], int, int]:
    """Cut ``draft`` at ``q'``'s first disagreement and put ``q'``'s token there (or append it after
    a fully agreed draft, budget permitting). ``best[i]`` is ``q'``'s argmax after draft token i-1.
    Returns ``(repaired_draft, agreed, added)`` with ``added`` in {0, 1}."""
    k = 0
    while k < len(draft) and draft[k] == best[k]:
        k += 1
    if k < len(draft) or k < budget:
        return list(draft[:k]) + [best[k]], k, 1
    return list(draft[:k]), k, 0


@dataclass
class Verdict:
    """The slim tier's ruling on one draft: ``escalate``, or settle ``draft[:accepted] + [token]``
    (``token`` None: just the accepted draft tokens, the last of which becomes the pending one)."""

    escalate: bool
    accepted: int = 0
    token: int | None = None


def tiered_verdict(
    ratios: Sequence[float],
    best: Sequence[int],
    own: Sequence[float],
    draft: Sequence[int],
    thresholds: TierThresholds,
    position: int,
) -> Verdict:
    """Walk the draft: accept while the ratio clears the accept gate; a middle ratio ends the walk
    with ``q'``'s regenerated token; a low one escalates. A fully accepted draft ends with ``q'``'s
    next token (its bonus). A token of ``q'``'s own (regenerated or bonus) also needs ``q'``'s top
    probability ``own[i]`` to clear ``thresholds.own``: else a regeneration escalates and a bonus is
    dropped. ``position`` is the output index of ``draft[0]``."""
    for i, r in enumerate(ratios):
        acc, esc = thresholds.at(position + i)
        if r >= acc:
            continue
        if r < esc or own[i] < thresholds.own:
            return Verdict(True)
        return Verdict(False, i, best[i])
    n = len(draft)
    if own[n] >= thresholds.own:
        return Verdict(False, n, best[n])
    return Verdict(False, n) if n else Verdict(True)
