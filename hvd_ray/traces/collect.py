"""Trace collection on Ray Data: prompts -> the target's greedy generations -> trace rows.

:class:`TraceActor` is the Ray Data class UDF of ``jobs/collect_traces.py`` (one model per actor,
batched generation) with the ``hvd_ray`` backend (our :class:`~hvd_ray.engine.Engine`) or the
optional ``vllm`` one (``generators.py``). The driver does the rest: the prompts' token rows
(``prompts.py``), the model's revision (``model_info.py``), what a folder already holds
(``resume.py``) and the part files (``store.py``); only the driver writes files. Each batch also
carries the ``node_id`` of the Ray node that generated it (dropped before writing), so the job
can say where its work ran.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime

import pyarrow as pa

from .errors import CollectError
from .generators import BACKENDS, GENERATORS
from .schema import TRACE_SCHEMA


class TraceActor:
    """Ray Data class UDF: loads the model once, turns a batch of input rows into trace rows.

    ``decoding`` is the run's decoding JSON (as a dict); the actor adds what it resolved itself
    (device) before writing it into each row.
    """

    def __init__(
        self,
        *,
        backend: str,
        folder: str,
        model_id: str,
        model_revision: str,
        decoding: dict,
        device: str | None = "auto",
        max_batch: int = 8,
        threads: int = 1,
        vllm_python: str | None = None,
    ):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch

        torch.set_num_threads(max(1, threads))
        if backend not in GENERATORS:
            raise CollectError(f"unknown backend {backend!r}; use one of {BACKENDS}")
        extra = {"vllm_python": vllm_python, "threads": max(1, threads)} if backend == "vllm" else {}
        self.gen = GENERATORS[backend](
            folder,
            decoding["dtype"],
            device,
            max_batch,
            topk=decoding.get("topk_logprobs") or 0,
            eos_token_ids=decoding.get("eos_token_ids") or (),
            **extra,
        )
        self.max_tokens = int(decoding["max_tokens"])
        import ray

        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        self.fixed = {
            "model_id": model_id,
            "model_revision": model_revision,
            "backend": backend,
            "decoding": json.dumps({**decoding, "device": self.gen.device, "max_batch": max_batch}, sort_keys=True),
        }

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        gens = self.gen.generate([r["prompt_tokens"] for r in rows], self.max_tokens)
        now = datetime.now(UTC)
        out = [
            {
                "prompt_id": r["prompt_id"],
                "workload": r["workload"],
                "split": r["split"],
                "seq": r["seq"],
                "prompt_tokens": r["prompt_tokens"],
                "output_tokens": g.output_tokens,
                "finish_reason": g.finish_reason,
                **self.fixed,
                "prefill_s": g.prefill_s,
                "decode_s": g.decode_s,
                "created_at": now,
                "topk_ids": g.topk_ids,
                "topk_logprobs": g.topk_logprobs,
            }
            for r, g in zip(rows, gens)
        ]
        table = pa.Table.from_pylist(out, schema=TRACE_SCHEMA)
        return table.append_column("node_id", pa.array([self.node_id] * table.num_rows, pa.string()))
