"""``make run``'s exact default, served over HTTP: ``python -m hvd_ray.serving`` in its own process
(its own local Ray, the default model in bf16, drafter ``hvd`` with the shipped EAGLE-3 head and the
shared suffix actor), reached by the official ``openai`` client, streamed and not; the API key from
the environment is enforced and never printed; SIGTERM drains requests in flight before exiting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-hvd-default-9f3a1c"


@pytest.fixture(scope="module")
def server(default_folder, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "HVD_RAY_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    with open(log, "w") as out:  # `make run` is this command with --port 8000
        proc = subprocess.Popen(
            [sys.executable, "-m", "hvd_ray.serving", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 300
    while "hvd-ray is serving" not in log.read_text():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    try:
        yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "log": log}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_default_answers_the_openai_client(server):
    import openai

    log = server["log"].read_text()
    assert "drafter=hvd" in log and "dtype=bfloat16" in log
    oai = openai.OpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "Write a Python function that returns the square of x."}]
    ch = oai.chat.completions.create(model="default", messages=msgs, max_tokens=24, temperature=0)
    assert ch.choices[0].finish_reason in ("length", "stop") and ch.choices[0].message.content
    parts = [
        c.choices[0].delta.content or ""
        for c in oai.chat.completions.create(model="default", messages=msgs, max_tokens=24, temperature=0, stream=True)
        if c.choices
    ]
    assert "".join(parts) == ch.choices[0].message.content  # streamed = not streamed (greedy)
    c = oai.completions.create(model="default", prompt="def add(a, b):", max_tokens=8, temperature=0.7, seed=3)
    assert c.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server['url']}/v1", api_key="wrong", max_retries=0).models.list()
    assert KEY not in server["log"].read_text()  # the startup hint names $HVD_RAY_API_KEY, not the key
    assert "$HVD_RAY_API_KEY" in server["log"].read_text()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Perth", "Seoul", "Rome")


def _ask(oai, stream: bool, **kw):
    """(content, [(id, name, arguments)], finish_reason, usage) of one chat call, streamed or not."""
    if not stream:
        r = oai.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        return m.content, calls, r.choices[0].finish_reason, r.usage
    content, calls, finish, use = "", [], None, None
    for chunk in oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        use = chunk.usage or use
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        calls += [(c.id, c.function.name, c.function.arguments) for c in d.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    return content or None, calls, finish, use


def test_twenty_agent_conversations_over_the_openai_client(server):
    """``make run``'s default (drafter hvd) as an agent's backend: 20 scripted conversations, half
    streamed, each tools -> tool_calls (``required``, or a named function) -> the tool's answer -> a
    final answer. Every call parses, names an offered function and its arguments validate against its
    schema (the grammar holds them to it); the call and its result reach the next prompt; nothing is
    dropped or answered with a 5xx."""
    import json

    import jsonschema
    import openai

    oai = openai.OpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=300)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for i in range(20):
        city, stream = CITIES[i % len(CITIES)], i % 2 == 1
        ask = "What is the weather" if i < 10 else "What time is it"
        msgs = [{"role": "user", "content": f"{ask} in {city}?"}]
        choice = "required" if i % 4 < 2 else {"type": "function", "function": {"name": "get_time"}}
        content, calls, finish, use = _ask(
            oai,
            stream,
            model="default",
            messages=msgs,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            temperature=0,
            max_tokens=48,
        )
        assert finish == "tool_calls" and calls, (i, content)
        for call_id, name, arguments in calls:
            assert call_id.startswith("call_") and name in schemas
            jsonschema.validate(json.loads(arguments), schemas[name])
        if isinstance(choice, dict):
            assert [name for _, name, _ in calls] == ["get_time"]
        msgs.append(
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {"id": c, "type": "function", "function": {"name": n, "arguments": a}} for c, n, a in calls
                ],
            }
        )
        msgs += [
            {"role": "tool", "tool_call_id": c, "content": json.dumps({"city": city, "result": "sunny, 21 C"})}
            for c, _, _ in calls
        ]
        content2, calls2, finish2, use2 = _ask(
            oai, stream, model="default", messages=msgs, tools=[WEATHER, TIME], temperature=0, max_tokens=24
        )
        assert finish2 in ("stop", "length", "tool_calls") and (content2 or calls2), i
        assert use2.prompt_tokens > use.prompt_tokens + use.completion_tokens  # the call and its result were sent


def test_sigterm_drains_requests_in_flight(server):
    import httpx

    body = {
        "messages": [{"role": "user", "content": "Count from one to thirty in words."}],
        "max_tokens": 64,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = threading.Barrier(3)
    results: dict[int, dict] = {}

    def stream(i: int) -> None:
        events, waited = [], False
        try:
            with httpx.stream(
                "POST",
                f"{server['url']}/v1/chat/completions",
                json=body,
                timeout=300,
                headers={"Authorization": f"Bearer {KEY}"},
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if not waited:
                            waited = True
                            started.wait(timeout=120)
        except Exception as e:  # noqa: BLE001 - recorded and asserted below
            events.append(f"EXCEPTION {e!r}")
        results[i] = {"events": events}

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait(timeout=120)  # both requests are streaming
    t0 = time.monotonic()
    server["proc"].send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=300)
    assert server["proc"].wait(timeout=300) == 0, server["log"].read_text()[-3000:]
    print(f"drained and exited {time.monotonic() - t0:.1f} s after SIGTERM")
    import json

    for i, res in results.items():
        ev = res["events"]
        assert ev[-1] == "[DONE]", ev[-3:]
        finals = [json.loads(e)["choices"][0]["finish_reason"] for e in ev[:-1]]
        assert finals[-1] == "length", (i, ev[-3:])  # every one of its 64 tokens arrived
    log = server["log"].read_text()
    assert "draining" in log and KEY not in log
