"""Our engine against transformers ``generate`` (batch 1 and 8), and the cost of one target forward
scoring k tokens: the figures that say whether verifying a draft is cheap here."""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from ..engine import Engine, SamplingParams
from ..model import load, resolve
from .machine import machine_line
from .prompts import prompt_ids


def median(xs):
    return statistics.median(xs) if xs else float("nan")


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
            sum(len(r.output) - 1 for r in reqs) / max(r.stats.decode_s for r in reqs)
        )
        return rate

    def hf(batch):
        L = max(map(len, batch))
        ids = torch.tensor([[tok.eos_token_id] * (L - len(b)) + b for b in batch])  # left padding
        am = torch.tensor([[0] * (L - len(b)) + [1] * len(b) for b in batch])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = ref.generate(
                ids,
                attention_mask=am,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
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

    # k-token verify cost with a ~300-token prefix; on a CPU without oneDNN bf16 also with torch's
    # own bf16 matmuls (HVD_BF16_UPCAST=0), interleaved per repetition
    model.setup_cache(1, 1024)
    prefix = (prompts[0] * 4)[:300]
    modes: dict[str, str | None] = {"": None}  # label -> HVD_BF16_UPCAST for that mode (None: as set)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        modes = {
            "bf16 weights as fp32 for 2+ rows (default here)": "1",
            "torch's bf16 matmuls (HVD_BF16_UPCAST=0)": "0",
        }
    user_flag = os.environ.get("HVD_BF16_UPCAST")
    times: dict[str, dict[int, list]] = {m: {k: [] for k in (1, 2, 4, 8, 16, 32)} for m in modes}
    for _ in range(args.reps * 3):
        for mode, flag in modes.items():
            if flag is not None:
                os.environ["HVD_BF16_UPCAST"] = flag
                model.pack_weights()
            for k, ts in times[mode].items():
                model.cache.truncate(0, 0)
                model(torch.tensor([prefix]), [0], last_only=True)
                t0 = time.perf_counter()
                model(torch.tensor([prefix[:k]]), [0])
                ts.append(time.perf_counter() - t0)
    if len(modes) > 1:  # the model as the user's setting packs it
        if user_flag is None:
            os.environ.pop("HVD_BF16_UPCAST", None)
        else:
            os.environ["HVD_BF16_UPCAST"] = user_flag
        model.pack_weights()
    all_costs = {mode: {k: median(ts) for k, ts in by_k.items()} for mode, by_k in times.items()}
    costs = next(iter(all_costs.values()))

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
        f"included; prefill is compute-bound and does not batch), "
        f"**{median(decode_rate['b8']) / median(decode_rate['b1']):.2f}x** "
        f"for decoding alone ({median(decode_rate['b8']):.1f} vs {median(decode_rate['b1']):.1f} tok/s, "
        "median per run).",
        "",
        "## Cost of one target forward scoring k tokens (300-token prefix), relative to k = 1",
        "",
        "| k | " + " | ".join(str(k) for k in costs) + " |",
        "| --- |" + " --- |" * len(costs),
    ]
    for mode, c in all_costs.items():
        label = f" ({mode})" if mode else ""
        lines += [
            f"| ms{label} | " + " | ".join(f"{v * 1000:.1f}" for v in c.values()) + " |",
            f"| x k=1{label} | " + " | ".join(f"{v / c[1]:.2f}" for v in c.values()) + " |",
        ]
    lines.append("")
    raw = {"batch1": b1, "batch8": b8, "verify_cost_s": costs, "verify_cost_s_by_mode": all_costs}
    return (
        "\n".join(lines)
        + "\n<details><summary>raw</summary>\n\n```json\n"
        + json.dumps(raw, indent=1)
        + "\n```\n</details>\n"
    )
