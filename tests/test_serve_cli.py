"""The app through Serve's own CLI, as the README and docs/serving.md tell an operator to run it:
``serve run config.yaml`` against a local Ray, stopped with Ctrl-C, and ``serve deploy config.yaml``
to a running Ray head, checked with ``serve status`` and removed with ``serve shutdown -y``. The
config is the repository's ``config.yaml`` with a small engine and this test's own ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from hvd_ray.bench.sim_cluster import SimulatedCluster, free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ELSEWHERE = Path(tempfile.gettempdir())  # a directory outside the checkout (not on the workers' path)
ENV = {
    **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    "HF_HUB_OFFLINE": "1",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def small_config(path: Path, port: int) -> Path:
    """config.yaml with its HTTP port moved to ``port`` and an engine small enough for a quick start."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["http_options"]["port"] = port
    args = cfg["applications"][0]["args"]
    args.update(
        drafter="none",
        max_batch=2,
        reuse_slots=0,
        max_model_len=512,
        max_tokens=32,
        autoscaling_config={"min_replicas": 1, "max_replicas": 1},
    )
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def chat(port: int) -> dict:
    import httpx

    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json={"model": "default", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] > 0, body
    return body


def serving(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def closed(port: int) -> bool:
    import httpx

    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def until(cond, timeout: float, what: str, log: Path | None = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(1)
    raise AssertionError(f"{what} not within {timeout:.0f} s" + (f":\n{log.read_text()[-3000:]}" if log else ""))


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]], cwd=ELSEWHERE, env=ENV, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def head():
    """A Ray head of its own (``ray start --head --block``: own ports and temp dir, its dashboard for
    ``serve deploy``), started outside the checkout, as ``cluster.yaml``'s start commands do (from the
    home directory): the config's application must come from the installed package."""
    env = {"HF_HUB_OFFLINE": "1", "RAY_metrics_report_interval_ms": "2000"}  # metrics reach /metrics sooner
    with SimulatedCluster({"CPU": 2}, dashboard=True, env=env, cwd=ELSEWHERE) as cluster:
        yield cluster


@pytest.mark.slow
def test_serve_run_of_the_config_answers_and_stops_on_ctrl_c(head, tmp_path, default_folder):
    port = free_port()
    config = small_config(tmp_path / "config.yaml", port)
    log = tmp_path / "serve-run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "serve"), "run", str(config), "--address", head.address],
            cwd=ELSEWHERE,
            env=ENV,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        until(lambda: proc.poll() is not None or serving(port), 180, "the app answering /health", log)
        assert proc.poll() is None, log.read_text()[-3000:]
        chat(port)
        proc.send_signal(signal.SIGINT)  # Ctrl-C: serve run shuts Serve down and exits
        assert proc.wait(90) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    until(lambda: closed(port), 30, "the HTTP port closed")
    assert "Got KeyboardInterrupt, shutting down" in log.read_text(), log.read_text()[-3000:]


@pytest.mark.slow
def test_serve_deploy_to_a_running_head_status_and_shutdown(head, tmp_path, default_folder):
    import httpx

    port = free_port()
    config = small_config(tmp_path / "config.yaml", port)
    dash = head.dashboard_url
    r = cli("serve", "deploy", str(config), "--address", dash)
    assert r.returncode == 0, r.stdout + r.stderr

    def app_running():
        s = cli("serve", "status", "--address", dash)
        assert s.returncode == 0, s.stdout + s.stderr
        st = yaml.safe_load(s.stdout)
        app = (st.get("applications") or {}).get("hvd") or {}
        assert app.get("status") not in ("DEPLOY_FAILED", "UNHEALTHY"), s.stdout
        return st if app.get("status") == "RUNNING" else None

    status = until(app_running, 180, "serve status: hvd RUNNING")
    deployments = status["applications"]["hvd"]["deployments"]
    assert deployments["ModelReplica"]["status"] == "HEALTHY"
    assert deployments["ModelReplica"]["replica_states"] == {"RUNNING": 1}, deployments
    assert serving(port)
    chat(port)

    def exported():  # the replica's own series on the head's Prometheus endpoint (Ray's metrics agent)
        try:
            text = httpx.get(f"http://127.0.0.1:{head.metrics_port}/metrics", timeout=10).text
        except httpx.HTTPError:
            return None
        return [line for line in text.splitlines() if line.startswith("ray_hvd_generated_tokens_total{")]

    series = until(exported, 60, "ray_hvd_generated_tokens_total on the metrics port")
    assert sum(float(line.rsplit(" ", 1)[1]) for line in series) > 0, series
    r = cli("serve", "shutdown", "-y", "--address", dash)
    assert r.returncode == 0, r.stdout + r.stderr
    until(lambda: closed(port), 60, "the HTTP port closed")
    after = yaml.safe_load(cli("serve", "status", "--address", dash).stdout) or {}
    assert not after.get("applications"), after
