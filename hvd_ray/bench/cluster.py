"""The ``cluster`` benchmark: a load ramp against the app on a :class:`~hvd_ray.bench.sim_cluster.SimulatedCluster`.

:func:`serve_on` deploys the app there; :class:`LoadDriver` keeps a changeable number of clients busy
through the load driver (:func:`~hvd_ray.bench.load.run_load`) and records every request's outcome
and time, so a run can be split into phases (scale-up, scale-down) afterwards.
``tests/test_autoscaling.py`` and ``python jobs/benchmark.py cluster`` use both.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass

from .load import run_load
from .machine import DTYPE_NAMES, command, cpu_name, machine_line, versions
from .sim_cluster import (
    REPLICA_RESOURCE,
    SimulatedCluster,
    alive_nodes,
    free_port,
    replica_states,
    worker_types,
)


@contextlib.contextmanager
def serve_on(address: str, config: dict, name: str, deploy_timeout_s: float = 180.0):
    """The app ``build_app(config)`` on the cluster at ``address``, Serve's HTTP proxy on the head
    only; yields its base URL. Blocks until the app runs (its first replica may wait for a node)."""
    import ray
    from ray import serve

    from ..serving import build_app

    ray.init(address=address, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        errors: list[BaseException] = []

        def deploy() -> None:
            try:
                serve.run(build_app(config), name=name, route_prefix="/")
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
                errors.append(e)

        # serve.run waits for the app without a deadline; a replica no node can hold would wait forever
        deployer = threading.Thread(target=deploy, daemon=True)
        deployer.start()
        deployer.join(deploy_timeout_s)
        if errors:
            raise errors[0]
        if deployer.is_alive():
            raise TimeoutError(f"{name} not running after {deploy_timeout_s:.0f} s: {replica_states(name)}")
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def app_config(
    *,
    max_replicas: int,
    target_ongoing: float,
    drafter: str = "none",
    dtype: str = "bfloat16",
    max_tokens: int = 32,
    downscale_delay_s: float = 8.0,
) -> dict:
    """Our app with replica autoscaling from 1 to ``max_replicas``, each replica on a worker node."""
    return {
        "model": "default",
        "dtype": dtype,
        "drafter": drafter,
        "suffix_actor": False,
        "max_batch": 2,
        "reuse_slots": 0,
        "max_model_len": 1024,
        "max_tokens": max_tokens,
        "torch_threads": 1,
        "autoscaling_config": {
            "min_replicas": 1,
            "max_replicas": max_replicas,
            "target_ongoing_requests": target_ongoing,
            "look_back_period_s": 4.0,
            "upscale_delay_s": 2.0,
            "downscale_delay_s": downscale_delay_s,
        },
        "ray_actor_options": {"num_cpus": 0.5, "resources": {REPLICA_RESOURCE: 1}},
        "ingress_ray_actor_options": {"num_cpus": 0.1},
        "graceful_shutdown_timeout_s": 20.0,
    }


@dataclass
class Call:
    start: float  # seconds since the driver started
    end: float
    outcome: str  # ok | rejected (a 503 with Retry-After) | failed
    error: str = ""

    @property
    def latency(self) -> float:
        return self.end - self.start


class LoadDriver:
    """``threads`` clients, of which the first ``concurrency`` each send one request after another
    (``run_load`` with one request: a random mix of chat / completion, streamed or not, greedy or
    sampled, every stream checked for its finish reason and ``[DONE]``). ``concurrency`` may change
    while it runs. A request that stalls for ``timeout_s`` fails; a client still stuck after
    ``stop``'s grace period is counted in ``hung``."""

    def __init__(self, url: str, threads: int, *, prompts: list, max_tokens: int, timeout_s: float = 120.0):
        self.url, self.prompts, self.max_tokens, self.timeout_s = url, prompts, max_tokens, timeout_s
        self.concurrency = 0
        self.calls: list[Call] = []
        self.hung = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(threads)]
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def start(self, concurrency: int) -> LoadDriver:
        self.concurrency = concurrency
        for t in self._threads:
            t.start()
        return self

    def _client(self, i: int) -> None:
        k = 0
        while not self._stop.is_set():
            if i >= self.concurrency:
                time.sleep(0.05)
                continue
            k += 1
            t0 = self.now()
            try:
                res = asyncio.run(
                    run_load(
                        self.url,
                        concurrency=1,
                        requests=1,
                        max_tokens=self.max_tokens,
                        disconnect_share=0.0,
                        prompts=self.prompts,
                        seed=i * 100_000 + k,
                        timeout_s=self.timeout_s,
                    )
                )
                outcome = "ok" if res.ok else "rejected" if res.rejected else "failed"
                error = "; ".join(res.errors) or ", ".join(res.reject_codes)
            except Exception as e:  # noqa: BLE001 - counted, never stops the run
                outcome, error = "failed", f"{type(e).__name__}: {e}"
            with self._lock:
                self.calls.append(Call(t0, self.now(), outcome, error))

    def stop(self, grace_s: float | None = None) -> list[Call]:
        """Stop sending; wait for the requests in flight (a hung one counts in ``hung``)."""
        self._stop.set()
        deadline = time.monotonic() + (grace_s if grace_s is not None else self.timeout_s + 10)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.hung = sum(t.is_alive() for t in self._threads)
        return sorted(self.calls, key=lambda c: c.start)


def phase_stats(calls: list[Call], start: float, end: float) -> dict:
    """Requests that started in [start, end): served, rejected, failed, latency p50 / p99."""
    xs = [c for c in calls if start <= c.start < end]
    lat = sorted(c.latency for c in xs if c.outcome == "ok")

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(round(q * (len(lat) - 1))))] if lat else float("nan")

    return {
        "requests": len(xs),
        "ok": sum(c.outcome == "ok" for c in xs),
        "rejected": sum(c.outcome == "rejected" for c in xs),
        "failed": sum(c.outcome == "failed" for c in xs),
        "errors": sorted({c.error for c in xs if c.outcome != "ok"}),
        "p50": statistics.median(lat) if lat else float("nan"),
        "p99": pct(0.99),
    }


# ------------------------------------------------------------------------------------------ the benchmark
APP = "hvd-cluster"


def bench_cluster(args) -> str:
    """A load ramp (low, then high until the replicas reach ``--max-replicas`` and for ``--hold-s``
    more, then low until the app is back at one replica and the cluster at its first node count)
    against the autoscaling app on a simulated cluster; replicas and nodes sampled every second."""
    from .load import real_prompts

    max_rep = args.max_replicas
    low, high = min(args.concurrency), max(args.concurrency)
    drafter = (args.drafters or ["none"])[0]
    target = args.target_ongoing
    cfg = app_config(
        max_replicas=max_rep, target_ongoing=target, drafter=drafter, dtype=args.dtype, max_tokens=args.max_tokens
    )
    prompts = real_prompts(8, max_chars=1500)
    load_avg = os.getloadavg()
    t_job = time.perf_counter()
    samples: list[tuple[float, int, int, int, int, int]] = []  # (t, clients, running, starting, stopping, nodes)
    marks: dict[str, float] = {}
    with SimulatedCluster({"CPU": 2}, worker_types(max_rep)) as cluster:
        with serve_on(cluster.address, cfg, APP) as url:
            load = LoadDriver(url, high, prompts=prompts, max_tokens=args.max_tokens)
            first_nodes = alive_nodes()

            def sample() -> tuple[int, int]:
                st = replica_states(APP)
                running, stopping, nodes = st.get("RUNNING", 0), st.get("STOPPING", 0), alive_nodes()
                starting = sum(st.values()) - running - stopping
                samples.append((load.now(), load.concurrency, running, starting, stopping, nodes))
                print(f"[cluster] {samples[-1]}", flush=True)
                return running, nodes

            def until(cond, timeout: float) -> None:
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    if cond(*sample()):
                        return
                    time.sleep(1.0)

            load.start(low)
            marks["base"] = load.now()
            until(lambda r, n: False, args.base_s)
            load.concurrency = high
            marks["up"] = load.now()
            until(lambda r, n: r >= max_rep, 300)
            marks["scaled up"] = load.now()
            until(lambda r, n: False, args.hold_s)
            load.concurrency = low
            marks["down"] = load.now()
            until(lambda r, n: r <= 1 and n <= first_nodes, 240)
            marks["scaled down"] = load.now()
            until(lambda r, n: False, 5)
            marks["end"] = load.now()
            calls = load.stop()
    wall = time.perf_counter() - t_job
    phases = [
        ("base", "base", "up", low),
        ("scale-up (high load until all replicas run)", "up", "scaled up", high),
        ("hold (all replicas)", "scaled up", "down", high),
        ("scale-down (low load until one replica, first node count)", "down", "end", low),
    ]
    peak_nodes = max(s[5] for s in samples)
    t_node = next((s[0] for s in samples if s[0] >= marks["up"] and s[5] > first_nodes), float("nan"))
    lines = [
        "# Serve autoscaling on a simulated multi-node cluster",
        "",
        f"Command: `{command('jobs/benchmark.py')}`  ",
        f"Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_name()}; {versions().split(', arctic')[0]}  ",
        f"Machine: {machine_line()}  ",
        f"Setup: Ray's autoscaler over its fake multi-node provider on this one machine "
        f"(`hvd_ray/bench/sim_cluster.py`): a head (2 CPUs: Serve's controller, its HTTP proxy, the ingress) "
        f"and up to {max_rep} worker nodes of 1 CPU and one `{REPLICA_RESOURCE}` each, idle ones removed "
        f"after 6 s. Our app: SmolLM2-135M-Instruct {DTYPE_NAMES[args.dtype]}, drafter `{drafter}`, "
        f"`max_batch` 2, one torch thread per replica, each replica needing one `{REPLICA_RESOURCE}` "
        f"(so it runs on a worker node); `autoscaling_config` 1-{max_rep} replicas, "
        f"`target_ongoing_requests` {target}, upscale delay 2 s, downscale delay 8 s. Load: the load "
        f"driver's mix (chat and completions, half streamed, half sampled; short real prompts), "
        f"{args.max_tokens} tokens at most, {low} client(s), then {high}, then {low}; whole job {wall:.0f} s. "
        f"Load average when the job started: {load_avg[0]:.1f} (1 min), {load_avg[1]:.1f} (5 min).",
        "",
        "Every simulated node shares this machine's cores, so more replicas add no compute here and a "
        "replica loading its model takes CPU from the ones serving: what this measures is Serve's and Ray's "
        "control loops (how long scaling takes, which nodes come and go) and that no request is lost on "
        "the way; latencies under the high load reflect the shared cores, not a real cluster's.",
        "",
        f"Scale-up: {high} clients from {marks['up']:.0f} s; the first new node {t_node - marks['up']:.0f} s "
        f"later, {max_rep} replicas running {marks['scaled up'] - marks['up']:.0f} s later, nodes "
        f"{first_nodes} -> {peak_nodes}. Scale-down: "
        f"{low} client(s) from {marks['down']:.0f} s; one replica and {first_nodes} nodes again "
        f"{marks['scaled down'] - marks['down']:.0f} s later.",
        "",
        "Requests by the phase they started in (failed: an error status, a broken stream or a stall; "
        "rejected: a 503 with Retry-After):",
        "",
        "| phase | s | clients | requests | served | rejected | failed | p50 s | p99 s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    total_bad = 0
    for name, a, b, clients in phases:
        st = phase_stats(calls, marks[a], marks[b])
        total_bad += st["failed"] + st["rejected"]
        lines.append(
            f"| {name} | {marks[a]:.0f}-{marks[b]:.0f} | {clients} | {st['requests']} | {st['ok']} | "
            f"{st['rejected']} | {st['failed']} | {st['p50']:.2f} | {st['p99']:.2f} |"
        )
    errors = sorted({c.error for c in calls if c.outcome != "ok"})
    lines += [
        "",
        f"Clients stuck at the end: {load.hung}." + (f" Errors: {'; '.join(errors)[:600]}." if errors else ""),
        "",
        "Replicas and nodes over time (sampled every second; a row at every change, and every 10 s; "
        "starting = replicas waiting for a node or loading the model; stopping = draining their requests):",
        "",
        "| t s | clients | replicas running | starting | stopping | nodes alive | requests done since the last row |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    last_row, last_key = -1e9, None
    for i, (t, c, r, s, d, n) in enumerate(samples):
        key = (c, r, s, d, n)
        if key != last_key or t - last_row >= 10 or i == len(samples) - 1:
            done = sum(1 for x in calls if last_row < x.end <= t) if last_key is not None else 0
            lines.append(f"| {t:.0f} | {c} | {r} | {s} | {d} | {n} | {done} |")
            last_row, last_key = t, key
    if total_bad or load.hung:
        print(f"[cluster] WARNING: {total_bad} requests failed or were rejected, {load.hung} hung", file=sys.stderr)
    return "\n".join(lines) + "\n"


__all__ = ["Call", "LoadDriver", "app_config", "bench_cluster", "phase_stats", "serve_on"]
