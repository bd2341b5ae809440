"""One builder for a speculative Engine: :class:`EngineSpec` + :func:`build_engine`.

The CLI, the serving replica, the tensor-parallel ranks and the benchmark jobs all build an engine
with drafters, a selection policy and a slim tier. Building it here alone keeps their options (names,
defaults, help) and semantics from drifting apart: ``add_spec_arguments`` renders the options into
argparse, ``ServingConfig.engine_spec()`` maps a config file onto them. Heavy imports stay inside
the functions, so a config or an argument parser costs no torch import.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["EngineSpec", "add_spec_arguments", "build_engine", "spec_from_args"]


def _opt(default: Any, help: str, **argparse_kw: Any):
    """A spec field with its default, a one-line help and any extra argparse keywords."""
    return field(default=default, metadata={"help": help, **argparse_kw})


@dataclass
class EngineSpec:
    """Every option that decides how an engine decodes (plain values: it travels to Ray actors)."""

    drafter: str = _opt("none", "none | hvd | suffix | eagle3 | layerskip | draft-model")
    policy: str = _opt(
        "cost-union",
        "with drafter hvd: cost-union (the cost rule; a lone request may verify both "
        "drafts as one tree) | cost (choose one) | tau | score | always-cache | always-model",
    )
    model_drafter: str = _opt(
        "eagle3", "with drafter hvd: eagle3 (the shipped head for the default model) | layerskip | draft-model | none"
    )
    predictor: str | None = _opt(None, "with drafter hvd: yield predictor artifact (default: the shipped one)")
    eagle3_head: str | None = _opt(None, "folder of an EAGLE-3 head (default: the shipped one)")
    draft_model: str | None = _opt(None, "folder of the draft model (drafter draft-model)")
    layerskip: str | None = _opt(
        None, "skip spec of drafter layerskip, e.g. attn:10-17,mlp:20 (default: the drafter's)"
    )
    slim: str | None = _opt(
        None,
        "VIA-SD slim-verifier tier: 'default' (shipped DIMR mask), 'layerskip', a skip "
        "spec (attn:10-17,mlp:20) or a DIMR mask artifact folder",
        metavar="MASK",
    )
    slim_mode: str = _opt(
        "lossless",
        "with slim: lossless (the target verifies everything) or tiered (lossy, "
        "the slim verifier settles confident tokens)",
        choices=("lossless", "tiered"),
    )
    num_draft_tokens: int = _opt(8, "draft budget of model drafters per step")
    cache_draft_tokens: int | None = _opt(
        None,
        "draft budget of the suffix cache per step (its drafts follow its match; unset: max(num_draft_tokens, 64))",
    )
    max_batch: int = _opt(8, "KV-cache slots = requests decoded together")
    max_len: int = _opt(2048, "context per request (prompt + output), capped by the model's")
    reuse_slots: int = _opt(
        0,
        "with prefix_reuse: KV slots beyond max_batch that only keep finished requests' "
        "K/V, so a retry or an agent's next turn finds its prefix after other requests ran "
        "(memory: one max_len slot each)",
    )
    prefix_reuse: bool = _opt(
        True,
        "a new request whose prompt starts with a finished request's tokens takes its "
        "KV slot and prefills only the rest (agent turns, retries)",
        action=argparse.BooleanOptionalAction,
    )
    suffix_history: str | None = _opt(
        None,
        "start the suffix drafter's global tree with the train-split outputs "
        "of this collect_traces folder (past outputs of the same model)",
        metavar="TRACES",
    )
    prefill_chunk: int | None = _opt(
        None,
        "while requests decode, prefill at most this many prompt tokens per step, so a long "
        "arriving prompt does not stall the running streams for its whole prefill (unset: whole prompts)",
        metavar="TOKENS",
    )
    step_costs: str | None = _opt(
        None,
        "with drafter hvd: a JSON file of the forward costs the cost policy prices steps with, "
        "timed once per kind of machine and reused (missing or no entry for this machine: timed "
        "at start-up and added)",
        metavar="FILE",
    )

    def slots(self) -> int:
        """KV slots an engine of this spec holds (the engine's and its drafters' caches)."""
        return self.max_batch + (self.reuse_slots if self.prefix_reuse else 0)


def add_spec_arguments(
    parser: argparse.ArgumentParser,
    *,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
) -> None:
    """``--drafter``, ``--policy``, ... from the spec's fields (``only`` / ``exclude`` choose which,
    ``defaults`` overrides a command's own defaults), so every command spells them the same."""
    keep = set(only) if only is not None else None
    defaults = defaults or {}
    for f in dataclasses.fields(EngineSpec):
        if f.name in exclude or keep is not None and f.name not in keep:
            continue
        kw = dict(f.metadata)
        if f.type.startswith("int"):
            kw["type"] = int
        parser.add_argument("--" + f.name.replace("_", "-"), default=defaults.get(f.name, f.default), **kw)


def spec_from_args(args: argparse.Namespace, **overrides: Any) -> EngineSpec:
    """The spec of parsed arguments: every field ``args`` has, then ``overrides``; defaults elsewhere."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineSpec) if hasattr(args, f.name)}
    return EngineSpec(**{**given, **overrides})


def build_engine(
    spec: EngineSpec,
    model,
    tokenizer,
    *,
    suffix_cache=None,
    drafters: Sequence | None = None,
    policy=None,
    slim_tier=None,
) -> Engine:
    """The Engine ``spec`` describes over ``model`` (``tokenizer``: its EOS and detokenizer; None
    for a weights-only model).

    ``suffix_cache``: the suffix drafter to use (serving passes its shared actor's proxy).
    Overrides for what the spec cannot name (benchmark methods): ``drafters`` (pre-made, with their
    ``policy``) replace the spec's drafter; ``slim_tier`` (a ``SlimTier``) replaces ``slim``.
    Raises ValueError for an unknown drafter or policy, a bad slim mask, or a ``suffix_history``
    with no suffix drafter to take it."""
    from .engine import Engine

    max_len = min(spec.max_len, model.cfg.max_position)
    if drafters is None:
        if policy is not None:
            raise ValueError("build_engine: a policy override needs its drafters")
        drafters, policy = _drafters(spec, model, tokenizer, max_len, suffix_cache)
    drafters = list(drafters)
    if spec.suffix_history:
        from .traces.history import past_outputs, warm_global_tree

        # a remote suffix cache holds no tree here: its actor warms its own
        if suffix_cache is None and not any(hasattr(d, "add_to_global") for d in drafters):
            raise ValueError("suffix_history needs a suffix drafter (drafter suffix or hvd)")
        warm_global_tree(drafters, past_outputs(spec.suffix_history))
    if slim_tier is None and spec.slim:
        from .dimr import resolve_mask
        from .verification.tiered import SlimTier

        slim_tier = SlimTier(resolve_mask(spec.slim, model.cfg.n_layers), spec.slim_mode)
    from .engine.grammar import Grammars

    eos = tokenizer.eos_token_id if tokenizer is not None else None
    detokenize = (lambda t: tokenizer.decode(t, skip_special_tokens=True)) if tokenizer is not None else None
    stops = {eos, *model.cfg.eos_token_ids} - {None}
    return Engine(
        model,
        drafters=drafters,
        policy=policy,
        slim=slim_tier,
        max_batch=spec.max_batch,
        max_len=max_len,
        num_draft_tokens=spec.num_draft_tokens if drafters else 0,
        cache_draft_tokens=spec.cache_draft_tokens,
        eos_token_ids=[eos] if eos is not None else [],
        detokenize=detokenize,
        prefix_reuse=spec.prefix_reuse,
        reuse_slots=spec.reuse_slots,
        grammars=Grammars(tokenizer, model.cfg.vocab_size, stops) if tokenizer is not None else None,
        prefill_chunk=spec.prefill_chunk,
    )


def _drafters(spec: EngineSpec, model, tokenizer, max_len: int, cache) -> tuple[list, Any]:
    """(drafters, policy) of the spec; model drafters get a KV slot per engine slot."""
    from .drafters import make_drafter

    if spec.drafter == "hvd":
        from .selection.hvd import build_hvd

        return build_hvd(
            model,
            tokenizer,
            policy=spec.policy,
            predictor=spec.predictor,
            model_drafter=spec.model_drafter,
            eagle3_head=spec.eagle3_head,
            draft_model=spec.draft_model,
            slots=spec.slots(),
            max_len=max_len,
            cache=cache,
            costs_file=spec.step_costs,
        )
    if cache is not None:
        if spec.drafter != "suffix":
            raise ValueError(f"a suffix cache goes with drafter suffix or hvd, not {spec.drafter!r}")
        return [cache], None
    drafter = make_drafter(
        spec.drafter,
        model,
        draft_model=spec.draft_model,
        eagle3_head=spec.eagle3_head,
        skip=spec.layerskip,
        slots=spec.slots(),
        max_len=max_len,
    )
    return ([drafter] if drafter else []), None
