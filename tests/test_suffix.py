"""Suffix-tree drafter against a brute-force reference that counts pattern occurrences directly."""

from __future__ import annotations

import os
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hvd_ray.drafters.base import Draft, DraftRequest
from hvd_ray.drafters.suffix import SuffixConfig, SuffixDrafter, SuffixTree

# HYP_N=5000 for a deeper run; 300 keeps the file at a few seconds.
FAST = settings(
    max_examples=int(os.environ.get("HYP_N", 300)), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---------------------------------------------------------------- brute force
def occ(seqs: list[list[int]], pat: list[int]) -> int:
    k = len(pat)
    return sum(1 for s in seqs for i in range(len(s) - k + 1) if s[i : i + k] == pat)


def substrings(seqs: list[list[int]], depth: int) -> Counter:
    c: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                c[tuple(s[i:j])] += 1
    return c


def conts(seqs, pat, depth):
    """Next-token counts after ``pat`` within the depth bound."""
    if len(pat) >= depth:
        return {}
    c: Counter = Counter()
    k = len(pat)
    for s in seqs:
        for i in range(len(s) - k):
            if s[i : i + k] == pat:
                c[s[i + k]] += 1
    return c


def ref_chain(seqs, pat, depth, limit, min_prob):
    """Greedy chain after ``pat``: most frequent next token (ties: smaller id)."""
    base = occ(seqs, pat)
    toks, probs, total = [], [], 0
    cur = list(pat)
    while len(toks) < limit:
        nxt = conts(seqs, cur, depth)
        if not nxt:
            break
        x = min(nxt, key=lambda t: (-nxt[t], t))
        if nxt[x] / base < min_prob:
            break
        toks.append(x)
        probs.append(nxt[x] / base)
        total += nxt[x]
        cur.append(x)
    return toks, probs, total


def ref_tree_total(seqs, pat, depth, limit, min_prob):
    """Sum of the ``limit`` largest counts among continuations with prob >= min_prob."""
    base = occ(seqs, pat)
    counts, frontier = [], [list(pat)]
    while frontier:
        cur = frontier.pop()
        for x, c in conts(seqs, cur, depth).items():
            if c / base >= min_prob:
                counts.append(c)
                frontier.append(cur + [x])
    return sum(sorted(counts, reverse=True)[:limit])


def ref_best(seqs, ctx, depth, cap, factor, offset, min_prob, tree, best=Fraction(0)):
    """(score, match_len) of the best draft over match lengths, longer match wins ties."""
    out = None
    for m in range(1, min(len(ctx), depth - 1) + 1):
        pat = ctx[-m:]
        base = occ(seqs, pat)
        if base == 0:
            break
        u = min(cap, int(m * factor + offset + 1e-6))
        if u <= 0:
            continue
        if tree:
            total = ref_tree_total(seqs, pat, depth, u, min_prob)
        else:
            total = ref_chain(seqs, pat, depth, u, min_prob)[2]
        score = Fraction(total, base)
        if score > 0 and score >= best:
            best, out = score, (score, m)
    return out


def check_draft(d: Draft, seqs, ctx, depth, limit, min_prob, tree):
    """The draft's tokens/probs are what the reference derives from its match length."""
    pat = ctx[-d.match_len :]
    base = occ(seqs, pat)
    assert len(d.token_ids) == len(d.parents) == len(d.probs) <= limit
    if not tree:
        toks, probs, total = ref_chain(seqs, pat, depth, limit, min_prob)
        assert d.token_ids == toks
        assert d.probs == probs
        assert d.is_chain
        assert d.score == total / base
        return
    paths: list[tuple[int, ...]] = []
    for i, (t, par) in enumerate(zip(d.token_ids, d.parents)):
        assert -1 <= par < i
        path = (paths[par] if par >= 0 else ()) + (t,)
        paths.append(path)
        c = occ(seqs, pat + list(path))
        assert len(pat) + len(path) <= depth
        assert d.probs[i] == c / base >= min_prob
    assert len(set(paths)) == len(paths)
    assert d.score == ref_tree_total(seqs, pat, depth, limit, min_prob) / base


# ---------------------------------------------------------------- SuffixTree
tokens = st.lists(st.integers(0, 3), max_size=25)


@st.composite
def tree_ops(draw):
    depth = draw(st.integers(1, 7))
    ops = draw(
        st.lists(st.tuples(st.sampled_from(["ext", "ext", "ext", "rm"]), st.integers(0, 3), tokens), max_size=12)
    )
    return depth, ops


def apply_ops(depth, ops):
    t, ref = SuffixTree(depth), {}
    for op, sid, toks in ops:
        if op == "rm":
            if sid in ref:
                t.remove(sid)
                del ref[sid]
        else:
            # interleave appends token by token with other sequences' appends
            t.extend(sid, toks)
            ref.setdefault(sid, []).extend(toks)
    return t, ref


@FAST
@given(tree_ops())
def test_counts_match_brute_force(case):
    depth, ops = case
    t, ref = apply_ops(depth, ops)
    t.check()
    seqs = list(ref.values())
    assert t.patterns() == dict(substrings(seqs, depth))
    assert t.num_tokens == sum(map(len, seqs))
    for s in seqs:
        for i in range(len(s)):
            pat = s[i : i + depth]
            assert t.count(pat) == occ(seqs, pat)
            assert t.continuations(pat[:-1]) == dict(conts(seqs, pat[:-1], depth))


@FAST
@given(tree_ops(), st.lists(st.integers(0, 4), max_size=10))
def test_match_is_longest_occurring_suffix(case, ctx):
    depth, ops = case
    t, ref = apply_ops(depth, ops)
    seqs = list(ref.values())
    want = max((m for m in range(0, min(len(ctx), depth) + 1) if m == 0 or occ(seqs, ctx[-m:])), default=0)
    assert t.match(ctx) == want
    tail = ctx[-depth:]
    assert t.count(tail) == (occ(seqs, tail) if tail else t.num_tokens)


@FAST
@given(
    tree_ops(),
    st.lists(st.integers(0, 3), max_size=10),
    st.integers(1, 8),
    st.sampled_from([0.5, 1.0, 2.0]),
    st.sampled_from([0.0, 1.0]),
    st.sampled_from([0.0, 0.1, 0.3]),
    st.booleans(),
)
def test_speculate_matches_brute_force(case, ctx, cap, factor, offset, min_prob, tree):
    depth, ops = case
    t, ref = apply_ops(depth, ops)
    seqs = list(ref.values())
    d = t.speculate(ctx, cap, factor, offset, min_prob, tree)
    want = ref_best(seqs, ctx, depth, cap, factor, offset, min_prob, tree)
    if want is None:
        assert len(d) == 0 and d.score == 0.0 and d.match_len == 0
        return
    score, m = want
    assert (d.score, d.match_len) == (float(score), m)
    limit = min(cap, int(m * factor + offset + 1e-6))
    check_draft(d, seqs, ctx, depth, limit, min_prob, tree)


# ---------------------------------------------------------------- SuffixDrafter
class RefDrafter:
    """Brute-force model of the drafter: plain lists, FIFO cache of outputs."""

    def __init__(self, cfg: SuffixConfig):
        self.cfg, self.active, self.cached = cfg, {}, {}

    def begin(self, rid, prompt):
        self.active[rid] = (list(prompt), [])
        if self.cfg.global_live:
            self._cache(rid, self.active[rid][1])

    def _cache(self, rid, out):
        if self.cfg.max_cached_requests == 0:
            return
        self.cached.pop(rid, None)
        self.cached[rid] = out
        while 0 < self.cfg.max_cached_requests < len(self.cached):
            del self.cached[next(iter(self.cached))]

    def accept(self, rid, toks):
        self.active[rid][1].extend(toks)

    def end(self, rid):
        _, out = self.active.pop(rid)
        if not self.cfg.global_live:
            self._cache(rid, out)

    def best(self, rid, cap):
        c = self.cfg
        prompt, out = self.active[rid]
        ctx = prompt + out
        args = (c.max_depth, cap, c.max_spec_factor, c.max_spec_offset, c.min_token_prob, c.use_tree_spec)
        r = ref_best([ctx], ctx, *args)
        g = ref_best([list(o) for o in self.cached.values()], ctx, *args)
        if g is not None and (r is None or g[0] > r[0]):
            return g, "suffix-global", [list(o) for o in self.cached.values()]
        return r, "suffix-request", [ctx]


@st.composite
def drafter_runs(draw):
    cfg = SuffixConfig(
        max_depth=draw(st.integers(2, 7)),
        max_spec_tokens=draw(st.integers(1, 8)),
        max_spec_factor=draw(st.sampled_from([0.5, 1.0, 2.0])),
        max_spec_offset=draw(st.sampled_from([0.0, 1.0])),
        min_token_prob=draw(st.sampled_from([0.0, 0.1, 0.4])),
        use_tree_spec=draw(st.booleans()),
        max_cached_requests=draw(st.sampled_from([-1, 0, 1, 2, 3])),
        global_live=draw(st.booleans()),
    )
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["begin", "accept", "accept", "spec", "spec", "end"]),
                st.integers(0, 4),
                tokens,
                st.integers(1, 9),
            ),
            min_size=4,
            max_size=30,
        )
    )
    prompt = draw(tokens)
    if draw(st.booleans()):  # short prompts: the global tree has to do the work
        ops = [(op, rid, toks[:2] if op == "begin" else toks, cap) for op, rid, toks, cap in ops]
        prompt = prompt[:1]
    return cfg, [("begin", 0, prompt, 1), ("begin", 1, prompt[::-1], 1)] + ops


@FAST
@given(drafter_runs())
def test_drafter_matches_brute_force(run):
    cfg, ops = run
    d, ref = SuffixDrafter(cfg), RefDrafter(cfg)
    for op, rid, toks, cap in ops:
        if op != "begin" and ref.active:  # act on an active request
            rid = sorted(ref.active)[rid % len(ref.active)]
        if op == "begin":
            if rid in ref.active:
                with pytest.raises(ValueError):
                    d.begin(rid, toks)
                continue
            d.begin(rid, toks)
            ref.begin(rid, toks)
        elif rid not in ref.active:
            continue
        elif op == "accept":
            d.accept(rid, toks)
            ref.accept(rid, toks)
        elif op == "end":
            d.end(rid)
            ref.end(rid)
        else:
            draft = d.speculate(rid, cap)
            want, source, seqs = ref.best(rid, min(cap, cfg.max_spec_tokens))
            event(f"draft from {source if want else 'nothing'}")
            if want is None:
                assert len(draft) == 0 and draft.score == 0.0 and draft.match_len == 0
                continue
            assert (draft.score, draft.match_len, draft.source) == (float(want[0]), want[1], source)
            ctx = d.context(rid)
            assert ctx == ref.active[rid][0] + ref.active[rid][1]
            limit = min(cap, cfg.max_spec_tokens, int(want[1] * cfg.max_spec_factor + cfg.max_spec_offset + 1e-6))
            check_draft(draft, seqs, ctx, cfg.max_depth, limit, cfg.min_token_prob, cfg.use_tree_spec)
        # eviction / removal: the global tree holds exactly the cached outputs, oldest evicted
        assert d.cached_requests == list(ref.cached)
        d.global_tree.check()
        assert d.global_tree.patterns() == dict(substrings([list(o) for o in ref.cached.values()], cfg.max_depth))


# ---------------------------------------------------------------- unit tests
def test_defaults():
    c = SuffixConfig()
    assert (
        c.max_depth,
        c.max_spec_tokens,
        c.max_spec_factor,
        c.max_spec_offset,
        c.min_token_prob,
        c.use_tree_spec,
    ) == (64, 64, 1.0, 0.0, 0.1, False)
    d = SuffixDrafter()
    assert d.name == "suffix" and d.config == c and SuffixTree().max_depth == 64


def test_empty_context_and_no_match():
    t = SuffixTree()
    assert len(t.speculate([])) == 0 and len(t.speculate([1, 2])) == 0  # empty tree
    t.extend("a", [1, 2, 3, 1, 2, 3])
    empty = t.speculate([])
    assert (empty.token_ids, empty.score, empty.match_len) == ([], 0.0, 0)
    none = t.speculate([7, 8, 9])
    assert (none.token_ids, none.score, none.match_len) == ([], 0.0, 0)
    assert t.match([7, 8, 9]) == 0 and t.count([7]) == 0
    d = SuffixDrafter()
    d.begin("r", [], 0)  # the engine also passes the KV slot
    assert len(d.speculate("r")) == 0 and d.speculate("r").source == "suffix-request"
    d.accept("r", [5])
    assert len(d.speculate("r")) == 0


def test_repeated_text_drafts_its_continuation():
    t = SuffixTree()
    text = list(range(10, 40))
    t.extend(0, text)
    d = t.speculate(text[:20])  # matches 20 tokens, may draft 20 (factor 1)
    assert d.token_ids == text[20:] and d.probs == [1.0] * 10 and d.score == 10.0
    assert d.match_len == 20 and d.is_chain and d.parents == list(range(-1, 9))


def test_max_spec_tokens_and_factor_caps():
    t = SuffixTree()
    text = list(range(100))
    t.extend(0, text)
    d = t.speculate(text[:50], max_spec_tokens=64)  # match m leaves 64 - m tokens of depth:
    assert (len(d), d.match_len) == (32, 32)  # m = 32 balances match and room
    assert t.speculate(text[:50], max_spec_tokens=5).token_ids == text[50:55]
    assert len(t.speculate(text[:3], max_spec_tokens=64)) == 3  # factor 1 * match 3
    assert len(t.speculate(text[:3], 64, 2.0, 1.0)) == 7  # 2 * 3 + 1
    assert len(t.speculate(text[:3], 0)) == 0
    d = SuffixDrafter(SuffixConfig(max_spec_tokens=4))
    d.begin("r", text + text[:30])
    assert d.speculate("r").token_ids == text[30:34]
    assert d.speculate("r", max_tokens=2).token_ids == text[30:32]
    assert len(d.speculate("r", max_tokens=10)) == 4  # the config caps a larger budget
    asks = [DraftRequest("r", 0, d.context("r"), 3), DraftRequest("r", 0, d.context("r"), 0)]
    assert [x.token_ids for x in d.propose(asks)] == [text[30:33], []]  # one speculate per request


def test_min_token_prob_and_probabilities():
    t = SuffixTree()
    # after [1]: 2 follows 3 times, 3 once; after [1, 2]: 4 twice, 5 once
    t.extend(0, [1, 2, 4, 1, 2, 4, 1, 2, 5, 1, 3])
    d = t.speculate([9, 1], 8, 1.0, 8.0, 0.1)
    assert d.match_len == 1 and d.token_ids[:2] == [2, 4]
    assert d.probs[:2] == [3 / 4, 2 / 4]
    assert t.speculate([9, 1], 8, 1.0, 8.0, 0.6).token_ids == [2]  # 2/4 < 0.6 stops
    assert t.continuations([1]) == {2: 3, 3: 1} and t.continuations([1, 2]) == {4: 2, 5: 1}


def test_tree_spec_branches():
    t = SuffixTree()
    t.extend(0, [1, 2, 1, 3, 1, 2, 1, 4])
    d = t.speculate([0, 1], 3, 1.0, 2.0, 0.2, use_tree_spec=True)
    # after [1]: 2 (2/4), 3 (1/4), 4 (1/4); after [1, 2]: 1 (2/4). Best-first: 2, 2->1, then a 1/4
    assert d.token_ids[:2] == [2, 1] and d.parents[:2] == [-1, 0] and d.probs == [0.5, 0.5, 0.25]
    assert d.token_ids[2] in (3, 4) and d.parents[2] == -1
    assert d.score == 1.25 and not d.is_chain


def test_request_tree_and_global_sources():
    d = SuffixDrafter()
    d.begin("a", [1, 2, 3])
    d.accept("a", [10, 11, 12, 13, 14, 15])
    d.end("a")
    d.begin("b", [7, 10, 11, 12])
    g = d.speculate("b")
    assert g.source == "suffix-global" and g.token_ids == [13, 14, 15] and g.match_len == 3
    d.accept("b", [13, 7, 10, 11, 12])  # now "b" itself repeats 7 10 11 12 -> 13
    r = d.speculate("b")
    assert r.source == "suffix-request" and r.token_ids[0] == 13 and r.match_len == 4
    assert d.cached_requests == ["a", "b"]


def test_eviction_is_fifo_and_bounded():
    d = SuffixDrafter(SuffixConfig(max_cached_requests=2))
    for i in range(4):
        d.begin(i, [100 + i])
        d.accept(i, [i, i + 1, i + 2])
        d.end(i)
    assert d.cached_requests == [2, 3]
    assert d.global_tree.count([0, 1]) == 0 and d.global_tree.count([3, 4, 5]) == 1
    assert d.global_tree.num_tokens == 6
    d.begin(2, [])  # reusing an id replaces its cached output
    assert d.cached_requests == [3, 2] and d.global_tree.count([2, 3, 4]) == 0
    off = SuffixDrafter(SuffixConfig(max_cached_requests=0))
    off.begin("x", [1, 2])
    off.accept("x", [1, 2])
    off.end("x")
    assert off.cached_requests == [] and off.global_tree.num_tokens == 0


def test_remove_all_empties_tree():
    t = SuffixTree(8)
    t.extend(0, [1, 2, 3] * 10)
    t.extend(1, [2, 3, 1] * 7)
    t.remove(0)
    t.check()
    t.remove(1)
    assert t.num_tokens == 0 and t.patterns() == {} and len(t) == 0
    t.extend(2, [5, 6])
    assert t.patterns() == {(5,): 1, (6,): 1, (5, 6): 1}


def test_history_from_a_trace_folder_seeds_the_global_tree(tmp_path):
    """``--suffix-history``: a collect_traces folder's train-split outputs (not prompts, not held-out
    outputs) go into the global tree, in arrival order, so a new request drafts from them."""
    import json

    from hvd_ray.traces.history import past_outputs, warm_global_tree
    from hvd_ray.traces.store import TraceWriter

    def row(pid: str, seq: int, split: str, prompt: list[int], output: list[int]) -> dict:
        return {
            "prompt_id": pid,
            "workload": "function_calling",
            "split": split,
            "seq": seq,
            "prompt_tokens": prompt,
            "output_tokens": output,
            "finish_reason": "stop",
            "model_id": "m",
            "model_revision": "rev",
            "backend": "hvd_ray",
            "decoding": json.dumps({"temperature": 0.0}),
            "prefill_s": 0.1,
            "decode_s": 0.2,
            "created_at": None,
            "topk_ids": None,
            "topk_logprobs": None,
        }

    call = [7, 8, 9, 10, 11, 12, 13, 14]
    with TraceWriter(tmp_path / "t") as w:
        w.add(
            [
                row("b", 1, "train", [1, 2], call),
                row("a", 0, "train", [3, 4], [20, 21, 22]),
                row("c", 2, "test", [5, 6], [30, 31, 32, 33]),
                row("d", 3, "train", [40, 41], []),
            ]
        )
    outs = past_outputs(tmp_path / "t")
    assert outs == [("history-0", [20, 21, 22]), ("history-1", call)]  # by seq; no test split, no empty
    d, plain = SuffixDrafter(), SuffixDrafter()
    assert warm_global_tree([d, object()], outs) == 1
    assert d.cached_requests == ["history-0", "history-1"] and d.global_tree.num_tokens == 3 + len(call)
    assert d.global_tree.count([1, 2]) == 0 and d.global_tree.count([30, 31]) == 0  # prompts / held out
    for x in (d, plain):
        x.begin("r", [99, 7, 8, 9])
    got = d.speculate("r", 8)
    assert got.source == "suffix-global" and got.token_ids == call[3 : 3 + len(got)] and len(got) > 0
    assert plain.speculate("r", 8).token_ids == []  # cold: nothing to draft from
    with pytest.raises(FileNotFoundError, match="no trace folder"):
        past_outputs(tmp_path / "missing")
    # the server's shared actor (suffix_history) starts from the same outputs (the class, no Ray)
    from hvd_ray.serving.suffix_actor import SuffixDrafterService

    assert SuffixDrafterService(None, str(tmp_path / "t")).stats()["cached_requests"] == 2


def test_a_per_draft_offset_drafts_as_a_drafter_configured_with_it():
    """HVD's cache drafter reaches past its match (``max_spec_offset``); asked with ``offset=0`` it
    drafts what a plain suffix drafter does (match and length: under load the engine's cache arm
    decodes as suffix decoding), and without it, its own longer drafts."""
    import random

    from hvd_ray.selection.hvd import suffix_config

    rng = random.Random(0)
    hvd, plain = SuffixDrafter(suffix_config("cost")), SuffixDrafter(SuffixConfig())
    history = [rng.randint(0, 20) for _ in range(300)]
    for d in (hvd, plain):
        d.add_to_global("h", history)
    longer = 0
    for i in range(40):
        prompt = [rng.randint(0, 20) for _ in range(30)] + history[i * 5 : i * 5 + 10]
        for d in (hvd, plain):
            d.begin(i, prompt)
        ours, theirs = hvd.speculate(i, 64, offset=0.0), plain.speculate(i, 64)
        assert (ours.token_ids, ours.probs, ours.source) == (theirs.token_ids, theirs.probs, theirs.source)
        assert len(hvd.speculate(i, 5, offset=0.0)) <= 5
        longer += len(hvd.speculate(i, 64)) > len(ours)
    assert longer > 20
