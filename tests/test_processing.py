"""Processed and constrained decoding stay exact under speculation: a grammar (xgrammar) cuts the
draft nodes it refuses and masks every verified position, penalties / ``logit_bias`` / ``min_tokens``
/ ``min_p`` judge each node by its own path, and logprobs are the target's, draft or not."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny

from hvd_ray.build import EngineSpec, build_engine
from hvd_ray.drafters.base import Draft
from hvd_ray.drafters.layerskip import LayerSkipDrafter
from hvd_ray.drafters.suffix import SuffixDrafter
from hvd_ray.engine import Engine, SamplingParams
from hvd_ray.engine.grammar import Grammars
from hvd_ray.model.transformer import Transformer


@pytest.fixture(scope="module")
def tok(target):
    return target[1]


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(tok, 49152, [tok.eos_token_id])


def _ids(tok, messages) -> list[int]:
    return tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)[
        "input_ids"
    ]


def test_a_grammar_cuts_refused_draft_nodes_with_their_subtrees(tok, grammars):
    """A tree whose branches the schema partly refuses: refused nodes go with their subtrees, the
    rest keep their order and parents, and each kept row's mask is the one the matcher gives after
    that node's path (the matcher ends where it started)."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    c = grammars.constraint({"type": "json_schema", "schema": schema})
    good = tok.encode('{"n": 12}', add_special_tokens=False)
    bad = tok.encode("hello", add_special_tokens=False)
    # node 0..k-1: the good chain; then a refused root branch with a child; then a refused child of node 0
    k = len(good)
    tokens = good + [bad[0], good[1], bad[0]]
    parents = list(range(-1, k - 1)) + [-1, k, 0]
    d, bits = c.prune(Draft(tokens, parents))
    assert d.token_ids == good and d.parents == list(range(-1, k - 1))
    assert bits.shape[0] == k + 1
    fresh = xgr.GrammarMatcher(grammars.compile({"type": "json_schema", "schema": schema}))
    want = xgr.allocate_token_bitmask(1, 49152)
    for row in range(k + 1):
        fresh.fill_next_token_bitmask(want, 0)
        assert torch.equal(bits[row], want[0]), row
        if row < k:
            assert fresh.accept_token(good[row])
    c.advance(good)  # the walk left the matcher at the context: the whole chain is still acceptable


def test_constrained_greedy_hvd_equals_constrained_plain_on_bfcl_schemas(target, tok):
    """fp32 greedy with ``json_schema`` over 20 BFCL function schemas: every output parses and
    validates, and HVD's tokens equal constrained decoding without speculation."""
    import jsonschema

    from hvd_ray.workloads.structured import bfcl_schema_tasks

    tasks = bfcl_schema_tasks(20)
    prompts = [_ids(tok, t["messages"]) for t in tasks]
    params = [
        SamplingParams(max_tokens=96, temperature=0.0, structure={"type": "json_schema", "schema": t["schema"]})
        for t in tasks
    ]
    outs = {}
    for drafter in ("none", "hvd"):
        engine = build_engine(EngineSpec(drafter=drafter, max_batch=4, max_len=1024), target[0], tok)
        outs[drafter] = engine.generate(prompts, params)
    for t, plain, hvd in zip(tasks, outs["none"], outs["hvd"]):
        assert hvd.output == plain.output, t["id"]
        assert plain.finish_reason == "stop", t["id"]
        jsonschema.validate(json.loads(tok.decode(plain.output, skip_special_tokens=True)), t["schema"])
    steps = [s for r in outs["hvd"] for s in r.stats.steps]
    assert sum(s.accepted for s in steps) > 50  # drafts were really verified under the grammar
    assert sum(r.stats.target_forwards for r in outs["hvd"]) < sum(r.stats.target_forwards for r in outs["none"])


def test_logprobs_under_hvd_equal_plain_decodings(target, tok, prompts):
    """The emitted tokens' log-probabilities (and top 3) under HVD equal plain decoding's to 1e-4 (fp32)."""
    got = {}
    for drafter in ("none", "hvd"):
        engine = build_engine(EngineSpec(drafter=drafter, max_batch=4, max_len=1024), target[0], tok)
        reqs = [engine.add_request(p, SamplingParams(max_tokens=24, temperature=0.0, logprobs=3)) for p in prompts[:4]]
        lps = {r.req_id: [] for r in reqs}
        while engine.has_unfinished():
            for out in engine.step():
                if out.logprobs is not None:
                    assert len(out.logprobs) == len(out.new_tokens)
                    lps[out.req_id] += out.logprobs
        got[drafter] = [(r.output, lps[r.req_id]) for r in reqs]
        if drafter == "hvd":
            assert any(s.accepted for r in reqs for s in r.stats.steps)
    for (out_a, lp_a), (out_b, lp_b) in zip(got["none"], got["hvd"]):
        assert out_a == out_b and len(lp_a) == len(out_a)
        for (a, top_a), (b, top_b), tok_id in zip(lp_a, lp_b, out_a):
            assert abs(a - b) < 1e-4
            assert [t for t, _ in top_a][:1] == [tok_id]  # greedy: the emitted token is the top one
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
            assert max(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b)) < 1e-4


# ------------------------------------------------------------------------------- sampling, exactly
PARAMS = dict(
    temperature=1.0,
    presence_penalty=0.7,
    frequency_penalty=0.4,
    repetition_penalty=1.3,
    min_p=0.05,
    logit_bias={3: 2.0, 5: -1.5},
    min_tokens=2,
    stop_token_ids=[7],
)


def _reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: dict, eos: list[int]) -> torch.Tensor:
    """The processed distribution written out plainly (vLLM's order): bias, min_tokens (EOS and the
    stop ids), repetition, frequency, presence, temperature, min_p."""
    x = logits.double().clone()
    for t, b in p["logit_bias"].items():
        x[t] += b
    if len(output) < p["min_tokens"]:
        x[p["stop_token_ids"] + eos] = float("-inf")
    for t in set(prompt) | set(output):
        x[t] = x[t] / p["repetition_penalty"] if x[t] > 0 else x[t] * p["repetition_penalty"]
    for t in set(output):
        x[t] -= p["frequency_penalty"] * output.count(t) + p["presence_penalty"]
    probs = (x / p["temperature"]).softmax(-1)
    probs[probs < p["min_p"] * probs.max()] = 0
    return (probs / probs.sum()).float()


@pytest.mark.parametrize("seeded", [True, False])
def test_processed_sampling_under_speculation_gives_the_processed_distribution(tmp_path, seeded):
    """Chi-square on the 2nd emitted token: speculative sampling with penalties, ``min_p``,
    ``logit_bias`` and ``min_tokens`` against the exact processed marginal, computed independently
    (``_reference``) from the target's logits; seeded requests (Gumbel-max keyed by position) and
    unseeded ones (rejection sampling)."""
    from conftest import second_token_marginal, second_token_pvalue

    folder = make_tiny("llama", tmp_path / "m", vocab_size=12, seed=5)
    model = Transformer.from_pretrained(folder, dtype=torch.float32)
    model.setup_cache(8, 64)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    V, eos = model.cfg.vocab_size, list(model.cfg.eos_token_ids)
    with torch.no_grad():
        model.cache.truncate(0, 0)
        p1 = _reference(model(torch.tensor([prompt]), [0]).logits[0, -1], prompt, [], PARAMS, eos)
        exact = torch.zeros(V)
        for a in range(V):
            if p1[a] > 0:
                model.cache.truncate(0, 0)
                row = model(torch.tensor([prompt + [a]]), [0]).logits[0, -1]
                exact += p1[a] * _reference(row, prompt, [a], PARAMS, eos)
    assert exact[7] == 0 and (exact > 0).sum() >= 4  # min_tokens and min_p bite, enough bins stay
    unprocessed = second_token_marginal(model, prompt, 1.0)  # the negative control's reference
    # a cache drafter (fixed tokens, trees) for one path, a model drafter (sampled chains) for the other
    drafter = SuffixDrafter() if seeded else LayerSkipDrafter(model, [(1, "attn"), (2, "mlp")], min_prob=0.0)
    engine = Engine(model, drafters=[drafter], max_batch=8, max_len=64, num_draft_tokens=4)
    n = 3000
    reqs = engine.generate(
        [prompt] * n,
        [SamplingParams(max_tokens=3, seed=s if seeded else None, ignore_eos=True, **PARAMS) for s in range(n)],
    )
    assert sum(s.accepted for r in reqs for s in r.stats.steps) > 100  # drafts were really accepted
    pvalue, obs = second_token_pvalue(reqs, exact)
    assert pvalue > 1e-3, (drafter.name, obs, (exact * n).tolist())
    assert obs[7] == 0
    assert second_token_pvalue(reqs, unprocessed)[0] < 1e-6  # the processing made a difference


def test_the_grammar_drafts_the_text_it_forces(tok, grammars):
    """A chain draft ending where the schema forces the next key is continued by that key's tokens
    (within the room given); a draft the grammar refuses, or no forced text, leaves it as it is."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    }
    c = grammars.constraint({"type": "json_schema", "schema": schema})
    empty = c.extend(Draft(), 16)
    assert tok.decode(empty.token_ids) == '{"city": "' and empty.source == "grammar"  # the value is a string
    head = tok.encode('{"city": "Paris",', add_special_tokens=False)
    d = c.extend(Draft.chain(head, source="suffix"), 16)
    assert d.source == "suffix+grammar" and d.token_ids[: len(head)] == head
    assert tok.decode(d.token_ids[len(head) :]).strip() == '"days":'
    assert len(c.extend(Draft.chain(head, source="suffix"), len(head) + 1)) == len(head) + 1  # the room caps it
    bad = Draft.chain(tok.encode("hello", add_special_tokens=False))
    assert c.extend(bad, 16) is bad
    assert c.prune(d)[0].token_ids == d.token_ids  # what it drafts, the grammar accepts


def test_each_node_of_a_tree_is_processed_with_its_own_path():
    """``Processing.apply`` on a tree draft: row j equals the reference processing of the output so
    far plus the draft tokens on node j's path (penalties count them, ``min_tokens`` knows the depth)."""
    from hvd_ray.engine.processing import Processing

    torch.manual_seed(0)
    prompt, output = [1, 2, 3], [4, 4]
    params = SamplingParams(max_tokens=8, **{**PARAMS, "min_tokens": 4, "min_p": 0.0})
    proc = Processing(params, prompt, 12, [0], None)
    proc.advance(output)
    draft = Draft([5, 4, 7, 5, 9], [-1, 0, 1, -1, 3])  # two branches: 5 4 7 and 5 9
    logits = torch.randn(len(draft) + 1, 12)
    got = proc.apply(logits, proc.prepare(draft))
    paths = [[], [5], [5, 4], [5, 4, 7], [5], [5, 9]]
    for j, path in enumerate(paths):
        want = _reference(logits[j], prompt, output + path, {**PARAMS, "min_tokens": 4, "min_p": 0.0}, [0])
        assert torch.allclose(got[j].softmax(-1), want, atol=1e-6), j


def test_a_seeded_request_samples_the_same_tokens_with_and_without_speculation(target, tok, prompts):
    """Seeded sampling (T 0.8, top-p 0.95, a penalty) draws each output position from (seed, position):
    HVD emits exactly plain decoding's tokens (fp32), and another seed other tokens."""
    params = [
        SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, presence_penalty=0.3, seed=7 + i) for i in range(4)
    ]
    outs = {}
    for drafter in ("none", "hvd"):
        engine = build_engine(EngineSpec(drafter=drafter, max_batch=4, max_len=1024), target[0], tok)
        reqs = engine.generate(prompts[:4], params)
        outs[drafter] = [r.output for r in reqs]
        if drafter == "hvd":
            assert sum(s.accepted for r in reqs for s in r.stats.steps) > 10
    assert outs["hvd"] == outs["none"]
    engine = build_engine(EngineSpec(drafter="none", max_batch=4, max_len=1024), target[0], tok)
    other = engine.generate(prompts[:4], [SamplingParams(**{**vars(p), "seed": p.seed + 100}) for p in params])
    assert [r.output for r in other] != outs["none"]
