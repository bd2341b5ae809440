"""A bounded HTTP load driver for the OpenAI endpoint: mixed traffic, client disconnects, latency.

Why not locust: the checks here need per-request classification (a stream must end with a finish
reason and ``[DONE]``, an error event inside a 200 stream is a failure, a hang-up we asked for is
not), deliberate disconnects mid-stream, and figures read back from the server between phases;
that is ~150 lines of asyncio + httpx (already a dependency), against locust's gevent runner.

Traffic: ``concurrency`` workers loop until ``duration_s`` or ``requests`` runs out, each request
drawn with a seeded RNG: chat or completion, streamed or not, sampled (temperature 0.8, top-p 0.95,
a seed) or greedy, and a share of streamed requests that hang up after their first chunk. Prompts
are real ones (the packaged code, chat and function-calling test sets).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class LoadResult:
    sent: int = 0
    ok: int = 0
    disconnected: int = 0  # hang-ups the driver chose (not failures)
    rejected: int = 0  # shed by the server: a 429/503 with Retry-After (not failures: the client may retry)
    failed: int = 0
    errors: Counter = field(default_factory=Counter)  # failure kind -> count
    latency_s: list[float] = field(default_factory=list)  # whole request, completed ones
    ttft_s: list[float] = field(default_factory=list)  # first content chunk, streamed ones
    rejected_s: list[float] = field(default_factory=list)  # how long a rejection took to arrive
    reject_codes: Counter = field(default_factory=Counter)  # "503 server_overloaded" -> count
    completion_tokens: int = 0
    wall_s: float = 0.0

    def percentile(self, xs: list[float], q: float) -> float:
        if not xs:
            return float("nan")
        s = sorted(xs)
        return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]

    def summary(self) -> dict:
        return {
            "sent": self.sent,
            "ok": self.ok,
            "disconnected": self.disconnected,
            "rejected": self.rejected,
            "failed": self.failed,
            "errors": dict(self.errors),
            "reject_codes": dict(self.reject_codes),
            "rejected_p99_s": round(self.percentile(self.rejected_s, 99), 3),
            "wall_s": round(self.wall_s, 1),
            "p50_s": round(self.percentile(self.latency_s, 50), 3),
            "p90_s": round(self.percentile(self.latency_s, 90), 3),
            "p99_s": round(self.percentile(self.latency_s, 99), 3),
            "ttft_p50_s": round(self.percentile(self.ttft_s, 50), 3),
            "ttft_p99_s": round(self.percentile(self.ttft_s, 99), 3),
            "completion_tokens": self.completion_tokens,
            "tokens_per_s": round(self.completion_tokens / self.wall_s, 1) if self.wall_s else 0.0,
        }


def wait_idle(http, timeout: float = 120.0, poll: float = 0.25) -> dict:
    """The server's ``/stats`` once nothing runs, waits or holds a suffix tree (or at ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        s = http.get("/stats").json()
        if (s["running"] == 0 and s["waiting"] == 0 and s["live_drafter_requests"] == 0) or time.monotonic() > deadline:
            return s
        time.sleep(poll)


def real_prompts(
    n_per_workload: int = 8, workloads=("code", "chat", "function_calling"), max_chars: int | None = None
) -> list[list[dict]]:
    """Chat messages of real test-split prompts (at most ``max_chars`` of text each, if set),
    interleaved across workloads."""
    from hvd_ray.workloads import load_workload

    def fits(p) -> bool:
        return max_chars is None or len(_flatten(p.messages)) <= max_chars

    groups = [[p.messages for p in load_workload(w, split="test") if fits(p)][:n_per_workload] for w in workloads]
    return [g[i] for i in range(n_per_workload) for g in groups if i < len(g)]


def _flatten(messages: list[dict]) -> str:
    return "\n\n".join(m["content"] for m in messages)


async def _one(
    client, rng: random.Random, prompts: list[list[dict]], max_tokens: int, disconnect_share: float, res: LoadResult
) -> None:
    messages = rng.choice(prompts)
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    hang_up = stream and rng.random() < disconnect_share
    body: dict = {"max_tokens": max_tokens, "stream": stream}
    if rng.random() < 0.5:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
    else:
        body["temperature"] = 0
    if chat:
        path, body["messages"] = "/v1/chat/completions", messages
    else:
        path, body["prompt"] = "/v1/completions", _flatten(messages)
    if stream:
        body["stream_options"] = {"include_usage": True}
    res.sent += 1
    t0 = time.perf_counter()
    try:
        if not stream:
            r = await client.post(path, json=body)
            if _shed(r, res, t0):
                return
            if r.status_code != 200:
                res.failed += 1
                res.errors[f"HTTP {r.status_code}: {r.text[:120]}"] += 1
                return
            data = r.json()
            if data["choices"][0]["finish_reason"] not in ("stop", "length"):
                raise ValueError(f"finish_reason {data['choices'][0]['finish_reason']!r}")
            res.completion_tokens += data["usage"]["completion_tokens"]
        else:
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    if _shed(r, res, t0):
                        return
                    res.failed += 1
                    res.errors[f"HTTP {r.status_code}: {(await r.aread())[:120]!r}"] += 1
                    return
                finish, done, first = None, False, True
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        raise ValueError(f"error event: {ev['error'].get('message', '')[:120]}")
                    if ev.get("usage"):
                        res.completion_tokens += ev["usage"]["completion_tokens"]
                    if ev.get("choices"):
                        if first:
                            first = False
                            res.ttft_s.append(time.perf_counter() - t0)
                            if hang_up:
                                res.disconnected += 1
                                return  # leaving the block closes the connection mid-generation
                        finish = ev["choices"][0].get("finish_reason") or finish
                if not done or finish not in ("stop", "length"):
                    raise ValueError(f"stream ended without [DONE] or a finish reason ({finish!r})")
    except Exception as e:  # noqa: BLE001 - every failure is counted by kind, none stops the run
        res.failed += 1
        res.errors[f"{type(e).__name__}: {str(e)[:120]}"] += 1
        return
    res.ok += 1
    res.latency_s.append(time.perf_counter() - t0)


def _shed(r, res: LoadResult, t0: float) -> bool:
    """Count a 429/503 that carries Retry-After and an OpenAI error body as a rejection."""
    if r.status_code not in (429, 503) or "retry-after" not in r.headers:
        return False
    try:
        code = r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return False
    res.rejected += 1
    res.rejected_s.append(time.perf_counter() - t0)
    res.reject_codes[f"{r.status_code} {code}"] += 1
    return True


async def run_load(
    base_url: str,
    *,
    concurrency: int = 32,
    duration_s: float | None = None,
    requests: int | None = None,
    max_tokens: int = 32,
    disconnect_share: float = 0.1,
    api_key: str | None = None,
    prompts: list[list[dict]] | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
    progress_every_s: float | None = None,
) -> LoadResult:
    """Drive ``base_url`` until ``duration_s`` has passed or ``requests`` have been sent (whichever
    is set first; at least one must be), ``concurrency`` at a time."""
    import httpx

    if duration_s is None and requests is None:
        raise ValueError("set duration_s or requests")
    prompts = prompts or real_prompts()
    res = LoadResult()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    t0 = time.perf_counter()
    deadline = t0 + duration_s if duration_s is not None else float("inf")
    budget = [requests if requests is not None else float("inf")]

    async def worker(i: int, client) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.perf_counter() < deadline and budget[0] > 0:
            budget[0] -= 1
            await _one(client, rng, prompts, max_tokens, disconnect_share, res)

    async def progress() -> None:
        while progress_every_s:
            await asyncio.sleep(progress_every_s)
            print(
                f"[load] {time.perf_counter() - t0:6.0f} s  sent {res.sent}  ok {res.ok}  "
                f"disconnected {res.disconnected}  failed {res.failed}",
                flush=True,
            )

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s, limits=limits) as client:
        ticker = asyncio.create_task(progress())
        try:
            await asyncio.gather(*(worker(i, client) for i in range(concurrency)))
        finally:
            ticker.cancel()
    res.wall_s = time.perf_counter() - t0
    return res
