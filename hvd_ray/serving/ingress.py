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
"""


import asyncio
import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol as P
from .config import ServingConfig

logger = logging.getLogger("ray.serve")

api = FastAPI(title="hvd-ray", description="OpenAI-compatible endpoint served by hvd-ray on Ray Serve")


def _error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _validation_error(errors: list[dict]) -> P.APIError:
    """A pydantic / FastAPI error list as one 400 with the first offending parameter named."""
    msgs, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return P.APIError(400, f"malformed JSON body: {err.get('msg', '')}".rstrip(": "), code="invalid_json")
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
    return JSONResponse(P.error_body(str(e.detail), etype, None, code), status_code=e.status_code,
                        headers=getattr(e, "headers", None))


@api.exception_handler(Exception)
async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    logger.exception("unhandled error in the ingress")
    return JSONResponse(P.error_body(f"internal error: {e!r}", "server_error"), status_code=500)


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
        doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    doc["security"] = [{"bearer": []}]
    api.openapi_schema = doc
    return doc


api.openapi = _openapi


def _cached(finish: dict) -> int | None:
    """Prompt tokens the replica did not prefill (prefix reuse), when its engine reports them."""
    return (finish.get("stats") or {}).get("cached_tokens")


def _replica_failed(e: BaseException) -> P.APIError:
    """The replica call raised: a replica that died or became unreachable is a clean 503 to retry;
    an exception inside its code (a bug) is a 500."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

    logger.warning("model replica call failed: %r", e)
    if isinstance(e, (RayActorError, BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError)):
        return P.APIError(503, f"the model replica failed while serving this request ({type(e).__name__}); "
                          "retry it", "server_error", None, "replica_unavailable")
    return P.APIError(500, f"the model replica failed on this request ({type(e).__name__})", "server_error",
                      None, "replica_error")


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=256)
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, replica: DeploymentHandle, config: dict):
        self.cfg = ServingConfig.model_validate(config)
        self.replica = replica
        self.names = self.cfg.accepted_model_names()
        self.api_key = self.cfg.resolved_api_key()  # the env of this process, never the builder args
        self._info: dict | None = None

    # ------------------------------------------------------------------------------ helpers
    def _authorize(self, request: Request) -> None:
        key = self.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise P.APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                             "invalid_request_error", None, "invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with a 413 as soon as it is known to exceed ``max_request_bytes``."""
        limit = self.cfg.max_request_bytes

        def too_large(n: int) -> P.APIError:
            return P.APIError(413, f"the request body ({n} bytes or more) exceeds this server's limit of {limit} "
                              "bytes", code="request_too_large")

        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise P.APIError(400, "invalid Content-Length header", code="invalid_request")
            if int(declared) > limit:
                raise too_large(int(declared))
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(size)
            parts.append(chunk)
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
        try:
            body = model_cls.model_validate(obj)
        except ValidationError as e:
            raise _validation_error(e.errors(include_url=False)) from None
        body.check_supported()
        if body.model is not None and body.model not in self.names:
            raise P.APIError(404, f"The model `{body.model}` does not exist. Available: {self.cfg.model_id}",
                             "invalid_request_error", "model", "model_not_found")
        size, unit = body.prompt_size()
        limit = self.cfg.prompt_char_limit() if unit == "characters" else self.cfg.max_model_len
        if size > limit:
            param = "messages" if model_cls is P.ChatCompletionRequest else "prompt"
            raise P.APIError(400, f"the prompt has {size} {unit}; this server accepts at most {limit}", param=param,
                             code="context_length_exceeded")
        return body

    def _check_max_tokens(self, n: int | None, param: str = "max_tokens") -> None:
        if n is not None and n > self.cfg.max_tokens:
            raise P.APIError(400, f"{param} ({n}) exceeds this server's limit of {self.cfg.max_tokens}",
                             param=param, code="invalid_value")

    async def _start(self, payload: dict):
        """Call the replica; return (response generator, start event) or raise APIError."""
        gen = self.replica.options(stream=True).generate.remote(payload)
        try:
            first = await gen.__anext__()
        except (Exception, asyncio.CancelledError) as e:
            gen.cancel()
            if isinstance(e, (asyncio.CancelledError, P.APIError)):
                raise
            raise _replica_failed(e) from None
        if first["type"] == "error":
            raise P.APIError(first.get("status", 500), first["message"],
                             first.get("error_type", "invalid_request_error" if first.get("status", 500) < 500
                                       else "server_error"),
                             first.get("param"), first.get("code"))
        return gen, first

    @staticmethod
    async def _collect(gen) -> tuple[str, dict]:
        parts, finish = [], None
        done = False
        try:
            async for ev in gen:
                if ev["type"] == "delta":
                    parts.append(ev["text"])
                elif ev["type"] == "finish":
                    finish, done = ev, True
                elif ev["type"] == "error":
                    done = True
                    raise P.APIError(ev.get("status", 500), ev["message"], ev.get("error_type", "server_error"),
                                     None, ev.get("code"))
        except (P.APIError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - the replica died mid-request
            raise _replica_failed(e) from None
        finally:
            if not done:
                gen.cancel()
        if finish is None:
            raise P.APIError(500, "the model replica ended the request without finishing it", "server_error")
        return "".join(parts), finish

    async def _stream(self, gen, start: dict, kind: str, include_usage: bool):
        rid = P.new_id("chatcmpl" if kind == "chat" else "cmpl")
        created, model = P.now(), self.cfg.model_id
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict:
            if kind == "chat":
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                c = P.chat_chunk(rid, model, created, delta, finish)
            else:
                c = P.completion_chunk(rid, model, created, text or "", finish)
            if include_usage:
                c["usage"] = None
            return c

        done = False
        try:
            if kind == "chat":
                yield _sse(chunk(None, None, role=True))
            try:
                async for ev in gen:
                    if ev["type"] == "delta":
                        yield _sse(chunk(ev["text"], None))
                    elif ev["type"] == "finish":
                        done = True
                        yield _sse(chunk(None, ev["finish_reason"]))
                        if include_usage:
                            use = P.usage(ev["prompt_tokens"], ev["completion_tokens"], _cached(ev))
                            yield _sse(P.usage_chunk(rid, model, created, obj, use))
                    elif ev["type"] == "error":
                        done = True
                        yield _sse(P.error_body(ev["message"], ev.get("error_type", "server_error"), None,
                                                ev.get("code")))
            except Exception as e:  # noqa: BLE001 - the replica died mid-stream: say so, then end the stream
                done = True
                yield _sse(_replica_failed(e).body())
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # client disconnected (or we failed): stop generating for it
                gen.cancel()

    async def _generate(self, payload: dict, kind: str, stream: bool, include_usage: bool):
        gen, start = await self._start(payload)
        if stream:
            return StreamingResponse(self._stream(gen, start, kind, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, fin = await self._collect(gen)
        use = P.usage(fin["prompt_tokens"], fin["completion_tokens"], _cached(fin))
        rid = P.new_id("chatcmpl" if kind == "chat" else "cmpl")
        build = P.chat_response if kind == "chat" else P.completion_response
        return JSONResponse(build(rid, self.cfg.model_id, text, fin["finish_reason"], use))

    # ------------------------------------------------------------------------------- routes
    @api.get("/health")
    async def health(self) -> JSONResponse:
        try:
            stats = await asyncio.wait_for(self.replica.stats.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001
            return JSONResponse(P.error_body(f"model replica unavailable: {e!r}", "server_error"), status_code=503)
        ok = stats.get("healthy", False)
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)

    @api.get("/stats")
    async def stats(self, request: Request) -> JSONResponse:
        """Engine figures of one (the chosen) model replica: queue, slots, mean accepted tokens."""
        self._authorize(request)
        return JSONResponse(await self.replica.stats.remote())

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        if self._info is None:
            self._info = await self.replica.info.remote()
        return JSONResponse({"object": "list", "data": [{
            "id": self.cfg.model_id, "object": "model", "created": 0, "owned_by": "hvd-ray",
            "root": self.cfg.model, "max_model_len": self._info["max_model_len"]}]})

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        body: P.CompletionRequest = await self._parse(request, P.CompletionRequest)
        self._check_max_tokens(body.max_tokens)
        payload = {**body.single_prompt(), "params": body.sampling(body.max_tokens)}
        return await self._generate(payload, "completion", body.stream, body.include_usage)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        body: P.ChatCompletionRequest = await self._parse(request, P.ChatCompletionRequest)
        n = body.requested_max_tokens
        self._check_max_tokens(n, "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        payload = {"messages": body.chat_messages(), "params": body.sampling(n)}
        return await self._generate(payload, "chat", body.stream, body.include_usage)
