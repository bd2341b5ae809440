"""No request can break serving: named bad inputs, a schemathesis fuzz of our own OpenAPI document,
load at concurrency 32 with disconnects, and the model replica killed under load.

One application for the module with the serving defaults (drafter ``hvd``: suffix cache + the
shipped EAGLE-3 head under the cost policy, the shared suffix actor in mirror mode, 4 slots) on a
real local Ray, the API key from the environment (``HVD_RAY_API_KEY``) as the README recommends.
Two settings differ, to keep CI short: the per-request ``max_tokens`` limit is 16, and the dtype is
float32 (on CPUs without bf16 matrix units, e.g. AVX2-only EPYCs, a bf16 prefill is ~6x slower than
fp32). The exact default (bf16, ``make run``) is served over HTTP in ``test_serve_default.py`` and
soaked for 10 minutes by ``jobs/soak.py`` (``benchmarks/reliability.md``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

import pytest
from conftest import serve_app

from hvd_ray.bench.load import wait_idle
from hvd_ray.serving.replica import ModelReplica
from hvd_ray.serving.suffix_actor import service_actors

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

pytestmark = pytest.mark.slow

API_KEY = "sk-hvd-reliability"
MAX_BATCH = 4
CONFIG = {
    "max_tokens": 16,
    "dtype": "float32",
    "max_model_len": 2048,
    "max_batch": MAX_BATCH,
    "torch_threads": 2,
    "ray_actor_options": {"num_cpus": 0.5},
    "ingress_ray_actor_options": {"num_cpus": 0.1},
    "num_replicas": 1,
    "graceful_shutdown_timeout_s": 5,
}
GOOD = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def base_url(default_folder):
    with serve_app(CONFIG, "hvd-rel", api_key=API_KEY) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    import httpx

    with httpx.Client(base_url=base_url, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def _good(http) -> None:
    r = http.post("/v1/chat/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def _error_shaped(r) -> dict:
    from hvd_ray.bench.fuzz import check_error_body

    check_error_body(r)
    return r.json()["error"]


# ---------------------------------------------------------------------------------- bad inputs
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = {  # name: (path, body, status, param, code); every one is followed by a good request
    "temperature_1e-45": (COMP, {"prompt": "x", "temperature": 1e-45, "max_tokens": 2}, 400, "temperature", None),
    "temperature_1e-5_samples": (COMP, {"prompt": "x", "temperature": 1e-5, "max_tokens": 2}, 200, None, None),
    "seed_2**64": (COMP, {"prompt": "x", "temperature": 0.7, "seed": 2**64}, 400, "seed", None),
    "seed_negative": (COMP, {"prompt": "x", "temperature": 0.7, "seed": -1}, 400, "seed", None),
    "temperature_above_2": (CHAT, {"messages": MSG, "temperature": 2.5}, 400, "temperature", None),
    "temperature_NaN": (COMP, b'{"prompt": "x", "temperature": NaN}', 400, None, "invalid_json"),
    "temperature_Infinity": (COMP, b'{"prompt": "x", "temperature": Infinity}', 400, None, "invalid_json"),
    "top_p_above_1": (COMP, {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    "top_k_negative": (COMP, {"prompt": "x", "top_k": -1}, 400, "top_k", None),
    "top_k_2**64": (COMP, {"prompt": "x", "top_k": 2**64}, 400, "top_k", None),
    "top_p_denormal_samples": (COMP, {"prompt": "x", "top_p": 5e-324, "max_tokens": 2}, 200, None, None),
    "five_stop_strings": (COMP, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    "stop_string_too_long": (COMP, {"prompt": "x", "stop": "s" * 300}, 400, "stop", None),
    "stop_token_ids_too_many": (COMP, {"prompt": "x", "stop_token_ids": list(range(65))}, 400, "stop_token_ids", None),
    "stop_token_id_negative": (COMP, {"prompt": "x", "stop_token_ids": [-5]}, 400, "stop_token_ids", None),
    "prompt_token_id_2**40": (COMP, {"prompt": [1, 2**40]}, 400, "prompt", None),
    "prompt_token_id_beyond_vocab": (COMP, {"prompt": [1, 10**6], "max_tokens": 2}, 400, "prompt", None),
    "prompt_token_ids_too_many": (COMP, {"prompt": [1] * 2049}, 400, "prompt", "context_length_exceeded"),
    "prompt_too_many_chars": (COMP, {"prompt": "a" * (32 * 2048 + 1)}, 400, "prompt", "context_length_exceeded"),
    "messages_too_many": (CHAT, {"messages": MSG * 1025}, 400, "messages", None),
    "message_content_too_big": (
        CHAT,
        {"messages": [{"role": "user", "content": "é" * 70000}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    "message_content_part_not_text": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages",
        None,
    ),
    "max_tokens_over_limit": (CHAT, {"messages": MSG, "max_tokens": 17}, 400, "max_tokens", None),
    "max_tokens_2**70": (CHAT, {"messages": MSG, "max_tokens": 2**70}, 400, "max_tokens", None),
    "n_17": (CHAT, {"messages": MSG, "n": 17}, 400, "n", None),
    "logit_bias_beyond_vocab": (CHAT, {"messages": MSG, "logit_bias": {"1000000": 5}}, 400, "logit_bias", None),
    "json_nested_too_deep": (CHAT, b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None, None),
    "body_not_utf8": (CHAT, b'{"messages": "\xff\xfe"}', 400, None, "invalid_json"),
    "stream_not_bool": (CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream", None),
    # malformed and mistyped bodies
    "malformed_json": (COMP, b"{not json", 400, None, "invalid_json"),
    "max_tokens_wrong_type": (COMP, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", None),
    "unknown_model": (COMP, {"prompt": "x", "model": "gpt-4o"}, 404, "model", "model_not_found"),
    "max_tokens_negative": (COMP, {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
    "prompt_longer_than_the_context": (
        COMP,
        {"prompt": "hello " * 2100, "max_tokens": 4},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    "messages_empty": (CHAT, {"messages": []}, 400, "messages", None),
    # lone UTF-16 surrogates: valid JSON escapes, not text (UTF-8 cannot encode them)
    "prompt_lone_surrogate": (COMP, b'{"prompt": "\\ud800", "max_tokens": 2}', 400, "prompt", "invalid_text"),
    "message_lone_surrogate": (
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi \\udfff"}]}',
        400,
        "messages",
        "invalid_text",
    ),
    "model_lone_surrogate": (COMP, b'{"prompt": "x", "model": "\\ud800"}', 400, "model", "invalid_text"),
    "stop_lone_surrogate": (COMP, b'{"prompt": "x", "stop": ["a\\udc00"]}', 400, "stop", "invalid_text"),
    "surrogate_pair_is_text": (COMP, b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}', 200, None, None),
    # nothing silently ignored: fields the server does not implement are named in a 400
    "repetition_penalty_zero": (CHAT, {"messages": MSG, "repetition_penalty": 0}, 400, "repetition_penalty", None),
    "repetition_penalty_denormal": (
        COMP,
        {"prompt": "x", "repetition_penalty": 5e-324},
        400,
        "repetition_penalty",
        None,
    ),
    "repetition_penalty_neutral": (COMP, {"prompt": "x", "max_tokens": 2, "repetition_penalty": 1.0}, 200, None, None),
    "min_p_above_1": (COMP, {"prompt": "x", "min_p": 1.5}, 400, "min_p", None),
    "audio_unsupported": (CHAT, {"messages": MSG, "audio": {"voice": "alloy"}}, 400, "audio", "unsupported_parameter"),
    "chat_template_kwargs_tools": (
        CHAT,
        {"messages": MSG, "chat_template_kwargs": {"tools": []}},
        400,
        "chat_template_kwargs",
        None,
    ),
    "tool_choice_without_tools": (CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice", None),
    "tool_message_without_id": (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages", None),
    "stop_string_256_non_ascii": (
        COMP,
        {"prompt": "x", "stop": ["\u00e9\u6f22" * 128], "max_tokens": 2},
        200,
        None,
        None,
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_named_bad_input_then_a_good_request(http, name):
    path, body, status, param, code = BAD[name]
    t0 = time.perf_counter()
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    took = time.perf_counter() - t0
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    else:
        err = _error_shaped(r)
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        if code:
            assert err["code"] == code, err
        assert took < 1.0, f"{name}: refused after {took:.2f} s"
    _good(http)


def test_a_30_mb_body_is_refused_before_parsing(base_url, http):
    import httpx

    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (30 * 2**20) + b'"}]}'
    t0 = time.perf_counter()
    r = httpx.post(
        f"{base_url}{CHAT}", content=big, headers={**http.headers, "Content-Type": "application/json"}, timeout=60
    )
    took = time.perf_counter() - t0
    assert r.status_code == 413, r.text
    assert _error_shaped(r)["code"] == "request_too_large"
    assert took < 1.0, f"413 after {took:.2f} s"

    # a generator body is sent chunked, without Content-Length: the limit holds while reading
    r = httpx.post(
        f"{base_url}{CHAT}",
        content=(b"a" * 2**20 for _ in range(30)),
        headers={**http.headers, "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and _error_shaped(r)["code"] == "request_too_large"
    _good(http)


# ---------------------------------------------------------------------------------------- fuzz
FUZZ_EXAMPLES = {"positive": 15, "negative": 20, "nasty": 30}


def test_schemathesis_fuzz_finds_no_server_error(base_url, http):
    """Our own /openapi.json, fuzzed: valid and invalid bodies for completions and chat completions
    and the models route, and valid bodies with one nasty field (lone surrogates, huge or non-ASCII
    stop strings, out-of-range token ids). Zero 5xx; every 4xx carries the OpenAI error body; serving
    goes on."""
    from hvd_ray.bench.fuzz import fuzz

    outcomes = fuzz(base_url, API_KEY, FUZZ_EXAMPLES)
    print("fuzz outcomes:", dict(outcomes))
    assert sum(outcomes.values()) >= 2 * sum(FUZZ_EXAMPLES.values())
    assert any(k[2] == 200 for k in outcomes) and any(400 <= k[2] < 500 for k in outcomes)
    assert sum(n for k, n in outcomes.items() if k[1] == "nasty") >= 2 * FUZZ_EXAMPLES["nasty"]
    _good(http)


# ---------------------------------------------------------------------------------------- load
def test_load_of_20_at_once_fails_nothing(base_url, http):
    """Mixed streamed / plain, sampled / greedy chat and completions with hang-ups, all at once: zero
    failures (20 requests, under the replica's 24 admitted, so a call still closing from an earlier
    test cannot push one into the bounded queue's 503); afterwards KV slots, the suffix trees and
    the actor's requests are back to idle, and a second wave of the same load leaves the replica's
    memory where the first one took it."""
    import ray

    from hvd_ray.bench.load import real_prompts, run_load

    _good(http)
    before = wait_idle(http)
    waves, rss = [], []
    for seed in (1, 2):  # the first wave also warms the allocator (new batch shapes): a leak shows in the second
        res = asyncio.run(
            run_load(
                base_url,
                concurrency=32,
                requests=20,
                max_tokens=16,
                disconnect_share=0.3,
                api_key=API_KEY,
                seed=seed,
                prompts=real_prompts(max_chars=2000),
            )
        )
        s = res.summary()
        print("load:", json.dumps(s))
        assert res.failed == 0, s["errors"]
        assert res.ok + res.disconnected == res.sent == 20
        waves.append(res)
        rss.append(wait_idle(http)["rss_bytes"])
    assert sum(r.disconnected for r in waves) > 0
    after = wait_idle(http)
    ok = sum(r.ok for r in waves)
    assert after["running"] == 0 and after["waiting"] == 0 and after["free_slots"] == after["slots"], after
    assert after["live_drafter_requests"] == 0, after
    assert after["finished"] - before["finished"] >= ok  # + hang-ups that finished before noticing
    assert after["failed"] == before["failed"]  # the engine failed no request under load
    # how batches drafted under load (the cost policy's SpeculationCheck): measured arms per batch size
    spec = after["speculation"]
    assert spec and all(e["preferred"] in ("cache", "policy", "plain") for e in spec.values()), spec
    assert sum(a["steps"] for e in spec.values() for a in e["arms"].values()) > 0, spec
    (actor,) = service_actors("hvd-suffix-drafter").values()
    deadline = time.monotonic() + 30
    while ray.get(actor.stats.remote())["requests"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.get(actor.stats.remote())["requests"] == 0
    print(f"replica RSS {before['rss_bytes'] / 2**20:.0f} -> {rss[0] / 2**20:.0f} -> {rss[1] / 2**20:.0f} MiB")
    # Measured here: 128-162 MiB per 24-request wave even after the first. jobs/memory.py tells it apart:
    # native memory the allocator keeps (Python heap and live tensors flat), slowing to ~0.3 MiB a request
    # after ~50 requests (benchmarks/memory.md). The bound catches anything worse than ~10 MiB a request
    growth = (rss[1] - rss[0]) / 2**20
    assert growth < 256, f"replica RSS grew {growth:.0f} MiB over the second wave of 24 requests"


# ------------------------------------------------------------------------------ overload and deadlines
def test_64_concurrent_requests_on_4_slots_are_served_or_shed_at_once(base_url, http):
    """Far past the slots every request still ends: a 200, or a 503 with Retry-After and the OpenAI
    body (the replicas' queue is bounded) that comes at once; none hangs. Afterwards the KV slots,
    the suffix trees and the shared actor's requests are back to idle and a normal request succeeds."""
    from hvd_ray.bench.load import real_prompts, run_load
    from hvd_ray.serving import ServingConfig

    cfg = ServingConfig.model_validate(CONFIG)
    _good(http)
    t0 = time.monotonic()
    res = asyncio.run(
        run_load(
            base_url,
            concurrency=64,
            requests=64,
            max_tokens=16,
            disconnect_share=0.0,
            api_key=API_KEY,
            seed=3,
            prompts=real_prompts(max_chars=2000),
            timeout_s=300,
        )
    )
    wall = time.monotonic() - t0
    s = res.summary()
    print("64 at once on 4 slots:", json.dumps(s))
    assert res.failed == 0, s["errors"]
    assert res.ok + res.rejected == 64
    admitted = cfg.replica_max_ongoing() + cfg.replica_max_queued()
    # all 64 are sent within the first second or two; requests that end meanwhile let a few more in
    assert res.ok >= admitted and res.rejected >= 64 - 2 * admitted, s
    assert set(res.reject_codes) <= {"503 server_overloaded", "503 first_token_timeout"}, s
    assert res.percentile(res.rejected_s, 50) < 2.0, s  # shed at once, not after queueing
    assert wall < cfg.first_token_timeout_s + 120, s
    after = wait_idle(http)
    assert after["running"] == 0 and after["waiting"] == 0 and after["free_slots"] == after["slots"], after
    assert after["live_drafter_requests"] == 0, after
    (actor,) = service_actors("hvd-suffix-drafter").values()
    deadline = time.monotonic() + 30
    import ray

    while ray.get(actor.stats.remote())["requests"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.get(actor.stats.remote())["requests"] == 0
    _good(http)


def test_health_answers_at_once_with_10_long_streams_in_flight(base_url, http):
    """/health never queues behind generation: with 10 streams in flight on 4 slots (2 of them queued
    for the replica) it answers 200 in under a second, five times in a row."""
    import threading

    import httpx

    started, ended = threading.Semaphore(0), []
    body = {
        "messages": [{"role": "user", "content": "Count from one to one hundred."}],
        "max_tokens": 16,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }

    def stream() -> None:
        with httpx.stream("POST", f"{base_url}{CHAT}", json=body, headers=http.headers, timeout=300) as r:
            assert r.status_code == 200
            first = True
            for line in r.iter_lines():
                if first and line.startswith("data: "):
                    first = False
                    started.release()
        ended.append(time.monotonic())

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(10)]
    for t in threads:
        t.start()
    for _ in range(MAX_BATCH):
        assert started.acquire(timeout=120)
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        r = httpx.get(f"{base_url}/health", timeout=10)
        took.append(time.perf_counter() - t0)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    checked = time.monotonic()
    for t in threads:
        t.join(timeout=300)
    print("health latencies (s):", [round(x, 3) for x in took])
    assert max(took) < 1.0, took
    assert len(ended) == 10 and max(ended) > checked  # the streams were still running while /health answered


def test_200_slow_body_clients_are_cut_at_the_body_deadline(base_url, http):
    """200 clients that send their body at 1 byte/s: a normal request is not delayed by more than a
    few seconds, and each slow client gets a 408 at the body deadline (it pins nothing for longer)."""
    from urllib.parse import urlsplit

    import httpx

    from hvd_ray.serving import ServingConfig

    limit = ServingConfig.model_validate(CONFIG).body_timeout_s
    host, port = urlsplit(base_url).hostname, urlsplit(base_url).port
    t0 = time.perf_counter()
    _good(http)
    alone = time.perf_counter() - t0
    payload = json.dumps(GOOD).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()

    async def slow_client() -> tuple[float, bytes]:
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection(host, port)
        t = loop.time()
        try:
            writer.write(head)
            for b in payload:  # one byte a second until the server answers or hangs up
                writer.write(bytes([b]))
                await writer.drain()
                try:
                    answer = await asyncio.wait_for(reader.read(4096), timeout=1.0)
                    return loop.time() - t, answer
                except TimeoutError:
                    continue
            return loop.time() - t, b""
        except ConnectionError:
            return loop.time() - t, b""
        finally:
            writer.close()

    async def run() -> tuple[list, float]:
        clients = [asyncio.create_task(slow_client()) for _ in range(200)]
        await asyncio.sleep(3)
        async with httpx.AsyncClient(base_url=base_url, headers=http.headers, timeout=120) as c:
            t = time.perf_counter()
            r = await c.post(CHAT, json=GOOD)
            took = time.perf_counter() - t
            assert r.status_code == 200, r.text
        return await asyncio.gather(*clients), took

    slow, took = asyncio.run(run())
    print(f"a normal request: {alone:.2f} s alone, {took:.2f} s beside 200 slow-body clients")
    assert took < alone + 5.0
    statuses = [answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/1.1 ") else answer[:40] for _, answer in slow]
    assert statuses == [b"408"] * 200, statuses[:5]
    assert max(t for t, _ in slow) < limit + 5.0, max(t for t, _ in slow)
    _good(http)


def test_streams_nobody_reads_hold_no_slot_past_their_max_tokens(base_url, http):
    """Clients that send a streamed request and never read the answer: each request runs to its
    max_tokens (what is left waits in the proxy, bounded by it), then frees its slot; the server
    goes idle and serves others while those connections stay open."""
    import socket
    from urllib.parse import urlsplit

    host, port = urlsplit(base_url).hostname, urlsplit(base_url).port
    payload = json.dumps({**GOOD, "max_tokens": 16, "ignore_eos": True, "stream": True}).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    socks = []
    try:
        for _ in range(2 * MAX_BATCH):
            sock = socket.create_connection((host, port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(head + payload)
            socks.append(sock)
        time.sleep(1)
        idle = wait_idle(http, timeout=180)
        assert idle["running"] == 0 and idle["waiting"] == 0 and idle["free_slots"] == idle["slots"], idle
        _good(http)
    finally:
        for sock in socks:
            sock.close()


# -------------------------------------------------------------------------------------- faults
def test_killing_the_model_replica_under_load(base_url, http):
    """Requests in flight when the replica dies end with a clean error (a 503, or an error event
    on a stream), none hangs; Serve starts a new replica and requests succeed again."""
    from hvd_ray.bench.faults import kill_replica_under_load
    from hvd_ray.bench.load import real_prompts

    _good(http)
    # the new replica loads the model and times its forwards before it serves: 110 s alone on an
    # AVX2-only 2-core box, over 300 s there while the other test worker runs, so requests queued
    # behind it may wait that long (a client timeout is not a hang, but is not a clean error either)
    k = kill_replica_under_load(
        base_url,
        API_KEY,
        concurrency=8,
        requests=16,
        max_tokens=16,
        app="hvd-rel",
        prompts=real_prompts(max_chars=2000),
        timeout_s=600,
    )
    print("under the kill:", json.dumps(k.load.summary()), f"recovered {k.recovery_s:.1f} s after the kill")
    assert not k.hung, "a request hung after the replica died"
    shed = k.load.rejected  # 503s with Retry-After: the replica died under them, or they waited too long
    assert k.load.ok + k.load.failed + shed == 16 and k.load.failed + shed > 0
    assert all(
        e.startswith("HTTP 503") or e.startswith("ValueError: error event: the model replica failed")
        for e in k.load.errors
    ), k.load.errors
    assert set(k.load.reject_codes) <= {
        "503 replica_unavailable",
        "503 first_token_timeout",
        "503 server_overloaded",
    }, k.load.reject_codes
    assert k.probes[-1] == 200 and set(k.probes[:-1]) <= {503}, k.probes
    assert http.get("/health").json()["status"] == "ok"


# -------------------------------------------------------------------------------------- liveness
class _Hangs(ModelReplica.func_or_class):
    """A model replica whose engine loop hangs in a step (a stuck collective or remote call) once a
    marker file says so: it holds the number of steps still to run; at 0 the file is removed (the
    replica Serve starts in this one's place decodes normally) and the step never returns."""

    def __init__(self, config: dict, marker: str):
        super().__init__(config)
        step = self.engine.step

        def step_or_hang():
            if os.path.exists(marker):
                left = int(open(marker).read() or 0)
                if left <= 0:
                    os.remove(marker)
                    threading.Event().wait()
                with open(marker, "w") as f:
                    f.write(str(left - 1))
            return step()

        self.engine.step = step_or_hang


def test_a_stuck_engine_step_sheds_its_requests_and_serve_replaces_the_replica(base_url, tmp_path):
    """The engine hangs right after a stream's first token: the stream ends with a request_timeout
    error event and [DONE] at its deadline, a request that arrives meanwhile gets a 503 with
    Retry-After at its first-token deadline, the replica reports unhealthy within step_timeout_s
    plus three health-check periods, Serve replaces it, and the new replica serves."""
    import httpx
    import ray
    from ray import serve

    from hvd_ray.serving import ServingConfig
    from hvd_ray.serving.ingress import OpenAIIngress

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = ServingConfig.model_validate(
        {
            "dtype": "float32",
            "drafter": "suffix",
            "suffix_actor": False,
            "max_batch": 2,
            "max_tokens": 16,
            "max_model_len": 1024,
            "torch_threads": 1,
            "step_timeout_s": 5,
            "first_token_timeout_s": 3,
            "request_timeout_s": 4,
            "graceful_shutdown_timeout_s": 2,
            "num_replicas": 1,
        }
    )
    conf = cfg.model_dump()
    marker = tmp_path / "steps-left"
    replica = serve.deployment(
        name="ModelReplica",
        health_check_period_s=1,
        max_ongoing_requests=4,
        graceful_shutdown_timeout_s=2,
        ray_actor_options={"num_cpus": 0.3},
    )(_Hangs)
    app = OpenAIIngress.options(ray_actor_options={"num_cpus": 0.1}).bind(replica.bind(conf, str(marker)), conf)
    serve.run(app, name="hvd-stuck", route_prefix="/stuck")
    url, headers = f"{base_url}/stuck", {"Authorization": f"Bearer {API_KEY}"}
    long = {**GOOD, "max_tokens": 8, "ignore_eos": True}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=300) as c:
            assert c.get("/health").status_code == 200
            assert c.post(CHAT, json=GOOD).status_code == 200
            marker.write_text("1")  # the next step (the stream's prefill) runs, the one after hangs
            first, lines, late = threading.Event(), [], []

            def stream() -> None:
                with c.stream("POST", CHAT, json={**long, "stream": True}) as r:
                    lines.append(r.status_code)
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            first.set()

            def plain() -> None:
                t = time.monotonic()
                r = c.post(CHAT, json=long)
                late.append(
                    (r.status_code, r.headers.get("retry-after"), r.json()["error"]["code"], time.monotonic() - t)
                )

            t0 = time.monotonic()
            streamer = threading.Thread(target=stream, daemon=True)
            streamer.start()
            assert first.wait(60), lines
            plains = [threading.Thread(target=plain, daemon=True) for _ in range(2)]
            for t in plains:
                t.start()
            while c.get("/health").status_code == 200:
                assert time.monotonic() - t0 < 60, "the stuck replica was never reported unhealthy"
                time.sleep(0.2)
            unhealthy = time.monotonic() - t0
            for t in [streamer, *plains]:
                t.join(timeout=120)
            assert not streamer.is_alive() and not any(t.is_alive() for t in plains), "a client hung"
            while c.get("/health").status_code != 200:
                assert time.monotonic() - t0 < 300, "no replica replaced the stuck one"
                time.sleep(0.5)
            replaced = time.monotonic() - t0
            print(
                f"stuck step: unhealthy after {unhealthy:.1f} s, replaced after {replaced:.1f} s; stream: "
                f"{lines}; requests that arrived meanwhile: {late}"
            )
            assert lines[0] == 200 and lines[-1] == "[DONE]", lines
            assert json.loads(lines[-2])["error"]["code"] == "request_timeout", lines
            assert [(st, ra, code) for st, ra, code, _ in late] == [(503, "5", "first_token_timeout")] * 2, late
            assert all(took < cfg.first_token_timeout_s + 3 for *_, took in late), late
            assert unhealthy < cfg.step_timeout_s + 3 * 1 + 10
            assert c.post(CHAT, json=GOOD).status_code == 200
    finally:
        serve.delete("hvd-stuck")
