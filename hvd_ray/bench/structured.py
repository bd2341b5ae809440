"""Constrained decoding under speculation: BFCL function schemas as ``response_format: json_schema``.

Each method decodes every task alone (batch 1), greedy, with the task's schema compiled by xgrammar
(``engine/grammar.py``); methods run in turn within each repetition, and each repetition builds its
engines afresh, so a suffix cache only learns from the outputs of the same repetition (earlier
tasks' JSON, as a server answering such calls would). Reported: whether every output parses and
validates, whether each method's tokens equal constrained decoding without speculation (fp32),
target forwards per 1,000 tokens, and tokens/s end to end (prefill included) and in decode (tokens
after the first over the decode time).
"""

from __future__ import annotations

import json
import statistics
import time

from ..build import EngineSpec, build_engine
from ..engine import SamplingParams
from ..model import load
from ..workloads.structured import bfcl_schema_tasks
from .machine import DTYPE_NAMES, command, cpu_name, machine_line, versions

METHODS = ("none", "hvd")  # drafters; "none" is constrained decoding without speculation


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def bench_structured(args) -> str:
    model, tok = load("default", args.dtype)
    tasks = bfcl_schema_tasks(args.prompts or 20)
    prompts = [
        tok(
            tok.apply_chat_template(t["messages"], add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )["input_ids"]
        for t in tasks
    ]
    methods = ["none"] + [m for m in (args.drafters or METHODS) if m != "none"]
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    outputs: dict[str, list[list[int]]] = {}
    t_job = time.perf_counter()
    for rep in range(args.reps):
        for m in methods:
            engine = build_engine(EngineSpec(drafter=m, max_batch=1, max_len=2048), model, tok)
            warm = SamplingParams(max_tokens=8, structure={"type": "json_object"})
            engine.generate([prompts[0]], warm)  # first-call costs (grammar compiler, kernels) out of the timing
            row = {"tokens": 0, "forwards": 0, "decode_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0, "valid": 0}
            outs = []
            for ids, t in zip(prompts, tasks):
                p = SamplingParams(
                    max_tokens=args.max_tokens,
                    temperature=0.0,
                    structure={"type": "json_schema", "schema": t["schema"]},
                )
                r = engine.generate([ids], p)[0]
                outs.append(r.output)
                row["tokens"] += len(r.output)
                row["forwards"] += r.stats.target_forwards
                row["decode_tokens"] += len(r.output) - 1
                row["prefill_s"] += r.stats.prefill_s
                row["decode_s"] += r.stats.decode_s
                row["valid"] += r.finish_reason == "stop" and _valid(
                    tok.decode(r.output, skip_special_tokens=True), t["schema"]
                )
            runs[m].append(row)
            outputs.setdefault(m, outs)
            print(f"rep {rep} {m}: {row}", flush=True)
    job_s = time.perf_counter() - t_job
    return report(args, tasks, prompts, methods, runs, outputs, job_s)


def report(args, tasks, prompts, methods, runs, outputs, job_s) -> str:
    med = statistics.median
    lens = sorted(map(len, prompts))
    base = runs["none"]

    def e2e(r):
        return r["tokens"] / (r["prefill_s"] + r["decode_s"])

    def dec(r):
        return r["decode_tokens"] / r["decode_s"]

    lines = [
        "# Constrained decoding: BFCL function schemas as `response_format: json_schema`",
        "",
        f"Command: `{command('jobs/benchmark.py')}`  ",
        f"Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_name()}; {versions().split(', ray ')[0]}  ",
        f"Machine: {machine_line()}  ",
        f"Model: SmolLM2-135M-Instruct, {DTYPE_NAMES[args.dtype]}, greedy, at most {args.max_tokens} tokens; "
        f"{len(tasks)} tasks (BFCL `simple_python`: the question, answered by the arguments of its function as "
        f"one JSON object under the function's parameter schema), prompts of {lens[0]}-{lens[-1]} tokens; each "
        f"request alone (batch 1); {args.reps} repetitions, methods in turn, engines built afresh each "
        f"repetition; whole job {job_s:.0f} s.",
        "",
        "valid = outputs that finished and validate against their schema; same tokens = outputs equal to "
        "constrained decoding without speculation (`none`); tok/s end to end = output tokens over prefill + "
        "decode time; decode tok/s = tokens after the first over the decode time (speculation cannot speed "
        "up a prefill); x = over `none` in the same repetition (median of the repetitions).",
        "",
        "| method | valid | same tokens | forwards / 1k tokens | tokens / decode forward | tok/s end to end | x | "
        "decode tok/s | x |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in methods:
        rs = runs[m]
        same = sum(a == b for a, b in zip(outputs[m], outputs["none"]))
        r0 = rs[0]
        steps = r0["forwards"] - len(tasks)
        lines.append(
            f"| `{m}` | {r0['valid']}/{len(tasks)} | {same}/{len(tasks)} | "
            f"{1000 * r0['forwards'] / r0['tokens']:.0f} | {r0['decode_tokens'] / max(steps, 1):.2f} | "
            f"{med(e2e(r) for r in rs):.1f} | {med(e2e(r) / e2e(b) for r, b in zip(rs, base)):.2f}x | "
            f"{med(dec(r) for r in rs):.1f} | {med(dec(r) / dec(b) for r, b in zip(rs, base)):.2f}x |"
        )
    return "\n".join(lines) + "\n"
