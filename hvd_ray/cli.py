"""``python -m hvd_ray generate ...``: stream a generation to stdout, statistics to stderr."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .build import add_spec_arguments, spec_from_args

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--model", default="default", help="'default' or a local HF safetensors folder")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    # --drafter, --policy, --num-draft-tokens, ... as every command spells them (hvd_ray/build.py)
    add_spec_arguments(g, exclude=("max_batch", "max_len"), defaults={"num_draft_tokens": 16, "cache_draft_tokens": 64})
    g.add_argument("--json", action="store_true", help="print the stats line as JSON")
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the model over this many Ray rank actors (gloo on CPU, NCCL on GPU)",
    )


def generate(args: argparse.Namespace) -> int:
    import torch

    from .build import build_engine
    from .engine import SamplingParams, TextStreamer
    from .model import ModelError, load

    if args.threads:
        torch.set_num_threads(args.threads)
    tp = args.tensor_parallel_size
    try:
        if tp > 1:  # only the rank actors load (their shard of) the model
            model, tok = _tp_model_info(args)
        else:
            model, tok = load(args.model, args.dtype, args.device)
    except (ModelError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
    )
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tok(args.prompt)["input_ids"]
    max_len = min(model.cfg.max_position, len(ids) + args.max_tokens + args.num_draft_tokens + 64)
    spec = spec_from_args(args, max_batch=1, max_len=max_len)
    errors = (ModelError, ValueError, RuntimeError) if tp > 1 else (ModelError, ValueError, FileNotFoundError)
    try:
        engine = _tp_engine(args, spec) if tp > 1 else build_engine(spec, model, tok)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        req = engine.add_request(ids, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    streamer = TextStreamer(tok, args.stop)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(streamer.push(out.new_tokens))
            sys.stdout.flush()
    sys.stdout.write(streamer.flush() + "\n")
    elapsed = time.perf_counter() - t0
    if tp > 1:
        engine.shutdown()
    stats = req.stats.summary(len(req.output))
    stats.update(
        tok_per_s=len(req.output) / elapsed if elapsed else 0.0,
        elapsed_s=elapsed,
        prompt_tokens=len(ids),
        finish_reason=req.finish_reason,
        drafter=args.drafter,
        slim_mode=args.slim_mode if args.slim else None,
    )
    if args.json:
        print(json.dumps(stats), file=sys.stderr)
    else:
        print(
            f"[{args.drafter}] {stats['generated']} tokens in {elapsed:.2f}s ({stats['tok_per_s']:.1f} tok/s); "
            f"mean accepted tokens/target forward {stats['mean_accepted_per_forward']:.2f}; "
            f"target forwards per 1k tokens {stats['forwards_per_1k_tokens']:.0f}; "
            f"finish={req.finish_reason}",
            file=sys.stderr,
        )
    return 0


def _tp_model_info(args: argparse.Namespace):
    """(an object with the model's ``cfg``, tokenizer) without loading the weights here."""
    from types import SimpleNamespace

    from .model import resolve
    from .model.config import load_hf_config
    from .model.tp import check_tp_size
    from .serving.tensor_parallel import load_tokenizer

    folder = resolve(args.model)
    cfg = load_hf_config(folder)
    check_tp_size(cfg, args.tensor_parallel_size)  # before Ray starts
    tok = load_tokenizer(folder)
    if tok is None:
        raise ValueError(f"{folder} has no tokenizer")
    return SimpleNamespace(cfg=cfg), tok


def _tp_engine(args: argparse.Namespace, spec):
    """A TensorParallelEngine over a local Ray (started here unless one is already running)."""
    import ray

    from .serving.tensor_parallel import TensorParallelEngine, TPEngineSpec

    threads = args.threads or 1
    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(
            address="local",
            num_cpus=max(args.tensor_parallel_size * threads, os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=False,
        )
    tp_spec = TPEngineSpec(model=args.model, dtype=args.dtype, device=args.device, engine=spec, torch_threads=threads)
    return TensorParallelEngine(tp_spec, args.tensor_parallel_size, rank_options={"num_cpus": threads})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvd_ray", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_generate(sub)
    args = parser.parse_args(argv)
    if args.cmd == "generate":
        return generate(args)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
