"""The model replica's engine loop: one thread that owns the Engine and steps it.

Continuous batching at step granularity: the engine loop thread is the only code that touches the
Engine. Requests arrive through a thread-safe inbox that the loop drains between steps (new
requests join, aborted ones leave), and every ``StepOutput`` is handed to the owning request's
asyncio queue with ``loop.call_soon_threadsafe``. torch releases the GIL inside its ops, so the
replica's event loop keeps serving (tokenising, detokenising, streaming) while a step runs.

Failures: a request the engine fails alone (its drafting, sampling or verification raised) gets a
500 error event and the loop goes on. If the loop itself fails (the shared target forward raised,
so the KV cache's state is unknown) every request in flight or queued gets a 500 event at once,
new ones are refused, and the replica's ``check_health`` fails. A loop that stops making progress
(a step or a drafter call that never returns) shows in its heartbeat (``stalled_s``), beaten
between steps and while idle.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

from .metrics import ReplicaMetrics

logger = logging.getLogger("ray.serve")


@dataclass
class Stream:
    """Where a request's events go: its asyncio queue, on the event loop that awaits it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int = 0  # the choice this engine request is (the queue may be shared by a request's n choices)


def deliver(stream: Stream, payload: dict) -> None:
    """Hand an event to a request's queue from the engine's thread."""
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, {**payload, "index": stream.index})
    except RuntimeError:  # the request's event loop is gone
        pass


def _merged(first: dict, then: dict) -> dict:
    """Two token events of one request as one (``then``'s finish fields)."""
    lps = None if first["logprobs"] is None or then["logprobs"] is None else first["logprobs"] + then["logprobs"]
    return {**then, "tokens": first["tokens"] + then["tokens"], "logprobs": lps}


def engine_failure(e: BaseException) -> dict:
    """The event every request in flight gets when its engine fails (its state is unknown)."""
    return {
        "type": "error",
        "status": 500,
        "message": f"engine failure: {e!r}",
        "error_type": "server_error",
        "code": "engine_failure",
    }


class EngineLoop:
    """Owns an Engine and runs ``step()`` on one thread while any request is unfinished."""

    def __init__(self, engine, metrics: ReplicaMetrics | None = None, stream_interval: int = 1):
        self.engine = engine
        self.metrics = metrics
        self.stream_interval = stream_interval
        self._held: dict[str, dict] = {}  # req_id -> tokens not yet delivered (stream_interval > 1)
        self._started: set[str] = set()  # req_ids whose first tokens went out
        self._inbox: deque = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._reqs: dict[str, tuple] = {}  # req_id -> (engine Request, Stream)
        self._stop = False
        self.error: BaseException | None = None
        # cumulative figures (read by stats(); written by the loop thread only)
        self.decode_tokens = 0
        self.decode_steps = 0
        self.cache_steps = 0  # decode steps that verified a suffix-cache draft
        self.prompt_tokens = self.cached_tokens = 0  # of finished requests; cached: K/V reused, not prefilled
        self.finished = 0
        self.aborted = 0
        self.failed = 0  # requests the engine failed alone (their error events were sent)
        self.steps = 0
        self.decode_s = 0.0  # time inside engine.step()
        self.prefill_s = 0.0  # of it, the prefill forwards of finished requests
        self.beat = time.monotonic()  # the loop's heartbeat: set between steps and on every idle turn
        self._thread = threading.Thread(target=self._run, name="hvd-engine-loop", daemon=True)
        self._thread.start()

    # ---- called from the event loop
    def submit(self, prompt_ids: list[int], params, req_id: str, stream: Stream) -> None:
        self._post(("add", prompt_ids, params, req_id, stream))

    def abort(self, req_id: str) -> None:
        self._post(("abort", req_id))

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()

    def _post(self, item) -> None:
        with self._lock:  # the same lock as _die: nothing is queued after the loop has failed
            if self.error is not None:
                raise RuntimeError(f"the engine loop failed: {self.error!r}")
            self._inbox.append(item)
        self._wake.set()

    def stats(self) -> dict:
        eng = self.engine
        return {
            "waiting": len(eng.waiting),
            "running": len(eng.running),
            "free_slots": len(eng.free_slots),
            "slots": eng.slots,
            "steps": self.steps,
            "finished": self.finished,
            "aborted": self.aborted,
            "failed": self.failed,
            "mean_accepted_per_forward": self.decode_tokens / self.decode_steps if self.decode_steps else 0.0,
            "cache_chosen_rate": self.cache_steps / self.decode_steps if self.decode_steps else 0.0,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_tokens,
            "prefill_s": self.prefill_s,
            "heartbeat_age_s": round(self.stalled_s(), 3),
            "healthy": self.error is None and self._thread.is_alive(),
        }

    def stalled_s(self) -> float:
        """Seconds since the loop last showed progress (a finished step, or an idle turn)."""
        return time.monotonic() - self.beat

    # ---- the loop thread
    def _drain(self) -> None:
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
        for item in items:
            if item[0] == "add":
                _, ids, params, req_id, stream = item
                try:
                    req = self.engine.add_request(ids, params, req_id)
                except Exception as e:  # noqa: BLE001 - validated before submit, but for the output's structure
                    param = "response_format" if params.structure is not None else None
                    deliver(stream, {"type": "error", "status": 400, "message": str(e), "param": param})
                    continue
                self._reqs[req_id] = (req, stream)
            else:
                req_id = item[1]
                self.engine.abort(req_id)
                entry = self._reqs.get(req_id)
                if entry is not None and entry[0].slot < 0:  # never admitted: gone without a StepOutput
                    del self._reqs[req_id]
                    self.aborted += 1

    def _run(self) -> None:
        try:
            while not self._stop:
                self.beat = time.monotonic()
                self._drain()
                if not self.engine.has_unfinished():
                    self._idle()
                    continue
                t0 = time.perf_counter()
                outs = self.engine.step()  # raises only when the shared forward failed
                self.beat = time.monotonic()
                self.decode_s += time.perf_counter() - t0
                self.steps += 1
                for out in outs:
                    self._dispatch(out)
                self._publish_queue()
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
            self._die(e)

    def _idle(self) -> None:
        for d in getattr(self.engine, "drafters", ()):  # e.g. sync with the suffix actor
            try:
                d.flush()
            except Exception:  # noqa: BLE001 - a background sync; the next idle turn retries
                logger.exception("drafter %s failed to flush", d.name)
        self._publish_queue()
        self.beat = time.monotonic()
        self._wake.wait(timeout=1.0)
        self._wake.clear()

    def _die(self, e: BaseException) -> None:
        """The engine's state is unknown: fail every request in flight or queued, refuse new ones
        (``_post``), and let ``check_health`` fail so Serve replaces this replica."""
        logger.error("engine loop failed; this replica is unhealthy:\n%s", traceback.format_exc())
        with self._lock:
            self.error = e
            queued, self._inbox = list(self._inbox), deque()
        streams = [entry[1] for entry in self._reqs.values()] + [it[4] for it in queued if it[0] == "add"]
        self._reqs.clear()
        self._held.clear()
        self._started.clear()
        for stream in streams:
            deliver(stream, engine_failure(e))

    def _dispatch(self, out) -> None:
        entry = self._reqs.get(out.req_id)
        if entry is None:
            return
        req, stream = entry
        if out.finish_reason == "error":  # the engine failed this request alone
            del self._reqs[out.req_id]
            self._held.pop(out.req_id, None)
            self._started.discard(out.req_id)
            self.failed += 1
            deliver(
                stream,
                {
                    "type": "error",
                    "status": 500,
                    "message": f"this request failed: {out.error}",
                    "error_type": "server_error",
                    "code": "request_failed",
                },
            )
            return
        payload = {
            "type": "tokens",
            "tokens": out.new_tokens,
            "finished": out.finished,
            "finish_reason": out.finish_reason,
            "logprobs": out.logprobs,
        }
        if not out.finished and self.stream_interval > 1 and not self._due(out.req_id, payload):
            return
        if out.finished:
            del self._reqs[out.req_id]
            self._started.discard(out.req_id)
            held = self._held.pop(out.req_id, None)
            if held is not None:
                payload = _merged(held, payload)
            if out.finish_reason != "abort":
                summary = req.stats.summary(len(req.output))
                payload["stats"] = summary
                n_steps = len(req.stats.steps)
                self.decode_steps += n_steps
                self.decode_tokens += sum(s.accepted + 1 for s in req.stats.steps)
                self.cache_steps += sum(s.source.startswith("suffix") for s in req.stats.steps)
                self.prompt_tokens += len(req.prompt)
                self.cached_tokens += req.stats.cached_tokens
                self.prefill_s += req.stats.prefill_s
                if self.metrics:
                    self.metrics.forwards.inc(summary["target_forwards"])
                    if self.decode_steps:
                        self.metrics.cache_rate.set(self.cache_steps / self.decode_steps)
                    for outcome in ("accepted", "regenerated", "escalated"):
                        if summary.get(f"slim_{outcome}"):
                            self.metrics.slim.inc(summary[f"slim_{outcome}"], tags={"outcome": outcome})
                    if self.decode_steps:
                        self.metrics.mat.set(self.decode_tokens / self.decode_steps)
            if out.finish_reason == "abort":
                self.aborted += 1
            else:
                self.finished += 1
        deliver(stream, payload)

    def _due(self, req_id: str, payload: dict) -> bool:
        """Whether ``payload`` goes out now: a request's first tokens at once, then every
        ``stream_interval`` tokens (the finish always: ``_dispatch``); else it is held."""
        if req_id not in self._started:
            if payload["tokens"]:
                self._started.add(req_id)
            return True
        held = self._held.pop(req_id, None)
        merged = payload if held is None else _merged(held, payload)
        if len(merged["tokens"]) >= self.stream_interval:
            payload.update(merged)
            return True
        self._held[req_id] = merged
        return False

    def _publish_queue(self) -> None:
        if self.metrics:
            self.metrics.waiting.set(len(self.engine.waiting))
            self.metrics.running.set(sum(1 for r in self.engine.running if not r.finished))
