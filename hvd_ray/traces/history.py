"""Past outputs for a suffix drafter's global tree, read from a trace folder.

SuffixDecoding's global tree pays off once it holds the service's past outputs; a fresh process has
none. A ``collect_traces`` folder is such a history (outputs of the same model on the same kind of
requests), so the CLI, the server and the benchmark can start the global tree from one instead of
from empty. Only outputs go in (as serving would add them), never prompts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["past_outputs", "warm_global_tree"]


def past_outputs(path: str | Path, splits: Sequence[str] = ("train", "")) -> list[tuple[str, list[int]]]:
    """(id, output tokens) of the traces in ``path`` whose split is in ``splits``, in arrival order.
    The default keeps the train split (and unsplit user traces), so held-out prompts' own outputs
    never seed the tree they are measured with."""
    from .records import read_trace_table, traces_from_table

    if not Path(path).exists():
        raise FileNotFoundError(f"suffix history: no trace folder at {path}")
    traces = traces_from_table(read_trace_table(path))
    return [(f"history-{t.seq}", t.output) for t in traces if t.split in splits and t.output]


def warm_global_tree(drafters: Iterable, outputs: Sequence[tuple[str, list[int]]]) -> int:
    """Add ``outputs`` to the global tree of every drafter that has one (``add_to_global``);
    returns how many drafters took them. The tree's bound still applies: the oldest go first."""
    n = 0
    for d in drafters:
        if hasattr(d, "add_to_global"):
            for rid, tokens in outputs:
                d.add_to_global(rid, tokens)
            n += 1
    return n
