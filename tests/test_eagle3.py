"""EAGLE-3 head and drafter on a tiny random target with randomly initialised heads (fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny
from safetensors import safe_open

from hvd_ray.drafters.base import DraftRequest
from hvd_ray.drafters.eagle3 import Eagle3Drafter
from hvd_ray.model.eagle3_checkpoint import ARCHITECTURE, Eagle3Config, default_aux_layer_ids, taps_for
from hvd_ray.model.eagle3_head import Eagle3Head
from hvd_ray.model.transformer import Transformer
from hvd_ray.verification import check_parents

torch.set_num_threads(1)
N_LAYERS = 8  # vLLM aux ids (2, 4, 5) -> our taps (1, 3, 4): three distinct layers
VOCAB = 320


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("eagle3_target"), num_hidden_layers=N_LAYERS)


@pytest.fixture(scope="module")
def target(target_folder):
    model = Transformer.from_pretrained(target_folder, dtype=torch.float32)
    model.setup_cache(4, 160)
    return model


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(target, drafter, req_id, prompt, slot):
    """What the engine does at prefill: target forward with taps, then begin + observe_target."""
    target.cache.truncate(slot, 0)
    out = target(torch.tensor([prompt]), [slot], taps=drafter.needs_taps)
    first = int(out.logits[0, -1].argmax())
    drafter.begin(req_id, prompt, slot)
    drafter.observe_target(req_id, prompt[1:] + [first], torch.cat(out.taps, -1)[0])
    return prompt + [first]


def verify_step(target, drafter, req_id, tokens, slot, accepted):
    """One decode step: the target scores [pending] + accepted, commits them, the head observes."""
    out = target(torch.tensor([[tokens[-1]] + accepted]), [slot], taps=drafter.needs_taps)
    bonus = int(out.logits[0, -1].argmax())
    drafter.observe_target(req_id, accepted + [bonus], torch.cat(out.taps, -1)[0])
    drafter.accept(req_id, accepted + [bonus])
    return tokens + accepted + [bonus]


def ask(req_id, slot, tokens, n=8):
    return DraftRequest(req_id, slot, tokens, n)


def head_snapshot(head, slot, n):
    return head.cache.k[0][slot, :, :n].clone(), head.cache.v[0][slot, :, :n].clone()


# ------------------------------------------------------------------------------------- layout
def test_checkpoint_layout_matches_vllm_eagle3(target, tmp_path):
    ids = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:100].tolist())
    head = Eagle3Head.from_target(target, ids, seed=1)
    head.save(tmp_path)
    H, nh, kvh, hd, inter = 64, 4, 2, 16, 128
    expected = {  # vllm/model_executor/models/llama_eagle3.py's load_weights input names
        "fc.weight": ([H, 3 * H], torch.float32),
        "midlayer.input_layernorm.weight": ([H], torch.float32),
        "midlayer.hidden_norm.weight": ([H], torch.float32),
        "midlayer.post_attention_layernorm.weight": ([H], torch.float32),
        "midlayer.self_attn.q_proj.weight": ([nh * hd, 2 * H], torch.float32),
        "midlayer.self_attn.k_proj.weight": ([kvh * hd, 2 * H], torch.float32),
        "midlayer.self_attn.v_proj.weight": ([kvh * hd, 2 * H], torch.float32),
        "midlayer.self_attn.o_proj.weight": ([H, nh * hd], torch.float32),
        "midlayer.mlp.gate_proj.weight": ([inter, H], torch.float32),
        "midlayer.mlp.up_proj.weight": ([inter, H], torch.float32),
        "midlayer.mlp.down_proj.weight": ([H, inter], torch.float32),
        "norm.weight": ([H], torch.float32),
        "lm_head.weight": ([100, H], torch.float32),
        "d2t": ([100], torch.int64),
        "t2d": ([VOCAB], torch.bool),
    }
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        got = {k: (list(f.get_tensor(k).shape), f.get_tensor(k).dtype) for k in f.keys()}
    assert got == expected  # in particular: no embed_tokens (shared with the target)

    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 100 and cfg["vocab_size"] == VOCAB
    assert cfg["target_hidden_size"] == H and cfg["hidden_size"] == H
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, N_LAYERS // 2, N_LAYERS - 3]
    assert cfg["tie_word_embeddings"] is False
    for key in (
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
    ):
        assert key in cfg
    from transformers import LlamaConfig  # the config is a valid HF Llama config, as vLLM reads it

    hf = LlamaConfig.from_pretrained(tmp_path)
    assert hf.hidden_size == H and hf.num_hidden_layers == 1 and hf.draft_vocab_size == 100


def test_tap_layers_follow_vllm_aux_ids(target, target_folder):
    assert default_aux_layer_ids(30) == (2, 15, 27) and taps_for((2, 15, 27)) == (1, 14, 26)
    head = Eagle3Head.from_target(target, draft_vocab_size=64)
    assert head.cfg.aux_layer_ids == (2, 4, 5)
    assert Eagle3Drafter(target, head).needs_taps == (1, 3, 4)
    # vLLM's aux id j is the residual stream entering layer j: HF's hidden_states[j].
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        hs = ref(ids, output_hidden_states=True).hidden_states
    target.cache.truncate(0, 0)
    out = target(ids, [0], taps=(1, 3, 4))
    for tap, j in zip(out.taps, (2, 4, 5)):
        assert torch.allclose(tap, hs[j], atol=1e-4)


def test_save_load_round_trip_gives_identical_outputs(target, tmp_path):
    head = Eagle3Head.from_target(target, draft_vocab_size=200, seed=7)
    head.save(tmp_path)
    loaded = Eagle3Head.load(tmp_path, target)
    assert loaded.cfg == head.cfg
    for (k, a), (k2, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and a.dtype == b.dtype and torch.equal(a, b)
    prompt = prompt_ids(20, 1)
    drafts = []
    for h in (head, loaded):
        for tree in (False, True):
            d = Eagle3Drafter(target, h, tree=tree, top_k=3, depth=4, max_nodes=12)
            toks = prefill(target, d, "r", prompt, 0)
            drafts.append(d.propose([ask("r", 0, toks, 12)])[0])
            d.end("r")
    assert drafts[0] == drafts[2] and drafts[1] == drafts[3]
    with pytest.raises(ValueError, match="does not fit the target"):
        cfg = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "target_hidden_size": 32}))
        Eagle3Head.load(tmp_path, target)


def test_d2t_t2d_map_the_draft_vocab_into_the_target_vocab(target):
    ids = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:40].tolist())
    head = Eagle3Head.from_target(target, list(reversed(ids)) + ids[:3], seed=2)  # order, dupes ignored
    assert head.cfg.draft_vocab_size == 40
    assert (torch.arange(40) + head.d2t).tolist() == ids
    assert head.to_target_ids(torch.arange(40)).tolist() == ids
    assert head.t2d.nonzero().flatten().tolist() == ids and int(head.t2d.sum()) == 40
    first = Eagle3Head.from_target(target, draft_vocab_size=16)
    assert first.d2t.tolist() == [0] * 16 and first.t2d.nonzero().flatten().tolist() == list(range(16))
    for tree in (False, True):
        d = Eagle3Drafter(target, head, tree=tree, top_k=4, depth=4, max_nodes=20)
        toks = prefill(target, d, "r", prompt_ids(12, 2), 1)
        draft = d.propose([ask("r", 1, toks, 20)])[0]
        assert len(draft) > 0 and all(head.t2d[t] for t in draft.token_ids)
        d.end("r")


def test_a_warm_started_head_decodes_the_targets_high_tap(target):
    """``warm_start``: before any training the head is the target's own output layer (restricted to
    the draft vocabulary) over its highest tap, whatever the token and the other taps say."""
    ids = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(6))[:50].tolist())
    head = Eagle3Head.from_target(target, ids, seed=3, warm_start=True)
    assert torch.equal(head.lm_head.weight, target.output.weight[torch.tensor(ids)])
    H = target.cfg.dim
    taps = torch.randn(1, 7, 3 * H, generator=torch.Generator().manual_seed(7))
    tokens = torch.tensor([prompt_ids(7, 8)])
    logits = head.teacher_forward(tokens, taps)
    expected = target.norm(taps[..., 2 * H :]) @ target.output.weight[torch.tensor(ids)].T
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    cold = Eagle3Head.from_target(target, ids, seed=3)
    assert not torch.allclose(cold.teacher_forward(tokens, taps), expected, atol=1e-2)


# ----------------------------------------------------------------------------------- drafting
def test_chain_drafting_incrementally_equals_recomputing(target):
    head = Eagle3Head.from_target(target, draft_vocab_size=256, seed=3)
    inc = Eagle3Drafter(target, head, depth=5)
    prompt = prompt_ids(24, 4)
    toks = prefill(target, inc, "a", prompt, 0)
    n0 = inc.committed("a")
    assert n0 == len(toks) - 1 == target.cache.lengths[0]
    d1 = inc.propose([ask("a", 0, toks)])[0]  # the head catches up on the prompt, then drafts
    assert len(d1) == 5 and d1.is_chain and d1.source == "eagle3"
    assert all(0 < p <= 1 for p in d1.probs)
    assert inc.committed("a") == n0  # drafting rolled itself back
    snap = head_snapshot(head, 0, n0)
    assert inc.propose([ask("a", 0, toks)])[0].token_ids == d1.token_ids  # drafting again: same draft
    assert all(torch.equal(a, b) for a, b in zip(snap, head_snapshot(head, 0, n0)))  # committed rows kept
    assert d1.probs == pytest.approx(inc.score_path("a", d1.token_ids), abs=1e-5)

    history = [d1]
    for accepted in (d1.token_ids[:2], []):  # two verify steps: 2 accepted, then none
        toks = verify_step(target, inc, "a", toks, 0, accepted)
        assert inc.committed("a") == len(toks) - 1 == target.cache.lengths[0]
        history.append(inc.propose([ask("a", 0, toks)])[0])

    # From scratch: a fresh head cache that observes the same committed sequence in one go.
    fresh = Eagle3Drafter(target, head, depth=5)
    head.cache = None
    assert prefill(target, fresh, "b", toks[:-1], 2) == toks
    target.cache.truncate(2, 0)
    want = fresh.propose([ask("b", 2, toks)])[0]
    assert want.token_ids == history[-1].token_ids
    assert want.probs == pytest.approx(history[-1].probs, abs=1e-5)


def test_batched_propose_equals_one_by_one(target):
    head = Eagle3Head.from_target(target, draft_vocab_size=256, seed=4)
    for tree in (False, True):
        d = Eagle3Drafter(target, head, tree=tree, top_k=3, depth=4, max_nodes=10)
        toks = [prefill(target, d, f"r{i}", prompt_ids(n, 10 + i), i) for i, n in enumerate((9, 17, 13))]
        asks = [ask(f"r{i}", i, toks[i], n) for i, n in enumerate((6, 3, 10))]
        together = d.propose(asks)
        alone = [d.propose([a])[0] for a in asks]
        for x, y, a in zip(together, alone, asks):
            assert x.token_ids == y.token_ids and x.parents == y.parents and len(x) <= a.max_tokens
            assert x.probs == pytest.approx(y.probs, abs=1e-5)
        assert d.propose([ask("r0", 0, toks[0], 0)])[0].token_ids == []
        for i in range(3):
            d.end(f"r{i}")


def test_catch_ups_together_equal_one_by_one(target):
    """Short backlogs of several requests run through the head in one padded forward: the same
    head state (next-token log-probs, feature, cache rows) and drafts as one forward each."""
    head = Eagle3Head.from_target(target, draft_vocab_size=256, seed=6)
    lens = (9, 17, 13)
    runs = []
    for together in (True, False):
        head.cache = None
        d = Eagle3Drafter(target, head, depth=4)
        toks = [prefill(target, d, f"r{i}", prompt_ids(n, 20 + i), i) for i, n in enumerate(lens)]
        asks = [ask(f"r{i}", i, toks[i], 4) for i in range(3)]
        drafts = d.propose(asks) if together else [d.propose([a])[0] for a in asks]
        # each request is charged its own catch-up (Draft.setup_s): in one padded forward, by its tokens
        assert all(x.setup_s > 0 for x in drafts)
        if together:
            assert [x.setup_s / drafts[0].setup_s for x in drafts] == pytest.approx([n / lens[0] for n in lens])
        assert all(x.setup_s == 0 for x in d.propose(asks))  # nothing left to catch up
        states = [d._state(f"r{i}") for i in range(3)]
        assert [d.committed(f"r{i}") for i in range(3)] == [n for n in lens]
        runs.append(
            (
                drafts,
                [s.logp.clone() for s in states],
                [s.hidden.clone() for s in states],
                [head_snapshot(head, i, n) for i, n in enumerate(lens)],
            )
        )
    (d1, lp1, h1, kv1), (d2, lp2, h2, kv2) = runs
    assert [x.token_ids for x in d1] == [x.token_ids for x in d2]
    for a, b in zip(lp1 + h1, lp2 + h2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for (k1, v1), (k2, v2) in zip(kv1, kv2):
        torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)


def test_a_windowed_catch_up_never_sees_the_rows_it_skipped(target):
    """With ``catch_up_window`` the head runs over the last tokens of a long backlog only; the rows
    before stay unwritten and hidden, so a previous request's stale rows in the slot change nothing."""
    head = Eagle3Head.from_target(target, draft_vocab_size=256, seed=7)
    prompt = prompt_ids(40, 30)
    runs = []
    for stale in (False, True):
        head.cache = None
        if stale:  # another request, caught up whole, filled slot 1's rows first
            full = Eagle3Drafter(target, head, depth=4)
            other = prefill(target, full, "old", prompt_ids(60, 31), 1)
            full.propose([ask("old", 1, other)])
            full.end("old")
        d = Eagle3Drafter(target, head, depth=4, catch_up_window=8)
        toks = prefill(target, d, "a", prompt, 1)
        first = d.propose([ask("a", 1, toks)])[0]
        st = d._state("a")
        assert st.floor == len(toks) - 1 - 8 and d.committed("a") == len(toks) - 1
        toks = verify_step(target, d, "a", toks, 1, first.token_ids[:2])  # short backlogs: no skip
        second = d.propose([ask("a", 1, toks)])[0]
        assert d._state("a").floor == st.floor
        runs.append((first, second))
    for x, y in zip(*runs):
        assert x.token_ids == y.token_ids
        assert x.probs == pytest.approx(y.probs, abs=1e-6)
    with pytest.raises(ValueError, match="catch_up_window"):
        Eagle3Drafter(target, head, catch_up_window=0)


def test_a_windowed_head_in_the_engine_stays_in_step_and_lossless(target_folder):
    """Prompts longer than the window, a batch of three with ragged backlogs, chains and trees:
    the head keeps in step with every request through acceptance and rejection, and greedy output
    is the plain engine's."""
    from hvd_ray.engine import Engine, SamplingParams

    prompts = [prompt_ids(n, 40 + n) for n in (37, 52, 44)]
    params = SamplingParams(max_tokens=24)
    model = Transformer.from_pretrained(target_folder, dtype=torch.float32)
    plain = [r.output for r in Engine(model, max_batch=3, max_len=128).generate(prompts, params)]
    for tree in (False, True):
        model = Transformer.from_pretrained(target_folder, dtype=torch.float32)
        head = Eagle3Head.from_target(model, draft_vocab_size=256, seed=8)
        d = Eagle3Drafter(model, head, tree=tree, top_k=3, depth=4, max_nodes=8, catch_up_window=6)
        reqs = Engine(model, drafters=[d], max_batch=3, max_len=128, num_draft_tokens=4).generate(prompts, params)
        assert [r.output for r in reqs] == plain
        assert all(r.finish_reason == "length" and max(s.drafted for s in r.stats.steps) > 0 for r in reqs)


def test_tree_is_valid_and_contains_the_chain(target):
    head = Eagle3Head.from_target(target, draft_vocab_size=256, seed=5)
    prompt = prompt_ids(15, 6)
    chain_d = Eagle3Drafter(target, head, depth=4)
    toks = prefill(target, chain_d, "c", prompt, 0)
    chain = chain_d.propose([ask("c", 0, toks)])[0]

    tree_d = Eagle3Drafter(target, head, tree=True, top_k=3, depth=4, max_nodes=16)
    prefill(target, tree_d, "t", prompt, 1)
    n = tree_d.committed("t")
    tree = tree_d.propose([ask("t", 1, toks, 16)])[0]  # catches up on the prompt, then drafts
    assert tree_d.committed("t") == n
    snap = head_snapshot(head, 1, n)
    assert tree_d.propose([ask("t", 1, toks, 16)])[0].token_ids == tree.token_ids
    assert all(torch.equal(a, b) for a, b in zip(snap, head_snapshot(head, 1, n)))  # committed rows kept
    check_parents(tree.parents)
    assert len(tree) == 16 and not tree.is_chain
    depth = []
    for p in tree.parents:
        depth.append(1 if p == -1 else depth[p] + 1)
    assert max(depth) <= 4
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
    for sib in kids.values():
        assert len(sib) <= 3 and len({tree.token_ids[i] for i in sib}) == len(sib)
    # Every node's prob is what the head gives it along its own path (checks the tree mask).
    for i in range(len(tree)):
        path, j = [], i
        while j != -1:
            path.append(j)
            j = tree.parents[j]
        path.reverse()
        got = tree_d.score_path("t", [tree.token_ids[j] for j in path])
        assert got == pytest.approx([tree.probs[j] for j in path], abs=1e-5)
    # The top-1 path of the tree is the chain.
    node, top1 = -1, []
    while kids.get(node):
        node = max(kids[node], key=lambda i: tree.probs[i])
        top1.append(tree.token_ids[node])
    assert len(top1) >= 2 and top1 == chain.token_ids[: len(top1)]
    # A width-1 tree is exactly the chain.
    narrow = Eagle3Drafter(target, head, tree=True, top_k=1, depth=4, max_nodes=16)
    prefill(target, narrow, "n", prompt, 2)
    line = narrow.propose([ask("n", 2, toks)])[0]
    assert line.is_chain and line.token_ids == chain.token_ids
    assert line.probs == pytest.approx(chain.probs, abs=1e-5)


def test_out_of_step_and_bad_taps_are_reported(target):
    head = Eagle3Head.from_target(target, draft_vocab_size=64)
    d = Eagle3Drafter(target, head)
    toks = prefill(target, d, "r", prompt_ids(8, 9), 0)
    with pytest.raises(RuntimeError, match="out of step"):
        d.propose([ask("r", 0, toks + [1])])
    with pytest.raises(ValueError, match="wide"):
        d.observe_target("r", [1, 2], torch.zeros(2, 64))
    with pytest.raises(KeyError, match="unknown"):
        d.observe_target("nope", [1], torch.zeros(1, 192))
    assert Eagle3Config.from_hf(head.cfg.to_hf()) == head.cfg


# --------------------------------------------------------------------------------- alignment
def trained_head(target, shift: int, steps: int = 200):
    """A head teacher-forced for a moment on the target's own features. With ``shift = 0`` pair i
    (tap i, token i + 1) learns the target's next token after token i + 1, as EAGLE-3 (and vLLM's
    proposer) align it; ``shift = 1`` learns one token too far, a negative control."""
    g = torch.Generator().manual_seed(0)
    head = Eagle3Head.from_target(target, seed=0)
    data = []
    for _ in range(24):
        seq = torch.randint(0, VOCAB, (8,), generator=g).tolist()
        target.cache.truncate(3, 0)
        logits = target(torch.tensor([seq]), [3]).logits[0, -1]
        while len(seq) < 64:  # sampled continuations: diverse, yet in the target's own style
            seq.append(int(torch.multinomial(logits.softmax(-1), 1, generator=g)))
            logits = target(torch.tensor([[seq[-1]]]), [3]).logits[0, -1]
        target.cache.truncate(3, 0)
        out = target(torch.tensor([seq]), [3], taps=head.tap_layers)
        data.append((torch.tensor(seq), torch.cat(out.taps, -1)[0], out.logits[0].argmax(-1)))
    target.cache.truncate(3, 0)
    head.train().requires_grad_(True)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for step in range(steps):
        seq, taps, greedy = data[step % len(data)]
        n = len(seq) - 1 - shift
        logits = head.teacher_forward(seq[None, 1 : n + 1], taps[None, :n])[0]
        loss = torch.nn.functional.cross_entropy(logits, greedy[1 + shift : n + 1 + shift])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


def mean_accepted(target, head, prompts, new_tokens=40):
    """Greedy speculative decoding with chain drafts (the test's own verify loop)."""
    d = Eagle3Drafter(target, head, depth=4)
    accepted = []
    for r, prompt in enumerate(prompts):
        toks = prefill(target, d, f"p{r}", prompt, 0)
        while len(toks) < len(prompt) + new_tokens:
            draft = d.propose([ask(f"p{r}", 0, toks, 4)])[0].token_ids
            start = target.cache.lengths[0]
            out = target(torch.tensor([[toks[-1]] + draft]), [0], taps=d.needs_taps)
            greedy = out.logits[0].argmax(-1).tolist()
            m = 0
            while m < len(draft) and draft[m] == greedy[m]:
                m += 1
            target.cache.truncate(0, start + 1 + m)
            d.observe_target(f"p{r}", draft[:m] + [greedy[m]], torch.cat(out.taps, -1)[0, : m + 1])
            toks += draft[:m] + [greedy[m]]
            accepted.append(m)
        d.end(f"p{r}")
    return sum(accepted) / len(accepted)


def test_a_briefly_trained_head_is_aligned_with_the_target(target):
    prompts = [prompt_ids(10, 100 + i) for i in range(3)]
    aligned = mean_accepted(target, trained_head(target, shift=0), prompts)
    off_by_one = mean_accepted(target, trained_head(target, shift=1), prompts)
    print(f"mean accepted per step: aligned {aligned:.2f}, off by one {off_by_one:.2f}")
    assert aligned > 0.3 and aligned > 3 * off_by_one, (aligned, off_by_one)


def test_chain_stops_when_the_head_loses_confidence(target):
    """``min_prob`` cuts the chain where the head's path probability first drops below it: the
    draft is the longest prefix of the unbounded chain whose running product stays >= min_prob."""
    head = Eagle3Head.from_target(target, draft_vocab_size=64, seed=7)
    full = Eagle3Drafter(target, head, depth=6)
    toks = prefill(target, full, "a", prompt_ids(16, 9), 0)
    d_full = full.propose([ask("a", 0, toks)])[0]
    full.end("a")
    running = []
    for p in d_full.probs:
        running.append(p * (running[-1] if running else 1.0))
    for min_prob in (0.0, running[1] * 0.999, running[2] * 1.001, 0.999):
        cut = Eagle3Drafter(target, head, depth=6, min_prob=min_prob)
        target.cache.truncate(0, 0)
        toks = prefill(target, cut, "a", prompt_ids(16, 9), 0)
        d = cut.propose([ask("a", 0, toks)])[0]
        cut.end("a")
        n = sum(1 for r in running if r >= min_prob)
        assert d.token_ids == d_full.token_ids[:n]
        assert d.probs == pytest.approx(d_full.probs[:n], abs=1e-6)
    with pytest.raises(ValueError):
        Eagle3Drafter(target, head, min_prob=1.0)
