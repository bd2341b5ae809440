"""Greedy against speculative methods on real prompts, batch 1, interleaved per prompt, in each
suffix-history regime asked for (``regimes``): MAT, target forwards per 1k tokens, tok/s, and how
HVD's cost policy fares against its own drafters and the live oracle."""

from __future__ import annotations

import functools
import json
import sys
import time

from ..engine import Engine, SamplingParams
from ..engine.costs import measure_step_costs
from ..model import load
from ..selection.hvd import EAGLE3_ASSET
from ..selection.policy import matched
from .interleave import Runner, Runs, engine_runner, run_interleaved
from .machine import DTYPE_NAMES, busy_cpu, command, machine_line
from .methods import make_method
from .peers import VLLM_METHODS, NotRun, vllm_runners
from .prompts import prompt_ids

SPEC_RAW_KEYS = ("tokens", "time", "forwards", "steps", "dec_tokens", "draft_s", "cache_steps", "prompt", "cached")


def spec_table(rows: dict, workloads, methods) -> list[str]:
    """The per-workload rows of one regime (MAT, fwd/1k, tok/s, speedup over greedy, ...)."""
    lines = [
        "| workload | method | MAT | fwd/1k | tok/s | speedup | draft share | cache chosen | prompt reused |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in workloads:
        g = rows.get((w, "greedy"))
        if not g:
            continue
        g_tps = g["tokens"] / g["time"]
        for m in methods:
            r = rows.get((w, m))
            if r is None:
                continue
            tps = r["tokens"] / r["time"]
            if not r["stats"]:  # a peer: tokens and time only
                lines.append(f"| {w} | {m} | - | - | {tps:.1f} | {tps / g_tps:.2f}x | - | - | - |")
                continue
            lines.append(
                f"| {w} | {m} | {r['dec_tokens'] / max(r['steps'], 1):.2f} | "
                f"{1000 * r['forwards'] / max(r['tokens'], 1):.0f} | {tps:.1f} | {tps / g_tps:.2f}x | "
                f"{100 * r['draft_s'] / r['time']:.1f}% | {100 * r['cache_steps'] / max(r['steps'], 1):.0f}% | "
                f"{100 * r['cached'] / max(r['prompt'], 1):.0f}% |"
            )
    return lines


CACHE_METHODS = ("suffix", "hvd-always-cache")
MODEL_METHODS = ("eagle3", "eagle3-tree", "layerskip", "hvd-always-model")


def _forwards_per_1k(rows: dict, w: str, m: str) -> float:
    return 1000 * rows[(w, m)]["forwards"] / max(rows[(w, m)]["tokens"], 1)


def dominance_table(by_regime: dict, workloads, methods) -> list[str]:
    """The dominance targets per regime and workload for the shipped policy (``hvd-cost-union`` where the run has
    it, else ``hvd-cost``): its tok/s over the best single source (always-cache, always-model) of
    the same run, and its forwards per 1k tokens over the live oracle's; with both in the run, the
    union's tok/s and forwards over hvd-cost's (union tree vs choose-one)."""
    cache = [m for m in methods if m in CACHE_METHODS]
    model = [m for m in methods if m in MODEL_METHODS]
    union = "hvd-cost-union" in methods and "hvd-cost" in methods
    hvd = "hvd-cost-union" if "hvd-cost-union" in methods else "hvd-cost"
    if hvd not in methods or not (cache or model):
        return []
    peers = [m for m in methods if m.startswith("vllm-suffix")]
    extra = [f" {hvd} / {m} |" for m in peers] + (
        [" union / choose-one tok/s | union / choose-one fwd |"] if union else []
    )
    lines = [
        f"| regime | workload | {hvd} tok/s | best single source | {hvd} / best | {hvd} fwd/1k | "
        f"oracle fwd/1k | {hvd} / oracle fwd |" + "".join(extra),
        "| --- | --- | --- | --- | --- | --- | --- | --- |" + " --- |" * (len(peers) + 2 * union),
    ]
    for regime, rows in by_regime.items():
        for w in workloads:
            if (w, hvd) not in rows:
                continue
            tps = {
                m: rows[(w, m)]["tokens"] / rows[(w, m)]["time"]
                for m in cache + model + peers + ["hvd-cost", "hvd-cost-union"]
                if (w, m) in rows
            }
            best = max(cache + model, key=tps.get)
            fwd = functools.partial(_forwards_per_1k, rows, w)
            orc = f"{fwd('oracle'):.0f}" if (w, "oracle") in rows else "-"
            ratio = f"{fwd(hvd) / fwd('oracle'):.2f}" if (w, "oracle") in rows else "-"
            vs = "".join(f" {tps[hvd] / tps[m]:.2f} |" if m in tps else " - |" for m in peers)
            if union:
                vs += (
                    f" {tps['hvd-cost-union'] / tps['hvd-cost']:.2f} | {fwd('hvd-cost-union') / fwd('hvd-cost'):.2f} |"
                    if "hvd-cost" in tps
                    else " - | - |"
                )
            lines.append(
                f"| {regime} | {w} | {tps[hvd]:.1f} | {best} {tps[best]:.1f} | "
                f"**{tps[hvd] / tps[best]:.2f}** | {fwd(hvd):.0f} | {orc} | {ratio} |{vs}"
            )
    return lines


def audited(run: Runner, policy, labels: list) -> Runner:
    """``run`` for an hvd-cost engine whose policy records its cache-side decisions: each is
    labelled with what greedy verification would accept of that step's cache draft (cut to the
    length the predictor describes), from greedy's output for the prompt (``ref``)."""

    def r(ids, params, ref):
        policy.audit = []
        out, stats = run(ids, params, ref)
        if ref is not None and out == ref:  # (lossless runs only: positions line up with greedy's)
            for _, pos, y, est, n, draft in policy.audit:
                labels.append((y, est, matched(draft.truncated(n), ref[pos:])))
        policy.audit = None
        return out, stats

    r.prelude = run  # an unmeasured earlier turn (run_interleaved) is not audited
    return r


def precision_recall(labels: list, which: int, at: float = 6.0) -> tuple[int, float, float]:
    """(positives, precision, recall) of ``estimate >= at`` for ``label >= at`` (``which``: 0 = ŷ,
    1 = the calibrated estimate)."""
    pos = sum(lab >= at for *_, lab in labels)
    said = [lab for *e, lab in labels if e[which] >= at]
    hit = sum(lab >= at for lab in said)
    return pos, hit / len(said) if said else float("nan"), hit / pos if pos else float("nan")


def bench_spec(args) -> str:
    """Greedy vs each drafter, batch 1, interleaved per prompt; per-workload MAT, forwards/1k, tok/s,
    in each suffix-history regime asked for (``hvd_ray.bench.regimes``)."""
    from ..traces.history import past_outputs, warm_global_tree
    from .regimes import agent_turn

    model, tok = load("default", args.dtype)
    startup = []  # what the start-up cost tables said, when timed on a busy CPU (--busy-startup)
    if getattr(args, "busy_startup", 0):
        with busy_cpu(args.busy_startup):  # cached on the model: every method's engine takes these tables
            busy = measure_step_costs(model)
        startup.append(
            f"Start-up cost tables timed while {args.busy_startup} other processes kept the CPU busy "
            f"(`--busy-startup`), then decoding on a quiet CPU: a forward over 8 / 32 tokens priced "
            f"at {busy.timed(8):.2f} / {busy.timed(32):.2f} one-token forwards."
        )
    n_per = args.prompts or (3 if args.quick else 6)
    split = None if args.split == "all" else args.split
    prompts = prompt_ids(tok, args.workloads, n_per, args.max_prompt_tokens, split, args.user_workloads)
    packaged = list(args.workloads)
    args.workloads = [*args.workloads, *(label for label, _ in args.user_workloads)]
    regimes = list(args.regimes)
    agent_room = args.max_tokens + 96 if "agent" in regimes else 0  # the first answer + the follow-up
    max_len = args.max_prompt_tokens + agent_room + args.max_tokens + 64
    names = ["greedy", *args.drafters]

    audit: dict = {}  # regime -> [(ŷ, calibrated estimate, label)] of hvd-cost's decisions

    peers: list = []  # live vLLM processes, closed at the end
    costed: dict = {}  # method -> the StepCosts its policy priced with (the latest engines')

    def fresh(history=()) -> dict[str, Runner]:
        runners = {}
        for name in names:
            try:
                if name.startswith("vllm-"):  # the vLLM peer, same prompts, interleaved (vllm_peer.py)
                    if history:
                        continue  # its history would have to be decoded through it: not in warm-history
                    if not args.vllm_python:
                        raise ValueError("vLLM methods need --vllm-python (bash ../shared/peers/setup_vllm.sh)")
                    if name not in VLLM_METHODS:
                        raise ValueError(f"unknown vLLM method; choose from {', '.join(VLLM_METHODS)}")
                    started, failed = vllm_runners(
                        args.vllm_python, [name], args.dtype, args.threads, str(args.eagle3_head or EAGLE3_ASSET)
                    )
                    if failed:
                        raise ValueError(failed[name])
                    runners[name] = started[name]
                    peers.append(runners[name])
                    continue
                eng, oracle = make_method(name, model, tok, args, max_len)
            except (ValueError, FileNotFoundError, NotRun) as e:
                print(f"skipping {name}: {e}", file=sys.stderr)
                continue
            warm_global_tree(eng.drafters, history)  # a serving system's global tree holds its past outputs
            runners[name] = engine_runner(eng, oracle)
            if getattr(getattr(eng.policy, "costs", None), "measured", False):
                costed[name] = eng.policy.costs
            if name == "hvd-cost":
                runners[name] = audited(runners[name], eng.policy, labels)
        return runners

    labels: list = []

    def measure(regime: str, runners, work) -> Runs:
        """One interleaved pass, filed under ``regime`` with the audit labels it produced."""
        runs = run_interleaved(runners, work, params, f"{regime} ")
        audit.setdefault(regime, []).extend(labels)
        labels.clear()
        if regime in regimes:
            by_regime[regime] = runs.rows
        for m, v in runs.identical.items():
            identical.setdefault(m, []).extend(v)
        return runs

    warm = past_outputs(args.warm_traces) if args.warm_traces else []
    params = SamplingParams(max_tokens=args.max_tokens)
    by_regime: dict[str, dict] = {}
    identical: dict[str, list] = {}
    notes = []
    first = [r for r in regimes if r != "warm-history"]
    if first:  # cold, then warm-repeat and agent on the same engines (their trees hold the earlier passes)
        runners = fresh(warm if "cold" not in regimes else ())
        runners["greedy"](prompts[0][2], params, None)  # warm-up
        base = measure("cold", runners, prompts)
        if "warm-repeat" in regimes:
            measure("warm-repeat", runners, prompts)
        if "agent" in regimes:
            from ..workloads import load_workload

            objs = {p.id: p for w in packaged for p in load_workload(w, split=split)}
            # each turn right after its first turn again (unmeasured), as in a live agent loop
            turns = [
                (
                    w,
                    f"{pid}/agent",
                    agent_turn(objs[pid], tok.decode(base.outputs[(w, pid, "greedy")], skip_special_tokens=True), tok),
                    (ids, base.outputs[(w, pid, "greedy")]),
                )
                for w, pid, ids in prompts
                if pid in objs
            ]
            measure("agent", runners, turns)
    if "warm-history" in regimes:
        history = list(warm)
        if not history:  # decode train-split prompts of the same workloads with plain greedy
            t0 = time.perf_counter()
            hist_ids = [
                ids for *_, ids in prompt_ids(tok, packaged, args.history_prompts, args.max_prompt_tokens, "train")
            ]
            # batched: the history is only the tree's input, and at 8 rows it decodes ~4x faster here
            g = Engine(model, max_batch=8, max_len=max_len, num_draft_tokens=0, eos_token_ids=[tok.eos_token_id])
            history = [(f"history-{i}", r.output) for i, r in enumerate(g.generate(hist_ids, params))]
            notes.append(
                f"warm-history: the global trees start with {len(history)} outputs of train-split prompts "
                f"of the same workloads ({args.history_prompts} per workload), decoded here with plain "
                f"greedy in {time.perf_counter() - t0:.0f} s."
            )
        else:
            notes.append(
                f"warm-history: the global trees start with {len(history)} past outputs "
                f"(the train-split traces in `{args.warm_traces}`)."
            )
        measure("warm-history", fresh(history), prompts)
    for p in peers:
        p.close()
    if costed:
        notes.append(
            "Width costs the cost policies priced with when the run ended (a forward over 8 / 32 tokens, "
            "in one-token forwards; `StepCosts.width_scale` re-fits the start-up tables from the lone "
            "verify forwards): "
            + "; ".join(f"{m} {c(8):.2f} / {c(32):.2f} (scale {c.width_scale:.2f})" for m, c in costed.items())
            + "."
        )
    if any(n.startswith("vllm-") for n in names) and "warm-history" in regimes:
        notes.append("vLLM methods run in cold, warm-repeat and agent (same engines), not in warm-history.")
    methods = [m for m in names if any((w, m) in rows for rows in by_regime.values() for w in args.workloads)]

    lines = [
        "# Speculative decoding benchmark: greedy vs drafters (batch 1)",
        "",
        f"Command: `{command('jobs/benchmark.py')}`  ",
        f"Machine: {machine_line()}  ",
        f"Model: SmolLM2-135M-Instruct, {DTYPE_NAMES[args.dtype]}, greedy, up to {args.max_tokens} new tokens, "
        f"{n_per} {'' if split is None else f'{split}-split '}prompts per workload "
        f"of <= {args.max_prompt_tokens} tokens"
        + "".join(
            f" (`{label}`: the user prompt file `{f}`)" for (label, _), f in zip(args.user_workloads, args.prompt_file)
        )
        + ", "
        f"draft budget {args.num_draft_tokens} tokens for model drafters and up to "
        f"{max(args.num_draft_tokens, 64)} for the suffix cache (sized by its match; `-tree` = tree drafts); "
        "every method runs on a prompt before the next prompt (interleaved). The suffix drafter's global "
        + (
            f"tree starts with {len(warm)} past outputs (the train-split traces in `{args.warm_traces}`, as a "
            "serving system's history would hold them) and fills with this run's outputs."
            if warm and regimes == ["cold"]
            else "tree starts empty and fills with this run's outputs"
            + (" (regimes below)." if regimes != ["cold"] else ".")
        ),
        "",
        "MAT = mean accepted tokens per target forward (decode steps: accepted draft tokens + 1); "
        "fwd/1k = target forwards (prefill included) per 1,000 generated tokens; speedup = tok/s over "
        "greedy's tok/s on the same prompts in the same run; draft share = drafting time / wall time; "
        "cache chosen = share of decode steps that verified a suffix-cache draft; prompt reused = share of "
        "prompt tokens whose K/V was already in the engine's slot (prefix reuse), not prefilled.",
        "",
        *startup,
        *([""] if startup else []),
    ]
    if regimes == ["cold"] and notes:
        lines += [*notes, ""]
    if regimes != ["cold"]:
        lines += [
            "Regimes (`hvd_ray/bench/regimes.py`): cold = empty history; warm-repeat = the same prompts "
            "again on the same engines; agent = a second turn (the prompt, greedy's first answer, a "
            "follow-up asking for it again, revised) on the same engines, each right after its first turn "
            "again (unmeasured), so an engine's K/V slot holds the conversation as in a live agent loop "
            "(prefix reuse; every method has its own KV cache); warm-history = fresh engines whose "
            "global trees hold other requests' outputs of the same workloads.",
            *notes,
            "",
        ]
        dom = dominance_table(by_regime, args.workloads, methods)
        if dom:
            lines += [
                "## HVD against its own drafters (targets: HVD / best >= 0.97, "
                "HVD fwd/1k within 10 % of the live oracle's)",
                "",
                *dom,
                "",
            ]
    if any(audit.values()):
        lines += [
            "## The cache side's estimates where decoding asks them (hvd-cost, every step start)",
            "",
            "Label = tokens of that step's cache draft (cut to the model budget, the draft φ_t describes) "
            "that greedy verification accepts, from greedy's output for the prompt. ŷ = the shipped "
            "predictor; calibrated = the estimate the policy used (ŷ or tree probabilities, each scaled "
            "online, whichever erred less lately). Precision / recall of `estimate >= 6` for `label >= 6`.",
            "",
            "| regime | step starts | label >= 6 | ŷ precision | ŷ recall | calibrated precision | calibrated recall |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for regime, labs in audit.items():
            if regime not in by_regime or not labs:
                continue
            pos, p0, r0 = precision_recall(labs, 0)
            _, p1, r1 = precision_recall(labs, 1)
            lines.append(f"| {regime} | {len(labs)} | {pos} | {p0:.2f} | {r0:.2f} | {p1:.2f} | {r1:.2f} |")
        lines.append("")
    for regime, rows in by_regime.items():
        if regimes != ["cold"]:
            lines += [f"## {regime}", ""]
        lines += spec_table(rows, args.workloads, methods) + [""]
    lines += [
        f"Outputs identical to greedy ({DTYPE_NAMES[args.dtype]}"
        + ("; batch-shape rounding may flip near-ties" if args.dtype != "float32" else "")
        + "): "
        + ", ".join(f"{m} {sum(v)}/{len(v)}" for m, v in identical.items() if m != "greedy"),
        "",
    ]
    raw = {}
    for regime, rows in by_regime.items():
        for (w, m), v in rows.items():
            raw[f"{w}/{m}" if regime == "cold" else f"{regime}:{w}/{m}"] = {k: v[k] for k in SPEC_RAW_KEYS}
    return (
        "\n".join(lines)
        + "\n<details><summary>raw</summary>\n\n```json\n"
        + json.dumps(raw, indent=1)
        + "\n```\n</details>\n"
    )
