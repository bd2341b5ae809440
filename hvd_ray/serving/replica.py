"""The model replica: one target model + Engine, driven by a background thread.

Continuous batching at step granularity: the engine loop thread is the only code that touches the
Engine. Requests arrive through a thread-safe inbox that the loop drains between steps (new
requests join, aborted ones leave), and every ``StepOutput`` is handed to the owning request's
asyncio queue with ``loop.call_soon_threadsafe``. torch releases the GIL inside its ops, so the
replica's event loop keeps serving (tokenising, detokenising, streaming) while a step runs.

``generate`` is an async generator (called through a streaming DeploymentHandle) yielding plain
dicts, first ``{"type": "start", ...}`` or ``{"type": "error", ...}``, then ``delta`` events and a
``finish`` event per choice (``index``: a request with ``n`` choices runs ``n`` engine requests on
one prompt, their events interleaved). Errors are events rather than exceptions so their status and
message cross the handle intact.

The request path around the loop (tokenising, validation, params, stop strings, streaming,
metrics) is ``ReplicaFront``'s.

Failures: a request the engine fails alone (its drafting, sampling or verification raised) gets a
500 error event and the loop goes on. If the loop itself fails (the shared target forward raised,
so the KV cache's state is unknown) every request in flight or queued gets a 500 event at once,
new ones a 503, ``check_health`` fails and Serve replaces the replica. A loop that stops making
progress (a step or a drafter call that never returns) is caught the same way: the loop beats a
heartbeat between steps and while idle, and ``check_health`` fails once it is older than
``step_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import psutil
from ray import serve

from ..engine.text import TextStreamer
from . import tools
from .config import ServingConfig

logger = logging.getLogger("ray.serve")


# ------------------------------------------------------------------------------------ metrics
class _Metrics:
    """A few real Serve metrics (Prometheus via Ray's metrics agent), tagged per replica by Serve."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.requests = metrics.Counter(
            "hvd_requests_total", "Finished generation requests.", tag_keys=("finish_reason",)
        )
        self.tokens = metrics.Counter("hvd_generated_tokens_total", "Generated (completion) tokens.")
        self.forwards = metrics.Counter("hvd_target_forwards_total", "Target forwards (prefill included).")
        self.ttft = metrics.Histogram(
            "hvd_time_to_first_token_seconds",
            "Time from arrival to the first token.",
            boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30],
        )
        self.mat = metrics.Gauge(
            "hvd_mean_accepted_tokens_per_forward",
            "Mean tokens emitted per decoding target forward since the replica started.",
        )
        self.cache_rate = metrics.Gauge(
            "hvd_cache_chosen_rate",
            "Share of decode steps that verified a suffix-cache draft, since the replica started.",
        )
        self.slim = metrics.Counter(
            "hvd_slim_tokens_total", "VIA-SD slim-tier outcomes per draft token.", tag_keys=("outcome",)
        )
        self.waiting = metrics.Gauge("hvd_queue_length", "Requests waiting for a KV-cache slot.")
        self.running = metrics.Gauge("hvd_running_requests", "Requests holding a KV-cache slot.")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int = 0  # the choice this engine request is (the queue may be shared by a request's n choices)


def deliver(stream: _Stream, payload: dict) -> None:
    """Hand an event to a request's queue from the engine's thread."""
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, {**payload, "index": stream.index})
    except RuntimeError:  # the request's event loop is gone
        pass


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

    def __init__(self, engine, metrics: _Metrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self._inbox: deque = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._reqs: dict[str, tuple] = {}  # req_id -> (engine Request, _Stream)
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
    def submit(self, prompt_ids: list[int], params, req_id: str, stream: _Stream) -> None:
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
        for stream in streams:
            deliver(stream, engine_failure(e))

    def _dispatch(self, out) -> None:
        entry = self._reqs.get(out.req_id)
        if entry is None:
            return
        req, stream = entry
        if out.finish_reason == "error":  # the engine failed this request alone
            del self._reqs[out.req_id]
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
        if out.finished:
            del self._reqs[out.req_id]
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

    def _publish_queue(self) -> None:
        if self.metrics:
            self.metrics.waiting.set(len(self.engine.waiting))
            self.metrics.running.set(sum(1 for r in self.engine.running if not r.finished))


# ------------------------------------------------------------------------------ the deployments
class ReplicaFront:
    """What every model replica does around its engine loop: tokenise and validate a request, parse
    its params, stream its events (``generate``), count it, report health. A subclass sets ``cfg``,
    ``tok``, ``loop`` (``submit`` / ``abort`` / ``shutdown``, ``error``, ``_thread``), ``metrics``,
    ``max_len`` (context per request), ``reserved`` (tokens a request must leave free past its
    output: the engine's draft room) and ``vocab_size``; :class:`ModelReplica` runs hvd-ray's
    engine."""

    cfg: ServingConfig
    loop: Any
    metrics: _Metrics | None = None
    max_len: int
    reserved: int = 0
    vocab_size: int

    def _start_metrics(self) -> None:
        try:
            self.metrics = _Metrics()
        except Exception:  # noqa: BLE001 - metrics must never keep a replica from serving
            logger.warning("metrics disabled:\n%s", traceback.format_exc())
            self.metrics = None

    # ---- Serve hooks
    def check_health(self) -> None:
        """Serve's health check, from state the loop publishes (never a call into the engine)."""
        if self.loop.error is not None or not self.loop._thread.is_alive():
            raise RuntimeError(f"engine loop is not running: {self.loop.error!r}")
        stalled = self.loop.stalled_s()
        if stalled > self.cfg.step_timeout_s:
            logger.error(
                "engine loop made no progress for %.0f s (step_timeout_s %g): unhealthy",
                stalled,
                self.cfg.step_timeout_s,
            )
            raise RuntimeError(f"engine loop made no progress for {stalled:.0f} s")

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown()

    # ---- the request path (called by the ingress)
    def _tokenize(self, req: dict) -> tuple[list[int], str, dict | None]:
        """(prompt ids, the parameter they came from, the structure tool calls must follow or None)."""
        if req.get("messages") is not None:
            try:
                text, structure = tools.render(
                    self.tok,
                    req["messages"],
                    req.get("tools"),
                    req.get("tool_choice"),
                    req.get("template_kwargs"),
                    req.get("parallel_tool_calls", True),
                )
            except Exception as e:  # noqa: BLE001 - a template rejecting the conversation is a client error
                raise _ClientError(f"the chat template rejected the messages: {e}", "messages") from e
            return self.tok(text, add_special_tokens=False)["input_ids"], "messages", structure
        if req.get("prompt_token_ids") is not None:
            ids = list(req["prompt_token_ids"])
            vocab = self.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise _ClientError(f"prompt token ids must be in [0, {vocab})", "prompt")
            return ids, "prompt", None
        return self.tok(req["prompt"])["input_ids"], "prompt", None

    def _params(self, req: dict, n_prompt: int, param: str, structure: dict | None = None):
        from ..engine import SamplingParams

        sp = dict(req["params"])
        room = self.max_len - n_prompt - self.reserved - 1
        if room < 1:
            raise _ClientError(
                f"the prompt is {n_prompt} tokens, which leaves no room to generate in this "
                f"model's context of {self.max_len} tokens",
                param,
                code="context_length_exceeded",
            )
        if sp["max_tokens"] is None:
            sp["max_tokens"] = min(self.cfg.max_tokens, room)
        elif sp["max_tokens"] > room:
            raise _ClientError(
                f"the prompt ({n_prompt} tokens) + max_tokens ({sp['max_tokens']}) exceeds this "
                f"model's context of {self.max_len} tokens (at most {room} new tokens "
                "fit)",
                "max_tokens",
                code="context_length_exceeded",
            )
        if any(not 0 <= t < self.vocab_size for t in sp.get("logit_bias") or ()):
            raise _ClientError(f"logit_bias token ids must be in [0, {self.vocab_size})", "logit_bias")
        if structure is not None:
            sp["structure"] = structure
        try:
            return SamplingParams(**sp)
        except (TypeError, ValueError) as e:  # messages start with the field's name
            name = str(e).split(" ", 1)[0]
            raise _ClientError(str(e), name if name in sp else None) from e

    @staticmethod
    def _choices(params, n: int) -> list:
        """The params of each of ``n`` choices: with a seed, choice i samples with seed + i, so the
        choices differ and the request stays reproducible."""
        if n == 1 or params.seed is None:
            return [params] * n
        return [dataclasses.replace(params, seed=(params.seed + i) % 2**63) for i in range(n)]

    def _token_text(self, token: int) -> str:
        """A token's own text (``tok.decode([token])``, as vLLM names logprob tokens), cached."""
        texts = self.__dict__.setdefault("_texts", {})
        text = texts.get(token)
        if text is None:
            text = texts[token] = self.tok.decode([token])
        return text

    async def generate(self, req: dict):
        """Stream one request: start|error, then delta events and one finish event per choice."""
        t0 = time.perf_counter()
        try:
            ids, param, structure = self._tokenize(req)
            if not ids:
                raise _ClientError("the prompt is empty", param)
            params = self._params(req, len(ids), param, structure)
        except _ClientError as e:
            yield {"type": "error", "status": 400, "message": e.message, "param": e.param, "code": e.code}
            return
        n = int(req.get("n") or 1)
        base = req.get("request_id") or uuid.uuid4().hex
        rids = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]
        queue: asyncio.Queue = asyncio.Queue()
        choices = [_Choice(p, self.tok, self._token_text) for p in self._choices(params, n)]
        live: set[int] = set()  # choices whose engine request may still run
        try:
            for i, (rid, choice) in enumerate(zip(rids, choices)):
                self.loop.submit(ids, choice.params, rid, _Stream(asyncio.get_running_loop(), queue, i))
                live.add(i)
        except RuntimeError as e:  # the engine loop failed (then it has failed the ones submitted too)
            yield {"type": "error", "status": 503, "message": str(e), "error_type": "server_error"}
            return
        yield {"type": "start", "prompt_tokens": len(ids), "n": n}
        first = True
        try:
            while live:
                ev = await queue.get()
                i = ev["index"]
                if i not in live:  # the last event of a choice a stop string ended here
                    continue
                if ev["type"] == "error":  # one choice failing fails the request; finally aborts the rest
                    live.discard(i)
                    if structure is not None and ev.get("param") == "response_format":
                        ev = {**ev, "param": "tools"}  # the tools' schemas made the structure
                    yield ev
                    return
                if first and ev["tokens"]:
                    first = False
                    if self.metrics:
                        self.metrics.ttft.observe(max(time.perf_counter() - t0, 0.0))
                choice = choices[i]
                piece, logprobs = choice.push(ev["tokens"], ev.get("logprobs"))
                finish = ev["finish_reason"] if ev["finished"] else None
                if choice.text.stopped:
                    if not ev["finished"]:  # a stop string the engine's window missed: end it here
                        self.loop.abort(rids[i])
                    finish = "stop"
                if finish is not None and not choice.text.stopped:
                    piece += choice.text.flush()
                if piece or logprobs:
                    delta = {"type": "delta", "index": i, "text": piece}
                    if logprobs is not None:
                        delta["logprobs"] = logprobs
                    yield delta
                if finish is not None:
                    live.discard(i)
                    self._count(choice.n_out, finish)
                    yield {
                        "type": "finish",
                        "index": i,
                        "finish_reason": finish,
                        "prompt_tokens": len(ids),
                        "completion_tokens": choice.n_out,
                        "stats": ev.get("stats"),
                    }
        finally:
            for i in live:  # client went away (generator closed / cancelled), or a choice failed: free the slots
                with contextlib.suppress(RuntimeError):  # the engine loop failed: nothing runs any more
                    self.loop.abort(rids[i])
                self._count(choices[i].n_out, "abort")

    def _count(self, n_out: int, finish: str) -> None:
        """Per-request metrics; they must never fail the request (a Counter refuses inc(0))."""
        if self.metrics is None:
            return
        try:
            if n_out:
                self.metrics.tokens.inc(n_out)
            self.metrics.requests.inc(tags={"finish_reason": finish})
        except Exception:  # noqa: BLE001
            logger.exception("metrics update failed")


@serve.deployment(name="ModelReplica", max_ongoing_requests=8, health_check_period_s=2)
class ModelReplica(ReplicaFront):
    """Holds the target model and an Engine with the configured drafter."""

    def __init__(self, config: dict):
        cfg = ServingConfig.model_validate(config)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch

        from ..build import build_engine
        from ..model import load

        torch.set_num_threads(cfg.threads())
        self.cfg = cfg
        if cfg.tensor_parallel_size > 1:  # the model lives sharded in rank actors (tensor_parallel.py)
            from .tensor_parallel import TensorParallelEngine

            self.engine = TensorParallelEngine.from_serving_config(cfg)
            self.model, self.tok = self.engine.model, self.engine.tokenizer
        else:
            self.model, self.tok = load(cfg.model, cfg.dtype, cfg.device)
            self.engine = build_engine(cfg.engine_spec(), self.model, self.tok, suffix_cache=self._suffix_cache(cfg))
        self.max_len, self.reserved = self.engine.max_len, self.engine.num_draft_tokens
        self.vocab_size = self.model.cfg.vocab_size
        self._start_metrics()
        self.loop = EngineLoop(self.engine, self.metrics)
        logger.info(
            "ModelReplica ready: model=%s dtype=%s drafter=%s max_batch=%d max_len=%d threads=%d",
            cfg.model,
            cfg.dtype,
            cfg.drafter,
            cfg.max_batch,
            self.engine.max_len,
            torch.get_num_threads(),
        )

    @staticmethod
    def _suffix_cache(cfg: ServingConfig):
        """The shared suffix actor's proxy for the engine's suffix drafter (None: an in-process one).
        The actor warms its own trees with ``suffix_history``; the engine builder warms a mirror's."""
        if not (cfg.suffix_actor and cfg.drafter in ("suffix", "hvd")):
            return None
        from ..selection.hvd import suffix_config
        from .suffix_actor import MirroredSuffixDrafter, RemoteSuffixDrafter, service_actor

        conf = suffix_config(cfg.policy if cfg.drafter == "hvd" else "none")
        actor = service_actor(
            cfg.suffix_actor_name, config=dataclasses.asdict(conf), history=cfg.suffix_history, model=cfg.model
        )
        if cfg.suffix_actor_mode == "mirror":
            return MirroredSuffixDrafter(actor, conf)
        return RemoteSuffixDrafter(actor, config=conf)

    # ---- methods called by the ingress
    def info(self) -> dict:
        return {
            "model": self.cfg.model_id,
            "max_model_len": self.engine.max_len,
            "max_tokens": self.cfg.max_tokens,
            "drafter": self.cfg.drafter,
            "dtype": self.cfg.dtype,
            "policy": self.cfg.policy if self.cfg.drafter == "hvd" else None,
            "slim": self.cfg.slim,
            "slim_mode": self.cfg.slim_mode if self.cfg.slim else None,
        }

    def stats(self) -> dict:
        """Engine-loop figures plus per-drafter state (live requests it tracks, actor wait time)."""
        out = self.loop.stats()
        drafters = getattr(self.engine, "drafters", [])
        out["drafters"] = {d.name: d.stats() for d in drafters}
        out["live_drafter_requests"] = sum(d.live_requests() for d in drafters)
        out["decode_s"] = self.loop.decode_s
        out["decode_steps"], out["decode_tokens"] = self.loop.decode_steps, self.loop.decode_tokens
        check = getattr(self.engine, "check", None)  # under a cost policy: how batches draft (costs.py)
        out["speculation"] = check.summary() if check is not None else None
        out["rss_bytes"] = psutil.Process().memory_info().rss  # leak checks under load (bench/load.py)
        return out


class _Choice:
    """One choice of a request as its tokens arrive: its text (stop strings cut it) and, when asked
    for, its tokens' log-probabilities as ``[token text, logprob, [[text, logprob], ...top k]]``."""

    def __init__(self, params, tok, token_text):
        self.params = params
        self.text = TextStreamer(tok, params.stop)
        self.token_text = token_text
        self.n_out = 0  # tokens taken: up to the one that completed a stop string

    def push(self, tokens: list[int], logprobs: list | None) -> tuple[str, list | None]:
        """(the text to send, the taken tokens' log-probabilities or None); with stop strings the
        tokens go one at a time, so those after a stop string are neither counted nor reported."""
        if self.params.stop:
            piece, taken = "", 0
            for t in tokens:
                piece += self.text.push([t])
                taken += 1
                if self.text.stopped:
                    break
        else:
            piece, taken = self.text.push(tokens), len(tokens)
        self.n_out += taken
        if self.params.logprobs is None:
            return piece, None
        name = self.token_text
        return piece, [
            [name(t), _finite(lp), [[name(c), _finite(clp)] for c, clp in top]]
            for t, (lp, top) in zip(tokens[:taken], logprobs or ())
        ]


def _finite(logprob: float) -> float:
    """A log-probability JSON can carry (as vLLM: -inf becomes -9999)."""
    return max(float(logprob), -9999.0)


class _ClientError(Exception):
    def __init__(self, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
