"""The OpenAI-compatible HTTP ingress (FastAPI inside a Serve deployment).

Routes: ``GET /health``, ``GET /stats``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` as server-sent events). Every error, including
malformed JSON and wrong types, is answered with an OpenAI body
``{"error": {"message", "type", "param", "code"}}`` and a 4xx/5xx status.

The ingress does no model work: it validates, then calls the model replica through a streaming
``DeploymentHandle`` and turns the replica's events into OpenAI objects. When the client goes
away, Serve cancels this request; the ``finally`` blocks cancel the replica call, whose generator
then aborts the request in the engine (its KV-cache slot is freed at the next step).

Validation comes before any work and in order of cost: the API key, the body size (413 from
``Content-Length`` or while reading, before parsing), JSON, the request model's ranges, then the
prompt's size in characters (before the replica tokenises it). A replica that dies under a request
is answered with a 503 (or an error event on a stream), never a hang.

Overload and deadlines: the model replicas' queue is bounded (Serve's ``max_queued_requests`` at
this deployment's handle); past it a request gets a 503 with ``Retry-After`` at once. The body must
arrive within ``body_timeout_s`` (408), the first token within ``first_token_timeout_s`` of arrival
(else a 503 with ``Retry-After``: the request was shed, the engine drops it), the whole request within
``request_timeout_s`` (504, or an error event ending the stream). A stream's response starts with its
first token, so its status can still say "overloaded". ``/health`` answers from Serve's controller,
whose view comes from each replica's own ``check_health`` (the engine loop's published progress),
never by queueing behind generation.
"""

import asyncio
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol as P
from . import tools
from .config import ServingConfig

logger = logging.getLogger("ray.serve")
HEALTH_CACHE_S = 0.5  # /health answers from a controller status at most this old

# The docs routes are added below, behind the API key (FastAPI's own would serve them to anyone).
api = FastAPI(
    title="hvd-ray",
    description="OpenAI-compatible endpoint served by hvd-ray on Ray Serve",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
)


class _JSON(JSONResponse):
    """JSON with non-ASCII escaped: an error message quoting a client's lone surrogate still renders."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(e: P.APIError) -> JSONResponse:
    return _JSON(e.body(), status_code=e.status, headers=e.headers)


def _validation_error(errors: list[dict]) -> P.APIError:
    """A pydantic / FastAPI error list as one 400 with the first offending parameter named."""
    msgs, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return P.APIError(400, f"malformed JSON body: {err.get('msg', '')}".rstrip(": "), code="invalid_json")
        if err.get("type") == "extra_forbidden" and loc:
            return P.APIError(
                400, f"{'.'.join(loc)} is not supported by this server", param=loc[0], code="unsupported_parameter"
            )
        if param is None and loc:
            param = loc[0]
        msgs.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return P.APIError(400, "; ".join(msgs) or "invalid request", param=param, code="invalid_value")


@api.exception_handler(P.APIError)
async def _api_error(_: Request, e: P.APIError) -> JSONResponse:
    return _error_response(e)


@api.exception_handler(RequestValidationError)
async def _request_validation(_: Request, e: RequestValidationError) -> JSONResponse:
    return _error_response(_validation_error(list(e.errors())))


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed", 401: "invalid_api_key"}.get(e.status_code)
    etype = "invalid_request_error" if e.status_code < 500 else "server_error"
    return _JSON(
        P.error_body(str(e.detail), etype, None, code), status_code=e.status_code, headers=getattr(e, "headers", None)
    )


@api.exception_handler(Exception)
async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    logger.exception("unhandled error in the ingress")
    return _JSON(P.error_body(f"internal error: {e!r}", "server_error"), status_code=500)


def _openapi() -> dict:
    """The OpenAPI document with the real request bodies: the routes read their bodies themselves
    (size limit first), so FastAPI cannot see the pydantic models; fuzzers and clients need them."""
    if api.openapi_schema:
        return api.openapi_schema
    doc = get_openapi(title=api.title, version="1", description=api.description, routes=api.routes)
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/completions", P.CompletionRequest), ("/v1/chat/completions", P.ChatCompletionRequest)):
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(js.pop("$defs", {}))
        comps[model.__name__] = js
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    doc["security"] = [{"bearer": []}]
    api.openapi_schema = doc
    return doc


api.openapi = _openapi


def _cached(finish: dict) -> int | None:
    """Prompt tokens the replica did not prefill (prefix reuse), when its engine reports them."""
    return (finish.get("stats") or {}).get("cached_tokens")


def _replica_failed(e: BaseException, retry_after_s: int = 5) -> P.APIError:
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


def _cancel(gen) -> None:
    """Cancel a replica call; a call that already failed re-raises its error here, which must not
    replace the error being answered."""
    try:
        gen.cancel()
    except Exception:  # noqa: BLE001
        pass


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024)
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, replica: DeploymentHandle, config: dict):
        self.cfg = ServingConfig.model_validate(config)
        self.replica = replica
        self.names = self.cfg.accepted_model_names()
        self.api_key = self.cfg.resolved_api_key()  # the env (or a file) of this process, never the args
        if not self.api_key:
            logger.warning(
                "no API key is set (HVD_RAY_API_KEY / api_key_file): anyone who can reach this endpoint can use it"
            )
        self._info: dict | None = None
        self._health: tuple[float, int, dict] | None = None  # (monotonic time, status, body), briefly cached

    # ------------------------------------------------------------------------------ helpers
    def _authorize(self, request: Request) -> None:
        key = self.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise P.APIError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                "invalid_request_error",
                None,
                "invalid_api_key",
            )

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with a 413 as soon as it is known to exceed ``max_request_bytes``."""
        limit = self.cfg.max_request_bytes

        def too_large(n: int) -> P.APIError:
            return P.APIError(
                413,
                f"the request body ({n} bytes or more) exceeds this server's limit of {limit} bytes",
                code="request_too_large",
            )

        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise P.APIError(400, "invalid Content-Length header", code="invalid_request")
            if int(declared) > limit:
                raise too_large(int(declared))
        parts, size = [], 0
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large(size)
                    parts.append(chunk)
        except TimeoutError:
            raise P.APIError(
                408,
                f"the request body did not arrive within {self.cfg.body_timeout_s:g} s",
                code="body_timeout",
                headers={"Connection": "close"},
            ) from None
        return b"".join(parts)

    async def _parse(self, request: Request, model_cls):
        self._authorize(request)
        raw = await self._read_body(request)
        try:
            obj = json.loads(raw, parse_constant=_no_constants)  # NaN / Infinity are not JSON
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise P.APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise P.APIError(400, "the request body must be a JSON object", code="invalid_json")
        where = P.find_surrogate(obj)
        if where is not None:
            raise P.APIError(
                400,
                "a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text",
                param=str(where[0]) if where else None,
                code="invalid_text",
            )
        try:
            body = model_cls.model_validate(obj)
        except ValidationError as e:
            raise _validation_error(e.errors(include_url=False)) from None
        body.check_supported()
        if body.model is not None and body.model not in self.names:
            raise P.APIError(
                404,
                f"The model `{body.model}` does not exist. Available: {self.cfg.model_id}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        size, unit = body.prompt_size()
        limit = self.cfg.prompt_char_limit() if unit == "characters" else self.cfg.max_model_len
        if size > limit:
            param = "messages" if model_cls is P.ChatCompletionRequest else "prompt"
            raise P.APIError(
                400,
                f"the prompt has {size} {unit}; this server accepts at most {limit}",
                param=param,
                code="context_length_exceeded",
            )
        return body

    def _check_max_tokens(self, n: int | None, param: str = "max_tokens") -> None:
        if n is not None and n > self.cfg.max_tokens:
            raise P.APIError(
                400,
                f"{param} ({n}) exceeds this server's limit of {self.cfg.max_tokens}",
                param=param,
                code="invalid_value",
            )

    async def _next(self, gen, deadline: float, what: str):
        """The replica stream's next event by ``deadline`` (event-loop time), else the shed error:
        a 503 with Retry-After before the first token, a 504 after it."""
        try:
            return await asyncio.wait_for(gen.__anext__(), max(0.0, deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            _cancel(gen)  # the replica's generator aborts the request in the engine
            if what == "first token":
                raise P.overloaded(
                    f"no first token within {self.cfg.first_token_timeout_s:g} s of arrival (the "
                    "server is overloaded); retry later",
                    self.cfg.retry_after_s,
                    "first_token_timeout",
                ) from None
            raise P.APIError(
                504,
                f"the request did not finish within {self.cfg.request_timeout_s:g} s",
                "server_error",
                None,
                "request_timeout",
            ) from None

    async def _start(self, payload: dict, arrived: float):
        """Call the replica and wait for the request's first token (or its end) until the first-token
        deadline; return (response generator, the events so far) or raise APIError."""
        deadline = arrived + self.cfg.first_token_timeout_s
        head: list[dict] = []
        gen = None
        try:
            gen = self.replica.options(stream=True).generate.remote(payload)  # a full queue raises here
            while not head or head[-1]["type"] == "start":
                ev = await self._next(gen, deadline, "first token")
                if ev["type"] == "error":
                    raise P.APIError(
                        ev.get("status", 500),
                        ev["message"],
                        ev.get(
                            "error_type", "invalid_request_error" if ev.get("status", 500) < 500 else "server_error"
                        ),
                        ev.get("param"),
                        ev.get("code"),
                    )
                head.append(ev)
        except (Exception, asyncio.CancelledError) as e:
            if gen is not None:
                _cancel(gen)
            if isinstance(e, (asyncio.CancelledError, P.APIError)):
                raise
            if isinstance(e, StopAsyncIteration):
                raise P.APIError(
                    500, "the model replica ended the request without finishing it", "server_error"
                ) from None
            raise _replica_failed(e, self.cfg.retry_after_s) from None
        return gen, head

    async def _events(self, gen, head: list[dict], deadline: float):
        """The request's events (``head`` first) until its finish, each by the request deadline."""
        for ev in head:
            if ev["type"] != "start":
                yield ev
        while True:
            try:
                ev = await self._next(gen, deadline, "finish")
            except StopAsyncIteration:
                return
            yield ev

    async def _collect(self, gen, head: list[dict], deadline: float) -> list[tuple[str, list, dict]]:
        """(text, logprob entries, finish event) of each choice, in index order."""
        n = head[0].get("n", 1)
        parts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        finish: list[dict | None] = [None] * n
        done = False
        try:
            async for ev in self._events(gen, head, deadline):
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
            raise _replica_failed(e, self.cfg.retry_after_s) from None
        finally:
            if not done:
                _cancel(gen)
        if not done:
            raise P.APIError(500, "the model replica ended the request without finishing it", "server_error")
        return [("".join(p), lp, f) for p, lp, f in zip(parts, logprobs, finish)]

    @staticmethod
    def _usage(finishes: list[dict]) -> dict:
        """One prompt, the choices' completion tokens summed (as OpenAI counts ``n`` choices)."""
        first = finishes[0]
        return P.usage(first["prompt_tokens"], sum(f["completion_tokens"] for f in finishes), _cached(first))

    async def _stream(
        self,
        gen,
        head: list[dict],
        deadline: float,
        kind: str,
        include_usage: bool,
        parallel_tools: bool | None,
        logprobs: bool,
    ):
        """Server-sent events of one request, each choice's chunks with its ``index``; with tools
        (``parallel_tools`` not None) a choice's content streams until a tool call may begin, and its
        calls come whole before its finish chunk; usage (when asked for) once all choices finished."""
        rid = P.new_id("chatcmpl" if kind == "chat" else "cmpl")
        created, model = P.now(), self.cfg.model_id
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        n = head[0].get("n", 1)
        split = [tools.StreamSplitter() if parallel_tools is not None else None for _ in range(n)]
        offset = [0] * n  # characters of each choice's logprob tokens so far (completions' text_offset)

        def chunk(i: int, text: str | None, finish: str | None, role: bool = False, delta=None, lps=None) -> dict:
            if kind == "chat":
                if delta is None:
                    delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                c = P.chat_chunk(
                    rid, model, created, delta, finish, i, P.chat_logprobs(lps) if lps is not None else None
                )
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
                    yield _sse(chunk(i, None, None, role=True))
            try:
                async for ev in self._events(gen, head, deadline):
                    i = ev.get("index", 0)
                    if ev["type"] == "delta":
                        text = split[i].push(ev["text"]) if split[i] else ev["text"]
                        lps = ev.get("logprobs") if logprobs else None
                        if text or lps:
                            yield _sse(chunk(i, text, None, lps=lps))
                    elif ev["type"] == "finish":
                        finished[i] = ev
                        finish = ev["finish_reason"]
                        if split[i]:
                            rest, calls = split[i].finish(parallel_tools)
                            if rest:
                                yield _sse(chunk(i, rest, None))
                            if calls:
                                finish = "tool_calls"
                                yield _sse(chunk(i, None, None, delta=P.tool_call_deltas(calls)))
                        yield _sse(chunk(i, None, finish))
                        if len(finished) == n:
                            done = True
                            if include_usage:
                                use = self._usage([finished[k] for k in range(n)])
                                yield _sse(P.usage_chunk(rid, model, created, obj, use))
                    elif ev["type"] == "error":
                        done = True
                        yield _sse(
                            P.error_body(
                                ev["message"], ev.get("error_type", "server_error"), ev.get("param"), ev.get("code")
                            )
                        )
            except P.APIError as e:  # the request deadline: say so, then end the stream
                done = True
                yield _sse(e.body())
            except Exception as e:  # noqa: BLE001 - the replica died mid-stream: say so, then end the stream
                done = True
                yield _sse(_replica_failed(e, self.cfg.retry_after_s).body())
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # client disconnected (or we failed): stop generating for it
                _cancel(gen)

    async def _generate(
        self,
        payload: dict,
        kind: str,
        stream: bool,
        include_usage: bool,
        arrived: float,
        parallel_tools: bool | None = None,
        logprobs: bool = False,
    ):
        """Run one request; ``parallel_tools`` not None: the output is parsed for tool calls."""
        gen, head = await self._start(payload, arrived)
        deadline = arrived + self.cfg.request_timeout_s
        if stream:
            return StreamingResponse(
                self._stream(gen, head, deadline, kind, include_usage, parallel_tools, logprobs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        results = await self._collect(gen, head, deadline)
        use = self._usage([fin for _, _, fin in results])
        rid = P.new_id("chatcmpl" if kind == "chat" else "cmpl")
        if kind != "chat":
            choices = [
                P.completion_choice(i, text, fin["finish_reason"], P.completion_logprobs(lps) if logprobs else None)
                for i, (text, lps, fin) in enumerate(results)
            ]
            return JSONResponse(P.completion_response(rid, self.cfg.model_id, choices, use))
        choices = []
        for i, (text, lps, fin) in enumerate(results):
            calls, finish = None, fin["finish_reason"]
            if parallel_tools is not None:
                text, calls = tools.parse(text, parallel_tools)
                finish = "tool_calls" if calls else finish
            choices.append(P.chat_choice(i, text, finish, calls, P.chat_logprobs(lps) if logprobs else None))
        return JSONResponse(P.chat_response(rid, self.cfg.model_id, choices, use))

    # ------------------------------------------------------------------------------- routes
    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 while Serve counts a running model replica: the controller's view, which each replica's
        ``check_health`` feeds from its engine loop's progress; never a call that queues behind generation."""
        now = time.monotonic()
        if self._health is None or now - self._health[0] > HEALTH_CACHE_S:
            try:
                status, body = 200, await asyncio.wait_for(asyncio.to_thread(self._replica_status), timeout=5)
                if not body["running_replicas"]:
                    status, body["status"] = 503, "unhealthy"
            except Exception as e:  # noqa: BLE001 - the controller did not answer: not healthy as far as we know
                status, body = 503, P.error_body(f"serving status unavailable: {e!r}", "server_error")
            self._health = (now, status, body)
        _, status, body = self._health
        return JSONResponse(body, status_code=status)

    def _replica_status(self) -> dict:
        ctx = serve.get_replica_context()
        dep = serve.status().applications[ctx.app_name].deployments[self.replica.deployment_name]
        running = dep.replica_states.get("RUNNING", 0)
        return {"status": "ok", "running_replicas": running, "deployment_status": str(dep.status.value)}

    @api.get("/stats")
    async def stats(self, request: Request) -> JSONResponse:
        """Engine figures of one (the chosen) model replica: queue, slots, mean accepted tokens. It is a
        replica call like generation: under overload it may be refused (503) like one."""
        self._authorize(request)
        try:
            return JSONResponse(await asyncio.wait_for(self.replica.stats.remote(), timeout=30))
        except TimeoutError:
            raise P.overloaded("the model replica did not answer within 30 s", self.cfg.retry_after_s) from None
        except Exception as e:  # noqa: BLE001
            raise _replica_failed(e, self.cfg.retry_after_s) from None

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi_json(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse(api.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        from fastapi.openapi.docs import get_swagger_ui_html

        self._authorize(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{api.title} - API")

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        if self._info is None:
            self._info = await self.replica.info.remote()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.cfg.model_id,
                        "object": "model",
                        "created": 0,
                        "owned_by": "hvd-ray",
                        "root": self.cfg.model,
                        "max_model_len": self._info["max_model_len"],
                    }
                ],
            }
        )

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        arrived = asyncio.get_running_loop().time()
        body: P.CompletionRequest = await self._parse(request, P.CompletionRequest)
        self._check_max_tokens(body.max_tokens)
        payload = {**body.single_prompt(), "params": body.sampling(body.max_tokens), "n": body.n}
        logprobs = body.logprobs is not None
        return await self._generate(payload, "completion", body.stream, body.include_usage, arrived, logprobs=logprobs)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        arrived = asyncio.get_running_loop().time()
        body: P.ChatCompletionRequest = await self._parse(request, P.ChatCompletionRequest)
        n = body.requested_max_tokens
        self._check_max_tokens(n, "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        payload = {
            "messages": body.chat_messages(),
            **body.tool_payload(),
            "params": body.sampling(n),
            "template_kwargs": body.chat_template_kwargs or {},
            "n": body.n,
        }
        parallel = body.parallel_tool_calls if "tools" in payload else None
        return await self._generate(payload, "chat", body.stream, body.include_usage, arrived, parallel, body.logprobs)
