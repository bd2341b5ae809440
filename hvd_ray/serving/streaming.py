"""A request's call to the model replica, turned into OpenAI responses: the streaming call under its
deadlines (the first token within ``first_token_timeout_s`` of arrival, else a 503 with
``Retry-After``; the whole request within ``request_timeout_s``, else a 504 or an error event ending
the stream), the replica's events collected into one response or relayed as server-sent events, and
a failed call answered with the right 5xx. When the client goes away, Serve cancels the request; the
``finally`` blocks cancel the replica call, whose generator then aborts the request in the engine
(its KV-cache slot is freed at the next step)."""

import asyncio
import json
import logging

from ray.serve.handle import DeploymentHandle

from . import protocol as P
from . import tools
from .config import ServingConfig

logger = logging.getLogger("ray.serve")


def replica_failed(e: BaseException, retry_after_s: int = 5) -> P.APIError:
    """The replica call raised: a full queue is a 503 with Retry-After; a replica that died or became
    unreachable is a clean 503 to retry; an exception inside its code (a bug) is a 500."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

    if isinstance(e, BackPressureError):
        return P.overloaded("the server is at capacity (its request queue is full); retry later", retry_after_s)
    logger.warning("model replica call failed: %r", e)
    if isinstance(e, (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError)):
        return P.APIError(
            503,
            f"the model replica failed while serving this request ({type(e).__name__}); retry it",
            "server_error",
            None,
            "replica_unavailable",
            {"Retry-After": str(int(retry_after_s))},
        )
    return P.APIError(
        500, f"the model replica failed on this request ({type(e).__name__})", "server_error", None, "replica_error"
    )


def cancel(gen) -> None:
    """Cancel a replica call; a call that already failed re-raises its error here, which must not
    replace the error being answered."""
    try:
        gen.cancel()
    except Exception:  # noqa: BLE001
        pass


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _cached(finish: dict) -> int | None:
    """Prompt tokens the replica did not prefill (prefix reuse), when its engine reports them."""
    return (finish.get("stats") or {}).get("cached_tokens")


def usage(finishes: list[dict]) -> dict:
    """One prompt, the choices' completion tokens summed (as OpenAI counts ``n`` choices)."""
    first = finishes[0]
    return P.usage(first["prompt_tokens"], sum(f["completion_tokens"] for f in finishes), _cached(first))


async def _next(gen, deadline: float, what: str, cfg: ServingConfig):
    """The replica stream's next event by ``deadline`` (event-loop time), else the shed error:
    a 503 with Retry-After before the first token, a 504 after it."""
    try:
        return await asyncio.wait_for(gen.__anext__(), max(0.0, deadline - asyncio.get_running_loop().time()))
    except TimeoutError:
        cancel(gen)  # the replica's generator aborts the request in the engine
        if what == "first token":
            raise P.overloaded(
                f"no first token within {cfg.first_token_timeout_s:g} s of arrival (the "
                "server is overloaded); retry later",
                cfg.retry_after_s,
                "first_token_timeout",
            ) from None
        raise P.APIError(
            504,
            f"the request did not finish within {cfg.request_timeout_s:g} s",
            "server_error",
            None,
            "request_timeout",
        ) from None


async def start(replica: DeploymentHandle, payload: dict, arrived: float, cfg: ServingConfig):
    """Call the replica and wait for the request's first token (or its end) until the first-token
    deadline; return (response generator, the events so far) or raise APIError."""
    deadline = arrived + cfg.first_token_timeout_s
    head: list[dict] = []
    gen = None
    try:
        gen = replica.options(stream=True).generate.remote(payload)  # a full queue raises here
        while not head or head[-1]["type"] == "start":
            ev = await _next(gen, deadline, "first token", cfg)
            if ev["type"] == "error":
                raise P.APIError(
                    ev.get("status", 500),
                    ev["message"],
                    ev.get("error_type", "invalid_request_error" if ev.get("status", 500) < 500 else "server_error"),
                    ev.get("param"),
                    ev.get("code"),
                )
            head.append(ev)
    except (Exception, asyncio.CancelledError) as e:
        if gen is not None:
            cancel(gen)
        if isinstance(e, (asyncio.CancelledError, P.APIError)):
            raise
        if isinstance(e, StopAsyncIteration):
            raise P.APIError(500, "the model replica ended the request without finishing it", "server_error") from None
        raise replica_failed(e, cfg.retry_after_s) from None
    return gen, head


async def _events(gen, head: list[dict], deadline: float, cfg: ServingConfig):
    """The request's events (``head`` first) until its finish, each by the request deadline."""
    for ev in head:
        if ev["type"] != "start":
            yield ev
    while True:
        try:
            ev = await _next(gen, deadline, "finish", cfg)
        except StopAsyncIteration:
            return
        yield ev


async def collect(gen, head: list[dict], deadline: float, cfg: ServingConfig) -> list[tuple[str, list, dict]]:
    """(text, logprob entries, finish event) of each choice, in index order."""
    n = head[0].get("n", 1)
    parts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list] = [[] for _ in range(n)]
    finish: list[dict | None] = [None] * n
    done = False
    try:
        async for ev in _events(gen, head, deadline, cfg):
            i = ev.get("index", 0)
            if ev["type"] == "delta":
                parts[i].append(ev["text"])
                logprobs[i] += ev.get("logprobs") or ()
            elif ev["type"] == "finish":
                finish[i] = ev
                done = all(f is not None for f in finish)
            elif ev["type"] == "error":
                done = True
                raise P.APIError(
                    ev.get("status", 500),
                    ev["message"],
                    ev.get("error_type", "server_error"),
                    ev.get("param"),
                    ev.get("code"),
                )
    except (P.APIError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 - the replica died mid-request
        raise replica_failed(e, cfg.retry_after_s) from None
    finally:
        if not done:
            cancel(gen)
    if not done:
        raise P.APIError(500, "the model replica ended the request without finishing it", "server_error")
    return [("".join(p), lp, f) for p, lp, f in zip(parts, logprobs, finish)]


async def stream(
    gen,
    head: list[dict],
    deadline: float,
    cfg: ServingConfig,
    kind: str,
    include_usage: bool,
    parallel_tools: bool | None,
    logprobs: bool,
):
    """Server-sent events of one request, each choice's chunks with its ``index``; with tools
    (``parallel_tools`` not None) a choice's content streams until a tool call may begin, and its
    calls come whole before its finish chunk; usage (when asked for) once all choices finished."""
    rid = P.new_id("chatcmpl" if kind == "chat" else "cmpl")
    created, model = P.now(), cfg.model_id
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    n = head[0].get("n", 1)
    split = [tools.StreamSplitter() if parallel_tools is not None else None for _ in range(n)]
    offset = [0] * n  # characters of each choice's logprob tokens so far (completions' text_offset)

    def chunk(i: int, text: str | None, finish: str | None, role: bool = False, delta=None, lps=None) -> dict:
        if kind == "chat":
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            c = P.chat_chunk(rid, model, created, delta, finish, i, P.chat_logprobs(lps) if lps is not None else None)
        else:
            c = P.completion_chunk(
                rid,
                model,
                created,
                text or "",
                finish,
                i,
                P.completion_logprobs(lps, offset[i]) if lps is not None else None,
            )
            offset[i] += sum(len(e[0]) for e in lps or ())
        if include_usage:
            c["usage"] = None
        return c

    done, finished = False, {}
    try:
        if kind == "chat":
            for i in range(n):
                yield sse(chunk(i, None, None, role=True))
        try:
            async for ev in _events(gen, head, deadline, cfg):
                i = ev.get("index", 0)
                if ev["type"] == "delta":
                    text = split[i].push(ev["text"]) if split[i] else ev["text"]
                    lps = ev.get("logprobs") if logprobs else None
                    if text or lps:
                        yield sse(chunk(i, text, None, lps=lps))
                elif ev["type"] == "finish":
                    finished[i] = ev
                    finish = ev["finish_reason"]
                    if split[i]:
                        rest, calls = split[i].finish(parallel_tools)
                        if rest:
                            yield sse(chunk(i, rest, None))
                        if calls:
                            finish = "tool_calls"
                            yield sse(chunk(i, None, None, delta=P.tool_call_deltas(calls)))
                    yield sse(chunk(i, None, finish))
                    if len(finished) == n:
                        done = True
                        if include_usage:
                            use = usage([finished[k] for k in range(n)])
                            yield sse(P.usage_chunk(rid, model, created, obj, use))
                elif ev["type"] == "error":
                    done = True
                    yield sse(
                        P.error_body(
                            ev["message"], ev.get("error_type", "server_error"), ev.get("param"), ev.get("code")
                        )
                    )
        except P.APIError as e:  # the request deadline: say so, then end the stream
            done = True
            yield sse(e.body())
        except Exception as e:  # noqa: BLE001 - the replica died mid-stream: say so, then end the stream
            done = True
            yield sse(replica_failed(e, cfg.retry_after_s).body())
        yield "data: [DONE]\n\n"
    finally:
        if not done:  # client disconnected (or we failed): stop generating for it
            cancel(gen)
