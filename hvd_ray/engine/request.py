"""Per-request state: sampling parameters, tokens so far, and the figures we report per request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .text import StopScanner

MIN_TEMPERATURE = 1e-5  # a smaller temperature is greedy decoding (as in vLLM)
MAX_TOP_LOGPROBS = 20  # as in OpenAI's API


@dataclass
class SamplingParams:
    """Decoding parameters of one request (OpenAI semantics where they overlap)."""

    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # what the request does to the target's logits (engine/processing.py), inside verification too:
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF/vLLM: logits of tokens in prompt or output divided (>0) or multiplied
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (after temperature)
    min_tokens: int = 0  # EOS and stop_token_ids are masked before this many output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # what the output must parse as (engine/grammar.py, xgrammar): {"type": "json_object"},
    # {"type": "json_schema", "schema": {...}}, {"type": "structural_tag", "format": {...}},
    # {"type": "regex", "pattern": "..."} or {"type": "grammar", "ebnf": "..."}
    structure: dict | None = None
    logprobs: int | None = None  # None: none; k >= 0: each output token's log-probability and the top k

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or not math.isfinite(self.top_p):
            raise ValueError("temperature and top_p must be finite numbers")
        if 0 < self.temperature < MIN_TEMPERATURE:  # 1/T would overflow the logits: decode greedily
            self.temperature = 0.0
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not -100.0 <= b <= 100.0 or not math.isfinite(b) for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        self.logit_bias = {int(k): float(b) for k, b in self.logit_bias.items()}
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def processed(self) -> bool:
        """Whether anything changes the target's logits before sampling besides T, top-k and top-p."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_p
            or self.min_tokens
            or self.logit_bias
            or self.structure is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class StepRecord:
    """One decoding step of one request: what was drafted, what survived, what it cost."""

    source: str
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    predicted: float | None = None  # the yield predictor's estimate, when a policy used one
    capped: bool = False  # the batch's draft sizing cut this draft (engine/costs.py:batch_lengths)
    # SpeculationCheck's arm for this batch step (engine/speculation_check.py): "policy", "cache" (the cache
    # drafter's draft, no policy asked) or "plain" (no drafts); None for a lone request or no check
    arm: str | None = None
    # slim tier (VIA-SD, verification/tiered.py): draft tokens q' accepted, tokens q' supplied
    # (repair / regeneration / bonus), draft tokens escalated to q; whether q ran this step
    slim_accepted: int = 0
    slim_regenerated: int = 0
    slim_escalated: int = 0
    full_forward: bool = True
    # a union step (the cache's and the model drafter's drafts as one tree, source "union"): the
    # model draft's tokens and how many of them the target accepted (what it alone would have got)
    union: tuple[int, int] | None = None
    context: int = 0  # tokens before this step's (the verify forward attends over them)

    @property
    def plain(self) -> bool:
        return self.arm == "plain"


@dataclass
class RequestStats:
    prefill_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose K/V were copied, not prefilled (prefix reuse: a finished
    # request's slot, or the prompt of one running)
    decode_s: float = 0.0
    target_forwards: int = 0  # full-target forwards, prefill included
    slim_forwards: int = 0  # slim-verifier (q') forwards of the VIA-SD tier
    steps: list[StepRecord] = field(default_factory=list)

    def summary(self, generated: int) -> dict:
        decode_tokens = sum(s.accepted + 1 for s in self.steps)
        n = len(self.steps)
        return {
            "generated": generated,
            "target_forwards": self.target_forwards,
            "mean_accepted_per_forward": decode_tokens / n if n else 0.0,
            "forwards_per_1k_tokens": 1000.0 * self.target_forwards / generated if generated else 0.0,
            "drafted": sum(s.drafted for s in self.steps),
            "accepted": sum(s.accepted for s in self.steps),
            "draft_s": sum(s.draft_s for s in self.steps),
            "verify_s": sum(s.verify_s for s in self.steps),
            "prefill_s": self.prefill_s,
            "cached_tokens": self.cached_tokens,
            "decode_s": self.decode_s,
            "slim_forwards": self.slim_forwards,
            "slim_accepted": sum(s.slim_accepted for s in self.steps),
            "slim_regenerated": sum(s.slim_regenerated for s in self.steps),
            "slim_escalated": sum(s.slim_escalated for s in self.steps),
        }


@dataclass
class Request:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    slot: int = -1
    output: list[int] = field(default_factory=list)
    pending: int | None = None  # last emitted token, not yet in the target's KV cache
    full_len: int | None = None  # cache length up to which every layer is exact (behind it: slim-settled)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why this request failed (finish_reason "error"); the others go on
    generator: torch.Generator | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    stop_scan: StopScanner | None = field(default=None, repr=False)  # the engine's stop-string search
    # penalties, bias, grammar (``params.processed``): an ``engine.processing.Processing``, which imports this module
    processing: Any = field(default=None, repr=False)
    step_logprobs: list | None = field(default=None, repr=False)  # this step's emitted tokens' (params.logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output
