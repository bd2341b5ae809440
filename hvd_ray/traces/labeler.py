"""The labelling worker: :class:`TraceLabeler` (a Ray Data actor, usable in-process too) labels
batches of traces with both drafters, and :func:`label_traces_ray` runs it over a trace folder.

The global suffix tree of a trace must hold the outputs of every *earlier* trace (smaller ``seq``),
so each actor reads every trace's output once and labels its batches in ``seq`` order, adding the
earlier outputs it has not seen yet (``replay.GlobalReplay``). Ray Data gets blocks that are
contiguous runs of ``seq``: one global-tree build per block at most, and blocks label in parallel.
The trace and label folders are local paths or storage URIs (``storage.py``): the labelers read the
traces and Ray Data's write tasks write the labels, wherever they run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

import pyarrow as pa
import torch

from ..drafters.eagle3 import Eagle3Drafter
from ..drafters.suffix import SuffixConfig
from ..selection.features import SPEC, VocabFlags
from ..selection.policy import Policy, ScoreRule
from ..workloads.turns import is_second_turn
from . import storage
from .labels import LABEL_VERSION, META_FILE, columns_to_table, label_schema
from .model_labels import model_drafter_labels
from .records import Trace, read_trace_table, traces_from_table
from .replay import GlobalReplay, budgets_for, replay_trace

WRITE_CPUS = 0.25
STATS_DIR = "_labelers"  # the labelers' counters while a run lasts ("_": parquet readers skip it)


@dataclass
class ReplayConfig:
    """How traces are replayed and labelled: the target, its model drafter, the cache drafter's
    settings, the draft budget and the simulated run that supplies the history features."""

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

    ``traces_dir`` (a path or storage URI) is read once for the global history (every trace's ``seq``
    and output). With ``stats_dir`` each labeler keeps its own counters there (``<node>-<pid>.json``:
    its Ray node, traces, positions, seconds), so the job can say where its work ran.
    """

    def __init__(self, traces_dir: str, config: dict | ReplayConfig | None = None, stats_dir: str | None = None):
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
        self.stats_file = None
        if stats_dir is not None:
            import ray

            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
            self.stats = {"node": node, **self.stats}
            self.stats_file = storage.join(stats_dir, f"{node[:16]}-{os.getpid()}.json")

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
        if self.stats_file is not None:
            storage.write_text(self.stats_file, json.dumps(self.stats))
        if not merged:
            return label_schema(SPEC.to_json()).empty_table()
        return columns_to_table(merged)


def label_traces_local(traces_dir: str, config: dict | ReplayConfig | None = None) -> pa.Table:
    """Label every trace in one process, in ``seq`` order (the reference for the Ray job)."""
    lab = TraceLabeler(traces_dir, config)
    return lab(read_trace_table(traces_dir))


def label_traces_ray(
    traces_dir: str | os.PathLike,
    out: str | os.PathLike,
    config: dict | ReplayConfig,
    *,
    chunk: int = 32,
    actors: int = 1,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    address: str | None = None,
) -> dict:
    """Label every trace of ``traces_dir`` on Ray Data: blocks of ``chunk`` traces through a pool of
    ``actors`` labelers, written as parquet into ``out`` with ``_labels_meta.json`` (returned; its
    ``workers`` say which Ray node labelled how many traces). Both folders are paths or storage URIs.

    Starts Ray when it is not running: joins ``address`` or ``$RAY_ADDRESS``, else a fresh local
    instance. The rows equal :func:`label_traces_local`'s.
    """
    import pyarrow.parquet as pq
    import ray

    traces, out = storage.normalize(traces_dir), storage.normalize(out)
    fs, out_path = storage.resolve(out)
    stats_dir = storage.join(out, STATS_DIR)
    _take_stats(stats_dir)  # an interrupted run's counters are not this run's
    config = config if isinstance(config, ReplayConfig) else ReplayConfig(**config)
    if not ray.is_initialized():
        ray.init(
            address=address or os.environ.get("RAY_ADDRESS") or "local", log_to_driver=False, include_dashboard=False
        )
    t0 = time.time()
    # Traces are small (token ids): read them here, sort by arrival, and hand Ray Data blocks that
    # are contiguous runs of ``seq`` (no distributed sort needed for a few MB).
    table = read_trace_table(traces).sort_by("seq")
    blocks = [table.slice(i, chunk) for i in range(0, table.num_rows, chunk)]
    ds = ray.data.from_arrow(blocks).map_batches(
        TraceLabeler,
        fn_constructor_kwargs={"traces_dir": traces, "config": dataclasses.asdict(config), "stats_dir": stats_dir},
        batch_size=None,  # one batch per block: one seq run per call
        batch_format="pyarrow",
        # a block is seconds to minutes of work: one at a time per actor, so an idle labeler takes
        # the next block instead of it queueing behind a busy one
        compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
        num_cpus=num_cpus,
        num_gpus=num_gpus or None,
    )
    # writing a block's labels is I/O: a small CPU share lets the write tasks run beside labelers
    # that fill their nodes
    ds.write_parquet(out_path, filesystem=fs, ray_remote_args={"num_cpus": WRITE_CPUS})
    elapsed = time.time() - t0
    workers = _take_stats(stats_dir)
    table = pq.ParquetDataset(out_path, filesystem=fs).read(columns=["seq", "regime"])
    meta = {
        "label_version": LABEL_VERSION,
        "feature_spec": SPEC.to_dict(),
        "replay": dataclasses.asdict(config),
        "model_depth": config.model_depth(),
        "traces_dir": traces,
        "rows": table.num_rows,
        "traces": len(set(table.column("seq").to_pylist())),
        "rows_by_regime": {r: table.column("regime").to_pylist().count(r) for r in ("cold", "agent", "repeat")},
        "elapsed_s": round(elapsed, 2),
        "workers": sorted(workers, key=lambda w: (w["node"], -w["traces"])),
    }
    storage.write_text(storage.join(out, META_FILE), json.dumps(meta, indent=1))
    return meta


def _take_stats(stats_dir: str) -> list[dict]:
    """The labelers' counters in ``stats_dir`` (one file each), removing the folder."""
    fs, path = storage.resolve(stats_dir)
    out = []
    for f in storage.files(stats_dir, "*.json"):
        with fs.open_input_stream(f) as fh:
            out.append(json.loads(fh.read()))
    if storage.is_dir(stats_dir):
        fs.delete_dir(path)
    return out
