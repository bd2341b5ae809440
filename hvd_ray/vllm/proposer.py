"""HVD's cache side as a vLLM speculative proposer (vLLM's ``custom_class`` method).

    from vllm import LLM
    llm = LLM(model=..., speculative_config={"method": "custom_class",
                                             "model": "hvd_ray.vllm.HvdProposer",
                                             "num_speculative_tokens": 32})

vLLM (checked on 0.32) builds the class from its ``VllmConfig`` inside the model runner, calls
``load_model(model)`` once, and after every step's sampled tokens are booked calls
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``: per batch row
the tokens that step emitted (empty for a prefill chunk), the row's length and its tokens (prompt +
output). It takes one draft per row back, of any length up to ``num_speculative_tokens`` (empty: a
plain decoding step), and verifies them, so greedy output stays vLLM's own greedy output.

The drafts come from our :class:`~hvd_ray.drafters.suffix.SuffixDrafter` (a tree per request over
its prompt and output, and the global tree over every request's output), and the policy decides per
request and step as it does in our engine: :class:`HvdProposer` (``cost``) verifies the cache draft
only where its expected yield, from the yield predictor ``g_θ(φ_t)`` or the draft's tree
probabilities (each calibrated online against what the step then emitted), pays for the longer
forward, and cuts it to the length that pays best; :class:`HvdTauProposer` verifies it whole when
``ŷ > τ``; :class:`SuffixProposer` verifies every cache draft whole (our trees alone).

Rows, not requests: vLLM tells a custom proposer no request ids (nor a request's ``max_tokens``), so
each row is matched by content to the request it continues: the request whose tokens are the row's
first tokens and whose length plus the tokens just emitted is the row's length. A row that continues
nobody starts a request (its prompt: the row minus the emitted tokens). A request missing from the
batch for ``AWAY_STEPS`` steps (finished, or preempted for that long) is ended: its output is already
in the global tree, which grows with every live output. Matching by content cannot tell apart two
requests whose tokens are identical so far; the drafts they get are then identical too.

The same proposer is HVD's decision inside hvd-ray's vLLM plug-in (``plugin.py``), which gives it a
model drafter it does not run itself (:class:`ModelDrafter`: vLLM's EAGLE-3 proposer): there
:meth:`HvdProposer.plan` decides per row between the cache draft, a model draft and none, the
plug-in has vLLM's proposer draft for the rows that chose it, and :meth:`HvdProposer.finish`
assembles the rows' drafts.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..drafters.base import Draft
from ..drafters.suffix import SuffixConfig, SuffixDrafter
from ..engine.costs import VERIFY_COST
from ..engine.request import StepRecord
from ..selection.cost_policy import CostPolicy
from ..selection.features import VocabFlags, features
from ..selection.hvd import EAGLE3_TOKEN_COST, load_predictor, suffix_config
from ..selection.policy import CACHE, MODEL, NONE, StepView, TauPolicy, nominal, unextended

# The draft length φ_t describes: the engine's default model-drafter budget, the one trace replay
# labelled the predictor's training rows at.
NOMINAL = 8
AWAY_STEPS = 8  # propose calls a request may miss (not scheduled, preempted) before it is ended
HISTORY = 16  # history features read the last 16 steps
# Step widths (tokens a step's forward scored, all rows together) the step clock files times under
CLOCK_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)
CLOCK_MIN = 3  # samples a width needs before its time counts


class StepClock:
    """What a target forward over ``w`` new tokens costs here, relative to one token, timed from the
    gaps between ``propose`` calls (a gap is one vLLM step: schedule, forward, sample, book; drafting
    excluded). Only steps whose every row was a decoding row drafted for by the previous call count,
    so the width is known: each row's last token plus the draft it was given. Times are averaged
    (exponentially) per width in ``CLOCK_WIDTHS`` (the nearest, on a log scale); ``table()`` is None
    until two widths have ``CLOCK_MIN`` samples each.

    A server under load never runs a one-token step (8 rows score at least 8 tokens), so where width
    1 is not timed its seconds come from a line fitted through the timed widths: the policy compares
    rates of the same batch at different widths, for which only the ratios between timed widths
    matter, and the line fixes the unit they are expressed in (without it the GPU-like prior stayed
    in force at batch 8 for a server's whole life, pricing every draft as nearly free)."""

    def __init__(self, adapt: float = 0.1):
        self.adapt = adapt
        self.seconds: dict[int, float] = {}
        self.samples: dict[int, int] = {}

    def add(self, width: int, seconds: float) -> None:
        w = min(CLOCK_WIDTHS, key=lambda b: abs(np.log(b) - np.log(max(width, 1))))
        old = self.seconds.get(w)
        self.seconds[w] = seconds if old is None else (1 - self.adapt) * old + self.adapt * seconds
        self.samples[w] = self.samples.get(w, 0) + 1

    def table(self) -> dict[int, float] | None:
        ok = sorted(w for w, n in self.samples.items() if n >= CLOCK_MIN)
        if len(ok) < 2:
            return None
        if ok[0] == 1:
            one = self.seconds[1]
        else:  # seconds = a + b * width through the timed widths, at width 1
            x = np.array(ok, float)
            y = np.array([self.seconds[w] for w in ok])
            b = max(0.0, float(np.polyfit(x, y, 1)[0]))
            one = float(np.mean(y - b * x)) + b
            if one <= 0:  # (a line through noise can cross zero: charge every token alike then)
                one = self.seconds[ok[0]] / ok[0]
        out, last = {1: 1.0}, 1.0
        for w in ok:  # a wider forward never costs less (noise can say so)
            last = max(last, self.seconds[w] / one)
            out[w] = last
        return out


class _Req:
    """One request as the proposer follows it: its tokens (a growing numpy buffer, to match rows),
    prompt length, output and the (cache chosen, accepted) history of its verify steps."""

    __slots__ = ("key", "buf", "n", "prompt_len", "output", "history", "drafted", "source", "draft_s", "away")

    def __init__(self, key: int, prompt: np.ndarray):
        self.key = key
        self.buf = np.zeros(max(64, 2 * len(prompt)), np.int32)
        self.buf[: len(prompt)] = prompt
        self.n = self.prompt_len = len(prompt)
        self.output: list[int] = []
        self.history: list[tuple[bool, int]] = []
        self.drafted = 0  # tokens of the draft proposed for it last step (0: none)
        self.source = NONE  # where that draft came from: CACHE, MODEL or NONE
        self.draft_s = 0.0  # seconds the model drafter spent on that step's drafts (MODEL)
        self.away = 0

    @property
    def req_id(self) -> int:  # (CostPolicy.shadow reads ``req_id`` and ``output``)
        return self.key

    def continues(self, row: np.ndarray, n: int, k: int) -> bool:
        return n == self.n + k and np.array_equal(row[: self.n], self.buf[: self.n])

    def extend(self, tokens: Sequence[int]) -> None:
        end = self.n + len(tokens)
        if end > len(self.buf):
            self.buf = np.concatenate([self.buf, np.zeros(max(end, len(self.buf)), np.int32)])
        self.buf[self.n : end] = tokens
        self.n = end
        self.output.extend(tokens)


@dataclass(frozen=True)
class ModelDrafter:
    """A model drafter as the policy sees one that runs elsewhere (vLLM's EAGLE-3 proposer, run by
    the plug-in): its name in step records and the draft length it makes (``depth``)."""

    name: str = "eagle3"
    depth: int = 5


class Pick(NamedTuple):
    """The decision for one batch row: ``source`` (CACHE, MODEL or NONE), the cache draft's tokens
    to verify (CACHE), or the model draft's length (MODEL)."""

    source: str
    tokens: list[int]
    length: int = 0


NO_DRAFT = Pick(NONE, [])


class HvdProposer:
    """HVD's cache side (the ``cost`` policy) for vLLM's ``custom_class`` method; see the module
    docstring. Settings from the environment: ``HVD_RAY_PREDICTOR`` (a yield-predictor folder;
    default the shipped one), ``HVD_VLLM_MAX_TOKENS`` (the ``max_tokens`` φ_t's relative position
    assumes, since vLLM does not tell a proposer; default 256), ``HVD_VLLM_VERIFY_COST`` (JSON
    ``{tokens: cost}``: a forward over that many new tokens relative to a 1-token one, on this
    hardware; default: timed from vLLM's own steps (:class:`StepClock`), starting from
    ``engine/costs.py:VERIFY_COST``, a GPU-like curve where long drafts are nearly free).

    ``model`` (the plug-in's): a model drafter the policy may choose per row instead of the cache,
    drafting ``model.depth`` tokens; ``model_accept`` its prior mean accepted tokens (None: the
    predictor's training mean) and ``model_token_cost`` its drafting time per token, in one-token
    target forwards, until measured (``finish``'s ``draft_s``)."""

    policy = "cost"
    timed = True  # time vLLM's steps for the cost table (else the static GPU-like one)

    def __init__(
        self,
        vllm_config,
        model: ModelDrafter | None = None,
        model_accept: float | None = None,
        model_token_cost: float = EAGLE3_TOKEN_COST,
    ) -> None:
        spec = vllm_config.speculative_config
        mc = vllm_config.model_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(mc.max_model_len)
        self.max_tokens = int(os.environ.get("HVD_VLLM_MAX_TOKENS", "256"))
        self.model = model
        self.cache = SuffixDrafter(suffix_config(self.policy) if self.policy != "always-cache" else SuffixConfig())
        self.decider = None
        self.clock = None
        if self.policy != "always-cache":
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(
                mc.tokenizer, trust_remote_code=bool(getattr(mc, "trust_remote_code", False))
            )
            self.flags = VocabFlags.from_tokenizer(tok, int(mc.get_vocab_size()))
            g = load_predictor(os.environ.get("HVD_RAY_PREDICTOR") or None)
            cost = os.environ.get("HVD_VLLM_VERIFY_COST")
            table = {int(w): float(c) for w, c in json.loads(cost).items()} if cost else dict(VERIFY_COST)
            # no table given: start from the GPU-like one (long drafts nearly free: an optimistic
            # prior, so wide steps happen and get timed) and switch to the timed one once it exists
            self.clock = StepClock() if not cost and self.policy == "cost" and self.timed else None
            self.decider = (
                CostPolicy(
                    g,
                    self.cache,
                    model,
                    self.flags,
                    cost_table=table,
                    model_accept=model_accept,
                    model_token_cost=model_token_cost,
                )
                if self.policy == "cost"
                else TauPolicy(g, self.cache, model, self.flags)
            )
        self._t_end: float | None = None  # when the last propose call returned
        self._width: int | None = None  # tokens the step after it scores (None: not known)
        self._rows: list[_Req | None] = []  # the request in each row last step
        self._reqs: dict[int, _Req] = {}  # live requests by key
        self._next = 0
        self.counts = {"requests": 0, "steps": 0, "cache_steps": 0, "drafted": 0, "accepted": 0}
        if model is not None:
            self.counts.update(model_steps=0, model_drafted=0, model_accepted=0)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM calls this with the target model; the trees need nothing from it."""

    # ------------------------------------------------------------------ vLLM's hook
    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings=None,
        **_,
    ) -> list[list[int]]:
        return self.finish(self.plan(sampled_token_ids, num_tokens_no_spec, token_ids_cpu))

    def plan(
        self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray
    ) -> list[Pick]:
        """Book the tokens each row emitted and decide, per row, what it verifies next step."""
        t0 = time.perf_counter()
        rows = self._track(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        batch = sum(r is not None for r in rows)
        if self.clock is not None and self._width and self._clean:
            self.clock.add(self._width, t0 - self._t_end)
            table = self.clock.table()
            if table is not None:
                self.decider.costs.table.clear()  # (CostPolicy.table is the same dict)
                self.decider.costs.table.update(table)
        if self.model is not None and self._width and self._clean and isinstance(self.decider, CostPolicy):
            # a one-token forward's seconds by the last step and its width: the unit the model's
            # drafting time is priced in (CostPolicy.learn)
            one = (t0 - self._t_end) / self.decider.costs.batch(batch, self._width)
            old = self.decider.forward_s
            self.decider.forward_s = one if old is None else 0.9 * old + 0.1 * one
        return [
            self._decide(r, int(num_tokens_no_spec[i]), batch) if r is not None else NO_DRAFT
            for i, r in enumerate(rows)
        ]

    def finish(
        self, picks: Sequence[Pick], model_tokens: Sequence[Sequence[int]] | None = None, draft_s: float = 0.0
    ) -> list[list[int]]:
        """Each row's draft for vLLM: the cache tokens picked, or the first ``length`` tokens of the
        row's model draft (``model_tokens``, one per row, drafted for the rows that chose the model;
        ``draft_s``: the seconds that drafting took)."""
        rows = self._rows  # (this step's, as plan found them)
        out = []
        for i, (p, r) in enumerate(zip(picks, rows)):
            draft = list(model_tokens[i][: p.length] if p.source == MODEL and model_tokens is not None else p.tokens)
            if r is not None:
                r.drafted, r.source = len(draft), (p.source if draft else NONE)
                r.draft_s = draft_s if p.source == MODEL else 0.0
            out.append(draft)
        batch = sum(r is not None for r in rows)
        self._width = sum(1 + len(d) for d, r in zip(out, rows) if r is not None) if batch == len(rows) else None
        self._t_end = time.perf_counter()
        return out

    # ------------------------------------------------------------------ rows -> requests
    def _track(self, sampled: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray) -> list[_Req | None]:
        """Match each row that emitted tokens to the request it continues (or start one), feed the
        emitted tokens to the trees and the policy, and end requests away for too long."""
        free = dict(self._reqs)  # not yet matched this step
        rows: list[_Req | None] = [None] * len(sampled)
        self._clean = len(sampled) == sum(r is not None for r in self._rows)  # the same rows as last step...
        for i, s in enumerate(sampled):
            if not s:  # a prefill chunk (or a discarded row): nothing to draft for
                self._clean = False
                continue
            n, row, k = int(num_tokens[i]), token_ids[i], len(s)
            r = self._rows[i] if i < len(self._rows) else None
            if r is None or r.key not in free or not r.continues(row, n, k):
                r = next((c for c in free.values() if c.continues(row, n, k)), None)
            if r is None:
                r = self._begin(row[: n - k])
                self._clean = False  # ...all of them continuing (a new one was prefilled)
            else:
                del free[r.key]
            self._accept(r, [int(t) for t in s])
            rows[i] = r
        for r in free.values():
            r.away += 1
            if r.away >= AWAY_STEPS:
                self._end(r)
        self._rows = rows
        return rows

    def _begin(self, prompt: np.ndarray) -> _Req:
        r = _Req(self._next, np.asarray(prompt, np.int32))
        self._next += 1
        self._reqs[r.key] = r
        self.cache.begin(r.key, r.buf[: r.n].tolist())
        self.counts["requests"] += 1
        return r

    def _accept(self, r: _Req, tokens: list[int]) -> None:
        r.away = 0
        if r.output:  # tokens of a verify step: the accepted draft tokens + the target's own
            accepted = len(tokens) - 1
            r.history.append((r.source == CACHE, accepted))
            if len(r.history) > HISTORY:
                del r.history[0]
            self.counts["steps"] += 1
            if r.source == CACHE:
                self.counts["cache_steps"] += 1
                self.counts["drafted"] += r.drafted
                self.counts["accepted"] += accepted
            elif r.source == MODEL:
                self.counts["model_steps"] += 1
                self.counts["model_drafted"] += r.drafted
                self.counts["model_accepted"] += accepted
                if isinstance(self.decider, CostPolicy):  # the model side learns what its drafts get
                    rec = StepRecord(self.model.name, r.drafted, accepted, r.draft_s, 0.0, context=r.n)
                    self.decider.learn(rec)
                    self.decider.request_model(r.key, self.model.depth, rec)
        r.extend(tokens)
        self.cache.accept(r.key, tokens)
        if isinstance(self.decider, CostPolicy):
            self.decider.shadow(r, True)  # score earlier steps' cache drafts on what was emitted

    def _end(self, r: _Req) -> None:
        del self._reqs[r.key]
        self.cache.end(r.key)

    # ------------------------------------------------------------------ the decision
    def _decide(self, r: _Req, n: int, batch: int) -> Pick:
        room = min(self.k, self.max_model_len - n - 1)
        if room <= 0:
            return NO_DRAFT
        long = self.cache.speculate(r.key, room)
        model_len = min(self.model.depth, room) if self.model is not None else 0
        if self.decider is None:
            return Pick(CACHE, list(long.token_ids)) if len(long) else NO_DRAFT
        if not len(long) and not model_len:
            return NO_DRAFT
        draft = nominal(long, min(NOMINAL, room, unextended(long, self.cache))) if len(long) else Draft()
        phi = features(
            draft,
            prompt_len=r.prompt_len,
            generated=len(r.output),
            max_tokens=self.max_tokens,
            last_token=r.output[-1],
            history=r.history,
            flags=self.flags,
        )
        view = StepView(
            phi, len(draft), model_len, cache_long=len(long), batch=batch, cache_probs=long.probs, context=r.n
        )
        if isinstance(self.decider, CostPolicy):
            key = CostPolicy.cache_key(draft.source, draft.match_len, len(r.output))
            m, m_len = self.decider.request_model(r.key, model_len) if model_len else (None, None)
            choice, y = self.decider.decide(view, key, m, m_len)
            self.decider.remember(r.key, long, y, key, len(r.output), view)
        else:
            choice, _ = self.decider.decide(view)
        if choice == CACHE and len(long):
            return Pick(CACHE, list(long.token_ids[: view.take if view.take is not None else len(long)]))
        if choice == MODEL and model_len:
            return Pick(MODEL, [], model_len)
        return NO_DRAFT

    def stats(self) -> dict:
        """Counts since start: requests seen, verify steps, steps that verified a cache draft, draft
        tokens proposed on them and accepted (with a model drafter, the same for its steps:
        ``model_*``); the step costs in use (``cost`` policy)."""
        out = dict(self.counts, live=len(self._reqs))
        if isinstance(self.decider, CostPolicy):
            out["costs"] = {str(w): round(c, 3) for w, c in sorted(self.decider.costs.table.items())}
            out["costs_timed"] = self.clock is not None and self.clock.table() is not None
            if self.clock is not None:  # seconds per step width, and how many steps each has
                out["step_s"] = {
                    str(w): [round(t, 4), self.clock.samples[w]] for w, t in sorted(self.clock.seconds.items())
                }
            if self.model is not None:
                out["model_accept"] = round(self.decider.model_accept, 3)
                if self.decider.model_draft_cost is not None:
                    out["model_draft_cost"] = round(self.decider.model_draft_cost, 3)
        return out


class HvdStaticProposer(HvdProposer):
    """The ``cost`` policy with the static GPU-like cost table (``VERIFY_COST``: long drafts nearly
    free), not timed: what it decides where verifying is cheap, e.g. on a GPU."""

    timed = False


class HvdTauProposer(HvdProposer):
    """The paper's rule: verify the cache draft (whole) when ``ŷ > 6``, else decode plainly."""

    policy = "tau"


class SuffixProposer(HvdProposer):
    """Our suffix trees alone: every cache draft is verified whole (SuffixDecoding's settings)."""

    policy = "always-cache"


__all__ = ["HvdProposer", "HvdStaticProposer", "HvdTauProposer", "ModelDrafter", "Pick", "SuffixProposer"]
