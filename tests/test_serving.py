"""The Ray Serve application end to end: a real local Ray + Serve, the real default model, HTTP.

One application for the whole module (fp32, suffix drafter, max_batch 4, an API key), reached
through httpx and through the official ``openai`` client. Greedy fp32 output must equal the CLI's
(plain greedy decoding) and concurrent requests must equal their sequential outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import serve_app

from hvd_ray.serving.suffix_actor import service_actors

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

slow = pytest.mark.slow  # the integration tests (real Ray + Serve + model); the unit tests below are fast

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "sk-hvd-test"
CONFIG = {
    "model": "default",
    "dtype": "float32",
    "drafter": "suffix",
    "max_batch": 4,
    "max_model_len": 1024,
    "max_tokens": 512,
    "torch_threads": 2,
    "ray_actor_options": {"num_cpus": 0.5},
    "ingress_ray_actor_options": {"num_cpus": 0.1},
}
PROMPT = "The capital of France is"
CHAT = "Name three colours."
N = 16


@pytest.fixture(scope="module")
def base_url(default_folder):  # default_folder: the model is provisioned before Ray starts
    with serve_app(CONFIG, "hvd-test", api_key=API_KEY) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    import httpx

    with httpx.Client(base_url=base_url, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def oai(base_url):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": "default", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _chat(http, content: str, **body) -> dict:
    r = http.post(
        "/v1/chat/completions",
        json={"model": "default", "temperature": 0, "messages": [{"role": "user", "content": content}], **body},
    )
    assert r.status_code == 200, r.text
    return r.json()


def _sse(http, path: str, body: dict) -> list:
    """The parsed `data:` events of a streamed response, ending with the literal '[DONE]'."""
    events = []
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _cli(*args: str) -> str:
    """The CLI's greedy text (plain decoding, fp32): what the server must reproduce."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hvd_ray",
            "generate",
            "--dtype",
            "float32",
            "--threads",
            "2",
            "--drafter",
            "none",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n")
    return out.stdout[:-1]


@pytest.fixture(scope="module")
def greedy(http):
    """Non-streamed greedy results, shared by several tests."""
    return {"completion": _complete(http, prompt=PROMPT, max_tokens=N), "chat": _chat(http, CHAT, max_tokens=N)}


# ------------------------------------------------------------------------------------------ basics
@slow
def test_health_models_and_auth(base_url, http):
    import httpx

    assert httpx.get(f"{base_url}/health", timeout=60).json()["status"] == "ok"  # no key needed
    for path in ("/openapi.json", "/docs"):  # the API's documents are behind the key too
        assert httpx.get(f"{base_url}{path}", timeout=60).status_code == 401
        assert http.get(path).status_code == 200
    assert http.get("/redoc").status_code == 404
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "default"
    assert models["data"][0]["max_model_len"] == 1024
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(
            f"{base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers, timeout=60
        )
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@slow
def test_greedy_completion_equals_cli(greedy):
    res = greedy["completion"]
    assert res["object"] == "text_completion" and res["model"] == "default"
    choice = res["choices"][0]
    assert choice["text"] == _cli("--prompt", PROMPT, "--max-tokens", str(N))
    assert choice["finish_reason"] == "length"
    assert res["usage"]["completion_tokens"] == N
    assert res["usage"]["total_tokens"] == res["usage"]["prompt_tokens"] + N
    from hvd_ray.model import load

    _, tok = load("default", "float32")
    assert res["usage"]["prompt_tokens"] == len(tok(PROMPT)["input_ids"])


@slow
def test_greedy_chat_equals_cli(greedy):
    res = greedy["chat"]
    assert res["object"] == "chat.completion"
    msg = res["choices"][0]["message"]
    assert msg["role"] == "assistant"
    cli = _cli("--chat", "--prompt", CHAT, "--max-tokens", str(N))
    assert msg["content"] == cli
    assert res["choices"][0]["finish_reason"] in ("length", "stop")
    assert res["usage"]["prompt_tokens"] > 20  # the template's system prompt is there


@slow
def test_streamed_equals_non_streamed(http, greedy):
    ev = _sse(
        http,
        "/v1/completions",
        {"model": "default", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "stream": True},
    )
    assert ev[-1] == "[DONE]" and len(ev) > 3
    chunks = ev[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == greedy["completion"]["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1

    ev = _sse(
        http,
        "/v1/chat/completions",
        {
            "model": "default",
            "messages": [{"role": "user", "content": CHAT}],
            "max_tokens": N,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert ev[-1] == "[DONE]"
    usage, chunks = ev[-2], ev[:-2]
    assert usage["choices"] == []
    want = greedy["chat"]["usage"]
    assert {k: usage["usage"][k] for k in want if k != "prompt_tokens_details"} == {
        k: v for k, v in want.items() if k != "prompt_tokens_details"
    }
    # the same prompt again: its K/V may still be in a slot (prefix reuse), never the last token's
    assert 0 <= usage["usage"]["prompt_tokens_details"]["cached_tokens"] < want["prompt_tokens"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == greedy["chat"]["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == greedy["chat"]["choices"][0]["finish_reason"]


@slow
def test_openai_client(oai, greedy):
    import openai

    c = oai.completions.create(model="default", prompt=PROMPT, max_tokens=N, temperature=0)
    assert c.choices[0].text == greedy["completion"]["choices"][0]["text"]
    assert c.usage.completion_tokens == N
    ch = oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": CHAT}], max_tokens=N, temperature=0
    )
    assert ch.choices[0].message.content == greedy["chat"]["choices"][0]["message"]["content"]
    stream = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": CHAT}],
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == ch.choices[0].message.content
    assert usage.total_tokens == ch.usage.total_tokens
    assert [m.id for m in oai.models.list().data] == ["default"]
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="default", prompt=PROMPT, max_tokens=2, n=17)
    bad = openai.OpenAI(base_url=oai.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
]


def _streamed_call(oai, **kw) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish reason) of a streamed chat completion, put back together."""
    content, calls, finish = "", [], None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for c in d.tool_calls or []:
            assert c.index == len(calls) and c.id.startswith("call_") and c.type == "function"
            calls.append({"name": c.function.name, "arguments": c.function.arguments})
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@slow
def test_an_agent_loop_with_tools_over_the_openai_client(oai):
    """tools -> tool_calls -> the tool's answer -> a final answer, streamed and not. A named
    tool_choice holds the answer to a call of that function, its arguments valid under the function's
    schema (a grammar); the parser returns it as ``message.tool_calls`` (finish_reason ``tool_calls``),
    the streamed call equals the non-streamed one (greedy), and the conversation carrying the call and
    its result is served. ``required`` with ``parallel_tool_calls: false`` gives exactly one call."""
    import jsonschema

    named = {"type": "function", "function": {"name": "get_weather"}}
    for city in ("Paris", "Tokyo", "Lima"):
        msgs = [{"role": "user", "content": f"What is the weather in {city} right now?"}]
        kw = {
            "model": "default",
            "messages": msgs,
            "tools": TOOLS,
            "tool_choice": named,
            "temperature": 0,
            "max_tokens": 48,
        }
        r = oai.chat.completions.create(**kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch.message.content
        call = ch.message.tool_calls[0]
        assert call.function.name == "get_weather" and ch.message.content is None
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
        content, calls, finish = _streamed_call(oai, **kw)
        assert finish == "tool_calls" and (content or None) == ch.message.content
        assert calls == [{"name": c.function.name, "arguments": c.function.arguments} for c in ch.message.tool_calls]
        msgs += [
            ch.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": city, "celsius": 21})},
        ]
        final = oai.chat.completions.create(model="default", messages=msgs, tools=TOOLS, temperature=0, max_tokens=32)
        assert final.choices[0].finish_reason in ("stop", "length", "tool_calls"), final
        assert final.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result reached the prompt
    none = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hi!"}],
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=8,
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    joke = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Tell me a joke."}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=48,
    )
    assert joke.choices[0].finish_reason == "tool_calls", joke
    (call,) = joke.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


# ----------------------------------------------------------------------- what a request can ask for
ANSWER = {  # a short JSON answer: it fits max_tokens 32 whole
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "count": {"type": "integer", "minimum": 0}},
    "required": ["answer", "count"],
    "additionalProperties": False,
}


@slow
def test_response_format_json_schema(http):
    """The answer is JSON valid under the schema, chat and completions (a vLLM extension) alike."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    res = _chat(http, "Is Paris in France? How many cities named Paris exist?", max_tokens=32, response_format=fmt)
    assert res["choices"][0]["finish_reason"] == "stop", res
    jsonschema.validate(json.loads(res["choices"][0]["message"]["content"]), ANSWER)
    res = _complete(http, prompt="Is Paris in France? JSON answer:", max_tokens=32, response_format=fmt)
    assert res["choices"][0]["finish_reason"] == "stop", res
    jsonschema.validate(json.loads(res["choices"][0]["text"]), ANSWER)


@slow
def test_logprobs(http, greedy):
    """Each output token's logprob and the top k, chat and completions, streamed or not; greedy, the
    chosen token is the top one (the logprobs are the target's raw distribution)."""
    res = _complete(http, prompt=PROMPT, max_tokens=N, logprobs=3)
    choice, lp = res["choices"][0], res["choices"][0]["logprobs"]
    assert choice["text"] == greedy["completion"]["choices"][0]["text"]  # asking for logprobs changes nothing
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == N
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(N)]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 3 and top[token] == logprob == pytest.approx(max(top.values()), abs=1e-5)
        assert logprob <= 0
    body = {"model": "default", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "logprobs": 3, "stream": True}
    stream = _sse(http, "/v1/completions", body)
    parts = [c["choices"][0]["logprobs"] for c in stream[:-1] if c["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]  # offsets run on across chunks

    res = _chat(http, CHAT, max_tokens=N, logprobs=True, top_logprobs=2)
    assert res["choices"][0]["message"] == greedy["chat"]["choices"][0]["message"]
    content = res["choices"][0]["logprobs"]["content"]
    assert len(content) == res["usage"]["completion_tokens"]
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 2 and entry["token"] == top[0]["token"] and top[0]["logprob"] >= top[1]["logprob"]
        assert entry["logprob"] == pytest.approx(top[0]["logprob"], abs=1e-5)
        assert entry["bytes"] == list(entry["token"].encode())
    body = {"model": "default", "messages": [{"role": "user", "content": CHAT}], "max_tokens": N, "temperature": 0}
    stream = _sse(http, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 2, "stream": True})
    streamed = [e for c in stream[:-1] if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    # the same tokens; the values may differ in the last digits (this time the prompt's K/V is reused)
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-3)
    assert _chat(http, CHAT, max_tokens=2)["choices"][0]["logprobs"] is None  # not asked for


@slow
def test_n_choices(http):
    """``n`` choices of one prompt (indexes 0..n-1), streamed and not; usage counts the prompt once and
    the choices' tokens together; greedy choices are identical, seeded sampled ones differ (seed + i)."""
    res = _complete(http, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True)
    assert [c["index"] for c in res["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in res["choices"]}) > 1
    single = _complete(http, prompt="Once upon a time", max_tokens=1)
    assert res["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert res["usage"]["completion_tokens"] == 3 * 8
    res = _chat(http, CHAT, max_tokens=8, n=2)
    assert res["choices"][0]["message"] == res["choices"][1]["message"]  # greedy: the same answer twice

    body = {"model": "default", "messages": [{"role": "user", "content": CHAT}], "max_tokens": 6, "n": 3}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    ev = _sse(http, "/v1/chat/completions", {**body, **stream, "temperature": 0.8, "ignore_eos": True})
    assert ev[-1] == "[DONE]" and ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 18
    chunks = [c["choices"][0] for c in ev[:-2]]
    assert [c["index"] for c in chunks[:3]] == [0, 1, 2] and all(c["delta"]["role"] == "assistant" for c in chunks[:3])
    assert sorted(c["index"] for c in chunks if c["finish_reason"]) == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in chunks if c["finish_reason"])
    for i in range(3):
        mine = [c for c in chunks if c["index"] == i]
        assert mine[-1]["finish_reason"] and "".join(c["delta"].get("content", "") for c in mine)


@slow
def test_penalties_logit_bias_and_min_tokens_change_the_output(http, greedy, default_folder):
    """Each processing parameter reaches the engine: the penalties change the greedy text, a -100 bias
    bans the greedy first token and +100 forces one, min_p keeps greedy's argmax, min_tokens holds the
    stop tokens off."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_folder)
    text = greedy["completion"]["choices"][0]["text"]  # " Paris.\n\nThe answer is: ..."
    (paris,) = tok.encode(" Paris", add_special_tokens=False)
    (london,) = tok.encode(" London", add_special_tokens=False)
    assert text.startswith(" Paris")
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.5}):
        assert _complete(http, prompt=PROMPT, max_tokens=N, **kw)["choices"][0]["text"] != text, kw
    banned = _complete(http, prompt=PROMPT, max_tokens=2, logit_bias={str(paris): -100})
    assert not banned["choices"][0]["text"].startswith(" Paris")
    forced = _complete(http, prompt=PROMPT, max_tokens=2, logit_bias={str(london): 100})
    assert forced["choices"][0]["text"] == " London London"
    assert text.startswith(_complete(http, prompt=PROMPT, max_tokens=4, min_p=0.5)["choices"][0]["text"])  # greedy
    (dot,) = tok.encode(".", add_special_tokens=False)
    short = _complete(http, prompt=PROMPT, max_tokens=8, stop_token_ids=[dot])  # " Paris", then "." stops it
    assert short["choices"][0]["finish_reason"] == "stop" and short["choices"][0]["text"] == " Paris", short
    held = _complete(http, prompt=PROMPT, max_tokens=8, stop_token_ids=[dot], min_tokens=4)
    assert held["usage"]["completion_tokens"] >= 4 and held["choices"][0]["text"] != short["choices"][0]["text"]


@slow
def test_stop_strings(http, greedy):
    full = greedy["completion"]["choices"][0]["text"]
    assert "\n\n" in full, full  # " Paris.\n\nThe answer ..." for this model
    want = full[: full.index("\n\n")]
    res = _complete(http, prompt=PROMPT, max_tokens=N, stop="\n\n")
    assert res["choices"][0]["text"] == want and res["choices"][0]["finish_reason"] == "stop"
    assert res["usage"]["completion_tokens"] < N
    # streamed: the held-back "\n" of a possible stop string must never leak into a chunk
    ev = _sse(
        http,
        "/v1/completions",
        {
            "model": "default",
            "prompt": PROMPT,
            "max_tokens": N,
            "temperature": 0,
            "stop": ["zzz", "\n\n"],
            "stream": True,
        },
    )
    assert "".join(c["choices"][0]["text"] for c in ev[:-1]) == want
    assert ev[-2]["choices"][0]["finish_reason"] == "stop"


@slow
def test_sampling(http):
    """A seeded request replays exactly, n=4 choices included, though the suffix drafter's global tree
    changed in between (each output position's draw is keyed by seed and position)."""
    body = dict(prompt="Once upon a time", max_tokens=8, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    res = _complete(http, **body)
    assert res["choices"][0]["finish_reason"] in ("length", "stop")
    assert 1 <= res["usage"]["completion_tokens"] <= 8
    four = _complete(http, **{**body, "n": 4, "max_tokens": 16})
    _complete(http, prompt="Once upon a time there was a dragon", max_tokens=16)  # the trees move on
    again = _complete(http, **{**body, "n": 4, "max_tokens": 16})
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in four["choices"]]
    assert len({c["text"] for c in four["choices"]}) > 1
    assert four["choices"][0]["text"].startswith(res["choices"][0]["text"])  # choice 0 samples with the seed


@slow
def test_concurrent_requests_equal_sequential(http):
    prompts = ["def fibonacci(n):", "The three primary colours are", "In 1969, astronauts", "import numpy as np\n"]
    seq = [_complete(http, prompt=p, max_tokens=20)["choices"][0]["text"] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        conc = list(pool.map(lambda p: _complete(http, prompt=p, max_tokens=20)["choices"][0]["text"], prompts))
    assert conc == seq


@slow
def test_metrics_are_exported(http):
    """The replica's metrics reach Ray's Prometheus endpoint (exported every few seconds)."""
    import httpx
    import ray

    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    want = [
        "ray_hvd_requests_total",
        "ray_hvd_generated_tokens_total",
        "ray_hvd_time_to_first_token_seconds",
        "ray_hvd_mean_accepted_tokens_per_forward",
        "ray_hvd_queue_length",
        "ray_hvd_cache_chosen_rate",
    ]
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        missing = [m for m in want if m not in text]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, missing
    mat = [line for line in text.splitlines() if line.startswith("ray_hvd_mean_accepted_tokens_per_forward{")]
    assert mat and float(mat[0].rsplit(" ", 1)[1]) >= 1.0
    rate = [line for line in text.splitlines() if line.startswith("ray_hvd_cache_chosen_rate{")]
    assert rate and 0.0 < float(rate[0].rsplit(" ", 1)[1]) <= 1.0  # the suffix drafter drafted


# ------------------------------------------------------------------------------------------ errors
MSG = [{"role": "user", "content": "hi"}]
NOPE = {"type": "object", "properties": {"a": {"type": "nope"}}}  # a schema xgrammar cannot compile
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": NOPE}}
BAD_TOOLS = {"tools": [{"type": "function", "function": {"name": "f", "parameters": NOPE}}], "tool_choice": "required"}


@slow
@pytest.mark.parametrize(
    "path,body,status,param,code",
    [
        ("/v1/completions", b"{not json", 400, None, "invalid_json"),
        ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", None),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
        ("/v1/completions", {"max_tokens": 4}, 400, "prompt", None),
        ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model", "model_not_found"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens", None),
        ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n", None),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", None),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"49152": 1}, "max_tokens": 2}, 400, "logit_bias", None),
        ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens", None),
        ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", None),
        ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format", None),
        ("/v1/chat/completions", {"messages": MSG, "response_format": BAD_SCHEMA}, 400, "response_format", None),
        ("/v1/chat/completions", {"messages": MSG, **BAD_TOOLS}, 400, "tools", None),
        (
            "/v1/chat/completions",
            {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            400,
            "tool_choice",
            None,
        ),
        (
            "/v1/chat/completions",
            {
                "messages": MSG,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            400,
            "stream_options",
            "unsupported_parameter",
        ),
        ("/v1/chat/completions", {"messages": MSG, "audio": {"voice": "alloy"}}, 400, "audio", "unsupported_parameter"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
        ("/v1/completions", {"prompt": "hello " * 1100, "max_tokens": 4}, 400, "prompt", "context_length_exceeded"),
        (
            "/v1/completions",
            {"prompt": "hello " * 600, "max_tokens": 500},
            400,
            "max_tokens",
            "context_length_exceeded",
        ),
        ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", None),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 0},
            400,
            "max_tokens",
            None,
        ),
    ],
)
def test_errors_are_openai_shaped(http, path, body, status, param, code):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    if code:
        assert err["code"] == code


@slow
def test_unknown_route_is_openai_shaped(http):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


# ------------------------------------------------------------------------------------ cancellation
# A request that cannot finish before its client hangs up. Sampled, not greedy: a greedy count
# repeats itself, so once the suffix tree holds it, 500 tokens took 0.85 s here (CI ran one to
# its end inside a 3 s client timeout); sampled at temperature 1 the cache drafts little.
LONG = {
    "model": "default",
    "prompt": "Count: one, two,",
    "max_tokens": 500,
    "temperature": 1.0,
    "seed": 7,
    "ignore_eos": True,
}


def _wait_idle(http, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = http.get("/stats").json()
        if s["running"] == 0 and s["waiting"] == 0:
            return s
        if time.monotonic() > deadline:
            return s
        time.sleep(0.25)


@slow
def test_a_second_turn_reuses_the_first_turns_kv(http):
    """An agent loop re-sends the conversation: the second turn prefills only what is new, and usage
    reports the rest as cached (OpenAI's prompt_tokens_details; engine outputs: test_prefix_reuse.py)."""
    _wait_idle(http)
    before = http.get("/stats").json()
    # a prompt longer than the engine's MIN_REUSE (32 tokens): re-tokenised with the answer's text, the
    # answer's tokens may come out differently, but the prompt's stay
    ask = (
        "Office supplies: paper clips, staples, pens, pencils, erasers, rulers, scissors, tape, glue sticks, "
        "sticky notes, folders and binders. List three uses of a paper clip:"
    )
    first = _complete(http, prompt=ask, max_tokens=24)
    assert first["usage"]["prompt_tokens"] > 32
    turn = ask + first["choices"][0]["text"] + "\nNow three more:"
    second = _complete(http, prompt=turn, max_tokens=24)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # (at least the first prompt but its last token, which may merge with the answer's first)
    assert first["usage"]["prompt_tokens"] - 1 <= cached < second["usage"]["prompt_tokens"], second["usage"]
    after = _wait_idle(http)
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] >= cached
    assert after["prefill_s"] > before["prefill_s"]  # the second turn still prefilled its new tokens
    assert (
        after["prompt_tokens"] - before["prompt_tokens"]
        == first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    )


@slow
def test_client_disconnect_frees_the_slot(http):
    before = _wait_idle(http)
    body = {**LONG, "stream": True}
    got = 0
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break  # leaving the block closes the connection mid-generation
    t0 = time.monotonic()
    after = _wait_idle(http, timeout=60)
    # 500 sampled tokens take 10+ s on this box; an aborted request is gone within a few steps
    assert after["running"] == 0 and after["waiting"] == 0, after
    assert after["aborted"] == before["aborted"] + 1
    assert time.monotonic() - t0 < 60
    res = _complete(http, prompt=PROMPT, max_tokens=4)
    assert res["choices"][0]["finish_reason"] == "length" and res["usage"]["completion_tokens"] == 4
    assert http.get("/health").json()["status"] == "ok"


@slow
def test_client_timeout_on_non_streamed_request_frees_the_slot(base_url, http):
    """A client that gives up on a non-streamed request (closes its connection, as a client timeout
    does) frees the slot: the request is aborted, not run to its end. The connection closes once the
    replica runs the request (``/stats``): a fixed 2 s client timeout could expire while the request
    still sat in Serve's queue on a loaded box, where Serve drops it before our code sees it."""
    import socket
    from urllib.parse import urlparse

    before = _wait_idle(http)
    url, body = urlparse(base_url), json.dumps(LONG).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Authorization: {http.headers['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
        conn.sendall(head + body)
        deadline = time.monotonic() + 60
        while http.get("/stats").json()["running"] == 0:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.1)
    after = _wait_idle(http, timeout=60)
    assert after["running"] == 0 and after["waiting"] == 0, after
    assert after["aborted"] == before["aborted"] + 1
    assert after["finished"] == before["finished"]  # it did not run to its end


@slow
def test_96_cancelled_streams_leave_no_state(base_url, http):
    """Clients that hang up (before or after the first token) leave no slot, queue entry or
    suffix-tree request behind, in the replica or in the shared drafter actor."""
    import httpx
    import ray

    before = _wait_idle(http)
    body = {"model": "default", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}

    def one(i: int) -> None:
        with httpx.Client(base_url=base_url, timeout=120, headers=http.headers) as c:
            with c.stream("POST", "/v1/completions", json={**body, "prompt": f"Story number {i}:"}) as r:
                assert r.status_code == 200
                if i % 4 == 0:
                    return  # hang up before reading anything
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        return  # hang up after the first event

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(96)))
    after = _wait_idle(http, timeout=120)
    assert after["running"] == 0 and after["waiting"] == 0, after
    assert after["free_slots"] == after["slots"] == CONFIG["max_batch"] + 4, after  # + the default reuse_slots
    assert after["finished"] == before["finished"]  # nothing ran to its end
    assert after["aborted"] > before["aborted"]
    deadline = time.monotonic() + 30  # the replica ships the last `end`s to the actor when idle
    while True:
        s = http.get("/stats").json()
        (actor,) = service_actors(CONFIG.get("suffix_actor_name", "hvd-suffix-drafter")).values()
        if s["live_drafter_requests"] == 0 and ray.get(actor.stats.remote())["requests"] == 0:
            break
        assert time.monotonic() < deadline, (s, ray.get(actor.stats.remote()))
        time.sleep(0.5)
    assert _complete(http, prompt=PROMPT, max_tokens=4)["usage"]["completion_tokens"] == 4


@slow
def test_killing_the_suffix_actor_fails_no_request(http):
    """The shared suffix-drafter actor dies mid-load: every request still completes, with exactly
    the greedy output (drafts change speed, not text), and drafting resumes after Ray restarts it."""
    import ray
    from ray.exceptions import ActorUnavailableError

    prompts = ["def add(a, b):", "The three primary colours are", "import numpy as np\n", "Dear Sir,"]
    want = [_complete(http, prompt=p, max_tokens=40)["choices"][0]["text"] for p in prompts]
    (actor,) = service_actors("hvd-suffix-drafter").values()
    first = ray.get(actor.stats.remote())["incarnation"]
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(_complete, http, prompt=p, max_tokens=40) for p in prompts * 2]
        deadline = time.monotonic() + 60
        while http.get("/stats").json()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        ray.kill(actor, no_restart=False)  # Ray restarts it, empty
        got = [f.result()["choices"][0]["text"] for f in futs]  # _complete asserts HTTP 200
    assert got == want * 2

    deadline = time.monotonic() + 60
    while True:
        try:
            if ray.get(actor.stats.remote(), timeout=30)["incarnation"] != first:
                break
        except ActorUnavailableError:
            pass
        assert time.monotonic() < deadline, "Ray did not restart the suffix drafter actor"
        time.sleep(0.2)
    assert _complete(http, prompt=prompts[0], max_tokens=40)["choices"][0]["text"] == want[0]
    stats = http.get("/stats").json()["drafters"]["suffix"]
    assert stats["calls"] > 0 and stats["live_requests"] == 0
    assert ray.get(actor.stats.remote())["cached_requests"] >= 1  # the new actor holds new history


# ------------------------------------------------------------------------------- fast unit tests
class _CharTok:
    """Ids are code points, except that ids 0, 1 are the two bytes of "é" (0 alone is unfinished)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\ufffd" if i == 0 else chr(i) for i in ids).replace("\ufffd\x01", "é")


def _push_all(stops, text, tok_ids=None):
    from hvd_ray.engine.text import TextStreamer

    st = TextStreamer(_CharTok(), stops)
    pieces = [st.push([i]) for i in (tok_ids or [ord(c) for c in text])]
    if not st.stopped:
        pieces.append(st.flush())
    return pieces, st.stopped


def test_stop_text_cuts_and_never_leaks_a_partial_stop():
    pieces, stopped = _push_all(["\n\n"], "ab\n\ncd")
    assert stopped and "".join(pieces) == "ab" and pieces[2] == ""  # the first "\n" was held back
    pieces, stopped = _push_all(["\n\n"], "a\nb")
    assert not stopped and "".join(pieces) == "a\nb" and pieces[1] == "" and pieces[2] == "\nb"
    pieces, stopped = _push_all(["END", "xyz"], "go ENx END")
    assert stopped and "".join(pieces) == "go ENx "
    pieces, stopped = _push_all([], "", tok_ids=[ord("a"), 0, 1, ord("b")])
    assert pieces[:4] == ["a", "", "é", "b"]  # an unfinished character is never streamed


def test_protocol_validation():
    from hvd_ray.serving import protocol as P

    assert P.CompletionRequest(prompt=["hi"]).single_prompt() == {"prompt": "hi"}
    assert P.CompletionRequest(prompt=[1, 2, 3]).single_prompt() == {"prompt_token_ids": [1, 2, 3]}
    assert P.CompletionRequest(prompt=[[4, 5]]).single_prompt() == {"prompt_token_ids": [4, 5]}
    with pytest.raises(P.APIError) as e:
        P.CompletionRequest(prompt=["a", "b"]).single_prompt()
    assert e.value.status == 400 and e.value.param == "prompt"
    assert P.CompletionRequest(prompt="x", stop=["", "a"]).stop_list() == ["a"]
    assert P.CompletionRequest(prompt="x", stop="\n").stop_list() == ["\n"]
    msg = P.ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert msg.text() == "ab"
    with pytest.raises(P.APIError):
        P.ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}]).text()
    chat = P.ChatCompletionRequest(messages=[{"role": "developer", "content": "be brief"}], max_completion_tokens=5)
    assert chat.chat_messages()[0]["role"] == "system" and chat.requested_max_tokens == 5
    tool = [{"type": "function", "function": {"name": "f"}}]
    for bad, param in [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true, as in OpenAI's API
        ({"min_tokens": 5, "max_completion_tokens": 4}, "min_tokens"),
        ({"tools": tool, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]:
        with pytest.raises(P.APIError) as e:
            P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **bad).check_supported()
        assert e.value.status == 400 and e.value.param == param
    with pytest.raises(P.APIError) as e:
        P.CompletionRequest(prompt="x", best_of=2).check_supported()
    assert e.value.param == "best_of"


def test_protocol_sampling_reaches_the_engine_params():
    """Every sampling field of a request becomes the engine's SamplingParams field of the same meaning."""
    from hvd_ray.engine import SamplingParams
    from hvd_ray.serving import protocol as P

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = P.ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.2,
        min_p=0.1,
        min_tokens=2,
        logit_bias={"17": -100, "3": 2.5},
        logprobs=True,
        top_logprobs=3,
        n=4,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
    )
    chat.check_supported()
    sp = chat.sampling(8)
    assert sp["logit_bias"] == {17: -100.0, 3: 2.5} and sp["logprobs"] == 3
    assert sp["structure"] == {"type": "json_schema", "schema": schema}
    engine = SamplingParams(**sp)  # every key is a SamplingParams field, in its range
    assert (engine.presence_penalty, engine.frequency_penalty, engine.repetition_penalty) == (0.5, -1.0, 1.2)
    assert (engine.min_p, engine.min_tokens) == (0.1, 2)
    bare = P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert bare.sampling(None)["logprobs"] is None and bare.sampling(None)["structure"] is None
    plain = P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert plain.sampling(None)["logprobs"] == 0  # logprobs without top_logprobs: the chosen tokens only
    for fmt, want in [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"type": "json_object"}),
        ({"type": "json_schema", "json_schema": {"name": "any"}}, {"type": "json_object"}),  # no schema: any object
    ]:
        assert P.CompletionRequest(prompt="x", response_format=fmt).sampling(4)["structure"] == want
    assert P.CompletionRequest(prompt="x", logprobs=5).sampling(4)["logprobs"] == 5


def test_logprobs_in_openai_shapes():
    """The replica's ``[token text, logprob, [[text, logprob], ...]]`` entries as OpenAI's chat and
    (legacy) completion ``logprobs``."""
    from hvd_ray.serving import protocol as P

    entries = [[" Paris", -0.25, [[" Paris", -0.25], [" Lyon", -2.0]]], ["é", -1.5, [["é", -1.5], ["e", -1.75]]]]
    chat = P.chat_logprobs(entries)["content"]
    assert chat[0] == {
        "token": " Paris",
        "logprob": -0.25,
        "bytes": list(b" Paris"),
        "top_logprobs": [
            {"token": " Paris", "logprob": -0.25, "bytes": list(b" Paris")},
            {"token": " Lyon", "logprob": -2.0, "bytes": list(b" Lyon")},
        ],
    }
    assert chat[1]["bytes"] == [0xC3, 0xA9]
    comp = P.completion_logprobs(entries, offset=4)
    assert comp == {
        "tokens": [" Paris", "é"],
        "token_logprobs": [-0.25, -1.5],
        "top_logprobs": [{" Paris": -0.25, " Lyon": -2.0}, {"é": -1.5, "e": -1.75}],
        "text_offset": [4, 10],
    }
    # logprobs: 0 still names the chosen token (OpenAI: up to k + 1 entries)
    assert P.completion_logprobs([["a", -0.5, []]])["top_logprobs"] == [{"a": -0.5}]


class _Loop:
    """The engine loop's surface, recording what a replica asks of it."""

    def __init__(self):
        self.submitted, self.aborted = [], []

    def submit(self, ids, params, req_id, stream):
        self.submitted.append((req_id, params, stream))

    def abort(self, req_id):
        self.aborted.append(req_id)

    def shutdown(self):
        pass


def _front(folder):
    """A replica's request path (ReplicaFront) over the default tokenizer and a recording loop."""
    from transformers import AutoTokenizer

    from hvd_ray.serving import ServingConfig
    from hvd_ray.serving.replica_front import ReplicaFront

    tokenizer = AutoTokenizer.from_pretrained(folder)

    class Front(ReplicaFront):
        max_len, vocab_size, tok = 512, len(tokenizer), tokenizer

        def __init__(self):
            self.cfg, self.loop = ServingConfig(), _Loop()

    return Front


def test_the_replica_runs_n_choices_as_engine_requests_and_multiplexes_their_events(default_folder):
    """``n`` engine requests on one prompt (ids ``<id>-<i>``, seeds seed + i), their events tagged with
    the choice's index; a stop string ends its choice alone (its engine request aborted, the tokens past
    it neither counted nor given logprobs); a client that leaves aborts every choice still running."""
    import asyncio

    from hvd_ray.serving.engine_loop import deliver

    Front = _front(default_folder)
    tok = Front.tok

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    def step(tokens, finished=False, reason=None):
        lps = [(-0.5, [(t, -0.5), (0, -3.0)]) for t in tokens]
        return {"type": "tokens", "tokens": tokens, "finished": finished, "finish_reason": reason, "logprobs": lps}

    params = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "stop": [" STOP"], "logprobs": 1}

    async def run(leave_early: bool):
        front = Front()
        gen = front.generate({"prompt": "Hello", "params": params, "n": 3, "request_id": "r"})
        start = await gen.__anext__()
        assert start["type"] == "start" and start["n"] == 3
        (s0, s1, s2) = [s for _, _, s in front.loop.submitted]
        assert [r for r, _, _ in front.loop.submitted] == ["r-0", "r-1", "r-2"]
        assert [p.seed for _, p, _ in front.loop.submitted] == [7, 8, 9]
        deliver(s1, step(ids(" one two")))
        deliver(s0, step(ids(" a STOP b c")))  # a stop string inside one step
        deliver(s1, step(ids(" three"), True, "length"))
        events = [await gen.__anext__() for _ in range(5)]
        if leave_early:
            await gen.aclose()
            return front, events
        deliver(s0, step([], True, "abort"))  # what the engine sends for the aborted r-0: ignored
        deliver(s2, step(ids(" x"), True, "stop"))
        events += [ev async for ev in gen]
        return front, events

    front, events = asyncio.run(run(leave_early=False))
    by = {i: [e for e in events if e["index"] == i] for i in range(3)}
    assert [e["type"] for e in by[0]] == ["delta", "finish"] and by[0][0]["text"] == " a"
    assert by[0][1]["finish_reason"] == "stop" and by[0][1]["completion_tokens"] == len(ids(" a STOP"))
    assert [e[0] for e in by[0][0]["logprobs"]] == [tok.decode([t]) for t in ids(" a STOP")]
    assert by[0][0]["logprobs"][0][2] == [[tok.decode([ids(" a")[0]]), -0.5], [tok.decode([0]), -3.0]]
    assert "".join(e.get("text", "") for e in by[1]) == " one two three" and by[1][-1]["finish_reason"] == "length"
    assert by[1][-1]["completion_tokens"] == len(ids(" one two")) + len(ids(" three"))
    assert by[2][-1]["finish_reason"] == "stop" and [e["type"] for e in events].count("finish") == 3
    assert front.loop.aborted == ["r-0"]  # the stop string's choice only

    front, events = asyncio.run(run(leave_early=True))
    assert sorted(front.loop.aborted) == ["r-0", "r-2"]  # r-1 had finished


def test_stream_interval_sends_a_streams_tokens_in_fewer_events_and_loses_none(target, prompts):
    """``stream_interval``: a request's first tokens go out at once, then events of at least that many
    tokens (with their logprobs), and the finish at once; the tokens are exactly those of one event
    per step, and an aborted request's held tokens are dropped with it."""
    import asyncio

    from hvd_ray.build import EngineSpec, build_engine
    from hvd_ray.engine import SamplingParams
    from hvd_ray.serving.engine_loop import EngineLoop, Stream

    model, tok = target
    params = SamplingParams(max_tokens=21, ignore_eos=True, logprobs=1)

    async def run(interval: int):
        loop = asyncio.get_running_loop()
        el = EngineLoop(
            build_engine(EngineSpec(drafter="suffix", max_batch=2, max_len=1024), model, tok), None, interval
        )
        streams = [Stream(loop, asyncio.Queue()) for _ in range(3)]
        for i, s in enumerate(streams[:2]):
            el.submit(prompts[i], params, f"r{i}", s)
        events = [[], []]
        for i, s in enumerate(streams[:2]):
            while not (events[i] and events[i][-1]["finished"]):
                events[i].append(await asyncio.wait_for(s.queue.get(), 120))
        el.submit(prompts[2], SamplingParams(max_tokens=200, ignore_eos=True), "r2", streams[2])
        first = await asyncio.wait_for(streams[2].queue.get(), 120)
        el.abort("r2")
        last = first
        while not last["finished"]:
            last = await asyncio.wait_for(streams[2].queue.get(), 120)
        el.shutdown()
        return events, (first, last), el

    each, _, _ = asyncio.run(run(1))
    held, (first, last), el = asyncio.run(run(4))
    for one, few in zip(each, held):
        assert sum((e["tokens"] for e in few), []) == sum((e["tokens"] for e in one), []) and len(few) < len(one)
        assert [lp for e in few for lp in e["logprobs"]] == [lp for e in one for lp in e["logprobs"]]
        assert few[0]["tokens"] and all(len(e["tokens"]) >= 4 for e in few[1:-1]) and few[-1]["finished"]
        assert all(len(e["logprobs"]) == len(e["tokens"]) for e in few)
    assert first["tokens"] and last["finished"] and last["finish_reason"] == "abort"
    assert not el._held and not el._started  # nothing kept for a request that ended


def test_the_replica_names_the_parameter_behind_an_engine_refusal(default_folder):
    """Out-of-range values the engine refuses, and ids beyond the vocabulary, are 400s naming their
    parameter; a structure the engine cannot compile names ``tools`` when the tools made it."""
    import asyncio

    from hvd_ray.serving.engine_loop import deliver
    from hvd_ray.serving.replica_front import ClientError

    front = _front(default_folder)()
    base = {"max_tokens": None, "temperature": 0.0}
    for extra, param in [
        ({"logit_bias": {front.vocab_size: 1.0}}, "logit_bias"),
        ({"min_tokens": 10**6}, "min_tokens"),
    ]:
        with pytest.raises(ClientError) as e:
            front._params({"params": {**base, **extra}}, 10, "prompt")
        assert e.value.param == param, e.value.message

    async def refused(req: dict) -> dict:
        gen = front.generate(req)
        assert (await gen.__anext__())["type"] == "start"
        _, params, stream = front.loop.submitted[-1]
        param = "response_format" if params.structure is not None else None  # as the engine loop names it
        deliver(stream, {"type": "error", "status": 400, "message": "bad schema", "param": param})
        return await gen.__anext__()

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    msgs = [{"role": "user", "content": "hi"}]
    ev = asyncio.run(refused({"messages": msgs, "tools": [tool], "tool_choice": "required", "params": base}))
    assert ev["type"] == "error" and ev["param"] == "tools"
    fmt = {**base, "structure": {"type": "json_object"}}
    assert asyncio.run(refused({"messages": msgs, "params": fmt}))["param"] == "response_format"


def test_protocol_limits():
    """Every range the limits table (docs/serving.md) promises, at the pydantic level (before any work)."""
    from pydantic import ValidationError

    from hvd_ray.serving import protocol as P

    ok = {"prompt": "x"}
    for field, bad, good in [
        ("seed", 2**63, 2**63 - 1),
        ("seed", -1, 0),
        ("temperature", 1e-45, 1e-5),
        ("temperature", 2.01, 0),
        ("temperature", float("nan"), 1.0),
        ("top_p", 0.0, 1e-3),
        ("top_k", 2**31, 2**31 - 1),
        ("stop", ["a"] * 5, ["a"] * 4),
        ("stop", "s" * 257, "s" * 256),
        ("stop_token_ids", [0] * 65, [0] * 64),
        ("stop_token_ids", [2**31], [2**31 - 1]),
        ("n", 17, 16),
        ("n", 0, 1),
        ("presence_penalty", 2.01, 2),
        ("frequency_penalty", -2.01, -2),
        ("repetition_penalty", 5e-324, 0.01),  # a denormal one would make the logits infinite
        ("repetition_penalty", 100.5, 100),
        ("min_p", 1.01, 1),
        ("min_tokens", -1, 0),
        ("logprobs", 21, 20),
        ("logit_bias", {"x1": 1}, {"1": 1}),
        ("logit_bias", {"1": 100.5}, {"1": -100}),
        ("logit_bias", {str(2**31): 1}, {str(2**31 - 1): 1}),
        ("response_format", {"type": "xml"}, {"type": "json_object"}),
        ("response_format", {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}}),
        ("prompt", [2**31], [2**31 - 1]),
        ("user", "u" * 257, "u" * 256),
    ]:
        with pytest.raises(ValidationError) as e:
            P.CompletionRequest(**{**ok, field: bad})
        assert e.value.errors()[0]["loc"][0] == field
        P.CompletionRequest(**{**ok, field: good})
    msg = {"role": "user", "content": "hi"}
    with pytest.raises(ValidationError):
        P.ChatCompletionRequest(messages=[msg] * (P.MAX_MESSAGES + 1))
    chat = P.ChatCompletionRequest(messages=[msg, {"role": "user", "content": [{"type": "text", "text": "abc"}]}])
    assert chat.prompt_size() == (5, "characters")
    assert P.CompletionRequest(prompt=[[1, 2, 3]]).prompt_size() == (3, "tokens")
    assert P.CompletionRequest(prompt="héllo").prompt_size() == (5, "characters")


def test_api_key_comes_from_the_environment_of_the_process_that_checks(monkeypatch, tmp_path):
    from hvd_ray.serving import ServingConfig

    monkeypatch.delenv("HVD_RAY_API_KEY", raising=False)
    cfg = ServingConfig()
    assert cfg.api_key is None and cfg.resolved_api_key() is None
    monkeypatch.setenv("HVD_RAY_API_KEY", "sk-env")
    assert ServingConfig().api_key is None  # never copied into the config (hence never into Serve args)
    assert cfg.resolved_api_key() == "sk-env"  # read where the key is checked (the ingress replica)
    with pytest.raises(ValueError, match="may not be set in the application's args"):
        ServingConfig(api_key="sk-args")  # Serve shows and logs an application's args
    monkeypatch.setenv("HVD_RAY_API_KEY", "  ")
    with pytest.raises(ValueError, match="set but empty"):  # never a silent "no auth"
        cfg.resolved_api_key()
    monkeypatch.delenv("HVD_RAY_API_KEY")
    key_file = tmp_path / "key"
    key_file.write_text("sk-file\n")
    assert ServingConfig(api_key_file=str(key_file)).resolved_api_key() == "sk-file"
    key_file.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        ServingConfig(api_key_file=str(key_file)).resolved_api_key()
    assert cfg.prompt_char_limit() == 32 * cfg.max_model_len


def test_config_and_builder():
    from pydantic import ValidationError
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    import serve_app
    from hvd_ray.serving import ServingConfig, build_app

    for bad in (
        {"tensor_parallel_size": 0},
        {"drafter": "magic"},
        {"max_tokens": 4096, "max_model_len": 2048},
        {"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}},
        {"dtype": "int3"},
        {"slim": "default", "slim_mode": "sometimes"},
        {"policy": "coin-flip"},
        {"model": "/some/other/model", "drafter": "hvd"},
    ):
        with pytest.raises(ValidationError):
            ServingConfig.model_validate(bad)
    # what `serve run config.yaml` / `serve run serve_app:app k=v` do with the builder and its args
    app = call_user_app_builder_with_args_if_necessary(serve_app.app, {"drafter": "none", "max_batch": "2"})
    assert isinstance(app, Application)
    assert isinstance(serve_app.default_app, Application)
    with pytest.raises(ValueError):  # Serve passes args only to builders: why `app` is one
        call_user_app_builder_with_args_if_necessary(serve_app.default_app, {"drafter": "none"})
    import yaml

    conf = yaml.safe_load((ROOT / "config.yaml").read_text())
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(conf)
    assert conf["applications"][0]["import_path"] == "hvd_ray.serving:build_app"  # importable from any directory
    assert isinstance(call_user_app_builder_with_args_if_necessary(build_app, {"drafter": "none"}), Application)
    cfg = ServingConfig.model_validate(conf["applications"][0]["args"])
    assert cfg.autoscaling_config["max_replicas"] >= cfg.autoscaling_config["min_replicas"] >= 1


def test_config_says_where_the_retired_vllm_backend_went():
    """``backend: vllm`` and its ``vllm_*`` fields are gone from the app: a config still carrying one
    is refused with where vLLM serving moved (vLLM's own server with the plug-in, Ray Serve LLM), not
    with pydantic's generic "extra inputs"."""
    from pydantic import ValidationError

    from hvd_ray.serving import ServingConfig

    for old in (
        {"backend": "vllm", "vllm_python": "/x/bin/python"},
        {"backend": "hvd"},
        {"vllm_draft_tokens": 16, "vllm_engine_args": {}},
    ):
        with pytest.raises(ValidationError) as e:
            ServingConfig.model_validate({"max_batch": 2, **old})
        msg = str(e.value)
        assert "`backend: vllm` was removed" in msg and f"this config sets {', '.join(old)}" in msg, msg
        assert "vllm.entrypoints.openai.api_server" in msg and "configs/serve_llm_hvd.yaml" in msg, msg
        assert "docs/vllm.md" in msg and "Extra inputs" not in msg, msg
