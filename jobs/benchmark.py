"""Side-by-side benchmarks. Every comparison runs its methods interleaved (A B A B ...) in one process
and reports medians and ratios from the same run: these machines are shared and noisy.

Modes:
  engine  own engine vs transformers ``generate`` (batch 1 and 8) + the k-token verify cost table
  spec    greedy vs each speculative drafter on real prompts: MAT, target forwards / 1k tokens, tok/s

    python jobs/benchmark.py engine [--quick]
    python jobs/benchmark.py spec [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hvd_ray.engine import Engine, SamplingParams  # noqa: E402
from hvd_ray.model import load, resolve  # noqa: E402
from hvd_ray.workloads import load_workload, render  # noqa: E402

WORKLOADS = ("function_calling", "function_calling_multi", "code", "chat")


def machine_line() -> str:
    import transformers

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, threads {torch.get_num_threads()}")


def prompt_ids(tok, workloads, per_workload: int, max_prompt_tokens: int, split: str = "test") -> list[tuple[str, str, list[int]]]:
    """(workload, prompt id, token ids) for held-out prompts, skipping ones longer than the budget."""
    out = []
    for w in workloads:
        taken = 0
        for p in load_workload(w, split=split):
            ids = tok(render(p, tok), add_special_tokens=False)["input_ids"]
            if len(ids) <= max_prompt_tokens:
                out.append((w, p.id, ids))
                taken += 1
            if taken == per_workload:
                break
    return out


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# --------------------------------------------------------------------------------------- engine
def bench_engine(args) -> str:
    from transformers import AutoModelForCausalLM

    model, tok = load("default", "bfloat16")
    ref = AutoModelForCausalLM.from_pretrained(resolve("default"), dtype=torch.bfloat16).eval()
    prompts = [ids for _, _, ids in prompt_ids(tok, ("chat", "code", "function_calling"), 3 if args.quick else 4, 400)]
    new = args.max_tokens
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    engine = Engine(model, max_batch=8, max_len=1024)

    def ours(batch):
        t0 = time.perf_counter()
        reqs = engine.generate(batch, params)
        return sum(len(r.output) for r in reqs) / (time.perf_counter() - t0)

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
    b1 = {"ours": [], "hf": []}
    for p in prompts:  # interleaved A B
        b1["ours"].append(ours([p]))
        b1["hf"].append(hf([p]))
    b8 = {"ours": [], "hf": []}
    batch = (prompts * 8)[:8]
    for _ in range(args.reps):
        b8["ours"].append(ours(batch))
        b8["hf"].append(hf(batch))

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
        f"{len(prompts)} held-out prompts (chat, code, function calling), runs interleaved A B A B.",
        "",
        "| setting | own engine tok/s (median) | transformers tok/s (median) | ratio |",
        "| --- | --- | --- | --- |",
        f"| batch 1 | {o1:.1f} | {h1:.1f} | {o1 / h1:.2f}x |",
        f"| batch 8 (throughput) | {o8:.1f} | {median(b8['hf']):.1f} | {o8 / median(b8['hf']):.2f}x |",
        "",
        f"Own engine batch-8 throughput / batch-1 throughput: **{o8 / o1:.2f}x**.",
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["engine"])
    ap.add_argument("--quick", action="store_true", help="a few-minute version")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=None, help="markdown file to write (default benchmarks/<mode>.md)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    args.reps = args.reps or (2 if args.quick else 3)
    report = {"engine": bench_engine}[args.mode](args)
    out = Path(args.out or ROOT / "benchmarks" / f"{args.mode}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(report)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
