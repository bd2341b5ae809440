"""The model replica: the Serve deployment holding one target model + Engine.

``ModelReplica`` loads the model (or its tensor-parallel ranks), builds the engine with the
configured drafter, and runs it on an ``EngineLoop`` (``engine_loop.py``: the one thread that steps
the engine, continuous batching at step granularity). The request path around the loop
(tokenising, validation, params, stop strings, streaming, metrics, health) is ``ReplicaFront``'s
(``replica_front.py``); this module adds what the ingress asks of a replica besides generation:
``info`` and ``stats``.

Failures: a request the engine fails alone gets a 500 error event and the loop goes on. If the loop
itself fails (the shared target forward raised, so the KV cache's state is unknown) every request
in flight or queued gets a 500 event at once, new ones a 503, ``check_health`` fails and Serve
replaces the replica. A loop that stops making progress (a step or a drafter call that never
returns) is caught the same way: the loop beats a heartbeat between steps and while idle, and
``check_health`` fails once it is older than ``step_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import psutil
from ray import serve

from .config import ServingConfig
from .engine_loop import EngineLoop
from .replica_front import ReplicaFront

logger = logging.getLogger("ray.serve")


@serve.deployment(name="ModelReplica", max_ongoing_requests=8, health_check_period_s=2)
class ModelReplica(ReplicaFront):
    """Holds the target model and an Engine with the configured drafter."""

    def __init__(self, config: dict):
        cfg = ServingConfig.model_validate(config)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch

        from ..build import build_engine
        from ..model import load

        torch.set_num_threads(cfg.threads())
        self.cfg = cfg
        if cfg.tensor_parallel_size > 1:  # the model lives sharded in rank actors (tensor_parallel.py)
            from .tensor_parallel import TensorParallelEngine

            self.engine = TensorParallelEngine.from_serving_config(cfg)
            self.model, self.tok = self.engine.model, self.engine.tokenizer
        else:
            self.model, self.tok = load(cfg.model, cfg.dtype, cfg.device)
            self.engine = build_engine(cfg.engine_spec(), self.model, self.tok, suffix_cache=self._suffix_cache(cfg))
        self.max_len, self.reserved = self.engine.max_len, self.engine.num_draft_tokens
        self.vocab_size = self.model.cfg.vocab_size
        self._start_metrics()
        self.loop = EngineLoop(self.engine, self.metrics, cfg.stream_interval)
        logger.info(
            "ModelReplica ready: model=%s dtype=%s drafter=%s max_batch=%d max_len=%d threads=%d",
            cfg.model,
            cfg.dtype,
            cfg.drafter,
            cfg.max_batch,
            self.engine.max_len,
            torch.get_num_threads(),
        )

    @staticmethod
    def _suffix_cache(cfg: ServingConfig):
        """The shared suffix actor's proxy for the engine's suffix drafter (None: an in-process one).
        The actor warms its own trees with ``suffix_history``; the engine builder warms a mirror's."""
        if not (cfg.suffix_actor and cfg.drafter in ("suffix", "hvd")):
            return None
        from ..selection.hvd import suffix_config
        from .suffix_actor import MirroredSuffixDrafter, RemoteSuffixDrafter, service_actor

        conf = suffix_config(cfg.policy if cfg.drafter == "hvd" else "none")
        actor = service_actor(
            cfg.suffix_actor_name, config=dataclasses.asdict(conf), history=cfg.suffix_history, model=cfg.model
        )
        if cfg.suffix_actor_mode == "mirror":
            return MirroredSuffixDrafter(actor, conf)
        return RemoteSuffixDrafter(actor, config=conf)

    # ---- methods called by the ingress
    def info(self) -> dict:
        return {
            "model": self.cfg.model_id,
            "max_model_len": self.engine.max_len,
            "max_tokens": self.cfg.max_tokens,
            "drafter": self.cfg.drafter,
            "dtype": self.cfg.dtype,
            "policy": self.cfg.policy if self.cfg.drafter == "hvd" else None,
            "slim": self.cfg.slim,
            "slim_mode": self.cfg.slim_mode if self.cfg.slim else None,
        }

    def stats(self) -> dict:
        """Engine-loop figures plus per-drafter state (live requests it tracks, actor wait time)."""
        out = self.loop.stats()
        drafters = getattr(self.engine, "drafters", [])
        out["drafters"] = {d.name: d.stats() for d in drafters}
        out["live_drafter_requests"] = sum(d.live_requests() for d in drafters)
        out["decode_s"] = self.loop.decode_s
        out["decode_steps"], out["decode_tokens"] = self.loop.decode_steps, self.loop.decode_tokens
        check = getattr(self.engine, "check", None)  # under a cost policy: how batches draft (costs.py)
        out["speculation"] = check.summary() if check is not None else None
        out["rss_bytes"] = psutil.Process().memory_info().rss  # leak checks under load (bench/load.py)
        return out
