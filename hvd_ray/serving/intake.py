"""Request intake for the HTTP ingress: the checks a request passes before any model work, in order
of cost (the API key, the body's size and arrival deadline, JSON, the request model's ranges, the
prompt's size in characters before the replica tokenises it). Each failure is a ``protocol.APIError``
naming its parameter."""

import asyncio
import hmac
import json

from fastapi import Request
from pydantic import ValidationError

from . import protocol as P
from .config import ServingConfig


def validation_error(errors: list[dict]) -> P.APIError:
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


def authorize(request: Request, key: str | None) -> None:
    """A 401 unless the request carries ``Authorization: Bearer <key>`` (no key set: anyone may)."""
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


async def read_body(request: Request, cfg: ServingConfig) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed ``max_request_bytes`` (from
    ``Content-Length`` or while reading, before parsing) and with a 408 when it has not arrived
    within ``body_timeout_s``."""
    limit = cfg.max_request_bytes

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
        async with asyncio.timeout(cfg.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(size)
                parts.append(chunk)
    except TimeoutError:
        raise P.APIError(
            408,
            f"the request body did not arrive within {cfg.body_timeout_s:g} s",
            code="body_timeout",
            headers={"Connection": "close"},
        ) from None
    return b"".join(parts)


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def parse(request: Request, model_cls, cfg: ServingConfig, key: str | None, names):
    """The request's body as ``model_cls`` once every check passed; ``key``: the API key (None: no
    key), ``names``: the model names this server answers to."""
    authorize(request, key)
    raw = await read_body(request, cfg)
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
        raise validation_error(e.errors(include_url=False)) from None
    body.check_supported()
    if body.model is not None and body.model not in names:
        raise P.APIError(
            404,
            f"The model `{body.model}` does not exist. Available: {cfg.model_id}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    size, unit = body.prompt_size()
    limit = cfg.prompt_char_limit() if unit == "characters" else cfg.max_model_len
    if size > limit:
        param = "messages" if model_cls is P.ChatCompletionRequest else "prompt"
        raise P.APIError(
            400,
            f"the prompt has {size} {unit}; this server accepts at most {limit}",
            param=param,
            code="context_length_exceeded",
        )
    return body


def check_max_tokens(n: int | None, cfg: ServingConfig, param: str = "max_tokens") -> None:
    """A 400 when the request asks for more new tokens than the server's ``max_tokens``."""
    if n is not None and n > cfg.max_tokens:
        raise P.APIError(
            400,
            f"{param} ({n}) exceeds this server's limit of {cfg.max_tokens}",
            param=param,
            code="invalid_value",
        )
