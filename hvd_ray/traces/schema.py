"""Parquet schemas of the offline pipeline: traces (collect_traces) and labels (label_traces).

A *trace* is one prompt's greedy generation by the target, with what is needed to replay it:
the exact prompt and output token ids, the model that produced it, and how. Arrival order
(``seq``) matters: trace replay rebuilds the global suffix tree from earlier traces only.
"""

from __future__ import annotations

import pyarrow as pa

TRACE_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("workload", pa.string(), nullable=False),
        pa.field("split", pa.string(), nullable=False),  # train | validation | test (by prompt id)
        pa.field("seq", pa.int64(), nullable=False),  # arrival order within the collection
        pa.field("prompt_tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("output_tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("finish_reason", pa.string()),
        pa.field("model_id", pa.string(), nullable=False),
        pa.field("model_revision", pa.string(), nullable=False),  # content hash of the weights
        pa.field("backend", pa.string(), nullable=False),  # hvd_ray | vllm
        pa.field("decoding", pa.string(), nullable=False),  # JSON: temperature, max_tokens, dtype, ...
        pa.field("prefill_s", pa.float64()),
        pa.field("decode_s", pa.float64()),
        pa.field("created_at", pa.timestamp("ms", tz="UTC")),
        # optional, for DIMR calibration: per output position, the target's top-k ids and log-probs
        pa.field("topk_ids", pa.list_(pa.list_(pa.int32()))),
        pa.field("topk_logprobs", pa.list_(pa.list_(pa.float32()))),
    ]
)
