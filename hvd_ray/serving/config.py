"""The serving configuration: the ``args`` of ``serve run config.yaml`` and of ``build_app``.

One flat pydantic model, so a typo in a config file fails at deploy time with the field's name
instead of being silently ignored (``extra="forbid"``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..build import EngineSpec
from ..drafters import DRAFTERS
from ..model.registry import ALIASES


def _spec(name: str, default: Any = ..., **constraints: Any) -> Any:
    """A config field for the engine option ``name``: its help text (and default, unless serving
    has its own) come from :class:`~hvd_ray.build.EngineSpec`, where the option is declared once."""
    f = EngineSpec.__dataclass_fields__[name]
    return Field(f.default if default is ... else default, description=f.metadata["help"], **constraints)


class ServingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # --- what is served
    model: str = Field("default", description="'default' or a local HF Llama/Qwen2/Qwen3 safetensors folder")
    served_model_name: str | None = Field(None, description="the id clients send as `model` (default: `model`)")
    dtype: str = "bfloat16"
    device: str = "cpu"
    drafter: str = _spec("drafter", "hvd")
    num_draft_tokens: int = _spec("num_draft_tokens", ge=0, le=64)
    cache_draft_tokens: int = _spec("cache_draft_tokens", 64, ge=0, le=256)
    draft_model: str | None = _spec("draft_model")
    eagle3_head: str | None = _spec("eagle3_head")
    layerskip: str | None = _spec("layerskip")
    # HVD (drafter: hvd): the suffix cache + a model drafter, chosen per step by a policy
    policy: str = _spec("policy")
    model_drafter: str = _spec("model_drafter")
    predictor: str | None = _spec("predictor")
    slim: str | None = _spec("slim")
    slim_mode: str = _spec("slim_mode", pattern="^(lossless|tiered)$")
    suffix_actor: bool = Field(True, description="suffix trees live in a shared CPU actor (serving/suffix_actor.py) "
                               "instead of inside each replica")
    suffix_actor_mode: str = Field("mirror", pattern="^(mirror|remote)$",
                                   description="mirror: draft from local trees, exchange finished outputs with the "
                                   "actor in the background | remote: the actor holds the request trees and "
                                   "drafts for the whole batch once per step")
    suffix_history: str | None = _spec("suffix_history")
    suffix_actor_name: str = Field("hvd-suffix-drafter", description="name of that actor (one per application)")

    # --- engine limits
    max_batch: int = _spec("max_batch", 4, ge=1, le=256)
    max_model_len: int = _spec("max_len", ge=16)
    max_tokens: int = Field(1024, ge=1, description="the largest `max_tokens` a request may ask for (and the default)")
    torch_threads: int | None = Field(2, ge=1, description="torch threads per replica (capped by the core count)")
    tensor_parallel_size: int = Field(1, ge=1, description="ranks the model is sharded over (rank actors in a "
                                      "placement group, gloo on CPU / NCCL on GPU); at most the model's KV heads")
    tp_ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1},
                                                 description="Ray resources of each tensor-parallel rank actor")

    # --- HTTP
    api_key: str | None = Field(None, description="require `Authorization: Bearer <api_key>`; prefer the env "
                                "HVD_RAY_API_KEY, which the ingress reads itself (args are visible in Serve's config)")
    max_request_bytes: int = Field(4 * 2**20, ge=1024, description="largest request body; larger ones get a 413 "
                                   "before they are parsed (from Content-Length, or while reading)")
    max_prompt_chars: int | None = Field(None, ge=1, description="largest prompt (or sum of message texts) in "
                                         "characters, refused before tokenising (default: 32 x max_model_len)")

    # --- Ray Serve deployment options
    num_replicas: int | None = Field(None, ge=1, description="fixed replica count (instead of autoscaling_config)")
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    max_ongoing_requests: int | None = Field(None, ge=1, description="per replica (default: 2 x max_batch)")
    ingress_ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.1})
    ingress_num_replicas: int = Field(1, ge=1)
    graceful_shutdown_timeout_s: float = Field(60.0, ge=0, description="on shutdown (SIGTERM, serve delete, "
                                               "scale-down) a replica waits this long for requests in flight")

    @field_validator("drafter")
    @classmethod
    def _known_drafter(cls, v: str) -> str:
        if v not in DRAFTERS + ("hvd",):
            raise ValueError(f"unknown drafter {v!r}; choose from {', '.join(DRAFTERS + ('hvd',))}")
        return v

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from ..selection.hvd import POLICIES

        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; choose from {', '.join(POLICIES)}")
        return v

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        from ..model import parse_dtype

        parse_dtype(v)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "ServingConfig":
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        if self.max_tokens >= self.max_model_len:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be < max_model_len ({self.max_model_len})")
        if self.drafter == "draft-model" and not self.draft_model:
            raise ValueError("drafter 'draft-model' needs draft_model (a folder sharing the tokenizer)")
        if self.drafter == "hvd" and self.model_drafter not in DRAFTERS or self.model_drafter == "suffix":
            raise ValueError(f"model_drafter must be one of eagle3, layerskip, draft-model, none; got {self.model_drafter!r}")
        if (self.drafter == "eagle3" or self.drafter == "hvd" and self.model_drafter == "eagle3") and \
                self.model.lower() not in ALIASES and not self.eagle3_head:
            raise ValueError("the shipped EAGLE-3 head fits the default model only: set eagle3_head, or "
                             "model_drafter: layerskip, or drafter: suffix")
        return self

    def engine_spec(self) -> EngineSpec:
        """What the replica's engine decodes with (``hvd_ray.build``), from this config's fields."""
        given = {name: getattr(self, name) for name in EngineSpec.__dataclass_fields__ if name in type(self).model_fields}
        return EngineSpec(**given, max_len=self.max_model_len)

    def resolved_api_key(self) -> str | None:
        """The key requests must carry: ``api_key``, else the env ``HVD_RAY_API_KEY`` of the process
        that asks (the ingress replica), so a key from the environment never travels in args."""
        return self.api_key or os.environ.get("HVD_RAY_API_KEY") or None

    def prompt_char_limit(self) -> int:
        return self.max_prompt_chars or 32 * self.max_model_len

    @property
    def model_id(self) -> str:
        """The id reported by /v1/models."""
        return self.served_model_name or self.model

    def accepted_model_names(self) -> set[str]:
        """Names a request's `model` field may carry (the served id plus the model's aliases)."""
        from ..model.registry import ALIASES, DEFAULT_MODEL

        names = {self.model_id, self.model}
        if self.model.lower() in ALIASES:
            names |= set(ALIASES) | {DEFAULT_MODEL}
        else:
            names.add(Path(self.model).name)
        return names

    def replica_max_ongoing(self) -> int:
        return self.max_ongoing_requests or 2 * self.max_batch
