"""The measurement loop every side-by-side comparison shares: each method on a prompt before the
next prompt (A B A B ...), in one process, so ratios come from the same machine state (these
machines are shared and noisy)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine import Engine, SamplingParams

Runner = Callable[[list[int], SamplingParams, "list[int] | None"], "tuple[list[int], object | None]"]


def engine_runner(engine: Engine, oracle=None) -> Runner:
    """A method backed by one of our engines: (output, RequestStats) for one prompt at batch 1.
    ``oracle`` (a ``LiveOracle``): it reads greedy's output for the prompt (``ref``) each run."""

    def run(ids: list[int], params: SamplingParams, ref: list[int] | None):
        if oracle is not None:
            if ref is None:
                raise ValueError("the oracle needs greedy's output: run greedy first")
            oracle.reference = list(ref)
        req = engine.generate([ids], params)[0]
        return req.output, req.stats

    return run


@dataclass
class Runs:
    """What ``run_interleaved`` measured: per (workload, method) accumulators, greedy agreement
    per method, per-step (source, accepted, predicted) records and every output."""

    rows: dict = field(default_factory=dict)
    identical: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)  # method -> [(source, accepted, predicted)]
    outputs: dict = field(default_factory=dict)  # (workload, prompt id, method) -> tokens


def prefix_agreement(out: list[int], ref: list[int]) -> float:
    """Share of the reference's tokens that ``out`` reproduces before the first difference."""
    n = 0
    while n < min(len(out), len(ref)) and out[n] == ref[n]:
        n += 1
    return n / max(len(ref), 1)


def empty_row(stats: bool) -> dict:
    """A (workload, method) accumulator of ``run_interleaved`` (``stats``: the method has engine stats)."""
    return {
        "tokens": 0,
        "time": 0.0,
        "forwards": 0,
        "steps": 0,
        "dec_tokens": 0,
        "draft_s": 0.0,
        "cache_steps": 0,
        "prompt": 0,
        "cached": 0,
        "slim_forwards": 0,
        "decode_s": 0.0,
        "prefix": 0.0,
        "identical": 0,
        "n": 0,
        "stats": stats,
    }


def run_interleaved(runners: dict[str, Runner], prompts, params: SamplingParams, progress: str = "") -> Runs:
    """Every method on a prompt before the next prompt (A B A B ...), batch 1. The first method is
    the reference (greedy): later methods see its output for this prompt as ``ref`` (the live
    oracle needs it) and are scored against it. Methods without engine stats (peers) count only
    tokens and time.

    A prompt may carry a fourth item, ``(ids, greedy's output)`` of an earlier turn that every method
    decodes, unmeasured and unscored, just before it: the agent regime's previous turn, which a
    serving engine has just decoded when the next one arrives (its K/V is still in a slot). A
    runner's ``prelude`` attribute, if any, runs it (e.g. without the audit)."""
    runs = Runs(identical={m: [] for m in runners})
    for i, (w, pid, ids, *before) in enumerate(prompts):
        ref_out = None
        for m, run in runners.items():  # interleaved: every method on this prompt, then the next prompt
            if before:
                getattr(run, "prelude", run)(before[0][0], params, before[0][1])
            t0 = time.perf_counter()
            out, stats = run(ids, params, ref_out)
            dt = time.perf_counter() - t0
            if ref_out is None:
                ref_out = out
            runs.identical[m].append(out == ref_out)
            runs.outputs[(w, pid, m)] = out
            acc = runs.rows.setdefault((w, m), empty_row(stats is not None))
            acc["tokens"] += len(out)
            acc["time"] += dt
            acc["prefix"] += prefix_agreement(out, ref_out)
            acc["identical"] += out == ref_out
            acc["n"] += 1
            if stats is not None:
                st = stats.summary(len(out))
                acc["cache_steps"] += sum(s.source.startswith(("suffix", "arctic")) for s in stats.steps)
                acc["forwards"] += st["target_forwards"]
                acc["slim_forwards"] += st["slim_forwards"]
                acc["steps"] += len(stats.steps)
                acc["dec_tokens"] += sum(s.accepted + 1 for s in stats.steps)
                acc["draft_s"] += st["draft_s"]
                acc["prompt"] += len(ids)
                acc["cached"] += st["cached_tokens"]
                acc["decode_s"] += st["decode_s"]
                runs.steps.setdefault(m, []).extend((s.source, s.accepted, s.predicted) for s in stats.steps)
        print(f"[{progress}{i + 1}/{len(prompts)}] {pid}", file=sys.stderr, flush=True)
    return runs
