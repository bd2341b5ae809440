"""jobs/collect_traces.py and hvd_ray.traces: revision hash, writer, resume plan, top-k, and
the job end to end on a real local Ray (direct ``python`` and ``ray job submit``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hvd_ray.traces import TRACE_SCHEMA, CollectError, TraceWriter, model_revision, read_traces
from hvd_ray.traces.generators import HvdRayGenerator, VllmGenerator, check_backend
from hvd_ray.traces.prompts import load_prompts
from hvd_ray.traces.resume import plan

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "collect_traces.py"
BIN = Path(sys.executable).parent
DECODING = {
    "temperature": 0.0,
    "max_tokens": 8,
    "dtype": "float32",
    "chat_template": True,
    "topk_logprobs": 0,
    "eos_token_ids": [2],
}


def trace_row(pid: str, seq: int, **over) -> dict:
    row = {
        "prompt_id": pid,
        "workload": "chat",
        "split": "test",
        "seq": seq,
        "prompt_tokens": [1, 2, 3],
        "output_tokens": [4, 5],
        "finish_reason": "length",
        "model_id": "m",
        "model_revision": "rev",
        "backend": "hvd_ray",
        "decoding": json.dumps({**DECODING, "device": "cpu"}),
        "prefill_s": 0.1,
        "decode_s": 0.2,
        "created_at": None,
        "topk_ids": None,
        "topk_logprobs": None,
    }
    return {**row, **over}


def input_row(pid: str, seq: int) -> dict:
    return {"prompt_id": pid, "workload": "chat", "split": "test", "seq": seq, "prompt_tokens": [1, 2, 3]}


# ------------------------------------------------------------------------------- library units


def test_model_revision_is_content_hash_and_cached(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HVD_RAY_CACHE", str(tmp_path / "cache"))
    rev = model_revision(tiny_llama)
    assert len(rev) == 64 and model_revision(tiny_llama) == rev
    assert list((tmp_path / "cache" / "revisions").glob("*.json"))  # cached
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    assert model_revision(copy) == rev  # content, not path
    weights = next(Path(copy).glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_revision(copy) != rev  # the stat key changed, so it re-hashed


def test_writer_parts_are_atomic_locked_and_read_sorted(tmp_path):
    out = tmp_path / "traces"
    with TraceWriter(out, rows_per_file=2) as w:
        assert w.add([trace_row("c", 2), trace_row("a", 0)]) is not None  # full part: written
        assert w.add([trace_row("b", 1)]) is None  # buffered
        with pytest.raises(CollectError, match="another collection"):
            TraceWriter(out)
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) == 2 and all(pq.read_schema(p).equals(TRACE_SCHEMA) for p in parts)
    # a crash mid-write leaves a temp file: readers ignore it, the next writer removes it
    (out / ".part-dead.parquet.tmp").write_bytes(b"PAR1 truncated")
    t = read_traces(out)
    assert t.schema.equals(TRACE_SCHEMA)
    assert t.column("prompt_id").to_pylist() == ["a", "b", "c"] and t.column("seq").to_pylist() == [0, 1, 2]
    assert read_traces(out, ["seq", "prompt_id"]).column_names == ["prompt_id", "seq"]
    w2 = TraceWriter(out)
    assert w2.removed_temps == [".part-dead.parquet.tmp"] and not list(out.glob("*.tmp"))
    w2.close()
    (tmp_path / "empty").mkdir()
    assert read_traces(tmp_path / "empty").schema.equals(TRACE_SCHEMA) and read_traces(tmp_path / "empty").num_rows == 0
    with pytest.raises(FileNotFoundError):
        read_traces(tmp_path / "missing")


def test_plan_resumes_and_refuses_to_mix_collections(tmp_path):
    out = tmp_path / "t"
    with TraceWriter(out) as w:
        w.add([trace_row("p1", 1), trace_row("p3", 3)])
    rows = [input_row(f"p{i}", i) for i in range(5)]
    p = plan(rows, out, model_revision="rev", backend="hvd_ray", decoding={**DECODING, "device": "cuda"})
    assert [r["prompt_id"] for r in p.todo] == ["p0", "p2", "p4"] and p.done == 2 and p.existing == 2
    p = plan(rows, out, model_revision="rev", backend="hvd_ray", decoding=DECODING, max_prompt_tokens=2)
    assert p.todo == [] and p.too_long == ["p0", "p2", "p4"]
    ok = dict(model_revision="rev", backend="hvd_ray", decoding=DECODING)
    with pytest.raises(CollectError, match="revision"):
        plan(rows, out, **{**ok, "model_revision": "other"})
    with pytest.raises(CollectError, match="backend"):
        plan(rows, out, **{**ok, "backend": "vllm"})
    with pytest.raises(CollectError, match="max_tokens"):
        plan(rows, out, **{**ok, "decoding": {**DECODING, "max_tokens": 9}})
    with pytest.raises(CollectError, match="seq"):  # same prompt, other position: another prompt list
        plan([input_row("p3", 0)], out, **ok)
    with pytest.raises(CollectError, match="seq 1 belongs"):  # another prompt at a used position
        plan([input_row("x", 1)], out, **ok)
    assert plan(rows, tmp_path / "new", **ok).todo == rows


def test_teacher_forced_topk_matches_a_full_forward(tiny_llama):
    import torch

    gen = HvdRayGenerator(str(tiny_llama), "float32", "cpu", max_batch=3, topk=4, eos_token_ids=[])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 7, 12, 5)]
    gens = gen.generate(prompts, max_tokens=6)
    assert all(len(x.output_tokens) == 6 and x.finish_reason == "length" for x in gens)
    outputs = [x.output_tokens for x in gens]
    outputs[3] = []  # an empty output has no positions
    chunked = gen.teacher_forced_topk(prompts, outputs, chunk=2)  # 4 rows > 3 slots, several chunks
    model = gen.model
    for p, o, x, (ids, lps) in zip(prompts, outputs, gens, chunked):
        assert len(ids) == len(lps) == len(o) and all(len(r) == 4 for r in ids)
        if not o:
            continue
        model.cache.truncate(0, 0)
        logits = model(torch.tensor([p + o]), [0]).logits[0, len(p) - 1 : len(p) + len(o) - 1]
        ref_v, ref_i = torch.log_softmax(logits.float(), -1).topk(4, -1)
        assert torch.allclose(torch.tensor(lps), ref_v, atol=1e-4)
        assert [r[0] for r in ids] == o == ref_i[:, 0].tolist()  # greedy: top-1 is the output token
        assert all(r == sorted(r, reverse=True) for r in lps)
        assert [r[0] for r in x.topk_ids] == o  # generate() filled them too


def test_vllm_backend_fails_clearly_when_missing():
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is installed here")
    except ImportError:
        pass
    with pytest.raises(CollectError, match="pip install 'hvd-ray\\[vllm\\]'"):
        VllmGenerator("/nonexistent", "bfloat16", "cpu", max_batch=2)


def test_job_refuses_vllm_backend_without_vllm(tmp_path):
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is installed here")
    except ImportError:
        pass
    with pytest.raises(CollectError, match="pip install 'hvd-ray\\[vllm\\]'"):
        check_backend("vllm")
    check_backend("vllm", vllm_python="/some/python")  # a vLLM interpreter of its own is enough
    r = subprocess.run(
        [sys.executable, str(JOB), "--workload", "code", "--backend", "vllm", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "pip install 'hvd-ray[vllm]'" in r.stderr
    assert not (tmp_path / "o").exists()


def test_user_prompt_file_input(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": f"u{i}", "prompt": f"Say {i}."}) + "\n" for i in range(5)))
    assert [p.id for p in load_prompts(prompts_file=str(f), limit=3)] == ["u0", "u1", "u2"]
    with pytest.raises(ValueError):
        load_prompts("code", str(f))
    r = subprocess.run(
        [sys.executable, str(JOB), "--workload", "code", "--prompts", str(f), "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


# --------------------------------------------------------------------------- end to end (Ray)


def _env() -> dict:
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("RAY_ADDRESS", None)  # the direct run must start its own Ray, never join another one
    return env


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _group_alive(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@contextmanager
def ray_head():
    """A private head node (own ports, own temp dir, own process group) torn down by process group:
    never `ray stop`, which would stop every Ray instance on the machine."""
    port, dash, client, agent = _free_ports(4)
    temp_dir = tempfile.mkdtemp(prefix="hvdrt", dir="/tmp")  # short: Unix socket paths are limited
    cmd = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--port",
        str(port),
        "--dashboard-port",
        str(dash),
        "--ray-client-server-port",
        str(client),
        "--dashboard-agent-listen-port",
        str(agent),
        "--num-cpus",
        "2",
        "--include-dashboard",
        "true",
        "--temp-dir",
        temp_dir,
        "--disable-usage-stats",
    ]
    proc = subprocess.Popen(
        cmd, env=_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    pgid = proc.pid  # setsid: every daemon `ray start` spawns stays in this process group
    try:
        log, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, log
        yield f"http://127.0.0.1:{dash}"
    finally:
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):  # gcs/raylet ignore SIGTERM
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        shutil.rmtree(temp_dir, ignore_errors=True)


def _run(cmd: list[str], timeout: float = 300) -> str:
    r = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    return out


def _summary(out: str) -> dict:
    line = [ln for ln in out.splitlines() if "collect_traces: summary " in ln][-1]
    return json.loads(line.split("collect_traces: summary ", 1)[1])


@pytest.mark.slow
def test_collect_direct_then_resumed_by_ray_job_submit(tmp_path, default_folder):
    t0 = time.monotonic()

    def tick(what: str) -> None:  # phase times, shown with -s
        print(f"[{time.monotonic() - t0:5.1f}s] {what}", flush=True)

    out = tmp_path / "traces"
    common = [
        "--workload",
        "code",
        "--split",
        "test",
        "--out",
        str(out),
        "--max-tokens",
        "8",
        "--dtype",
        "float32",
        "--topk-logprobs",
        "5",
        "--batch-size",
        "2",
        "--rows-per-file",
        "2",
    ]

    # 1. direct: starts its own local Ray; 3 prompts, one per engine batch and per part file
    s = _summary(_run([sys.executable, str(JOB), *common, "--limit", "3", "--batch-size", "1", "--rows-per-file", "1"]))
    assert s["new"] == 3 and s["skipped_done"] == 0 and s["parts"] >= 2 and s["output_tokens"] > 0
    tick("direct run")
    first = read_traces(out)
    assert first.num_rows == 3 and first.column("seq").to_pylist() == [0, 1, 2]

    # 2. simulate a crash: the part holding seq 0 never got renamed, its temp file is left over
    for part in out.glob("part-*.parquet"):
        if 0 in pq.read_table(part, columns=["seq"]).column("seq").to_pylist():
            part.rename(out / ".part-crashed.parquet.tmp")
    kept = read_traces(out)
    assert 1 <= kept.num_rows < 3 and 0 not in kept.column("seq").to_pylist()

    # 3. resume with N + M prompts through `ray job submit` on a private head node
    with ray_head() as address:
        tick("head started")
        log = _run(
            [
                str(BIN / "ray"),
                "job",
                "submit",
                "--address",
                address,
                "--working-dir",
                str(ROOT),
                "--runtime-env-json",
                json.dumps({"excludes": [".venv", ".git", ".hypothesis", ".pytest_cache"]}),
                "--",
                "python",
                "jobs/collect_traces.py",
                *common,
                "--limit",
                "6",
            ],
            timeout=400,
        )
        tick("job done")
    tick("head stopped")
    assert "joined" in log and "succeeded" in log, log[-3000:]
    s = _summary(log)
    assert s["new"] == 6 - kept.num_rows and s["skipped_done"] == kept.num_rows and s["traces_in_out"] == 6
    assert not list(out.glob("*.tmp"))

    traces = read_traces(out)
    assert traces.schema.equals(TRACE_SCHEMA)
    assert all(pq.read_schema(p).equals(TRACE_SCHEMA) for p in out.glob("part-*.parquet"))
    rows = traces.to_pylist()
    assert [r["seq"] for r in rows] == list(range(6)) and len({r["prompt_id"] for r in rows}) == 6
    assert [r for r in rows if r["seq"] in kept.column("seq").to_pylist()] == kept.to_pylist()  # untouched
    assert [r["output_tokens"] for r in rows[:3]] == first.column("output_tokens").to_pylist()  # redone identically
    for r in rows:
        assert r["workload"] == "code" and r["split"] == "test" and r["backend"] == "hvd_ray"
        assert r["model_id"] == default_folder.name and r["model_revision"] == model_revision(default_folder)
        d = json.loads(r["decoding"])
        assert d["temperature"] == 0.0 and d["max_tokens"] == 8 and d["dtype"] == "float32" and d["topk_logprobs"] == 5
        assert r["finish_reason"] in ("stop", "length") and r["prefill_s"] > 0 and r["created_at"] is not None
        ids, lps = r["topk_ids"], r["topk_logprobs"]
        assert len(ids) == len(lps) == len(r["output_tokens"]) and all(len(x) == 5 for x in ids + lps)
        assert [x[0] for x in ids] == r["output_tokens"]  # greedy: top-1 is the emitted token
        assert all(x == sorted(x, reverse=True) and x[0] <= 0 for x in lps)

    # 4. the traces are exactly what our engine produces for these prompts (fp32, greedy)
    import torch
    from transformers import AutoTokenizer

    from hvd_ray.engine import Engine, SamplingParams
    from hvd_ray.model import Transformer
    from hvd_ray.workloads import load_workload, render

    tok = AutoTokenizer.from_pretrained(default_folder)
    prompts = load_workload("code", split="test", limit=6)
    assert [p.id for p in prompts] == [r["prompt_id"] for r in rows]
    model = Transformer.from_pretrained(default_folder, dtype=torch.float32)
    engine = Engine(model, max_batch=1, max_len=1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 threads on a busy 2-core box collapse (docs/design.md)
    try:
        for p, r in zip(prompts, rows):
            ids = tok(render(p, tok), add_special_tokens=False)["input_ids"]
            assert ids == r["prompt_tokens"]
            req = engine.generate([ids], SamplingParams(max_tokens=8))[0]
            assert req.output == r["output_tokens"] and req.finish_reason == r["finish_reason"], p.id
    finally:
        torch.set_num_threads(threads)

    tick("engine reference")
    # 5. nothing left to do: no Ray, no new files
    before = sorted(out.glob("part-*.parquet"))
    out5 = _run([sys.executable, str(JOB), *common, "--limit", "6"])
    s = _summary(out5)
    assert s["new"] == 0 and s["skipped_done"] == 6 and "Ray instance" not in out5
    assert sorted(out.glob("part-*.parquet")) == before
    tick("no-op run")

    # 6. agent turns: each traced prompt again as a second turn (its answer, then a follow-up), after the
    # first turns in arrival order and in the same split; the first turn's prompt is a prefix of it
    s = _summary(_run([sys.executable, str(JOB), *common, "--limit", "6", "--second-turns"]))
    assert s["new"] == 6 and s["skipped_done"] == 6
    rows2 = read_traces(out).to_pylist()
    assert [r["seq"] for r in rows2] == list(range(12))
    for r1, r2 in zip(rows2[:6], rows2[6:]):
        assert r2["prompt_id"] == r1["prompt_id"] + "/again" and r2["split"] == r1["split"] == "test"
        assert r2["prompt_tokens"][: len(r1["prompt_tokens"])] == r1["prompt_tokens"]
        text = tok.decode(r2["prompt_tokens"])
        assert tok.decode(r1["output_tokens"], skip_special_tokens=True).strip() in text
        assert "whole function again" in text  # the code workload's follow-up
    tick("second turns")
