"""The decoding loop: admit requests into KV-cache slots, then step draft -> verify -> accept.

One ``step()`` advances every running request by one target forward (prefill for new ones, a
verify forward for the rest). A request with an empty draft is plain decoding, so greedy decoding
and speculative decoding share this single loop; that is what makes "speculative output equals
greedy output of the same engine" a meaningful check.

Failure isolation: an exception in one request's own work (a drafter's ``begin``/``propose``/
``accept``, the policy, sampling, verification) fails that request alone (``finish_reason
"error"``, its slot freed) and the batch goes on. Only the target forward, which every running
request shares, propagates: after it fails the cache's state is unknown, so the caller must stop.

Prefix reuse (``slots.py``): a new prompt that continues what a free slot holds, or shares a prefix
with a running request's prompt, prefills only the rest.

One concept, the engine's loop (admission, prefill, the decode step and its accounting); row
verification lives in ``verify.py``, slot choice in ``slots.py``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..drafters.base import Draft, Drafter, DraftRequest
from ..model.tp import rank0_values
from ..model.transformer import Transformer
from ..verification import tree_attention_mask
from ..verification.tiered import SlimTier, confidence_ratios, repair, tiered_verdict
from ..verification.tree import tree_depths
from .costs import batch_lengths
from .grammar import Grammars
from .policy import Choice, DraftPolicy, as_choice, as_policy
from .processing import Processing, token_logprobs
from .request import Request, SamplingParams, StepRecord
from .slots import MIN_REUSE, check_fits, choose_slot, common_prefix
from .speculation_check import ARMS, CACHE, PLAIN, POLICY, SpeculationCheck
from .verify import device_walks, first_tokens, verify_row

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """Tokens a request gained in one step (for streaming), and whether it is done."""

    req_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None = None  # finish_reason "error": what went wrong with this request
    # with ``params.logprobs``: per new token, (its log-probability, [(token, log-probability)] of the
    # top ``params.logprobs``) under the target's raw distribution (before any processing)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class DraftPlan:
    """One decode step's drafts, planned before its forward: per request (``reqs``) its draft, the
    policy's predicted yield, whether the batch's sizing cut it, its own drafting seconds; ``arm``: how
    the batch drafts (``speculation_check.SpeculationCheck``)."""

    reqs: list[Request]
    drafts: list[Draft]
    predicted: list[float | None]
    capped: list[bool]
    own_s: list[float]
    arm: str = POLICY

    def live(self) -> DraftPlan:
        """The plan less the requests that failed while it was made."""
        keep = [i for i, r in enumerate(self.reqs) if not r.finished]
        pick = lambda xs: [xs[i] for i in keep]  # noqa: E731
        return DraftPlan(
            pick(self.reqs), pick(self.drafts), pick(self.predicted), pick(self.capped), pick(self.own_s), self.arm
        )


class Engine:
    """Continuous batching over a fixed number of KV-cache slots with pluggable draft sources.

    ``drafters`` are consulted through ``policy`` (default: the first drafter, or none) each step;
    a drafter sees every request (``begin``/``accept``/``end``) so its state stays current even on
    steps where another source is chosen.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        drafters: Sequence[Drafter] = (),
        policy: DraftPolicy | Callable | None = None,
        max_batch: int = 8,
        max_len: int = 2048,
        num_draft_tokens: int = 8,
        cache_draft_tokens: int | None = None,
        eos_token_ids: Iterable[int] = (),
        detokenize: Callable[[list[int]], str] | None = None,
        slim: SlimTier | None = None,
        prefix_reuse: bool = True,
        reuse_slots: int = 0,
        grammars: Grammars | None = None,
        prefill_chunk: int | None = None,
    ):
        self.model = model
        self.grammars = grammars  # compiles ``params.structure`` (structured outputs); None: refused
        self.drafters = list(drafters)
        self.policy = as_policy(policy)  # engine/policy.py: what the engine may ask of it
        self.num_draft_tokens = num_draft_tokens
        # cache drafters (``adaptive_length``) size their own drafts by their match, up to 64 tokens as
        # in SuffixDecoding; a model drafter's draft costs per token, so it keeps the smaller budget
        self.cache_draft_tokens = (
            (max(num_draft_tokens, 64) if cache_draft_tokens is None else cache_draft_tokens)
            if num_draft_tokens > 0
            else 0
        )
        self.decoding_batch = 1  # requests in the current decode step (policies size drafts by it)
        # under a cost policy a batch drafts the way that measures fastest at its size: the policy's
        # choices, the cache drafter's drafts alone, or none (speculation_check.SpeculationCheck)
        self.check = None
        if self.policy is not None and self.policy.costs is not None:
            self.check = SpeculationCheck(arms=ARMS if self.policy.cache is not None else (POLICY, PLAIN))
        self.eos = set(eos_token_ids) | set(model.cfg.eos_token_ids)
        self.detokenize = detokenize
        self.slim = slim  # VIA-SD slim-verifier tier (verification/tiered.py); None = two tiers
        if slim is not None and max(i for i, _ in slim.mask) >= model.cfg.n_layers:
            raise ValueError(f"slim mask {slim.mask} skips layers a {model.cfg.n_layers}-layer model lacks")
        if reuse_slots < 0 or max_batch < 1:
            raise ValueError(f"need max_batch >= 1 and reuse_slots >= 0, got {max_batch} and {reuse_slots}")
        # slots beyond max_batch only keep finished requests' K/V for prefix reuse (none without it)
        self.max_batch, self.slots = max_batch, max_batch + (reuse_slots if prefix_reuse else 0)
        if model.cache is None or model.cache.slots < self.slots or model.cache.max_len < max_len:
            model.setup_cache(self.slots, max_len)
        self.max_len = model.cache.max_len
        # self.slots, even where a shared model's cache has more: drafters size theirs the same way
        self.free_slots = deque(range(self.slots))
        self.prefix_reuse = prefix_reuse
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 (or None: whole prompts), got {prefill_chunk}")
        # while requests decode, a step prefills at most this many prompt tokens (None: whole prompts)
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.taps = tuple(sorted({t for d in self.drafters for t in d.needs_taps}))
        self._ids = itertools.count()

    # ------------------------------------------------------------------------------ requests
    def add_request(
        self, prompt: Sequence[int], params: SamplingParams | None = None, req_id: str | None = None
    ) -> Request:
        params = params or SamplingParams()
        prompt = check_fits(prompt, params, self.num_draft_tokens, self.max_len, self.model.cfg.vocab_size)
        req = Request(req_id or f"req-{next(self._ids)}", prompt, params)
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if params.processed:
            if params.structure is not None and self.grammars is None:
                raise ValueError("structured outputs need an engine built with its tokenizer")
            constraint = self.grammars.constraint(params.structure) if params.structure is not None else None
            req.processing = Processing(params, prompt, vocab, self.eos, constraint)
        if not params.greedy:
            req.generator = torch.Generator(device=self.model.device)
            req.generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.waiting.append(req)
        return req

    def abort(self, req_id: str) -> None:
        for req in list(self.waiting) + self.running:
            if req.req_id == req_id and not req.finished:
                req.finish_reason = "abort"
        self.waiting = deque(r for r in self.waiting if not r.finished)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        """One target forward per running request; returns what each request gained."""
        outputs: list[StepOutput] = []
        self._release(outputs)
        admitted = []
        while self.waiting and self.free_slots and len(self.running) + len(admitted) < self.max_batch:
            req = self.waiting.popleft()
            req.slot, reused = choose_slot(self.model.cache, self.free_slots, req.prompt, self.prefix_reuse)
            req.stats.cached_tokens = reused
            try:
                for d in self.drafters:
                    d.begin(req.req_id, req.prompt, req.slot)
                    if reused:
                        d.reuse_prefix(req.req_id, reused)
            except Exception as e:  # noqa: BLE001 - this request's drafter state: fail it alone
                self.running.append(req)
                self._fail(req, e, "drafter begin")
                continue
            admitted.append(req)
        # a request decodes once its prompt is computed and its first token out; slot order lets the
        # model read consecutive cache slots as one view
        decoding = sorted((r for r in self.running if not r.finished and r.output), key=lambda r: r.slot)
        prefilling = [r for r in self.running if not r.finished and not r.output] + admitted
        self.running += admitted
        if decoding:
            outputs += self._decode(decoding)
        if prefilling:
            outputs += self._prefill(prefilling, chunked=bool(decoding))
        self._release(outputs)
        return outputs

    def _release(self, outputs: list[StepOutput]) -> None:
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self.free_slots.append(req.slot)
            self._keep(req)
            for d in self.drafters:
                try:
                    d.end(req.req_id)
                except Exception:  # noqa: BLE001 - the request is over either way
                    logger.exception("drafter %s failed to end request %s", d.name, req.req_id)
            if req.finish_reason in ("abort", "error"):
                outputs.append(StepOutput(req.req_id, [], True, req.finish_reason, req.error))

    def _keep(self, req: Request) -> None:
        """Record whose K/V a finished request leaves in its slot (none after a failure, whose
        cache state is unknown; behind ``full_len`` only, where a lossy tier settled tokens)."""
        cache = self.model.cache
        if not self.prefix_reuse or req.finish_reason == "error" or req.slot < 0:
            return
        n = cache.lengths[req.slot]
        if self.slim is not None and req.full_len is not None:
            n = min(n, req.full_len)
        cache.tokens[req.slot] = req.tokens[:n]

    def _fail(self, req: Request, e: BaseException, where: str) -> None:
        """End ``req`` with ``finish_reason "error"``; ``_release`` frees its slot and reports it."""
        logger.error("request %s failed in %s: %r", req.req_id, where, e, exc_info=e)
        req.finish_reason, req.error = "error", f"{where} failed: {type(e).__name__}: {e}"

    def _prefill(self, reqs: list[Request], chunked: bool = False) -> list[StepOutput]:
        """One forward per new prompt, in admission order: prefill is compute-bound, so batching
        prompts of different lengths would only add padding work, and a lone sequence takes the fused
        causal kernel. ``chunked`` (requests are decoding) with ``prefill_chunk`` set: at most that
        many prompt tokens this step, so a long prompt does not stall the streams for its whole
        prefill; the rest follows in the next steps (the K/V of a prompt's computed part stay in its
        slot, as a kept prefix's do), and its first token comes with its last chunk."""
        dev = self.model.device
        results = []
        # prompts whose K/V exist: a slot holds the first tokens of its request's prompt (all of them
        # once it decodes; ``cache.lengths`` of them while it prefills, read when shared)
        computed = [r for r in self.running if not r.finished and r.slot >= 0]
        budget = self.prefill_chunk if chunked and self.prefill_chunk else None
        for req in reqs:
            if budget is not None and budget <= 0:
                break
            t0 = time.perf_counter()
            if self.prefix_reuse and not req.stats.target_forwards:
                self._share_prefix(req, computed)
            c = self.model.cache.lengths[req.slot]  # K/V already there (prefix reuse, earlier chunks)
            end = len(req.prompt) if budget is None else min(len(req.prompt), c + budget)
            out = self.model(torch.tensor([req.prompt[c:end]], device=dev), [req.slot], taps=self.taps, last_only=True)
            req.stats.prefill_s += time.perf_counter() - t0
            req.stats.target_forwards += 1
            if budget is not None:
                budget -= end - c
            if end < len(req.prompt):  # more chunks to come
                if self.taps:
                    self._observe(req, req.prompt[c + 1 : end + 1], out.taps, 0, slice(0, end - c))
                continue
            try:
                first = first_tokens([req], out.logits[:, -1])[0]
                if req.params.logprobs is not None:
                    req.step_logprobs = token_logprobs(out.logits[:, -1], [0], [first], req.params.logprobs)
                if self.taps:
                    self._observe(req, req.prompt[c + 1 :] + [first], out.taps, 0, slice(0, len(req.prompt) - c))
                results.append(self._emit(req, [first]))
            except Exception as e:  # noqa: BLE001
                self._fail(req, e, "sampling the first token")
        return results

    def _share_prefix(self, req: Request, computed: list[Request]) -> None:
        """Copy into ``req``'s slot the K/V of the longest prefix its prompt shares with the computed
        part of another running request's prompt (decoding, or prefilled earlier), where that
        beats what its slot already holds. Concurrent agents send one tool list with every call:
        without this, each recomputed it until one of them had finished and left its slot to reuse.
        A prompt's K/V never change while its request runs (rollback and compaction touch only
        positions past it)."""
        cache = self.model.cache
        best, src = max(cache.lengths[req.slot], MIN_REUSE - 1), None
        for r in computed:
            if r is req:
                continue
            n = common_prefix(r.prompt, req.prompt, min(len(r.prompt), cache.lengths[r.slot], len(req.prompt) - 1))
            if n > best:
                best, src = n, r
        if src is None:
            return
        cache.copy_prefix(src.slot, req.slot, best)
        cache.tokens[req.slot] = req.prompt[:best]
        req.stats.cached_tokens = best
        for d in self.drafters:
            d.reuse_prefix(req.req_id, best)

    def draft_budget(self, r: Request, drafter: Drafter | None = None) -> int:
        """How many draft tokens request ``r`` may verify this step from ``drafter`` (its drafts are
        cut to this): ``cache_draft_tokens`` for a drafter with ``adaptive_length``, else
        ``num_draft_tokens``, within what the request and its KV slot have room for."""
        cap = self.cache_draft_tokens if drafter is not None and drafter.adaptive_length else self.num_draft_tokens
        return max(
            0, min(cap, r.params.max_tokens - len(r.output) - 1, self.max_len - self.model.cache.lengths[r.slot] - 1)
        )

    def _grammar_room(self, r: Request, d: Draft) -> int:
        """Nodes a draft may have once the grammar continued it (``grammar.Constraint.extend``): up to
        ``num_draft_tokens`` forced tokens more, within the request's tokens to come and its slot (a
        plain engine, without drafts, gets none)."""
        if self.num_draft_tokens == 0:
            return 0
        return min(
            len(d) + self.num_draft_tokens,
            r.params.max_tokens - len(r.output) - 1,
            self.max_len - self.model.cache.lengths[r.slot] - 1,
        )

    def _plan(self, reqs: list[Request]) -> DraftPlan:
        """Each request's draft for this step, from the source its policy chose (with the predicted
        yield, and whether the batch's draft sizing cut it: ``costs.batch_lengths``), cut and
        continued by its grammar; requests that failed on the way are left out.

        A policy returns a drafter (or None), or a :class:`Choice` that may carry a draft it already
        made (a selection policy drafts from the cache to decide) and its predicted yield. Requests
        without a ready draft are drafted in one ``propose`` call per source, so model drafters batch.
        A request whose policy, drafter or grammar raises is failed (``_fail``).
        """
        n = len(reqs)
        self.decoding_batch = n
        arm = POLICY if self.check is None else self.check.arm(n)
        if arm == PLAIN:  # measured: drafts do not pay at this batch size now
            plan = DraftPlan(reqs, [Draft() for _ in reqs], [None] * n, [False] * n, [0.0] * n, arm)
        else:
            plan = self._draft(reqs, arm)
        for i, r in enumerate(reqs):  # a grammar cuts what it refuses before the forward (engine/grammar.py)
            if r.processing is not None and not r.finished:
                try:
                    plan.drafts[i] = r.processing.prepare(plan.drafts[i], self._grammar_room(r, plan.drafts[i]))
                except Exception as e:  # noqa: BLE001 - this request's grammar: fail it alone
                    self._fail(r, e, "matching the draft to the output's grammar")
        return plan.live()

    def _draft(self, reqs: list[Request], arm: str) -> DraftPlan:
        """The drafts of ``arm`` (``speculation_check.SpeculationCheck``): the policy's choices, or the cache
        drafter's own drafts (``CACHE``)."""
        default = self.drafters[0] if self.drafters else None
        prefetch = [self.policy.cache] if arm == CACHE else self.drafters
        for d in prefetch:  # remote drafters fetch the whole batch's drafts in one call
            try:
                d.prepare([DraftRequest(r.req_id, r.slot, r.tokens, self.draft_budget(r, d)) for r in reqs])
            except Exception:  # noqa: BLE001 - a prefetch only; propose asks again per request below
                logger.exception("drafter %s failed to prepare the batch", d.name)
        choices = []
        own = [0.0] * len(reqs)  # each request's own drafting time (its policy call, its share of a propose)
        for i, r in enumerate(reqs):
            t0 = time.perf_counter()
            try:  # the cache arm: the cache drafter's own draft, as it decodes alone
                choices.append(
                    self.policy.cache_choice(r, self)
                    if arm == CACHE
                    else as_choice(self.policy(r, self) if self.policy else default)
                )
            except Exception as e:  # noqa: BLE001
                self._fail(r, e, "draft selection")
                choices.append(Choice(None))
            own[i] = time.perf_counter() - t0
        # Under a cost policy a shared batch's draft lengths are sized together (costs.batch_lengths)
        # before any model drafter runs: a draft is not drafted past its length, nor at all at 0.
        caps, costs = None, self.policy.costs if self.policy is not None else None
        capped = [False] * len(reqs)  # its length was cut (the policy does not learn the drafter from it)
        if costs is not None and len(reqs) > 1 and all(c.gains is not None for c in choices):
            planned = [
                0
                if c.drafter is None or r.finished
                else self.draft_budget(r, c.drafter)
                if c.draft is None
                else min(len(c.draft), self.draft_budget(r, c.drafter))
                for r, c in zip(reqs, choices)
            ]
            caps = batch_lengths(planned, [c.gains for c in choices], costs)
            capped = [n > cap for n, cap in zip(planned, caps)]
        for src in {id(c.drafter): c.drafter for c in choices if c.drafter is not None}.values():
            idxs = [
                i
                for i, c in enumerate(choices)
                if c.drafter is src and c.draft is None and not reqs[i].finished and (caps is None or caps[i] > 0)
            ]
            if idxs:
                t0 = time.perf_counter()
                made = self._propose(src, [reqs[i] for i in idxs], None if caps is None else [caps[i] for i in idxs])
                spent = time.perf_counter() - t0
                # what the drafter spent on one request alone is that request's (a new prompt's
                # catch-up); the batched drafting is split evenly
                alone = [d.setup_s if d is not None else 0.0 for d in made]
                shared = max(0.0, spent - sum(alone)) / len(idxs)
                for i, d, s in zip(idxs, made, alone):
                    choices[i].draft = d
                    own[i] += s + shared
        drafts: list[Draft] = [Draft() for _ in reqs]
        for i, (r, c) in enumerate(zip(reqs, choices)):
            if c.draft is not None and not r.finished:
                drafts[i] = c.draft.truncated(
                    min(self.draft_budget(r, c.drafter), len(c.draft) if caps is None else caps[i])
                )
                if c.also is not None:  # the cache draft first, so its nodes keep the cache's order
                    # (it fits the slot: the cache part is within the tokens still to come, the model
                    # part within num_draft_tokens, and check_fits left room for both)
                    drafts[i] = Draft.union(c.also, drafts[i])
        return DraftPlan(reqs, drafts, [c.predicted for c in choices], capped, own, arm)

    def _propose(self, src: Drafter, reqs: list[Request], caps: Sequence[int] | None = None) -> list[Draft | None]:
        """``src.propose`` for the batch (request ``i``'s draft at most ``caps[i]`` tokens); if it
        raises, once per request, failing only the ones that raise again (a batched call cannot say
        whose request broke it)."""
        cap_of = {r.req_id: c for r, c in zip(reqs, caps)} if caps is not None else {}

        def ask(r: Request) -> DraftRequest:
            budget = self.draft_budget(r, src)
            return DraftRequest(r.req_id, r.slot, r.tokens, min(budget, cap_of.get(r.req_id, budget)))

        where = f"drafting ({src.name})"
        try:
            return list(src.propose([ask(r) for r in reqs]))
        except Exception as e:  # noqa: BLE001
            if len(reqs) == 1:
                self._fail(reqs[0], e, where)
                return [None]
            logger.exception("drafter %s failed on a batch of %d; retrying per request", src.name, len(reqs))
        out: list[Draft | None] = []
        for r in reqs:
            try:
                out.append(src.propose([ask(r)])[0])
            except Exception as e:  # noqa: BLE001
                self._fail(r, e, where)
                out.append(None)
        return out

    def _decode(self, reqs: list[Request]) -> list[StepOutput]:
        """One decoding step for the running requests, in call order: plan the drafts, let the slim
        tier (if any) settle or repair them, verify the rest in one target forward, commit."""
        t0 = time.perf_counter()
        plan = self._plan(reqs)
        if not plan.reqs:
            return []
        t1 = time.perf_counter()
        for r in plan.reqs:  # without a lossy tier every layer's K/V is exact up to the cache length
            if r.full_len is None or self.slim is None or self.slim.mode == "lossless":
                r.full_len = self.model.cache.lengths[r.slot]
        settled: dict[int, list[int]] = {}  # rows the slim tier settled: their tokens
        counts = [(0, 0, 0)] * len(plan.reqs)  # slim accepted / regenerated / escalated
        if self.slim is not None:
            settled, plan.drafts, counts = self._slim_pass(plan.reqs, plan.drafts)
        full = [b for b in range(len(plan.reqs)) if b not in settled]
        verified = self._verify_full([plan.reqs[b] for b in full], [plan.drafts[b] for b in full])
        t2 = time.perf_counter()
        return self._commit(plan, settled, dict(zip(full, verified)), counts, (t0, t1, t2))

    def _commit(
        self,
        plan: DraftPlan,
        settled: dict[int, list[int]],
        verified: dict[int, tuple[list[int], int] | None],
        counts: list[tuple[int, int, int]],
        times: tuple[float, float, float],
    ) -> list[StepOutput]:
        """Record each row's step (``StepRecord``), emit its tokens, and account the step: its arm's
        rate (``speculation_check.SpeculationCheck``), the forward's cost (``costs.StepCosts``), decode time."""
        t0, t1, t2 = times
        reqs, drafts, B = plan.reqs, plan.drafts, len(plan.reqs)
        draft_s, verify_s = t1 - t0, t2 - t1
        context = len(reqs[0].prompt) + len(reqs[0].output)  # a lone row's, for costs.observe
        # each row's drafting time: the step's, split as the rows' own drafting split it (a request
        # that ran the model drafter paid for it; its neighbours that verified a cache draft did not)
        own = plan.own_s
        shares = [x / sum(own) for x in own] if sum(own) > 0 else [1.0 / B] * B
        if self.policy is not None:  # the policy learns from these: every TP rank must see the same
            draft_s, verify_s, *shares = rank0_values(self.model, [draft_s, verify_s, *shares])
        results, produced = [], 0
        for b, (req, d) in enumerate(zip(reqs, drafts)):
            if req.finished:  # its verification failed (``_fail``); released by ``step``
                continue
            if b in settled:
                emitted = settled[b]
                accepted = len(emitted) - 1
            else:
                path, nxt = verified[b]
                emitted, accepted = [d.token_ids[i] for i in path] + [nxt], len(path)
            produced += len(emitted)
            union = None  # a union step: (the model draft's tokens, how many of them were accepted)
            if d.marks is not None and b not in settled:
                on = next((n for n, i in enumerate(verified[b][0]) if not d.marks[i]), len(verified[b][0]))
                union = (sum(d.marks), on)
            req.stats.steps.append(
                StepRecord(
                    d.source or "none",
                    len(d),
                    accepted,
                    draft_s * shares[b],
                    verify_s / B,
                    plan.predicted[b],
                    capped=plan.capped[b],
                    arm=plan.arm if self.check is not None and B > 1 else None,
                    slim_accepted=counts[b][0],
                    slim_regenerated=counts[b][1],
                    slim_escalated=counts[b][2],
                    full_forward=b not in settled,
                    union=union,
                    context=len(req.prompt) + len(req.output),
                )
            )
            try:
                results.append(self._emit(req, emitted))
            except Exception as e:  # noqa: BLE001 - a drafter's accept: fail this request alone
                self._fail(req, e, "emitting tokens")
        if self.check is not None:
            self.check.record(B, plan.arm, produced, draft_s + verify_s)
            if self.slim is None:  # one target forward over every row: what it costs here (costs.StepCosts)
                self.policy.costs.observe(B, B + sum(map(len, drafts)), verify_s, context)
        dt = time.perf_counter() - t0
        for r in reqs:
            r.stats.decode_s += dt
        return results

    def _slim_pass(
        self, reqs: list[Request], drafts: list[Draft]
    ) -> tuple[dict[int, list[int]], list[Draft], list[tuple[int, int, int]]]:
        """The slim tier (``verification/tiered.py``): one ``q'`` forward (the target with ``skip``)
        over ``[pending] + draft`` for the chain drafts it can help. A tiered greedy row ``q'`` settles
        keeps its tokens' K/V unverified (``full_len`` stays behind, the next full forward catches
        up); every other row gets its draft repaired by ``q'``. Returns the settled rows' tokens by
        row, the drafts to verify (settled rows keep theirs, for the record) and the slim counts."""
        tier, cache, dev = self.slim, self.model.cache, self.model.device
        B = len(reqs)
        starts = [cache.lengths[r.slot] for r in reqs]
        tiered = [tier.mode == "tiered" and r.params.greedy for r in reqs]
        budgets = [self.draft_budget(r) for r in reqs]
        use = [
            b
            for b in range(B)
            if drafts[b].is_chain
            and reqs[b].processing is None  # q' judges by the raw distribution, without logprobs
            and reqs[b].params.logprobs is None
            and budgets[b] > 0
            and (len(drafts[b]) or tier.slim_empty)
            and not (tiered[b] and starts[b] - reqs[b].full_len + len(drafts[b]) + 1 > tier.max_lag)
        ]
        settled: dict[int, list[int]] = {}
        drafts = list(drafts)
        counts = [(0, 0, 0)] * B
        if not use:
            return settled, drafts, counts
        rows = [[reqs[b].pending] + drafts[b].token_ids for b in use]
        T = max(map(len, rows))
        toks = torch.tensor([r + [0] * (T - len(r)) for r in rows], device=dev)
        taps = self.taps if any(tiered[b] for b in use) else ()
        out = self.model(toks, [reqs[b].slot for b in use], n_new=[len(r) for r in rows], skip=tier.mask, taps=taps)
        best = out.logits.argmax(-1).tolist()
        for j, b in enumerate(use):
            req, d = reqs[b], drafts[b]
            req.stats.slim_forwards += 1
            if tiered[b] and len(d):
                own = out.logits[j, : len(d) + 1].float().softmax(-1).amax(-1).tolist()
                v = tiered_verdict(
                    confidence_ratios(out.logits[j], d.token_ids),
                    best[j],
                    own,
                    d.token_ids,
                    tier.thresholds,
                    len(req.output),
                )
                if not v.escalate:
                    settled[b] = d.token_ids[: v.accepted] + ([v.token] if v.token is not None else [])
                    counts[b] = (v.accepted, int(v.token is not None), 0)
                    cache.truncate(req.slot, starts[b] + len(settled[b]))
                    if self.taps:
                        self._observe(req, settled[b], out.taps, j, slice(0, len(settled[b])))
                    continue
            repaired, agreed, added = repair(best[j], d.token_ids, budgets[b])
            counts[b] = (agreed, added, len(d) if tiered[b] else 0)
            drafts[b] = Draft.chain(repaired, source=d.source)
            cache.truncate(req.slot, starts[b])
        return settled, drafts, counts

    def _verify_full(self, reqs: list[Request], drafts: list[Draft]) -> list[tuple[list[int], int] | None]:
        """One target forward over ``tokens[full_len:] + [pending] + draft`` per request: verify the
        draft and rewrite every layer's K/V over the lag ``tokens[full_len:]`` (what the slim tier
        settled unverified; empty without a lossy tier), so the cache is exact again up to the new
        length. Returns ``(accepted path, next token)`` per request, None where it failed (``_fail``)."""
        if not reqs:
            return []
        cache, dev = self.model.cache, self.model.device
        B = len(reqs)
        # (tokens copies prompt + output: only rows that lag pay for it)
        lags = [
            r.tokens[r.full_len : cache.lengths[r.slot]] if r.full_len < cache.lengths[r.slot] else [] for r in reqs
        ]
        for r in reqs:
            cache.truncate(r.slot, r.full_len)
        rows = [lag + [r.pending] + d.token_ids for r, lag, d in zip(reqs, lags, drafts)]
        widths = list(map(len, rows))
        T = max(widths)
        toks = torch.tensor([x + [0] * (T - len(x)) for x in rows], device=dev)
        mask = depths = None
        if any(not d.is_chain for d in drafts):
            mask = torch.tril(torch.ones(B, T, T, dtype=torch.bool, device=dev))
            depths = torch.arange(T, device=dev).repeat(B, 1)
            for b, (lag, d) in enumerate(zip(lags, drafts)):
                if not d.is_chain:  # the draft's tree sits after the lag, which every node sees
                    g, w = len(lag), widths[b]
                    mask[b, g:w, g:w] = tree_attention_mask(d.parents, device=dev)
                    depths[b, g:w] = g + torch.tensor(tree_depths(d.parents), device=dev)
        # rows of different widths are packed (each pays for its own tokens); their logits come packed
        out = self.model(
            toks,
            [r.slot for r in reqs],
            n_new=widths,
            depths=depths,
            attn_mask=mask,
            taps=self.taps,
            packed_logits=True,
        )
        logits = out.logits
        walks = best = None
        if (
            logits.is_cuda
            and T > 1
            and out.offsets is None
            and all(r.params.greedy and r.processing is None for r in reqs)
            and not any(lags)
        ):
            walks = device_walks(logits, drafts)  # one Triton pass, no full argmax
        elif any(r.params.greedy for r in reqs):
            flat = logits.argmax(-1).tolist()  # one sync
            best = flat if out.offsets is None else [flat[a:b] for a, b in itertools.pairwise(out.offsets)]
        results: list[tuple[list[int], int] | None] = []
        for b, (req, lag, d) in enumerate(zip(reqs, lags, drafts)):
            g = len(lag)
            try:
                path, nxt = verify_row(
                    req,
                    d,
                    out.row(b)[g : widths[b]],
                    walks[b] if walks is not None else None,
                    best[b][g:] if best is not None else None,
                )
                if req.params.logprobs is not None:
                    req.step_logprobs = token_logprobs(
                        out.row(b)[g : widths[b]],
                        [0] + [i + 1 for i in path],
                        [d.token_ids[i] for i in path] + [nxt],
                        req.params.logprobs,
                    )
                keep = list(range(g + 1)) + [g + 1 + i for i in path]
                cache.compact(req.slot, req.full_len, keep)
                req.full_len = cache.lengths[req.slot]
                if self.taps:
                    self._observe(
                        req, [d.token_ids[i] for i in path] + [nxt], out.taps, b, torch.tensor(keep[g:], device=dev)
                    )
                req.stats.target_forwards += 1
                results.append((path, nxt))
            except Exception as e:  # noqa: BLE001 - this request's verification: fail it alone
                self._fail(req, e, "verification")
                results.append(None)
        return results

    def _observe(self, req: Request, next_tokens: list[int], taps: list[torch.Tensor], row: int, pos) -> None:
        """Hand each tap-reading drafter the target's hidden states at the committed positions."""
        for d in self.drafters:
            if d.needs_taps:
                fused = torch.cat([taps[self.taps.index(t)][row, pos] for t in d.needs_taps], dim=-1)
                d.observe_target(req.req_id, next_tokens, fused)

    def _emit(self, req: Request, tokens: list[int]) -> StepOutput:
        """Append tokens to the output, cutting at EOS / stop tokens / stop strings / max_tokens."""
        p = req.params
        kept: list[int] = []
        for tok in tokens:
            if tok in p.stop_token_ids or (tok in self.eos and not p.ignore_eos):
                req.finish_reason = "stop"
                break
            kept.append(tok)
            if len(req.output) + len(kept) >= p.max_tokens:
                req.finish_reason = "length"
                break
        req.output += kept
        logprobs, req.step_logprobs = req.step_logprobs, None
        if p.stop and self.detokenize and not req.finished:
            new = kept
            if req.stop_scan is None:  # incremental over the whole output text: no stop string is too long
                from .text import StopScanner

                req.stop_scan, new = StopScanner(self.detokenize, p.stop), req.output
            if req.stop_scan.push(new):
                req.finish_reason = "stop"
        if kept:  # also when finishing, so e.g. the suffix cache keeps the whole output
            for d in self.drafters:
                d.accept(req.req_id, kept)
        if not req.finished:
            req.pending = req.output[-1]
            if req.processing is not None:
                req.processing.advance(kept)
        return StepOutput(
            req.req_id,
            kept,
            req.finished,
            req.finish_reason,
            logprobs=logprobs[: len(kept)] if logprobs is not None else None,
        )

    # ----------------------------------------------------------------------------- helpers
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Request]:
        """Run ``prompts`` to completion (batched up to the slot count) and return the requests."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_unfinished():
            self.step()
        return reqs

    def stream(self, prompt: Sequence[int], params: SamplingParams | None = None) -> Iterator[list[int]]:
        """Yield the tokens of one request as they are produced."""
        req = self.add_request(prompt, params)
        while not req.finished:
            for out in self.step():
                if out.req_id == req.req_id and out.new_tokens:
                    yield out.new_tokens
        while self.has_unfinished():
            self.step()
