"""The serving configuration: the ``args`` of ``serve run config.yaml`` and of ``build_app``.

One flat pydantic model, so a typo in a config file fails at deploy time with the field's name
instead of being silently ignored (``extra="forbid"``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..build import EngineSpec
from ..drafters import DRAFTERS
from ..model.registry import ALIASES


def _spec(name: str, default: Any = ..., **constraints: Any) -> Any:
    """A config field for the engine option ``name``: its help text (and default, unless serving
    has its own) come from :class:`~hvd_ray.build.EngineSpec`, where the option is declared once."""
    f = EngineSpec.__dataclass_fields__[name]
    return Field(f.default if default is ... else default, description=f.metadata["help"], **constraints)


# Where the retired vLLM backend of this app (``backend: vllm`` and its ``vllm_*`` fields) moved: a
# config that still sets ``backend`` or a ``vllm_*`` key is refused with this, not with pydantic's
# generic "extra inputs are not permitted" (no field of this model starts with ``vllm_``).
VLLM_MOVED = (
    "to serve with vLLM, run vLLM's own OpenAI server with hvd-ray's plug-in (`python -m "
    "vllm.entrypoints.openai.api_server --model M --enforce-eager --speculative-config "
    '\'{"method": "hvd", "num_speculative_tokens": 32}\'`) or Ray Serve LLM '
    "(`serve run configs/serve_llm_hvd.yaml`): docs/vllm.md"
)


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
    suffix_actor: bool = Field(
        True,
        description="suffix trees live in a shared CPU actor (serving/suffix_actor.py) instead of inside each replica",
    )
    suffix_actor_mode: str = Field(
        "mirror",
        pattern="^(mirror|remote)$",
        description="mirror: draft from local trees, exchange finished outputs with the "
        "actor in the background | remote: the actor holds the request trees and "
        "drafts for the whole batch once per step",
    )
    suffix_history: str | None = _spec("suffix_history")
    step_costs: str | None = _spec("step_costs")
    prefill_chunk: int | None = _spec("prefill_chunk", ge=1)
    prefix_reuse: bool = _spec("prefix_reuse")
    reuse_slots: int = _spec("reuse_slots", 4, ge=0, le=256)
    suffix_actor_name: str = Field(
        "hvd-suffix-drafter",
        description="base name of that actor; its full name adds "
        "a digest of the model, the suffix config and the history, so a redeploy of "
        "another model or config never reuses another's trees",
    )

    # --- engine limits
    max_batch: int = _spec("max_batch", 4, ge=1, le=256)
    max_model_len: int = _spec("max_len", ge=16)
    max_tokens: int = Field(1024, ge=1, description="the largest `max_tokens` a request may ask for (and the default)")
    stream_interval: int = Field(
        1,
        ge=1,
        le=64,
        description="a stream's tokens go out in events of at least this many (its first tokens and its "
        "end at once), as vLLM's stream_interval: fewer events through Serve's proxy and the ingress",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per replica (capped by the core "
        "count); default: all cores but one, which Serve's HTTP proxy, the "
        "ingress and the clients need (with a torch thread on every core, any of "
        "them running stalls every forward)",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks the model is sharded over (rank actors in a "
        "placement group, gloo on CPU / NCCL on GPU); at most the model's KV heads",
    )
    tp_ray_actor_options: dict[str, Any] = Field(
        default_factory=lambda: {"num_cpus": 1}, description="Ray resources of each tensor-parallel rank actor"
    )

    # --- HTTP
    api_key: str | None = Field(
        None,
        description="never set here (Serve shows and logs an application's args): "
        "the key comes from the env HVD_RAY_API_KEY or api_key_file, which the ingress "
        "reads itself; `python -m hvd_ray.serving --api-key` moves it into that env",
    )
    api_key_file: str | None = Field(
        None,
        description="a file on the ingress's node holding the key that requests "
        "must carry (`Authorization: Bearer <key>`), e.g. a mounted secret",
    )
    max_request_bytes: int = Field(
        4 * 2**20,
        ge=1024,
        description="largest request body; larger ones get a 413 "
        "before they are parsed (from Content-Length, or while reading)",
    )
    max_prompt_chars: int | None = Field(
        None,
        ge=1,
        description="largest prompt (or sum of message texts) in "
        "characters, refused before tokenising (default: 32 x max_model_len)",
    )

    # --- admission control and deadlines (an overloaded server refuses at once instead of queueing forever)
    max_queued_requests: int | None = Field(
        None,
        ge=1,
        description="requests each ingress replica queues for the "
        "model replicas beyond the ones they run; past it a request gets a "
        "503 with Retry-After at once (default: 4 x max_batch)",
    )
    retry_after_s: int = Field(5, ge=1, description="the Retry-After (seconds) sent with an overload 503")
    first_token_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a request without its first token this long "
        "after it arrived (queued, or in prefill) is dropped with a 503 and "
        "Retry-After",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="a request still generating this long after it "
        "arrived is cut: a 504 (or an error event ending its stream)",
    )
    body_timeout_s: float = Field(
        10.0,
        gt=0,
        description="the whole request body must arrive within this "
        "time, else a 408 (slow or stalled uploads cannot pin the ingress)",
    )
    step_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a replica whose engine has work but has not finished "
        "a step for this long reports unhealthy, and Serve replaces it",
    )

    # --- Ray Serve deployment options
    num_replicas: int | None = Field(None, ge=1, description="fixed replica count (instead of autoscaling_config)")
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    max_ongoing_requests: int | None = Field(None, ge=1, description="per replica (default: 2 x max_batch)")
    request_router: Literal["pow2", "affinity"] = Field(
        "pow2",
        description="how the ingress picks a model replica: pow2 = Serve's default power of two choices; "
        "affinity = the replica that served the longest prefix of the request, while its queue is at most "
        "one longer than the shortest (a conversation's next turn finds its K/V and suffix trees there; "
        "serving/affinity.py)",
    )
    ingress_ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.1})
    ingress_num_replicas: int = Field(1, ge=1)
    ingress_max_ongoing_requests: int = Field(
        1024, ge=1, description="HTTP requests one ingress replica holds at once (reading bodies, waiting, streaming)"
    )
    ingress_max_queued_requests: int = Field(
        256,
        ge=1,
        description="requests Serve's HTTP proxy queues for a full "
        "ingress; past it the proxy answers 503 with Retry-After",
    )
    graceful_shutdown_timeout_s: float = Field(
        60.0,
        ge=0,
        description="on shutdown (SIGTERM, serve delete, scale-down) a replica waits this long for requests in flight",
    )

    @model_validator(mode="before")
    @classmethod
    def _retired_vllm_backend(cls, data: Any) -> Any:
        if isinstance(data, dict):
            gone = [k for k in data if k == "backend" or isinstance(k, str) and k.startswith("vllm_")]
            if gone:
                raise ValueError(
                    f"`backend: vllm` was removed, with backend and the vllm_* fields (this config "
                    f"sets {', '.join(gone)}): this app runs hvd-ray's own engine, so drop them; " + VLLM_MOVED
                )
        return data

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

    @field_validator("api_key")
    @classmethod
    def _no_key_in_args(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError(
                "api_key may not be set in the application's args (Serve shows and logs them): "
                "export HVD_RAY_API_KEY where Ray starts, or set api_key_file to a file holding it"
            )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ServingConfig:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        if self.max_tokens >= self.max_model_len:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be < max_model_len ({self.max_model_len})")
        if self.drafter == "draft-model" and not self.draft_model:
            raise ValueError("drafter 'draft-model' needs draft_model (a folder sharing the tokenizer)")
        if self.drafter == "hvd" and self.model_drafter not in DRAFTERS or self.model_drafter == "suffix":
            raise ValueError(
                f"model_drafter must be one of eagle3, layerskip, draft-model, none; got {self.model_drafter!r}"
            )
        if (
            (self.drafter == "eagle3" or self.drafter == "hvd" and self.model_drafter == "eagle3")
            and self.model.lower() not in ALIASES
            and not self.eagle3_head
        ):
            raise ValueError(
                "the shipped EAGLE-3 head fits the default model only: set eagle3_head, or "
                "model_drafter: layerskip, or drafter: suffix"
            )
        return self

    def engine_spec(self) -> EngineSpec:
        """What the replica's engine decodes with (``hvd_ray.build``), from this config's fields."""
        given = {
            name: getattr(self, name) for name in EngineSpec.__dataclass_fields__ if name in type(self).model_fields
        }
        return EngineSpec(**given, max_len=self.max_model_len)

    def threads(self) -> int:
        """Torch threads of one replica: ``torch_threads`` capped by the cores, else all but one."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, min(self.torch_threads or cores - 1, cores))

    def resolved_api_key(self) -> str | None:
        """The key requests must carry, read in the process that checks it (the ingress replica):
        ``api_key_file``'s content, else the env ``HVD_RAY_API_KEY``; None: no key is required.
        An empty key (an empty file, ``HVD_RAY_API_KEY=""``) is an error, not a silent "no auth"."""
        if self.api_key_file:
            try:
                key = Path(self.api_key_file).read_text().strip()
            except OSError as e:
                raise ValueError(f"api_key_file {self.api_key_file}: {e.strerror}") from None
            if not key:
                raise ValueError(f"api_key_file {self.api_key_file} is empty")
            return key
        key = os.environ.get("HVD_RAY_API_KEY")
        if key is not None and not key.strip():
            raise ValueError("HVD_RAY_API_KEY is set but empty: unset it to serve without a key, or give the key")
        return key.strip() if key else None

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

    def replica_max_queued(self) -> int:
        return self.max_queued_requests or 4 * self.max_batch
