"""Tool calling: the tools and the tool-call history into the prompt, the model's calls out of its text.

Rendering: a chat template that knows tools (Qwen2/Qwen3 folders' do: ``apply_chat_template(...,
tools=...)``) renders them itself, calls as Hermes ``<tool_call>{"name", "arguments"}</tool_call>``
blocks. Any other template (SmolLM2's) gets the default tool prompt below, in the layout small
instruct models are tuned on: the schemas inside ``<tools>`` in the system message, calls as one JSON
list inside ``<tool_call>``, tool results as ``tool`` messages inside ``<tool_response>``. Earlier
assistant calls are rendered back into the text the model would have written, so the history reaches
the model whichever template renders it.

``tool_choice``: ``none`` renders no tools; ``auto`` lets the model choose, unconstrained;
``required`` and a named function constrain the whole answer with a grammar (:func:`structure`, an
xgrammar structural tag the engine enforces): calls in the template's format and nothing else, each
call's arguments valid under its function's ``parameters`` schema (a named choice: one call of that
function; ``parallel_tool_calls: false``: exactly one call).

Parsing: every ``<tool_call>`` block of the output (a JSON object or a list of them, an unclosed last
block included) becomes an OpenAI tool call with a fresh id and its arguments as a JSON string; text
outside the blocks is the message's content. Output whose blocks do not parse is returned as content,
never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"

DEFAULT_TOOL_PROMPT = """You are an expert in composing functions. You are given a question and a set of possible \
functions. Based on the question, you may make one or more function/tool calls to achieve the purpose.
You have access to the following tools:
<tools>{tools}</tools>

To call functions, answer with the calls in this format and nothing else:
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
... (more tool calls as required)
]</tool_call>
{choice}"""

_CHOICE = {
    "auto": "If no function call is needed, answer the user directly.",
    "required": "You must call at least one function.",
}


def template_knows_tools(tok) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself."""
    return "tools" in (getattr(tok, "chat_template", None) or "")


def _call_text(calls: list[dict], listed: bool) -> str:
    """Assistant tool calls (OpenAI form) as the text the model writes for them."""
    plain = [
        {"name": c["function"]["name"], "arguments": _loads(c["function"].get("arguments") or "{}")} for c in calls
    ]
    if listed:
        return f"{OPEN}{json.dumps(plain, ensure_ascii=False)}{CLOSE}"
    return "\n".join(f"{OPEN}\n{json.dumps(c, ensure_ascii=False)}\n{CLOSE}" for c in plain)


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


def render(
    tok,
    messages: list[dict],
    tools: list[dict] | None,
    tool_choice: Any,
    template_kwargs: dict | None = None,
    parallel: bool = True,
) -> tuple[str, dict | None]:
    """(prompt text, the structure the answer must follow or None) for a chat request; ``messages``
    in OpenAI form (assistant ``tool_calls``, ``tool`` messages with ``tool_call_id``);
    ``template_kwargs``: more variables for the chat template (e.g. Qwen3's ``enable_thinking``)."""
    own = template_knows_tools(tok)
    use = bool(tools) and tool_choice != "none"
    msgs = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            if own:
                m["tool_calls"] = [
                    {
                        "type": "function",
                        "id": c.get("id"),
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": _loads(c["function"].get("arguments") or "{}"),
                        },
                    }
                    for c in m["tool_calls"]
                ]
            else:
                text = _call_text(m.pop("tool_calls"), listed=True)
                m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
        if m["role"] == "tool" and not own:
            m = {"role": "tool", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        msgs.append(m)
    if use and not own:
        schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        choice = _CHOICE.get(tool_choice if isinstance(tool_choice, str) else "required", "")
        system = DEFAULT_TOOL_PROMPT.format(tools=schemas, choice=choice)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": f"{system}\n{msgs[0]['content'] or ''}"}
        else:
            msgs.insert(0, {"role": "system", "content": system})
    for m in msgs:
        if m.get("content") is None:
            m["content"] = ""
    kwargs = {**(template_kwargs or {}), **({"tools": list(tools)} if use and own else {})}
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    return text, structure(tools, tool_choice, own, parallel) if use else None


def structure(tools: list[dict], tool_choice: Any, own_template: bool, parallel: bool = True) -> dict | None:
    """The engine's ``structure`` for ``required`` or a named function (None for ``auto``): an
    xgrammar structural tag that admits exactly the calls :func:`parse` reads back, in the template's
    format: the default one's JSON list inside one ``<tool_call>`` block, or Hermes blocks (one call
    each, newline-separated) for a template that knows tools. A function without ``parameters``
    takes any JSON object."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
        parallel = False  # a named choice is one call of that function (as OpenAI and vLLM answer it)
    elif tool_choice == "required":
        chosen = list(tools)
    else:
        return None
    opening, end, sep = (f"{OPEN}\n", f"}}\n{CLOSE}", "\n") if own_template else ("", "}", ", ")
    tags = [
        {
            "type": "tag",
            "begin": f'{opening}{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
            "content": {
                "type": "json_schema",
                "json_schema": t["function"].get("parameters") or {"type": "object"},
                "max_whitespace_cnt": 1,  # one space at a time: small models given free whitespace may loop on it
            },
            "end": end,
        }
        for t in chosen
    ]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": sep, "at_least_one": True}
    calls["stop_after_first"] = not parallel
    if not own_template:
        calls = {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": f"{OPEN}["},
                calls,
                {"type": "const_string", "value": f"]{CLOSE}"},
            ],
        }
    return {"type": "structural_tag", "format": calls}


def parse(text: str, parallel: bool = True) -> tuple[str | None, list[dict] | None]:
    """(content, OpenAI tool calls) of a finished output; no calls: (text, None)."""
    if OPEN not in text:
        return text, None
    calls, rest, pos = [], [], 0
    for m in re.finditer(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", text, re.S):
        rest.append(text[pos : m.start()])
        pos = m.end()
        found = _calls(m.group(1))
        if found is None:
            return text, None
        calls += found
    rest.append(text[pos:])
    if not calls:
        return text, None
    if not parallel:
        calls = calls[:1]
    content = "".join(rest).strip()
    return content or None, [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
        }
        for c in calls
    ]


_DECODER = json.JSONDecoder()


def _objects(body: str) -> list | None:
    """The JSON of one block: an object or a list of them; small models often drop the commas
    between a list's objects or cut the list short, so whole objects are read one after another
    (``[`` / ``,`` / ``]`` / whitespace between them skipped) and a cut-off last one is dropped."""
    body = body.strip()
    try:
        obj = json.loads(body)
        return [obj] if isinstance(obj, dict) else obj if isinstance(obj, list) else None
    except ValueError:
        pass
    out, i = [], 0
    while i < len(body):
        if body[i] in "[],\n\t\r ":
            i += 1
            continue
        try:
            obj, i = _DECODER.raw_decode(body, i)
        except ValueError:
            break  # a cut-off or malformed object ends the block
        out.append(obj)
    return out or None


def _calls(body: str) -> list[dict] | None:
    """The calls in one block (see :func:`_objects`), or None."""
    obj = _objects(body)
    if obj is None:
        return None
    out = []
    for c in obj:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return None
        args = c.get("arguments", c.get("parameters", {}))
        args = _loads(args) if isinstance(args, str) else args
        if not isinstance(args, dict):
            return None
        out.append({"name": c["name"], "arguments": args})
    return out


class StreamSplitter:
    """Streams content deltas until a tool call may begin, then holds the rest for :func:`parse`."""

    def __init__(self) -> None:
        self.text = ""  # all output so far
        self.sent = 0  # characters of ``text`` already streamed as content
        self.holding = False

    def push(self, piece: str) -> str:
        """The content that can be streamed now."""
        self.text += piece
        if self.holding:
            return ""
        i = self.text.find(OPEN, self.sent)
        if i >= 0:
            self.holding = True
            out, self.sent = self.text[self.sent : i], i
            return out
        end = len(self.text)
        for k in range(min(len(OPEN) - 1, end - self.sent), 0, -1):  # a partial "<tool_call" may follow
            if self.text.endswith(OPEN[:k]):
                end -= k
                break
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self, parallel: bool = True) -> tuple[str, list[dict] | None]:
        """(content still to stream, tool calls or None) once the output is complete."""
        held = self.text[self.sent :]
        content, calls = parse(held, parallel)
        if calls is None:
            return held, None
        return content or "", calls
