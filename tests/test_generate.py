"""Generation with the own engine: greedy equals transformers, batching, sampling params, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hvd_ray.engine import Engine, SamplingParams, TextStreamer, trim_at_stop
from hvd_ray.model import load
from hvd_ray.model.transformer import Transformer
from hvd_ray.workloads import load_workload, render


@pytest.fixture(scope="module")
def fp32_default(default_folder):
    return load(str(default_folder), "float32")


def real_prompts(tok, n_per: int = 2) -> list[list[int]]:
    prompts = []
    for w in ("code", "chat", "function_calling"):
        for p in load_workload(w, split="test", limit=n_per):
            prompts.append(tok(render(p, tok), add_special_tokens=False)["input_ids"])
    return prompts


@pytest.mark.slow
def test_greedy_matches_transformers_on_real_prompts(fp32_default, default_folder):
    from transformers import AutoModelForCausalLM

    model, tok = fp32_default
    ref = AutoModelForCausalLM.from_pretrained(default_folder, dtype=torch.float32).eval()
    prompts = real_prompts(tok)
    assert len(prompts) >= 5
    engine = Engine(model, max_batch=1, max_len=2048, eos_token_ids=[tok.eos_token_id])
    for ids in prompts:
        ours = engine.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True))[0].output
        with torch.no_grad():
            # explicit attention mask: the chat template contains the pad id, which HF would mask out
            out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=tok.eos_token_id, min_new_tokens=24)
        assert ours == out[0, len(ids):].tolist()


@pytest.mark.slow
def test_batched_generation_equals_one_at_a_time(fp32_default):
    model, tok = fp32_default
    prompts = real_prompts(tok, n_per=1) + [tok("def add(a, b):")["input_ids"]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    alone = [Engine(model, max_batch=1).generate([p], params)[0].output for p in prompts]
    batched = Engine(model, max_batch=4).generate(prompts, params)
    assert [r.output for r in batched] == alone


def test_sampling_params_and_stops(tiny_llama):
    model = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    engine = Engine(model, max_batch=2, max_len=256)
    prompt = list(range(3, 20))
    greedy = engine.generate([prompt], SamplingParams(max_tokens=20))[0]
    assert len(greedy.output) == 20 and greedy.finish_reason == "length"
    # top_k = 1 sampling is greedy; a seed replays exactly; different seeds differ
    topk1 = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.8, top_k=1, seed=1))[0]
    assert topk1.output == greedy.output
    a, b, c = engine.generate([prompt] * 3, [SamplingParams(max_tokens=20, temperature=1.5, seed=s) for s in (7, 7, 8)])
    assert a.output == b.output and a.output != c.output
    # a stop token ends the request without being emitted
    stop_tok = greedy.output[5]
    first = greedy.output.index(stop_tok)
    r = engine.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop_tok]))[0]
    assert r.output == greedy.output[:first] and r.finish_reason == "stop"
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="exceeds the context"):
        engine.add_request(prompt, SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):  # a tokenizer's output (a dict) instead of its ids
        engine.add_request({"input_ids": prompt, "attention_mask": [1] * len(prompt)}, SamplingParams())
    with pytest.raises(ValueError, match=r"must be in \[0, "):
        engine.add_request(prompt + [model.cfg.vocab_size], SamplingParams())
    assert engine.add_request(torch.tensor(prompt), SamplingParams()).prompt == prompt  # a tensor row works


def test_abort_frees_the_slot(tiny_llama):
    model = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    engine = Engine(model, max_batch=1, max_len=128)
    r1 = engine.add_request([5, 6, 7], SamplingParams(max_tokens=50))
    r2 = engine.add_request([8, 9], SamplingParams(max_tokens=3))
    engine.step()
    engine.abort(r1.req_id)
    while engine.has_unfinished():
        engine.step()
    assert r1.finish_reason == "abort" and len(r1.output) < 50
    assert r2.finish_reason == "length" and len(r2.output) == 3


def test_text_helpers(default_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_folder)
    ids = tok("héllo wörld — ok")["input_ids"]
    s = TextStreamer(tok)
    text = "".join(s.push([i]) for i in ids) + s.flush()
    assert text == tok.decode(ids)
    assert trim_at_stop("abc STOP def", ["STOP", "def"]) == "abc "
    assert trim_at_stop("abc", ["x"]) is None


@pytest.mark.slow
def test_cli_generate_matches_engine(fp32_default):
    model, tok = fp32_default
    prompt = "The three primary colors are"
    want = Engine(model, max_batch=1).generate([tok(prompt)["input_ids"]],
                                               SamplingParams(max_tokens=12, ignore_eos=False))[0]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "hvd_ray", "generate", "--prompt", prompt, "--max-tokens", "12",
                          "--dtype", "float32", "--threads", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == tok.decode(want.output, skip_special_tokens=True)
    assert "tok/s" in out.stderr and "target forwards per 1k tokens" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "hvd_ray", "generate", "--prompt", "x", "--model", "/nonexistent"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "neither a known name" in bad.stderr
