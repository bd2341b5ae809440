"""Draft sources behind one interface (see base.py)."""

from __future__ import annotations

from .base import Draft, Drafter, DraftRequest

DRAFTERS = ("none", "suffix", "eagle3", "layerskip", "draft-model")
# An EAGLE-3 chain stops once the head's path probability drops below this (benchmarks/spec.md).
EAGLE3_MIN_PROB = 0.2
# The head catches up on at most this many of the tokens since it last drafted (a new request's
# prompt): on long prompts a window of 128-512 tokens drafts as well as the whole prompt does and
# spares the head's forward over the rest.
EAGLE3_CATCH_UP_WINDOW = 256


def make_drafter(
    name: str,
    model,
    *,
    draft_model: str | None = None,
    eagle3_head: str | None = None,
    skip: str | None = None,
    slots: int = 8,
    max_len: int = 2048,
    tree: bool = False,
) -> Drafter | None:
    """Build the drafter called ``name`` for the target ``model`` (None for plain decoding)."""
    if name == "none":
        return None
    if name == "suffix":
        from .suffix import SuffixConfig, SuffixDrafter

        return SuffixDrafter(SuffixConfig(use_tree_spec=tree))
    if name == "layerskip":
        from .layerskip import LayerSkipDrafter, parse_skip

        return LayerSkipDrafter(model, parse_skip(skip) if skip else None)
    if name == "draft-model":
        from .model_drafter import draft_model_drafter

        if not draft_model:
            raise ValueError("--drafter draft-model needs --draft-model FOLDER (a model sharing the tokenizer)")
        return draft_model_drafter(draft_model, model, slots=slots, max_len=max_len)
    if name == "eagle3":
        from ..model.eagle3_head import Eagle3Head, shipped_head
        from ..model.linear import pack_linears
        from .eagle3 import Eagle3Drafter

        head = Eagle3Head.load(eagle3_head, model) if eagle3_head else shipped_head(model)
        # this head only drafts: its fp32 linears run on prepacked weights too, as the target's
        # (Eagle3Head.load cannot: training loads heads with it and packed copies take no updates)
        pack_linears(head, head.device, head.dtype, fp32=True)
        return Eagle3Drafter(
            model,
            head,
            tree=tree,
            slots=slots,
            max_len=max_len,
            min_prob=0.0 if tree else EAGLE3_MIN_PROB,
            catch_up_window=EAGLE3_CATCH_UP_WINDOW,
        )
    raise ValueError(f"unknown drafter {name!r}; choose from {', '.join(DRAFTERS)}")


__all__ = ["DRAFTERS", "Draft", "DraftRequest", "Drafter", "make_drafter"]
