"""The model replica's request path around its engine loop (``ReplicaFront``): tokenise and validate a
request, parse its params, stream its events, count it, report health.

``generate`` is an async generator (called through a streaming DeploymentHandle) yielding plain
dicts, first ``{"type": "start", ...}`` or ``{"type": "error", ...}``, then ``delta`` events and a
``finish`` event per choice (``index``: a request with ``n`` choices runs ``n`` engine requests on
one prompt, their events interleaved). Errors are events rather than exceptions so their status and
message cross the handle intact.

Health: ``check_health`` fails once the engine loop has failed (Serve then replaces the replica) or
made no progress for ``step_timeout_s`` (its heartbeat is older).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import traceback
import uuid
from typing import Any

from ..engine.text import TextStreamer
from . import tools
from .config import ServingConfig
from .engine_loop import Stream
from .metrics import ReplicaMetrics

logger = logging.getLogger("ray.serve")


class ReplicaFront:
    """What every model replica does around its engine loop: tokenise and validate a request, parse
    its params, stream its events (``generate``), count it, report health. A subclass sets ``cfg``,
    ``tok``, ``loop`` (``submit`` / ``abort`` / ``shutdown``, ``error``, ``_thread``), ``metrics``,
    ``max_len`` (context per request), ``reserved`` (tokens a request must leave free past its
    output: the engine's draft room) and ``vocab_size``; :class:`~hvd_ray.serving.replica.ModelReplica`
    runs hvd-ray's engine."""

    cfg: ServingConfig
    loop: Any
    metrics: ReplicaMetrics | None = None
    max_len: int
    reserved: int = 0
    vocab_size: int

    def _start_metrics(self) -> None:
        try:
            self.metrics = ReplicaMetrics()
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
                raise ClientError(f"the chat template rejected the messages: {e}", "messages") from e
            return self.tok(text, add_special_tokens=False)["input_ids"], "messages", structure
        if req.get("prompt_token_ids") is not None:
            ids = list(req["prompt_token_ids"])
            vocab = self.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise ClientError(f"prompt token ids must be in [0, {vocab})", "prompt")
            return ids, "prompt", None
        return self.tok(req["prompt"])["input_ids"], "prompt", None

    def _params(self, req: dict, n_prompt: int, param: str, structure: dict | None = None):
        from ..engine import SamplingParams

        sp = dict(req["params"])
        room = self.max_len - n_prompt - self.reserved - 1
        if room < 1:
            raise ClientError(
                f"the prompt is {n_prompt} tokens, which leaves no room to generate in this "
                f"model's context of {self.max_len} tokens",
                param,
                code="context_length_exceeded",
            )
        if sp["max_tokens"] is None:
            sp["max_tokens"] = min(self.cfg.max_tokens, room)
        elif sp["max_tokens"] > room:
            raise ClientError(
                f"the prompt ({n_prompt} tokens) + max_tokens ({sp['max_tokens']}) exceeds this "
                f"model's context of {self.max_len} tokens (at most {room} new tokens "
                "fit)",
                "max_tokens",
                code="context_length_exceeded",
            )
        if any(not 0 <= t < self.vocab_size for t in sp.get("logit_bias") or ()):
            raise ClientError(f"logit_bias token ids must be in [0, {self.vocab_size})", "logit_bias")
        if structure is not None:
            sp["structure"] = structure
        try:
            return SamplingParams(**sp)
        except (TypeError, ValueError) as e:  # messages start with the field's name
            name = str(e).split(" ", 1)[0]
            raise ClientError(str(e), name if name in sp else None) from e

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
                raise ClientError("the prompt is empty", param)
            params = self._params(req, len(ids), param, structure)
        except ClientError as e:
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
                self.loop.submit(ids, choice.params, rid, Stream(asyncio.get_running_loop(), queue, i))
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


class ClientError(Exception):
    """A request the replica refuses with a 400 naming ``param`` (an error event, not an exception
    across the handle)."""

    def __init__(self, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
