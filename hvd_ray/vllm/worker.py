"""A vLLM worker extension that counts target forwards and reads our proposer's counts.

    llm = LLM(..., worker_extension_cls="hvd_ray.vllm.HvdWorkerExtension")
    llm.collective_rpc("hvd_count_forwards")       # once: wrap the model runner's execute_model
    ...generate...
    llm.collective_rpc("hvd_stats")[0]           # {"forwards", "prefill_forwards", "scheduled_tokens",
                                                 #  "draft_tokens", "block_size" (of the KV cache),
                                                 #  "proposer": HvdProposer.stats()
                                                 #  or, under the plug-in's method hvd, Hybrid.stats()}

A forward is one ``execute_model`` call that schedules tokens; a prefill forward one that schedules a
new request (its prompt, or its first chunk). vLLM's own spec-decode counters over-count accepted
tokens where ``max_tokens`` cuts a step's output; these count what ran.
"""

from __future__ import annotations


class HvdWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); call through ``collective_rpc``."""

    def hvd_count_forwards(self) -> None:
        runner = self.model_runner
        if getattr(runner, "_hvd_counts", None) is not None:
            return
        counts = runner._hvd_counts = {"forwards": 0, "prefill_forwards": 0, "scheduled_tokens": 0, "draft_tokens": 0}
        inner = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            n = scheduler_output.total_num_scheduled_tokens
            if n:
                counts["forwards"] += 1
                counts["scheduled_tokens"] += n
                counts["prefill_forwards"] += bool(scheduler_output.scheduled_new_reqs)
                counts["draft_tokens"] += sum(len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values())
            return inner(scheduler_output, *args, **kwargs)

        runner.execute_model = execute_model

    def hvd_stats(self) -> dict:
        runner = self.model_runner
        out = dict(getattr(runner, "_hvd_counts", None) or {})
        out["block_size"] = runner.cache_config.block_size
        drafter = runner.__dict__.get("_hvd_hybrid") or getattr(runner, "drafter", None)  # (the plug-in's)
        if callable(getattr(drafter, "stats", None)):
            out["proposer"] = drafter.stats()
        return out
