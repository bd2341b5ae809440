"""Kernel == torch reference checks, shared by the CPU tests (under ``TRITON_INTERPRET=1``) and
``hvd_ray/kernels/check_gpu.py`` (on CUDA).

Every check builds random inputs (seeded) that include the edge cases the engine meets — empty drafts,
every token accepted, none accepted, tied and NaN/-inf logits, padded batches of unequal drafts,
trees with several branches and duplicate siblings, residuals emptied by rounding — runs the Triton
kernel and the torch reference on them, and raises ``AssertionError`` on any difference.
``run_checks`` returns ``{name: None | error message}``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._triton import block_size
from .greedy_accept import verify_greedy_torch, verify_greedy_triton
from .kv_compact import compact_kv_torch, compact_kv_triton
from .rejection import verify_rejection_torch, verify_rejection_triton
from .tree_accept import verify_tree_torch, verify_tree_triton


@dataclass
class Setup:
    device: str = "cpu"
    vocab: int = 1000  # not a power of two: the last tile is partial
    block_v: int | None = 128  # small tiles so a row spans several (None: the launchers' choice)
    batch: int = 6
    seed: int = 0
    samples: int = 200_000  # sequences in the chi-square check (the interpreter runs ~1 ms each)


def _eq(name: str, got, want) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        if not torch.equal(g.cpu(), w.cpu()):
            raise AssertionError(f"{name}: output {i} differs\n kernel    {g.tolist()}\n reference {w.tolist()}")


def _gen(s: Setup) -> torch.Generator:
    return torch.Generator().manual_seed(s.seed)


def _chain_batch(s: Setup, K: int, g: torch.Generator, dtype=torch.float32):
    """Logits ``[B, K+1, V]`` and drafts that follow the argmax for a random number of tokens."""
    B, V = s.batch, s.vocab
    logits = torch.randn(B, K + 1, V, generator=g).to(dtype)
    best = logits.argmax(-1)
    lens = torch.randint(0, K + 1, (B,), generator=g)
    lens[0], lens[-1] = K, 0  # a full-length draft and an empty one
    drafts = torch.randint(0, V, (B, K), generator=g)
    agree = torch.randint(0, K + 2, (B,), generator=g)  # follow the argmax this far
    agree[0] = K  # row 0: every token accepted
    for b in range(B):
        a = min(int(agree[b]), K)
        drafts[b, :a] = best[b, :a]
        if a < K and drafts[b, a] == best[b, a]:
            drafts[b, a] = (best[b, a] + 1) % V
    if B > 1 and K:
        drafts[1, 0] = (best[1, 0] + 1) % V  # row 1: nothing accepted
        lens[1] = K
    return logits, drafts, lens


def check_greedy(s: Setup) -> None:
    g = _gen(s)
    for K in (0, 1, 5):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            logits, drafts, lens = _chain_batch(s, K, g, dtype)
            logits, drafts, lens = logits.to(s.device), drafts.to(s.device), lens.to(s.device)
            got = verify_greedy_triton(logits, drafts, lens, block_v=s.block_v)
            want = verify_greedy_torch(logits, drafts, lens)
            _eq(f"greedy K={K} {dtype}", got, want)
            acc, bonus = (t.tolist() for t in want)
            assert acc[0] == K and bonus[0] == int(logits[0, K].argmax()), "row 0: every token accepted"
            assert acc[-1] == 0 and bonus[-1] == int(logits[-1, 0].argmax()), "last row: an empty draft"
            if K and s.batch > 1:
                assert acc[1] == 0, "row 1: nothing accepted"
    # non-contiguous logits (a slice of a wider verify output)
    logits, drafts, lens = _chain_batch(s, 4, g)
    wide = torch.randn(s.batch, 7, s.vocab, generator=g)
    wide[:, 1:6] = logits
    view, drafts, lens = wide[:, 1:6].to(s.device), drafts.to(s.device), lens.to(s.device)
    _eq(
        "greedy strided",
        verify_greedy_triton(view, drafts, lens, block_v=s.block_v),
        verify_greedy_torch(view, drafts, lens),
    )


def check_greedy_ties(s: Setup) -> None:
    """Ties resolve to the first maximum like ``torch.argmax``, within a tile and across tiles."""
    g = _gen(s)
    B, K, V = s.batch, 3, s.vocab
    bv = s.block_v or block_size(V, 2048)  # the kernel's tile width
    # few distinct values: every row has many tied maxima
    logits = torch.randint(0, 4, (B, K + 1, V), generator=g).float()
    logits[0, 0, :] = 0.0
    logits[0, 0, [i for i in (bv + 3, 3, 2 * bv + 3) if i < V]] = 5.0  # one lane, different tiles
    logits[0, 1, :] = float("-inf")  # all -inf: torch answers 0
    logits[0, 2, [V - 1, 7]] = float("nan")  # NaN counts as the maximum
    logits[0, 3, [5, V - 2]] = float("inf")
    best = logits.argmax(-1)
    drafts = best[:, :K].clone()
    drafts[2, 1] = (best[2, 1] + 1) % V
    lens = torch.full((B,), K)
    args = (logits.to(s.device), drafts.to(s.device), lens.to(s.device))
    got = verify_greedy_triton(*args, block_v=s.block_v)
    want = verify_greedy_torch(*args)
    _eq("greedy ties", got, want)
    # the walk itself, on the tied row: bonus is the first NaN index after three accepted rows
    one = verify_greedy_triton(logits[:1].to(s.device), best[:1, :K].to(s.device), [K], block_v=s.block_v)
    assert int(one[0][0]) == K and int(one[1][0]) == int(best[0, K]) == 5, one


def _random_tree(n: int, g: torch.Generator) -> list[int]:
    return [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]


def check_tree(s: Setup) -> None:
    g = _gen(s)
    B, V = s.batch, s.vocab
    for N in (0, 1, 6, 13):
        logits = torch.randn(B, N + 1, V, generator=g)
        best = logits.argmax(-1)
        parents = torch.full((B, N), -1, dtype=torch.long)
        drafts = torch.randint(0, V, (B, N), generator=g)
        n_nodes = torch.randint(0, N + 1, (B,), generator=g)
        n_nodes[0] = N
        for b in range(B):
            n = int(n_nodes[b])
            par = _random_tree(n, g) if b % 3 else list(range(-1, n - 1))  # every third one a chain
            if b == 1 and n >= 4:
                par[:4] = [-1, -1, -1, 1]  # several root branches
            parents[b, :n] = torch.tensor(par, dtype=torch.long)
            for i, p in enumerate(par):  # ~60% follow the argmax
                if torch.rand(1, generator=g) < 0.6:
                    drafts[b, i] = best[b, p + 1]
            if b == 2 and n >= 3:  # duplicate siblings
                parents[b, :3] = torch.tensor([-1, -1, -1])
                drafts[b, :3] = best[b, 0]
        args = (logits.to(s.device), drafts.to(s.device), parents.to(s.device), n_nodes.to(s.device))
        _eq(f"tree N={N}", verify_tree_triton(*args, block_v=s.block_v), verify_tree_torch(*args))
    # a hand-made tree: the second branch matches, then a deep path down to a leaf
    V = s.vocab
    logits = torch.zeros(1, 6, V)
    #          node: 1   2   3   4   5     (draft index + 1); parents of draft 0..4
    parents = torch.tensor([[-1, -1, 1, 1, 1]])  # drafts 2-4: children of draft 1
    drafts = torch.tensor([[10, 11, 12, 13, 14]])
    logits[0, 0, 11] = 1.0  # root -> draft 1 (node 2)
    logits[0, 2, 14] = 1.0  # node 2 -> draft 4 (node 5); draft 3 (13) is not the argmax
    logits[0, 5, 42] = 1.0  # leaf: bonus 42
    args = (logits.to(s.device), drafts.to(s.device), parents.to(s.device), torch.tensor([5]).to(s.device))
    got = verify_tree_triton(*args, block_v=s.block_v)
    _eq("tree hand-made", got, verify_tree_torch(*args))
    assert got[0][0, :2].tolist() == [1, 4] and int(got[1][0]) == 2 and int(got[2][0]) == 42, got


def _probs(shape, g: torch.Generator, sharp: float = 3.0) -> torch.Tensor:
    p = (torch.randn(*shape, generator=g) * sharp).softmax(-1)
    return p


def check_rejection(s: Setup) -> None:
    g = _gen(s)
    B, V = s.batch, s.vocab
    for K in (0, 1, 4):
        for with_q in (False, True):
            p = _probs((B, K + 1, V), g)
            q = _probs((B, K, V), g) if with_q else None
            best = p.argmax(-1)
            drafts = torch.randint(0, V, (B, K), generator=g)
            follow = torch.rand(B, K, generator=g) < 0.7
            drafts = torch.where(follow, best[:, :K], drafts)
            lens = torch.randint(0, K + 1, (B,), generator=g)
            lens[0] = K
            accept_u = torch.rand(B, K, generator=g)
            accept_u[0] = 0.0  # row 0: accepted whenever p(x) > 0
            if B > 1 and K:
                accept_u[1] = 1.0 - 2**-24  # row 1: rejected unless p(x) >= q(x) ~ 1
                lens[1] = K
            sample_u = torch.rand(B, generator=g)
            sample_u[-1] = 0.0  # the first token with mass
            if B > 2:
                sample_u[2] = 1.0 - 2**-24  # the last token with mass
            if with_q and K and B > 3:
                q[3, 0] = p[3, 0]  # q >= p everywhere: the residual is empty, draw from p
                q[3, 0, drafts[3, 0]] += 0.5
                accept_u[3, 0] = 1.0 - 2**-24
                lens[3] = K
            if K and B > 4:
                p[4, 0, drafts[4, 0]] = 0.0  # a draft token the target rules out: rejected
                lens[4] = K
            dev = s.device
            args = (
                p.to(dev),
                drafts.to(dev),
                lens.to(dev),
                accept_u.to(dev),
                sample_u.to(dev),
                None if q is None else q.to(dev),
            )
            got = verify_rejection_triton(*args, block_v=s.block_v)
            want = verify_rejection_torch(*args)
            _eq(f"rejection K={K} q={with_q}", got, want)
            acc, tok = want
            pw = p.to(dev)
            for b in range(B):  # the emitted token always has mass where it is drawn
                assert float(pw[b, int(acc[b]), int(tok[b])]) > 0, (b, int(acc[b]), int(tok[b]))
                if K and b == 4 and B > 4:
                    assert int(acc[b]) == 0 and int(tok[b]) != int(drafts[4, 0])
            if K and B > 3 and with_q:
                assert int(acc[3]) == 0
    # bf16 probabilities (the kernel reads any float dtype; the reference upcasts the same way)
    p = _probs((B, 3, V), g).bfloat16()
    drafts = p[:, :2].float().argmax(-1)
    lens = torch.full((B,), 2)
    au, su = torch.rand(B, 2, generator=g), torch.rand(B, generator=g)
    args = tuple(t.to(s.device) for t in (p, drafts, lens, au, su))
    _eq("rejection bf16", verify_rejection_triton(*args, block_v=s.block_v), verify_rejection_torch(*args))


def first_token_counts(
    fn: Callable,
    n: int,
    p0: torch.Tensor,
    q0: torch.Tensor | None,
    drafts: torch.Tensor,
    g: torch.Generator,
    device: str,
    **kw,
) -> torch.Tensor:
    """Counts of the first emitted token over ``n`` independent sequences (draft token or replacement)."""
    V = p0.shape[-1]
    K = drafts.shape[1]
    p = p0.expand(n, K + 1, V).contiguous().to(device)
    q = None if q0 is None else q0.expand(n, K, V).contiguous().to(device)
    accept_u = torch.rand(n, K, generator=g).to(device)
    sample_u = torch.rand(n, generator=g).to(device)
    d = drafts.to(device)
    acc, tok = fn(p, d, torch.full((n,), K, device=device), accept_u, sample_u, q, **kw)
    first = torch.where(acc > 0, d[:, 0], tok)
    return torch.bincount(first.cpu(), minlength=V)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    expected = probs.double() / probs.double().sum() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return float(chisquare(counts[keep].double().numpy(), expected[keep].numpy()).pvalue)


def rejection_distribution(fn: Callable, s: Setup, n: int, **kw) -> None:
    """The first emitted token of ``fn`` (kernel or reference) is distributed as the target's ``p_0``
    (chi-square on an 8-token vocabulary; with and without draft distributions)."""
    g = _gen(s)
    V = 8
    p0 = torch.tensor([0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.12, 0.08])
    rest = torch.full((V,), 1.0 / V)
    p = torch.stack([p0, rest, rest])[None]  # [1, 3, V]
    q = torch.stack([torch.tensor([0.05, 0.40, 0.05, 0.10, 0.10, 0.10, 0.10, 0.10]), rest])[None]
    sampled = torch.multinomial(q[0], n, replacement=True, generator=g).T  # x_i ~ q_i, as the theorem needs
    fixed = torch.tensor([[1, 2]]).expand(n, 2)  # deterministic: a token p finds unlikely
    for qq, drafts in ((q, sampled), (None, fixed)):
        counts = first_token_counts(fn, n, p, qq, drafts, g, s.device, **kw)
        pv = chi_square_pvalue(counts, p0)
        assert pv > 1e-3, f"first-token distribution differs from the target (q={qq is not None}): p={pv:.2g} {counts}"


def check_rejection_distribution(s: Setup) -> None:
    rejection_distribution(verify_rejection_triton, s, s.samples)


def _cache(s: Setup, g: torch.Generator, dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (4, 3, 40, 24)  # slots, kv heads, max_len, head_dim (not 2^k)
    k = [torch.randn(shape, generator=g).to(dtype).to(s.device) for _ in range(2)]
    v = [torch.randn(shape, generator=g).to(dtype).to(s.device) for _ in range(2)]
    return k, v


def check_kv_compact(s: Setup) -> None:
    g = _gen(s)
    cases = [
        ([2], [5], [[0, 2, 3, 7]]),  # one slot
        ([0, 3, 1], [0, 9, 30], [[0, 1, 4, 5, 6], [0, 3], [0, 1, 2]]),  # several, one a no-op
        ([1, 2], [3, 0], [[0, 9], [0, 1, 2, 3, 5, 8, 13, 21, 34]]),  # a long jump; a deep path
        ([0], [10], [[0]]),  # nothing accepted
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for slots, starts, keeps in cases:
            k, v = _cache(s, g, dtype)
            k2, v2 = [t.clone() for t in k], [t.clone() for t in v]
            compact_kv_triton(k, v, slots, starts, keeps)
            compact_kv_torch(k2, v2, slots, starts, keeps)
            for a, b in zip(k + v, k2 + v2):
                if not torch.equal(a.cpu(), b.cpu()):
                    raise AssertionError(f"kv compact {dtype} {slots} {starts} {keeps}: caches differ")


CHECKS: dict[str, Callable[[Setup], None]] = {
    "greedy": check_greedy,
    "greedy_ties": check_greedy_ties,
    "tree": check_tree,
    "rejection": check_rejection,
    "rejection_distribution": check_rejection_distribution,
    "kv_compact": check_kv_compact,
}


def run_checks(setup: Setup, names: list[str] | None = None) -> dict[str, str | None]:
    """Run the named checks (all by default); ``{name: None}`` on success, else the error text."""
    out: dict[str, str | None] = {}
    for name in names or list(CHECKS):
        try:
            CHECKS[name](setup)
            out[name] = None
        except Exception:  # report every check, not just the first failure
            out[name] = traceback.format_exc(limit=3)
    return out


def compile_for_cuda(capability: int = 90, dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")) -> list[str]:
    """Compile every kernel to PTX/cubin for an sm_``capability`` GPU without one (Triton's bundled
    ptxas): catches what the interpreter cannot, GPU code generation errors. Returns what compiled."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .greedy_accept import _greedy_accept_kernel
    from .kv_compact import _kv_compact_kernel
    from .rejection import _rejection_kernel
    from .tree_accept import _tree_accept_kernel

    i64, i32 = "*i64", "i32"
    cases = []
    for dt in dtypes:
        cases.append(
            (
                _greedy_accept_kernel,
                dict(
                    logits_ptr=f"*{dt}",
                    s_lb=i32,
                    s_lk=i32,
                    drafts_ptr=i64,
                    s_db=i32,
                    lens_ptr=i64,
                    acc_ptr=i64,
                    bonus_ptr=i64,
                    V=i32,
                ),
                dict(BLOCK_V=2048),
            )
        )
        cases.append(
            (
                _tree_accept_kernel,
                dict(
                    logits_ptr=f"*{dt}",
                    s_lb=i32,
                    s_ln=i32,
                    drafts_ptr=i64,
                    s_db=i32,
                    parents_ptr=i64,
                    s_pb=i32,
                    nodes_ptr=i64,
                    path_ptr=i64,
                    s_tb=i32,
                    plen_ptr=i64,
                    bonus_ptr=i64,
                    V=i32,
                ),
                dict(BLOCK_V=2048, BLOCK_N=64),
            )
        )
        cases.append(
            (
                _kv_compact_kernel,
                dict(
                    k_ptr=f"*{dt}",
                    v_ptr=f"*{dt}",
                    s_slot=i32,
                    s_head=i32,
                    s_pos=i32,
                    slots_ptr=i64,
                    starts_ptr=i64,
                    keep_ptr=i64,
                    s_keep=i32,
                    nkeep_ptr=i64,
                    D=i32,
                ),
                dict(BLOCK_D=64),
            )
        )
        for has_q in (False, True):
            cases.append(
                (
                    _rejection_kernel,
                    dict(
                        p_ptr=f"*{dt}",
                        s_pb=i32,
                        s_pk=i32,
                        q_ptr=f"*{dt}",
                        s_qb=i32,
                        s_qk=i32,
                        drafts_ptr=i64,
                        s_db=i32,
                        lens_ptr=i64,
                        au_ptr="*fp32",
                        s_ab=i32,
                        su_ptr="*fp32",
                        acc_ptr=i64,
                        tok_ptr=i64,
                        V=i32,
                    ),
                    dict(HAS_Q=has_q, BLOCK_V=1024),
                )
            )
    done = []
    for fn, sig, consts in cases:
        names = fn.arg_names
        signature = {**sig, **{k: "constexpr" for k in consts}}
        signature = {k: signature[k] for k in names}
        src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()})
        triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
        done.append(f"{fn.__name__}[{sig[names[0]]}{', ' + str(consts) if consts else ''}]")
    return done
