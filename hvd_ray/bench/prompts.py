"""The prompts a benchmark runs: held-out prompts of the packaged workloads within a token budget,
and user prompt files as extra workloads."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..workloads import load_user_prompts, load_workload, render
from ..workloads.agent import agent_prompts

# workloads built here from the packaged ones (not dataset workloads of their own)
BUILT = {"agent": agent_prompts}


def prompt_ids(
    tok,
    workloads,
    per_workload: int,
    max_prompt_tokens: int,
    split: str | None = "test",
    extra: Sequence[tuple[str, list]] = (),
) -> list[tuple[str, str, list[int]]]:
    """(workload, prompt id, token ids) for held-out prompts, skipping ones longer than the budget;
    a workload may also be one of ``BUILT`` (``agent``: tool schemas shared by every prompt).
    ``extra``: more (label, prompts) workloads, e.g. ``user_workloads``' user prompt files."""
    sources = [(w, BUILT[w](split) if w in BUILT else load_workload(w, split=split)) for w in workloads]
    sources += list(extra)
    out = []
    for w, prompts in sources:
        taken = 0
        for p in prompts:
            ids = tok(render(p, tok), add_special_tokens=False)["input_ids"]
            if len(ids) <= max_prompt_tokens:
                out.append((w, p.id, ids))
                taken += 1
            if taken == per_workload:
                break
    return out


def user_workloads(files: Sequence[str], split: str | None, taken: Sequence[str] = ()) -> list[tuple[str, list]]:
    """Each user prompt file (jsonl/parquet) as one workload: (its file name without the suffix, its
    prompts of ``split``; None: all). Raises ValueError for an unusable file, or for names that
    repeat each other or one in ``taken`` (the packaged workloads run beside them)."""
    labels = [Path(f).stem for f in files]
    if len(set(labels)) < len(labels) or set(labels) & set(taken):
        raise ValueError(f"the files' names ({', '.join(labels)}) must differ from each other and from the workloads")
    out = []
    for f, label in zip(files, labels):
        own = [p for p in load_user_prompts(f) if split is None or p.split == split]
        if not own:
            raise ValueError(
                f"{f} has no {split}-split prompts (ids hash into train/validation/test); "
                "pass --split all to use every prompt in it"
            )
        out.append((label, own))
    return out
