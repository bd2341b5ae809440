"""Self-written chat prompts (hvd_ray.workloads.self_chat, jobs/generate_prompts.py) with the real model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hvd_ray.workloads import load_user_prompts
from hvd_ray.workloads.self_chat import clean_query, dedup_key, user_turn_prefix

ROOT = Path(__file__).resolve().parent.parent


def _job():
    spec = importlib.util.spec_from_file_location("generate_prompts", ROOT / "jobs" / "generate_prompts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_prefix_stops_where_a_user_message_starts(default_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_folder)
    prefix = user_turn_prefix(tok)
    assert prefix.endswith("<|im_start|>user\n")
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False)
    assert rendered.startswith(prefix + "hi there")


def test_unusable_samples_are_dropped():
    assert (
        clean_query("  How do I sort a list of tuples by the second item?  ")
        == "How do I sort a list of tuples by the second item?"
    )
    assert clean_query("Hi there") is None  # too short
    assert clean_query("What is 2+2?<|im_end|> <|im_start|>assistant") is None  # ran past its turn
    assert clean_query(" ".join(["word"] * 200)) is None  # too long
    assert dedup_key("Hello,  World!") == dedup_key("hello world")


def test_generation_writes_usable_prompts_and_resumes(tmp_path):
    job = _job()
    out = tmp_path / "self-chat.jsonl"
    assert job.main(["--out", str(out), "--count", "5", "--batch-size", "8", "--max-tokens", "64"]) == 0
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(first) == 5
    # A second run with a larger --count appends new samples after the last one drawn, never repeating.
    assert job.main(["--out", str(out), "--count", "9", "--batch-size", "8", "--max-tokens", "64"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[:5] == first and len(rows) == 9
    assert min(r["sample"] for r in rows[5:]) > max(r["sample"] for r in first)
    assert len({dedup_key(r["prompt"]) for r in rows}) == 9
    prompts = load_user_prompts(out)  # the file is a valid user prompt file for collect_traces
    assert [p.id for p in prompts] == [r["id"] for r in rows]
    assert all(p.workload == "chat" and p.messages[-1]["role"] == "user" for p in prompts)
    assert all(clean_query(p.messages[-1]["content"]) == p.messages[-1]["content"] for p in prompts)


def test_openers_steer_each_sample_in_turn(tmp_path):
    out = tmp_path / "steered.jsonl"
    assert (
        _job().main(
            [
                "--out",
                str(out),
                "--count",
                "4",
                "--batch-size",
                "8",
                "--max-tokens",
                "64",
                "--openers",
                "Imagine you are",
                "Solve",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        opener = ("Imagine you are", "Solve")[r["sample"] % 2]
        assert r["opener"] == opener and r["prompt"].startswith(opener + " ")
        assert r["id"] == f"self_chat/{dedup_key(opener).replace(' ', '-')}/{r['sample']}"


def test_bad_arguments_are_refused(tmp_path):
    for bad in (["--count", "0"], ["--openers", "Solve", " "]):
        with pytest.raises(SystemExit):
            _job().main(["--out", str(tmp_path / "x.jsonl"), *bad])
