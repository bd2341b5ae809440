"""The methods and peers of the side-by-side report (``jobs/report.py``), each as a runner for
``benchmark.run_interleaved``: ``(prompt ids, params, greedy's output for this prompt) -> (output,
RequestStats or None)``.

* our methods: engines with a drafter, HVD policies, VIA-SD slim tiers (``make_engine_method``);
* ``oracle``: a live oracle policy (``LiveOracle``) — every step it drafts from both the cache and
  the model drafter and verifies the one that *greedy's own output for this prompt* (same engine,
  same run) continues further. Greedy decoding is deterministic, so that is the draft the target
  accepts more of, without spending extra target forwards; its forwards per 1,000 tokens are the
  selection upper bound, its tok/s is not meaningful (it drafts from both sources every step);
* peers: transformers ``generate`` greedy and prompt lookup (``hf_runner``), arctic-inference's
  ``SuffixDecodingCache`` as a draft source of our engine (``ArcticDrafter``), and vLLM CPU in its
  own interpreter (``run_vllm``, optional).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from hvd_ray.drafters.base import Draft, Drafter, DraftRequest
from hvd_ray.engine import Engine, SamplingParams
from hvd_ray.engine.engine import Choice
from hvd_ray.selection.policy import Policy, matched

HERE = Path(__file__).resolve().parent


class NotRun(Exception):
    """A method that cannot run here; the message is the reason the report gives."""


# ------------------------------------------------------------------------------------ oracle
class LiveOracle(Policy):
    """Selection upper bound at run time: drafts from both sources and picks the draft the target
    accepts more of, read off greedy's output for the prompt (``reference``; set per prompt).
    Ties go to the cache, whose drafting is free — the offline ``OraclePolicy``'s rule."""

    name = "oracle"
    needs_phi = False

    def __init__(self, cache, model, flags=None):
        super().__init__(cache, model, flags)
        self.reference: list[int] = []

    def decide(self, view):  # pragma: no cover - the engine hook below decides with the drafts in hand
        raise RuntimeError("LiveOracle decides in __call__")

    def __call__(self, req, engine) -> Choice:
        budget = engine.draft_budget(req)
        truth = self.reference[len(req.output):]
        long_budget = max(budget, engine.draft_budget(req, self.cache))
        cache = self.cache.speculate(req.req_id, long_budget).truncated(long_budget)
        model = self.model.propose([DraftRequest(req.req_id, req.slot, req.tokens, budget)])[0].truncated(budget) \
            if self.model is not None and budget > 0 else Draft()
        y_c, y_m = matched(cache, truth), matched(model, truth)
        if len(cache) and y_c >= y_m:
            return Choice(self.cache, cache, float(y_c))
        if len(model):
            return Choice(self.model, model, float(y_m))
        return Choice(None, None, 0.0)


# ---------------------------------------------------------------------------------- arctic
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
            ctx = np.asarray(r.tokens[-self.depth:], dtype=np.int32)
            d = self.cache.speculate(r.req_id, ctx, max_spec_tokens=max(r.max_tokens, 0), max_spec_factor=1.0,
                                     max_spec_offset=0.0, min_token_prob=0.1, use_tree_spec=self.tree)
            out.append(Draft(list(d.token_ids), list(d.parents), list(d.probs), float(d.score),
                             int(d.match_len), self.name))
        return out

    def end(self, req_id: str) -> None:
        self.cache.stop_request(req_id)
        self.ctx.pop(req_id, None)


# ------------------------------------------------------------------------------- our methods
def slim_mask(mask: str | None, n_layers: int) -> str:
    """The slim tier's mask: ``mask``, else the shipped DIMR mask; NotRun when there is none."""
    from hvd_ray.dimr.mask import _shipped

    if mask is None and _shipped(n_layers) is None:
        raise NotRun("no mask: the DIMR mask hvd_ray/assets/slim-smollm2/ is not shipped")
    return mask or "default"


def make_engine_method(name: str, model, tok, args, max_len: int) -> tuple[Engine, object | None]:
    """(engine, oracle policy or None) for a report method name:

    ``greedy``, a drafter (``suffix``, ``eagle3``, ``layerskip``, ``arctic-suffix``), ``hvd-<policy>``,
    ``oracle``, ``via-lossless`` / ``via-tiered`` (EAGLE-3 + slim tier), ``hvd-<policy>+slim``
    (HVD + lossless slim tier). The oracle and arctic-suffix bring their own drafters and policy."""
    from hvd_ray.build import EngineSpec, build_engine
    from hvd_ray.drafters import make_drafter
    from hvd_ray.drafters.suffix import SuffixDrafter

    base, _, slim = name.partition("+")
    spec = EngineSpec(model_drafter=args.model_drafter, eagle3_head=args.eagle3_head,
                      num_draft_tokens=args.num_draft_tokens, max_batch=1, max_len=max_len)
    drafters, policy, oracle = None, None, None
    if base == "via-lossless" or base == "via-tiered":
        spec = replace(spec, drafter=args.model_drafter, slim=slim_mask(args.slim_mask, model.cfg.n_layers),
                       slim_mode=base[4:])
    elif base == "oracle":
        cache = SuffixDrafter()
        drafter = make_drafter(args.model_drafter, model, eagle3_head=args.eagle3_head, slots=1, max_len=max_len)
        drafters, policy = [cache, drafter], LiveOracle(cache, drafter)
        oracle = policy
    elif base.startswith("hvd-"):
        spec = replace(spec, drafter="hvd", policy=base[4:])
    elif base == "arctic-suffix":
        drafters = [ArcticDrafter()]
    elif base != "greedy":
        spec = replace(spec, drafter=base)
    if slim:
        if slim != "slim":
            raise ValueError(f"unknown method suffix {slim!r} in {name!r} (only '+slim')")
        spec = replace(spec, slim=slim_mask(args.slim_mask, model.cfg.n_layers), slim_mode="lossless")
    return build_engine(spec, model, tok, drafters=drafters, policy=policy), oracle


def engine_method_runner(engine: Engine, oracle: LiveOracle | None):
    def run(ids, params, ref):
        if oracle is not None:
            if ref is None:
                raise ValueError("the oracle needs greedy's output: run greedy first")
            oracle.reference = list(ref)
        req = engine.generate([ids], params)[0]
        return req.output, req.stats
    return run


# ------------------------------------------------------------------------------ transformers
def hf_runner(ref_model, tok, prompt_lookup: int | None = None):
    """transformers ``generate`` at batch 1, greedy (or prompt lookup decoding), stopping at EOS
    like our engine. No engine stats: only tokens and time are compared."""
    def run(ids, params: SamplingParams, ref):
        x = torch.tensor([ids])
        kw = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
        with torch.no_grad():
            out = ref_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=params.max_tokens,
                                     do_sample=False, pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                     **kw)
        new = out[0, len(ids):].tolist()
        if tok.eos_token_id in new:  # our engine's output includes the EOS token it stopped at
            new = new[: new.index(tok.eos_token_id) + 1]
        return new, None
    return run


# ------------------------------------------------------------------------------------- vLLM
VLLM_METHODS = {
    "vllm-greedy": None,
    "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "vllm-suffix": {"method": "suffix", "num_speculative_tokens": 16},
    # vLLM's suffix defaults cap a draft at 12 tokens (tree depth 24 / 2); depth 64 allows 32
    "vllm-suffix-d64": {"method": "suffix", "num_speculative_tokens": 32, "suffix_decoding_max_tree_depth": 64},
    "vllm-eagle3": {"method": "eagle3", "num_speculative_tokens": 8},  # "model": our shipped head, set below
}


class VllmRunner:
    """A benchmark runner (``ids, params, ref -> (output, None)``) over a live ``vllm_peer.py
    --serve`` process in the vLLM interpreter ``python``: one ``LLM`` (``spec``: its speculative
    config, None for plain decoding), asked one prompt at a time so it interleaves with our methods
    (the pipe's round trip, about a millisecond, counts in its time)."""

    def __init__(self, python: str, spec: dict | None, dtype: str, threads: int, start_timeout: float = 900):
        from hvd_ray.model import resolve

        if not Path(python).exists():
            raise NotRun(f"--vllm-python {python} does not exist")
        job = {"model": str(resolve("default")), "dtype": dtype, "threads": threads, "spec": spec}
        env = dict(os.environ)
        iomp = Path(python).absolute().parents[1] / "lib" / "libiomp5.so"  # the venv's, not the base python's
        if iomp.exists():  # vLLM's CPU guide: preload Intel OpenMP, or lose "significant performance"
            env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
        self.proc = subprocess.Popen([python, str(HERE / "vllm_peer.py"), "--serve", json.dumps(job)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            self.close()
            raise NotRun(f"the vLLM peer did not start (rc {self.proc.returncode}; its log is on stderr)")

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


def run_vllm(python: str, prompts, max_tokens: int, threads: int, eagle3_head: str, timeout: float = 3600) -> dict:
    """Run ``jobs/vllm_peer.py`` in the vLLM interpreter ``python`` on the same prompt ids; returns
    its JSON: ``{"version": ..., "methods": {name: {"tokens", "time", "outputs"} | {"error": ...}}}``."""
    from hvd_ray.model import resolve

    if not Path(python).exists():
        raise NotRun(f"--vllm-python {python} does not exist")
    methods = {k: (dict(v, model=eagle3_head) if k == "vllm-eagle3" else v) for k, v in VLLM_METHODS.items()}
    job = {"model": str(resolve("default")), "prompts": [ids for _, _, ids in prompts], "max_tokens": max_tokens,
           "threads": threads, "methods": methods}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    t0 = time.perf_counter()
    res = subprocess.run([python, str(HERE / "vllm_peer.py"), f.name], capture_output=True, text=True,
                         timeout=timeout)
    Path(f.name).unlink(missing_ok=True)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise NotRun(f"vLLM run failed (rc {res.returncode}): {last}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out

