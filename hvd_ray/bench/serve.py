"""The Ray Serve app over HTTP at several concurrencies: requests/s, tokens/s, latency, TTFT and
the time the engine loop spends on the shared suffix actor, for several servers (drafter, actor
mode) side by side."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path

from ..engine.speculation_check import ARMS
from ..model import resolve
from ..serving.config import ServingConfig
from .machine import DTYPE_NAMES, command, machine_line
from .prompts import prompt_ids


@contextlib.contextmanager
def local_server(cfg: dict, name: str = "bench"):
    """Our Serve app of ``cfg`` on a fresh local Ray, one replica; yields its base URL."""
    import ray
    from ray import serve

    from ..serving import build_app
    from .vllm_load import free_port

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(
            build_app({"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}, **cfg}), name=name, route_prefix="/"
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _levels(args, tok) -> tuple[list[list[int]], dict[int, list[list[int]]]]:
    """(warm-up prompts, the prompts of each concurrency level)."""
    n_per = 2 if args.quick else 4
    sets = ("function_calling", "code", "code_edit", "chat")
    prompts = [ids for _, _, ids in prompt_ids(tok, sets, n_per, 1024)]
    levels = {c: prompts * (2 if c >= 8 else 1) for c in args.concurrency}
    if args.fresh_prompts:  # every level its own held-out prompts (test, then validation split), none sent twice
        need = sum(2 if c >= 8 else 1 for c in args.concurrency) * n_per + 1  # + 1 for the warm-up
        pool = {
            w: [
                ids
                for _, _, ids in prompt_ids(tok, (w,), need, 1024, "test")
                + prompt_ids(tok, (w,), need, 1024, "validation")
            ][:need]
            for w in sets
        }
        short = [w for w, ids in pool.items() if len(ids) < need]
        if short:
            raise ValueError(f"--fresh-prompts: too few held-out prompts in {', '.join(short)} for these levels")
        prompts, at = [pool[w][-1] for w in sets], 0  # the warm-up prompts are not measured
        for c in args.concurrency:
            k = n_per * (2 if c >= 8 else 1)
            levels[c] = [ids for w in sets for ids in pool[w][at : at + k]]
            at += k
    return prompts, levels


def _request(base: str, ids: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: latency, time to first text, completion tokens."""
    import httpx

    body = {
        "model": "default",
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, usage = None, None
    with httpx.Client(base_url=base, timeout=600) as c, c.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ttft is None and ev.get("choices") and ev["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            if ev.get("usage"):
                usage = ev["usage"]
    return {
        "latency": time.perf_counter() - t0,
        "ttft": ttft or float("nan"),
        "tokens": usage["completion_tokens"] if usage else 0,
    }


def _pct(xs, q):
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def _stats(base: str) -> dict:
    import httpx

    with httpx.Client(base_url=base) as c:
        return c.get("/stats").json()


def _arm_steps(stats: dict) -> dict[str, int]:
    """Batch steps so far by the way they drafted (``/stats`` ``speculation``; empty without one)."""
    out: dict[str, int] = {}
    for entry in (stats.get("speculation") or {}).values():
        for arm, got in entry["arms"].items():
            out[arm] = out.get(arm, 0) + got["steps"]
    return out


def _arms_cell(s0: dict, s1: dict) -> str:
    """The level's batch steps by arm, cache / policy / plain shares (``-`` without a cost policy)."""
    a0, a1 = _arm_steps(s0), _arm_steps(s1)
    n = {arm: a1.get(arm, 0) - a0.get(arm, 0) for arm in ARMS}
    total = sum(n.values())
    return " / ".join(f"{100 * n[a] / total:.0f}%" for a in n) if total else "-"


def _parse_server(server: str) -> tuple[str, str, int | None]:
    """``drafter[:suffix_actor_mode][@torch_threads]`` -> (drafter, mode, threads); threads None:
    the serving default (``ServingConfig.threads``), what a user's replica gets."""
    spec, _, threads = server.partition("@")
    drafter, _, mode = spec.partition(":")
    return drafter, mode or "mirror", int(threads) if threads else None


def _server_config(args, server: str, i: int) -> dict:
    drafter, mode, threads = _parse_server(server)
    return {
        "model": "default",
        "dtype": args.dtype,
        "drafter": drafter,
        "max_batch": 8,
        "max_model_len": 2048,
        "max_tokens": 1024,
        "torch_threads": threads,
        "num_replicas": 1,
        "num_draft_tokens": args.num_draft_tokens,
        "ray_actor_options": {"num_cpus": 1},
        "suffix_actor_mode": mode,
        "suffix_actor_name": f"hvd-bench-suffix-{i}",
    }


def _server_md(args, server: str, n_prompts: int, rows: list[str], raw: dict) -> str:
    drafter, mode, threads = _parse_server(server)
    lines = [
        f"# HTTP benchmark: the Ray Serve app at concurrency {', '.join(map(str, args.concurrency))}",
        "",
        f"Command: `{command('jobs/benchmark.py')}`  ",
        f"Machine: {machine_line()}  ",
        f"Server: one replica, SmolLM2-135M-Instruct {DTYPE_NAMES[args.dtype]}, drafter `{drafter}`"
        + (
            f" (suffix cache shared through the drafter actor, `suffix_actor_mode: {mode}`"
            + (f" + shipped EAGLE-3 head, `{ServingConfig().policy}` policy)" if drafter == "hvd" else ")")
            if drafter in ("hvd", "suffix")
            else ""
        )
        + f", max_batch 8, {ServingConfig(torch_threads=threads).threads()} torch threads"
        + (" (the serving default: all cores but one)" if threads is None else "")
        + f"; greedy, up to {args.max_tokens} new tokens; "
        f"{n_prompts} held-out prompts (function calling, code, code editing, chat), streamed over HTTP "
        "(`/v1/completions`, SSE). "
        + (
            "Every level sends its own held-out prompts (test, then validation split; twice as many at "
            "concurrency 8 and above) and no prompt is sent twice: the suffix history holds only earlier "
            "levels' answers to other prompts."
            if args.fresh_prompts
            else "Concurrency 8 and above sends every prompt twice; every level after the first re-sends the "
            "first level's prompts (their answers are in the suffix history)."
        ),
        "",
        "Latency = request start to `[DONE]`; TTFT = request start to the first text chunk; "
        "actor wait = time the engine loop spent on suffix-drafter actor calls (blocked on them in `remote` mode; "
        "submitting and polling background calls in `mirror` mode) / time inside engine steps; in steps = time "
        "inside engine steps (prefill and decode) / wall time of the level; prefill = time in the prefill forwards "
        "of the level's requests / time inside engine steps (what no drafter can speed up); tokens/forward = "
        "tokens a request gained per target forward it took part in (finished requests); batch arms = the "
        "level's batch steps (2 rows or more) by the way they drafted under the cost policy (`GET /stats` "
        "`speculation`, `engine/speculation_check.py:SpeculationCheck`): the cache drafter's own drafts / the policy's "
        "choices / none.",
        "",
        "| concurrency | requests | requests/s | tokens/s | p50 latency s | p99 latency s | p50 TTFT s | p99 TTFT s "
        "| actor wait | in steps | prefill | tokens/forward | batch arms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]
    return (
        "\n".join(lines)
        + "\n<details><summary>raw</summary>\n\n```json\n"
        + json.dumps(raw, indent=1)
        + "\n```\n</details>\n"
    )


def bench_http_servers(args) -> list[tuple[str, str]]:
    """Every server in ``args.servers`` (``drafter[:suffix_actor_mode]``) as its own Serve
    application in one Ray, measured level by level in turn: at each concurrency every server runs
    the level's requests while the others idle, in an order that alternates from level to level.
    A shared box's speed drifts within minutes (docs/results-http.md); servers run one after
    another as whole jobs would see different machines, side by side they see the same one.

    Writes ``args.http_out`` when every server ran. Returns (server, markdown) pairs."""
    from concurrent.futures import ThreadPoolExecutor

    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from ..serving import build_app

    tok = AutoTokenizer.from_pretrained(resolve("default"))
    warm, levels = _levels(args, tok)
    servers = list(args.servers)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2 + 2 * len(servers), include_dashboard=False, log_to_driver=False)
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    rows: dict[str, list[str]] = {s: [] for s in servers}
    raw: dict[str, dict] = {s: {} for s in servers}
    tps: dict[tuple[str, int], float] = {}
    dec: dict[tuple[str, int], float] = {}
    failed: dict[str, str] = {}
    bases: dict[str, str] = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for i, server in enumerate(servers):
            try:
                serve.run(build_app(_server_config(args, server, i)), name=f"bench{i}", route_prefix=f"/s{i}")
                bases[server] = f"http://127.0.0.1:{port}/s{i}"
                _request(bases[server], warm[0], args.max_tokens)  # warm-up, not measured
            except Exception as e:  # noqa: BLE001 - the report says why the cells are missing
                failed[server] = f"{type(e).__name__}: {e}"
        live = [s for s in servers if s not in failed]
        for j, conc in enumerate(args.concurrency):
            work = levels[conc]
            for server in live if j % 2 == 0 else live[::-1]:
                base = bases[server]
                s0 = _stats(base)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(conc) as pool:
                    res = list(pool.map(functools.partial(_request, base, max_tokens=args.max_tokens), work))
                wall = time.perf_counter() - t0
                s1 = _stats(base)
                wait = sum(d.get("wait_s", 0.0) for d in s1["drafters"].values()) - sum(
                    d.get("wait_s", 0.0) for d in s0["drafters"].values()
                )
                busy = s1["decode_s"] - s0["decode_s"]
                prefill = s1.get("prefill_s", 0.0) - s0.get("prefill_s", 0.0)
                steps = s1["decode_steps"] - s0["decode_steps"]  # requests' steps: forwards each request took part in
                forward = (s1["decode_tokens"] - s0["decode_tokens"]) / steps if steps else 0.0
                toks = sum(r["tokens"] for r in res)
                raw[server][f"c{conc}"] = res
                tps[(server, conc)] = toks / wall
                # decoding's own throughput: the level's tokens over the time in steps outside prefill
                dec[(server, conc)] = toks / (busy - prefill) if busy > prefill else float("nan")
                lat, ttft = [r["latency"] for r in res], [r["ttft"] for r in res]
                rows[server].append(
                    f"| {conc} | {len(work)} | {len(work) / wall:.2f} | {toks / wall:.1f} | {_pct(lat, 0.5):.2f} | "
                    f"{_pct(lat, 0.99):.2f} | {_pct(ttft, 0.5):.2f} | {_pct(ttft, 0.99):.2f} | "
                    f"{100 * wait / busy if busy else 0:.1f}% | {100 * busy / wall:.0f}% | "
                    f"{100 * prefill / busy if busy else 0:.0f}% | {forward:.2f} | "
                    f"{_arms_cell(s0, s1)} |"
                )
                print(f"{server}: {rows[server][-1]}", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    out = [
        (s, f"not run: {failed[s]}\n" if s in failed else _server_md(args, s, len(warm), rows[s], raw[s]))
        for s in servers
    ]
    if not failed:
        dest = Path(args.http_out)
        summary = ""
        base = servers[0]
        if len(servers) > 1:  # tokens/s of each server over the first one's, per concurrency
            head = (
                "| concurrency | "
                + " | ".join(f"`{d}` tok/s" for d in servers)
                + " | "
                + " | ".join(f"`{d}` / `{base}`" for d in servers[1:])
                + " | "
                + " | ".join(f"`{d}` / `{base}` decoding" for d in servers[1:])
                + " |"
            )
            table = [
                f"| {c} | "
                + " | ".join(f"{tps[(d, c)]:.1f}" for d in servers)
                + " | "
                + " | ".join(f"**{tps[(d, c)] / tps[(base, c)]:.2f}x**" for d in servers[1:])
                + " | "
                + " | ".join(f"{dec[(d, c)] / dec[(base, c)]:.2f}x" for d in servers[1:])
                + " |"
                for c in args.concurrency
            ]
            summary = (
                "# HTTP benchmark summary (servers side by side in one Ray, taking turns level by level)\n\n"
                f"Command: `{command('jobs/benchmark.py')}`\n\n"
                "Every server is its own Serve application in the same Ray; at each concurrency level "
                "the servers run the level's requests in turn (the others idle), the order alternating "
                "from level to level.\n\n"
                + (
                    "Every level sends its own held-out prompts and none is sent twice: each level is a "
                    "cold pass for its prompts (the suffix history holds earlier levels' answers to other "
                    "prompts).\n\n"
                    if args.fresh_prompts
                    else "Every concurrency level sends the same prompts, so from the second level on a server "
                    "with a suffix cache has their answers in its global tree (the warm-repeat regime of "
                    "`benchmarks/regimes.md`); only the first level is a cold pass.\n\n"
                )
                + "\n".join([head, "| --- |" + " --- |" * (3 * len(servers) - 2), *table])
                + "\n\n"
                + "Decoding = tokens over the time inside engine steps less the level's prefill forwards "
                "(the per-server tables' `prefill` share): the part of the work a drafter can speed up. "
                "With a prefill share p and decoding k times as fast, a level gets 1 / (p + (1 - p) / k) "
                "times as fast.\n\n"
            )
        dest.write_text(summary + "\n".join(f"<!-- server: {d} -->\n{md}" for d, md in out))
        print(f"wrote {dest}", file=sys.stderr)
    return out
