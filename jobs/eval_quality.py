"""VIA-SD evaluation: speed and quality of the slim-verifier tier next to greedy and two-tier spec.

Speed (batch 1, interleaved per prompt, held-out prompts of several workloads): greedy, two-tier
speculative decoding with drafter D, D + lossless slim tier, D + tiered slim tier. Reports MAT,
rejection rate, full-target forwards per 1,000 tokens, slim forwards, tok/s ratios vs greedy and
vs two-tier, agreement with greedy.

Quality (batch 8): greedy vs tiered (lossless is greedy by construction; tests/test_tiered.py
checks it token for token in fp32) on HumanEval pass@1 and BFCL exact match (``hvd_ray.bench.scoring``).

    python jobs/eval_quality.py --drafters suffix eagle3 --out benchmarks/via_sd.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from hvd_ray.bench.interleave import prefix_agreement
from hvd_ray.bench.machine import machine_line
from hvd_ray.bench.prompts import prompt_ids
from hvd_ray.bench.scoring import bfcl_match, extract_code, parse_tool_calls, run_tests, sandbox_info
from hvd_ray.build import EngineSpec, build_engine
from hvd_ray.dimr import describe_mask, resolve_mask
from hvd_ray.engine import Engine, SamplingParams
from hvd_ray.model import load
from hvd_ray.verification.tiered import SlimTier, TierThresholds
from hvd_ray.workloads import load_workload, render

BFCL_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")


def slim_tier(mode: str, args, n_layers: int) -> SlimTier:
    """``lossless`` | ``tiered`` (the gates given) | ``tiered-strict`` (q' accepts only its own argmax)."""
    if mode == "tiered-strict":
        th = TierThresholds(accept=1.0, escalate=args.escalate, early_accept=1.0, own=args.own)
        mode = "tiered"
    else:
        th = TierThresholds(accept=args.accept, escalate=args.escalate, own=args.own)
    return SlimTier(resolve_mask(args.mask, n_layers), mode, th, max_lag=args.max_lag)


def make_engine(method: str, model, tok, args, max_batch: int, max_len: int) -> Engine:
    """``greedy`` | ``D`` | ``D+lossless`` | ``D+tiered`` for a drafter name D (the slim tier with
    this job's gates, hence built here)."""
    drafter_name, _, mode = method.partition("+")
    spec = EngineSpec(
        drafter="none" if drafter_name == "greedy" else drafter_name,
        max_batch=max_batch,
        max_len=max_len,
        num_draft_tokens=args.num_draft_tokens,
    )
    return build_engine(spec, model, tok, slim_tier=slim_tier(mode, args, model.cfg.n_layers) if mode else None)


def bench_speed(model, tok, args) -> tuple[list[str], dict]:
    prompts = prompt_ids(tok, args.workloads, args.per_workload, args.max_prompt_tokens)
    max_len = args.max_prompt_tokens + args.max_tokens + args.num_draft_tokens + 64
    methods = ["greedy"] + [
        f"{d}{m}"
        for d in args.drafters
        for m in ("", "+lossless", "+tiered") + (("+tiered-strict",) if args.strict else ())
    ]
    engines = {m: make_engine(m, model, tok, args, 1, max_len) for m in methods}
    params = SamplingParams(max_tokens=args.max_tokens)
    engines["greedy"].generate([prompts[0][2]], params)  # warm-up
    acc = {
        m: dict(
            tokens=0,
            time=0.0,
            full=0,
            slim=0,
            steps=0,
            dec=0,
            drafted=0,
            accepted=0,
            s_acc=0,
            s_regen=0,
            s_esc=0,
            identical=0,
            prefix=0.0,
            n=0,
        )
        for m in methods
    }
    for i, (_w, pid, ids) in enumerate(prompts):
        ref = None
        for m in methods:
            t0 = time.perf_counter()
            req = engines[m].generate([ids], params)[0]
            dt = time.perf_counter() - t0
            ref = req.output if m == "greedy" else ref
            a, st = acc[m], req.stats
            a["tokens"] += len(req.output)
            a["time"] += dt
            a["full"] += st.target_forwards
            a["slim"] += st.slim_forwards
            a["steps"] += len(st.steps)
            a["dec"] += sum(s.accepted + 1 for s in st.steps)
            a["drafted"] += sum(s.drafted for s in st.steps)
            a["accepted"] += sum(s.accepted for s in st.steps)
            a["s_acc"] += sum(s.slim_accepted for s in st.steps)
            a["s_regen"] += sum(s.slim_regenerated for s in st.steps)
            a["s_esc"] += sum(s.slim_escalated for s in st.steps)
            a["identical"] += req.output == ref
            a["prefix"] += prefix_agreement(req.output, ref)
            a["n"] += 1
        print(f"[speed {i + 1}/{len(prompts)}] {pid}", file=sys.stderr, flush=True)
    g_tps = acc["greedy"]["tokens"] / acc["greedy"]["time"]
    lines = [
        "| method | MAT | rejection | full fwd/1k | slim fwd/1k | slim acc / regen / esc | tok/s | vs greedy "
        "| vs two-tier | identical to greedy | prefix agreement |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in methods:
        a = acc[m]
        tps = a["tokens"] / a["time"]
        two = acc[m.partition("+")[0]]
        two_tps = two["tokens"] / two["time"]
        rej = 1 - a["accepted"] / a["drafted"] if a["drafted"] else float("nan")
        lines.append(
            f"| {m} | {a['dec'] / max(a['steps'], 1):.2f} | {rej:.0%} | {1000 * a['full'] / a['tokens']:.0f} | "
            f"{1000 * a['slim'] / a['tokens']:.0f} | {a['s_acc']} / {a['s_regen']} / {a['s_esc']} | {tps:.1f} | "
            f"{tps / g_tps:.2f}x | {tps / two_tps:.2f}x | {a['identical']}/{a['n']} | {a['prefix'] / a['n']:.0%} |"
        )
    return lines, acc


def quality_prompts(tok, args):
    he = load_workload("code")[: args.humaneval] if args.humaneval else []
    bf = load_workload("function_calling", categories=BFCL_CATEGORIES)[: args.bfcl] if args.bfcl else []
    bf = [p for p in bf if p.meta.get("ground_truth")]
    return he, bf


def bench_quality(model, tok, args) -> tuple[list[str], dict]:
    he, bf = quality_prompts(tok, args)
    items = [(p, SamplingParams(max_tokens=args.humaneval_tokens)) for p in he] + [
        (p, SamplingParams(max_tokens=args.bfcl_tokens)) for p in bf
    ]
    ids = [tok(render(p, tok), add_special_tokens=False)["input_ids"] for p, _ in items]
    max_len = max(map(len, ids)) + max(args.humaneval_tokens, args.bfcl_tokens) + args.num_draft_tokens + 64
    methods = ["greedy"] + [
        f"{d}+{m}" for d in args.drafters for m in ("tiered",) + (("tiered-strict",) if args.strict else ())
    ]
    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    for m in methods:
        eng = make_engine(m, model, tok, args, args.batch, max_len)
        t0 = time.perf_counter()
        reqs = eng.generate(ids, [sp for _, sp in items])
        dt = time.perf_counter() - t0
        outputs[m] = [r.output for r in reqs]
        texts = [tok.decode(r.output, skip_special_tokens=True) for r in reqs]
        he_pass = [
            run_tests(
                extract_code(t, p.raw, p.meta["entry_point"])
                + "\n\n"
                + p.meta["test"]
                + f"\n\ncheck({p.meta['entry_point']})\n"
            )
            for (p, _), t in zip(items[: len(he)], texts[: len(he)])
        ]
        bf_ok = [
            bfcl_match(parse_tool_calls(t), p.meta["ground_truth"])
            for (p, _), t in zip(items[len(he) :], texts[len(he) :])
        ]
        full = sum(r.stats.target_forwards for r in reqs)
        toks = sum(len(r.output) for r in reqs)
        results[m] = dict(
            humaneval=sum(he_pass) / max(len(he_pass), 1),
            he_pass=sum(he_pass),
            bfcl=sum(bf_ok) / max(len(bf_ok), 1),
            bf_ok=sum(bf_ok),
            time=dt,
            tokens=toks,
            full_per_1k=1000 * full / max(toks, 1),
        )
        print(f"[quality] {m}: {results[m]}", file=sys.stderr, flush=True)
    g = outputs["greedy"]
    lines = [
        f"| method | HumanEval pass@1 (n={len(he)}) | Δ vs greedy | BFCL exact match (n={len(bf)}) | "
        "Δ vs greedy | outputs identical to greedy | prefix agreement | full fwd/1k |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in methods:
        r, out = results[m], outputs[m]
        same = sum(a == b for a, b in zip(out, g))
        pre = sum(prefix_agreement(a, b) for a, b in zip(out, g)) / len(g)
        lines.append(
            f"| {m} | {100 * r['humaneval']:.1f}% ({r['he_pass']}) | "
            f"{100 * (r['humaneval'] - results['greedy']['humaneval']):+.1f} pt | "
            f"{100 * r['bfcl']:.1f}% ({r['bf_ok']}) | {100 * (r['bfcl'] - results['greedy']['bfcl']):+.1f} pt | "
            f"{same}/{len(g)} | {pre:.0%} | {r['full_per_1k']:.0f} |"
        )
    return lines, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", default=["suffix", "eagle3"])
    ap.add_argument("--mask", default="default", help="slim mask: 'default', a skip spec or a DIMR artifact")
    ap.add_argument("--accept", type=float, default=0.6)
    ap.add_argument("--escalate", type=float, default=0.3)
    ap.add_argument("--own", type=float, default=0.5)
    ap.add_argument("--max-lag", type=int, default=32)
    ap.add_argument("--strict", action="store_true", help="also run tiered-strict (q' accepts only its argmax)")
    ap.add_argument("--workloads", nargs="+", default=["function_calling", "code", "chat"])
    ap.add_argument("--per-workload", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--num-draft-tokens", type=int, default=16)
    ap.add_argument("--humaneval", type=int, default=40, help="first N HumanEval problems (0 = skip)")
    ap.add_argument("--bfcl", type=int, default=40, help="first N BFCL prompts with ground truth (0 = skip)")
    ap.add_argument("--humaneval-tokens", type=int, default=320)
    ap.add_argument("--bfcl-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=8, help="batch size of the quality runs")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the markdown here (default: stdout)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load("default", "bfloat16")
    mask = resolve_mask(args.mask, model.cfg.n_layers)
    t0 = time.time()
    speed, s_raw = ([], {}) if args.skip_speed else bench_speed(model, tok, args)
    quality, q_raw = bench_quality(model, tok, args) if (args.humaneval or args.bfcl) else ([], {})
    lines = [
        "# VIA-SD: three-tier verification (drafter → slim verifier q' → target q)",
        "",
        f"Command: `{' '.join(['python', 'jobs/eval_quality.py'] + sys.argv[1:])}`  ",
        f"Machine: {machine_line()}; load average at start {os.getloadavg()[0]:.1f}; wall {time.time() - t0:.0f} s  ",
        f"Model: SmolLM2-135M-Instruct, bf16, greedy. Slim mask `{args.mask}` "
        f"({describe_mask(args.mask, model.cfg.n_layers)}) = skip {len(mask)} sub-layers "
        f"{mask}. Gates: accept ratio >= {args.accept}, escalate < {args.escalate} (from output token 16; "
        f"stricter 0.9 / 0.6 before, linearly), q' own-token top-prob >= {args.own}, max lag {args.max_lag}; "
        f"draft budget {args.num_draft_tokens}. `+tiered-strict`: the slim tier accepts only its own argmax "
        "(accept gate 1.0), other gates the same.",
        "",
    ]
    if speed:
        lines += (
            [
                f"## Speed (batch 1, {args.per_workload} held-out prompts per workload {args.workloads}, up to "
                f"{args.max_tokens} new tokens, methods interleaved per prompt)",
                "",
                "MAT = tokens emitted per decode step; rejection = 1 − accepted / drafted over the drafts each step "
                "finally judged (lossless and escalated steps: the q'-repaired draft q verified; slim-settled steps: "
                "the drafter's draft); full fwd/1k = full-target forwards (prefill included) per 1,000 tokens; "
                "slim acc / regen / esc = draft tokens q' accepted / tokens q' supplied (repair, regeneration, bonus) "
                "/ draft tokens escalated to q; vs two-tier = tok/s over the same drafter without the slim tier; "
                "identical / prefix agreement = against greedy's output in this run (bf16: batch-shape rounding "
                "may flip near-ties even for lossless methods).",
                "",
            ]
            + speed
            + [""]
        )
    if quality:
        lines += (
            [
                f"## Task quality (batch {args.batch}; HumanEval: first {args.humaneval} problems, up to "
                f"{args.humaneval_tokens} tokens; BFCL: first {args.bfcl} prompts of {list(BFCL_CATEGORIES)} "
                f"interleaved, up to {args.bfcl_tokens} tokens)",
                "",
                "Lossless modes equal greedy by construction (q verifies every token; token-identical in fp32, "
                "tests/test_tiered.py), so only tiered modes are scored separately. HumanEval tests ran "
                + f"in this sandbox: {sandbox_info()['summary']}.",
                "",
            ]
            + quality
            + [""]
        )
    text = (
        "\n".join(lines)
        + "\n<details><summary>raw</summary>\n\n```json\n"
        + json.dumps({"speed": s_raw, "quality": q_raw}, indent=1)
        + "\n```\n</details>\n"
    )
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
