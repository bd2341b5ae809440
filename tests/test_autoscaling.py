"""Serve replica autoscaling onto nodes Ray's autoscaler adds, and back, on a simulated cluster
(Ray's real autoscaler over its fake multi-node provider: each worker node is a raylet of its own on
this machine). The model replicas need a resource only worker nodes have, so scaling the app out
needs new nodes; requests must keep being answered while replicas start on them and while they are
drained and the nodes removed."""

from __future__ import annotations

import time

import pytest

from hvd_ray.bench.cluster import LoadDriver, app_config, phase_stats, serve_on
from hvd_ray.bench.load import real_prompts
from hvd_ray.bench.sim_cluster import SimulatedCluster, alive_nodes, replica_states, worker_types

APP = "autoscale-test"


def wait_for(cond, timeout: float, what: str) -> list[tuple[float, dict, int]]:
    """Poll (replica states, alive nodes) every second until ``cond(states, nodes)``; the samples."""
    seen, deadline = [], time.monotonic() + timeout
    while True:
        st, nodes = replica_states(APP), alive_nodes()
        seen.append((time.monotonic(), st, nodes))
        if cond(st, nodes):
            return seen
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:.0f} s: {seen[-5:]}"
        time.sleep(1.0)


@pytest.mark.slow
def test_replicas_scale_out_onto_new_nodes_and_back_without_failing_a_request(default_folder):
    config = app_config(max_replicas=2, target_ongoing=1, max_tokens=12, downscale_delay_s=5.0)
    prompts = real_prompts(4, max_chars=1200)
    with SimulatedCluster({"CPU": 2}, worker_types(2), idle_timeout_minutes=0.1) as cluster:
        with serve_on(cluster.address, config, APP) as url:
            # the first replica needed a worker node of its own: the autoscaler launched it
            first = wait_for(lambda st, n: st.get("RUNNING") == 1 and n == 2, 30, "one replica on one worker")
            load = LoadDriver(url, 4, prompts=prompts, max_tokens=12, timeout_s=90).start(4)
            try:
                up = wait_for(lambda st, n: st.get("RUNNING") == 2 and n == 3, 120, "two replicas on two workers")
                t_up = load.now()
                time.sleep(4)  # both replicas serve a little under load
                load.concurrency = 1
                t_down = load.now()
                down = wait_for(
                    lambda st, n: st.get("RUNNING") == 1 and sum(st.values()) == 1 and n == 2,
                    90,
                    "back to one replica on one worker",
                )
                t_end = load.now()
            finally:
                calls = load.stop()
    assert first[-1][2] == 2 and max(n for _, _, n in up) == 3  # the node count grew with the replicas
    assert min(n for _, _, n in down) == 2  # and shrank after them
    assert load.hung == 0, "a request hung"
    scale_up, scale_down = phase_stats(calls, 0, t_down), phase_stats(calls, t_down, t_end + 1)
    for name, st in (("scale-up", scale_up), ("scale-down", scale_down)):
        assert st["requests"] >= 3, (name, st)
        assert st["failed"] == 0 and st["rejected"] == 0, (name, st)
    assert all(c.outcome == "ok" for c in calls), [c for c in calls if c.outcome != "ok"]
    print(f"scaled up after {t_up:.0f} s of load, down {t_end - t_down:.0f} s after it eased;", scale_up, scale_down)
