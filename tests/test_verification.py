"""Verification primitives: tree layout, greedy accept, distribution-preserving sampling.

The sampling tests are statistical but deterministic (fixed seeds): the distribution of the first
and of the first two emitted tokens must match the target (chi-square, p > 0.001), and negative
controls show the same check rejects samplers that are subtly wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from hvd_ray.drafters.base import Draft
from hvd_ray.verification import (
    check_parents,
    greedy_accept_chain,
    greedy_accept_chain_batch,
    greedy_accept_tree,
    path_to,
    rejection_sample_chain,
    rejection_sample_tree,
    sample,
    target_probs,
    tree_attention_mask,
    tree_children,
    tree_depths,
)

torch.set_num_threads(1)

# A hand-made tree:      root(0)
#                      /    |    \
#                   d0(1)  d1(2)  d4(5)
#                   |      /  \
#                 d2(3)  d3(4) d5(6)
#                          |
#                        d6(7)
TREE = [-1, -1, 0, 1, -1, 1, 3]


# ---------------------------------------------------------------- tree layout


def test_tree_depths_and_paths():
    assert tree_depths(TREE) == [0, 1, 1, 2, 2, 1, 2, 3]
    assert path_to(TREE, 0) == [0]
    assert path_to(TREE, 3) == [0, 1, 3]
    assert path_to(TREE, 7) == [0, 2, 4, 7]
    assert tree_children(TREE) == [[0, 1, 4], [2], [3, 5], [], [6], [], [], []]
    assert tree_depths([]) == [0]


def test_tree_attention_mask_is_ancestor_relation():
    mask = tree_attention_mask(TREE)
    assert mask.dtype == torch.bool and mask.shape == (8, 8)
    for j in range(8):
        assert mask[j].nonzero().flatten().tolist() == sorted(path_to(TREE, j))
    assert mask[:, 0].all()  # everyone sees the root
    assert mask.diagonal().all()  # and itself
    assert mask.sum().item() == sum(d + 1 for d in tree_depths(TREE))


@pytest.mark.parametrize("n", [0, 1, 5])
def test_chain_mask_is_lower_triangular(n):
    parents = Draft.chain(range(n)).parents
    assert torch.equal(tree_attention_mask(parents), torch.ones(n + 1, n + 1).tril().bool())
    assert tree_depths(parents) == list(range(n + 1))


@pytest.mark.parametrize("bad", [[0], [-2], [-1, 1], [-1, 0, 3]])
def test_parents_must_point_backwards(bad):
    with pytest.raises(ValueError):
        check_parents(bad)
    with pytest.raises(ValueError):
        tree_attention_mask(bad)


# ---------------------------------------------------------------- greedy


def logits_with_argmax(best: list[int], vocab: int = 10) -> torch.Tensor:
    out = torch.randn(len(best), vocab, generator=torch.Generator().manual_seed(len(best)))
    out[torch.arange(len(best)), torch.tensor(best)] = 100.0
    return out


def test_greedy_chain_cases():
    logits = logits_with_argmax([3, 1, 4, 1, 5])
    assert greedy_accept_chain(logits, [3, 1, 4, 1]) == (4, 5)  # all accepted, bonus
    assert greedy_accept_chain(logits, [2, 1, 4, 1]) == (0, 3)  # none: correction token
    assert greedy_accept_chain(logits, [3, 1, 9, 1]) == (2, 4)  # partial
    assert greedy_accept_chain(logits[:1], []) == (0, 3)  # empty draft
    assert greedy_accept_chain(logits, torch.tensor([3, 1, 4, 1])) == (4, 5)
    with pytest.raises(ValueError):
        greedy_accept_chain(logits, [3])


def test_greedy_ties_take_first_max_like_argmax():
    logits = torch.zeros(2, 4)
    logits[0, [1, 3]] = 1.0
    assert greedy_accept_chain(logits, [3]) == (0, 1)
    assert greedy_accept_chain(logits, [1]) == (1, 0)


def test_greedy_chain_batch_matches_rows():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        B, K, V = 1 + trial % 5, trial % 6, 4
        # small integer logits: many ties, which must resolve like torch.argmax
        logits = torch.randint(0, 3, (B, K + 1, V), generator=g).float()
        best = logits.argmax(-1)
        drafts = torch.randint(0, V, (B, K), generator=g)
        keep = torch.rand(B, K, generator=g) < 0.7
        drafts = torch.where(keep, best[:, :K], drafts)  # long accepted runs
        lens = torch.randint(0, K + 1, (B,), generator=g)
        acc, bonus = greedy_accept_chain_batch(logits, drafts, lens)
        assert acc.dtype == torch.long and acc.shape == bonus.shape == (B,)
        for b in range(B):
            n = int(lens[b])
            want = greedy_accept_chain(logits[b, : n + 1], drafts[b, :n])
            assert (int(acc[b]), int(bonus[b])) == want
    acc, bonus = greedy_accept_chain_batch(
        logits_with_argmax([7, 2])[:, None].transpose(0, 1), torch.tensor([[7]]), [1]
    )
    assert acc.tolist() == [1] and bonus.tolist() == [2]


def test_greedy_tree_follows_the_right_branch():
    # argmax per node: root->12, d0->x, d1->13, d2->x, d3->14, d4->x, d5->x, d6->15
    tokens = [11, 12, 20, 13, 10, 21, 14]
    best = [12, 0, 13, 0, 14, 0, 0, 15]
    path, bonus = greedy_accept_tree(logits_with_argmax(best, 30), tokens, TREE)
    assert path == [1, 3, 6] and bonus == 15
    # root argmax matches no child: nothing accepted
    path, bonus = greedy_accept_tree(logits_with_argmax([9] + best[1:], 30), tokens, TREE)
    assert path == [] and bonus == 9


def test_greedy_tree_on_a_chain_equals_greedy_chain():
    g = torch.Generator().manual_seed(1)
    for n in range(6):
        logits = torch.randint(0, 3, (n + 1, 4), generator=g).float()
        draft = torch.where(
            torch.rand(n, generator=g) < 0.8, logits[:n].argmax(-1), torch.randint(0, 4, (n,), generator=g)
        ).tolist()
        path, bonus = greedy_accept_tree(logits, draft, Draft.chain(draft).parents)
        k, want_bonus = greedy_accept_chain(logits, draft)
        assert path == list(range(k)) and bonus == want_bonus


# ---------------------------------------------------------------- target_probs


def test_target_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    torch.testing.assert_close(target_probs(logits, 1.0), logits.softmax(-1))
    torch.testing.assert_close(target_probs(logits, 0.5), (logits / 0.5).softmax(-1))
    assert target_probs(logits, 0.0).tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    top2 = target_probs(logits, 1.0, top_k=2)
    torch.testing.assert_close(top2[0, :2], logits[0, :2].softmax(-1))
    assert (top2[0, 2:] == 0).all()
    # nucleus: smallest set with mass >= top_p (top token always kept)
    p = logits.softmax(-1)[0]
    nucleus = target_probs(logits, 1.0, top_p=float(p[0] + p[1]) - 1e-4)
    assert (nucleus[0] > 0).tolist() == [True, True, False, False, False]
    assert (target_probs(logits, 1.0, top_p=1e-6)[0] > 0).sum() == 1
    # top-k first, then top-p on the renormalised survivors
    both = target_probs(logits, 1.0, top_k=3, top_p=0.999)
    assert (both[0] > 0).sum() == 3
    batched = target_probs(torch.randn(2, 3, 7), 0.8, top_k=4, top_p=0.9)
    torch.testing.assert_close(batched.sum(-1), torch.ones(2, 3))


# ---------------------------------------------------------------- speculative sampling: exact cases


def test_rejection_sampling_reduces_to_greedy_at_temperature_zero():
    g = torch.Generator().manual_seed(2)
    for n in range(8):
        logits = torch.randn(n + 1, 6, generator=g)
        probs = target_probs(logits, 0.0)
        draft = torch.where(
            torch.rand(n, generator=g) < 0.8, logits[:n].argmax(-1), torch.randint(0, 6, (n,), generator=g)
        ).tolist()
        assert rejection_sample_chain(probs, draft, None, g) == greedy_accept_chain(logits, draft)
        path, tok = rejection_sample_tree(probs, draft, Draft.chain(draft).parents, g)
        k, bonus = greedy_accept_chain(logits, draft)
        assert (path, tok) == (list(range(k)), bonus)
    tokens, best = [11, 12, 20, 13, 10, 21, 14], [12, 0, 13, 0, 14, 0, 0, 15]
    logits = logits_with_argmax(best, 30)
    assert rejection_sample_tree(target_probs(logits, 0.0), tokens, TREE, g) == greedy_accept_tree(logits, tokens, TREE)


def test_draft_equal_to_target_is_always_accepted():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(5, 6, generator=g), -1)
    for _ in range(50):
        draft = sample(p[:4], g).tolist()
        k, _ = rejection_sample_chain(p, draft, p[:4], g)
        assert k == 4


def test_sampling_is_deterministic_given_the_seed():
    p = torch.softmax(torch.randn(8, 6, generator=torch.Generator().manual_seed(4)), -1)
    q = torch.softmax(torch.randn(7, 6, generator=torch.Generator().manual_seed(5)), -1)
    tree_tokens, chain_tokens = [0, 1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 5, 0, 1]

    def run(seed: int) -> list:
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(40):
            out.append(rejection_sample_chain(p, chain_tokens, q, g))
            out.append(rejection_sample_chain(p, chain_tokens, None, g))
            out.append(rejection_sample_tree(p, tree_tokens, TREE, g))
            out.append(sample(p, g).tolist())
        return out

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_empty_drafts_just_sample():
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert rejection_sample_chain(p, [], None, g) == (0, 2)
    assert rejection_sample_chain(p, [], torch.empty(0, 4), g) == (0, 2)
    assert rejection_sample_tree(p, [], [], g) == ([], 2)


# ---------------------------------------------------------------- speculative sampling: statistics
#
# A toy "language": the target's next-token distribution is a fixed random function of the prefix,
# and so is the draft model's (a different one). Target rows for each draft node are built from the
# node's own prefix, exactly as a real verify forward would produce them. The first two emitted
# tokens of a generation must then be distributed as P(a) * P(b | a).

V = 6
DRAWS = 20_000
Step = Callable[[tuple, np.random.Generator, torch.Generator], list]


@functools.cache
def dist(kind: int, prefix: tuple) -> np.ndarray:
    """kind 0: the target's next-token distribution after ``prefix``; kind 1: the draft model's."""
    z = np.random.default_rng([kind, len(prefix), *prefix]).normal(size=V) * 1.3
    e = np.exp(z - z.max())
    return e / e.sum()


def rows(prefix: tuple, draft: list, parents: list) -> torch.Tensor:
    """Target rows for every node of a draft hanging off ``prefix``."""
    node_prefix = [prefix]
    for tok, par in zip(draft, parents):
        node_prefix.append(node_prefix[par + 1] + (tok,))
    return torch.from_numpy(np.stack([dist(0, pre) for pre in node_prefix])).float()


def chain_sampled_step(prefix, rng, g):
    """A chain of random length 0-3 sampled from the draft model."""
    draft, qs, pre = [], [], prefix
    for _ in range(rng.integers(4)):
        q = dist(1, pre)
        draft.append(int(rng.choice(V, p=q)))
        qs.append(q)
        pre = pre + (draft[-1],)
    qs = torch.from_numpy(np.stack(qs)).float() if qs else torch.empty(0, V)
    k, tok = rejection_sample_chain(rows(prefix, draft, list(range(-1, len(draft) - 1))), draft, qs, g)
    return draft[:k] + [tok]


def chain_greedy_step(prefix, rng, g):
    """The draft model's greedy chain, of random length 0-3."""
    draft, pre = [], prefix
    for _ in range(rng.integers(4)):
        draft.append(int(dist(1, pre).argmax()))
        pre = pre + (draft[-1],)
    k, tok = rejection_sample_chain(rows(prefix, draft, list(range(-1, len(draft) - 1))), draft, None, g)
    return draft[:k] + [tok]


def top_children(prefix: tuple, k: int) -> list[int]:
    return [int(t) for t in np.argsort(-dist(1, prefix), kind="stable")[:k]]


def tree_step(prefix, rng, g, duplicate: bool = False):
    """Top-3 children at the root, top-2 below some of them; optionally a duplicate root child.

    Which root children get children is random, so the token after an accepted leaf (the bonus)
    lands at both the second and the third emitted position.
    """
    draft, parents = [], []
    roots = top_children(prefix, 3)
    if duplicate:
        roots = [roots[0], roots[1], roots[0], roots[2]]
    for r in roots:
        draft.append(r)
        parents.append(-1)
        me = len(draft) - 1
        for c in top_children(prefix + (r,), 2) if rng.random() < 0.5 else []:
            draft.append(c)
            parents.append(me)
    path, tok = rejection_sample_tree(rows(prefix, draft, parents), draft, parents, g)
    return [draft[i] for i in path] + [tok]


def first_two(step: Step, seed: int, draws: int = DRAWS) -> np.ndarray:
    """Counts of the first two generated tokens, running a second step when the first emits one."""
    rng, g = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    counts = np.zeros((V, V))
    for _ in range(draws):
        out = step((), rng, g)
        if len(out) < 2:
            out += step((out[0],), rng, g)
        counts[out[0], out[1]] += 1
    return counts


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit, pooling cells whose expected count is below 5."""
    counts, expected = counts.ravel(), probs.ravel() * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


TARGET_FIRST = dist(0, ())
TARGET_PAIR = np.stack([TARGET_FIRST[a] * dist(0, (a,)) for a in range(V)])


def assert_matches_target(counts: np.ndarray) -> None:
    p_first = chi2_pvalue(counts.sum(1), TARGET_FIRST)
    p_pair = chi2_pvalue(counts, TARGET_PAIR)
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)


def test_toy_language_is_a_real_test():
    # draft and target disagree enough for a wrong sampler to show
    assert np.abs(dist(0, ()) - dist(1, ())).sum() > 0.5
    assert np.abs(TARGET_PAIR.sum() - 1.0) < 1e-9


@pytest.mark.parametrize(
    "step",
    [chain_sampled_step, chain_greedy_step, tree_step, functools.partial(tree_step, duplicate=True)],
    ids=["chain-sampled", "chain-deterministic", "tree", "tree-duplicates"],
)
def test_speculative_sampling_preserves_the_target(step):
    assert_matches_target(first_two(step, seed=11))


# Negative controls: the same check, on samplers with classic bugs, must fail.


def from_draft_model(prefix, rng, g):
    """Emits the draft model's own samples: no verification at all."""
    a = int(rng.choice(V, p=dist(1, prefix)))
    return [a, int(rng.choice(V, p=dist(1, prefix + (a,))))]


def resample_from_p_on_rejection(prefix, rng, g):
    """Correct accept rule, but the replacement comes from p instead of the residual."""
    q = dist(1, prefix)
    x = int(rng.choice(V, p=q))
    p = dist(0, prefix)
    if rng.random() < min(1.0, p[x] / q[x]):
        return [x]
    return [int(rng.choice(V, p=p))]


def tree_without_renormalising(prefix, rng, g):
    """Tries the top-3 children with probability p(c) each, forgetting to renormalise."""
    p = dist(0, prefix)
    for c in top_children(prefix, 3):
        if rng.random() < p[c]:
            return [c]
    residual = p.copy()
    residual[top_children(prefix, 3)] = 0
    return [int(rng.choice(V, p=residual / residual.sum()))]


@pytest.mark.parametrize("step", [from_draft_model, resample_from_p_on_rejection, tree_without_renormalising])
def test_the_check_catches_wrong_samplers(step):
    counts = first_two(step, seed=11)
    with pytest.raises(AssertionError):
        assert_matches_target(counts)


def test_engine_device_walks_equal_greedy_walk():
    """The engine's batched verify (``hvd_ray.kernels.verify_tree`` on CUDA; its torch reference here) returns
    what ``greedy_walk`` returns for every request of a padded batch of chains and trees."""
    from hvd_ray.drafters.base import Draft
    from hvd_ray.engine.verify import device_walks
    from hvd_ray.verification import greedy_walk

    g = torch.Generator().manual_seed(11)
    V, N = 7, 6
    logits = torch.randn(5, N + 1, V, generator=g)
    best = logits.argmax(-1).tolist()
    drafts = [
        Draft.chain([best[0][0], best[0][1], 3]),  # two accepted, then a (likely) miss
        Draft.chain([]),  # nothing to verify: just the bonus token
        Draft([best[2][0], (best[2][0] + 1) % V, best[2][1]], [-1, -1, 0], [1.0] * 3),  # tree
        Draft.chain(best[3][:N]),  # all accepted
        Draft([1, 2, 3, 4], [-1, 0, 0, 1], [1.0] * 4),
    ]
    got = device_walks(logits, drafts)
    want = [greedy_walk(best[b], d.token_ids, d.parents) for b, d in enumerate(drafts)]
    assert got == want
    assert got[3] == (list(range(N)), best[3][N]) and got[1] == ([], best[1][0])
