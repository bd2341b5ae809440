"""Function calling through the API: BFCL's functions sent as ``tools`` (not pasted into a system
prompt) to our server with the official ``openai`` client, its ``message.tool_calls`` scored.

For each server (drafter) and each ``tool_choice`` (``auto``: the model decides; ``required``: the
answer is held to a call by the grammar, ``engine/grammar.py``) every task is one chat request;
``--concurrency`` of them in flight. Reported: answers with tool calls, calls that match BFCL's
ground truth (``scoring.bfcl_match``: names and argument values), completion tokens/s and latency.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from ..workloads.datasets import load_bfcl
from ..workloads.structured import json_schema
from .machine import DTYPE_NAMES, command, cpu_name, machine_line, versions
from .scoring import bfcl_match
from .serve import local_server

CATEGORIES = ("simple_python", "multiple", "parallel")
CHOICES = ("auto", "required")


def tasks(per_category: int) -> list[dict]:
    """BFCL prompts as API requests: the conversation without our system prompt, the functions as tools."""
    out = []
    for cat in CATEGORIES:
        for p in load_bfcl(cat)[:per_category]:
            msgs = [{"role": m["role"], "content": m["content"]} for m in p.meta["question"]]
            tools = [
                {
                    "type": "function",
                    "function": {
                        "name": f["name"],
                        "description": f.get("description", ""),
                        "parameters": json_schema(f["parameters"]),
                    },
                }
                for f in p.meta["functions"]
            ]
            out.append({"id": p.id, "messages": msgs, "tools": tools, "truth": p.meta["ground_truth"]})
    return out


def _ask(oai, task: dict, choice: str, max_tokens: int) -> dict:
    import json

    t0 = time.perf_counter()
    r = oai.chat.completions.create(
        model="default",
        messages=task["messages"],
        tools=task["tools"],
        tool_choice=choice,
        temperature=0,
        max_tokens=max_tokens,
    )
    dt = time.perf_counter() - t0
    msg = r.choices[0].message
    calls = None
    if msg.tool_calls:
        calls = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in msg.tool_calls]
    return {
        "latency_s": dt,
        "tokens": r.usage.completion_tokens,
        "called": calls is not None,
        "match": bool(task["truth"]) and bfcl_match(calls, task["truth"]),
    }


def bench_tools(args) -> str:
    import openai

    work = tasks(args.prompts or 12)
    servers = args.drafters
    c = args.concurrency[0] if args.concurrency else 4
    rows = {}
    t_job = time.perf_counter()
    for drafter in servers:
        cfg = {"model": "default", "dtype": args.dtype, "drafter": drafter, "max_batch": 8, "max_model_len": 4096}
        with local_server(cfg, "tools") as base:
            oai = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
            _ask(oai, work[0], "required", 8)  # warm-up, not measured
            for choice in CHOICES:
                t0 = time.perf_counter()
                with ThreadPoolExecutor(c) as pool:
                    res = list(pool.map(lambda t, o=oai, ch=choice: _ask(o, t, ch, args.max_tokens), work))
                wall = time.perf_counter() - t0
                rows[(drafter, choice)] = (res, wall)
                print(drafter, choice, sum(r["match"] for r in res), flush=True)
    return report(args, work, servers, rows, c, time.perf_counter() - t_job)


def report(args, work, servers, rows, c, job_s) -> str:
    n = len(work)
    lines = [
        "# Function calling through the API: BFCL functions as `tools`, scored on `message.tool_calls`",
        "",
        f"Command: `{command('jobs/benchmark.py')}`  ",
        f"Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_name()}; {versions().split(', ray ')[0]}  ",
        f"Machine: {machine_line()}  ",
        f"Model: SmolLM2-135M-Instruct, {DTYPE_NAMES[args.dtype]}, greedy, at most {args.max_tokens} tokens; "
        f"{n} BFCL tasks ({', '.join(CATEGORIES)}: {n // len(CATEGORIES)} each), the official `openai` client, "
        f"{c} requests in flight; whole job {job_s:.0f} s.",
        "",
        "called = answers with `tool_calls`; BFCL match = calls equal to the ground truth (names and "
        "argument values, `scoring.bfcl_match`); tok/s = completion tokens over the wall time of the cell.",
        "",
        "| server | tool_choice | called | BFCL match | tok/s | mean latency s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for drafter in servers:
        for choice in CHOICES:
            res, wall = rows[(drafter, choice)]
            lines.append(
                f"| `{drafter}` | `{choice}` | {sum(r['called'] for r in res)}/{n} | "
                f"{sum(r['match'] for r in res)}/{n} | {sum(r['tokens'] for r in res) / wall:.1f} | "
                f"{statistics.mean(r['latency_s'] for r in res):.2f} |"
            )
    return "\n".join(lines) + "\n"
