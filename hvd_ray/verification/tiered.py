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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from ..model.transformer import SubLayer, Transformer
from .greedy import greedy_walk
from .sampling import rejection_sample_tree, target_probs
from .tree import tree_attention_mask, tree_depths

if TYPE_CHECKING:  # pragma: no cover
    from ..drafters.base import Draft
    from ..engine.engine import Engine, StepOutput
    from ..engine.request import Request

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
        return (self.early_accept + w * (self.accept - self.early_accept),
                self.early_escalate + w * (self.escalate - self.early_escalate))


def resolve_mask(mask: "str | Path | Sequence[SubLayer] | None", n_layers: int) -> list[SubLayer]:
    """The slim verifier's skipped sub-layers from: a ``SlimMask`` or a list of ``(layer, kind)``;
    ``"default"`` (the shipped DIMR mask when there is one, else ``layerskip.default_skip``);
    ``"layerskip"`` (``default_skip``); a DIMR mask artifact (folder, ``mask.json`` or shipped name,
    checksum-verified by ``hvd_ray.dimr.load_mask``); or a skip spec (``"attn:10-17,mlp:20"``)."""
    from ..drafters.layerskip import default_skip, parse_skip

    if mask is None or (isinstance(mask, str) and mask == "default"):
        skip = _shipped(n_layers) or default_skip(n_layers)
    elif isinstance(mask, str) and mask == "layerskip":
        skip = default_skip(n_layers)
    elif isinstance(mask, (str, Path)):
        skip = _load_artifact(str(mask))
        if skip is None:
            skip = parse_skip(str(mask))
    else:
        skip = [(int(i), str(k)) for i, k in getattr(mask, "skip", mask)]
    bad = [s for s in skip if not 0 <= s[0] < n_layers or s[1] not in ("attn", "mlp")]
    if bad:
        raise ValueError(f"invalid slim-verifier sub-layers {bad} for a {n_layers}-layer model")
    if any(i == 0 for i, _ in skip):
        raise ValueError("the slim verifier always keeps layer 0 (its K/V anchor every position)")
    if not skip:
        raise ValueError("an empty slim mask is the full model: use no slim tier instead")
    return sorted(set(skip))


def describe_mask(mask: "str | Path | Sequence[SubLayer] | None", n_layers: int) -> str:
    """Where ``resolve_mask`` takes this mask from, for reports."""
    if mask is None or mask == "default":
        return "shipped DIMR mask" if _shipped(n_layers) else "layerskip.default_skip (no DIMR mask shipped)"
    return str(mask) if isinstance(mask, (str, Path)) else "explicit list"


def _shipped(n_layers: int) -> list[SubLayer] | None:
    """The shipped DIMR mask for a model of ``n_layers`` layers, if one is shipped."""
    try:
        from ..dimr import MaskError, load_mask
    except ImportError:
        return None
    try:
        m = load_mask("default")
    except MaskError:
        return None
    return list(m.skip) if m.n_layers == n_layers else None


def _load_artifact(spec: str) -> list[SubLayer] | None:
    """A DIMR ``SlimMask`` artifact's skip list; None when ``spec`` is no artifact (a skip spec)."""
    from ..dimr import MaskError, load_mask

    try:
        return list(load_mask(spec).skip)
    except MaskError as e:
        looks_like_spec = all(p.strip().split(":")[0] in ("attn", "mlp", "layer")
                              for p in spec.split(",") if p.strip())
        if looks_like_spec and not Path(spec).exists():
            return None
        raise ValueError(str(e)) from None


@dataclass
class SlimTier:
    """Engine configuration of the slim tier: the routing mask, the mode and the gates."""

    mask: "str | Sequence[SubLayer] | None" = "default"
    mode: str = "lossless"
    thresholds: TierThresholds = field(default_factory=TierThresholds)
    max_lag: int = 32  # tiered: most tokens past the fully verified length before a full forward
    slim_empty: bool = True  # run q' on an empty draft too (its argmax becomes a one-token draft)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown slim mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.max_lag < 1:
            raise ValueError(f"max_lag must be >= 1, got {self.max_lag}")


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


def tiered_verdict(ratios: Sequence[float], best: Sequence[int], own: Sequence[float], draft: Sequence[int],
                   thresholds: TierThresholds, position: int) -> Verdict:
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


# ---------------------------------------------------------------------------------- the step
class SlimStep:
    """The engine's decode step with a slim tier (``Engine(slim=SlimTier(...))``)."""

    def __init__(self, model: Transformer, tier: SlimTier):
        self.model = model
        self.tier = tier
        self.skip = resolve_mask(tier.mask, model.cfg.n_layers)

    @torch.inference_mode()
    def decode(self, engine: "Engine", reqs: list["Request"]) -> list["StepOutput"]:
        from ..drafters.base import Draft
        from ..engine.request import StepRecord

        t0 = time.perf_counter()
        reqs, drafts, predicted = engine._live_drafts(reqs)
        if not reqs:
            return []
        t1 = time.perf_counter()
        cache, dev = self.model.cache, self.model.device
        B = len(reqs)
        starts = [cache.lengths[r.slot] for r in reqs]
        for r, s in zip(reqs, starts):
            if r.full_len is None or engine.slim.mode == "lossless":
                r.full_len = s
        tiered = [engine.slim.mode == "tiered" and r.params.greedy for r in reqs]
        budgets = [engine.draft_budget(r) for r in reqs]
        # --- slim forward over [pending] + draft for the chain drafts it can help
        use = [b for b in range(B) if drafts[b].is_chain and budgets[b] > 0
               and (len(drafts[b]) or self.tier.slim_empty)
               and not (tiered[b] and starts[b] - reqs[b].full_len + len(drafts[b]) + 1 > self.tier.max_lag)]
        counts = {b: [0, 0, 0] for b in range(B)}  # slim accepted / regenerated / escalated
        settled: dict[int, Verdict] = {}
        full_drafts: dict[int, Draft] = {b: drafts[b] for b in range(B)}
        slim_taps: list[torch.Tensor] = []
        if use:
            rows = [[reqs[b].pending] + drafts[b].token_ids for b in use]
            T = max(map(len, rows))
            toks = torch.tensor([r + [0] * (T - len(r)) for r in rows], device=dev)
            taps = engine.taps if any(tiered[b] for b in use) else ()
            out = self.model(toks, [reqs[b].slot for b in use], n_new=[len(r) for r in rows], skip=self.skip,
                             taps=taps)
            slim_taps = out.taps
            best = out.logits.argmax(-1).tolist()
            for j, b in enumerate(use):
                req, d = reqs[b], drafts[b]
                req.stats.slim_forwards += 1
                if tiered[b] and len(d):
                    own = out.logits[j, : len(d) + 1].float().softmax(-1).amax(-1).tolist()
                    v = tiered_verdict(confidence_ratios(out.logits[j], d.token_ids), best[j], own, d.token_ids,
                                       self.tier.thresholds, len(req.output))
                    if not v.escalate:
                        settled[b] = v
                        extra = v.token is not None
                        counts[b][:2] = [v.accepted, int(extra)]
                        cache.truncate(req.slot, starts[b] + v.accepted + int(extra))
                        continue
                repaired, agreed, added = repair(best[j], d.token_ids, budgets[b])
                counts[b] = [agreed, added, len(d) if tiered[b] else 0]
                full_drafts[b] = Draft.chain(repaired, source=d.source)
                cache.truncate(req.slot, starts[b])
        # --- full forward (with the catch-up of settled-but-unverified tokens) for the rest
        full = [b for b in range(B) if b not in settled]
        emitted: dict[int, list[int]] = {}
        accepted: dict[int, int] = {}
        if full:
            self._full(engine, [reqs[b] for b in full], [full_drafts[b] for b in full], emitted, accepted, full)
        t2 = time.perf_counter()
        results = []
        for b, req in enumerate(reqs):
            if req.finished:  # failed in verification (engine._fail); released by the engine
                continue
            if b in settled:
                v = settled[b]
                toks = drafts[b].token_ids[: v.accepted] + ([v.token] if v.token is not None else [])
                if engine.taps:
                    engine._observe(req, toks, slim_taps, use.index(b), slice(0, len(toks)))
                emitted[b], accepted[b] = toks, len(toks) - 1
            d = full_drafts[b]
            req.stats.steps.append(StepRecord(
                d.source or drafts[b].source or "none", len(d) if b not in settled else len(drafts[b]),
                accepted[b], (t1 - t0) / B, (t2 - t1) / B, predicted[b],
                slim_accepted=counts[b][0], slim_regenerated=counts[b][1], slim_escalated=counts[b][2],
                full_forward=b not in settled))
            try:
                results.append(engine._emit(req, emitted[b]))
            except Exception as e:  # noqa: BLE001 - a drafter's accept: fail this request alone
                engine._fail(req, e, "emitting tokens")
        dt = time.perf_counter() - t0
        for r in reqs:
            r.stats.decode_s += dt
        return results

    def _full(self, engine: "Engine", reqs: list["Request"], drafts: list["Draft"], emitted: dict, accepted: dict,
              index: list[int]) -> None:
        """One target forward over ``tokens[full_len:] + draft`` per request: verify the draft and
        rewrite every layer's K/V at the lagging positions (exact cache again up to the new length)."""
        cache, dev = self.model.cache, self.model.device
        lags = [r.tokens[r.full_len: cache.lengths[r.slot]] for r in reqs]
        for r in reqs:
            cache.truncate(r.slot, r.full_len)
        rows = [lag + [r.pending] + d.token_ids for r, lag, d in zip(reqs, lags, drafts)]
        widths = list(map(len, rows))
        T = max(widths)
        toks = torch.tensor([x + [0] * (T - len(x)) for x in rows], device=dev)
        mask = depths = None
        if any(not d.is_chain for d in drafts):
            B = len(reqs)
            mask = torch.tril(torch.ones(B, T, T, dtype=torch.bool, device=dev))
            depths = torch.arange(T, device=dev).repeat(B, 1)
            for b, (lag, d) in enumerate(zip(lags, drafts)):
                if not d.is_chain:
                    g, w = len(lag), widths[b]
                    mask[b, g:w, g:w] = tree_attention_mask(d.parents, device=dev)
                    depths[b, g:w] = g + torch.tensor(tree_depths(d.parents), device=dev)
        out = self.model(toks, [r.slot for r in reqs], n_new=widths, depths=depths, attn_mask=mask,
                         taps=engine.taps)
        best = out.logits.argmax(-1).tolist() if any(r.params.greedy for r in reqs) else None
        for b, (req, lag, d) in enumerate(zip(reqs, lags, drafts)):
            g, p = len(lag), req.params
            try:
                if p.greedy:
                    path, nxt = greedy_walk(best[b][g:], d.token_ids, d.parents)
                else:
                    probs = target_probs(out.logits[b, g: widths[b]], p.temperature, p.top_k, p.top_p)
                    path, nxt = rejection_sample_tree(probs, d.token_ids, d.parents, req.generator)
            except Exception as e:  # noqa: BLE001 - this request's verification: fail it alone
                engine._fail(req, e, "verification")
                continue
            keep = list(range(g + 1)) + [g + 1 + i for i in path]
            cache.compact(req.slot, req.full_len, keep)
            req.full_len = cache.lengths[req.slot]
            toks_out = [d.token_ids[i] for i in path] + [nxt]
            if engine.taps:
                engine._observe(req, toks_out, out.taps, b, torch.tensor(keep[g:], device=dev))
            req.stats.target_forwards += 1
            emitted[index[b]], accepted[index[b]] = toks_out, len(path)
