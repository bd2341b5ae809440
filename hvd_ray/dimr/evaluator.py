"""Slim-mask evaluation: a mask's KL, R, top-1 agreement and agreed run against the full target.

Each calibration sequence is prefilled once by the full target, and its windows are then run
through the slim view on top of that prefix. The full target's log-probs at those positions are
computed once (top-k plus a folded remainder, see ``cost.coarse_logprobs``), so an evaluation costs
only the slim forwards: one batched forward per window index, all sequences at once. Windows of a
sequence are scored latest-first, so a window's slim K/V writes never sit under a later-scored
window's prefix; the target's K/V at window positions is restored before every evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .calibration import CalibSeq
from .cost import DEFAULT_ALPHA, DEFAULT_BETA, kl, r_cost, with_remainder
from .mask import SlimMask, SubLayer


class SlimEvaluator:
    """Scores slim masks against the full target on a fixed set of windows (see the module docstring).

    Owns ``model.cache`` (one slot per sequence). Building it costs one full-target pass over every
    sequence; :meth:`evaluate` then costs ``n_windows`` slim forwards.
    """

    def __init__(self, model, seqs: Sequence[CalibSeq], *, width: int = 8, topk: int = 64):
        if not seqs:
            raise ValueError("empty calibration set")
        n_win = {len(s.starts) for s in seqs}
        if len(n_win) != 1 or 0 in n_win:
            raise ValueError("every calibration sequence needs the same, non-zero number of windows (place_windows)")
        self.model, self.seqs, self.width, self.topk = model, list(seqs), width, topk
        self.rounds = n_win.pop()
        n = len(seqs)
        max_len = max(max(s.starts) + width for s in seqs)
        model.setup_cache(n, -(-max_len // 64) * 64)
        cache, dev = model.cache, model.device
        ids, logq = [], []
        for i, s in enumerate(seqs):
            first, last = min(s.starts), max(s.starts) + width
            if first > 0:
                model(torch.tensor([s.tokens[:first]], device=dev), [i], last_only=True)
            lp = torch.log_softmax(model(torch.tensor([s.tokens[first:last]], device=dev), [i]).logits[0].float(), -1)
            rows = torch.stack([lp[st - first : st - first + width] for st in s.starts])  # [R, W, V]
            top, idx = rows.topk(topk, dim=-1)
            ids.append(idx.cpu())
            logq.append(with_remainder(top).cpu())
        self.ids = torch.stack(ids, 1)  # [R, n, W, k]
        self.logq = torch.stack(logq, 1)  # [R, n, W, k+1]
        self.slots = list(range(n))
        self.starts = [[s.starts[r] for s in seqs] for r in range(self.rounds)]
        self.tokens = [
            torch.tensor([s.tokens[s.starts[r] : s.starts[r] + width] for s in seqs], device=dev)
            for r in range(self.rounds)
        ]
        si = torch.tensor(self.slots, device=dev)[:, None].expand(n, width)
        self._index = [
            (si, torch.tensor(st, device=dev)[:, None] + torch.arange(width, device=dev)) for st in self.starts
        ]
        self._backup = [
            [(kc[si_, :, pi].clone(), vc[si_, :, pi].clone()) for kc, vc in zip(cache.k, cache.v)]
            for si_, pi in self._index
        ]

    @property
    def positions(self) -> int:
        return self.rounds * len(self.seqs) * self.width

    def _restore(self) -> None:
        cache = self.model.cache
        for (si, pi), saved in zip(self._index, self._backup):
            for kc, vc, (kb, vb) in zip(cache.k, cache.v, saved):
                kc[si, :, pi] = kb
                vc[si, :, pi] = vb

    @torch.inference_mode()
    def evaluate(
        self, skip: Sequence[SubLayer] | SlimMask = (), *, alpha: float = DEFAULT_ALPHA, beta: float = DEFAULT_BETA
    ) -> dict[str, float]:
        """Mean KL(q‖q'), R, top-1 agreement and mean agreed run per window, over all positions.

        ``run`` is the mean length of the prefix of a window on which q' and q agree on the top-1
        token: how far a slim tier would get through a perfect draft before it diverges.
        """
        skip = skip.skipped if isinstance(skip, SlimMask) else list(skip)
        self._restore()
        cache, m = self.model.cache, self.model
        kls, rs, agree = [], [], []
        for r in range(self.rounds):
            for slot, st in zip(self.slots, self.starts[r]):
                cache.lengths[slot] = st
            logits = m(self.tokens[r], self.slots, skip=skip).logits.float()
            lp = torch.log_softmax(logits, -1)
            ids = self.ids[r].to(lp.device)
            slim = with_remainder(lp.gather(-1, ids))
            logq = self.logq[r].to(lp.device)
            kls.append(kl(logq, slim).cpu())
            rs.append(r_cost(slim, logq, alpha, beta).cpu())
            agree.append((logits.argmax(-1) == ids[..., 0]).cpu())
        a = torch.stack(agree)  # [R, n, W]
        return {
            "kl": torch.stack(kls).mean().item(),
            "r": torch.stack(rs).mean().item(),
            "top1": a.float().mean().item(),
            "run": a.long().cumprod(-1).sum(-1).float().mean().item(),
        }
