"""OpenAI wire format: request models (pydantic), response/chunk builders and error bodies.

Only what the server implements is modelled, and nothing is silently ignored: a field the server
does not know is refused with a 400 naming it (``unsupported_parameter``), and known fields it
cannot honour (``n > 1``, ``logprobs``, penalties, ...) with a 400 naming the parameter.

Every field that reaches the engine has a range checked here, before any work (the README's
"Limits and failure behaviour" lists them): a request the engine cannot run must be a 400 naming
its parameter, never an exception inside a decoding step shared with other requests.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from ..engine.request import MIN_TEMPERATURE  # smaller non-zero temperatures are refused (1/T would overflow)

# Limits of a request (documented in the README's "Limits and failure behaviour").
MAX_SEED = 2**63  # seeds are in [0, 2**63): torch generators take a signed 64-bit seed
MAX_TOP_K = 2**31 - 1
MAX_STOP = 4  # stop strings per request, as in OpenAI's API
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1  # ids beyond the vocabulary are refused by the replica, which knows it
MAX_MESSAGES = 1024
TEMPLATE_OWN_KWARGS = {
    "conversation",
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "tokenize",
    "continue_final_message",
    "return_tensors",
    "return_dict",
    "chat_template",
}
MAX_TOOLS = 128  # tools per request, and calls per assistant message
MAX_TOOL_NAME = 64
MAX_TOOL_ARGUMENTS = 2**16  # characters of one call's arguments (JSON text)
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class APIError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def overloaded(message: str, retry_after_s: int, code: str = "server_overloaded") -> APIError:
    """A 503 the client should retry later (``Retry-After``): the server shed this request."""
    return APIError(503, message, "server_error", None, code, {"Retry-After": str(int(retry_after_s))})


_SURROGATE = re.compile("[\ud800-\udfff]")


def find_surrogate(obj: Any, path: tuple = ()) -> tuple | None:
    """The path to the first string (or key) of parsed JSON holding a lone UTF-16 surrogate
    (``"\\ud800"`` decodes to one; it cannot be encoded as UTF-8, so tokenising it would fail)."""
    stack = [(obj, path)]
    while stack:
        o, p = stack.pop()
        if isinstance(o, str):
            if _SURROGATE.search(o):
                return p
        elif isinstance(o, dict):
            for k, v in o.items():
                if _SURROGATE.search(k):
                    return p + (k,)
                stack.append((v, p + (k,)))
        elif isinstance(o, list):
            stack.extend((v, p + (i,)) for i, v in enumerate(o))
    return None


# ------------------------------------------------------------------------------------ requests
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(
        1.0, ge=0.0, le=2.0, allow_inf_nan=False, description=f"0 decodes greedily; else at least {MIN_TEMPERATURE}"
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)  # extension (vLLM); 0 = off
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)  # extension (vLLM)
    ignore_eos: StrictBool = False  # extension (vLLM)
    n: int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    # extension (vLLM); its benchmark client sends the neutral 1.0 with every request
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=256)

    @field_validator("temperature")
    @classmethod
    def _dividable(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:  # 1/T would overflow the logits
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return v

    @field_validator("stop")
    @classmethod
    def _short_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else (v or []):
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    def check_supported(self) -> None:
        """Raise APIError(400) for parameters the server accepts syntactically but cannot honour."""
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", param="n", code="unsupported_value")
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise APIError(400, f"{param} is not supported (must be 0)", param=param, code="unsupported_value")
        if self.repetition_penalty != 1.0:
            raise APIError(
                400,
                "repetition_penalty is not supported (must be 1)",
                param="repetition_penalty",
                code="unsupported_value",
            )
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]  # "" would match everywhere

    def sampling(self, max_tokens: int | None) -> dict:
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop_list(),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: StrictBool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_value")
        if self.logprobs is not None:
            raise APIError(400, "logprobs is not supported", param="logprobs", code="unsupported_value")
        if self.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", param="best_of", code="unsupported_value")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_value")

    def prompt_size(self) -> tuple[int, str]:
        """(size, unit) of the prompt before tokenising: characters of text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return len(p), "characters"
        if p and isinstance(p[0], str):
            return sum(map(len, p)), "characters"
        if p and isinstance(p[0], list):
            return sum(map(len, p)), "tokens"
        return len(p), "tokens"

    def single_prompt(self) -> dict:
        """{'prompt': str} or {'prompt_token_ids': [...]}; one prompt per request."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt is empty", param="prompt")
            return {"prompt": p}
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(t, int) for t in p):
            return {"prompt_token_ids": list(p)}
        raise APIError(400, "only one prompt per request is supported", param="prompt", code="unsupported_value")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(max_length=MAX_TOOL_NAME)
    arguments: str = Field("{}", max_length=MAX_TOOL_ARGUMENTS)  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    class _Name(BaseModel):
        name: str

    type: Literal["function"]
    function: _Name


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # an assistant's earlier calls
    tool_call_id: str | None = Field(None, max_length=256)  # the call a tool message answers

    def size(self) -> int:
        """Characters of text this message carries (bounded before the chat template runs)."""
        calls = sum(len(c.function.arguments) + len(c.function.name) for c in self.tool_calls or ())
        if isinstance(self.content, str):
            return len(self.content) + calls
        return sum(len(p["text"]) for p in self.content or () if isinstance(p.get("text"), str)) + calls

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400,
                    f"unsupported content part type {part.get('type')!r} (text only)",
                    param="messages",
                    code="unsupported_value",
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM): more variables for the chat template

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("messages must contain at least one message")
        return v

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise APIError(400, "logprobs is not supported", param="logprobs", code="unsupported_value")
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools or ()}:
                raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        taken = sorted(set(self.chat_template_kwargs or ()) & TEMPLATE_OWN_KWARGS)
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}", param="chat_template_kwargs")
        for m in self.messages:
            if m.role == "tool" and not m.tool_call_id:
                raise APIError(400, "a tool message needs tool_call_id", param="messages")
            if m.tool_calls and m.role != "assistant":
                raise APIError(400, "only assistant messages carry tool_calls", param="messages")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise APIError(
                400,
                "response_format other than text is not supported",
                param="response_format",
                code="unsupported_value",
            )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt_size(self) -> tuple[int, str]:
        tools = sum(len(t.model_dump_json()) for t in self.tools or ())
        return sum(m.size() for m in self.messages) + tools, "characters"

    def chat_messages(self) -> list[dict]:
        """The conversation for the chat template, tool calls and tool-call ids included."""
        out = []
        for m in self.messages:  # 'developer' is OpenAI's newer name for 'system'; templates know the latter
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out

    def tool_payload(self) -> dict:
        """What the replica renders and the ingress parses: the tools and the choice (none: no tools)."""
        if not self.tools or self.tool_choice == "none":
            return {}
        choice = (
            self.tool_choice.model_dump()
            if isinstance(self.tool_choice, NamedToolChoice)
            else (self.tool_choice or "auto")
        )
        return {"tools": [t.model_dump(exclude_none=True) for t in self.tools], "tool_choice": choice}


# ----------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens whose K/V was reused (prefix reuse)."""
    use = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        use["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return use


def completion_response(rid: str, model: str, text: str, finish_reason: str, use: dict) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": use,
    }


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_response(
    rid: str, model: str, text: str | None, finish_reason: str, use: dict, tool_calls: list[dict] | None = None
) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
        "usage": use,
    }


def tool_call_deltas(calls: list[dict]) -> dict:
    """A chunk delta carrying whole tool calls, as OpenAI streams them (index, id, name, arguments)."""
    return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(rid: str, model: str, created: int, object: str, use: dict) -> dict:
    return {"id": rid, "object": object, "created": created, "model": model, "choices": [], "usage": use}
