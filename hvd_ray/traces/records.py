"""Trace records as replay reads them: a trace folder's rows -> :class:`Trace`, sorted by ``seq``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from .store import read_traces

TRACE_COLUMNS = ("prompt_id", "workload", "split", "seq", "prompt_tokens", "output_tokens", "finish_reason", "decoding")


@dataclass
class Trace:
    """One recorded greedy generation; ``max_tokens`` from its decoding JSON (else its output length)."""

    prompt_id: str
    seq: int
    prompt: list[int]
    output: list[int]
    max_tokens: int
    workload: str = ""
    split: str = ""

    @property
    def rid(self) -> str:
        return f"seq-{self.seq}"


def _max_tokens(decoding: str | None, n_out: int) -> int:
    try:
        mt = json.loads(decoding or "{}").get("max_tokens")
    except (TypeError, ValueError):
        mt = None
    return int(mt) if mt else n_out


def traces_from_table(table: pa.Table) -> list[Trace]:
    """``TRACE_SCHEMA`` rows -> :class:`Trace` list sorted by ``seq``."""
    d = table.to_pydict()
    n = table.num_rows
    get = lambda c, i, default="": d[c][i] if c in d and d[c][i] is not None else default  # noqa: E731
    out = [
        Trace(
            str(d["prompt_id"][i]),
            int(d["seq"][i]),
            list(d["prompt_tokens"][i]),
            list(d["output_tokens"][i]),
            _max_tokens(get("decoding", i, None), len(d["output_tokens"][i])),
            str(get("workload", i)),
            str(get("split", i)),
        )
        for i in range(n)
    ]
    return sorted(out, key=lambda tr: tr.seq)


def read_trace_table(path: str | Path, columns: Sequence[str] | None = TRACE_COLUMNS) -> pa.Table:
    """The trace folder (``collect_traces`` parts) as one table sorted by ``seq``, with the
    columns replay reads (``traces.store.read_traces``)."""
    return read_traces(path, columns)
