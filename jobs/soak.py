"""Reliability benchmark: soak the serving defaults, fuzz them, kill their model replica.

    python jobs/soak.py --minutes 10 --concurrency 32 --out benchmarks/reliability.md

Starts a local Ray + Serve application with the serving defaults (what ``make run`` serves: drafter
``hvd``, bf16, 4 slots; ``--arg key=value`` changes a config key), then:

1. soak: ``--concurrency`` clients for ``--minutes`` (bench/load.py: chat and completions, streamed
   or not, sampled or greedy, 10 % of streams hang up early), with the replica's RSS, free KV slots,
   live suffix-tree requests and the suffix actor's requests read before and after;
2. fuzz: schemathesis over /openapi.json (bench/fuzz.py), outcome counts;
3. fault: the model replica killed under load (bench/faults.py): outcomes and time to recovery;
4. overload: 2x, 8x and 32x as many concurrent clients as KV slots (``--overload``), each level
   sending twice as many requests as clients: served, shed (503 + Retry-After), failed, latency.

Writes a markdown report (and its data as JSON beside it) with the command of each phase;
``--phases fault`` reruns one phase and keeps the others' results from the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

KEY = "sk-soak"
PHASES = ["soak", "fuzz", "fault", "overload"]


def _actor_requests() -> int:
    import ray

    from hvd_ray.serving.suffix_actor import service_actors

    (actor,) = service_actors("hvd-suffix-drafter").values()
    return ray.get(actor.stats.remote())["requests"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32, help="per request (default 32)")
    ap.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a serving config key (hvd_ray/serving/config.py), e.g. dtype=float32",
    )
    ap.add_argument("--fuzz-examples", type=int, default=50, help="schemathesis examples per route and mode")
    ap.add_argument("--phases", nargs="+", default=PHASES, choices=PHASES)
    ap.add_argument(
        "--overload",
        nargs="+",
        type=int,
        default=[2, 8, 32],
        metavar="X",
        help="overload levels: clients as a multiple of the KV slots (default 2 8 32)",
    )
    ap.add_argument("--out", default="benchmarks/reliability.md")
    args = ap.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["HVD_RAY_API_KEY"] = KEY
    import httpx
    import ray
    import yaml
    from ray import serve

    from hvd_ray.bench.faults import kill_replica_under_load
    from hvd_ray.bench.fuzz import fuzz
    from hvd_ray.bench.load import real_prompts, run_load, wait_idle
    from hvd_ray.bench.machine import cpu_name, machine_line, versions
    from hvd_ray.serving import ServingConfig, build_app

    conf = {"num_replicas": 1, **{k: yaml.safe_load(v) for k, v in (a.split("=", 1) for a in args.arg)}}
    cfg = ServingConfig.model_validate(conf)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg), name="hvd", route_prefix="/")
    out = Path(args.out)
    data = out.with_suffix(".json")
    report: dict = json.loads(data.read_text()) if data.exists() and len(args.phases) < len(PHASES) else {}
    cmd = "python jobs/soak.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        with httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {KEY}"}) as http:
            http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 2}).raise_for_status()
            if "soak" in args.phases:
                before = wait_idle(http, timeout=300)
                print(f"[soak] {args.concurrency} clients for {args.minutes} min against {url}", flush=True)
                res = asyncio.run(
                    run_load(
                        url,
                        concurrency=args.concurrency,
                        duration_s=60 * args.minutes,
                        max_tokens=args.max_tokens,
                        api_key=KEY,
                        progress_every_s=30,
                    )
                )
                after = wait_idle(http, timeout=300)
                report["soak"] = {
                    **res.summary(),
                    "command": cmd,
                    "config": conf,
                    "minutes": args.minutes,
                    "concurrency": args.concurrency,
                    "rss_start_mib": before["rss_bytes"] / 2**20,
                    "rss_end_mib": after["rss_bytes"] / 2**20,
                    "free_slots_end": after["free_slots"],
                    "slots": cfg.max_batch,
                    "live_drafter_requests_end": after["live_drafter_requests"],
                    "actor_requests_end": _actor_requests(),
                    "engine_failed": after["failed"],
                }
                print("[soak]", json.dumps(report["soak"]), flush=True)
            if "fuzz" in args.phases:
                print("[fuzz] schemathesis ...", flush=True)
                t0 = time.perf_counter()
                outcomes = fuzz(
                    url,
                    KEY,
                    {"positive": args.fuzz_examples, "negative": args.fuzz_examples, "nasty": args.fuzz_examples},
                )
                report["fuzz"] = {
                    "outcomes": {f"{r} {m} {s}": n for (r, m, s), n in sorted(outcomes.items())},
                    "s": time.perf_counter() - t0,
                    "command": cmd,
                    "config": conf,
                }
            if "fault" in args.phases:
                print("[fault] killing the model replica under load ...", flush=True)
                k = kill_replica_under_load(
                    url, KEY, concurrency=8, requests=24, max_tokens=16, app="hvd", prompts=real_prompts(max_chars=2000)
                )
                report["fault"] = {
                    **k.load.summary(),
                    "hung": k.hung,
                    "healthy_s": k.healthy_s,
                    "recovery_s": k.recovery_s,
                    "probes": k.probes,
                    "command": cmd,
                    "config": conf,
                }
            if "overload" in args.phases:
                levels = []
                for x in args.overload:
                    clients = x * cfg.max_batch
                    print(f"[overload] {clients} clients ({x}x the slots), {2 * clients} requests", flush=True)
                    res = asyncio.run(
                        run_load(
                            url,
                            concurrency=clients,
                            requests=2 * clients,
                            api_key=KEY,
                            max_tokens=args.max_tokens,
                            disconnect_share=0.0,
                            seed=x,
                            prompts=real_prompts(max_chars=2000),
                        )
                    )
                    idle = wait_idle(http, timeout=300)
                    levels.append(
                        {
                            **res.summary(),
                            "x": x,
                            "clients": clients,
                            "slots_free_after": idle["free_slots"],
                            "slots": idle["slots"],
                        }
                    )
                    print("[overload]", json.dumps(levels[-1]), flush=True)
                report["overload"] = {
                    "levels": levels,
                    "command": cmd,
                    "config": conf,
                    "queue": cfg.replica_max_ongoing() + cfg.replica_max_queued(),
                    "first_token_timeout_s": cfg.first_token_timeout_s,
                    "machine": f"{cpu_name()}; {machine_line()}",
                    "versions": versions(),
                    "date": time.strftime("%Y-%m-%d"),
                }
    finally:
        serve.shutdown()
        ray.shutdown()
    out.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(json.dumps(report, indent=1) + "\n")
    write(report, out)


def _secs(x: float) -> str:
    return "-" if x != x else f"{x:.2f} s"  # NaN: nothing to time


def _kind(e: str) -> str:
    return "503" if e.startswith("HTTP 503") else "an error event on the stream" if "error event" in e else e[:80]


def write(r: dict, out: Path) -> None:
    s, f, k = r["soak"], r["fuzz"], r["fault"]
    o = r.get("overload")
    errors = "; ".join(f"{n}x {e}" for e, n in s["errors"].items()) or "none"
    lines = [
        "# Reliability: soak, fuzz, replica kill",
        "",
        "Serving config: the defaults (`make run`: drafter `hvd` with the shipped EAGLE-3 head and the shared "
        "suffix actor, bf16, 4 KV slots) with one model replica and `max_tokens` (the per-request limit) 64, which "
        "bounds the fuzz's generations. Clients: chat and completions, streamed or not, sampled (T 0.8, top-p 0.95, "
        "seeded) or greedy, on real test-split prompts (code, chat, function calling); 10 % of streams hang up "
        "after their first chunk.",
        "",
        f"## Soak: {s['concurrency']} clients for {s['minutes']:g} minutes",
        "",
        f"`{s['command']}`",
        "",
        "| requests | ok | hung up by the client | failed | p50 / p90 / p99 latency | p50 / p99 time to first token "
        "| completion tok/s | replica RSS start -> end |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {s['sent']} | {s['ok']} | {s['disconnected']} | **{s['failed']}** | {s['p50_s']:.1f} / {s['p90_s']:.1f} / "
        f"{s['p99_s']:.1f} s | {s['ttft_p50_s']:.1f} / {s['ttft_p99_s']:.1f} s | {s['tokens_per_s']} | "
        f"{s['rss_start_mib']:.0f} -> {s['rss_end_mib']:.0f} MiB |",
        "",
        f"Failure kinds: {errors}. After the soak: {s['free_slots_end']} of {s['slots']} KV slots free, "
        f"{s['live_drafter_requests_end']} live suffix-tree requests in the replica, {s['actor_requests_end']} in the "
        f"shared suffix actor, {s['engine_failed']} requests failed by the engine.",
        "",
        "Latency is mostly queueing: 32 clients share 4 KV slots of one replica on 2 CPU cores, and on this "
        "machine's CPU (AVX2, no bf16 matrix instructions) a bf16 prefill is ~6x slower than fp32's.",
        "",
        f"## Fuzz: schemathesis over /openapi.json ({f['s']:.0f} s)",
        "",
        f"`{f['command']}`",
        "",
        "| route, mode, status | responses |",
        "| --- | --- |",
        *[f"| {key} | {n} |" for key, n in f["outcomes"].items()],
        "",
        "No 5xx; every 4xx carried the OpenAI error body (the run stops at the first that does not).",
        "",
        "## Fault: the model replica killed under load (8 clients, 24 requests, prompts under 2,000 characters)",
        "",
        f"`{k['command']}`",
        "",
        f"- requests: {k['sent']}: {k['ok']} ok, {k['failed']} ended with a clean error "
        f"({'; '.join(f'{n}x {_kind(e)}' for e, n in k['errors'].items()) or 'none'}); hung: {k['hung']}",
        f"- kill -> a replacement replica answers `/health`: **{k['healthy_s']:.1f} s**; kill -> the first "
        f"request sent after the kill succeeded: **{k['recovery_s']:.1f} s** (it queues behind the clients' "
        "requests)",
        "",
    ]
    if o:
        lines += [
            "## Overload: clients at 2x, 8x, 32x the KV slots",
            "",
            f"`{o['command']}` ({o['date']}; {o['machine']}; {o['versions']})",
            "",
            f"Each level sends twice as many requests as it has clients, each client sending its next request when "
            f"the last one ends. A replica admits {o['queue']} requests (running, waiting for a slot, or queued at "
            "the ingress: `max_ongoing_requests` + `max_queued_requests`); past that a request is shed at once with "
            f"a 503, `Retry-After` and the OpenAI error body, and one without its first token "
            f"{o['first_token_timeout_s']:g} s after it arrived is shed the same way.",
            "",
            "| clients | requests | served | shed (503 + Retry-After) | failed | p50 / p99 latency of the served | "
            "p99 time to shed | completion tok/s | KV slots free after |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *[
                f"| {lv['clients']} ({lv['x']}x) | {lv['sent']} | {lv['ok']} | {lv['rejected']} | **{lv['failed']}** | "
                f"{lv['p50_s']:.1f} / {lv['p99_s']:.1f} s | {_secs(lv['rejected_p99_s'])} | {lv['tokens_per_s']} | "
                f"{lv['slots_free_after']} of {lv['slots']} |"
                for lv in o["levels"]
            ],
            "",
            "Shed kinds: "
            + "; ".join(
                f"{lv['x']}x: " + (", ".join(f"{n}x {c}" for c, n in lv["reject_codes"].items()) or "none")
                for lv in o["levels"]
            )
            + ".",
            "",
        ]
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
