"""Side-by-side benchmarks. Every comparison runs its methods interleaved (A B A B ...) in one process
and reports medians and ratios from the same run: these machines are shared and noisy.

Modes:
  report  (the default) every method and peer side by side -> benchmarks/REPORT.md + benchmarks/report/*.png
          (jobs/report.py); --quick: 2 prompts per workload, 48 tokens, no HTTP unless --http
  engine  own engine vs transformers ``generate`` (batch 1 and 8) + the k-token verify cost table
  spec    greedy vs each speculative drafter on real prompts: MAT, target forwards / 1k tokens, tok/s
  http    the Ray Serve app over HTTP at concurrency 1 and 8: requests/s, tokens/s, latency, TTFT

    python jobs/benchmark.py [report] [--quick] [--http] [--vllm-python VENV/bin/python]
    python jobs/benchmark.py engine [--quick]
    python jobs/benchmark.py spec [--quick] [--warm-traces DIR] [--prompt-file my.jsonl [--split all]]
    python jobs/benchmark.py http [--quick] [--servers none hvd:mirror hvd:remote]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hvd_ray.build import add_spec_arguments  # noqa: E402
from hvd_ray.engine import Engine, SamplingParams  # noqa: E402
from hvd_ray.model import load, resolve  # noqa: E402
from hvd_ray.workloads import load_workload, render  # noqa: E402

WORKLOADS = ("function_calling", "code", "code_edit", "chat")  # multi-turn BFCL prompts are 4-5k tokens


def machine_line() -> str:
    import transformers

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, threads {torch.get_num_threads()}")


def prompt_ids(tok, workloads, per_workload: int, max_prompt_tokens: int, split: str | None = "test",
               extra: Sequence[tuple[str, list]] = ()) -> list[tuple[str, str, list[int]]]:
    """(workload, prompt id, token ids) for held-out prompts, skipping ones longer than the budget.
    ``extra``: more (label, prompts) workloads, e.g. ``user_workloads``' user prompt files."""
    sources = [(w, load_workload(w, split=split)) for w in workloads] + list(extra)
    out = []
    for w, prompts in sources:
        taken = 0
        for p in prompts:
            ids = tok(render(p, tok), add_special_tokens=False)["input_ids"]
            if len(ids) <= max_prompt_tokens:
                out.append((w, p.id, ids))
                taken += 1
            if taken == per_workload:
                break
    return out


def user_workloads(files: Sequence[str], split: str | None, taken: Sequence[str] = ()) -> list[tuple[str, list]]:
    """Each user prompt file (jsonl/parquet) as one workload: (its file name without the suffix, its
    prompts of ``split``; None: all). Raises ValueError for an unusable file, or for names that
    repeat each other or one in ``taken`` (the packaged workloads run beside them)."""
    from hvd_ray.workloads import load_user_prompts

    labels = [Path(f).stem for f in files]
    if len(set(labels)) < len(labels) or set(labels) & set(taken):
        raise ValueError(f"the files' names ({', '.join(labels)}) must differ from each other and from the workloads")
    out = []
    for f, label in zip(files, labels):
        own = [p for p in load_user_prompts(f) if split is None or p.split == split]
        if not own:
            raise ValueError(f"{f} has no {split}-split prompts (ids hash into train/validation/test); "
                             "pass --split all to use every prompt in it")
        out.append((label, own))
    return out


def median(xs):
    return statistics.median(xs) if xs else float("nan")



# --------------------------------------------------------------------- shared measurement loop
Runner = Callable[[list[int], SamplingParams, "list[int] | None"], "tuple[list[int], object | None]"]


def engine_runner(engine: Engine) -> Runner:
    """A method backed by one of our engines: (output, RequestStats) for one prompt at batch 1."""
    def run(ids: list[int], params: SamplingParams, ref: list[int] | None):
        req = engine.generate([ids], params)[0]
        return req.output, req.stats
    return run


@dataclass
class Runs:
    """What ``run_interleaved`` measured: per (workload, method) accumulators, greedy agreement
    per method, per-step (source, accepted, predicted) records and every output."""

    rows: dict = field(default_factory=dict)
    identical: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)  # method -> [(source, accepted, predicted)]
    outputs: dict = field(default_factory=dict)  # (workload, prompt id, method) -> tokens


def prefix_agreement(out: list[int], ref: list[int]) -> float:
    """Share of the reference's tokens that ``out`` reproduces before the first difference."""
    n = 0
    while n < min(len(out), len(ref)) and out[n] == ref[n]:
        n += 1
    return n / max(len(ref), 1)


def empty_row(stats: bool) -> dict:
    """A (workload, method) accumulator of ``run_interleaved`` (``stats``: the method has engine stats)."""
    return {"tokens": 0, "time": 0.0, "forwards": 0, "steps": 0, "dec_tokens": 0, "draft_s": 0.0, "cache_steps": 0,
            "slim_forwards": 0, "decode_s": 0.0, "prefix": 0.0, "identical": 0, "n": 0, "stats": stats}


def run_interleaved(runners: dict[str, Runner], prompts, params: SamplingParams, progress: str = "") -> Runs:
    """Every method on a prompt before the next prompt (A B A B ...), batch 1. The first method is
    the reference (greedy): later methods see its output for this prompt as ``ref`` (the live
    oracle needs it) and are scored against it. Methods without engine stats (peers) count only
    tokens and time."""
    runs = Runs(identical={m: [] for m in runners})
    for i, (w, pid, ids) in enumerate(prompts):
        ref_out = None
        for m, run in runners.items():  # interleaved: every method on this prompt, then the next prompt
            t0 = time.perf_counter()
            out, stats = run(ids, params, ref_out)
            dt = time.perf_counter() - t0
            if ref_out is None:
                ref_out = out
            runs.identical[m].append(out == ref_out)
            runs.outputs[(w, pid, m)] = out
            acc = runs.rows.setdefault((w, m), empty_row(stats is not None))
            acc["tokens"] += len(out)
            acc["time"] += dt
            acc["prefix"] += prefix_agreement(out, ref_out)
            acc["identical"] += out == ref_out
            acc["n"] += 1
            if stats is not None:
                st = stats.summary(len(out))
                acc["cache_steps"] += sum(s.source.startswith(("suffix", "arctic")) for s in stats.steps)
                acc["forwards"] += st["target_forwards"]
                acc["slim_forwards"] += st["slim_forwards"]
                acc["steps"] += len(stats.steps)
                acc["dec_tokens"] += sum(s.accepted + 1 for s in stats.steps)
                acc["draft_s"] += st["draft_s"]
                acc["decode_s"] += st["decode_s"]
                runs.steps.setdefault(m, []).extend((s.source, s.accepted, s.predicted) for s in stats.steps)
        print(f"[{progress}{i + 1}/{len(prompts)}] {pid}", file=sys.stderr, flush=True)
    return runs


# --------------------------------------------------------------------------------------- engine
def bench_engine(args) -> str:
    from transformers import AutoModelForCausalLM

    model, tok = load("default", "bfloat16")
    ref = AutoModelForCausalLM.from_pretrained(resolve("default"), dtype=torch.bfloat16).eval()
    # 8 held-out prompts: each alone (batch 1) and all together (batch 8), so the two
    # throughputs cover exactly the same work
    prompts = [ids for _, _, ids in prompt_ids(tok, ("chat", "code", "function_calling"), 3, 400)][:8]
    new = args.max_tokens
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    engine = Engine(model, max_batch=8, max_len=1024)

    decode_rate = {"b1": [], "b8": []}  # tokens after the first / decode time (prefill excluded)

    def ours(batch):
        t0 = time.perf_counter()
        reqs = engine.generate(batch, params)
        rate = sum(len(r.output) for r in reqs) / (time.perf_counter() - t0)
        decode_rate["b1" if len(batch) == 1 else "b8"].append(
            sum(len(r.output) - 1 for r in reqs) / max(r.stats.decode_s for r in reqs))
        return rate

    def hf(batch):
        L = max(map(len, batch))
        ids = torch.tensor([[tok.eos_token_id] * (L - len(b)) + b for b in batch])  # left padding
        am = torch.tensor([[0] * (L - len(b)) + [1] * len(b) for b in batch])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = ref.generate(ids, attention_mask=am, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=tok.eos_token_id)
        return (out.shape[1] - L) * len(batch) / (time.perf_counter() - t0)

    ours([prompts[0]]), hf([prompts[0]])  # warm-up
    b1 = {"ours": [], "hf": []}  # per repetition: throughput of the 8 prompts run one at a time
    b8 = {"ours": [], "hf": []}  # per repetition: throughput of the 8 prompts run together
    for _ in range(args.reps):  # interleaved A B A B
        for name, fn in (("ours", ours), ("hf", hf)):
            rates = [fn([p]) for p in prompts]
            b1[name].append(len(prompts) / sum(1 / r for r in rates))  # total tokens / total time
        b8["ours"].append(ours(prompts))
        b8["hf"].append(hf(prompts))

    # k-token verify cost with a ~300-token prefix
    model.setup_cache(1, 1024)
    prefix = (prompts[0] * 4)[:300]
    costs = {}
    for k in (1, 2, 4, 8, 16, 32):
        ts = []
        for _ in range(args.reps * 3):
            model.cache.truncate(0, 0)
            model(torch.tensor([prefix]), [0], last_only=True)
            t0 = time.perf_counter()
            model(torch.tensor([prefix[:k]]), [0])
            ts.append(time.perf_counter() - t0)
        costs[k] = median(ts)

    o1, h1, o8 = median(b1["ours"]), median(b1["hf"]), median(b8["ours"])
    lines = [
        "# Engine benchmark: own engine vs transformers `generate`",
        "",
        f"Command: `python jobs/benchmark.py engine{' --quick' if args.quick else ''} --threads {args.threads}`  ",
        f"Machine: {machine_line()}  ",
        f"Model: SmolLM2-135M-Instruct, bf16, greedy, {new} new tokens per request (EOS ignored), "
        f"{len(prompts)} held-out prompts (chat, code, function calling); batch 1 = the prompts one after another, "
        f"batch 8 = all at once; tok/s = generated tokens / wall time (prefill included); medians of "
        f"{args.reps} repetitions, own engine and transformers interleaved A B A B.",
        "",
        "| setting | own engine tok/s | transformers tok/s | ratio |",
        "| --- | --- | --- | --- |",
        f"| batch 1 | {o1:.1f} | {h1:.1f} | {o1 / h1:.2f}x |",
        f"| batch 8 (throughput) | {o8:.1f} | {median(b8['hf']):.1f} | {o8 / median(b8['hf']):.2f}x |",
        "",
        f"Own engine batch-8 throughput / batch-1 throughput: **{o8 / o1:.2f}x** end to end (prefill "
        f"included; prefill is compute-bound and does not batch), **{median(decode_rate['b8']) / median(decode_rate['b1']):.2f}x** "
        f"for decoding alone ({median(decode_rate['b8']):.1f} vs {median(decode_rate['b1']):.1f} tok/s, median per run).",
        "",
        "## Cost of one target forward scoring k tokens (300-token prefix), relative to k = 1",
        "",
        "| k | " + " | ".join(str(k) for k in costs) + " |",
        "| --- |" + " --- |" * len(costs),
        "| ms | " + " | ".join(f"{v * 1000:.1f}" for v in costs.values()) + " |",
        "| x k=1 | " + " | ".join(f"{v / costs[1]:.2f}" for v in costs.values()) + " |",
        "",
    ]
    raw = {"batch1": b1, "batch8": b8, "verify_cost_s": costs}
    return "\n".join(lines) + "\n<details><summary>raw</summary>\n\n```json\n" + json.dumps(raw, indent=1) + "\n```\n</details>\n"


# ----------------------------------------------------------------------------------------- spec
def make_method(name: str, model, tok, args, max_len: int) -> Engine:
    """The batch-1 engine of a method name: ``greedy``, a drafter ("suffix", "layerskip", "eagle3", with
    "-tree" for tree drafts; the suffix drafter also takes "-f<max_spec_factor>", "-o<max_spec_offset>",
    "-p<min_token_prob>") or "hvd-<policy>" (suffix + model drafter + selection policy)."""
    from dataclasses import replace

    from hvd_ray.build import build_engine, spec_from_args
    from hvd_ray.drafters import make_drafter

    spec = spec_from_args(args, max_batch=1, max_len=max_len)
    if name == "greedy":
        return build_engine(spec, model, tok)
    if name.startswith("hvd-"):
        return build_engine(replace(spec, drafter="hvd", policy=name[4:]), model, tok)
    if name.startswith("suffix"):  # suffix[-tree][-fF][-oO][-pP], e.g. suffix-tree-f2-p0.05
        from hvd_ray.drafters.suffix import SuffixConfig, SuffixDrafter

        parts = name.split("-")[1:]

        def opt(key: str, default: float) -> float:
            return next((float(p[1:]) for p in parts if p[:1] == key), default)

        cfg = SuffixConfig(use_tree_spec="tree" in parts, max_spec_factor=opt("f", SuffixConfig.max_spec_factor),
                           max_spec_offset=opt("o", SuffixConfig.max_spec_offset),
                           min_token_prob=opt("p", SuffixConfig.min_token_prob))
        return build_engine(replace(spec, drafter="suffix"), model, tok, drafters=[SuffixDrafter(cfg)])
    if not name.endswith("-tree"):
        return build_engine(replace(spec, drafter=name), model, tok)
    base = name[:-5]  # tree drafts: a drafter the spec cannot name
    drafter = make_drafter(base, model, eagle3_head=args.eagle3_head, slots=1, max_len=max_len, tree=True)
    return build_engine(replace(spec, drafter=base), model, tok, drafters=[drafter])


DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
SPEC_RAW_KEYS = ("tokens", "time", "forwards", "steps", "dec_tokens", "draft_s", "cache_steps")


def spec_table(rows: dict, workloads, methods) -> list[str]:
    """The per-workload rows of one regime (MAT, fwd/1k, tok/s, speedup over greedy, ...)."""
    lines = ["| workload | method | MAT | fwd/1k | tok/s | speedup | draft share | cache chosen |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
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
                lines.append(f"| {w} | {m} | - | - | {tps:.1f} | {tps / g_tps:.2f}x | - | - |")
                continue
            lines.append(f"| {w} | {m} | {r['dec_tokens'] / max(r['steps'], 1):.2f} | "
                         f"{1000 * r['forwards'] / max(r['tokens'], 1):.0f} | {tps:.1f} | {tps / g_tps:.2f}x | "
                         f"{100 * r['draft_s'] / r['time']:.1f}% | {100 * r['cache_steps'] / max(r['steps'], 1):.0f}% |")
    return lines


CACHE_METHODS = ("suffix", "hvd-always-cache")
MODEL_METHODS = ("eagle3", "eagle3-tree", "layerskip", "hvd-always-model")


def dominance_table(by_regime: dict, workloads, methods) -> list[str]:
    """P2's bars per regime and workload: hvd-cost tok/s over the best single source (always-cache,
    always-model) of the same run, and its forwards per 1k tokens over the live oracle's."""
    cache = [m for m in methods if m in CACHE_METHODS]
    model = [m for m in methods if m in MODEL_METHODS]
    if "hvd-cost" not in methods or not (cache or model):
        return []
    peers = [m for m in methods if m.startswith("vllm-suffix")]
    lines = ["| regime | workload | hvd-cost tok/s | best single source | hvd-cost / best | hvd-cost fwd/1k | "
             "oracle fwd/1k | hvd-cost / oracle fwd |" + "".join(f" hvd-cost / {m} |" for m in peers),
             "| --- | --- | --- | --- | --- | --- | --- | --- |" + " --- |" * len(peers)]
    for regime, rows in by_regime.items():
        for w in workloads:
            if (w, "hvd-cost") not in rows:
                continue
            tps = {m: rows[(w, m)]["tokens"] / rows[(w, m)]["time"]
                   for m in cache + model + peers + ["hvd-cost"] if (w, m) in rows}
            best = max(cache + model, key=tps.get)
            fwd = lambda m: 1000 * rows[(w, m)]["forwards"] / max(rows[(w, m)]["tokens"], 1)  # noqa: E731
            orc = f"{fwd('oracle'):.0f}" if (w, "oracle") in rows else "-"
            ratio = f"{fwd('hvd-cost') / fwd('oracle'):.2f}" if (w, "oracle") in rows else "-"
            vs = "".join(f" {tps['hvd-cost'] / tps[m]:.2f} |" if m in tps else " - |" for m in peers)
            lines.append(f"| {regime} | {w} | {tps['hvd-cost']:.1f} | {best} {tps[best]:.1f} | "
                         f"**{tps['hvd-cost'] / tps[best]:.2f}** | {fwd('hvd-cost'):.0f} | {orc} | {ratio} |{vs}")
    return lines


def audited(run: Runner, policy, labels: list) -> Runner:
    """``run`` for an hvd-cost engine whose policy records its cache-side decisions: each is
    labelled with what greedy verification would accept of that step's cache draft (cut to the
    length the predictor describes), from greedy's output for the prompt (``ref``)."""
    from hvd_ray.selection.policy import matched

    def r(ids, params, ref):
        policy.audit = []
        out, stats = run(ids, params, ref)
        if ref is not None and out == ref:  # (lossless runs only: positions line up with greedy's)
            for _, pos, y, est, n, draft in policy.audit:
                labels.append((y, est, matched(draft.truncated(n), ref[pos:])))
        policy.audit = None
        return out, stats
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
    from hvd_ray.bench.regimes import agent_turn
    from hvd_ray.traces.history import past_outputs, warm_global_tree

    model, tok = load("default", args.dtype)
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

    def fresh(history=()) -> dict[str, Runner]:
        runners = {}
        for name in names:
            try:
                if name.startswith("vllm-"):  # the vLLM peer, same prompts, interleaved (jobs/vllm_peer.py)
                    from report_methods import VLLM_METHODS, NotRun, VllmRunner

                    if history:
                        continue  # its history would have to be decoded through it: not in warm-history
                    if not args.vllm_python:
                        raise ValueError("vLLM methods need --vllm-python (bash ../shared/peers/setup_vllm.sh)")
                    if name not in VLLM_METHODS:
                        raise ValueError(f"unknown vLLM method; choose from {', '.join(VLLM_METHODS)}")
                    try:
                        runners[name] = VllmRunner(args.vllm_python, VLLM_METHODS[name], args.dtype, args.threads)
                    except NotRun as e:
                        raise ValueError(str(e)) from e
                    peers.append(runners[name])
                    continue
                if name == "oracle":
                    from report_methods import engine_method_runner, make_engine_method

                    eng, orc = make_engine_method("oracle", model, tok, args, max_len)
                    runners[name] = engine_method_runner(eng, orc)
                    warm_global_tree(eng.drafters, history)
                    continue
                eng = make_method(name, model, tok, args, max_len)
            except (ValueError, FileNotFoundError) as e:
                print(f"skipping {name}: {e}", file=sys.stderr)
                continue
            warm_global_tree(eng.drafters, history)  # a serving system's global tree holds its past outputs
            runners[name] = engine_runner(eng)
            if name == "hvd-cost":
                runners[name] = audited(runners[name], eng.policy, labels)
        return runners

    labels: list = []

    def measure(regime: str, runners, work) -> "Runs":
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
            from hvd_ray.workloads import load_workload

            objs = {p.id: p for w in packaged for p in load_workload(w, split=split)}
            turns = [(w, f"{pid}/agent", agent_turn(objs[pid], tok.decode(base.outputs[(w, pid, "greedy")],
                                                                           skip_special_tokens=True), tok))
                     for w, pid, _ in prompts if pid in objs]
            measure("agent", runners, turns)
    if "warm-history" in regimes:
        history = list(warm)
        if not history:  # decode train-split prompts of the same workloads with plain greedy
            t0 = time.perf_counter()
            hist_ids = [ids for *_, ids in prompt_ids(tok, packaged, args.history_prompts, args.max_prompt_tokens,
                                                       "train")]
            g = Engine(model, max_batch=1, max_len=max_len, num_draft_tokens=0, eos_token_ids=[tok.eos_token_id])
            history = [(f"history-{i}", r.output) for i, r in enumerate(g.generate([ids], params)[0]
                                                                         for ids in hist_ids)]
            notes.append(f"warm-history: the global trees start with {len(history)} outputs of train-split prompts "
                         f"of the same workloads ({args.history_prompts} per workload), decoded here with plain "
                         f"greedy in {time.perf_counter() - t0:.0f} s.")
        else:
            notes.append(f"warm-history: the global trees start with {len(history)} past outputs "
                         f"(the train-split traces in `{args.warm_traces}`).")
        measure("warm-history", fresh(history), prompts)
    for p in peers:
        p.close()
    if any(n.startswith("vllm-") for n in names) and "warm-history" in regimes:
        notes.append("vLLM methods run in cold, warm-repeat and agent (same engines), not in warm-history.")
    methods = [m for m in names if any((w, m) in rows for rows in by_regime.values() for w in args.workloads)]

    lines = [
        "# Speculative decoding benchmark: greedy vs drafters (batch 1)",
        "",
        f"Command: `{' '.join(['python', 'jobs/benchmark.py'] + sys.argv[1:])}`  ",
        f"Machine: {machine_line()}  ",
        f"Model: SmolLM2-135M-Instruct, {DTYPE_NAMES[args.dtype]}, greedy, up to {args.max_tokens} new tokens, "
        f"{n_per} {'' if split is None else f'{split}-split '}prompts per workload of <= {args.max_prompt_tokens} tokens"
        + "".join(f" (`{label}`: the user prompt file `{f}`)"
                  for (label, _), f in zip(args.user_workloads, args.prompt_file))
        + ", "
        f"draft budget {args.num_draft_tokens} tokens for model drafters and up to "
        f"{max(args.num_draft_tokens, 64)} for the suffix cache (sized by its match; `-tree` = tree drafts); "
        "every method runs on a prompt before the next prompt (interleaved). The suffix drafter's global "
        + (f"tree starts with {len(warm)} past outputs (the train-split traces in `{args.warm_traces}`, as a "
           "serving system's history would hold them) and fills with this run's outputs."
           if warm and regimes == ["cold"] else "tree starts empty and fills with this run's outputs"
           + (" (regimes below)." if regimes != ["cold"] else ".")),
        "",
        "MAT = mean accepted tokens per target forward (decode steps: accepted draft tokens + 1); "
        "fwd/1k = target forwards (prefill included) per 1,000 generated tokens; speedup = tok/s over "
        "greedy's tok/s on the same prompts in the same run; draft share = drafting time / wall time; "
        "cache chosen = share of decode steps that verified a suffix-cache draft.",
        "",
    ]
    if regimes != ["cold"]:
        lines += ["Regimes (`hvd_ray/bench/regimes.py`): cold = empty history; warm-repeat = the same prompts "
                  "again on the same engines; agent = a second turn (the prompt, greedy's first answer, a "
                  "follow-up asking for it again, revised) on the same engines; warm-history = fresh engines whose "
                  "global trees hold other requests' outputs of the same workloads.", *notes, ""]
        dom = dominance_table(by_regime, args.workloads, methods)
        if dom:
            lines += ["## HVD against its own drafters (P2's bars: hvd-cost / best >= 0.97, "
                      "hvd-cost fwd/1k within 10 % of the live oracle's)", "", *dom, ""]
    if any(audit.values()):
        lines += ["## The cache side's estimates where decoding asks them (hvd-cost, every step start)", "",
                  "Label = tokens of that step's cache draft (cut to the model budget, the draft φ_t describes) "
                  "that greedy verification accepts, from greedy's output for the prompt. ŷ = the shipped "
                  "predictor; calibrated = the estimate the policy used (ŷ or tree probabilities, each scaled "
                  "online, whichever erred less lately). Precision / recall of `estimate >= 6` for `label >= 6`.", "",
                  "| regime | step starts | label >= 6 | ŷ precision | ŷ recall | calibrated precision | calibrated recall |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
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
    lines += [f"Outputs identical to greedy ({DTYPE_NAMES[args.dtype]}"
              + ("; batch-shape rounding may flip near-ties" if args.dtype != "float32" else "") + "): " +
              ", ".join(f"{m} {sum(v)}/{len(v)}" for m, v in identical.items() if m != "greedy"), ""]
    raw = {}
    for regime, rows in by_regime.items():
        for (w, m), v in rows.items():
            raw[f"{w}/{m}" if regime == "cold" else f"{regime}:{w}/{m}"] = {k: v[k] for k in SPEC_RAW_KEYS}
    return "\n".join(lines) + "\n<details><summary>raw</summary>\n\n```json\n" + json.dumps(raw, indent=1) \
        + "\n```\n</details>\n"


# ----------------------------------------------------------------------------------------- http
def bench_http(args) -> str:
    """The Serve app (one replica, bf16) driven over HTTP by `c` concurrent streaming clients."""
    import httpx
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from hvd_ray.serving import build_app

    tok = AutoTokenizer.from_pretrained(resolve("default"))
    n_per = 2 if args.quick else 4
    sets = ("function_calling", "code", "code_edit", "chat")
    prompts = [ids for _, _, ids in prompt_ids(tok, sets, n_per, 1024)]
    levels = {c: prompts * (2 if c >= 8 else 1) for c in args.concurrency}
    if args.fresh_prompts:  # every level its own held-out prompts (test, then validation split), none sent twice
        need = sum(2 if c >= 8 else 1 for c in args.concurrency) * n_per + 1  # + 1 for the warm-up
        pool = {w: [ids for _, _, ids in prompt_ids(tok, (w,), need, 1024, "test")
                    + prompt_ids(tok, (w,), need, 1024, "validation")][:need] for w in sets}
        short = [w for w, ids in pool.items() if len(ids) < need]
        if short:
            raise ValueError(f"--fresh-prompts: too few held-out prompts in {', '.join(short)} for these levels")
        prompts, at = [pool[w][-1] for w in sets], 0  # the warm-up prompts are not measured
        for c in args.concurrency:
            k = n_per * (2 if c >= 8 else 1)
            levels[c] = [ids for w in sets for ids in pool[w][at:at + k]]
            at += k
    drafter, _, mode = args.serve_drafter.partition(":")
    mode = mode or "mirror"
    config = {"model": "default", "dtype": args.dtype, "drafter": drafter, "max_batch": 8,
              "max_model_len": 2048, "max_tokens": 1024, "torch_threads": args.threads, "num_replicas": 1,
              "num_draft_tokens": args.num_draft_tokens, "ray_actor_options": {"num_cpus": 1},
              "suffix_actor_mode": mode}
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name="bench", route_prefix="/")
    base = f"http://127.0.0.1:{port}"

    def one(ids: list[int]) -> dict:
        body = {"model": "default", "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
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
        return {"latency": time.perf_counter() - t0, "ttft": ttft or float("nan"),
                "tokens": usage["completion_tokens"] if usage else 0}

    from concurrent.futures import ThreadPoolExecutor

    def pct(xs, q):
        xs = sorted(x for x in xs if x == x)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")

    rows, raw = [], {}
    try:
        one(prompts[0])  # warm-up
        with httpx.Client(base_url=base) as c:
            s0 = c.get("/stats").json()
        for conc in args.concurrency:
            work = levels[conc]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(conc) as pool:
                res = list(pool.map(one, work))
            wall = time.perf_counter() - t0
            with httpx.Client(base_url=base) as c:
                s1 = c.get("/stats").json()
            wait = sum(d.get("wait_s", 0.0) for d in s1["drafters"].values()) - \
                sum(d.get("wait_s", 0.0) for d in s0["drafters"].values())
            busy = s1["decode_s"] - s0["decode_s"]
            s0 = s1
            toks = sum(r["tokens"] for r in res)
            raw[f"c{conc}"] = res
            args.http_tps[(args.serve_drafter, conc)] = toks / wall
            rows.append(f"| {conc} | {len(work)} | {len(work) / wall:.2f} | {toks / wall:.1f} | "
                        f"{pct([r['latency'] for r in res], 0.5):.2f} | {pct([r['latency'] for r in res], 0.99):.2f} | "
                        f"{pct([r['ttft'] for r in res], 0.5):.2f} | {pct([r['ttft'] for r in res], 0.99):.2f} | "
                        f"{100 * wait / busy if busy else 0:.1f}% |")
            print(rows[-1], file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
    lines = [
        f"# HTTP benchmark: the Ray Serve app at concurrency {', '.join(map(str, args.concurrency))}",
        "",
        f"Command: `{' '.join(['python', 'jobs/benchmark.py'] + sys.argv[1:])}`  ",
        f"Machine: {machine_line()}  ",
        f"Server: one replica, SmolLM2-135M-Instruct {DTYPE_NAMES[args.dtype]}, drafter `{drafter}`"
        + (f" (suffix cache shared through the drafter actor, `suffix_actor_mode: {mode}`"
           + (" + shipped EAGLE-3 head, cost policy)" if drafter == "hvd" else ")") if drafter in ("hvd", "suffix") else "")
        + f", max_batch 8, {args.threads} torch threads; greedy, up to {args.max_tokens} new tokens; "
        f"{len(prompts)} held-out prompts (function calling, code, code editing, chat), streamed over HTTP "
        "(`/v1/completions`, SSE). "
        + ("Every level sends its own held-out prompts (test, then validation split; twice as many at "
           "concurrency 8 and above) and no prompt is sent twice: the suffix history holds only earlier "
           "levels' answers to other prompts." if args.fresh_prompts else
           "Concurrency 8 and above sends every prompt twice; every level after the first re-sends the "
           "first level's prompts (their answers are in the suffix history)."),
        "",
        "Latency = request start to `[DONE]`; TTFT = request start to the first text chunk; "
        "actor wait = time the engine loop spent on suffix-drafter actor calls (blocked on them in `remote` mode; "
        "submitting and polling background calls in `mirror` mode) / time inside engine steps.",
        "",
        "| concurrency | requests | requests/s | tokens/s | p50 latency s | p99 latency s | p50 TTFT s | p99 TTFT s | actor wait |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]
    return "\n".join(lines) + "\n<details><summary>raw</summary>\n\n```json\n" + json.dumps(raw, indent=1) + "\n```\n</details>\n"


def bench_http_servers(args) -> list[tuple[str, str]]:
    """``bench_http`` once per server in ``args.servers`` (``drafter[:suffix_actor_mode]``); writes
    benchmarks/http.md (or ``--out``) when every server ran. Returns (server, markdown) pairs."""
    out = []
    tps: dict = {}
    for server in args.servers:
        a = argparse.Namespace(**vars(args))
        a.serve_drafter, a.http_tps = server, tps
        try:
            md = bench_http(a)
        except Exception as e:  # noqa: BLE001 - the report says why the HTTP cells are missing
            md = f"not run: {type(e).__name__}: {e}\n"
        out.append((server, md))
    if all(not md.startswith("not run") for _, md in out):
        dest = Path(getattr(args, "http_out", None) or ROOT / "benchmarks" / "http.md")
        summary = ""
        base = args.servers[0]
        if len(args.servers) > 1:  # tokens/s of each server over the first one's, per concurrency
            head = "| concurrency | " + " | ".join(f"`{d}` tok/s" for d in args.servers) + " | " + \
                " | ".join(f"`{d}` / `{base}`" for d in args.servers[1:]) + " |"
            rows = [f"| {c} | " + " | ".join(f"{tps[(d, c)]:.1f}" for d in args.servers) + " | " +
                    " | ".join(f"**{tps[(d, c)] / tps[(base, c)]:.2f}x**" for d in args.servers[1:]) + " |"
                    for c in args.concurrency]
            summary = ("# HTTP benchmark summary (servers run one after another in one job)\n\n"
                       f"Command: `{' '.join(['python', 'jobs/benchmark.py'] + sys.argv[1:])}`\n\n"
                       + ("Every level sends its own held-out prompts and none is sent twice: each level is a "
                          "cold pass for its prompts (the suffix history holds earlier levels' answers to other "
                          "prompts).\n\n" if args.fresh_prompts else
                          "Every concurrency level sends the same prompts, so from the second level on a server "
                          "with a suffix cache has their answers in its global tree (the warm-repeat regime of "
                          "`benchmarks/regimes.md`); only the first level is a cold pass.\n\n")
                       + "\n".join([head, "| --- |" + " --- |" * (2 * len(args.servers) - 1), *rows]) + "\n\n")
        dest.write_text(summary + "\n".join(f"<!-- server: {d} -->\n{md}" for d, md in out))
        print(f"wrote {dest}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="report", choices=["report", "engine", "spec", "http"])
    ap.add_argument("--workloads", nargs="+", default=None)
    ap.add_argument("--drafters", nargs="+", default=["suffix", "suffix-tree", "layerskip"])
    add_spec_arguments(ap, only=("eagle3_head", "predictor", "model_drafter", "num_draft_tokens"),
                       defaults={"num_draft_tokens": 16})  # the options of hvd-* and model-drafter methods
    ap.add_argument("--regimes", nargs="+", default=["cold"], choices=["cold", "warm-repeat", "agent", "warm-history"],
                    help="spec: suffix-history regimes to measure (hvd_ray/bench/regimes.py)")
    ap.add_argument("--history-prompts", type=int, default=8,
                    help="spec warm-history without --warm-traces: train-split prompts per workload decoded for the history")
    ap.add_argument("--warm-traces", default=None,
                    help="spec: seed suffix drafters' global trees with the train-split outputs in this trace folder")
    ap.add_argument("--servers", nargs="+", default=["none", "hvd:mirror", "hvd:remote"],
                    help="http: servers to run, drafter[:suffix_actor_mode] (hvd, suffix, none, ...; mirror | remote)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8],
                    help="http: concurrent streaming clients, one measurement per value")
    ap.add_argument("--fresh-prompts", action="store_true",
                    help="http: every concurrency level sends its own held-out prompts, none sent twice (cold caches)")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="a few-minute version")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_NAMES),
                    help="spec mode: float32 makes every method decode the same tokens (lossless), so MAT "
                         "and forwards compare exactly across drafters and heads; bf16 is what serving runs")
    ap.add_argument("--prompts", type=int, default=None, help="spec mode: prompts per workload (default 6)")
    ap.add_argument("--prompt-file", nargs="+", default=[], metavar="FILE",
                    help="spec mode: also measure on your own prompts (.jsonl/.parquet user prompt files, as "
                         "collect_traces.py --prompts takes), each reported as a workload named after its file; "
                         "give --workloads too to keep packaged ones, else only the files are run")
    ap.add_argument("--split", default="test", choices=["train", "validation", "test", "all"],
                    help="spec mode: which split of each prompt set to run (default test: the held-out prompts)")
    ap.add_argument("--out", default=None, help="markdown file to write (default benchmarks/<mode>.md)")
    from report import add_args, main_report

    add_args(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.prompt_file and args.mode != "spec":
        ap.error("--prompt-file is a spec-mode option")
    if args.mode == "report":
        args.max_tokens = args.max_tokens or (48 if args.quick else 128)
        return main_report(args)
    try:  # refuse a bad file before any model loads
        args.user_workloads = user_workloads(args.prompt_file, None if args.split == "all" else args.split,
                                             args.workloads or ())
    except (OSError, ValueError) as e:
        ap.error(f"--prompt-file: {e}")
    args.workloads = args.workloads if args.workloads is not None else ([] if args.prompt_file else list(WORKLOADS))
    args.max_tokens = args.max_tokens or (32 if args.quick else (64 if args.mode == "engine" else 128))
    args.reps = args.reps or (2 if args.quick else 3)
    if args.mode == "http":
        args.http_out = args.out
        bench_http_servers(args)
        return
    report = {"engine": bench_engine, "spec": bench_spec}[args.mode](args)
    out = Path(args.out or ROOT / "benchmarks" / f"{args.mode}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(report)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
