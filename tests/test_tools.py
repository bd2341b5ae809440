"""Tool calling's text side (hvd_ray/serving/tools.py): tools and the tool-call history rendered into
the prompt by the default model's template and by a template that knows tools, the grammar that holds
``required`` / named answers to calls (compiled by xgrammar with the default tokenizer, as the engine
does), and calls parsed out of the output, whole or streamed in pieces."""

from __future__ import annotations

import json
import random

import pytest

from hvd_ray.serving import tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]
# A template that renders tools itself, as Qwen2/Qwen3's do (Hermes layout), reduced to what matters
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tok(default_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_folder)


def test_the_default_template_gets_the_default_tool_prompt_and_the_history(tok):
    assert not tools.template_knows_tools(tok)
    text, structure = tools.render(tok, HISTORY, TOOLS, "auto")
    assert structure is None  # auto: the model chooses, unconstrained
    assert "<tools>" + json.dumps(TOOLS[0]["function"]) + "</tools>" in text
    # the assistant's earlier call and the tool's answer reach the prompt, in order
    call = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    response = '<|im_start|>tool\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>'
    assert call in text and response in text and text.index(call) < text.index(response)
    assert text.endswith("<|im_start|>assistant\n")

    none, structure = tools.render(tok, HISTORY, TOOLS, "none")  # no tools offered, the history stays
    assert "<tools>" not in none and call in none and structure is None
    for choice in ("required", NAMED):
        text, structure = tools.render(tok, HISTORY[:1], TOOLS, choice)
        assert text.endswith("<|im_start|>assistant\n")  # nothing forced into the prompt: a grammar holds it
        assert structure == tools.structure(TOOLS, choice, own_template=False)


def test_a_template_that_knows_tools_renders_them_itself(tok):
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = TOOL_TEMPLATE
    assert tools.template_knows_tools(tok)
    text, structure = tools.render(tok, HISTORY, TOOLS, "auto")
    assert structure is None
    assert "# Tools\n<tools>" in text and "You are an expert in composing functions" not in text
    call = text[text.index("<|im_start|>assistant") : text.index("<|im_start|>tool")]
    assert '"name": "get_weather"' in call and '"arguments": {"city": "Paris"}' in call  # a dict, not a string
    assert '<|im_start|>tool\n{"temperature": 21}<|im_end|>' in text
    _, structure = tools.render(tok, HISTORY[:1], TOOLS, NAMED, parallel=False)
    assert structure == tools.structure(TOOLS, NAMED, own_template=True, parallel=False)


def test_chat_template_kwargs_reach_the_template(tok):
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}|{{ mood | default('plain') }}"
    assert tools.render(tok, HISTORY[:1], None, None)[0].endswith("|plain")
    assert tools.render(tok, HISTORY[:1], None, None, {"mood": "terse"})[0].endswith("|terse")


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("no call here", "no call here", None),
        ('<tool_call>[{"name": "f", "arguments": {"a": 1}}]</tool_call>', None, [("f", {"a": 1})]),
        (
            'Sure. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": '
            '{"b": "x"}}\n</tool_call>',
            "Sure.",
            [("f", {}), ("g", {"b": "x"})],
        ),
        # a small model's list without commas, cut short by max_tokens: the whole objects count
        ('<tool_call>[\n{"name": "f", "arguments": {"a": 1}}\n{"name": "g", "argu', None, [("f", {"a": 1})]),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}', None, [("f", {"a": 2})]),  # arguments as a string
        ('<tool_call>\n"not a call"\n</tool_call>', '<tool_call>\n"not a call"\n</tool_call>', None),
        ('<tool_call>[{"arguments": {}}]</tool_call>', '<tool_call>[{"arguments": {}}]</tool_call>', None),
    ],
)
def test_parse(text, content, calls):
    got_content, got = tools.parse(text)
    assert got_content == content
    if calls is None:
        assert got is None
    else:
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)
        assert len({c["id"] for c in got}) == len(got)


def test_parallel_tool_calls_false_keeps_the_first():
    _, calls = tools.parse(
        '<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]</tool_call>', parallel=False
    )
    assert [c["function"]["name"] for c in calls] == ["f"]


@pytest.mark.parametrize(
    "text",
    [
        "Just an answer, with a < sign and <tool in it.",
        'Let me check. <tool_call>[{"name": "f", "arguments": {"a": 1}}]</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "<tool_call>garbage",
    ],
)
def test_streamed_pieces_give_what_parse_gives(text):
    rng = random.Random(0)
    for _ in range(20):
        split, streamed, i = tools.StreamSplitter(), "", 0
        while i < len(text):
            n = rng.randint(1, 6)
            streamed += split.push(text[i : i + n])
            i += n
        rest, calls = split.finish()
        content, want = tools.parse(text)
        if want is None:
            assert streamed + rest == text and calls is None
        else:
            assert (streamed + rest).strip() == (content or "") and [c["function"] for c in calls] == [
                c["function"] for c in want
            ]
        assert "<tool_call" not in streamed  # a call's opening is never streamed as content


# ------------------------------------------------------------------------- the calls' grammar
TWO = TOOLS + [{"type": "function", "function": {"name": "get_time"}}]  # no parameters: any JSON object
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'


@pytest.fixture(scope="module")
def compiler(tok):
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    return xgr.GrammarCompiler(info)


def _accepts(compiler, tok, structure: dict, text: str) -> bool:
    """Whether the engine could emit ``text`` (as the tokenizer splits it) and then end the answer."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(structure)))
    return all(matcher.accept_token(t) for t in tok(text, add_special_tokens=False)["input_ids"]) and (
        matcher.accept_token(tok.eos_token_id) and matcher.is_terminated()
    )


@pytest.mark.parametrize("own", [False, True], ids=["default-template", "own-template"])
def test_the_calls_grammar_admits_what_parse_reads_as_calls_and_nothing_else(compiler, tok, own):
    def block(*calls: str) -> str:  # the calls as the template writes them
        if own:
            return "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
        return f"<tool_call>[{', '.join(calls)}]</tool_call>"

    required = tools.structure(TWO, "required", own)
    named = tools.structure(TWO, NAMED, own)
    single = tools.structure(TWO, "required", own, parallel=False)
    assert tools.structure(TWO, "auto", own) is None
    args = {"get_weather": {"city": "Paris"}, "get_time": {"zone": "CET"}}
    for structure, text, names in [
        (required, block(WEATHER), ["get_weather"]),
        (required, block(WEATHER, TIME), ["get_weather", "get_time"]),
        (named, block(WEATHER), ["get_weather"]),
        (single, block(TIME), ["get_time"]),
    ]:
        assert _accepts(compiler, tok, structure, text), text
        content, calls = tools.parse(text)
        assert content is None
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (name, args[name]) for name in names
        ]
    for structure, text in [
        (named, block(TIME)),  # not the named function
        (named, block(WEATHER, WEATHER)),  # a named choice is one call
        (single, block(WEATHER, TIME)),  # parallel_tool_calls: false allows one call
        (required, "Sure! " + block(WEATHER)),  # text around the calls
        (required, block(WEATHER) + " Done."),
        (required, ""),  # no call at all
        (required, block('{"name": "get_weather", "arguments": {}}')),  # the required "city" missing
        (required, block('{"name": "get_weather", "arguments": {"city": 3}}')),  # a number, not a string
        (required, block(WEATHER)[:-3]),  # cut short
        (required, block('{"name": "get_weather", "arguments": {\n\n  "city": "Paris"}}')),  # runs of whitespace
        (required, block('{"name": "get_news", "arguments": {}}')),  # not one of the tools
    ]:
        assert not _accepts(compiler, tok, structure, text), text


def test_a_schema_xgrammar_cannot_compile_fails_the_compile(compiler):
    """The engine compiles the structure when the request is added; its error becomes a 400 naming tools."""
    params = {"type": "object", "properties": {"a": {"type": "nope"}}}
    bad = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    with pytest.raises(Exception, match="nope"):
        compiler.compile_structural_tag(json.dumps(tools.structure(bad, "required", own_template=False)))
