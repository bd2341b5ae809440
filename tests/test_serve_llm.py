"""Ray Serve LLM (``ray.serve.llm:build_openai_app``) over vLLM with hvd-ray's plug-in: the shipped
``configs/serve_llm_hvd.yaml`` run by ``serve run`` on a Ray instance of its own and asked by the official
``openai`` client. Its interpreter is ``make serve-llm-env``'s overlay venv (the vLLM env + ray[serve]);
hvd-ray is not installed there: this checkout and the plug-in's entry point come through PYTHONPATH."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from test_vllm_serve import AGENT_TOOLS, TRIP  # the travel agent both served tests ask

SERVE_LLM_PYTHON = os.environ.get("HVD_SERVE_LLM_PYTHON", str(Path.home() / ".cache/hvd-peers/serve-llm/bin/python"))
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "serve_llm_hvd.yaml"


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (every process a ``start_new_session`` child starts, and theirs,
    unless one of them calls setsid: Ray's and vLLM's processes do not)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                pids.append(int(d.name))
    return pids


def alive(pids: list[int], wait: float = 10) -> list[int]:
    """The ``pids`` still running (zombies do not count) after up to ``wait`` s."""

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    end = time.monotonic() + wait
    while (left := [p for p in pids if running(p)]) and time.monotonic() < end:
        time.sleep(0.2)
    return left


def end_session(proc: subprocess.Popen, first: int, grace: float) -> list[int]:
    """Send ``first`` to ``proc``, wait ``grace`` s for its whole session to end, then SIGKILL what is left
    of that session; returns the pids that had to be killed."""
    if proc.poll() is None:
        proc.send_signal(first)
    end = time.monotonic() + grace
    while time.monotonic() < end and (proc.poll() is None or session_pids(proc.pid)):
        time.sleep(0.5)
    left = session_pids(proc.pid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    return left


def wait_for(what: str, check, proc: subprocess.Popen, log: Path, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"exited (rc {proc.returncode}) before {what}:\n{log.read_text()[-4000:]}"
        got = check()
        if got:
            return got
        time.sleep(1)
    raise AssertionError(f"no {what} within {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def http_get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode() if r.status == 200 else None
    except OSError:
        return None


@pytest.mark.slow
@pytest.mark.skipif(not Path(SERVE_LLM_PYTHON).exists(), reason="no Ray Serve LLM interpreter (make serve-llm-env)")
def test_serve_run_of_the_ray_serve_llm_config_answers_the_openai_client(tmp_path, default_folder):
    """``serve run configs/serve_llm_hvd.yaml`` (model and port substituted) on a fresh ``ray start --head``
    (its own ports and temp dir): a greedy fp32 chat answer equals hvd-ray's own engine's greedy answer (twice,
    the second time with the first answer in the suffix cache), ``tool_choice="required"`` returns tool calls;
    the plug-in's method ``hvd`` ran in vLLM's worker and vLLM accepted drafts (its spec-decode counter, which
    Ray Serve LLM exports as a Ray metric). Everything started is stopped: Serve, then the head's session."""
    import openai
    import yaml
    from conftest import free_port
    from transformers import AutoTokenizer

    from hvd_ray.engine import Engine, SamplingParams
    from hvd_ray.model import load

    bin_dir = Path(SERVE_LLM_PYTHON).parent
    check = "import importlib.util as u; assert u.find_spec('vllm') and u.find_spec('ray.serve.llm')"
    probe = subprocess.run([SERVE_LLM_PYTHON, "-c", check], check=False, capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"the Ray Serve LLM interpreter lacks ray.serve.llm or vllm: {probe.stderr[-300:]}")

    cfg = yaml.safe_load(CONFIG.read_text())
    http_port = free_port()
    cfg["http_options"]["port"] = http_port
    llm = cfg["applications"][0]["args"]["llm_configs"][0]
    llm["model_loading_config"]["model_source"] = str(default_folder)
    # priced with the GPU-like table: the timed costs of a quiet 2-core box can make every draft look too
    # dear for these few requests, and the test needs drafts verified
    llm["engine_kwargs"]["speculative_config"]["hvd_policy"] = "static"
    model_id = llm["model_loading_config"]["model_id"]
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    # hvd-ray as an installed plug-in would be seen by vLLM: this checkout and a dist-info that declares the
    # entry point, on PYTHONPATH (Ray's workers and vLLM's processes inherit it)
    dist = tmp_path / "plugin" / "hvd_ray_vllm_plugin-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hvd-ray-vllm-plugin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nhvd = hvd_ray.vllm.plugin:register\n")
    child_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    child_env["PYTHONPATH"] = os.pathsep.join([str(dist.parent), str(ROOT)])
    child_env.update(
        HF_HUB_OFFLINE="1",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_metrics_report_interval_ms="2000",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
    )  # SIGTERM stops the head at once
    temp = tempfile.mkdtemp(prefix="hsl", dir="/tmp")  # short: Ray's socket paths live under it
    ports = {
        name: free_port()
        for name in (
            "port",
            "node-manager-port",
            "object-manager-port",
            "ray-client-server-port",
            "dashboard-port",
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "runtime-env-agent-port",
            "metrics-export-port",
        )
    }
    head_cmd = [
        str(bin_dir / "ray"),
        "start",
        "--head",
        "--block",
        f"--temp-dir={temp}",
        "--num-cpus=2",
        "--include-dashboard=false",
        "--disable-usage-stats",
        "--object-store-memory=200000000",
    ]
    head_cmd += [f"--{k}={v}" for k, v in ports.items()]
    head_log, serve_log = tmp_path / "ray-head.log", tmp_path / "serve-run.log"
    serve = None
    with open(head_log, "w") as f:
        head = subprocess.Popen(
            head_cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env, cwd=tmp_path, start_new_session=True
        )
    try:
        address = wait_for(
            "Ray head", lambda: re.search(r"ray start --address='([^']+)'", head_log.read_text()), head, head_log, 120
        ).group(1)
        with open(serve_log, "w") as f:
            serve = subprocess.Popen(
                [str(bin_dir / "serve"), "run", str(tmp_path / "serve.yaml"), "--address", address],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=child_env,
                cwd=tmp_path,
                start_new_session=True,
            )

        # meanwhile: hvd-ray's own engine, fp32 greedy, on the chat template's prompt
        tok = AutoTokenizer.from_pretrained(default_folder)
        msgs = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
        ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"
        ]
        model, _ = load(str(default_folder), "float32")
        out = Engine(model, max_batch=1, max_len=1024).generate([ids], SamplingParams(max_tokens=32))[0].output
        want = tok.decode(out, skip_special_tokens=True)
        del model

        base = f"http://127.0.0.1:{http_port}"
        wait_for("Serve LLM app", lambda: model_id in (http_get(base + "/v1/models") or ""), serve, serve_log, 300)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        for _ in range(2):  # the second answer verifies suffix-cache drafts of the first
            ch = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=32, temperature=0).choices[0]
            assert ch.message.content == want, (ch.message.content, want)
        ch = client.chat.completions.create(
            model=model_id, messages=TRIP, tools=AGENT_TOOLS, tool_choice="required", max_tokens=96, temperature=0
        ).choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        assert {c.function.name for c in ch.message.tool_calls} <= {"get_weather", "search_flights"}, ch

        def accepted() -> float:
            text = http_get(f"http://127.0.0.1:{ports['metrics-export-port']}/metrics") or ""
            return sum(
                float(v)
                for v in re.findall(
                    r"^ray_vllm_spec_decode_num_accepted_tokens(?:_total)?\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE
                )
            )

        n = wait_for("accepted drafts in Ray's metrics", accepted, head, head_log, 90)
        print(f"vLLM accepted {n:.0f} draft tokens")
        logs = [serve_log, *Path(temp).glob("session_*/logs/worker-*")]
        assert any("hvd-ray plug-in: method hvd" in p.read_text(errors="replace") for p in logs), serve_log.read_text()[
            -4000:
        ]
    finally:
        t = time.monotonic()
        left = end_session(serve, signal.SIGINT, 90) if serve else []  # serve run's Ctrl-C: serve.shutdown()
        left += end_session(head, signal.SIGTERM, 60)  # ray start --block: stops the head's processes
        print(f"stopped in {time.monotonic() - t:.0f} s; killed after the grace period: {left}")
        shutil.rmtree(temp, ignore_errors=True)
    # a straggler of the head's session (seen once: one process past the grace periods) is killed above, so
    # nothing outlives the test; the session's processes must be gone now
    assert not alive(left), f"processes still alive after the kill: {left}"
