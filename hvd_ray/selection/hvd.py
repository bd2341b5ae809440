"""Assemble Hybrid Verified Decoding: the suffix cache drafter, a model drafter and a policy.

The shipped predictor (trained on the default model's traces by jobs/train_predictor.py) lives in
``hvd_ray/assets/predictor-smollm2``, pinned by the SHA-256 of its weights, so ``--drafter hvd``
works out of the box for the default model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..drafters import make_drafter
from ..drafters.suffix import SuffixConfig, SuffixDrafter
from ..engine.costs import VERIFY_COST, measure_step_costs
from .cost_policy import CostPolicy
from .features import VocabFlags
from .policy import AlwaysCache, AlwaysModel, Policy, ScoreRule, TauPolicy
from .predictor import WEIGHTS_FILE, YieldPredictor

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SHIPPED_PREDICTOR = ASSETS / "predictor-smollm2"
EAGLE3_ASSET = ASSETS / "eagle3-smollm2"
# cost-union: the cost policy that may also verify both drafts as one tree (CostPolicy's ``union``)
POLICIES = ("tau", "cost", "cost-union", "score", "always-cache", "always-model")
COST_POLICIES = ("cost", "cost-union")
# The cost policy's cache drafts reach this many tokens past their match (SuffixDecoding's
# max_spec_offset), while the path's probability stays >= min_token_prob, and the policy verifies
# only the part that pays: on hardware where a 2-token forward costs twice a 1-token one, the
# match-sized drafts at the start of a repeated answer (1, 2, 3 tokens) never pay, a 9-token
# draft does. φ_t still describes the match-sized draft (policy.unextended).
CACHE_OFFSET = 8
# One EAGLE-3 draft token (a one-layer head), relative to a one-token target forward: the cost
# policy's prior until it times the head's drafts.
EAGLE3_TOKEN_COST = 0.15


def suffix_config(policy: str, **kw) -> SuffixConfig:
    """The suffix drafter's settings under ``policy``: arctic-inference's defaults, with drafts
    reaching ``CACHE_OFFSET`` past the match for the cost policy (which sizes what it verifies)."""
    return SuffixConfig(max_spec_offset=CACHE_OFFSET if policy in COST_POLICIES else 0.0, **kw)


def load_predictor(path: str | Path | None = None) -> YieldPredictor:
    """A predictor artifact; the shipped one is checked against its pinned checksum."""
    if path is not None:
        return YieldPredictor.load(path)
    pin = json.loads((SHIPPED_PREDICTOR / "checksum.json").read_text())
    digest = hashlib.sha256((SHIPPED_PREDICTOR / WEIGHTS_FILE).read_bytes()).hexdigest()
    if digest != pin["sha256"]:
        raise ValueError(f"shipped predictor {SHIPPED_PREDICTOR} fails its checksum ({digest} != {pin['sha256']})")
    return YieldPredictor.load(SHIPPED_PREDICTOR)


def eagle3_accept_prior(head: str | Path | None = None) -> float | None:
    """Mean accepted draft tokens of an EAGLE-3 head by its training report (``training.json``:
    the held-out all-positions figure, less the bonus token), or None without one. Optimistic
    (prompts included), so every request tries the head early and its own steps take over."""
    report = Path(head) if head else EAGLE3_ASSET
    meta = json.loads((report / "training.json").read_text()) if (report / "training.json").exists() else {}
    heldout = meta.get("heldout", {})
    accept = heldout.get("all_positions", heldout).get("mean_accepted_tokens_per_forward")
    return accept - 1.0 if accept else None


def build_hvd(
    model,
    tokenizer,
    *,
    policy: str = "tau",
    predictor: str | None = None,
    tau: float = 6.0,
    model_drafter: str = "layerskip",
    eagle3_head: str | None = None,
    slots: int = 8,
    max_len: int = 2048,
    cache=None,
    draft_model: str | None = None,
    measure_costs: bool = True,
    costs_file: str | None = None,
) -> tuple[list, Policy]:
    """(drafters for the Engine, the policy to pass as ``Engine(policy=...)``). ``cache``: the suffix
    drafter to use (default a fresh in-process one; serving passes its actor proxy).
    ``measure_costs``: the cost policy times the target's forward on this hardware (a few seconds,
    once per model; engine/costs.py) instead of assuming the static ``VERIFY_COST`` table, or reads
    them from ``costs_file`` where a process on the same kind of machine timed them before."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    cache = cache if cache is not None else SuffixDrafter(suffix_config(policy))
    drafter = make_drafter(
        model_drafter, model, eagle3_head=eagle3_head, draft_model=draft_model, slots=slots, max_len=max_len
    )
    flags = VocabFlags.from_tokenizer(tokenizer, model.cfg.vocab_size)
    if policy in ("tau", *COST_POLICIES):
        g, union = load_predictor(predictor), policy == "cost-union"
        costs = measure_step_costs(model, file=costs_file) if measure_costs and policy in COST_POLICIES else VERIFY_COST
        if policy == "tau":
            pol: Policy = TauPolicy(g, cache, drafter, flags, tau=tau)
        elif model_drafter == "eagle3":
            # a one-layer head drafts at a small fraction of a target forward per token (measured
            # ~0.1-0.15 here). The acceptance prior is the training report's all-positions figure,
            # an optimistic one (prompts included): every request then tries the head early, and its
            # own model steps take over after a few (CostPolicy.request_model).
            pol = CostPolicy(
                g,
                cache,
                drafter,
                flags,
                model_token_cost=EAGLE3_TOKEN_COST,
                cost_table=costs,
                model_accept=eagle3_accept_prior(eagle3_head),
                union=union,
            )
        else:
            pol = CostPolicy(g, cache, drafter, flags, cost_table=costs, union=union)
    elif policy == "score":
        pol = ScoreRule(cache, drafter, flags, tau=tau)
    elif policy == "always-cache":
        pol = AlwaysCache(cache, drafter, flags)
    else:
        pol = AlwaysModel(cache, drafter, flags)
    return [d for d in (cache, drafter) if d is not None], pol
