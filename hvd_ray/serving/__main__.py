"""``python -m hvd_ray.serving``: start Ray + Serve locally, deploy the app, print the URL, block.

    python -m hvd_ray.serving                          # default model, HVD (suffix + EAGLE-3, cost policy), bf16, :8000
    python -m hvd_ray.serving --config config.yaml     # args (and http_options) from a Serve config
    python -m hvd_ray.serving --drafter none --dtype float32 --port 8001 --api-key sk-local

Flags override the config file. An API key (``--api-key``, a config file's ``api_key``, or the env
``HVD_RAY_API_KEY``) reaches the ingress through this process's environment, which the local Ray
instance's workers inherit: never through the application's args, which Serve shows and logs.
Ctrl-C or SIGTERM drains: new requests are refused, requests in flight finish (up to
``--drain-timeout`` seconds), then Serve and the local Ray instance shut down.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hvd_ray.serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default=None, help="a Serve config file (applications[0].args are used)")
    p.add_argument("--host", default=None, help="HTTP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    p.add_argument("--address", default=None, help="Ray address to join (default: start a local instance)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local Ray instance")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        dest="graceful_shutdown_timeout_s",
        help="seconds in-flight requests may take to finish on SIGTERM / Ctrl-C (default 60)",
    )
    for flag, kind in [
        ("model", str),
        ("drafter", str),
        ("dtype", str),
        ("device", str),
        ("max-batch", int),
        ("max-model-len", int),
        ("max-tokens", int),
        ("api-key", str),
        ("torch-threads", int),
        ("served-model-name", str),
        ("num-replicas", int),
        ("policy", str),
        ("model-drafter", str),
    ]:
        p.add_argument(f"--{flag}", type=kind, default=None)
    return p.parse_args(argv)


def _from_file(path: str) -> tuple[dict, dict]:
    import yaml

    with open(path) as f:
        conf = yaml.safe_load(f) or {}
    apps = conf.get("applications") or [{}]
    return dict(apps[0].get("args") or {}), dict(conf.get("http_options") or {})


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args, http = _from_file(a.config) if a.config else ({}, {})
    for key in (
        "model",
        "drafter",
        "dtype",
        "device",
        "max_batch",
        "max_model_len",
        "max_tokens",
        "api_key",
        "torch_threads",
        "served_model_name",
        "num_replicas",
        "policy",
        "model_drafter",
        "graceful_shutdown_timeout_s",
    ):
        if getattr(a, key) is not None:
            args[key] = getattr(a, key)
    if a.num_replicas is not None:
        args.pop("autoscaling_config", None)
    key = args.pop("api_key", None)
    if key:
        if a.address:
            print(
                "error: with --address the key must be in the cluster's environment: export HVD_RAY_API_KEY "
                "where its nodes start (the key is never passed in application args)",
                file=sys.stderr,
            )
            return 2
        os.environ["HVD_RAY_API_KEY"] = key  # inherited by the local Ray instance's workers
    host = a.host or http.get("host") or "127.0.0.1"
    port = a.port or http.get("port") or 8000

    from .app import build_app
    from .config import ServingConfig

    try:
        cfg = ServingConfig.model_validate(args)
    except ValueError as e:
        print(f"error: invalid serving config:\n{e}", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    ray.init(
        address=a.address or "local",
        num_cpus=a.num_cpus,
        include_dashboard=False,
        namespace="serve",
        log_to_driver=True,
    )
    try:
        serve.start(http_options={"host": host, "port": int(port)})
        serve.run(build_app(cfg), name="hvd", route_prefix="/")
        url = f"http://{host}:{port}"
        print(f"hvd-ray is serving {cfg.model_id} (drafter={cfg.drafter}, dtype={cfg.dtype}) at {url}/v1", flush=True)
        if key or os.environ.get("HVD_RAY_API_KEY"):  # the key itself is never printed
            ref = "<the key given with --api-key / api_key>" if key else "$HVD_RAY_API_KEY"
            auth = f' -H "Authorization: Bearer {ref}"'
        else:
            auth = ""
        print(
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            '-d \'{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64}\'',
            flush=True,
        )
        signal.signal(signal.SIGTERM, _interrupt)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the drain short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(
            f"draining: in-flight requests may finish (up to {cfg.graceful_shutdown_timeout_s:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        _drain()
        print("shutting down", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _drain() -> None:
    """Stop taking requests, then wait until the replicas have none in flight.

    ``serve.delete`` tears the application down gracefully: each replica stops accepting requests
    and waits for its ongoing ones up to its ``graceful_shutdown_timeout_s`` (the config key), while
    the HTTP proxy keeps streaming their responses; only then does ``serve.shutdown`` stop the proxy.
    """
    from ray import serve

    try:
        serve.delete("hvd", _blocking=True)
    except Exception as e:  # noqa: BLE001 - shutting down anyway
        print(f"drain incomplete: {e!r}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
