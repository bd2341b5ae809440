"""Parquet schema of the label files ``jobs/label_traces.py`` writes (one row per trace position),
and the table replay's label columns make in it (:func:`columns_to_table`).

Row (prompt_id, t) describes the decoding step that would start when the request's output holds
``t`` tokens (``t >= 1``: the first token comes from prefill). At that point the context is
``prompt + output[:t]`` and a draft proposes ``output[t:]``:

* ``phi``: the feature vector φ_t (``selection/features.py``; names and version in the schema
  metadata key ``hvd_ray.feature_spec`` and in ``_labels_meta.json`` next to the files);
* ``y_cache``: the oracle label — the length of the longest prefix of the cache (suffix) draft that
  matches the recorded continuation; with greedy verification that is exactly the number of draft
  tokens the target accepts; ``cache_len``/``cache_score``/``cache_source``: that draft;
* ``y_model``/``model_len``: the same for the model drafter (0/0 when none is configured);
* ``budget``: the engine's draft budget at t (``min(max_draft, max_tokens - t - 1)``);
* ``remaining``: ``len(output) - t``; labels are cut at the trace's end (a draft can match at most
  ``remaining`` tokens; at a ``stop`` finish the EOS token itself is not in the trace);
* ``step_start``: whether t is where a step starts in the simulated decoding run that supplies the
  history features; ``sim_cache``: at step starts, whether that run verified the cache draft;
* ``regime``: ``cold`` (the global tree holds the earlier traces' outputs), ``agent`` (the same for
  a prompt's second turn, ``<id>/again`` from ``collect_traces.py --second-turns``: its prompt holds
  the first answer, which the global tree holds too) or ``repeat`` (the trace replayed again right
  after, its own output now in the global tree: a retry; ``label_traces.py --repeat``). Label
  folders written before the column existed read as all ``cold``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

LABEL_VERSION = 2  # 2: the regime column
SPEC_KEY = b"hvd_ray.feature_spec"
META_FILE = "_labels_meta.json"  # the leading "_" keeps parquet readers from treating it as data

LABEL_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("workload", pa.string(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("t", pa.int32(), nullable=False),
        pa.field("remaining", pa.int32(), nullable=False),
        pa.field("budget", pa.int32(), nullable=False),
        pa.field("step_start", pa.bool_(), nullable=False),
        pa.field("sim_cache", pa.bool_()),
        pa.field("phi", pa.list_(pa.float32()), nullable=False),
        pa.field("cache_len", pa.int32(), nullable=False),
        pa.field("cache_score", pa.float32(), nullable=False),
        pa.field("cache_source", pa.string(), nullable=False),
        pa.field("y_cache", pa.int32(), nullable=False),
        pa.field("model_len", pa.int32(), nullable=False),
        pa.field("y_model", pa.int32(), nullable=False),
        pa.field("regime", pa.string(), nullable=False),
    ]
)


def label_schema(spec_json: str) -> pa.Schema:
    """:data:`LABEL_SCHEMA` with the feature spec attached as metadata."""
    return LABEL_SCHEMA.with_metadata({SPEC_KEY: spec_json.encode()})


def with_regime(table: pa.Table) -> pa.Table:
    """``table`` with a ``regime`` column (all ``cold`` where a version-1 label folder has none)."""
    if "regime" in table.column_names:
        return table
    return table.append_column("regime", pa.array(["cold"] * table.num_rows, pa.string()))


def columns_to_table(cols: dict[str, list]) -> pa.Table:
    """Label columns (``replay.replay_trace``'s, merged) as one table in :func:`label_schema` with
    the current feature spec."""
    from ..selection.features import SPEC

    schema = label_schema(SPEC.to_json())
    arrays = []
    for f in schema:
        v = cols[f.name]
        if f.name == "phi":
            flat = np.concatenate(v).astype(np.float32) if v else np.zeros(0, np.float32)
            offsets = np.arange(len(v) + 1, dtype=np.int32) * (len(SPEC) if v else 0)
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)))
        else:
            arrays.append(pa.array(v, type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)
