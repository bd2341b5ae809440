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
            out = ref.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.eos_token_id,
                min_new_tokens=24,
            )
        assert ours == out[0, len(ids) :].tolist()


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
    want = Engine(model, max_batch=1).generate(
        [tok(prompt)["input_ids"]], SamplingParams(max_tokens=12, ignore_eos=False)
    )[0]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hvd_ray",
            "generate",
            "--prompt",
            prompt,
            "--max-tokens",
            "12",
            "--dtype",
            "float32",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == tok.decode(want.output, skip_special_tokens=True)
    assert "tok/s" in out.stderr and "target forwards per 1k tokens" in out.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "hvd_ray", "generate", "--prompt", "x", "--model", "/nonexistent"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bad.returncode == 2 and "neither a known name" in bad.stderr


# ------------------------------------------------------------------- incremental text and stop strings
_MIXED = (
    "héllo wörld — ok 😀😀 🎉🎉🎉 世界你好，这是一个测试。日本語のテキスト 한국어 텍스트 👨‍👩‍👧‍👦 🏳️‍🌈\n"
    "def f(x):\n    if x:\n        return '✓'  # 🚀\n\treturn None\n\n\nclass A:\n    pass\n"
)


class _CountingTok:
    """A tokenizer that counts what passes through ``decode``."""

    def __init__(self, tok):
        self.tok, self.calls, self.ids, self.chars = tok, 0, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        text = self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        self.calls, self.ids, self.chars = self.calls + 1, self.ids + len(ids), self.chars + len(text)
        return text


def _chunks(ids: list[int], rng, most: int) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, most)
        out.append(ids[i : i + k])
        i += k
    return out


def test_text_streamer_equals_decode_on_multibyte_text(default_folder):
    """Pushed one token at a time or in chunks, with special tokens, cut mid-character or at a stop
    string: the pieces concatenate to ``decode`` (cut at the earliest stop), and every prefix streamed
    is a prefix of it (no unfinished character, no part of a stop string leaks)."""
    import random

    from transformers import AutoTokenizer

    from hvd_ray.engine.text import StopScanner

    tok = AutoTokenizer.from_pretrained(default_folder)
    specials = tok.all_special_ids
    base = tok(_MIXED, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    for trial in range(120):
        ids = list(base)
        for _ in range(rng.randint(0, 4)):
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        ids = ids[: rng.randint(1, len(ids))]
        want = tok.decode(ids, skip_special_tokens=True)
        a = rng.randrange(len(want))
        stops = [want[a : a + rng.randint(1, 40)], "never in the text"] if trial % 2 else []
        if any("\ufffd" in s for s in stops):
            stops = []
        cut = trim_at_stop(want, stops)
        chunks = _chunks(ids, rng, 1 if trial % 3 == 0 else 7)
        s, got, pushed = TextStreamer(tok, stops), "", 0
        for c in chunks:
            got += s.push(c)
            pushed += 1
            assert (cut if cut is not None else want).startswith(got)
            if s.stopped:
                break
        if not s.stopped:
            got += s.flush()
        assert s.stopped == (cut is not None) and got == (want if cut is None else cut)
        if stops:  # the engine's stop scan fires at the same push
            scan = StopScanner(lambda t: tok.decode(t, skip_special_tokens=True), stops)
            fired = next((k + 1 for k, c in enumerate(chunks) if scan.push(c)), None)
            assert fired == (pushed if s.stopped else None)


def test_text_streamer_decodes_o_of_new_tokens(default_folder):
    """2,000 pushes decode a bounded window each, not the whole output: linear, not quadratic, work."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_folder)
    ids = tok(_MIXED * 40, add_special_tokens=False)["input_ids"][:2000]
    want = tok.decode(ids, skip_special_tokens=True)
    stops = ["x" * 256, "\n\n\n\n", "return 1"]
    for most in (1, 8):
        counting = _CountingTok(tok)
        s = TextStreamer(counting, stops)
        pushes = _chunks(ids, random.Random(most), most)
        assert most > 1 or len(pushes) == 2000
        got = "".join(s.push(c) for c in pushes) + s.flush()
        assert got == want and not s.stopped
        assert counting.calls < 3 * len(pushes)
        assert counting.ids < 20 * len(ids) and counting.chars < 20 * len(want)  # all of it each time: ~1000x


@pytest.mark.slow
def test_engine_finds_a_long_stop_string(fp32_default):
    """A 200-character stop string spanning many steps ends the request where its text ends."""
    from hvd_ray.drafters.suffix import SuffixDrafter

    model, tok = fp32_default
    detok = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    prompt = real_prompts(tok, n_per=1)[1]  # chat: prose
    params = dict(max_tokens=64, ignore_eos=True)
    engine = Engine(model, max_batch=1, max_len=1024, eos_token_ids=[tok.eos_token_id], detokenize=detok)
    plain = engine.generate([prompt], SamplingParams(**params))[0].output
    text = detok(plain)
    stop = text[len(text) // 2 - 100 : len(text) // 2 + 100]
    assert len(stop) == 200 and "\ufffd" not in stop
    end = next(k for k in range(len(plain) + 1) if stop in detok(plain[:k]))  # the token the stop ends in
    r = engine.generate([prompt], SamplingParams(**params, stop=[stop]))[0]
    assert r.finish_reason == "stop" and r.output == plain[:end]  # one token a step: not one past
    # a speculative step emits several tokens; the stop string is found in the step it ends in
    cached = Engine(
        model, drafters=[SuffixDrafter()], max_batch=1, max_len=1024, eos_token_ids=[tok.eos_token_id], detokenize=detok
    )
    cached.generate([prompt], SamplingParams(**params))  # now the suffix cache drafts this output
    r = cached.generate([prompt], SamplingParams(**params, stop=[stop]))[0]
    assert r.finish_reason == "stop" and r.output == plain[: len(r.output)]
    assert end <= len(r.output) <= end + r.stats.steps[-1].accepted
