"""What an arriving prompt's prefill costs the streams already decoding, and what it costs the new
request, with whole-prompt prefill and with chunked prefill (``prefill_chunk``).

Our engine in one process, as a replica builds it, keeps ``concurrency`` requests running (staggered
as in ``where``: a new prompt enters as one finishes, so prefills land among running streams). Each
step's end is a delivery time for every request that gained tokens then: a stream's gaps between
deliveries are what its client sees (a prefill in a step stretches that step's gap for every
stream), and a request's first delivery after it entered is its time to first token, compared with
the time its own prefill forwards took."""

from __future__ import annotations

import statistics
import time

from ..build import build_engine
from ..engine import SamplingParams
from ..model import load
from ..serving.config import ServingConfig
from .machine import DTYPE_NAMES, command, cpu_name, machine_line, versions
from .prompts import prompt_ids


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(engine, prompts: list[list[int]], params, c: int) -> dict:
    """``prompts`` through ``engine`` at concurrency ``c``: tok/s, the streams' delivery gaps and
    the requests' times to first token over their own prefill seconds."""
    queue, reqs, entered, gaps, ttft = list(prompts), [], {}, [], []
    last: dict[str, tuple[int, float]] = {}  # request -> (tokens it had, when it got them)
    gap, step = max(1, params.max_tokens // c), 0
    t0 = time.perf_counter()
    while queue or engine.has_unfinished():
        ramp = len(reqs) < c and step % gap == 0
        while queue and len(engine.running) + len(engine.waiting) < c and (ramp or len(reqs) >= c):
            r = engine.add_request(queue.pop(0), params)
            reqs.append(r)
            # when it arrived, and whether streams were decoding then
            entered[r.req_id] = (time.perf_counter(), any(x.output and not x.finished for x in engine.running))
            ramp = False
        engine.step()
        now = time.perf_counter()
        for r in reqs:
            n, before = len(r.output), last.get(r.req_id)
            if not n or (before is not None and before[0] == n):
                continue
            if before is not None:
                gaps.append(now - before[1])
            elif entered[r.req_id][1]:  # its first token, after it arrived beside decoding streams
                ttft.append((now - entered[r.req_id][0], r.stats.prefill_s))
            last[r.req_id] = (n, now)
        step += 1
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output) for r in reqs)
    ratio = [t / p for t, p in ttft if p > 0]
    return {
        "tok_s": tokens / wall,
        "gap_p50": _pct(gaps, 0.5),
        "gap_p99": _pct(gaps, 0.99),
        "gap_max": max(gaps, default=float("nan")),
        "ttft_p50": _pct([t for t, _ in ttft], 0.5),
        "ttft_p99": _pct([t for t, _ in ttft], 0.99),
        "prefill_p50": statistics.median([p for _, p in ttft]) if ttft else float("nan"),
        "ratio_p50": _pct(ratio, 0.5),
        "ratio_p99": _pct(ratio, 0.99),
        "arrivals": len(ttft),
    }


def bench_prefill(args) -> str:
    c = args.concurrency[-1] if args.concurrency else 8
    drafter = args.drafters[0] if args.drafters else "none"
    chunks = [None if ch <= 0 else ch for ch in args.prefill_chunks]
    model, tok = load("default", args.dtype)
    n = args.prompts or 4 * c
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    t_job = time.perf_counter()
    tables = []
    for workload in args.workloads or ["agent"]:
        prompts = [ids for *_, ids in prompt_ids(tok, [workload], n + c, args.max_prompt_tokens)]
        results = []  # (chunk, figures) in run order: a setting may repeat, to show drift between runs
        for chunk in chunks:
            cfg = ServingConfig.model_validate(
                {"dtype": args.dtype, "drafter": drafter, "max_batch": c, "max_model_len": 4096, "prefill_chunk": chunk}
            )
            engine = build_engine(cfg.engine_spec(), model.with_own_cache(), tok)  # fresh cache: no reuse across runs
            run(engine, prompts[:c], params, c)  # warm-up: oneDNN primitives, the step-cost fits
            results.append((chunk, run(engine, prompts[c:], params, c)))
            r = results[-1][1]
            print(f"[prefill] {workload}, chunk {chunk}: {r['tok_s']:.1f} tok/s, gap max {r['gap_max']:.3f} s")
        lens = sorted(map(len, prompts[c:]))
        tables += ["", f"### {workload}: {len(lens)} prompts of {lens[0]}-{lens[-1]} tokens", "", *_table(results)]
    lines = [
        "# Chunked prefill: arriving prompts beside decoding streams",
        "",
        f"Command: `{command('jobs/benchmark.py')}`  ",
        f"Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_name()}; {versions().split(', ray ')[0]}  ",
        f"Machine: {machine_line()}  ",
        f"Model: SmolLM2-135M-Instruct, {DTYPE_NAMES[args.dtype]}, our engine as a replica builds it (drafter "
        f"`{drafter}`, 4,096-token slots, a fresh KV cache per row), greedy, {args.max_tokens} output tokens per "
        f"request (`ignore_eos`); {n} prompts per workload with {c} in flight (staggered as in `where`), after {c} "
        f"warm-up prompts; whole job {time.perf_counter() - t_job:.0f} s.",
        "",
        "Rows in run order. chunk = `prefill_chunk` (prompt tokens a step may prefill while streams decode; "
        "- = whole prompts); x first = tok/s over the first row's. "
        "gap = seconds between a decoding stream's deliveries (step ends that gave it tokens). TTFT = from a "
        "request's arrival beside decoding streams to its first token; prefill = the seconds of its own prefill "
        "forwards (the tokens a shared prefix did not cover); TTFT/prefill per request.",
        *tables,
    ]
    return "\n".join(lines) + "\n"


def _table(results: list[tuple[int | None, dict]]) -> list[str]:
    base = results[0][1]["tok_s"]
    lines = [
        "| chunk | tok/s | x first | gap p50 | gap p99 | gap max | TTFT p50 | TTFT p99 | prefill p50 | "
        "TTFT/prefill p50 | p99 | arrivals |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for chunk, r in results:
        lines.append(
            f"| {chunk or '-'} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | {r['gap_p50']:.3f} | "
            f"{r['gap_p99']:.3f} | {r['gap_max']:.3f} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | "
            f"{r['prefill_p50']:.2f} | {r['ratio_p50']:.2f} | {r['ratio_p99']:.2f} | {r['arrivals']} |"
        )
    return lines


__all__ = ["bench_prefill", "run"]
