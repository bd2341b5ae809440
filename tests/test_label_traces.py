"""Trace replay labels (hvd_ray/traces/replay.py, labeler.py) against brute force, on
traces written from real engine generations of a tiny random Llama (fp32), and online-vs-offline
equality of the features φ_t."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import make_tiny

from hvd_ray.drafters.base import Draft, DraftRequest
from hvd_ray.drafters.eagle3 import Eagle3Drafter
from hvd_ray.drafters.layerskip import LayerSkipDrafter, parse_skip
from hvd_ray.drafters.suffix import SuffixConfig, SuffixDrafter
from hvd_ray.engine import Engine, SamplingParams
from hvd_ray.model.eagle3_head import Eagle3Head
from hvd_ray.model.transformer import Transformer
from hvd_ray.selection.features import VocabFlags
from hvd_ray.selection.policy import ScoreRule
from hvd_ray.traces.labeler import label_traces_local, label_traces_ray
from hvd_ray.traces.labels import LABEL_SCHEMA
from hvd_ray.traces.model_labels import model_drafter_labels
from hvd_ray.traces.records import read_trace_table, traces_from_table
from hvd_ray.traces.replay import GlobalReplay, budgets_for, longest_match, replay_trace
from hvd_ray.traces.schema import TRACE_SCHEMA

MAX_NEW = 40
SKIP = "attn:1-2"  # the tiny model has 4 layers
DEPTH = 4
MIN_PROB = 0.0  # random tiny models are unsure of everything: no confidence stop


def write_traces(folder: Path, prompts, outputs, max_tokens: int, seqs=None, splits=None, finish=None) -> Path:
    """A TRACE_SCHEMA parquet folder for (prompt, output) pairs."""
    n = len(prompts)
    seqs = list(range(n)) if seqs is None else list(seqs)
    rows = dict(
        prompt_id=[f"p{s}" for s in seqs],
        workload=["synthetic"] * n,
        split=list(splits) if splits is not None else ["train"] * n,
        seq=seqs,
        prompt_tokens=[list(p) for p in prompts],
        output_tokens=[list(o) for o in outputs],
        finish_reason=list(finish) if finish is not None else ["length"] * n,
        model_id=["tiny"] * n,
        model_revision=["test"] * n,
        backend=["hvd_ray"] * n,
        decoding=[json.dumps({"max_tokens": max_tokens, "temperature": 0.0, "dtype": "float32"})] * n,
        prefill_s=[0.0] * n,
        decode_s=[0.0] * n,
        created_at=[None] * n,
        topk_ids=[None] * n,
        topk_logprobs=[None] * n,
    )
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pydict(rows, schema=TRACE_SCHEMA), folder / "part-0.parquet")
    return folder


def tiny_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts sharing structure (a common head and tail), so outputs and suffixes repeat."""
    rng = np.random.default_rng(seed)
    head, tail = rng.integers(3, 320, 24).tolist(), rng.integers(3, 320, 8).tolist()
    out = [head + rng.integers(3, 320, 6).tolist() + tail for _ in range(n)]
    out[3] = list(out[1])  # a repeated prompt: its output is in the global tree of later traces
    return out


@functools.cache
def tiny_setup() -> dict:
    """One tiny model, its traces (plain greedy) and the default tokenizer, shared by the tests."""
    from hvd_ray.model.registry import resolve

    root = Path(tempfile.mkdtemp(prefix="hvd-label-"))
    atexit.register(shutil.rmtree, root, True)
    folder = make_tiny("llama", root / "tiny", initializer_range=0.1, max_position_embeddings=1024)
    model = Transformer.from_pretrained(folder, dtype=torch.float32)
    prompts = tiny_prompts(6)
    reqs = Engine(model, max_batch=1, max_len=512).generate(
        prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    )
    outputs = [r.output for r in reqs]
    traces = write_traces(
        root / "traces", prompts, outputs, MAX_NEW, splits=["train", "train", "test", "train", "validation", "test"]
    )
    return {
        "root": root,
        "folder": folder,
        "model": model,
        "prompts": prompts,
        "outputs": outputs,
        "traces": traces,
        "tokenizer": str(resolve("default")),
    }


def replay_config(s: dict, **kw) -> dict:
    base = dict(
        model=str(s["folder"]),
        tokenizer=s["tokenizer"],
        dtype="float32",
        model_drafter="layerskip",
        skip=SKIP,
        depth=DEPTH,
        min_prob=MIN_PROB,
        max_draft=16,
        batch_slots=4,
        threads=1,
    )
    base.update(kw)
    return base


@functools.cache
def tiny_labels() -> pa.Table:
    s = tiny_setup()
    return label_traces_local(str(s["traces"]), replay_config(s))


@pytest.fixture(scope="module")
def setup():
    return tiny_setup()


# ---------------------------------------------------------------------------------------------
def test_longest_match_chain_and_tree():
    out = [5, 6, 7, 8]
    assert longest_match(Draft.chain([6, 7, 9]), out, 1) == 2
    assert longest_match(Draft.chain([6, 7, 8, 9]), out, 1) == 3  # cut at the trace's end
    assert longest_match(Draft(), out, 0) == 0
    # tree: 6 -> (9 | 7 -> 8)
    tree = Draft([6, 9, 7, 8], [-1, 0, 0, 2], [1.0] * 4)
    assert longest_match(tree, out, 1) == 3


def brute_cache_draft(config: SuffixConfig, history, prompt, output, t, budget, rid="me"):
    """A fresh drafter driven through its public API: earlier requests begin/accept/end, then this
    one up to position t."""
    d = SuffixDrafter(config)
    for i, (p, o) in enumerate(history):
        d.begin(f"h{i}", p)
        d.accept(f"h{i}", o)
        d.end(f"h{i}")
    d.begin(rid, prompt)
    d.accept(rid, output[:t])
    return d.speculate(rid, budget)


def test_cache_labels_equal_brute_force(setup):
    """Every position of every trace: the replayed cache draft and its label equal a fresh drafter
    fed the earlier traces in arrival order, with a small global bound (evictions happen)."""
    s = setup
    cfg = SuffixConfig(max_cached_requests=3)
    table = read_trace_table(s["traces"])
    traces = traces_from_table(table)
    hist = table.to_pydict()
    gr = GlobalReplay(list(zip(hist["seq"], hist["output_tokens"])), cfg)
    flags = VocabFlags.from_decode(lambda i: chr(32 + i % 90), 320)
    hits = {"suffix-global": 0, "suffix-request": 0}
    for k, tr in enumerate(traces):
        drafts = {}
        cols = replay_trace(tr, gr.drafter_before(tr.seq), flags, max_draft=16, drafts=drafts)
        gr.done(tr.seq)
        budgets = budgets_for(tr, 16)
        earlier = [(traces[j].prompt, traces[j].output) for j in range(k)]
        for t, y in zip(cols["t"], cols["y_cache"]):
            ref = brute_cache_draft(cfg, earlier, tr.prompt, tr.output, t, int(budgets[t]))
            got = drafts.get(t, Draft())  # budget 0: nothing drafted
            assert (got.token_ids, got.source, got.match_len) == (ref.token_ids, ref.source, ref.match_len), (k, t)
            assert got.score == pytest.approx(ref.score)
            brute_y = 0
            while (
                brute_y < len(ref.token_ids)
                and t + brute_y < len(tr.output)
                and ref.token_ids[brute_y] == tr.output[t + brute_y]
            ):
                brute_y += 1
            assert y == brute_y
            if ref.token_ids:
                hits[ref.source] += 1
    assert hits["suffix-global"] > 0 and hits["suffix-request"] > 0


def test_global_tree_holds_only_earlier_traces(setup, tmp_path):
    """The repeated prompt's trace sees its twin's output only when the twin came first."""
    s = setup
    prompts, outputs = s["prompts"], s["outputs"]
    assert prompts[1] == prompts[3] and outputs[1] == outputs[3]
    cfg = SuffixConfig()
    gr = GlobalReplay([(i, o) for i, o in enumerate(outputs)], cfg)
    for seq in range(len(outputs)):
        assert gr.drafter_before(seq).cached_requests == [f"seq-{j}" for j in range(seq)]
    # bounded: only the last max_cached_requests - 1 earlier outputs (the live request takes a slot)
    gr = GlobalReplay([(i, o) for i, o in enumerate(outputs)], SuffixConfig(max_cached_requests=2))
    assert gr.drafter_before(5).cached_requests == ["seq-3", "seq-4"]
    assert gr.drafter_before(2).cached_requests == ["seq-0", "seq-1"]  # going back rebuilds
    assert gr.rebuilds == 2

    # arrival order: prompts[3] (seq 3) comes after its twin prompts[1] and drafts from its output
    d = tiny_labels().to_pydict()
    twin = [i for i, q in enumerate(d["seq"]) if q == 3]
    assert sum(d["cache_source"][i] == "suffix-global" for i in twin) > len(twin) // 2
    assert sum(d["y_cache"][i] for i in twin) > len(twin)
    # reversed arrival (prompts[i] gets seq 5 - i): prompts[3] (seq 2) now precedes its twin (seq 4)
    folder = write_traces(tmp_path / "rev", prompts, outputs, MAX_NEW, seqs=[5 - i for i in range(6)])
    r = label_traces_local(str(folder), replay_config(s, model_drafter="none")).to_pydict()
    tr = traces_from_table(read_trace_table(folder))[2]
    assert tr.prompt == prompts[3]
    b = budgets_for(tr, 16)
    earlier = [(prompts[5], outputs[5]), (prompts[4], outputs[4])]
    rows = [i for i, q in enumerate(r["seq"]) if q == 2]
    for i in rows:
        t = r["t"][i]
        ref = brute_cache_draft(cfg, earlier, tr.prompt, tr.output, t, int(b[t]))
        assert (r["cache_len"][i], r["cache_score"][i]) == (len(ref), pytest.approx(ref.score))
    late = [i for i, q in enumerate(r["seq"]) if q == 4]
    assert sum(r["y_cache"][i] for i in late) > sum(r["y_cache"][i] for i in rows)


@pytest.mark.parametrize("kind", ["layerskip", "eagle3", "eagle3-tree"])
def test_model_labels_equal_brute_force(setup, kind):
    """Teacher-forced batched drafts == drafting each position from a fresh engine-like state."""
    s = setup
    model = Transformer.from_pretrained(s["folder"], dtype=torch.float32)
    if kind == "layerskip":
        drafter = LayerSkipDrafter(model, parse_skip(SKIP), depth=DEPTH, min_prob=MIN_PROB)
    else:
        head = Eagle3Head.from_target(model, draft_vocab_size=200, seed=3, dtype=torch.float32)
        drafter = Eagle3Drafter(
            model, head, tree=kind.endswith("tree"), depth=3, top_k=3, max_nodes=8, slots=4, max_len=512
        )
    tr = traces_from_table(read_trace_table(s["traces"]))[2]
    budgets = budgets_for(tr, 6)
    y, lens, drafts = model_drafter_labels(drafter, tr.prompt, tr.output, budgets, batch=4, return_drafts=True)
    seq = tr.prompt + tr.output
    model.setup_cache(4, 512)
    agree = 0
    for t in range(1, len(tr.output)):
        L = len(tr.prompt) + t
        model.cache.truncate(0, 0)
        out = model(torch.tensor([seq[: L - 1]]), [0], taps=tuple(sorted(set(drafter.needs_taps))), last_only=True)
        if kind != "layerskip":
            drafter.begin("r", seq[: L - 1], 0)
            taps = torch.cat([out.taps[sorted(set(drafter.needs_taps)).index(i)][0] for i in drafter.needs_taps], -1)
            drafter.observe_target("r", seq[1:L], taps)
        ref = drafter.propose([DraftRequest("r", 0, seq[:L], int(budgets[t]))])[0]
        if kind != "layerskip":
            drafter.end("r")
        got = drafts.get(t, Draft())  # budget 0: nothing drafted
        assert (got.token_ids, got.parents) == (ref.token_ids, ref.parents), t
        assert lens[t] == len(ref)
        assert y[t] == longest_match(ref, tr.output, t)
        agree += y[t] > 0
    if kind == "layerskip":
        assert agree > 0  # the slim view agrees with the target somewhere


def test_labels_schema_and_columns(setup):
    lab = tiny_labels()
    assert lab.schema.remove_metadata() == LABEL_SCHEMA
    d = lab.to_pydict()
    traces = traces_from_table(read_trace_table(setup["traces"]))
    assert lab.num_rows == sum(len(tr.output) - 1 for tr in traces)
    for i in range(lab.num_rows):
        assert d["remaining"][i] == MAX_NEW - d["t"][i]
        assert 0 <= d["y_cache"][i] <= d["cache_len"][i] and 0 <= d["y_model"][i] <= d["model_len"][i] <= DEPTH
        assert d["budget"][i] == min(16, MAX_NEW - d["t"][i] - 1)
        assert (d["sim_cache"][i] is None) == (not d["step_start"][i])
    assert any(d["y_model"]) and any(d["y_cache"])
    assert {d["split"][i] for i in range(lab.num_rows)} == {"train", "test", "validation"}


def test_repeat_regime_labels_a_second_pass_and_leaves_the_cold_ones_alone(setup):
    """--repeat: each trace again, right after, as its own request with its own first answer in the
    global tree (a retry); the cold rows, and so every later trace's history, stay what they were."""
    s = setup
    cold = tiny_labels()
    both = label_traces_local(str(s["traces"]), replay_config(s, repeat=True))
    d = both.to_pydict()
    reg = np.asarray(d["regime"])
    assert set(reg) == {"cold", "repeat"} and (reg == "repeat").sum() == (reg == "cold").sum() == cold.num_rows
    keep = [c for c in cold.column_names]
    assert both.filter(pa.compute.equal(both.column("regime"), "cold")).select(keep).equals(cold.select(keep))
    rep = both.filter(pa.compute.equal(both.column("regime"), "repeat")).to_pydict()
    # the global tree's copy of the first answer drafts, and its drafts are mostly taken whole (the tiny
    # model's outputs loop, so a context can continue in more than one way); cold: 27% global, y 4.7
    n = len(rep["y_cache"])
    assert sum(src == "suffix-global" for src in rep["cache_source"]) >= 0.9 * n
    assert sum(y == L for y, L in zip(rep["y_cache"], rep["cache_len"])) >= 0.75 * n
    assert sum(rep["y_cache"]) > 1.5 * sum(cold.column("y_cache").to_pylist())
    assert rep["y_model"] == cold.column("y_model").to_pylist()  # teacher-forced: the same drafts


class LoggingPolicy(ScoreRule):
    """ScoreRule that records the φ it computed online at every step."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: dict[tuple[str, int], np.ndarray] = {}

    def decide(self, view):
        out = super().decide(view)
        self._last = view
        return out

    def __call__(self, req, engine):
        choice = super().__call__(req, engine)
        self.log[(req.req_id, len(req.output))] = self._last.phi
        return choice


def test_features_online_equal_offline(setup):
    """Serve the prompts with a ScoreRule policy (suffix + layer-skip drafters, batch 1 in arrival
    order); replay the resulting traces with the same rule: the step starts coincide with the
    engine's steps, φ_t is bit-identical there, and the accepted lengths agree."""
    s = setup
    model = Transformer.from_pretrained(s["folder"], dtype=torch.float32)
    suffix = SuffixDrafter()
    layerskip = LayerSkipDrafter(model, parse_skip(SKIP), depth=DEPTH, min_prob=MIN_PROB)
    from transformers import AutoTokenizer

    flags = VocabFlags.from_tokenizer(AutoTokenizer.from_pretrained(s["tokenizer"]), model.cfg.vocab_size)
    policy = LoggingPolicy(suffix, layerskip, flags, tau=1.0)
    engine = Engine(model, drafters=[suffix, layerskip], policy=policy, max_batch=1, max_len=512, num_draft_tokens=16)
    reqs = engine.generate(s["prompts"], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [r.output for r in reqs] == s["outputs"]  # lossless
    sources = {st.source for r in reqs for st in r.stats.steps}
    assert {"layerskip"} < sources and sources & {"suffix-request", "suffix-global"}

    lab = label_traces_local(str(s["traces"]), replay_config(s, sim_tau=1.0))
    d = lab.to_pydict()
    phi = np.asarray(d["phi"], np.float32)
    for k, r in enumerate(reqs):
        rows = {d["t"][i]: i for i in range(lab.num_rows) if d["seq"][i] == k}
        starts = sorted(t for t, i in rows.items() if d["step_start"][i])
        online_t = sorted(t for (rid, t) in policy.log if rid == r.req_id)
        assert starts == online_t, k
        for t in online_t:
            np.testing.assert_array_equal(phi[rows[t]], policy.log[(r.req_id, t)])
        acc = [st.accepted for st in r.stats.steps]
        replay_acc = [(d["y_cache"][rows[t]] if d["sim_cache"][rows[t]] else d["y_model"][rows[t]]) for t in starts]
        assert acc == replay_acc


def test_label_traces_job_with_ray(setup, tmp_path, monkeypatch):
    """The Ray Data labelling of jobs/label_traces.py (local Ray, 2 CPUs, fractional actors) == in-process."""
    import ray

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    s = setup
    out = tmp_path / "labels"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        meta = label_traces_ray(s["traces"], out, replay_config(s), chunk=2, actors=2, num_cpus=0.5)
    finally:
        ray.shutdown()
    assert meta["traces"] == 6 and json.loads((out / "_labels_meta.json").read_text())["rows"] == meta["rows"]
    got = pq.ParquetDataset(str(out)).read().sort_by([("seq", "ascending"), ("t", "ascending")])
    ref = tiny_labels().sort_by([("seq", "ascending"), ("t", "ascending")])
    assert got.num_rows == ref.num_rows
    for name in LABEL_SCHEMA.names:
        assert got.column(name).to_pylist() == ref.column(name).to_pylist(), name
