"""Tree layout of a draft for the verify forward.

The verify forward feeds ``[last_token] + draft.token_ids``: node 0 is the root (the last context
token) and draft token ``i`` is node ``i + 1``, whose parent node is ``parents[i] + 1``. Parents
always precede their children, so one pass in order is enough for every helper here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_parents(parents: Sequence[int]) -> None:
    """Raise ``ValueError`` unless every parent is -1 or an earlier draft index."""
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: a parent must be -1 or an earlier index")


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (root = 0); position ids of the verify forward are ``start + depth``."""
    check_parents(parents)
    depths = [0]
    for p in parents:
        depths.append(depths[p + 1] + 1)
    return depths


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root (0) down to ``node``, both included."""
    check_parents(parents)
    if not 0 <= node <= len(parents):
        raise ValueError(f"node {node} outside a tree of {len(parents) + 1} nodes")
    path = [node]
    while node:
        node = parents[node - 1] + 1
        path.append(node)
    return path[::-1]


def tree_attention_mask(parents: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """``[n+1, n+1]`` bool mask: ``mask[j, k]`` iff node k is node j or one of its ancestors.

    This is the draft-local part of the verify attention mask (every node also sees the whole
    context). A chain gives the usual lower-triangular causal mask.
    """
    check_parents(parents)
    n = len(parents)
    rows: list[list[bool]] = [[True] + [False] * n]
    for i, p in enumerate(parents):
        row = list(rows[p + 1])
        row[i + 1] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool, device=device)


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """For every node, its children's draft indices in draft order (the order they are tried)."""
    check_parents(parents)
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        children[p + 1].append(i)
    return children
