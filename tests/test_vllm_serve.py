"""vLLM's own OpenAI server with hvd-ray's plug-in (``hvd_ray/bench/vllm_server.py``), as a vLLM user runs
it: the agent API (tools, JSON schema, logprobs) answers as it does without speculation."""

from __future__ import annotations

import re

import pytest
from test_vllm import VLLM_PYTHON, needs_vllm

AGENT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "description": "Search flights on a date",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string"},
                    "destination": {"type": "string"},
                    "date": {"type": "string"},
                },
                "required": ["origin", "destination", "date"],
            },
        },
    },
]
TRIP = [
    {"role": "system", "content": "You are a travel assistant. Use the tools."},
    {
        "role": "user",
        "content": "Find me a flight from Boston to Paris on 2026-12-24, and tell me the weather in Paris.",
    },
]
PERSON = {
    "type": "object",
    "required": ["name", "age", "languages"],
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
}


def agent_calls(url: str) -> list[dict]:
    """The agent requests both servers answer (greedy): tool calls (required, a named function, auto),
    a JSON-schema answer, and logprobs; each answer reduced to what the client reads."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    asks = [
        dict(messages=TRIP, tools=AGENT_TOOLS, tool_choice=c, max_tokens=n)
        for c, n in (("required", 96), ({"type": "function", "function": {"name": "search_flights"}}, 48), ("auto", 32))
    ]
    asks.append(
        dict(
            messages=[{"role": "user", "content": "Describe a software engineer named Ada as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
            max_tokens=96,
        )
    )
    asks.append(
        dict(
            messages=[{"role": "user", "content": "List the planets of the solar system."}],
            logprobs=True,
            top_logprobs=2,
            max_tokens=24,
        )
    )
    out = []
    for ask in asks:
        ch = client.chat.completions.create(model=model, temperature=0, **ask).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
        lp = (
            [(t.token, t.logprob, [x.token for x in t.top_logprobs]) for t in ch.logprobs.content]
            if ch.logprobs
            else []
        )
        out.append({"content": ch.message.content, "calls": calls, "finish": ch.finish_reason, "logprobs": lp})
    return out


@pytest.mark.slow
@needs_vllm
def test_vllm_serve_with_the_plugin_answers_agents_as_without_speculation(tmp_path, default_folder):
    """vLLM's own OpenAI server (hermes tool parser) with ``--speculative-config '{"method": "hvd"}'``
    and without speculation, fp32, the official ``openai`` client: tool calls (``tool_choice``
    required, a named function, auto), a JSON-schema ``response_format`` and logprobs come back the
    same (logprobs within 1e-3); the JSON answer follows its schema; the plug-in drafted and vLLM
    accepted drafts (its own spec-decode metrics)."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema
    import requests
    from conftest import free_port

    from hvd_ray.bench.vllm_server import VllmServer

    # (priced with the GPU-like table: timed costs on a quiet 2-core box can make every draft of these few
    # requests look too dear, and the test needs drafts verified)
    spec = {"method": "hvd", "num_speculative_tokens": 32, "hvd_policy": "static"}
    servers = [
        VllmServer(
            VLLM_PYTHON,
            str(default_folder),
            free_port(),
            s,
            log=str(tmp_path / f"{name}.log"),
            threads=1,
            dtype="float32",
            max_model_len=2048,
        )
        for name, s in (("plain", None), ("hvd", spec))
    ]
    try:
        with ThreadPoolExecutor(2) as pool:  # the two servers answer side by side
            plain, ours = pool.map(lambda srv: agent_calls(srv.wait(600).url), servers)
        metrics = requests.get(f"{servers[1].url}/metrics", timeout=30).text
    finally:
        for srv in servers:
            srv.stop()
    assert [{**a, "logprobs": None} for a in ours] == [{**a, "logprobs": None} for a in plain]
    for a, b in zip(ours[-1]["logprobs"], plain[-1]["logprobs"], strict=True):
        assert a[0] == b[0] and a[2] == b[2] and abs(a[1] - b[1]) < 1e-3, (a, b)
    assert plain[0]["calls"] and plain[0]["finish"] == "tool_calls", plain[0]
    jsonschema.validate(json.loads(ours[3]["content"]), PERSON)
    log = (tmp_path / "hvd.log").read_text()
    assert "hvd-ray plug-in: method hvd" in log, log[-3000:]
    accepted = re.search(r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} ([0-9.e+]+)", metrics, re.M)
    assert accepted and float(accepted.group(1)) > 0, metrics[:2000]
