#!/usr/bin/env python
"""Sample chat prompts from the target itself (Magpie-style) into a user prompt file.

    python jobs/generate_prompts.py --out ~/.cache/hvd_ray/prompts/self-chat.jsonl --count 1600
    python jobs/collect_traces.py --prompts ~/.cache/hvd_ray/prompts/self-chat.jsonl \
        --max-tokens 160 --out ~/.cache/hvd_ray/traces/self-chat

The target sees only its chat template up to a user turn and samples the message (temperature,
top-p, one seed per sample, so a run is reproducible). Samples that run past the turn, are too
short or too long, or repeat an earlier one are dropped. Rows are appended as they are accepted,
so a stopped run resumes where it left off (``--count`` is the total wanted).

``--openers "Imagine you are" "Solve"`` starts sample i's message with opener i mod n, to steer
the prompts towards a kind of request (role-play, arithmetic, ...) that free sampling rarely writes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hvd_ray.workloads.self_chat import clean_query, dedup_key, user_turn_prefix


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSONL file (appended to; resumes)")
    p.add_argument("--count", type=int, default=1600, help="prompts wanted in the file in total")
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=96, help="longest user message sampled")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="first sample's seed; sample i uses seed + i")
    p.add_argument("--minutes", type=float, default=None, help="stop after this long (resume later)")
    p.add_argument(
        "--openers",
        nargs="+",
        default=None,
        help="words each message starts with, in turn (sample i gets opener i mod n)",
    )
    args = p.parse_args(argv)
    if args.count < 1 or args.batch_size < 1 or args.max_tokens < 1:
        p.error("--count, --batch-size and --max-tokens must be >= 1")
    if args.openers and any(not o.strip() for o in args.openers):
        p.error("--openers must be non-empty strings")
    return args


def read_existing(path: Path) -> tuple[set[str], int]:
    """Dedup keys of the rows already written and the next sample index (resume state)."""
    keys, next_index = set(), 0
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                keys.add(dedup_key(row["prompt"]))
                next_index = max(next_index, row["sample"] + 1)
    return keys, next_index


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from hvd_ray.engine import Engine, SamplingParams
    from hvd_ray.model import load

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    keys, sample = read_existing(out)
    if len(keys) >= args.count:
        print(f"{out}: already {len(keys)} prompts (>= --count {args.count})")
        return 0
    model, tok = load(args.model, dtype=args.dtype)
    openers = [o.strip() for o in args.openers] if args.openers else [""]
    slugs = ["/" + "-".join(dedup_key(o).split()) if o else "" for o in openers]  # id part per opener
    prefixes = [tok(user_turn_prefix(tok) + o, add_special_tokens=False)["input_ids"] for o in openers]
    engine = Engine(model, max_batch=args.batch_size, max_len=max(map(len, prefixes)) + args.max_tokens + 16)
    t0, drawn, kept0 = time.time(), 0, len(keys)
    with open(out, "a", encoding="utf-8") as f:
        while len(keys) < args.count:
            if args.minutes is not None and time.time() - t0 > 60 * args.minutes:
                print("time budget reached; rerun to continue")
                break
            seeds = range(sample, sample + args.batch_size)
            params = [
                SamplingParams(
                    max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed + s
                )
                for s in seeds
            ]
            reqs = engine.generate([prefixes[s % len(openers)] for s in seeds], params)
            for s, req in zip(seeds, reqs):
                opener = openers[s % len(openers)]
                sampled = tok.decode(req.output, skip_special_tokens=True)
                text = (
                    clean_query(f"{opener} {sampled.lstrip()}" if opener else sampled)
                    if req.finish_reason == "stop"
                    else None
                )
                key = dedup_key(text) if text is not None else None
                if key is None or key in keys or len(keys) >= args.count:
                    continue
                keys.add(key)
                row = {
                    "id": f"self_chat{slugs[s % len(openers)]}/{args.seed + s}",
                    "prompt": text,
                    "workload": "chat",
                    "sample": s,
                    "source": "self_chat",
                }
                if opener:
                    row["opener"] = opener
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            sample += args.batch_size
            drawn += len(params)
            dt = time.time() - t0
            print(
                f"{len(keys)}/{args.count} prompts  (kept {len(keys) - kept0} of {drawn} sampled, {dt:.0f} s)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
