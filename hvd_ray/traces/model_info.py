"""What a trace records about its target model: content revision, context, dtype name, EOS ids."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from .errors import CollectError


def model_revision(folder: str | os.PathLike) -> str:
    """SHA-256 over ``config.json`` and every ``*.safetensors`` file (names, sizes, bytes).

    Stable across machines and copies of the same weights. Computed once per folder and cached
    under ``<hvd_ray cache>/revisions/`` keyed by the files' size and mtime, so later calls cost a
    few ``stat`` calls.
    """
    from ..model.registry import cache_dir

    folder = Path(folder).expanduser().resolve()
    files = sorted([folder / "config.json", *folder.glob("*.safetensors")], key=lambda p: p.name)
    missing = [f.name for f in files if not f.is_file()]
    if missing or len(files) < 2:
        raise CollectError(f"{folder}: cannot compute a revision (missing {missing or '*.safetensors'})")
    stat = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    cache = cache_dir() / "revisions" / (hashlib.sha256(str(folder).encode()).hexdigest()[:24] + ".json")
    try:
        cached = json.loads(cache.read_text())
        if cached.get("folder") == str(folder) and cached.get("files") == stat:
            return cached["revision"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.stat().st_size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 23):
                h.update(chunk)
    revision = h.hexdigest()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps({"folder": str(folder), "files": stat, "revision": revision}))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return revision


def model_context(folder: str | os.PathLike) -> int:
    """The model's context length from its ``config.json`` (2048 when it names none)."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or cfg.get("max_seq_len") or 2048)


def canonical_dtype(name: str) -> str:
    """A dtype name as the traces record it (``bf16`` -> ``bfloat16``)."""
    from ..model import parse_dtype

    return str(parse_dtype(name)).removeprefix("torch.")


def eos_token_ids(folder: str | os.PathLike, tokenizer: Any = None) -> list[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer (what the CLI stops on)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        p = Path(folder) / name
        if p.is_file():
            eos = json.loads(p.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)
