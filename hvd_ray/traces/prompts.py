"""The prompts a collection generates for: where they come from, their second turns, their token rows."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from . import storage
from .errors import CollectError
from .store import read_traces


def load_prompts(
    workload: str | None = None, prompts_file: str | None = None, *, split: str | None = None, limit: int | None = None
) -> list:
    """A packaged workload's prompts or a user prompt file's (JSONL or parquet): exactly one of the
    two sources; ``split`` keeps one split (by prompt id), ``limit`` the first prompts."""
    from ..workloads import load_user_prompts, load_workload

    if (workload is None) == (prompts_file is None):
        raise ValueError("give a workload or a prompt file, not both or neither")
    if workload:
        return load_workload(workload, split=split, limit=limit)
    prompts = load_user_prompts(prompts_file)
    if split:
        prompts = [p for p in prompts if p.split == split]
    return prompts if limit is None else prompts[:limit]


def second_turns(prompts: Sequence[Any], out: str | os.PathLike, tokenizer: Any) -> list:
    """The second turns (``workloads.turns.second_turn``) of the ``prompts`` traced in ``out``."""
    from ..workloads.turns import second_turn

    if not storage.is_dir(out):
        return []
    done = read_traces(out, ["prompt_id", "output_tokens"]).to_pydict()
    answer = dict(zip(done["prompt_id"], done["output_tokens"]))
    return [
        second_turn(p, tokenizer.decode(answer[p.id], skip_special_tokens=True))
        for p in prompts
        if p.id in answer and answer[p.id]
    ]


def prepare_prompts(prompts: Sequence[Any], tokenizer: Any, chat: bool = True) -> list[dict]:
    """Input rows for the dataset: id, workload, split, ``seq`` = position in ``prompts``, token ids."""
    from ..workloads import render

    rows, seen = [], set()
    for seq, p in enumerate(prompts):
        if p.id in seen:
            raise CollectError(f"prompt id {p.id!r} appears twice in the input")
        seen.add(p.id)
        ids = tokenizer(render(p, tokenizer, chat=chat), add_special_tokens=False)["input_ids"]
        rows.append(
            {
                "prompt_id": p.id,
                "workload": p.workload,
                "split": p.split,
                "seq": seq,
                "prompt_tokens": [int(t) for t in ids],
            }
        )
    return rows
