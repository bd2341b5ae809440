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
    recovery_s: float  # kill -> first request that succeeded after it
    probes: list[int]  # the status of each probe until then (503s expected)


def model_replica(app: str | None = None):
    """The handle of a running ModelReplica actor (of application ``app``, if given)."""
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if name.startswith("SERVE_REPLICA") and "ModelReplica" in name and (app is None or f"::{app}#" in name):
            return ray.get_actor(name, namespace=a["namespace"])
    raise LookupError("no ModelReplica actor is running")


def kill_replica_under_load(base_url: str, api_key: str | None = None, *, concurrency: int = 8, requests: int = 24,
                            max_tokens: int = 16, prompts=None, app: str | None = None,
                            timeout_s: float = 600.0) -> KillOutcome:
    """Start ``requests`` requests ``concurrency`` at a time, kill the model replica once the engine
    runs some, wait for them all, then probe until a request succeeds again."""
    import httpx
    import ray

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out: dict = {}
    runner = threading.Thread(target=lambda: out.setdefault("res", asyncio.run(run_load(
        base_url, concurrency=concurrency, requests=requests, max_tokens=max_tokens, disconnect_share=0.0,
        api_key=api_key, seed=2, timeout_s=timeout_s, prompts=prompts))), daemon=True)
    replica = model_replica(app)
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s) as http:
        runner.start()
        deadline = time.monotonic() + 120
        while http.get("/stats").json()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        t_kill = time.monotonic()
        ray.kill(replica, no_restart=True)  # Serve notices the dead actor and starts a new replica
        runner.join(timeout=timeout_s)
        probes = []
        while time.monotonic() - t_kill < timeout_s:
            r = http.post("/v1/chat/completions", json=PROBE)
            probes.append(r.status_code)
            if r.status_code == 200:
                break
            time.sleep(0.5)
        recovery = time.monotonic() - t_kill
    return KillOutcome(out.get("res", LoadResult()), runner.is_alive(), recovery, probes)
