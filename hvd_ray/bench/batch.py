"""Load in one process: each method keeps ``concurrency`` requests running (a new prompt enters as
soon as one finishes, as clients over HTTP would), and the methods' engines take turns step by step
(A B A B ...), each on its own copy of the model. Ratios come from the same machine state, without
Serve's proxy, the ingress and the clients on the same cores (``bench/serve.py`` measures those)."""

from __future__ import annotations

import sys
import time

from ..build import build_engine, spec_from_args
from ..engine.speculation_check import ARMS
from ..model import load
from .machine import DTYPE_NAMES, command, machine_line
from .prompts import prompt_ids


def method_spec(name: str, args, concurrency: int, max_len: int):
    """``greedy``, ``hvd-<policy>`` (``+predictor=DIR``: another predictor artifact, as in spec
    mode) or a drafter name, as an engine spec with ``concurrency`` slots."""
    if name == "greedy":
        extra = {"drafter": "none"}
    elif name.startswith("hvd-"):
        policy, _, predictor = name[4:].partition("+predictor=")
        extra = {"drafter": "hvd", "policy": policy, **({"predictor": predictor} if predictor else {})}
    else:
        extra = {"drafter": name}
    return spec_from_args(args, max_batch=concurrency, max_len=max_len, **extra)


def closed_loop(engines: dict, prompts: list[list[int]], params, concurrency: int) -> dict:
    """Every engine through ``prompts`` at ``concurrency``, one step each in turn. Per method: the
    requests and the seconds spent inside its steps."""
    queue = {m: list(prompts) for m in engines}
    done: dict[str, list] = {m: [] for m in engines}
    spent = {m: 0.0 for m in engines}
    live, steps = True, 0
    while live:
        live = False
        for m, eng in engines.items():
            while queue[m] and len(eng.running) + len(eng.waiting) < concurrency:
                done[m].append(eng.add_request(queue[m].pop(0), params))
            if eng.has_unfinished():
                live = True
                t0 = time.perf_counter()
                eng.step()
                spent[m] += time.perf_counter() - t0
        steps += 1
        if steps % 200 == 0:
            print(
                f"[c={concurrency}] step {steps}: "
                + ", ".join(f"{m} {sum(r.finished for r in done[m])}/{len(prompts)}" for m in engines),
                file=sys.stderr,
                flush=True,
            )
    return {m: {"reqs": done[m], "seconds": spent[m]} for m in engines}


def bench_batch(args) -> str:
    from ..engine import SamplingParams

    _, tok = load("default", args.dtype)
    n_per = args.prompts or (6 if args.quick else 16)
    split = None if args.split == "all" else args.split
    prompts = [ids for *_, ids in prompt_ids(tok, args.workloads, n_per, args.max_prompt_tokens, split)]
    params = SamplingParams(max_tokens=args.max_tokens)
    methods = ["greedy", *args.drafters]
    max_len = args.max_prompt_tokens + args.max_tokens + 64
    lines = [
        "# Batched decoding under closed-loop load (in-process)",
        "",
        f"Command: `{command('jobs/benchmark.py')}`  ",
        f"Machine: {machine_line()}  ",
        f"Model: SmolLM2-135M-Instruct, {DTYPE_NAMES[args.dtype]}, greedy, up to {args.max_tokens} new tokens; "
        f"{len(prompts)} {'' if split is None else f'{split}-split '}prompts ({', '.join(args.workloads)}), "
        "each sent once (cold: every method's suffix history holds only this run's earlier answers). "
        "Each method keeps `concurrency` requests running, a new one entering as one finishes; the "
        "methods' engines take turns step by step, each on its own copy of the model.",
        "",
        "tok/s = generated tokens / time inside the method's engine steps (prefill included); "
        "tokens/forward = decode tokens per request per target forward it took part in; drafted "
        "steps = decode steps in which the request verified a draft; arms = hvd's batch steps (2 rows or "
        "more) by the way they drafted (`engine/speculation_check.py:SpeculationCheck`): the cache drafter's own "
        "drafts / the policy's choices / none.",
        "",
        "| concurrency | method | tokens | tok/s | vs greedy | tokens/forward | drafted steps | identical to greedy "
        "| arms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in args.concurrency:
        engines = {}
        for m in methods:
            model, _ = load("default", args.dtype)  # one model each: engines must not share a KV cache
            engines[m] = build_engine(method_spec(m, args, c, max_len), model, tok)
        runs = closed_loop(engines, prompts, params, c)
        ref = [r.output for r in runs["greedy"]["reqs"]]
        base = sum(map(len, ref)) / runs["greedy"]["seconds"]
        for m, run in runs.items():
            reqs = run["reqs"]
            toks = sum(len(r.output) for r in reqs)
            steps = [s for r in reqs for s in r.stats.steps]
            tps = toks / run["seconds"]
            same = sum(r.output == o for r, o in zip(reqs, ref))
            armed = [s.arm for s in steps if s.arm is not None]
            arms = " / ".join(f"{armed.count(a) / len(armed):.0%}" for a in ARMS) if armed else ""
            lines.append(
                f"| {c} | {m} | {toks} | {tps:.1f} | **{tps / base:.2f}x** | "
                f"{sum(s.accepted + 1 for s in steps) / max(len(steps), 1):.2f} | "
                f"{sum(s.drafted > 0 for s in steps) / max(len(steps), 1):.0%} | {same}/{len(reqs)} | "
                f"{arms} |"
            )
        del engines, runs
    return "\n".join(lines) + "\n"
