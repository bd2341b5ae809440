"""The OpenAI-compatible HTTP ingress (FastAPI inside a Serve deployment): the app, its routes and
how errors render.

Routes: ``GET /health``, ``GET /stats``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` as server-sent events). Every error, including
malformed JSON and wrong types, is answered with an OpenAI body
``{"error": {"message", "type", "param", "code"}}`` and a 4xx/5xx status.

The ingress does no model work: it validates (``intake.py``: before any work and in order of cost),
then calls the model replica through a streaming ``DeploymentHandle`` and turns the replica's events
into OpenAI objects (``streaming.py``: deadlines, cancellation, server-sent events). A replica that
dies under a request is answered with a 503 (or an error event on a stream), never a hang.

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
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol as P
from . import streaming, tools
from .config import ServingConfig
from .intake import authorize, check_max_tokens, parse, validation_error

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


@api.exception_handler(P.APIError)
async def _api_error(_: Request, e: P.APIError) -> JSONResponse:
    return _error_response(e)


@api.exception_handler(RequestValidationError)
async def _request_validation(_: Request, e: RequestValidationError) -> JSONResponse:
    return _error_response(validation_error(list(e.errors())))


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
        gen, head = await streaming.start(self.replica, payload, arrived, self.cfg)
        deadline = arrived + self.cfg.request_timeout_s
        if stream:
            return StreamingResponse(
                streaming.stream(gen, head, deadline, self.cfg, kind, include_usage, parallel_tools, logprobs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        results = await streaming.collect(gen, head, deadline, self.cfg)
        use = streaming.usage([fin for _, _, fin in results])
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
        authorize(request, self.api_key)
        try:
            return JSONResponse(await asyncio.wait_for(self.replica.stats.remote(), timeout=30))
        except TimeoutError:
            raise P.overloaded("the model replica did not answer within 30 s", self.cfg.retry_after_s) from None
        except Exception as e:  # noqa: BLE001
            raise streaming.replica_failed(e, self.cfg.retry_after_s) from None

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi_json(self, request: Request) -> JSONResponse:
        authorize(request, self.api_key)
        return JSONResponse(api.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        from fastapi.openapi.docs import get_swagger_ui_html

        authorize(request, self.api_key)
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{api.title} - API")

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        authorize(request, self.api_key)
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
        body: P.CompletionRequest = await parse(request, P.CompletionRequest, self.cfg, self.api_key, self.names)
        check_max_tokens(body.max_tokens, self.cfg)
        payload = {**body.single_prompt(), "params": body.sampling(body.max_tokens), "n": body.n}
        logprobs = body.logprobs is not None
        return await self._generate(payload, "completion", body.stream, body.include_usage, arrived, logprobs=logprobs)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        arrived = asyncio.get_running_loop().time()
        body: P.ChatCompletionRequest = await parse(
            request, P.ChatCompletionRequest, self.cfg, self.api_key, self.names
        )
        n = body.requested_max_tokens
        check_max_tokens(
            n, self.cfg, "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        )
        payload = {
            "messages": body.chat_messages(),
            **body.tool_payload(),
            "params": body.sampling(n),
            "template_kwargs": body.chat_template_kwargs or {},
            "n": body.n,
        }
        parallel = body.parallel_tool_calls if "tools" in payload else None
        return await self._generate(payload, "chat", body.stream, body.include_usage, arrived, parallel, body.logprobs)
