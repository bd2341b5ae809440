"""One concept, the OpenAI wire format: request models (pydantic), response/chunk builders, error bodies.

Only what the server implements is modelled, and nothing is silently ignored: a field the server
does not know is refused with a 400 naming it (``unsupported_parameter``), and values of known fields
it cannot honour (``best_of > 1``, ``echo``, a ``response_format`` other than text / JSON) with a 400
naming the parameter.

Every field that reaches the engine has a range checked here, before any work (the README's
"Limits and failure behaviour" lists them): a request the engine cannot run must be a 400 naming
its parameter, never an exception inside a decoding step shared with other requests.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from ..engine.request import (
    MAX_TOP_LOGPROBS,  # top log-probabilities per token (OpenAI: 20)
    MIN_TEMPERATURE,  # smaller non-zero temperatures are refused (1/T would overflow)
)

# Limits of a request (documented in the README's "Limits and failure behaviour").
MAX_SEED = 2**63  # seeds are in [0, 2**63): torch generators take a signed 64-bit seed
MAX_TOP_K = 2**31 - 1
MAX_STOP = 4  # stop strings per request, as in OpenAI's API
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1  # ids beyond the vocabulary are refused by the replica, which knows it
MAX_N = 16  # choices per request (each one an engine request sharing the prompt's K/V)
MAX_PENALTY = 2.0  # presence / frequency penalties in [-2, 2], as in OpenAI's API
MAX_LOGIT_BIAS = 100.0  # logit_bias values in [-100, 100], as in OpenAI's API
# repetition_penalty divides (or multiplies) logits: a denormal one would make them infinite
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
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
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # a token id as a JSON object's key
LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]


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
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class JSONSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``; the output is always held to ``schema`` (``strict``
    or not, as vLLM does)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # none: any JSON object
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (a JSON object) or
    ``{"type": "json_schema", "json_schema": {...}}`` (JSON valid under the schema)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def structure(self) -> dict | None:
        """The engine's ``structure`` (None: unconstrained text)."""
        if self.type == "text":
            return None
        if self.type == "json_schema" and self.json_schema is not None and self.json_schema.schema_ is not None:
            return {"type": "json_schema", "schema": self.json_schema.schema_}
        return {"type": "json_object"}

    @model_validator(mode="after")
    def _schema_for_its_type(self) -> ResponseFormat:
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self


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
    n: int = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    repetition_penalty: float = Field(  # extension (vLLM); 1 = off
        1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, allow_inf_nan=False
    )
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)  # extension (vLLM); 0 = off
    min_tokens: int = Field(0, ge=0, le=MAX_TOKEN_ID)  # extension (vLLM): no EOS / stop token before this many
    # token id (a decimal string, as JSON keys are) -> added to its logit; ids beyond the vocabulary
    # are refused by the replica
    logit_bias: dict[TokenIdKey, LogitBias] | None = None
    response_format: ResponseFormat | None = None  # completions: an extension (vLLM)
    user: str | None = Field(None, max_length=256)

    @field_validator("temperature")
    @classmethod
    def _dividable(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:  # 1/T would overflow the logits
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k in v or ():
            if int(k) > MAX_TOKEN_ID:
                raise ValueError(f"logit_bias keys must be token ids in [0, {MAX_TOKEN_ID}], got {k}")
        return v

    @field_validator("stop")
    @classmethod
    def _short_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else (v or []):
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    def check_supported(self) -> None:
        """Raise APIError(400) for parameters the server accepts syntactically but cannot honour,
        and for combinations that contradict each other."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        n = self.requested_max_tokens
        if n is not None and self.min_tokens > n:
            raise APIError(400, f"min_tokens ({self.min_tokens}) exceeds max_tokens ({n})", param="min_tokens")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]  # "" would match everywhere

    def top_logprobs_k(self) -> int | None:
        """Top log-probabilities per output token (None: no logprobs)."""
        return None

    def sampling(self, max_tokens: int | None) -> dict:
        """The engine's SamplingParams fields (the replica adds a tool call's structure)."""
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop_list(),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_p": self.min_p,
            "min_tokens": self.min_tokens,
            "logit_bias": {int(k): b for k, b in (self.logit_bias or {}).items()},
            "structure": self.response_format.structure() if self.response_format else None,
            "logprobs": self.top_logprobs_k(),
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: StrictBool = False
    # the top log-probabilities per token (OpenAI allows 5, vLLM 20)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_value")
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
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # needs logprobs: true
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM): more variables for the chat template

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("messages must contain at least one message")
        return v

    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools or ()}:
                raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        forced = self.tools and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise APIError(
                400,
                "tool_choice 'required' or a named function holds the answer to tool calls; it cannot also "
                f"follow response_format {self.response_format.type!r}",
                param="tool_choice",
            )
        taken = sorted(set(self.chat_template_kwargs or ()) & TEMPLATE_OWN_KWARGS)
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}", param="chat_template_kwargs")
        for m in self.messages:
            if m.role == "tool" and not m.tool_call_id:
                raise APIError(400, "a tool message needs tool_call_id", param="messages")
            if m.tool_calls and m.role != "assistant":
                raise APIError(400, "only assistant messages carry tool_calls", param="messages")

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
        return {
            "tools": [t.model_dump(exclude_none=True) for t in self.tools],
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
        }


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


def chat_logprobs(entries: list) -> dict:
    """OpenAI's chat ``logprobs`` of the replica's ``[token text, logprob, [[text, logprob], ...]]``
    entries (each token's UTF-8 bytes included)."""

    def one(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(t, lp), "top_logprobs": [one(c, clp) for c, clp in top]} for t, lp, top in entries]}


def completion_logprobs(entries: list, offset: int = 0) -> dict:
    """OpenAI's (legacy) completion ``logprobs`` of the replica's entries; ``offset``: characters of
    the choice's text before them. Each ``top_logprobs`` holds the top k and the chosen token, as in
    OpenAI's API (up to k + 1 entries)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for text, logprob, top in entries:
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({**dict(top), text: logprob})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def completion_chunk(
    rid: str, model: str, created: int, text: str, finish_reason: str | None, index: int = 0, logprobs=None
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [completion_choice(index, text, finish_reason, logprobs)],
    }


def chat_choice(
    index: int,
    text: str | None,
    finish_reason: str,
    tool_calls: list[dict] | None = None,
    logprobs: dict | None = None,
) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def tool_call_deltas(calls: list[dict]) -> dict:
    """A chunk delta carrying whole tool calls, as OpenAI streams them (index, id, name, arguments)."""
    return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}


def chat_chunk(
    rid: str, model: str, created: int, delta: dict, finish_reason: str | None, index: int = 0, logprobs=None
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def usage_chunk(rid: str, model: str, created: int, object: str, use: dict) -> dict:
    return {"id": rid, "object": object, "created": created, "model": model, "choices": [], "usage": use}
