"""Conversation affinity under load: multi-turn agent conversations against our Serve app with one
replica, then two replicas routed by Serve's power of two choices and by prefix affinity
(``serving/affinity.py``). Each conversation re-sends itself with the model's answer and a follow-up
(``workloads/turns.py``) for ``--turns`` turns, ``--concurrency`` conversations in flight; every
setup gets the same conversations (``--workloads agent``: one 2,000-token tool list shared by all;
``agent-own-tools``: each conversation lists the tools in its own order, so nothing but its own
earlier turns is worth caching for it). Reported: the prompt tokens the replicas found cached (usage's
``cached_tokens``) against one replica's, and output tokens per second."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from ..workloads.agent import agent_prompts
from ..workloads.datasets import load_workload
from ..workloads.turns import DEFAULT_FOLLOW_UP, FOLLOW_UPS
from .machine import DTYPE_NAMES, command, cpu_name, machine_line, versions

SETUPS = (
    ("one replica", 1, "pow2"),
    ("two replicas, power of two choices", 2, "pow2"),
    ("two replicas, affinity", 2, "affinity"),
)


def converse(url: str, model: str, messages: list[dict], follow: str, turns: int, max_tokens: int) -> list[dict]:
    """One conversation of ``turns`` greedy chat calls; per call its usage and latency."""
    import httpx

    out, msgs = [], list(messages)
    with httpx.Client(base_url=url, timeout=600) as http:
        for _ in range(turns):
            t0 = time.perf_counter()
            r = http.post(
                "/v1/chat/completions",
                json={"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            )
            r.raise_for_status()
            body = r.json()
            usage = body["usage"]
            out.append(
                {
                    "prompt": usage["prompt_tokens"],
                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    "completion": usage["completion_tokens"],
                    "latency": time.perf_counter() - t0,
                }
            )
            answer = body["choices"][0]["message"]["content"] or ""
            msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow}]
    return out


def run_setup(args, conversations: list[tuple[list[dict], str]], replicas: int, router: str) -> dict:
    from .serve import local_server

    cfg = {
        "model": "default",
        "served_model_name": "default",
        "dtype": args.dtype,
        "drafter": (args.drafters or ["none"])[0],
        "max_batch": 4,
        "reuse_slots": 8,
        "max_model_len": 4096,
        "max_tokens": args.max_tokens,
        "torch_threads": 1,
        "num_replicas": replicas,
        "request_router": router,
        "suffix_actor_name": f"hvd-bench-affinity-{replicas}-{router}",
    }
    c = args.concurrency[0]
    with local_server(cfg, "affinity") as url:
        converse(url, "default", [{"role": "user", "content": "Say hello."}], "Again.", 1, 4)  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(c) as pool:
            calls = list(
                pool.map(lambda cv: converse(url, "default", cv[0], cv[1], args.turns, args.max_tokens), conversations)
            )
        wall = time.perf_counter() - t0
    flat = [x for conv in calls for x in conv]
    later = [x for conv in calls for x in conv[1:]]  # turns after the first: their conversation's K/V exists
    lat = sorted(x["latency"] for x in flat)
    return {
        "wall": wall,
        "requests": len(flat),
        "prompt": sum(x["prompt"] for x in flat),
        "cached": sum(x["cached"] for x in flat),
        "later_prompt": sum(x["prompt"] for x in later),
        "later_cached": sum(x["cached"] for x in later),
        "out": sum(x["completion"] for x in flat),
        "p50": statistics.median(lat),
        "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


def bench_affinity(args) -> str:
    workload = (args.workloads or ["agent"])[0]
    n = args.prompts or 8
    if workload in ("agent", "agent-own-tools"):  # one tool list shared by all, or each its own order
        prompts = agent_prompts(own_tools=workload == "agent-own-tools")
    else:
        prompts = load_workload(workload, split="test")
    conversations = [(p.messages, FOLLOW_UPS.get(p.workload, DEFAULT_FOLLOW_UP)) for p in prompts[:n]]
    t_job = time.perf_counter()
    res = {}
    for name, replicas, router in SETUPS:
        res[name] = run_setup(args, conversations, replicas, router)
        r = res[name]
        print(f"[affinity] {name}: {r['out'] / r['wall']:.1f} tok/s, cached {r['cached']}/{r['prompt']}", flush=True)
    one, pow2 = res[SETUPS[0][0]], res[SETUPS[1][0]]
    lines = [
        "# Conversation affinity: multi-turn agents over two replicas",
        "",
        f"Command: `{command('jobs/benchmark.py')}`  ",
        f"Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_name()}; {versions().split(', ray ')[0]}  ",
        f"Machine: {machine_line()}  ",
        f"Setup: our Serve app, SmolLM2-135M-Instruct {DTYPE_NAMES[args.dtype]}, drafter "
        f"`{(args.drafters or ['none'])[0]}`, one torch thread and `max_batch` 4 (+ 8 reuse slots) per "
        f"replica; {n} {workload} conversations of {args.turns} turns (each turn re-sends the conversation "
        f"with the model's answer and a follow-up), {args.concurrency[0]} in flight, greedy, "
        f"{args.max_tokens} tokens a turn (`ignore_eos`); whole job {time.perf_counter() - t_job:.0f} s.",
        "",
        "cached = prompt tokens the serving replica already held (usage `cached_tokens`) over all prompt "
        "tokens; later turns = the same over turns 2 on, whose conversation's K/V exists on some replica; "
        "x = output tok/s over two replicas with power of two choices.",
        "",
        "| setup | requests | cached | cached, later turns | vs one replica | out tok/s | x | p50 s | p99 s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in res.items():
        tps = r["out"] / r["wall"]
        lines.append(
            f"| {name} | {r['requests']} | {r['cached'] / r['prompt']:.1%} | "
            f"{r['later_cached'] / max(r['later_prompt'], 1):.1%} | {r['cached'] / max(one['cached'], 1):.2f} | "
            f"{tps:.1f} | {tps / (pow2['out'] / pow2['wall']):.2f}x | {r['p50']:.1f} | {r['p99']:.1f} |"
        )
    return "\n".join(lines) + "\n"


__all__ = ["bench_affinity", "converse"]
