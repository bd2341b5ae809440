"""``build_app(args) -> Application``: the Serve application (ingress -> model replica).

Serve calls an *application builder* with the ``args`` of a config file (``serve run config.yaml``)
or the ``key=value`` pairs of ``serve run serve_app:app key=value``; ``serve_app.app`` is this
builder. Deployment options (replicas, autoscaling, resources) come from the same args, so one
file describes the whole application; a ``deployments:`` section in a Serve config file still
overrides them, as usual in Serve.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from .config import ServingConfig


def uses_gpu(device: str) -> bool:
    """Whether a replica on ``device`` reserves a GPU: ``cuda``, and ``auto`` where the Ray cluster the
    app is built in has GPUs (an ``auto`` replica that reserved none would use a GPU the scheduler
    may give to another); ``auto`` with no GPU in the cluster yet (an autoscaler that has not
    started a GPU node) reserves none: say ``cuda`` there."""
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1


def build_app(args: dict[str, Any] | ServingConfig | None = None) -> Application:
    cfg = args if isinstance(args, ServingConfig) else ServingConfig.model_validate(dict(args or {}))
    from .ingress import OpenAIIngress
    from .replica import ModelReplica

    conf = cfg.model_dump()
    actor = dict(cfg.ray_actor_options)
    # on CUDA the replica holds the model's GPU, unless tensor parallelism gives it to the rank actors
    # (each rank one GPU, all in one placement group): the replica then only drives them
    if uses_gpu(cfg.device) and "num_gpus" not in actor and cfg.tensor_parallel_size == 1:
        actor["num_gpus"] = 1
    drain = {"graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s}
    # Bounded queues: the ingress's handle queues at most replica_max_queued() requests for the model
    # replicas (BackPressureError -> the ingress's 503 + Retry-After), the HTTP proxy at most
    # ingress_max_queued_requests for the ingress (Serve's own 503 + Retry-After).
    opts: dict[str, Any] = {
        "ray_actor_options": actor,
        "max_ongoing_requests": cfg.replica_max_ongoing(),
        "max_queued_requests": cfg.replica_max_queued(),
        **drain,
    }
    if cfg.request_router == "affinity":
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class="hvd_ray.serving.affinity.PrefixAffinityRouter"
        )
    if cfg.autoscaling_config is not None:
        auto = {"target_ongoing_requests": cfg.max_batch, **cfg.autoscaling_config}
        opts["autoscaling_config"] = auto
    else:
        opts["num_replicas"] = cfg.num_replicas or 1
    replica = ModelReplica.options(**opts).bind(conf)
    ingress = OpenAIIngress.options(
        ray_actor_options=dict(cfg.ingress_ray_actor_options),
        num_replicas=cfg.ingress_num_replicas,
        max_ongoing_requests=cfg.ingress_max_ongoing_requests,
        max_queued_requests=cfg.ingress_max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=cfg.retry_after_s),
        **drain,
    )
    return ingress.bind(replica, conf)
