"""Greedy verification of tree drafts: the longest accepted root-to-leaf path per sequence.

Inputs: ``logits [B, N+1, V]`` (row ``j`` = node ``j``; node 0 is the last context token, draft
token ``i`` is node ``i + 1``), ``drafts [B, N]``, ``parents [B, N]`` (``-1`` = child of the root;
parents precede children, as ``hvd_ray.verification.check_parents`` demands) and ``n_nodes [B]``
(true draft sizes; the rest is padding). From the root, the walk moves to the first child in draft
order whose token is the argmax at the current node, and stops when there is none: the argmax
there is the bonus token. Output ``(path [B, N], path_len [B], bonus [B])`` with ``path`` holding
the accepted draft indices root side first, padded with -1. Reference: ``verify_tree_torch``, a
walk of its own (the kernels import nothing else from ``hvd_ray``); the tests hold it to the engine's
``hvd_ray.verification.greedy_walk``.

One program per sequence holds the draft's tokens and parents in registers and takes an argmax only
of the rows on the accepted path (depth + 1 rows instead of N + 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._triton import block_size, jit, nonempty, require_triton, row_argmax, tl, use_triton


def _check(logits, drafts, parents, n_nodes):
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, N+1, V], got shape {tuple(logits.shape)}")
    B, N1, _ = logits.shape
    dev = logits.device
    drafts = torch.as_tensor(drafts, device=dev).reshape(B, N1 - 1)
    parents = torch.as_tensor(parents, device=dev).reshape(B, N1 - 1)
    n_nodes = torch.as_tensor(n_nodes, device=dev).reshape(B)
    return drafts, parents, n_nodes


def verify_tree_torch(
    logits: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor, n_nodes: torch.Tensor | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: one ``torch.argmax`` over the logits, then a walk per sequence in Python."""
    drafts, parents, n_nodes = _check(logits, drafts, parents, n_nodes)
    B, N1, _ = logits.shape
    best, toks, pars, ns = (t.tolist() for t in (logits.argmax(-1), drafts, parents, n_nodes))
    path = torch.full((B, N1 - 1), -1, dtype=torch.long)
    lens, bonus = [], []
    for b in range(B):
        n = ns[b]
        p, nxt = _walk(best[b][: n + 1], toks[b][:n], pars[b][:n])
        path[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        lens.append(len(p))
        bonus.append(nxt)
    dev = logits.device
    return (
        path.to(dev),
        torch.tensor(lens, dtype=torch.long, device=dev),
        torch.tensor(bonus, dtype=torch.long, device=dev),
    )


def _walk(best: list[int], toks: list[int], pars: list[int]) -> tuple[list[int], int]:
    """From the root, move to the first child (in draft order) whose token is ``best`` at the current
    node; ``(path, best at the node where it stops)``. At most ``len(toks)`` moves, like the kernel."""
    path: list[int] = []
    node = 0
    for _ in range(len(toks)):
        child = next((i for i, (t, p) in enumerate(zip(toks, pars)) if p + 1 == node and t == best[node]), None)
        if child is None:
            break
        path.append(child)
        node = child + 1
    return path, best[node]


@jit
def _tree_accept_kernel(
    logits_ptr,
    s_lb,
    s_ln,
    drafts_ptr,
    s_db,
    parents_ptr,
    s_pb,
    nodes_ptr,
    path_ptr,
    s_tb,
    plen_ptr,
    bonus_ptr,
    V,
    BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(nodes_ptr + b).to(tl.int32)
    offs = tl.arange(0, BLOCK_N)
    valid = offs < n
    toks = tl.load(drafts_ptr + b * s_db + offs, mask=valid, other=-1).to(tl.int32)
    pars = tl.load(parents_ptr + b * s_pb + offs, mask=valid, other=-2).to(tl.int32)
    big = 2147483647
    node = 0
    depth = 0
    stop = n + 1  # a path has at most n nodes, so a malformed parent list cannot loop forever
    best = 0
    while depth < stop:
        best = row_argmax(logits_ptr + b * s_lb + node * s_ln, V, BLOCK_V)
        hit = valid & (pars + 1 == node) & (toks == best)
        child = tl.min(tl.where(hit, offs, big), 0)
        if child < big:
            tl.store(path_ptr + b * s_tb + depth, child.to(tl.int64))
            depth += 1
            node = child + 1
        else:
            stop = depth
    tl.store(plen_ptr + b, depth.to(tl.int64))
    tl.store(bonus_ptr + b, best.to(tl.int64))


def verify_tree_triton(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    parents: torch.Tensor,
    n_nodes: torch.Tensor | Sequence[int],
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``); same contract as the reference."""
    require_triton(logits)
    drafts, parents, n_nodes = _check(logits, drafts, parents, n_nodes)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    B, N1, V = logits.shape
    dev = logits.device
    path = torch.full((B, N1 - 1), -1, dtype=torch.long, device=dev)
    plen = torch.empty(B, dtype=torch.long, device=dev)
    bonus = torch.empty(B, dtype=torch.long, device=dev)
    if B == 0:
        return path, plen, bonus
    drafts, parents = nonempty(drafts.contiguous()), nonempty(parents.contiguous())
    _tree_accept_kernel[(B,)](
        logits,
        logits.stride(0),
        logits.stride(1),
        drafts,
        N1 - 1,
        parents,
        N1 - 1,
        n_nodes.contiguous(),
        path,
        path.stride(0),
        plen,
        bonus,
        V,
        BLOCK_V=block_v or block_size(V, 2048),
        BLOCK_N=block_size(N1 - 1, 1 << 16),
        num_warps=8 if V >= 8192 else 4,
    )
    return path, plen, bonus


def verify_tree(
    logits: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor, n_nodes: torch.Tensor | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(path [B, N], path_len [B], bonus [B])`` of greedy tree verification: Triton on CUDA, else torch."""
    if use_triton(logits):
        return verify_tree_triton(logits, drafts, parents, n_nodes)
    return verify_tree_torch(logits, drafts, parents, n_nodes)
