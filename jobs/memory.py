"""Where a serving engine's memory goes under a long mixed load.

    python jobs/memory.py --drafters none hvd --waves 40 --out benchmarks/memory.md

Each drafter runs in its own process (RSS is per process): an engine built from the serving spec
(``EngineSpec``: 4 KV slots, fp32 by default) decodes ``--waves`` waves of ``--requests`` requests,
the load test's mix (real test-split chat prompts of code, chat and function calling, half sampled at
T 0.8, half greedy, ``--max-tokens`` each). After every wave, with the engine idle: the process's RSS,
the Python heap (``tracemalloc``) and the bytes of every live torch tensor. RSS that grows while the
Python heap and the tensors stay flat is native memory the allocator keeps, not objects we hold.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _tensor_mib() -> float:
    """Bytes of the distinct storages of every strided tensor the garbage collector can see (the
    prepacked mkldnn weights have no storage to read; they are built once, at load)."""
    import gc

    import torch

    seen, total = set(), 0
    for o in gc.get_objects():
        if torch.is_tensor(o) and o.layout == torch.strided:
            st = o.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total / 2**20


def run_drafter(args: argparse.Namespace, drafter: str, queue) -> None:
    """One process: build the engine, run the waves, put one dict per wave on ``queue``."""
    import gc
    import random
    import tracemalloc

    import torch

    from hvd_ray.bench.load import real_prompts
    from hvd_ray.build import EngineSpec, build_engine
    from hvd_ray.engine.request import SamplingParams
    from hvd_ray.model import load

    torch.set_num_threads(args.threads)
    model, tok = load("default", dtype=args.dtype)
    engine = build_engine(EngineSpec(drafter=drafter, max_batch=args.max_batch), model, tok)
    prompts = [
        tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
        for m in real_prompts(max_chars=2000)
    ]
    rng = random.Random(args.seed)
    tracemalloc.start()
    for wave in range(args.waves):
        for _ in range(args.requests):
            sampled = rng.random() < 0.5
            engine.add_request(
                rng.choice(prompts),
                SamplingParams(
                    max_tokens=args.max_tokens,
                    temperature=0.8 if sampled else 0.0,
                    top_p=0.95 if sampled else 1.0,
                    seed=rng.randrange(2**31),
                ),
            )
        while engine.has_unfinished():
            engine.step()
        gc.collect()
        row = {
            "drafter": drafter,
            "wave": wave + 1,
            "requests": (wave + 1) * args.requests,
            "rss_mib": _rss_mib(),
            "python_mib": tracemalloc.get_traced_memory()[0] / 2**20,
            "tensor_mib": _tensor_mib(),
        }
        print(json.dumps(row), file=sys.stderr, flush=True)
        queue.put(row)
    queue.put(None)


def report(args: argparse.Namespace, rows: list[dict]) -> str:
    from hvd_ray.bench.machine import command, machine_line

    by = {d: [r for r in rows if r["drafter"] == d] for d in args.drafters}
    lines = [
        "# Engine memory under a long mixed load",
        "",
        f"Command: `{command('jobs/memory.py')}`  ",
        f"Machine: {machine_line()}",
        "",
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        "| drafter | requests | RSS after the first wave MiB | RSS at the end MiB | RSS growth over the second half "
        "MiB per request | Python heap first -> last MiB | live tensors first -> last MiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d, rs in by.items():
        if not rs:
            continue
        mid, last = rs[len(rs) // 2], rs[-1]
        per = (last["rss_mib"] - mid["rss_mib"]) / max(1, last["requests"] - mid["requests"])
        lines.append(
            f"| `{d}` | {last['requests']} | {rs[0]['rss_mib']:.0f} | {last['rss_mib']:.0f} | {per:.2f} | "
            f"{rs[0]['python_mib']:.1f} -> {last['python_mib']:.1f} | "
            f"{rs[0]['tensor_mib']:.0f} -> {last['tensor_mib']:.0f} |"
        )
    lines += [
        "",
        "RSS after each wave (MiB):",
        "",
        "| wave | " + " | ".join(f"`{d}`" for d in by) + " |",
        "| --- |" + " --- |" * len(by),
    ]
    for w in range(args.waves):
        lines.append(
            f"| {w + 1} | " + " | ".join(f"{rs[w]['rss_mib']:.0f}" if w < len(rs) else "" for rs in by.values()) + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", default=["none", "hvd"])
    ap.add_argument("--waves", type=int, default=40)
    ap.add_argument("--requests", type=int, default=24, help="requests per wave")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="markdown report (its rows as JSON beside it)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ctx = mp.get_context("spawn")
    rows: list[dict] = []
    for d in args.drafters:  # one after another: RSS is per process, and they would share the cores
        q = ctx.Queue()
        p = ctx.Process(target=run_drafter, args=(args, d, q))
        p.start()
        while (row := q.get()) is not None:
            rows.append(row)
        p.join()
        if p.exitcode:
            raise SystemExit(f"drafter {d}: the worker process exited with {p.exitcode}")
    text = report(args, rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
