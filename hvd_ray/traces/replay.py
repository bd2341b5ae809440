"""Trace replay: rebuild the drafters' state at every position of a recorded greedy generation,
draft, and label each draft with the number of its tokens the target would accept.

For a trace with prompt ``P`` and output ``O`` (``N`` tokens), position ``t`` (1 <= t < N) is the
decoding step that starts when the output holds ``t`` tokens: the context is ``P + O[:t]`` and a
draft proposes ``O[t:]``. Greedy verification accepts the longest draft prefix that matches the
target's own greedy continuation, which *is* the recorded ``O[t:]`` — so the label needs no target
forward (for a tree draft: the longest root path matching it).

**Cache drafter state, exactly as serving has it.** One real ``SuffixDrafter`` per worker, driven
through its public lifecycle for the replayed trace (``begin(prompt)``, ``accept`` token by token,
``end``), so the request tree is ``P + O[:t]`` and — with ``global_live`` — the global tree also
holds the request's own output so far. The global tree holds the outputs of traces with a smaller
``seq`` (arrival order), bounded by ``max_cached_requests`` (oldest evicted first): this is serving
the traces one at a time in arrival order. Traces are labelled in ``seq`` order within a batch;
:class:`GlobalReplay` adds the earlier outputs a batch needs (rebuilding from the bound's window
when a batch starts before the worker's current point), so batches can be labelled in parallel
by different workers at the cost of one global-tree build per batch. Concurrent serving (other
requests' partial outputs in the global tree) is not modelled.

**Draft budget.** As the engine computes it: ``min(max_draft, max_tokens - t - 1)`` with
``max_tokens`` from the trace's ``decoding`` JSON (its output length when absent). The online
engine must run with ``num_draft_tokens == max_draft`` for the labels to describe it.

**History features.** φ_t includes features of the request's earlier steps (recent accepted
lengths, the rate of choosing the cache). They come from a simulated decoding run along the trace
under a documented policy (default :class:`~hvd_ray.selection.policy.ScoreRule` with τ = 6:
verify the cache draft when its own score > 6, else the model draft): from t = 1, a step at t
accepts ``y_cache[t]`` or ``y_model[t]`` tokens plus the bonus token, so the next step starts at
``t + accepted + 1``. Every position is labelled (``step_start`` marks the run's steps); a position
between two step starts gets the history of the steps *completed* by then (the step in flight over
it is left out: its accepted length would tell how far the continuation at t matches, which no
decoding-time state knows). ``--sim-predictor`` replaces the rule with the
τ rule on a trained predictor (a second, self-consistent round).

**Model drafter labels, teacher-forced and batched.** One target forward over ``P + O`` fills a
KV-cache slot with exact committed K/V (plus hidden-state taps for EAGLE-3); it is copied to
``batch`` slots, and positions are drafted ``batch`` at a time by the drafter's own ``propose``
(its real code: depth, confidence stop, chain or tree) with each slot's length set to the
position's committed length. Slots take positions in decreasing order, so the scratch rows a draft
writes past its committed length are never read by a later (shorter) position. The only
difference from online drafting is floating-point: committed K/V come from one prefill instead of
the engine's successive verify forwards (use fp32 when comparing token for token).
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from ..drafters.base import Draft, DraftRequest
from ..drafters.eagle3 import Eagle3Drafter, _ReqState
from ..drafters.suffix import SuffixConfig, SuffixDrafter
from ..model.kv_cache import KVCache
from ..selection.features import SPEC, VocabFlags, features
from ..selection.policy import CACHE, MODEL, Policy, ScoreRule, StepView
from ..workloads.turns import is_second_turn
from .labels import label_schema

TRACE_COLUMNS = ("prompt_id", "workload", "split", "seq", "prompt_tokens", "output_tokens", "finish_reason", "decoding")


@dataclass
class Trace:
    prompt_id: str
    seq: int
    prompt: list[int]
    output: list[int]
    max_tokens: int
    workload: str = ""
    split: str = ""

    @property
    def rid(self) -> str:
        return f"seq-{self.seq}"


def _max_tokens(decoding: str | None, n_out: int) -> int:
    try:
        mt = json.loads(decoding or "{}").get("max_tokens")
    except (TypeError, ValueError):
        mt = None
    return int(mt) if mt else n_out


def traces_from_table(table: pa.Table) -> list[Trace]:
    """``TRACE_SCHEMA`` rows -> :class:`Trace` list sorted by ``seq``."""
    d = table.to_pydict()
    n = table.num_rows
    get = lambda c, i, default="": d[c][i] if c in d and d[c][i] is not None else default  # noqa: E731
    out = [
        Trace(
            str(d["prompt_id"][i]),
            int(d["seq"][i]),
            list(d["prompt_tokens"][i]),
            list(d["output_tokens"][i]),
            _max_tokens(get("decoding", i, None), len(d["output_tokens"][i])),
            str(get("workload", i)),
            str(get("split", i)),
        )
        for i in range(n)
    ]
    return sorted(out, key=lambda tr: tr.seq)


def read_trace_table(path: str | Path, columns: Sequence[str] | None = TRACE_COLUMNS) -> pa.Table:
    """The trace folder (``collect_traces`` parts) as one table sorted by ``seq``, with the
    columns replay reads (``traces.collect.read_traces``)."""
    from .collect import read_traces

    return read_traces(path, columns)


def longest_match(draft: Draft, output: Sequence[int], t: int) -> int:
    """Length of the longest root path of ``draft`` equal to ``output[t:]`` (greedy acceptance)."""
    toks, parents = draft.token_ids, draft.parents
    n = len(output) - t
    if draft.is_chain:
        k = 0
        for tok in toks:
            if k >= n or tok != output[t + k]:
                break
            k += 1
        return k
    depth = {-1: 0}
    best = 0
    for i, (tok, par) in enumerate(zip(toks, parents)):
        d = depth.get(par)
        if d is not None and d < n and tok == output[t + d]:
            depth[i] = d + 1
            best = max(best, d + 1)
    return best


# ---------------------------------------------------------------------------------------------
# cache drafter
class GlobalReplay:
    """A ``SuffixDrafter`` whose global tree holds the outputs of traces before a given ``seq``.

    ``history``: every trace's ``(seq, output)`` (any order). :meth:`drafter_before` returns the
    drafter with the global tree holding the outputs of traces with smaller ``seq`` (the last
    ``max_cached_requests`` of them), advancing incrementally when called with increasing ``seq``.
    """

    def __init__(self, history: Sequence[tuple[int, Sequence[int]]], config: SuffixConfig):
        self.config = config
        hist = sorted((int(s), list(o)) for s, o in history)
        self._seqs = [s for s, _ in hist]
        self._outs = [o for _, o in hist]
        self.drafter: SuffixDrafter | None = None
        self._next = 0  # index of the next history output not yet in the drafter
        self.rebuilds = 0

    def _add(self, i: int) -> None:
        # What begin + accept* + end leave in the global tree (with or without global_live): a
        # cache slot (evicting the oldest beyond the bound), then the output. No request tree.
        d, rid = self.drafter, f"seq-{self._seqs[i]}"
        d.add_to_global(rid, self._outs[i])

    def drafter_before(self, seq: int) -> SuffixDrafter:
        i = bisect.bisect_left(self._seqs, seq)
        if self.drafter is None or self._next > i:
            self.drafter = SuffixDrafter(self.config)
            lim = self.config.max_cached_requests
            self._next = max(0, i - lim) if lim > 0 else (i if lim == 0 else 0)
            self.rebuilds += 1
        while self._next < i:
            self._add(self._next)
            self._next += 1
        return self.drafter

    def done(self, seq: int) -> None:
        """The trace ``seq`` was replayed through the drafter: its output is in the tree now."""
        i = bisect.bisect_left(self._seqs, seq)
        if i < len(self._seqs) and self._seqs[i] == seq and self._next == i:
            self._next = i + 1


def budgets_for(trace: Trace, max_draft: int) -> np.ndarray:
    """The engine's draft budget at each t (index = t)."""
    t = np.arange(len(trace.output))
    return np.clip(np.minimum(max_draft, trace.max_tokens - t - 1), 0, None).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# model drafter
def _fill_slots(cache: KVCache, n: int, batch: int) -> None:
    """Copy slot 0's first ``n`` K/V rows to slots 1..batch-1 and set every length to ``n`` (the
    target's cache or the EAGLE-3 head's: per layer ``[slots, kv, len, hd]``)."""
    for kc, vc in zip(cache.k, cache.v):
        kc[1:batch, :, :n] = kc[0:1, :, :n]
        vc[1:batch, :, :n] = vc[0:1, :, :n]
    for s in range(batch):
        cache.lengths[s] = n


def _ensure_cache(model, batch: int, need: int):
    c = model.cache
    if c is None or c.slots < batch or c.max_len < need:
        model.setup_cache(max(batch, c.slots if c else 0), max(need, c.max_len if c else 0))
    return model.cache


@torch.inference_mode()
def model_drafter_labels(
    drafter,
    prompt: Sequence[int],
    output: Sequence[int],
    budgets: Sequence[int],
    batch: int = 8,
    return_drafts: bool = False,
):
    """``(y, lens[, drafts])``: per position t (index t; 0 unused) the model drafter's accepted
    length against ``output[t:]`` and its draft length, teacher-forced and batched (module doc).

    Supports ``ModelDrafter`` (layer-skip self-drafting: shared target cache; separate draft model:
    its own cache) and ``Eagle3Drafter``. Takes over the drafting model's KV cache (resized to at
    least ``batch`` slots): do not share the model with a running engine.
    """
    N = len(output)
    y = np.zeros(N, np.int32)
    lens = np.zeros(N, np.int32)
    drafts: dict[int, Draft] = {}
    ts = [t for t in range(N - 1, 0, -1) if budgets[t] > 0]
    if not ts:
        return (y, lens, drafts) if return_drafts else (y, lens)
    seq = [int(x) for x in list(prompt) + list(output)]
    P = len(prompt)
    batch = max(1, min(batch, len(ts)))
    is_eagle = isinstance(drafter, Eagle3Drafter)
    model = drafter.target if is_eagle else drafter.model
    room = getattr(drafter, "draft_room", getattr(drafter, "depth", 8)) + 2
    cache = _ensure_cache(model, batch, len(seq) + room)
    dev = model.device
    prefix = seq[:-1]  # committed K/V up to the largest position's context
    cache.truncate(0, 0)
    taps_idx = tuple(sorted(set(drafter.needs_taps))) if is_eagle else ()
    out = model(torch.tensor([prefix], device=dev), [0], taps=taps_idx, last_only=True)
    if is_eagle:
        head = drafter.head
        hc = head.cache
        if hc is None or hc.slots < batch or hc.max_len < len(seq) + room:
            head.setup_cache(max(batch, hc.slots if hc else 0), max(len(seq) + room, hc.max_len if hc else 0))
        hc = head.cache
        fused_taps = torch.cat([out.taps[taps_idx.index(t)][0] for t in drafter.needs_taps], dim=-1)
        hc.truncate(0, 0)
        # the head observes (tap at position j, token j+1) pairs, as the engine feeds it
        prenorm, hlogits = head(
            torch.tensor([seq[1 : len(prefix) + 1]], device=head.device),
            head.fuse(drafter._order_taps(fused_taps))[None],
            [0],
        )
        _fill_slots(hc, len(prefix), batch)
    _fill_slots(cache, len(prefix), batch)
    for g in range(0, len(ts), batch):
        group = ts[g : g + batch]
        asks = []
        for b, t in enumerate(group):
            L = P + t
            cache.lengths[b] = min(cache.lengths[b], L - 1)  # decreasing t per slot: a truncate
            rid = f"pos-{t}"
            if is_eagle:
                hc.lengths[b] = min(hc.lengths[b], L - 1)
                drafter._reqs[rid] = _ReqState(
                    b, prenorm[0, L - 2], torch.log_softmax(hlogits[0, L - 2].float(), -1), seq[L - 1]
                )
            asks.append(DraftRequest(rid, b, seq[:L], int(budgets[t])))
        for t, ask, d in zip(group, asks, drafter.propose(asks)):
            d = d.truncated(ask.max_tokens)
            y[t] = longest_match(d, output, t)
            lens[t] = len(d)
            if return_drafts:
                drafts[t] = d
        if is_eagle:
            for ask in asks:
                drafter._reqs.pop(ask.req_id, None)
    return (y, lens, drafts) if return_drafts else (y, lens)


# ---------------------------------------------------------------------------------------------
# one trace
def replay_trace(
    trace: Trace,
    drafter: SuffixDrafter,
    flags: VocabFlags,
    *,
    max_draft: int,
    y_model: np.ndarray | None = None,
    model_len: np.ndarray | None = None,
    model_depth: int = 0,
    sim: Policy | None = None,
    drafts: dict | None = None,
    regime: str = "cold",
    rid: str | None = None,
) -> dict[str, list]:
    """Label every position of ``trace`` with the cache drafter in its serving state (the
    drafter's global tree must already hold the earlier traces; the trace goes through
    begin/accept/end as request ``rid``, default ``trace.rid``). Returns ``LABEL_SCHEMA`` columns,
    ``regime`` filled in. ``drafts``, if given, collects the cache draft at each t (tests)."""
    P, out = trace.prompt, trace.output
    N = len(out)
    if y_model is None:
        y_model = np.zeros(N, np.int32)
        model_len = np.zeros(N, np.int32)
    sim = sim or ScoreRule()
    budgets = budgets_for(trace, max_draft)
    cols: dict[str, list] = {
        k: []
        for k in (
            "t",
            "remaining",
            "budget",
            "step_start",
            "sim_cache",
            "phi",
            "cache_len",
            "cache_score",
            "cache_source",
            "y_cache",
            "model_len",
            "y_model",
        )
    }
    rid = rid or trace.rid
    drafter.begin(rid, P)
    if N:
        drafter.accept(rid, out[:1])
    hist: list[tuple[bool, int]] = []
    next_step = 1
    for t in range(1, N):
        budget = int(budgets[t])
        draft = drafter.speculate(rid, budget)
        yc = longest_match(draft, out, t)
        start = t == next_step
        # history = the run's steps completed by t: between step starts, the step in flight (which
        # covers t) is left out, since its outcome reveals how far the continuation matched
        phi = features(
            draft,
            prompt_len=len(P),
            generated=t,
            max_tokens=trace.max_tokens,
            last_token=out[t - 1],
            history=hist if start else hist[:-1],
            flags=flags,
        )
        sim_cache = None
        if start:
            view = StepView(phi, len(draft), min(model_depth, budget), yc, int(y_model[t]))
            choice, _ = sim.decide(view)
            sim_cache = choice == CACHE
            acc = yc if sim_cache else int(y_model[t]) if (choice == MODEL and model_depth > 0) else 0
            hist.append((sim_cache, acc))
            next_step = t + acc + 1
        if drafts is not None:
            drafts[t] = draft
        for k, v in (
            ("t", t),
            ("remaining", N - t),
            ("budget", budget),
            ("step_start", start),
            ("sim_cache", sim_cache),
            ("phi", phi),
            ("cache_len", len(draft)),
            ("cache_score", float(draft.score)),
            ("cache_source", draft.source),
            ("y_cache", yc),
            ("model_len", int(model_len[t])),
            ("y_model", int(y_model[t])),
        ):
            cols[k].append(v)
        drafter.accept(rid, out[t : t + 1])
    drafter.end(rid)
    n = len(cols["t"])
    cols.update(
        prompt_id=[trace.prompt_id] * n,
        workload=[trace.workload] * n,
        split=[trace.split] * n,
        seq=[trace.seq] * n,
        regime=[regime] * n,
    )
    return cols


def columns_to_table(cols: dict[str, list]) -> pa.Table:
    schema = label_schema(SPEC.to_json())
    arrays = []
    for f in schema:
        v = cols[f.name]
        if f.name == "phi":
            flat = np.concatenate(v).astype(np.float32) if v else np.zeros(0, np.float32)
            offsets = np.arange(len(v) + 1, dtype=np.int32) * (len(SPEC) if v else 0)
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)))
        else:
            arrays.append(pa.array(v, type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


# ---------------------------------------------------------------------------------------------
# the labelling worker (a Ray Data actor; usable in-process too)
@dataclass
class ReplayConfig:
    model: str | None = "default"  # target model name/folder; None: cache labels only
    tokenizer: str | None = None  # folder with the tokenizer (default: the model's)
    dtype: str = "float32"
    device: str = "cpu"
    model_drafter: str = "layerskip"  # layerskip | draft-model | eagle3 | none
    skip: str | None = None  # layer-skip spec, e.g. "attn:10-17" (default: layerskip.default_skip)
    depth: int | None = None  # model drafter depth k (None: the drafter's default, as served)
    min_prob: float | None = None  # model drafter confidence stop (None: the drafter's default)
    draft_model: str | None = None
    eagle3_head: str | None = None
    eagle3_tree: bool = False
    max_draft: int = 64
    suffix: dict = field(default_factory=dict)  # SuffixConfig overrides
    sim_tau: float = 6.0
    sim_predictor: str | None = None
    repeat: bool = False  # also label each trace replayed again with its own output in the global tree
    batch_slots: int = 8
    threads: int = 1

    def suffix_config(self) -> SuffixConfig:
        return SuffixConfig(**self.suffix)

    def model_depth(self) -> int:
        """The model drafter's depth (0 without one): ``depth`` or the drafter class's default."""
        if self.model_drafter == "none" or self.model is None:
            return 0
        if self.depth is not None:
            return self.depth
        import inspect

        if self.model_drafter == "eagle3":
            return 8 if self.eagle3_tree else 5  # Eagle3Drafter's defaults
        if self.model_drafter == "layerskip":
            from ..drafters.layerskip import LayerSkipDrafter as cls
        else:
            from ..drafters.model_drafter import ModelDrafter as cls
        return int(inspect.signature(cls.__init__).parameters["depth"].default)


class TraceLabeler:
    """Labels batches of traces (``TRACE_SCHEMA`` pyarrow tables) -> ``LABEL_SCHEMA`` tables.

    ``traces_dir`` is read once for the global history (every trace's ``seq`` and output).
    """

    def __init__(self, traces_dir: str, config: dict | ReplayConfig | None = None):
        cfg = config if isinstance(config, ReplayConfig) else ReplayConfig(**(config or {}))
        self.cfg = cfg
        torch.set_num_threads(max(1, cfg.threads))
        hist = read_trace_table(traces_dir, ("seq", "output_tokens")).to_pydict()
        self.global_replay = GlobalReplay(list(zip(hist["seq"], hist["output_tokens"])), cfg.suffix_config())
        self.drafter = None
        self.model = None
        tok_path = cfg.tokenizer
        vocab = None
        if cfg.model is not None and cfg.model_drafter != "none":
            from ..model import parse_device, parse_dtype, resolve
            from ..model.transformer import Transformer

            folder = resolve(cfg.model)
            self.model = Transformer.from_pretrained(
                folder, dtype=parse_dtype(cfg.dtype), device=parse_device(cfg.device)
            )
            vocab = self.model.cfg.vocab_size
            tok_path = tok_path or str(folder)
            self.drafter = self._make_drafter()
            assert self.drafter.depth == cfg.model_depth(), "ReplayConfig.model_depth() is out of date"
        elif cfg.model is not None:
            from ..model import resolve

            tok_path = tok_path or str(resolve(cfg.model))
        if tok_path is None:
            raise ValueError("need a tokenizer (config.tokenizer) for the structure flags")
        from transformers import AutoTokenizer

        self.flags = VocabFlags.from_tokenizer(AutoTokenizer.from_pretrained(tok_path), vocab)
        self.sim = self._make_sim()
        self.stats = {"traces": 0, "positions": 0, "cache_s": 0.0, "model_s": 0.0}

    def _make_drafter(self):
        cfg, m = self.cfg, self.model
        if cfg.model_drafter == "layerskip":
            from ..drafters.layerskip import LayerSkipDrafter, parse_skip

            kw = {} if cfg.min_prob is None else {"min_prob": cfg.min_prob}
            if cfg.depth is not None:
                kw["depth"] = cfg.depth
            return LayerSkipDrafter(m, parse_skip(cfg.skip) if cfg.skip else None, **kw)
        if cfg.model_drafter == "draft-model":
            from ..drafters.model_drafter import draft_model_drafter

            d = draft_model_drafter(cfg.draft_model, m, slots=cfg.batch_slots, max_len=m.cfg.max_position)
            if cfg.depth is not None:
                d.depth = cfg.depth
            if cfg.min_prob is not None:
                d.min_prob = cfg.min_prob
            return d
        if cfg.model_drafter == "eagle3":
            from ..model.eagle3_head import Eagle3Head

            return Eagle3Drafter(
                m,
                Eagle3Head.load(cfg.eagle3_head, m),
                tree=cfg.eagle3_tree,
                depth=cfg.depth,
                slots=cfg.batch_slots,
                max_len=m.cfg.max_position,
            )
        raise ValueError(f"unknown model drafter {cfg.model_drafter!r}")

    def _make_sim(self) -> Policy:
        if self.cfg.sim_predictor:
            from ..selection.policy import TauPolicy
            from ..selection.predictor import YieldPredictor

            return TauPolicy(YieldPredictor.load(self.cfg.sim_predictor), tau=self.cfg.sim_tau)
        return ScoreRule(tau=self.cfg.sim_tau)

    @property
    def model_depth(self) -> int:
        return int(self.drafter.depth) if self.drafter is not None else 0

    def label(self, trace: Trace, drafts: dict | None = None, model_drafts: dict | None = None) -> dict[str, list]:
        budgets = budgets_for(trace, self.cfg.max_draft)
        ym = ml = None
        if self.drafter is not None:
            t0 = time.perf_counter()
            res = model_drafter_labels(
                self.drafter,
                trace.prompt,
                trace.output,
                budgets,
                self.cfg.batch_slots,
                return_drafts=model_drafts is not None,
            )
            ym, ml = res[0], res[1]
            if model_drafts is not None:
                model_drafts.update(res[2])
            self.stats["model_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        drafter = self.global_replay.drafter_before(trace.seq)
        cols = replay_trace(
            trace,
            drafter,
            self.flags,
            max_draft=self.cfg.max_draft,
            y_model=ym,
            model_len=ml,
            model_depth=self.model_depth,
            sim=self.sim,
            drafts=drafts,
            regime="agent" if is_second_turn(trace.prompt_id) else "cold",
        )
        self.global_replay.done(trace.seq)
        if self.cfg.repeat:  # the same request again (a retry, an agent re-sending context), as its own
            # request: its first answer stays in the global tree; the copy leaves again, so later traces
            # see the same history as without --repeat
            rid = f"{trace.rid}/repeat"
            again = replay_trace(
                trace,
                drafter,
                self.flags,
                max_draft=self.cfg.max_draft,
                y_model=ym,
                model_len=ml,
                model_depth=self.model_depth,
                sim=self.sim,
                regime="repeat",
                rid=rid,
            )
            if rid in drafter.cached_requests:
                drafter.evict(rid)
            for k, v in again.items():
                cols[k].extend(v)
        self.stats["cache_s"] += time.perf_counter() - t0
        self.stats["traces"] += 1
        self.stats["positions"] += len(cols["t"])
        return cols

    def __call__(self, batch: pa.Table) -> pa.Table:
        merged: dict[str, list] = {}
        for tr in traces_from_table(batch):
            for k, v in self.label(tr).items():
                merged.setdefault(k, []).extend(v)
        if not merged:
            return label_schema(SPEC.to_json()).empty_table()
        return columns_to_table(merged)


def label_traces_local(traces_dir: str, config: dict | ReplayConfig | None = None) -> pa.Table:
    """Label every trace in one process, in ``seq`` order (the reference for the Ray job)."""
    lab = TraceLabeler(traces_dir, config)
    return lab(read_trace_table(traces_dir))


__all__ = [
    "GlobalReplay",
    "ReplayConfig",
    "Trace",
    "TraceLabeler",
    "budgets_for",
    "columns_to_table",
    "label_traces_local",
    "longest_match",
    "model_drafter_labels",
    "read_trace_table",
    "replay_trace",
    "traces_from_table",
]
