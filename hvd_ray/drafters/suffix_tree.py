"""One concept: the depth-bounded suffix tree of SuffixDecoding, and drafting from it.

A ``SuffixTree`` holds every substring of length <= ``max_depth`` of its sequences, path-compressed,
with ``count`` = occurrences of the node's string (suffixes passing through it). Appending a token
touches only the ``max_depth`` *active* nodes of that sequence (where its last ``max_depth``
suffixes end), so it is O(depth); the cases mirror arctic-inference's C++ tree so that every active
suffix ends exactly at a node end. Each node caches its most frequent child (``best``, ties to the
smaller token id) so a greedy draft is a pointer walk. A draft token's path probability (product of
child/parent counts) telescopes to ``count(path node) / count(match node)`` and is computed that
way, so equal drafts score exactly equal across match lengths and trees.

Drafting (:func:`search`) tries match lengths longest-first and skips one when a score upper bound
cannot beat the best so far, so a step evaluates a handful of candidates; where a sequence's active
nodes already sit on the context's suffixes, matching them is free. The drafter that keeps a tree
per request and a global one is ``suffix.py`` (as arctic-inference keeps its tree and its cache
apart).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from hvd_ray.drafters.base import Draft

__all__ = ["SpecParams", "SuffixTree", "materialize", "search"]


class _Node:
    """A tree node: tokens ``ref[ref_idx:ref_idx+length]`` and their occurrence ``count``."""

    __slots__ = ("count", "token", "length", "ref", "ref_idx", "parent", "children", "best")

    def __init__(self, count: int, token: int, length: int, ref: list, ref_idx: int, parent: _Node | None) -> None:
        self.count = count
        self.token = token  # first token (the key in the parent's children)
        self.length = length
        self.ref = ref  # list holding the tokens (a sequence, or a private copy)
        self.ref_idx = ref_idx
        self.parent = parent
        self.children: dict[int, _Node] | None = None  # None for leaves: saves a dict per leaf
        self.best: _Node | None = None  # most frequent child (not for root)


def _best_child(children: dict[int, _Node] | None) -> _Node | None:
    if not children:
        return None
    return min(children.values(), key=lambda c: (-c.count, c.token))


def _bump_best(node: _Node, child: _Node) -> None:
    """``child``'s count just grew (or it is new): make it ``node.best`` if it now wins."""
    b = node.best
    if b is None or (b is not child and (child.count > b.count or (child.count == b.count and child.token < b.token))):
        node.best = child


class SuffixTree:
    """One depth-bounded, path-compressed suffix tree over many sequences, with counts."""

    def __init__(self, max_depth: int = 64) -> None:
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self.max_depth = max_depth
        self._root = _Node(0, -1, 0, [], 0, None)
        self._root.children = {}
        self._seqs: dict[Hashable, list[int]] = {}
        # Per sequence: nodes where its last <= max_depth suffixes end, longest suffix first, so
        # ``active[-m]`` is the node of the length-m suffix (always at that node's end).
        self._active: dict[Hashable, list[_Node]] = {}

    # ------------------------------------------------------------------ building
    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def num_tokens(self) -> int:
        return self._root.count

    def seq(self, seq_id: Hashable) -> list[int]:
        return self._seqs[seq_id]

    def active(self, seq_id: Hashable) -> list[_Node] | None:
        """The nodes where the sequence's last suffixes end (``active[-m]``: the length-m one), or
        None for a sequence the tree does not hold; :func:`search` matches from them for free."""
        return self._active.get(seq_id)

    def add_seq(self, seq_id: Hashable) -> None:
        """Register an empty sequence (so it has a slot before its first token)."""
        if seq_id not in self._seqs:
            self._seqs[seq_id] = []
            self._active[seq_id] = []

    def extend(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        self.add_seq(seq_id)
        for t in tokens:
            self.append(seq_id, t)

    def append(self, seq_id: Hashable, token: int) -> None:
        """Append one token: every active suffix of the sequence grows by it (O(max_depth))."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            self.add_seq(seq_id)
            seq = self._seqs[seq_id]
        active = self._active[seq_id]
        root = self._root
        token = int(token)
        active.append(root)
        root.count += 1
        if len(active) > self.max_depth:
            del active[0]  # that suffix reached max_depth: it stops growing
        seq.append(token)
        n = len(seq)
        for i in range(len(active)):
            node = active[i]
            if node.count == 1 and node is not root:
                # 1a: only this suffix goes through the node, so it is a leaf: grow it in place.
                node.length += 1
                if node.ref is not seq:  # only after a removal left it on another's tokens
                    node.ref = seq
                    node.ref_idx = n - node.length
                continue
            ch = node.children
            child = ch.get(token) if ch is not None else None
            if child is None:
                # 1b: a new leaf for the token.
                new = _Node(1, token, 1, seq, n - 1, node)
                if ch is None:
                    node.children = {token: new}
                    node.best = new
                else:
                    ch[token] = new
                    if node is not root:
                        _bump_best(node, new)
                active[i] = new
            elif node is not root and node.count == child.count + 1:
                # 2: this suffix ends here and every other one continues into ``child``.
                if child.length == 1:
                    # 2a: fuse node into child; child takes node's place under its parent.
                    parent = node.parent
                    child.count += 1
                    child.token = node.token
                    child.length = node.length + 1
                    child.ref = seq
                    child.ref_idx = n - child.length
                    child.parent = parent
                    parent.children[child.token] = child
                    if parent.best is node:
                        parent.best = child
                    active[i] = child
                else:
                    # 2b: move the child's first token up into node.
                    node.length += 1
                    node.ref = seq
                    node.ref_idx = n - node.length
                    child.length -= 1
                    child.ref_idx += 1
                    new_tok = child.ref[child.ref_idx]
                    if new_tok != token:
                        del ch[token]
                        ch[new_tok] = child
                    child.token = new_tok
            elif child.length == 1:
                # 3a: step into the child.
                child.count += 1
                if node is not root:
                    _bump_best(node, child)
                active[i] = child
            else:
                # 3b: split child after its first token; the suffix ends at the new node.
                new = _Node(child.count + 1, token, 1, seq, n - 1, node)
                ch[token] = new
                child.length -= 1
                child.ref_idx += 1
                child.token = child.ref[child.ref_idx]
                child.parent = new
                new.children = {child.token: child}
                new.best = child
                if node is not root:
                    if node.best is child:
                        node.best = new
                    _bump_best(node, new)
                active[i] = new

    def remove(self, seq_id: Hashable) -> None:
        """Drop a sequence: decrement counts along all its suffixes, prune zero-count subtrees."""
        seq = self._seqs.pop(seq_id)
        del self._active[seq_id]
        root = self._root
        n = len(seq)
        for start in range(n):
            root.count -= 1
            node, i = root, start
            while i < n:
                ch = node.children
                child = ch.get(seq[i]) if ch is not None else None
                if child is None:
                    break
                if child.count == 1:
                    del ch[seq[i]]
                    if not ch:
                        node.children = None
                    if node is not root and node.best is child:
                        node.best = _best_child(node.children)
                    break
                child.count -= 1
                if node is not root and node.best is child:
                    node.best = _best_child(ch)
                if child.ref is seq:  # keep only the node's own tokens, not the whole sequence
                    child.ref = seq[child.ref_idx : child.ref_idx + child.length]
                    child.ref_idx = 0
                i += child.length
                node = child
            # A node left with one child of equal count is a chain: merge it into the child.
            ch = node.children
            if node is not root and ch is not None and len(ch) == 1:
                (c,) = ch.values()
                if c.count == node.count:
                    c.ref = (
                        node.ref[node.ref_idx : node.ref_idx + node.length] + c.ref[c.ref_idx : c.ref_idx + c.length]
                    )
                    c.ref_idx = 0
                    c.token = node.token
                    c.length += node.length
                    c.parent = parent = node.parent
                    parent.children[c.token] = c
                    if parent.best is node:
                        parent.best = c

    # ------------------------------------------------------------------ queries
    def _walk(self, ctx: Sequence[int], start: int, end: int) -> tuple[_Node, int] | None:
        """Node and offset where ``ctx[start:end]`` ends in the tree, or None if it never occurs."""
        node, idx, i = self._root, 0, start
        while i < end:
            ch = node.children
            if ch is None:
                return None
            child = ch.get(ctx[i])
            if child is None:
                return None
            node = child
            L = child.length
            if L == 1:
                i += 1
                idx = 1
                continue
            k = min(L, end - i)
            r = child.ref_idx
            if child.ref[r + 1 : r + k] != ctx[i + 1 : i + k]:
                return None
            i += k
            idx = k
        return node, idx

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of ``pattern`` (len <= max_depth) in the stored sequences."""
        pattern = list(pattern)
        if not pattern:
            return self._root.count
        hit = self._walk(pattern, 0, len(pattern))
        return hit[0].count if hit is not None else 0

    def match(self, context: Sequence[int]) -> int:
        """Length of the longest suffix of ``context`` (<= max_depth) that occurs in the tree."""
        context = list(context)
        return self._longest(context, 0, min(len(context), self.max_depth))

    def _longest(self, ctx: Sequence[int], lo: int, hi: int) -> int:
        """The longest ``m`` in ``[lo, hi]`` whose suffix ``ctx[-m:]`` occurs, ``ctx[-lo:]`` known to
        (occurrence is monotone: a suffix of an occurring pattern occurs)."""
        n = len(ctx)
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if self._walk(ctx, n - mid, n) is not None:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def continuations(self, pattern: Sequence[int]) -> dict[int, int]:
        """Next-token counts after ``pattern`` (for tests and analysis)."""
        pattern = list(pattern)
        hit = self._walk(pattern, 0, len(pattern)) if len(pattern) else (self._root, 0)
        if hit is None:
            return {}
        node, idx = hit
        if idx < node.length:
            return {node.ref[node.ref_idx + idx]: node.count}
        return {t: c.count for t, c in (node.children or {}).items()}

    def patterns(self) -> dict[tuple[int, ...], int]:
        """Every stored string with its count, expanded token by token (for tests: O(tree))."""
        out: dict[tuple[int, ...], int] = {}
        stack = [(c, ()) for c in (self._root.children or {}).values()]
        while stack:
            node, prefix = stack.pop()
            toks = node.ref[node.ref_idx : node.ref_idx + node.length]
            for j in range(1, node.length + 1):
                out[prefix + tuple(toks[:j])] = node.count
            prefix = prefix + tuple(toks)
            stack.extend((c, prefix) for c in (node.children or {}).values())
        return out

    def check(self) -> None:
        """Assert structural invariants (tests only)."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            ch = node.children or {}
            assert sum(c.count for c in ch.values()) <= node.count
            if node is not self._root:
                assert node.length >= 1 and node.count >= 1
                assert node.ref[node.ref_idx] == node.token
                assert node.ref_idx + node.length <= len(node.ref)
                assert node.parent.children[node.token] is node
                assert node.best is _best_child(ch), "stale best child"
            for t, c in ch.items():
                assert c.token == t and c.parent is node
                assert node is self._root or c.count < node.count, "uncompressed chain"
            stack.extend(ch.values())

    # ------------------------------------------------------------------ drafting
    def speculate(
        self,
        context: Sequence[int],
        max_spec_tokens: int = 64,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        use_tree_spec: bool = False,
    ) -> Draft:
        """Best draft over all match lengths of ``context``'s suffixes (walked from the root)."""
        ctx = context if isinstance(context, list) else list(context)
        p = SpecParams(max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob, use_tree_spec)
        hit = search(self, ctx, None, p, 0.0)
        return materialize(hit, p, "suffix")


class SpecParams:
    """How a draft is sized and cut: ``SuffixConfig``'s drafting fields, checked."""

    __slots__ = ("max_spec_tokens", "factor", "offset", "min_prob", "tree")

    def __init__(self, max_spec_tokens: int, factor: float, offset: float, min_prob: float, tree: bool) -> None:
        if factor < 0:
            raise ValueError("max_spec_factor must be >= 0")
        self.max_spec_tokens = int(max_spec_tokens)
        self.factor = float(factor)
        self.offset = float(offset)
        self.min_prob = float(min_prob)
        self.tree = bool(tree)


# A search hit: (score, match node, offset in it, match_len, token limit, tree draft or None)
_Hit = tuple


def search(tree: SuffixTree, ctx: list[int], active: list[_Node] | None, p: SpecParams, best: float) -> _Hit | None:
    """Best draft from ``tree`` whose score beats ``best`` (strictly), longest match first.

    ``active``, if given, are the active nodes of a sequence whose last tokens are ``ctx``'s last
    ``len(active)`` tokens, so ``active[-m]`` is already the match for ``ctx[-m:]``; they count that
    sequence's own occurrence, so only counts >= 2 leave anything to draft.
    """
    n_ctx = len(ctx)
    max_depth = tree.max_depth
    hi = min(n_ctx, max_depth - 1)  # a match at max_depth leaves no room to draft
    if hi <= 0 or tree._root.count == 0:
        return None
    k = min(len(active), hi) if active else 0
    # M = longest useful match length (matches are monotone in m, so binary search).
    if k and active[-1].count >= 2:
        lo, h = 1, k
        while lo < h:
            mid = (lo + h + 1) >> 1
            if active[-mid].count >= 2:
                lo = mid
            else:
                h = mid - 1
        M = lo
        if M == k == len(active) and k < hi:
            # The sequence is shorter than the context: longer suffixes reach into text it
            # lacks (the prompt), so look them up elsewhere in the tree.
            M = tree._longest(ctx, k, hi)
    elif k:
        return None
    else:
        M = tree._longest(ctx, 0, hi)
    cap, factor, offset, min_prob = p.max_spec_tokens, p.factor, p.offset, p.min_prob
    chain = not p.tree
    found = None
    for m in range(M, 0, -1):
        a = int(m * factor + offset + 1e-6)
        if a > cap:
            a = cap
        if a <= best:
            break  # a(m) only shrinks with m: nothing shorter can win
        room = max_depth - m if chain else a  # a chain is at most as long as the depth left
        u = a if a < room else room
        if u <= best:
            continue
        if m <= k:
            node = active[-m]
            idx = node.length
        else:
            hit = tree._walk(ctx, n_ctx - m, n_ctx)
            if hit is None:
                continue
            node, idx = hit
        start = node
        base = node.count
        if idx < node.length:
            c1 = base
        else:
            b = node.best if node.children is not None else None
            if b is None:
                continue
            c1 = b.count
        if c1 / base < min_prob or c1 * u / base <= best:
            continue
        if not chain:
            tdraft = _tree_draft(node, idx, base, u, min_prob)
            score = tdraft[0] / base
            if score > best:
                best = score
                found = (score, node, idx, m, u, tdraft)
            continue
        # Greedy chain, scored without building it: sum of counts along the path / base.
        total = 0
        got = 0
        rem = node.length - idx
        if rem > 0:
            got = rem if rem < u else u
            total = base * got
        while got < u:
            b = node.best
            if b is None:
                break
            c = b.count
            if c / base < min_prob:
                break
            take = b.length
            if take > u - got:
                take = u - got
            total += c * take
            got += take
            node = b
        score = total / base
        if score > best:
            best = score
            found = (score, start, idx, m, u, None)
    return found


def _tree_draft(node: _Node, idx: int, base: int, limit: int, min_prob: float):
    """Best-first token tree: the ``limit`` most probable continuations (each prob >= min_prob).

    Returns (sum of counts, tokens, parents, probs). One token per pop, the rest of its node
    re-queued behind equally likely ones: ties spread across branches (breadth), as in
    arctic-inference, which accepts slightly more than finishing one run first.
    """
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    total = 0
    tie = 0
    heap: list = [(-base, 0, node, idx, -1)]
    pop, push = heapq.heappop, heapq.heappush
    while heap and len(tokens) < limit:
        negc, _, nd, i, par = pop(heap)
        if i < nd.length:
            c = -negc
            parents.append(par)
            tokens.append(nd.ref[nd.ref_idx + i])
            probs.append(c / base)
            total += c
            par = len(tokens) - 1
            if i + 1 < nd.length:
                tie += 1
                push(heap, (negc, tie, nd, i + 1, par))
                continue
        if nd.children is None:
            continue
        for ch in nd.children.values():
            if ch.count / base >= min_prob:
                tie += 1
                push(heap, (-ch.count, tie, ch, 0, par))
    return total, tokens, parents, probs


def materialize(hit: _Hit | None, p: SpecParams, source: str) -> Draft:
    if hit is None:
        return Draft(source=source)
    score, node, idx, m, u, tdraft = hit
    if tdraft is not None:
        _, tokens, parents, probs = tdraft
        return Draft(tokens, parents, probs, score, m, source)
    base = node.count
    tokens: list[int] = []
    probs: list[float] = []
    min_prob = p.min_prob
    rem = node.length - idx
    if rem > 0:
        take = rem if rem < u else u
        r = node.ref_idx + idx
        tokens.extend(node.ref[r : r + take])
        probs.extend([1.0] * take)
    while len(tokens) < u:
        b = node.best if node.children is not None else None
        if b is None:
            break
        pr = b.count / base
        if pr < min_prob:
            break
        take = min(b.length, u - len(tokens))
        tokens.extend(b.ref[b.ref_idx : b.ref_idx + take])
        probs.extend([pr] * take)
        node = b
    return Draft(tokens, list(range(-1, len(tokens) - 1)), probs, score, m, source)
