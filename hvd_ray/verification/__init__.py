"""Verification of drafts against the target: greedy, rejection sampling, chains and trees.

Pure tensor functions (no model): the engine runs one target forward over ``[last_token] + draft``
with ``tree_attention_mask`` and hands the logits (or ``target_probs`` of them) to these.
"""

from .greedy import greedy_accept_chain, greedy_accept_chain_batch, greedy_accept_tree, greedy_walk
from .sampling import rejection_sample_chain, rejection_sample_tree, sample, target_probs
from .tree import check_parents, path_to, tree_attention_mask, tree_children, tree_depths

__all__ = [
    "check_parents",
    "greedy_accept_chain",
    "greedy_accept_chain_batch",
    "greedy_accept_tree",
    "greedy_walk",
    "path_to",
    "rejection_sample_chain",
    "rejection_sample_tree",
    "sample",
    "target_probs",
    "tree_attention_mask",
    "tree_children",
    "tree_depths",
]
