"""HVD inside vLLM (``hvd_ray.vllm``: the cache side as a ``custom_class`` proposer, the whole hybrid
as the plug-in's method ``hvd``) against vLLM's own greedy, suffix and EAGLE-3 decoding (with our
head): every method is an ``LLM`` in the vLLM interpreter, batch 1, prompts interleaved across
methods; hvd-ray's worker extension counts each method's target forwards."""

from __future__ import annotations

from ..selection.hvd import EAGLE3_ASSET
from .machine import DTYPE_NAMES, command, machine_line
from .peers import VLLM_HVD_METHODS, VLLM_METHODS, run_vllm_job
from .prompts import prompt_ids

# the plug-in's method (hvd_ray/vllm/plugin.py): the cache, the shipped EAGLE-3 head and the cost policy
# (``static``: priced with the GPU-like cost table, where a wider verify forward costs little: the drafts
# the policy would verify on a GPU, so its tokens per forward are the hardware-independent figure)
PLUGIN_METHODS = {
    "vllm-hvd-plugin": {"method": "hvd", "num_speculative_tokens": 32},
    "vllm-hvd-plugin-static": {"method": "hvd", "num_speculative_tokens": 32, "hvd_policy": "static"},
}
PLUGIN = "hvd_ray.vllm.plugin:register"  # its entry point (pyproject.toml), called by vllm_peer.py
METHODS = {
    **VLLM_METHODS,
    "vllm-eagle3": {**VLLM_METHODS["vllm-eagle3"], "model": str(EAGLE3_ASSET)},
    **VLLM_HVD_METHODS,
    **PLUGIN_METHODS,
}
DEFAULT_METHODS = ("vllm-greedy", "vllm-suffix", "vllm-suffix-d64", "vllm-hvd-suffix", "vllm-hvd-static", "vllm-hvd")


def bench_vllm(args) -> str:
    from transformers import AutoTokenizer

    from ..model import resolve

    if not args.vllm_python:
        raise SystemExit("vllm mode needs --vllm-python (bash ../shared/peers/setup_vllm.sh)")
    names = list(args.vllm_methods or DEFAULT_METHODS)
    bad = [m for m in names if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown vLLM methods {bad}; choose from {', '.join(METHODS)}")
    if "vllm-greedy" not in names:
        names.insert(0, "vllm-greedy")
    tok = AutoTokenizer.from_pretrained(resolve("default"))
    n_per = args.prompts or (2 if args.quick else 4)
    prompts = prompt_ids(
        tok, args.workloads, n_per, args.max_prompt_tokens, args.split if args.split != "all" else None
    )
    job = {
        "model": str(resolve("default")),
        "prompts": [ids for *_, ids in prompts],
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "dtype": args.dtype,
        "inproc": True,
        "count": True,
        "methods": {m: METHODS[m] for m in names},
    }
    if any(m in PLUGIN_METHODS for m in names):  # (vLLM calls only installed packages' entry points)
        job["plugins"] = [PLUGIN]
    res = run_vllm_job(args.vllm_python, job)
    meth = res["methods"]
    errors = {m: r["error"] for m, r in meth.items() if "error" in r}
    ran = [m for m in names if m not in errors]
    # per workload and method: tokens, seconds, forwards, prefill forwards, prompts, identical to greedy
    agg: dict = {}
    for j, (w, _, _) in enumerate(prompts):
        ref = meth["vllm-greedy"]["outputs"][j] if "vllm-greedy" in ran else None
        for m in ran:
            tokens, s, fwd, pre = meth[m]["per_prompt"][j]
            a = agg.setdefault((w, m), [0, 0.0, 0, 0, 0, 0])
            a[0] += tokens
            a[1] += s
            a[2] += fwd
            a[3] += pre
            a[4] += 1
            a[5] += meth[m]["outputs"][j] == ref
    lines = [
        "# HVD inside vLLM vs vLLM's greedy, suffix and EAGLE-3 decoding (batch 1)",
        "",
        f"Command: `{command('jobs/benchmark.py')}`  ",
        f"Machine: {machine_line()}; vLLM {res.get('version')} (CPU), own interpreter `{args.vllm_python}`, "
        f"engine core in-process, eager  ",
        f"Model: SmolLM2-135M-Instruct, {DTYPE_NAMES[args.dtype]}, greedy, up to {args.max_tokens} new tokens, "
        f"{n_per} {args.split}-split prompts per workload of <= {args.max_prompt_tokens} tokens; every method is "
        "its own `LLM` and runs each prompt before the next prompt (interleaved); global suffix caches start "
        f"empty and keep this run's outputs. Wall time of the whole job: {res['wall_s']:.0f} s.",
        "",
        "Methods (`speculative_config`): " + "; ".join(f"`{m}` = `{METHODS[m]}`" for m in names) + ".",
        "",
        "tok/fwd = generated tokens per target forward (prefill forwards included); MAT = decode tokens per "
        "decode forward ((tokens - prompts) / (forwards - prefill forwards)); forwards counted by "
        "`hvd_ray.vllm.HvdWorkerExtension` around the model runner's `execute_model`; speedup = tok/s over "
        "vllm-greedy's on the same prompts in the same run; same = outputs token-identical to vllm-greedy's "
        f"({DTYPE_NAMES[args.dtype]}"
        + (
            "; a verify forward rounds differently from one-token forwards, so near-ties can flip"
            if args.dtype != "float32"
            else ""
        )
        + ").",
        "",
        "| workload | method | tokens | forwards | tok/fwd | MAT | tok/s | speedup | same |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in dict.fromkeys(w for w, *_ in prompts):
        g = agg.get((w, "vllm-greedy"))
        for m in ran:
            tokens, s, fwd, pre, n, same = agg[(w, m)]
            tps = tokens / s
            mat = (tokens - n) / max(fwd - pre, 1)
            lines.append(
                f"| {w} | {m} | {tokens} | {fwd} | {tokens / max(fwd, 1):.2f} | {mat:.2f} | {tps:.1f} | "
                f"{tps / (g[0] / g[1]):.2f}x | {same}/{n} |"
            )
    stats = {m: meth[m].get("proposer") for m in ran if meth[m].get("proposer")}
    if stats:
        lines += [
            "",
            "Our proposers' own counts (whole run): "
            + "; ".join(
                f"`{m}`: {s['steps']} verify steps, {s['cache_steps']} with a cache draft, {s['drafted']} draft tokens "
                f"proposed there, {s['accepted']} accepted"
                + (
                    f"; {s['model_steps']} with an EAGLE-3 draft, {s['model_drafted']} draft tokens there, "
                    f"{s['model_accepted']} accepted; {s['mixed_steps']} steps whose rows took different sources"
                    if "model_steps" in s
                    else ""
                )
                + (
                    f", step costs by width at the end "
                    f"({'timed from its own steps' if s.get('costs_timed') else 'prior'}): "
                    + ", ".join(f"{w}: {c:.2f}" for w, c in s["costs"].items())
                    if s.get("costs")
                    else ""
                )
                for m, s in stats.items()
            )
            + ".",
        ]
    if errors:
        lines += ["", "Not run: " + "; ".join(f"`{m}`: {e}" for m, e in errors.items())]
    return "\n".join(lines) + "\n"
