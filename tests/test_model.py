"""The own transformer against transformers' reference, and its cache / mask / batch invariants (fp32)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hvd_ray.model.registry import ModelError, check_folder, resolve
from hvd_ray.model.transformer import Transformer
from hvd_ray.verification.tree import tree_attention_mask

# fp32 logits against transformers: our CPU matmuls run on oneDNN-prepacked weights (their own
# accumulation order), so 30 layers agree to ~1e-4 on logits of magnitude ~20 (5e-6 relative)
ATOL = 2e-4


def load_pair(folder):
    ours = Transformer.from_pretrained(folder, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ours, ref


def ours_logits(model, ids, slot=0):
    model.cache.truncate(slot, 0)
    return model(torch.tensor([ids]), [slot]).logits[0]


def test_logits_match_transformers(tiny_folder):
    ours, ref = load_pair(tiny_folder)
    ours.setup_cache(2, 128)
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = ours_logits(ours, ids)
    assert (got - want).abs().max().item() <= ATOL


def test_taps_are_the_residual_stream(tiny_folder):
    ours, ref = load_pair(tiny_folder)
    ours.setup_cache(1, 64)
    ids = list(range(3, 23))
    with torch.no_grad():
        hs = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
    out = ours(torch.tensor([ids]), [0], taps=(0, 2))
    assert (out.taps[0][0] - hs[1][0]).abs().max() <= ATOL
    assert (out.taps[1][0] - hs[3][0]).abs().max() <= ATOL


def test_multi_token_forward_and_rollback_equal_step_by_step(tiny_llama):
    model = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    model.setup_cache(1, 128)
    ids = list(range(5, 35))
    full = ours_logits(model, ids)
    # prefix, then one token at a time
    model.cache.truncate(0, 0)
    step = [model(torch.tensor([ids[:10]]), [0]).logits[0]]
    for t in ids[10:]:
        step.append(model(torch.tensor([[t]]), [0]).logits[0])
    assert (torch.cat(step) - full).abs().max() <= ATOL
    # a wrong 6-token chunk, rolled back, then the right tokens
    model.cache.truncate(0, 20)
    model(torch.tensor([[1, 2, 3, 4, 5, 6]]), [0])
    assert model.cache.lengths[0] == 26
    model.cache.truncate(0, 20)
    again = model(torch.tensor([ids[20:]]), [0]).logits[0]
    assert (again - full[20:]).abs().max() <= ATOL
    with pytest.raises(ValueError):
        model.cache.truncate(0, 99)


def test_a_run_of_slots_splits_where_one_key_span_would_waste_too_much():
    """Consecutive slots attend as one run over its longest row's span, until padding a row to it
    would waste more than ``SPAN_WASTE`` (key, query) pairs (a 1,000-token context beside 150-token
    ones); different widths always split."""
    from hvd_ray.model.attention import SPAN_WASTE, slot_runs

    assert slot_runs([0, 1, 2], [100, 120, 90], [1, 1, 1]) == [(0, 3, 0, 121, 1)]
    assert slot_runs([0, 1, 2, 3], [150, 1000, 1010, 140], [1, 1, 1, 1]) == [
        (0, 1, 0, 151, 1),
        (1, 3, 1, 1011, 1),
        (3, 4, 3, 141, 1),
    ]
    assert slot_runs([0, 1, 3], [10, 10, 10], [2, 2, 2]) == [(0, 2, 0, 12, 2), (3, 4, 2, 12, 2)]
    assert slot_runs([0, 1], [10, 10], [1, 3]) == [(0, 1, 0, 11, 1), (1, 2, 1, 13, 3)]
    wide = SPAN_WASTE // 4 + 1  # 4 queries per row: 4 x that many wasted pairs is over the bound
    assert len(slot_runs([0, 1], [10, 10 + wide], [4, 4])) == 2 and len(slot_runs([0, 1], [10, 10 + wide], [1, 1])) == 1


@pytest.mark.parametrize("waste", [None, 0])  # the default; 0: rows of different spans in runs of their own
@pytest.mark.parametrize("slots", [(0, 1, 2), (0, 2, 3)])  # one run of slots; runs [0], [2, 3]
def test_batched_forward_equals_per_sequence(tiny_folder, slots, waste, monkeypatch):
    if waste is not None:
        monkeypatch.setattr("hvd_ray.model.attention.SPAN_WASTE", waste)
    model = Transformer.from_pretrained(tiny_folder, dtype=torch.float32)
    model.setup_cache(5, 128)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (7, 19, 12)]
    alone = [ours_logits(model, s, slot=4) for s in seqs]
    # batched prefill with padding
    T = max(map(len, seqs))
    toks = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    for s in slots:
        model.cache.truncate(s, 0)
    out = model(toks, list(slots), n_new=[len(s) for s in seqs]).logits
    for b, s in enumerate(seqs):
        assert (out[b, : len(s)] - alone[b]).abs().max() <= ATOL
        assert model.cache.lengths[slots[b]] == len(s)
    # then a batched decode step of different widths from different lengths: the rows are packed
    # (each pays for its own tokens), with padded or packed logits and padded taps
    nxt = [[11, 12, 13], [14], [15, 16]]
    toks = torch.tensor([n + [0] * (3 - len(n)) for n in nxt])
    for packed in (False, True):
        for b, s in enumerate(slots):
            model.cache.truncate(s, len(seqs[b]))
        out = model(toks, list(slots), n_new=[len(n) for n in nxt], taps=(1,), packed_logits=packed)
        assert (out.offsets is not None) == packed and out.taps[0].shape[:2] == (3, 3)
        for b, s in enumerate(seqs):
            ref = ours_logits(model, s + nxt[b], slot=4)
            assert out.row(b)[: len(nxt[b])].shape[0] == len(nxt[b])
            assert (out.row(b)[: len(nxt[b])] - ref[len(s) :]).abs().max() <= ATOL
            assert model.cache.lengths[slots[b]] == len(s) + len(nxt[b])
            model.cache.truncate(4, len(s))  # slot 4 holds s + nxt[b]: score nxt[b] after s again, for its taps
            alone = model(torch.tensor([nxt[b]]), [4], taps=(1,)).taps[0][0]
            assert (out.taps[0][b, : len(nxt[b])] - alone).abs().max() <= ATOL
    # a plain decode step (one token per row, contexts of different lengths): one run, or (waste 0)
    # a run per context length
    for b, s in enumerate(slots):
        model.cache.truncate(s, len(seqs[b]))
    out = model(torch.tensor([[21], [22], [23]]), list(slots)).logits
    for b, s in enumerate(seqs):
        assert (out[b, 0] - ours_logits(model, s + [21 + b], slot=4)[-1]).abs().max() <= ATOL


def test_tree_mask_equals_each_branch_alone(tiny_llama):
    model = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    model.setup_cache(2, 128)
    prefix = list(range(10, 30))
    # tree over new tokens: 0 root(last token) -> 1 -> 2 ; 0 -> 3 -> 4 ; 1 -> 5
    tokens = [40, 41, 42, 43, 44, 45]
    parents = [-1, 0, 1, 0, 3, 1]
    depth = [0, 1, 2, 1, 2, 2]
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    model.cache.truncate(0, 0)
    model(torch.tensor([prefix]), [0])
    out = model(torch.tensor([tokens]), [0], depths=torch.tensor([depth]), attn_mask=mask[None]).logits[0]
    for i in range(6):
        path, j = [], i
        while j != -1:
            path.insert(0, tokens[j])
            j = parents[j]
        ref = ours_logits(model, prefix + path, slot=1)[-1]
        assert (out[i] - ref).abs().max() <= ATOL
    # compaction: keep branch 0 -> 3 -> 4 and continue as if it had been a chain
    model.cache.compact(0, len(prefix), [0, 3, 4])
    assert model.cache.lengths[0] == len(prefix) + 3
    nxt = model(torch.tensor([[7]]), [0]).logits[0, -1]
    ref = ours_logits(model, prefix + [40, 43, 44, 7], slot=1)[-1]
    assert (nxt - ref).abs().max() <= ATOL


def test_slim_forward_empty_mask_and_dropped_blocks(tiny_folder):
    ours, ref = load_pair(tiny_folder)
    ours.setup_cache(1, 64)
    ids = list(range(4, 24))
    full = ours_logits(ours, ids)
    ours.cache.truncate(0, 0)
    assert torch.equal(ours(torch.tensor([ids]), [0], skip=[]).logits[0], full)
    skip = [(1, "attn"), (2, "mlp"), (3, "attn"), (3, "mlp")]
    dropped = copy.deepcopy(ref)
    with torch.no_grad():  # reference: zero each skipped sub-layer's output projection
        for layer, part in skip:
            blk = dropped.model.layers[layer]
            (blk.self_attn.o_proj if part == "attn" else blk.mlp.down_proj).weight.zero_()
        want = dropped(torch.tensor([ids])).logits[0]
    ours.cache.truncate(0, 0)
    got = ours(torch.tensor([ids]), [0], skip=skip).logits[0]
    assert (got - want).abs().max() <= ATOL
    assert (got - full).abs().max() > 1e-3  # the mask really changed something


def test_bad_folders_give_clear_errors(tmp_path, tiny_llama):
    with pytest.raises(ModelError, match="neither a known name"):
        resolve(tmp_path / "nope")
    with pytest.raises(ModelError, match="no config.json"):
        check_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        check_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match="not supported"):
        check_folder(tmp_path)
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_llama / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelError, match="cannot read weights"):
        Transformer.from_pretrained(bad)


@pytest.mark.slow
def test_default_model_logits_match_transformers(default_folder):
    ours, ref = load_pair(default_folder)
    assert ours.cfg.n_layers == 30 and ours.cfg.dim == 576 and ours.cfg.vocab_size == 49152
    ours.setup_cache(1, 256)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_folder)
    ids = tok('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')["input_ids"]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = ours_logits(ours, ids)
    assert (got - want).abs().max().item() <= ATOL


def test_bf16_packed_weights_are_bit_identical_and_batches_run(tiny_llama):
    """Where oneDNN has bf16, packed bf16 weights give bit-identical logits; where it has not (an
    AVX2-only CPU), multi-row inputs run through an fp32 copy of the weights (``Packed.upcast``) and
    match the bf16 matmuls to bf16 rounding, while one-row inputs keep the bf16 weights."""
    from hvd_ray.model.linear import linear

    model = Transformer.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    model.setup_cache(3, 64)
    ids = torch.tensor([list(range(5, 25))])
    packed = model.pack_weights()
    upcast = packed and model.layers[0].mlp.w13.__dict__["packed"].upcast
    assert upcast == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    a = model(ids, [0]).logits
    for mod in model.modules():
        mod.__dict__.pop("packed", None)
    model.cache.truncate(0, 0)
    b = model(ids, [0]).logits
    if packed and not upcast:  # oneDNN bf16 available on this CPU
        assert torch.equal(a, b)
    elif upcast:
        assert (a.float() - b.float()).abs().max() <= 0.05 * max(1.0, b.float().abs().max().item())
        model.pack_weights()
        lin = model.layers[0].mlp.w13
        x = torch.randn(1, 1, lin.in_features, dtype=torch.bfloat16)
        assert torch.equal(linear(x, lin), torch.nn.functional.linear(x, lin.weight))  # one row: bf16
        x = torch.randn(2, 5, lin.in_features, dtype=torch.bfloat16)
        want = torch.nn.functional.linear(x.float(), lin.weight.float()).to(torch.bfloat16)
        assert linear(x, lin).dtype == torch.bfloat16 and torch.allclose(linear(x, lin), want, rtol=1e-2, atol=1e-2)
    # a bf16 batch (the cache: bf16 where the CPU has bf16 instructions, else fp32) runs and matches closely
    model.cache.truncate(0, 0)
    batched = model(torch.cat([ids, ids]), [1, 2]).logits
    assert (batched[0].float() - b[0].float()).abs().max() < 0.1


@pytest.mark.parametrize("kernel", ["sdpa", "attend"])
def test_a_bf16_cache_attends_as_an_fp32_cache_does(tiny_llama, kernel, monkeypatch):
    """A bf16 model's K/V are bf16 values, so a bf16 cache stores them as exactly as an fp32 one; on
    CPU it attends through SDPA's kernel (``sdpa_attend``, bool masks); decode forwards take
    ``attend`` in bf16 where that is faster on the CPU (``bf16_decode_sdpa``; both forced here).
    Every attention path gives the same logits to bf16 rounding: a batched prefill over runs of
    slots, packed decode rows of different widths, a tree mask, a one-token step over different
    lengths, a lone row's chain after its prefix."""
    monkeypatch.setenv("HVD_BF16_ATTENTION", kernel)
    bf = Transformer.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    models = {d: bf.with_own_cache() for d in (torch.float32, torch.bfloat16)}
    for d, m in models.items():
        m.setup_cache(5, 128, d)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (7, 19, 12)]
    T = max(map(len, seqs))
    prefill = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    nxt = [[11, 12, 13], [14], [15, 16]]
    steps = [  # (tokens, slots, keyword arguments)
        (prefill, [0, 2, 3], {"n_new": [len(s) for s in seqs]}),
        (
            torch.tensor([n + [0] * (3 - len(n)) for n in nxt]),
            [0, 2, 3],
            {"n_new": list(map(len, nxt)), "packed_logits": True},
        ),
        (
            torch.tensor([[31, 32, 33, 34]] * 3),
            [0, 2, 3],  # a tree per row: 31 -> {32, 33 -> 34}
            {"attn_mask": tree_attention_mask([-1, -1, 1]).expand(3, 4, 4), "depths": torch.tensor([[0, 1, 1, 2]] * 3)},
        ),
        (torch.tensor([[21], [22], [23]]), [0, 2, 3], {}),
        (torch.tensor([list(range(40, 46))]), [2], {}),
    ]
    for toks, slots, kw in steps:
        a, b = (models[d](toks, slots, **kw).logits.float() for d in (torch.float32, torch.bfloat16))
        assert a.shape == b.shape and (a - b).abs().max() <= 0.05 * max(1.0, a.abs().max().item())
    assert models[torch.bfloat16].cache.lengths == models[torch.float32].cache.lengths


def test_fp32_packed_weights_match_blas_and_give_each_row_the_same_bits(tiny_llama):
    """fp32 on CPU runs through oneDNN-prepacked weights (a 2-17-token forward then costs little
    more than a 1-token one): logits agree with plain ``F.linear`` to fp32 rounding, and each row's
    result is bit-identical whatever the number of rows, which keeps speculative verification
    (k rows) token-identical to plain decoding (1 row)."""
    from hvd_ray.model.linear import linear

    model = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    if not model.pack_weights():
        pytest.skip("no oneDNN on this build")
    model.setup_cache(1, 64)
    ids = torch.tensor([list(range(5, 25))])
    a = model(ids, [0]).logits
    for mod in model.modules():
        mod.__dict__.pop("packed", None)
    model.cache.truncate(0, 0)
    b = model(ids, [0]).logits
    assert (a - b).abs().max() < 1e-4
    model.pack_weights()
    lin = model.layers[0].mlp.w13
    x = torch.randn(3, 17, lin.in_features)
    full = linear(x, lin)
    assert all(torch.equal(full[i, j], linear(x[i : i + 1, j : j + 1], lin)[0, 0]) for i in range(3) for j in range(17))


def test_the_bf16_decode_kernel_is_timed_once_and_can_be_forced(monkeypatch):
    """``bf16_decode_sdpa``: the environment forces either kernel at any size and rejects anything
    else; ``auto`` times the two once per process and takes SDPA below the crossover only."""
    from hvd_ray.model.attention import _sdpa_crossover, bf16_decode_sdpa

    monkeypatch.setenv("HVD_BF16_ATTENTION", "sdpa")
    assert bf16_decode_sdpa(10) is True and bf16_decode_sdpa(10**6) is True
    monkeypatch.setenv("HVD_BF16_ATTENTION", "attend")
    assert bf16_decode_sdpa(10) is False and bf16_decode_sdpa(10**6) is False
    monkeypatch.setenv("HVD_BF16_ATTENTION", "flash")
    with pytest.raises(ValueError, match="HVD_BF16_ATTENTION"):
        bf16_decode_sdpa(10)
    monkeypatch.setenv("HVD_BF16_ATTENTION", "auto")
    n = _sdpa_crossover()
    assert n >= 0.0
    hits = _sdpa_crossover.cache_info().hits
    assert bf16_decode_sdpa(int(min(n, 10**9)) + 1) is False or n == float("inf")
    assert _sdpa_crossover.cache_info().hits > hits  # timed once, then remembered
