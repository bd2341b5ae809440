"""The vLLM-backed model replica (``backend: vllm``): vLLM's engine with an hvd-ray proposer behind
the same OpenAI ingress.

vLLM lives in its own interpreter (``vllm_python``: vLLM's CPU build has its own virtualenv, without
Ray), so the replica runs it in a child process, ``traces/vllm_generate.py --serve``: vLLM's
``LLMEngine`` stepped while any request is unfinished, fed one JSON line per request or abort on
its stdin, answering one line per request and step with its new tokens. :class:`VllmLoop` is the
replica's side of that pipe, with the interface of the hvd-ray engine's
:class:`~hvd_ray.serving.replica.EngineLoop` (``submit`` / ``abort`` / ``error``), so everything
around it is shared with :class:`~hvd_ray.serving.replica.ModelReplica`: tokenising (chat template),
validation, params, stop strings, detokenising, streaming, metrics (``ReplicaFront``).

The proposer is named by class (``hvd_ray.vllm.HvdProposer``, ``vllm_method``), and vLLM imports it
in the child; this module imports nothing from vLLM nor ``hvd_ray.vllm``.

Failures: a request vLLM refuses gets a 400 event. If the child exits (a failed step, killed, out
of memory), every request in flight gets a 500 event at once, new ones a 503, ``check_health``
fails and Serve replaces the replica.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import psutil
from ray import serve

from .config import ServingConfig
from .replica import ReplicaFront, _Metrics, _Stream, deliver, engine_failure

logger = logging.getLogger("ray.serve")

# the child's script (run by path in the vLLM interpreter, never imported here)
CHILD = Path(__file__).resolve().parents[1] / "traces" / "vllm_generate.py"
PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")


class VllmLoop:
    """The replica's side of a vLLM child process (``command``): requests go out as JSON lines,
    a reader thread hands each answer line to its request's stream, and the child's exit fails
    every request in flight (``error`` is set, ``submit`` refuses)."""

    def __init__(self, command: list[str], env: dict | None = None, metrics: _Metrics | None = None):
        self.metrics = metrics
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM did not start (rc {self.proc.wait()}; its log is in this replica's log)")
        self.ready = json.loads(line)
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self.error: BaseException | None = None
        self.child: dict = {}  # the child's last counts (hvd-ray's worker extension)
        self.beat = time.monotonic()  # the last line from the child, or the last time it had nothing to do
        self.finished = self.aborted = self.failed = self.tokens = 0
        self._thread = threading.Thread(target=self._read, name="hvd-vllm-reader", daemon=True)
        self._thread.start()

    # ---- called from the event loop
    def submit(self, prompt_ids: list[int], params, req_id: str, stream: _Stream) -> None:
        ask = {"op": "add", "id": req_id, "ids": list(prompt_ids), "params": {k: getattr(params, k) for k in PARAMS}}
        with self._lock:  # the same lock as _die: nothing is sent after the child has gone
            if self.error is not None:
                raise RuntimeError(f"the vLLM process failed: {self.error}")
            self._streams[req_id] = stream
            try:
                self._send(ask)
            except OSError as e:
                del self._streams[req_id]
                raise RuntimeError(f"the vLLM process is gone ({e!r})") from None

    def abort(self, req_id: str) -> None:
        with self._lock:
            if self._streams.pop(req_id, None) is None or self.error is not None:
                return
            self.aborted += 1
            try:
                self._send({"op": "abort", "id": req_id})
            except OSError:  # the reader thread hears about the exit
                pass

    def _send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def shutdown(self, timeout: float = 10.0) -> None:
        """End the child: the end of its input aborts what it runs and ends it."""
        self._stop = True
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def stalled_s(self) -> float:
        """Seconds the child has said nothing while requests were in flight (0 when idle)."""
        if not self._streams:
            self.beat = time.monotonic()
        return time.monotonic() - self.beat

    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and self.proc.poll() is None

    def stats(self) -> dict:
        return {"backend": "vllm", "running": len(self._streams), "finished": self.finished, "aborted": self.aborted,
                "failed": self.failed, "generated_tokens": self.tokens, "healthy": self.healthy(),
                "vllm": {**self.child, "pid": self.proc.pid, "version": self.ready.get("version"),
                         "device": self.ready.get("device")}}

    # ---- the reader thread
    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                self.beat = time.monotonic()
                self._dispatch(json.loads(line))
            rc = self.proc.wait()
            raise RuntimeError(f"the vLLM process exited (rc {rc}; its log is in this replica's log)")
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
            self._die(e)

    def _dispatch(self, msg: dict) -> None:
        if "stats" in msg:
            if self.metrics and msg["stats"].get("forwards", 0) > self.child.get("forwards", 0):
                self.metrics.forwards.inc(msg["stats"]["forwards"] - self.child.get("forwards", 0))
            self.child = msg["stats"]
            return
        rid = msg["id"]
        with self._lock:
            stream = self._streams.get(rid)
            if stream is not None and ("error" in msg or msg["finished"]):
                del self._streams[rid]
        if stream is None:  # aborted meanwhile
            return
        if "error" in msg:
            self.failed += 1
            deliver(stream, {"type": "error", "status": 400, "message": f"vLLM refused this request: {msg['error']}"})
            return
        self.tokens += len(msg["tokens"])
        self.finished += bool(msg["finished"])
        deliver(stream, {"type": "tokens", "tokens": msg["tokens"], "finished": msg["finished"],
                         "finish_reason": msg["finish_reason"]})

    def _die(self, e: BaseException) -> None:
        if self._stop:
            logger.info("the vLLM process ended (replica shutting down)")
        else:
            logger.error("the vLLM process failed; this replica is unhealthy: %r", e)
        with self._lock:
            self.error = e
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            deliver(stream, engine_failure(e))


@serve.deployment(name="VllmReplica", max_ongoing_requests=8, health_check_period_s=2)
class VllmReplica(ReplicaFront):
    """vLLM's engine (``vllm_method``: hvd-ray's proposer by default) in a child process of the vLLM
    interpreter; the tokenizer, validation and streaming are the same as :class:`ModelReplica`'s."""

    def __init__(self, config: dict):
        cfg = ServingConfig.model_validate(config)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer

        from ..model import resolve
        from ..traces.collect import canonical_dtype, model_context
        from ..traces.vllm_generate import vllm_env

        self.cfg = cfg
        python = cfg.resolved_vllm_python()
        folder = resolve(cfg.model)
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.vocab_size = int(json.loads((folder / "config.json").read_text())["vocab_size"])
        self.max_len = min(cfg.max_model_len, model_context(folder))
        threads = cfg.threads()
        job = {"folder": str(folder), "dtype": canonical_dtype(cfg.dtype), "max_batch": cfg.max_batch,
               "max_model_len": self.max_len, "threads": threads,
               "speculative_config": cfg.vllm_speculative_config(), "engine_args": cfg.vllm_engine_args}
        env = vllm_env(python)
        env["OMP_NUM_THREADS"] = str(threads)  # torch_threads, not Ray's default of the actor's num_cpus
        self._start_metrics()
        self.loop = VllmLoop([python, str(CHILD), "--serve", json.dumps(job)], env=env, metrics=self.metrics)
        logger.info("VllmReplica ready: model=%s dtype=%s method=%s vllm=%s device=%s max_batch=%d max_len=%d",
                    cfg.model, cfg.dtype, cfg.vllm_method, self.loop.ready.get("version"),
                    self.loop.ready.get("device"), cfg.max_batch, self.max_len)

    def info(self) -> dict:
        return {"model": self.cfg.model_id, "max_model_len": self.max_len, "max_tokens": self.cfg.max_tokens,
                "backend": "vllm", "vllm_method": self.cfg.vllm_method, "dtype": self.cfg.dtype,
                "vllm": self.loop.ready.get("version"), "device": self.loop.ready.get("device")}

    def stats(self) -> dict:
        out = self.loop.stats()
        out["rss_bytes"] = psutil.Process().memory_info().rss  # the replica and its vLLM process
        try:
            out["rss_bytes"] += psutil.Process(self.loop.proc.pid).memory_info().rss
        except psutil.Error:  # gone
            pass
        return out
