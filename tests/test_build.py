"""hvd_ray/build.py: one EngineSpec for every command (argparse, the serving config, TP ranks) and
build_engine, the only library code that builds an Engine with drafters, a policy or a slim tier."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from hvd_ray.build import EngineSpec, add_spec_arguments, build_engine, spec_from_args
from hvd_ray.engine import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def test_spec_round_trips_through_argparse():
    ap = argparse.ArgumentParser()
    add_spec_arguments(ap)
    assert spec_from_args(ap.parse_args([])) == EngineSpec()
    argv = [
        "--drafter",
        "hvd",
        "--policy",
        "tau",
        "--model-drafter",
        "layerskip",
        "--predictor",
        "p",
        "--eagle3-head",
        "h",
        "--draft-model",
        "d",
        "--layerskip",
        "attn:3",
        "--slim",
        "default",
        "--slim-mode",
        "tiered",
        "--num-draft-tokens",
        "4",
        "--cache-draft-tokens",
        "32",
        "--max-batch",
        "2",
        "--max-len",
        "300",
        "--suffix-history",
        "traces",
    ]
    want = EngineSpec(
        drafter="hvd",
        policy="tau",
        model_drafter="layerskip",
        predictor="p",
        eagle3_head="h",
        draft_model="d",
        layerskip="attn:3",
        slim="default",
        slim_mode="tiered",
        num_draft_tokens=4,
        cache_draft_tokens=32,
        max_batch=2,
        max_len=300,
        suffix_history="traces",
    )
    assert spec_from_args(ap.parse_args(argv)) == want
    assert {f.name for f in dataclasses.fields(EngineSpec)} == set(vars(ap.parse_args([])))  # every field rendered
    assert all(f.metadata["help"] for f in dataclasses.fields(EngineSpec))
    with pytest.raises(SystemExit):
        ap.parse_args(["--slim-mode", "sometimes"])

    # a command's subset, own defaults and fixed values (the CLI's batch 1 and prompt-sized context)
    ap = argparse.ArgumentParser()
    add_spec_arguments(ap, only=("drafter", "num_draft_tokens"), defaults={"num_draft_tokens": 16})
    args = ap.parse_args(["--drafter", "suffix"])
    assert vars(args) == {"drafter": "suffix", "num_draft_tokens": 16}
    assert spec_from_args(args, max_batch=1) == EngineSpec(drafter="suffix", num_draft_tokens=16, max_batch=1)

    from hvd_ray.cli import _add_generate

    ap = argparse.ArgumentParser()
    _add_generate(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(["generate", "--prompt", "x", "--drafter", "suffix", "--suffix-history", "t"])
    assert spec_from_args(args, max_batch=1, max_len=99) == EngineSpec(
        drafter="suffix", num_draft_tokens=16, cache_draft_tokens=64, max_batch=1, max_len=99, suffix_history="t"
    )


def test_serving_config_maps_to_the_spec():
    from hvd_ray.serving.config import ServingConfig

    cfg = ServingConfig(
        drafter="hvd",
        policy="always-cache",
        model_drafter="layerskip",
        predictor="p",
        draft_model="d",
        layerskip="attn:3",
        slim="default",
        slim_mode="tiered",
        num_draft_tokens=5,
        cache_draft_tokens=40,
        max_batch=3,
        max_model_len=512,
        max_tokens=100,
        suffix_history="traces",
    )
    assert cfg.engine_spec() == EngineSpec(
        drafter="hvd",
        policy="always-cache",
        model_drafter="layerskip",
        predictor="p",
        draft_model="d",
        layerskip="attn:3",
        slim="default",
        slim_mode="tiered",
        num_draft_tokens=5,
        cache_draft_tokens=40,
        max_batch=3,
        max_len=512,
        suffix_history="traces",
        reuse_slots=4,
    )  # serving keeps 4 slots of K/V
    for cfg in (ServingConfig(), ServingConfig(drafter="eagle3", eagle3_head="h")):  # every field, same name
        spec = cfg.engine_spec()
        for f in dataclasses.fields(EngineSpec):
            assert getattr(spec, f.name) == getattr(cfg, "max_model_len" if f.name == "max_len" else f.name), f.name
    for f in dataclasses.fields(EngineSpec):  # declared once: the config's help is the spec's
        name = "max_model_len" if f.name == "max_len" else f.name
        assert ServingConfig.model_fields[name].description == f.metadata["help"], name


def test_serving_threads_leave_a_core_to_serve(monkeypatch):
    """By default a replica runs torch on all cores but one: on 2 cores, 2 threads stall whenever Serve's
    proxy, the ingress or a client runs (benchmarks/http_concurrency.md: 1 thread was faster there)."""
    import os

    from hvd_ray.serving.config import ServingConfig

    for cores, default in ((1, 1), (2, 1), (16, 15)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert ServingConfig().threads() == default
        assert ServingConfig(torch_threads=4).threads() == min(4, cores)  # asked for: capped by the cores


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from hvd_ray.model.transformer import Transformer

    return Transformer.from_pretrained(tiny_llama, dtype=torch.float32)


def test_build_engine_plain_suffix_and_slim_on_a_tiny_model(tiny):
    from hvd_ray.drafters.suffix import SuffixDrafter
    from hvd_ray.verification.tiered import SlimTier

    prompt, params = [5, 17, 33, 2, 91, 7, 5, 17], SamplingParams(max_tokens=12, ignore_eos=True)
    plain = build_engine(EngineSpec(max_batch=2, max_len=10**6), tiny, None)  # weights only: no tokenizer
    assert plain.drafters == [] and plain.policy is None and plain.slim is None
    assert plain.num_draft_tokens == 0 and plain.max_len == tiny.cfg.max_position  # capped by the model
    want = plain.generate([prompt], params)[0].output
    eng = build_engine(EngineSpec(drafter="suffix", num_draft_tokens=6, max_len=128), tiny, None)
    assert [type(d) for d in eng.drafters] == [SuffixDrafter] and eng.num_draft_tokens == 6
    assert eng.cache_draft_tokens == 64 and eng.detokenize is None
    assert eng.generate([prompt], params)[0].output == want
    eng = build_engine(EngineSpec(drafter="layerskip", layerskip="attn:2", slim="attn:1-2", max_len=128), tiny, None)
    assert (
        isinstance(eng.slim, SlimTier) and eng.slim.mode == "lossless" and eng.slim.mask == [(1, "attn"), (2, "attn")]
    )
    assert eng.drafters[0].skip == [(2, "attn")]
    assert eng.generate([prompt], params)[0].output == want  # lossless: the target still verifies everything


def test_build_engine_rejects_bad_input(tiny):
    from hvd_ray.drafters.suffix import SuffixDrafter

    for spec, match in (
        (EngineSpec(drafter="magic"), "unknown drafter"),
        (EngineSpec(drafter="hvd", policy="coin-flip"), "unknown policy"),
        (EngineSpec(slim="attn:0"), "layer 0"),
        (EngineSpec(slim="attn:9"), "invalid slim-verifier"),
        (EngineSpec(slim="default", slim_mode="sometimes"), "slim mode|mask"),
        (EngineSpec(drafter="layerskip", suffix_history="anywhere"), "needs a suffix drafter"),
    ):
        with pytest.raises(ValueError, match=match):
            build_engine(dataclasses.replace(spec, max_len=64), tiny, None)
    with pytest.raises(ValueError, match="suffix cache goes with"):
        build_engine(EngineSpec(drafter="layerskip", max_len=64), tiny, None, suffix_cache=SuffixDrafter())
    with pytest.raises(ValueError, match="needs its drafters"):
        build_engine(EngineSpec(max_len=64), tiny, None, policy=object())


def test_build_engine_hvd_on_the_default_model(target):
    """HVD (the shipped predictor + EAGLE-3 head, cost policy) and a slim tier: lossless in fp32."""
    from hvd_ray.drafters.eagle3 import Eagle3Drafter
    from hvd_ray.drafters.suffix import SuffixDrafter
    from hvd_ray.selection.cost_policy import CostPolicy

    model, tok = target
    ids = tok("def add(a, b):")["input_ids"]
    params = SamplingParams(max_tokens=12)
    want = build_engine(EngineSpec(max_batch=1, max_len=128), model, tok).generate([ids], params)[0].output
    eng = build_engine(EngineSpec(drafter="hvd", slim="default", max_batch=1, max_len=128), model, tok)
    assert [type(d) for d in eng.drafters] == [SuffixDrafter, Eagle3Drafter] and isinstance(eng.policy, CostPolicy)
    assert eng.policy.cache is eng.drafters[0] and eng.slim is not None and eng.eos >= {tok.eos_token_id}
    assert eng.drafters[0].config.max_spec_offset > 0  # the cost policy's cache drafts reach past the match
    assert eng.generate([ids], params)[0].output == want


def test_only_build_constructs_a_speculative_engine():
    """``Engine(...)`` with drafters, a policy or a slim tier appears in hvd_ray/build.py alone."""
    found = []
    for path in sorted([*(ROOT / "hvd_ray").rglob("*.py"), *(ROOT / "jobs").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Engine":
                if {k.arg for k in node.keywords} & {"drafters", "policy", "slim", None}:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(found) == 1 and found[0].startswith("hvd_ray/build.py:"), found
