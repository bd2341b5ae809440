"""A multi-node Ray cluster simulated on one machine, for the autoscaling tests and benchmark.

:class:`SimulatedCluster` runs Ray's real autoscaler with its fake multi-node provider: every worker
node the autoscaler launches is a raylet of its own, a separate node to the scheduler and to Serve.
Worker nodes carry a resource the head lacks (``REPLICA_RESOURCE``), so model replicas that ask for
it make the autoscaler add nodes, and a node left idle is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ray.cluster_utils import AutoscalingCluster

REPLICA_RESOURCE = "replica_node"  # only worker nodes have it: a model replica never lands on the head
WORKER_TYPE = "replica.cpu"
MODEL_DEPLOYMENT = "ModelReplica"

# ray/autoscaler/_private/fake_multi_node/example.yaml, the template AutoscalingCluster merges its node
# types into; Ray's wheel does not ship that file
FAKE_TEMPLATE = {
    "cluster_name": "fake_multinode",
    "max_workers": 8,
    "provider": {
        "type": "fake_multinode",
        "use_node_id_as_ip": True,
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
    },
    "head_node_type": "ray.head.default",
    "auth": {},
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": 0.1,
    "docker": {},
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
}


def session_pids(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(d.name))
    return pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_types(max_workers: int, cpus: float = 1, object_store_mb: int = 100) -> dict:
    """One worker node type for model replicas: ``cpus`` CPUs and one ``replica_node`` each."""
    return {
        WORKER_TYPE: {
            "resources": {"CPU": cpus, REPLICA_RESOURCE: 1, "object_store_memory": object_store_mb * 2**20},
            "node_config": {},
            "min_workers": 0,
            "max_workers": max_workers,
        }
    }


class SimulatedCluster(AutoscalingCluster):
    """``ray.cluster_utils.AutoscalingCluster`` (the real autoscaler over the fake multi-node provider),
    started so that it can share a machine with other Ray instances.

    AutoscalingCluster's ``start`` and ``shutdown`` run ``ray stop --force``, which kills every Ray
    process on the machine, another user's cluster included, and its config template is missing from
    Ray's wheel. This one builds the same config from :data:`FAKE_TEMPLATE`, starts the head with
    ``ray start --head --block`` on ports and a temp dir of its own (the provider's worker nodes join
    that GCS), and on shutdown stops exactly the processes descended from that command. Without
    ``worker_node_types`` it is a plain head with no autoscaler (``serve deploy`` needs only a
    dashboard). Use it as a context manager; ``address`` is the GCS address for ``ray.init``.
    """

    def __init__(
        self,
        head_resources: dict,
        worker_node_types: dict | None = None,
        *,
        dashboard: bool = False,
        env: dict | None = None,
        cwd: str | Path | None = None,
        **config_kwargs,
    ):
        from ray._private.services import get_node_ip_address

        self.ip = get_node_ip_address()
        self.gcs_port = free_port()
        self.dashboard_port = free_port() if dashboard else None
        self.metrics_port = free_port()  # Ray's Prometheus endpoint on the head (/metrics)
        self.env = dict(env or {})
        self.cwd = cwd  # the head's Ray adds its own working directory to every worker's sys.path
        self.autoscaling = bool(worker_node_types)
        self.proc: subprocess.Popen | None = None
        self.temp_dir: str | None = None
        super().__init__(dict(head_resources), dict(worker_node_types or {}), **config_kwargs)

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
        config = json.loads(json.dumps(FAKE_TEMPLATE))
        config["provider"]["gcs_address"] = self.address  # the worker nodes join this head, not 6379
        config["available_node_types"] = {
            **worker_node_types,
            "ray.head.default": {"resources": head_resources, "node_config": {}, "max_workers": 0},
        }
        config.update(config_kwargs)
        return config

    def start(self, _system_config=None, override_env=None, timeout_s: float = 90.0) -> str:
        # a short path: Ray's socket paths under it must stay within the 107-byte limit
        self.temp_dir = tempfile.mkdtemp(prefix="ray-sim-")
        res = dict(self._head_resources)
        ray_bin = str(Path(sys.executable).with_name("ray"))
        cmd = [
            ray_bin,
            "start",
            "--head",
            "--block",
            f"--port={self.gcs_port}",
            f"--temp-dir={self.temp_dir}",
            f"--num-cpus={res.pop('CPU', 0)}",
            f"--num-gpus={res.pop('GPU', 0)}",
            f"--object-store-memory={res.pop('object_store_memory', 200 * 2**20)}",
            f"--ray-client-server-port={free_port()}",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={self.metrics_port}",
        ]
        if res:
            cmd.append(f"--resources={json.dumps(res)}")
        if self.dashboard_port:
            cmd += ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}"]
        else:
            cmd.append("--include-dashboard=false")
        if self.autoscaling:
            config = Path(self.temp_dir) / "autoscaling.json"
            config.write_text(json.dumps(self._config))
            cmd.append(f"--autoscaling-config={config}")
        if _system_config is not None:
            cmd.append(f"--system-config={json.dumps(_system_config, separators=(',', ':'))}")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(
            AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_FAKE_CLUSTER="1", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1"
        )
        env.setdefault("RAY_AUTH_MODE", "disabled")
        env.update(self.env, **(override_env or {}))
        self.log = Path(self.temp_dir) / "ray-start.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = self.log.read_text()
                self.shutdown()
                raise RuntimeError(f"ray start failed (rc {self.proc.returncode}):\n{text[-4000:]}")
            time.sleep(0.5)
        return self.address

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the head (``ray start --block`` stops its own processes on SIGTERM), then whatever else
        is left of its process session: the worker nodes' raylets and workers, which the autoscaler
        started (no Ray process calls setsid, so all of them stay in the session ``start`` opened)."""
        if self.proc is not None:
            sid = self.proc.pid
            if self.proc.poll() is None:
                self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                left = session_pids(sid)
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                end = time.monotonic() + grace
                while session_pids(sid) and time.monotonic() < end:
                    time.sleep(0.2)
            self.proc = None
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    def __enter__(self) -> SimulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def alive_nodes() -> int:
    """Nodes of the connected cluster that are alive (the head counts)."""
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"])


def replica_states(app: str, deployment: str = MODEL_DEPLOYMENT) -> dict[str, int]:
    """``{"RUNNING": 2, "STARTING": 1, ...}`` of the app's model deployment."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return {}
    return {getattr(k, "value", str(k)): v for k, v in status.deployments[deployment].replica_states.items()}


__all__ = [
    "MODEL_DEPLOYMENT",
    "REPLICA_RESOURCE",
    "WORKER_TYPE",
    "SimulatedCluster",
    "alive_nodes",
    "free_port",
    "replica_states",
    "session_pids",
    "worker_types",
]
