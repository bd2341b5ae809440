"""Greedy verification: keep the draft tokens the target would have picked itself.

``target_logits[j]`` is the target's distribution for the token that follows node j (node 0 = last
context token, node i+1 = draft token i). Argmax ties resolve like ``torch.argmax`` (first maximum),
so the result is token-identical to plain greedy decoding with the same logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .tree import check_parents, tree_children


def _as_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)


def greedy_accept_chain(target_logits: torch.Tensor, draft_tokens: Sequence[int] | torch.Tensor) -> tuple[int, int]:
    """Longest prefix with ``draft[i] == argmax(logits[i])``; bonus = argmax after that prefix.

    ``target_logits`` is ``[n+1, V]``. Returns ``(num_accepted, bonus_token)``; the step emits
    ``draft[:num_accepted] + [bonus_token]``.
    """
    draft = _as_list(draft_tokens)
    if target_logits.shape[0] != len(draft) + 1:
        raise ValueError(f"need {len(draft) + 1} logit rows, got {target_logits.shape[0]}")
    if target_logits.device.type == "cuda":  # Triton kernel: reads rows only up to the first mismatch
        from ..kernels import verify_greedy

        acc, bonus = verify_greedy(
            target_logits[None], torch.tensor([draft], dtype=torch.long).reshape(1, -1), [len(draft)]
        )
        return tuple(torch.stack([acc, bonus]).view(-1).tolist())
    best = target_logits.argmax(-1).tolist()
    k = 0
    while k < len(draft) and draft[k] == best[k]:
        k += 1
    return k, best[k]


def greedy_accept_chain_batch(
    target_logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched ``greedy_accept_chain`` without a Python loop or a host sync.

    ``target_logits`` ``[B, K+1, V]``, ``drafts`` ``[B, K]`` padded (padding is never accepted),
    ``draft_lens`` ``[B]``. Returns ``(accepted [B], bonus [B])`` as long tensors on the logits'
    device. On CUDA this runs the Triton kernel ``hvd_ray.kernels.verify_greedy`` (same results).
    """
    if target_logits.device.type == "cuda":
        from ..kernels import verify_greedy

        return verify_greedy(target_logits, drafts, draft_lens)
    return greedy_accept_chain_batch_torch(target_logits, drafts, draft_lens)


def greedy_accept_chain_batch_torch(
    target_logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch implementation of ``greedy_accept_chain_batch`` (any device): the kernel's own
    reference, ``hvd_ray.kernels.verify_greedy_torch``, so the two cannot drift apart."""
    from ..kernels import verify_greedy_torch

    return verify_greedy_torch(target_logits, drafts, draft_lens)


def greedy_accept_tree(
    target_logits: torch.Tensor, draft_tokens: Sequence[int] | torch.Tensor, parents: Sequence[int]
) -> tuple[list[int], int]:
    """Follow, from the root, the child whose token is the target's argmax at the current node.

    Returns ``(accepted_nodes, bonus_token)`` where ``accepted_nodes`` are draft indices along the
    accepted path, root side first. With duplicate sibling tokens the first one in draft order wins.
    """
    draft = _as_list(draft_tokens)
    if len(parents) != len(draft) or target_logits.shape[0] != len(draft) + 1:
        raise ValueError("need len(parents) == len(draft) and len(draft) + 1 logit rows")
    if target_logits.device.type == "cuda":  # Triton kernel: argmax only of the rows on the path
        from ..kernels import verify_tree

        check_parents(parents)
        path, n, bonus = verify_tree(
            target_logits[None],
            torch.tensor([draft], dtype=torch.long).reshape(1, -1),
            torch.tensor([list(parents)], dtype=torch.long).reshape(1, -1),
            [len(draft)],
        )
        n, bonus = torch.stack([n, bonus]).view(-1).tolist()
        return path[0, :n].tolist(), bonus
    return greedy_walk(target_logits.argmax(-1).tolist(), draft, parents)


def greedy_walk(best: Sequence[int], draft: Sequence[int], parents: Sequence[int]) -> tuple[list[int], int]:
    """``greedy_accept_tree`` on precomputed argmax tokens ``best[node]`` (the engine takes one
    argmax over the whole batch's logits, then walks each request's draft in Python)."""
    if all(p == i - 1 for i, p in enumerate(parents)):  # chain: longest matching prefix
        n = 0
        while n < len(draft) and draft[n] == best[n]:
            n += 1
        return list(range(n)), best[n]
    children = tree_children(parents)
    path: list[int] = []
    node = 0
    while True:
        nxt = next((c for c in children[node] if draft[c] == best[node]), None)
        if nxt is None:
            return path, best[node]
        path.append(nxt)
        node = nxt + 1
