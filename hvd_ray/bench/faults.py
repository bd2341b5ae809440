"""Fault injection against a live application: kill the model replica under load, time recovery."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from .load import LoadResult, run_load

PROBE = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}


@dataclass
class KillOutcome:
    load: LoadResult  # the requests sent around the kill
    hung: bool  # some request never ended
    healthy_s: float  # kill -> /health answers ok again (a replacement replica serves)
    recovery_s: float  # kill -> the first request sent after the kill that succeeded
    probes: list[int]  # the status of each such request until then (503s expected)


def model_replica(app: str | None = None):
    """The handle of a running ModelReplica actor (of application ``app``, if given)."""
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if name.startswith("SERVE_REPLICA") and "ModelReplica" in name and (app is None or f"::{app}#" in name):
            return ray.get_actor(name, namespace=a["namespace"])
    raise LookupError("no ModelReplica actor is running")


def kill_replica_under_load(
    base_url: str,
    api_key: str | None = None,
    *,
    concurrency: int = 8,
    requests: int = 24,
    max_tokens: int = 16,
    prompts=None,
    app: str | None = None,
    timeout_s: float = 600.0,
) -> KillOutcome:
    """Start ``requests`` requests ``concurrency`` at a time, kill the model replica once the engine
    runs some, time how long until ``/health`` is ok again and until a request sent after the kill
    succeeds, then wait for the clients' requests to end."""
    import httpx
    import ray

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out: dict = {}
    runner = threading.Thread(
        target=lambda: out.setdefault(
            "res",
            asyncio.run(
                run_load(
                    base_url,
                    concurrency=concurrency,
                    requests=requests,
                    max_tokens=max_tokens,
                    disconnect_share=0.0,
                    api_key=api_key,
                    seed=2,
                    timeout_s=timeout_s,
                    prompts=prompts,
                )
            ),
        ),
        daemon=True,
    )
    replica = model_replica(app)
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s) as http:
        runner.start()
        deadline = time.monotonic() + 120
        while http.get("/stats").json()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        t_kill = time.monotonic()
        ray.kill(replica, no_restart=True)  # Serve notices the dead actor and starts a new replica
        healthy = None
        probes: list[int] = []
        while time.monotonic() - t_kill < timeout_s:
            if healthy is None and httpx.get(f"{base_url}/health", timeout=30).status_code == 200:
                healthy = time.monotonic() - t_kill
            if healthy is not None:  # a new request, queued behind what the clients still send
                r = http.post("/v1/chat/completions", json=PROBE)
                probes.append(r.status_code)
                if r.status_code == 200:
                    break
            time.sleep(0.5)
        recovery = time.monotonic() - t_kill
        runner.join(timeout=timeout_s)
    return KillOutcome(
        out.get("res", LoadResult()),
        runner.is_alive(),
        healthy if healthy is not None else float("inf"),
        recovery,
        probes,
    )
