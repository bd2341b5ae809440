"""Resuming a collection: what a trace folder (a local path or a storage URI) already holds, what is
left, and a refusal to mix collections (another model, backend, decoding setup or prompt order) in
one folder."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import storage
from .errors import CollectError
from .schema import TRACE_SCHEMA
from .store import read_traces

# Decoding keys that must agree between the traces already in a directory and a resumed run.
# (device, batch size and thread count are recorded but may change between runs.)
IDENTITY_KEYS = ("temperature", "max_tokens", "dtype", "chat_template", "topk_logprobs", "eos_token_ids")


@dataclass
class Plan:
    todo: list[dict]  # input rows still to generate, in seq order
    done: int  # input prompts already in the directory
    existing: int  # rows in the directory before this run
    too_long: list[str] = field(default_factory=list)  # prompt ids that do not fit the context


def plan(
    rows: Sequence[dict],
    out_dir: str | os.PathLike,
    *,
    model_revision: str,
    backend: str,
    decoding: dict,
    max_prompt_tokens: int | None = None,
) -> Plan:
    """Split the input rows into done (already in ``out_dir``) and to-do, refusing to mix collections.

    Raises :class:`CollectError` when the directory holds traces of another model revision, backend
    or decoding setup, or when ``seq`` numbers disagree with this input's order (another prompt list
    was collected into this directory) — resuming then would corrupt arrival order.
    """
    existing = (
        read_traces(out_dir, ["prompt_id", "seq", "model_revision", "backend", "decoding"])
        if storage.is_dir(out_dir)
        else TRACE_SCHEMA.empty_table()
    )
    where = f"{out_dir} already holds traces"
    fix = "; use another --out directory (or the same settings as before)"
    for rev in set(existing.column("model_revision").to_pylist()) - {model_revision}:
        raise CollectError(f"{where} of model revision {rev[:12]}…, this run uses {model_revision[:12]}…{fix}")
    for b in set(existing.column("backend").to_pylist()) - {backend}:
        raise CollectError(f"{where} of backend {b!r}, this run uses {backend!r}{fix}")
    mine = {k: decoding.get(k) for k in IDENTITY_KEYS}
    for d in set(existing.column("decoding").to_pylist()):
        theirs = {k: json.loads(d).get(k) for k in IDENTITY_KEYS}
        if theirs != mine:
            diff = {k: (theirs[k], mine[k]) for k in IDENTITY_KEYS if theirs[k] != mine[k]}
            raise CollectError(f"{where} with other decoding settings (before, now): {diff}{fix}")
    seq_of = dict(zip(existing.column("prompt_id").to_pylist(), existing.column("seq").to_pylist()))
    used = {s: p for p, s in seq_of.items()}
    todo, done, too_long = [], 0, []
    for r in rows:
        if r["prompt_id"] in seq_of:
            if seq_of[r["prompt_id"]] != r["seq"]:
                raise CollectError(
                    f"{where}: prompt {r['prompt_id']!r} has seq {seq_of[r['prompt_id']]} there but "
                    f"{r['seq']} in this input (a different prompt list or order){fix}"
                )
            done += 1
        elif r["seq"] in used:
            raise CollectError(
                f"{where}: seq {r['seq']} belongs to prompt {used[r['seq']]!r} there but to "
                f"{r['prompt_id']!r} in this input (a different prompt list or order){fix}"
            )
        elif max_prompt_tokens is not None and len(r["prompt_tokens"]) > max_prompt_tokens:
            too_long.append(r["prompt_id"])
        else:
            todo.append(r)
    return Plan(todo, done, existing.num_rows, too_long)
