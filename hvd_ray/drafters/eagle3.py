"""EAGLE-3 drafting: chains or dynamic trees from the head in ``hvd_ray/model/eagle3_head.py``.

Alignment (as in vLLM's proposer): the tap at target position ``i`` is paired with token ``i + 1``
and the head runs at RoPE position ``i``; its output there predicts token ``i + 2``. So after the
target has committed ``n`` positions the head's cache holds exactly ``n`` entries, its last output
predicts the token after the pending one, and draft step ``s`` (s >= 1) runs at position
``n + s - 1``. Drafting writes past the committed length and never advances it, so the rollback
after drafting is free and exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model.eagle3_head import Eagle3Head
from ..model.kv_cache import KVCache
from ..model.transformer import Transformer
from .base import Draft, Drafter, DraftRequest


@dataclass
class _ReqState:
    slot: int
    hidden: Tensor | None = None  # [H] the head's last pre-norm output (the feature to continue from)
    logp: Tensor | None = None  # [V_draft] fp32 log-probs of that output (the next draft token)
    last_token: int | None = None  # the token paired with the last observed tap (pending in target)
    # observations not yet run through the head: it catches up only when asked to draft, so a
    # policy that verifies other drafts most steps does not pay a head forward on every step
    pending_tokens: list[int] = field(default_factory=list)
    pending_taps: list[Tensor] = field(default_factory=list)
    floor: int = 0  # the head's first cache row written for this request (``catch_up_window``)
    setup_s: float = 0.0  # seconds of the last catch-up (``Draft.setup_s``)


# Backlogs of at most this many tokens are caught up together, padded to the longest (_catch_up).
CATCH_UP_BATCH = 32


class Eagle3Drafter(Drafter):
    """EAGLE-3 drafting (chain or dynamic tree) as a :class:`~hvd_ray.drafters.base.Drafter`.

    Chain: greedy top-1 of the head, up to ``min(depth, max_tokens)`` tokens (``depth`` default 5),
    stopping early once the head's own path probability (the product of its top-1 probabilities)
    falls below ``min_prob`` (EAGLE-2's observation: the head's confidence tracks acceptance, so a
    low-confidence tail costs head forwards and verify width for tokens the target rejects).
    Tree (EAGLE-2 style dynamic tree): the root's top-k children form level 1; at each level the
    current frontier (k nodes) runs through the head in one forward with a tree attention mask, each
    frontier node gets its top-k children, and the k best children by cumulative log prob become the
    next frontier; after ``depth`` levels the ``min(max_nodes, max_tokens)`` best nodes of the whole
    pool by cumulative log prob form the draft, listed best-first (a child never scores above its
    parent, so parents come first and every prefix is the best tree of that size).
    ``depth`` defaults to 8 for trees (the paper setting, with top-k 4 and ~32 nodes).

    ``Draft.probs[i]`` is the head's softmax probability of token i given its parent; ``score`` is
    the sum over draft nodes of their path probabilities (the head's own expected accepted length).
    """

    name = "eagle3"

    def __init__(
        self,
        target: Transformer,
        head: Eagle3Head,
        *,
        tree: bool = False,
        top_k: int = 4,
        depth: int | None = None,
        max_nodes: int = 32,
        min_prob: float = 0.0,
        slots: int | None = None,
        max_len: int | None = None,
        catch_up_window: int | None = None,
    ):
        if not 0.0 <= min_prob < 1.0:
            raise ValueError(f"min_prob must be in [0, 1), got {min_prob}")
        self.target, self.head = target, head
        self.min_prob = min_prob
        self.tree = tree
        self.top_k = max(1, min(top_k, head.cfg.draft_vocab_size))
        self.depth = depth if depth is not None else (8 if tree else 5)
        if self.depth < 1 or max_nodes < 1:
            raise ValueError("depth and max_nodes must be >= 1")
        self.max_nodes = max_nodes
        self.needs_taps: tuple[int, ...] = head.tap_layers
        self._slots, self._max_len = slots, max_len
        if catch_up_window is not None and catch_up_window < 1:
            raise ValueError(f"catch_up_window must be >= 1 (or None: the whole context), got {catch_up_window}")
        self.catch_up_window = catch_up_window
        self._reqs: dict[str, _ReqState] = {}

    # ----------------------------------------------------------------------------- bookkeeping
    @property
    def draft_room(self) -> int:
        """Cache rows past the committed length that one propose may write."""
        return max(self.depth, self.top_k * self.depth)

    def _ensure_cache(self) -> KVCache:
        """The head's cache, sized like the target's (plus drafting room), made on first use and
        remade while no request is live if the target's cache has outgrown it."""
        head, tc = self.head, self.target.cache
        slots = self._slots or (tc.slots if tc is not None else None)
        max_len = self._max_len or (tc.max_len if tc is not None else None)
        if head.cache is not None and (self._reqs or slots is None or max_len is None):
            return head.cache
        if slots is None or max_len is None:
            raise RuntimeError("set up the target's cache first, or pass slots= and max_len=")
        c = head.cache
        if c is None or c.slots < slots or c.max_len < max_len + self.draft_room:
            head.setup_cache(slots, max_len + self.draft_room)
        return head.cache

    def begin(self, req_id: str, prompt: Sequence[int], slot: int) -> None:
        cache = self._ensure_cache()
        if not 0 <= slot < cache.slots:
            raise ValueError(f"slot {slot} is outside the head's cache ({cache.slots} slots)")
        cache.lengths[slot] = 0
        self._reqs[req_id] = _ReqState(slot)

    def reuse_prefix(self, req_id: str, n: int) -> None:
        # taps come from position n on: the head's rows below it stay unwritten, hidden by the floor
        st = self._state(req_id)
        self.head.cache.lengths[st.slot] = st.floor = n

    def accept(self, req_id: str, tokens: Sequence[int]) -> None:
        # Everything the head needs arrives through observe_target (tokens paired with taps).
        self._state(req_id)

    def live_requests(self) -> int:
        return len(self._reqs)

    def end(self, req_id: str) -> None:
        st = self._reqs.pop(req_id, None)
        if st is not None and self.head.cache is not None:
            self.head.cache.lengths[st.slot] = 0

    def _state(self, req_id: str) -> _ReqState:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise KeyError(f"request {req_id!r} is unknown to the eagle3 drafter (call begin first)") from None

    def committed(self, req_id: str) -> int:
        """The head's committed cache length for a request (= the target's committed length)."""
        st = self._state(req_id)
        return self.head.cache.lengths[st.slot] + len(st.pending_tokens)

    def rollback(self, req_id: str, length: int) -> None:
        """Forget observed positions from ``length`` on (the next observe must re-supply them)."""
        st = self._state(req_id)
        self._catch_up([(req_id, st)])
        self.head.cache.truncate(st.slot, length)
        st.floor = min(st.floor, length)  # rows from ``length`` on are written again by the next catch-up
        st.hidden = st.logp = st.last_token = None

    # --------------------------------------------------------------------------------- observe
    def _order_taps(self, taps: Tensor) -> Tensor:
        """Taps in ``needs_taps`` order; also accepts the sorted distinct layers (an engine that
        taps the union of its drafters' layers once and this is its only tap drafter)."""
        Ht = self.head.cfg.target_hidden_size
        width = taps.shape[-1]
        if width == len(self.needs_taps) * Ht:
            return taps
        distinct = sorted(set(self.needs_taps))
        if width == len(distinct) * Ht:
            parts = taps.split(Ht, dim=-1)
            return torch.cat([parts[distinct.index(t)] for t in self.needs_taps], dim=-1)
        raise ValueError(
            f"taps are {width} wide; expected {len(self.needs_taps)} x {Ht} "
            f"(the target's layers {self.needs_taps} concatenated in that order)"
        )

    def observe_target(self, req_id: str, next_tokens: Sequence[int], taps: Tensor) -> None:
        """Record ``n`` committed positions: ``taps [n, 3*H_target]`` with the tokens that follow
        them. The head runs over them (appending n rows to its cache, at the target's positions)
        the next time it drafts for this request."""
        st = self._state(req_id)
        n = len(next_tokens)
        if taps.dim() != 2 or taps.shape[0] != n:
            raise ValueError(f"taps must be [n, width] with n = len(next_tokens) = {n}; got {tuple(taps.shape)}")
        if n == 0:
            return
        st.pending_tokens.extend(int(t) for t in next_tokens)
        st.pending_taps.append(self._order_taps(taps))

    @torch.inference_mode()
    def _catch_up(self, reqs: Sequence[tuple[str, _ReqState]]) -> None:
        """Run the head over the observations recorded since it last drafted, for each of ``reqs``
        (req_id, state): only the last ``catch_up_window`` of them (a new request's prompt), and
        the short backlogs of several requests in one padded forward (under load a request drafts
        every few steps, and one head forward per request costs ~3 ms whatever its length)."""
        head = self.head
        cache = self._ensure_cache()
        todo = []  # (state, tokens, taps) in the window
        for req_id, st in reqs:
            n = len(st.pending_tokens)
            if n == 0:
                continue
            if cache.lengths[st.slot] + n + self.draft_room > cache.max_len:
                raise ValueError(f"request {req_id!r} would overflow the head's cache ({cache.max_len} rows)")
            taps = torch.cat(st.pending_taps)
            skip = n - self.catch_up_window if self.catch_up_window is not None else 0
            if skip > 0:  # only the last window: the rows skipped stay unwritten, hidden below the floor
                cache.lengths[st.slot] += skip
                st.floor = cache.lengths[st.slot]
                taps, st.pending_tokens = taps[skip:], st.pending_tokens[skip:]
            st.pending_taps = [taps]  # (the backlog as it will run, should a failed propose be retried)
            todo.append((st, st.pending_tokens, taps))
        # (padding writes up to CATCH_UP_BATCH rows past a backlog: only where the cache has room)
        short = [
            t
            for t in todo
            if len(t[1]) <= CATCH_UP_BATCH and cache.lengths[t[0].slot] + CATCH_UP_BATCH <= cache.max_len
        ]
        if len(short) < 2:
            short = []
        batched = {id(st) for st, _, _ in short}
        for group in ([short] if short else []) + [[t] for t in todo if id(t[0]) not in batched]:
            t0 = time.perf_counter()
            T = max(len(tokens) for _, tokens, _ in group)
            # rows past a backlog are padding: written past its length, never seen, overwritten later
            fused = head.fuse(torch.stack([F.pad(taps, (0, 0, 0, T - len(tokens))) for _, tokens, taps in group]))
            ids = torch.tensor(
                [tokens + [tokens[-1]] * (T - len(tokens)) for _, tokens, _ in group], device=head.device
            )
            sts = [st for st, _, _ in group]
            starts = [cache.lengths[st.slot] for st in sts]
            prenorm, logits = head(
                ids,
                fused,
                [st.slot for st in sts],
                starts=starts,
                advance=False,
                floors=[st.floor for st in sts],
                logits_at=[len(t) - 1 for _, t, _ in group],
            )
            for b, (st, tokens, _) in enumerate(group):
                cache.lengths[st.slot] = starts[b] + len(tokens)
                st.hidden = prenorm[b, len(tokens) - 1]
                st.logp = torch.log_softmax(logits[b, 0].float(), dim=-1)
                st.last_token = tokens[-1]
                st.pending_tokens, st.pending_taps = [], []
            spent, total = time.perf_counter() - t0, sum(len(t) for _, t, _ in group)
            for st, tokens, _ in group:  # each request's share, by its tokens
                st.setup_s = spent * len(tokens) / total

    # --------------------------------------------------------------------------------- propose
    @torch.inference_mode()
    def propose(self, reqs: Sequence[DraftRequest]) -> list[Draft]:
        drafts = [Draft(source=self.name) for _ in reqs]
        asked = [(i, self._state(r.req_id)) for i, r in enumerate(reqs) if r.max_tokens > 0]
        self._catch_up([(reqs[i].req_id, st) for i, st in asked])
        live: list[tuple[int, _ReqState, int, int]] = []  # (index, state, committed, budget)
        for i, st in asked:
            r = reqs[i]
            if st.logp is None:
                continue
            n = self.head.cache.lengths[st.slot]
            if r.slot != st.slot:
                raise ValueError(f"request {r.req_id!r} began in slot {st.slot} but drafts in slot {r.slot}")
            if len(r.tokens) - 1 != n or r.tokens[-1] != st.last_token:
                raise RuntimeError(
                    f"eagle3 head is out of step with request {r.req_id!r}: it observed {n} positions "
                    f"ending in token {st.last_token}, the request has {len(r.tokens) - 1} committed "
                    f"tokens and pending token {r.tokens[-1]} (call observe_target after every target "
                    "forward with the accepted positions)"
                )
            live.append((i, st, n, r.max_tokens))
        if live:
            made = self._tree(live) if self.tree else self._chain(live)
            for (i, *_), d in zip(live, made):
                drafts[i] = d
        for i, st in asked:
            drafts[i].setup_s, st.setup_s = st.setup_s, 0.0
        return drafts

    def _chain(self, live: list[tuple[int, _ReqState, int, int]]) -> list[Draft]:
        head = self.head
        want = [min(self.depth, budget) for *_, budget in live]
        logp = torch.stack([st.logp for _, st, _, _ in live])
        hidden = torch.stack([st.hidden for _, st, _, _ in live])
        lp, tok = logp.max(dim=-1)  # [B]
        toks, lps = [tok], [lp]
        floor = math.log(self.min_prob) if self.min_prob > 0 else None
        cum = lp.clone()
        rows = list(range(len(live)))
        for s in range(1, max(want) + 1):
            if floor is not None:  # token s-1 is kept only while the path stays above the floor
                for b, ok in enumerate((cum >= floor).tolist()):
                    if not ok and want[b] > s - 1:
                        want[b] = s - 1
            rows = [b for b in rows if want[b] > s]
            if not rows:
                break
            sel = torch.tensor(rows, device=head.device)
            prenorm, logits = head(
                head.to_target_ids(toks[-1][sel])[:, None],
                hidden[sel][:, None],
                [live[b][1].slot for b in rows],
                starts=[live[b][2] + s - 1 for b in rows],
                advance=False,
                floors=[live[b][1].floor for b in rows],
            )
            step_lp, step_tok = torch.log_softmax(logits[:, 0].float(), -1).max(dim=-1)
            hidden = hidden.clone()
            hidden[sel] = prenorm[:, 0]
            nt, nl = toks[-1].clone(), lps[-1].clone()
            nt[sel], nl[sel] = step_tok, step_lp
            toks.append(nt)
            lps.append(nl)
            cum = cum + nl
        tok_t = head.to_target_ids(torch.stack(toks, 1)).tolist()  # [B, steps]
        lp_t = torch.stack(lps, 1).tolist()
        out = []
        for b, n in enumerate(want):
            probs = [math.exp(x) for x in lp_t[b][:n]]
            score = sum(_running_products(probs))
            out.append(Draft.chain(tok_t[b][:n], probs, score=score, source=self.name))
        return out

    def _tree(self, live: list[tuple[int, _ReqState, int, int]]) -> list[Draft]:
        head = self.head
        dev = head.device
        B, k, H = len(live), self.top_k, head.cfg.hidden_size
        budgets = [min(self.max_nodes, budget) for *_, budget in live]
        depths_b = [min(self.depth, n) for n in budgets]
        D = max(depths_b)
        slots = [st.slot for _, st, _, _ in live]
        committed = torch.tensor([n for _, _, n, _ in live], device=dev)
        logp = torch.stack([st.logp for _, st, _, _ in live])

        # Level 1: the root's top-k. Pool arrays are lists of [B, m] tensors, concatenated at the end.
        f_lp, f_tok = logp.topk(k, dim=-1)
        pool_tok, pool_lp, pool_score = [f_tok], [f_lp], [f_lp]
        pool_parent = [torch.full((B, k), -1, dtype=torch.long, device=dev)]
        pool_depth = [torch.ones(B, k, dtype=torch.long, device=dev)]
        f_score, f_pool = f_lp, torch.arange(k, device=dev).expand(B, k)
        f_hidden = torch.stack([st.hidden for _, st, _, _ in live])[:, None].expand(B, k, H)
        anc = torch.zeros(B, k, max(D - 1, 1) * k, dtype=torch.bool, device=dev)  # draft rows seen
        offset = k
        ar_k = torch.arange(k, device=dev)
        for lvl in range(1, D):  # run the depth-lvl frontier; its children are depth lvl + 1
            base = (lvl - 1) * k
            anc[:, ar_k, base + ar_k] = True  # each node sees itself
            span = int(committed.max()) + lvl * k
            kpos = torch.arange(span, device=dev)
            mask = (kpos[None, :] < committed[:, None])[:, None, :].expand(B, k, span).clone()
            cols = (committed[:, None] + torch.arange(lvl * k, device=dev))[:, None, :].expand(B, k, lvl * k)
            mask.scatter_(2, cols, anc[:, :, : lvl * k])
            prenorm, logits = head(
                head.to_target_ids(f_tok),
                f_hidden,
                slots,
                starts=(committed + base).tolist(),
                positions=(committed + lvl - 1)[:, None].expand(B, k),
                attn_mask=mask,
                advance=False,
                floors=[st.floor for _, st, _, _ in live],
            )
            c_lp, c_tok = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)  # [B, k, k]
            c_score = f_score[:, :, None] + c_lp
            pool_tok.append(c_tok.reshape(B, k * k))
            pool_lp.append(c_lp.reshape(B, k * k))
            pool_score.append(c_score.reshape(B, k * k))
            pool_parent.append(f_pool[:, :, None].expand(B, k, k).reshape(B, k * k))
            pool_depth.append(torch.full((B, k * k), lvl + 1, dtype=torch.long, device=dev))
            if lvl < D - 1:
                f_score, sel = c_score.reshape(B, k * k).topk(k, dim=-1)
                par = sel // k
                f_tok = c_tok.reshape(B, k * k).gather(1, sel)
                f_hidden = prenorm.gather(1, par[:, :, None].expand(B, k, H))
                anc = anc.gather(1, par[:, :, None].expand(B, k, anc.shape[-1]))
                f_pool = offset + sel
            offset += k * k

        tok = head.to_target_ids(torch.cat(pool_tok, 1)).tolist()
        lp = torch.cat(pool_lp, 1).tolist()
        score = torch.cat(pool_score, 1).tolist()
        parent = torch.cat(pool_parent, 1).tolist()
        depth = torch.cat(pool_depth, 1).tolist()
        out = []
        for b in range(B):
            order = sorted(
                (i for i in range(len(tok[b])) if depth[b][i] <= depths_b[b]),
                key=lambda i: (-score[b][i], depth[b][i], i),
            )
            nodes: list[int] = []  # best-first, so every prefix is the best tree of its size
            where: dict[int, int] = {}
            for i in order:
                if len(nodes) == budgets[b]:
                    break
                if parent[b][i] == -1 or parent[b][i] in where:
                    where[i] = len(nodes)
                    nodes.append(i)
            out.append(
                Draft(
                    token_ids=[tok[b][i] for i in nodes],
                    parents=[-1 if parent[b][i] == -1 else where[parent[b][i]] for i in nodes],
                    probs=[math.exp(lp[b][i]) for i in nodes],
                    score=sum(math.exp(score[b][i]) for i in nodes),
                    source=self.name,
                )
            )
        return out

    # -------------------------------------------------------------------------------- utilities
    @torch.inference_mode()
    def score_path(self, req_id: str, tokens: Sequence[int]) -> list[float]:
        """The head's probability of each target token along a path from the pending token, by
        plain sequential head steps (nothing is committed). Tokens outside the draft vocab get 0."""
        st = self._state(req_id)
        self._catch_up([(req_id, st)])
        if st.logp is None:
            raise RuntimeError(f"request {req_id!r} has no observed positions yet")
        head = self.head
        n = head.cache.lengths[st.slot]
        logp, hidden, probs = st.logp, st.hidden, []
        for s, t in enumerate(tokens):
            if not bool(head.t2d[t]):
                return probs + [0.0] * (len(tokens) - s)
            d = int(
                torch.searchsorted(
                    torch.arange(head.cfg.draft_vocab_size, device=head.device) + head.d2t,
                    torch.tensor(t, device=head.device),
                )
            )
            probs.append(math.exp(float(logp[d])))
            if s + 1 < len(tokens):
                prenorm, logits = head(
                    torch.tensor([[t]], device=head.device),
                    hidden[None, None],
                    [st.slot],
                    starts=[n + s],
                    advance=False,
                    floors=[st.floor],
                )
                hidden, logp = prenorm[0, 0], torch.log_softmax(logits[0, 0].float(), -1)
        return probs


def _running_products(xs: Sequence[float]) -> list[float]:
    """Running products: the path probability of each node of a chain."""
    out, acc = [], 1.0
    for x in xs:
        acc *= x
        out.append(acc)
    return out
