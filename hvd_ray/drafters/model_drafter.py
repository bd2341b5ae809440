"""Chain drafts from a transformer run greedily: a separate small draft model, or the target itself
under a layer-skip routing mask (see layerskip.py).

The drafter feeds the context tokens its KV cache has not seen yet, then drafts ``k`` tokens one
forward at a time for the whole batch, and finally rolls its cache back so that it again holds
only committed tokens. Drafts are greedy (deterministic), so rejection sampling treats them as
one-hot proposals and the output distribution is still exactly the target's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..model.transformer import SubLayer, Transformer
from .base import Draft, Drafter, DraftRequest


class ModelDrafter(Drafter):
    """Greedy chain drafting with a :class:`Transformer`.

    ``shares_target_cache`` means ``model`` *is* the target and drafting writes into the target's
    own cache slots (self-speculation): positions at and past the committed length are scratch
    space that the next verify forward overwrites, and positions before it are exact target K/V,
    which the kept layers read. Otherwise ``model`` has its own cache with the same slot numbers.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        skip: Iterable[SubLayer] = (),
        shares_target_cache: bool = False,
        name: str = "draft-model",
        max_len: int | None = None,
        slots: int | None = None,
        depth: int = 5,
        min_prob: float = 0.0,
    ):
        self.model = model
        self.depth = depth  # each draft token costs one drafter forward: keep chains short
        self.min_prob = min_prob  # stop a chain at the first token the drafter is this unsure of
        self.skip = sorted(set(skip))
        self.shared = shares_target_cache
        self.name = name
        if not self.shared and (model.cache is None or (slots and model.cache.slots < slots)):
            model.setup_cache(slots or 8, max_len or 2048)

    def begin(self, req_id: str, prompt: Sequence[int], slot: int) -> None:
        if not self.shared:
            if slot >= self.model.cache.slots:
                raise ValueError(f"draft model has {self.model.cache.slots} cache slots, slot {slot} requested")
            self.model.cache.truncate(slot, 0)

    @torch.inference_mode()
    def propose(self, reqs: Sequence[DraftRequest]) -> list[Draft]:
        live = [r for r in reqs if r.max_tokens > 0]
        drafts = {r.req_id: Draft(source=self.name) for r in reqs}
        if not live:
            return list(drafts.values())
        cache, dev = self.model.cache, self.model.device
        slots = [r.slot for r in live]
        restore = [cache.lengths[s] if self.shared else len(r.tokens) for s, r in zip(slots, live)]
        feed = [r.tokens[cache.lengths[s] :] for s, r in zip(slots, live)]
        if self.shared:
            assert all(len(f) == 1 for f in feed), "the target cache must hold all but the pending token"
        width = max(map(len, feed))
        toks = torch.tensor([f + [0] * (width - len(f)) for f in feed], device=dev)
        logits = self.model(
            toks,
            slots,
            n_new=[len(f) for f in feed],
            skip=self.skip,
            logit_rows=torch.tensor([len(f) - 1 for f in feed], device=dev),
        ).logits[:, -1]
        want = [min(r.max_tokens, self.depth) for r in live]
        out: list[list[int]] = [[] for _ in live]
        probs: list[list[float]] = [[] for _ in live]
        going = [True] * len(live)
        for i in range(max(want)):
            best = logits.float().softmax(-1).max(-1)
            toks_i, probs_i = best.indices.tolist(), best.values.tolist()
            for b in range(len(live)):
                if going[b] and (probs_i[b] < self.min_prob or i >= want[b]):
                    going[b] = False
                if going[b]:
                    out[b].append(toks_i[b])
                    probs[b].append(probs_i[b])
            if i + 1 == max(want) or not any(going):
                break
            logits = self.model(best.indices[:, None], slots, skip=self.skip).logits[:, -1]
        for s, n in zip(slots, restore):
            cache.truncate(s, n)
        for b, r in enumerate(live):
            drafts[r.req_id] = Draft.chain(out[b], probs[b], source=self.name)
        return [drafts[r.req_id] for r in reqs]


def draft_model_drafter(folder: str, target: Transformer, *, slots: int = 8, max_len: int = 2048) -> ModelDrafter:
    """A separate small model that shares the target's tokenizer (vocabularies must match)."""
    draft = Transformer.from_pretrained(folder, dtype=target.dtype, device=target.device)
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"draft model vocab ({draft.cfg.vocab_size}) != target vocab ({target.cfg.vocab_size})")
    return ModelDrafter(draft, name="draft-model", slots=slots, max_len=max_len)
