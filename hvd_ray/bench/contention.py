"""Intra-op threads beside a busy neighbour: our engine in one process at a concurrency, with one torch
thread and with all cores, alone and beside another process that keeps part of a core busy in short
bursts (as a server's HTTP and streaming path does: Serve's proxy, the ingress, Ray's own processes).

torch's OpenMP ops end on a barrier, so a decode step of many short ops waits whenever any of its
threads is descheduled; with every core given to torch, a neighbour's bursts land inside those ops.
This measures what that costs, to say how many torch threads a replica should run beside its
serving path (``ServingConfig.threads``) and what a server on a small machine must do to use every
core (docs/results-http.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from ..build import build_engine
from ..engine import SamplingParams
from ..model import load
from ..serving.config import ServingConfig
from .machine import DTYPE_NAMES, command, cpu_name, machine_line, versions
from .prompts import prompt_ids
from .where_time import staggered_loop

BURST_S = 0.003  # the neighbour's period: busy for share * BURST_S, then asleep for the rest

NEIGHBOUR = """
import sys, time
share, period = float(sys.argv[1]), float(sys.argv[2])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < share * period:
        pass
    time.sleep((1 - share) * period)
"""


def neighbour(share: float) -> subprocess.Popen | None:
    """A process keeping ``share`` of one core busy in bursts (None for share 0)."""
    if share <= 0:
        return None
    return subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(share), str(BURST_S)])


def run(engine, prompts, params, c: int, threads: int, share: float) -> dict:
    """The engine over ``prompts`` at concurrency ``c`` with ``threads`` torch threads beside a
    neighbour of ``share``: tok/s over the wall time, and the cores this process kept busy."""
    import torch

    torch.set_num_threads(threads)
    staggered_loop(engine, prompts[:c], params, c)  # warm-up: caches, oneDNN primitives for this width
    proc = neighbour(share)
    try:
        me = psutil.Process()
        cpu0, t0 = sum(me.cpu_times()[:2]), time.perf_counter()
        reqs, _ = staggered_loop(engine, prompts[c:], params, c)
        wall = time.perf_counter() - t0
        cpu = sum(me.cpu_times()[:2]) - cpu0
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    return {"tok_s": sum(len(r.output) for r in reqs) / wall, "cores": cpu / wall}


def bench_contention(args) -> str:
    c = args.concurrency[-1] if args.concurrency else 8
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    shares = args.busy_shares
    cfg = ServingConfig.model_validate(
        {"model": "default", "dtype": args.dtype, "drafter": "none", "max_batch": max(8, c), "max_model_len": 4096}
    )
    model, tok = load(cfg.model, cfg.dtype, cfg.device)
    engine = build_engine(cfg.engine_spec(), model, tok)
    n = args.prompts or 4 * c
    workload = (args.workloads or ["agent"])[0]
    prompts = [ids for *_, ids in prompt_ids(tok, [workload], n, args.max_prompt_tokens)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    t_job = time.perf_counter()
    for threads in sorted({1, cores}):
        for share in shares:
            results[threads, share] = r = run(engine, prompts, params, c, threads, share)
            print(f"[contention] {threads} threads, neighbour {share}: {r['tok_s']:.1f} tok/s", flush=True)
    lens = sorted(map(len, prompts))
    lines = [
        "# Intra-op threads beside a busy neighbour",
        "",
        f"Command: `{command('jobs/benchmark.py')}`  ",
        f"Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_name()}; {versions().split(', ray ')[0]}  ",
        f"Machine: {machine_line()}  ",
        f"Model: SmolLM2-135M-Instruct, {DTYPE_NAMES[args.dtype]}, our engine as a replica builds it (drafter "
        f"`none`, 4,096-token slots), greedy, {args.max_tokens} output tokens per request (`ignore_eos`); "
        f"{n - c} {workload} prompts of {lens[0]}-{lens[-1]} tokens, {c} in flight (staggered as in "
        f"`where`), after {c} warm-up prompts; whole job {time.perf_counter() - t_job:.0f} s.",
        "",
        f"neighbour = another process busy for that share of one core, in bursts every {BURST_S * 1e3:.0f} ms "
        "(a server's HTTP and streaming path measured 0.25-0.3 of a core at concurrency 8 in where_time.md). "
        "x alone = tok/s over the same threads without a neighbour; x 1 thread = over one torch thread at the "
        "same neighbour; cores = the engine process's busy cores over the wall time.",
        "",
        "| torch threads | neighbour | tok/s | x alone | x 1 thread | cores |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (threads, share), r in results.items():
        alone = results[threads, shares[0]]["tok_s"]
        one = results[1, share]["tok_s"]
        lines.append(
            f"| {threads} | {share:g} | {r['tok_s']:.1f} | {r['tok_s'] / alone:.2f}x | {r['tok_s'] / one:.2f}x | "
            f"{r['cores']:.2f} |"
        )
    return "\n".join(lines) + "\n"


__all__ = ["bench_contention", "neighbour"]
