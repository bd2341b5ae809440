"""A user's own prompts from a JSONL or parquet file.

Each row has ``messages`` (a list of ``{"role", "content"}``, ending with a user turn; a JSON
string of that list is accepted too) or ``prompt`` (a string, which becomes one user turn and the
plain ``raw`` prompt), or both. Optional columns: ``id`` (else ``user/<sha256 of the content>``),
``workload`` (default ``"chat"``). Any other columns go to ``meta``.

Row numbers in errors are 1-based: the line number in a JSONL file, the row index + 1 in parquet.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .prompts import WORKLOADS, Prompt, check_messages

PARQUET_SUFFIXES = (".parquet", ".pq")
_KNOWN = {"id", "messages", "prompt", "workload"}


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: row {n} is not valid JSON ({e.msg})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    yield from enumerate(pq.read_table(path).to_pylist(), start=1)


def _prompt_from_row(row: Any, where: str) -> Prompt:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with 'messages' or 'prompt', got {type(row).__name__}")
    messages, text = row.get("messages"), row.get("prompt")
    if messages is None and text is None:
        raise ValueError(f"{where}: needs a 'messages' list or a 'prompt' string")
    if text is not None and (not isinstance(text, str) or not text.strip()):
        raise ValueError(f"{where}: 'prompt' must be a non-empty string")
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: 'messages' is a string but not a JSON list") from None
    if messages is None:
        messages = [{"role": "user", "content": text}]
    else:
        check_messages(messages, where)
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    workload = row.get("workload") or "chat"
    if workload not in WORKLOADS:
        raise ValueError(f"{where}: workload {workload!r} not in {WORKLOADS}")
    pid = row.get("id")
    if pid is None:
        content = json.dumps({"messages": messages, "prompt": text}, sort_keys=True, ensure_ascii=False)
        pid = "user/" + hashlib.sha256(content.encode("utf-8")).hexdigest()[:16]
    elif not isinstance(pid, (str, int)) or isinstance(pid, bool) or str(pid) == "":
        raise ValueError(f"{where}: 'id' must be a non-empty string or integer")
    meta = {k: v for k, v in row.items() if k not in _KNOWN and v is not None}
    try:
        json.dumps(meta)
    except TypeError:
        meta = {k: str(v) for k, v in meta.items()}
    meta["source"] = "user"
    return Prompt(id=str(pid), workload=workload, messages=messages, raw=text, meta=meta)


def load_user_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a ``.jsonl`` file or a ``.parquet`` file (see the module docstring).

    Raises ``ValueError`` naming the row for a malformed row or a duplicate id.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found")
    rows = _parquet_rows(path) if path.suffix.lower() in PARQUET_SUFFIXES else _jsonl_rows(path)
    prompts, seen = [], {}
    for n, row in rows:
        prompt = _prompt_from_row(row, f"{path}: row {n}")
        if prompt.id in seen:
            raise ValueError(f"{path}: row {n} repeats id {prompt.id!r} of row {seen[prompt.id]}")
        seen[prompt.id] = n
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts
