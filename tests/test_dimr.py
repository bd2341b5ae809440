"""DIMR: cost functions, the mask artifact, the measured budget, the evaluator and a real Tune search."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hvd_ray.dimr import MaskError, SlimMask, load_mask, save_mask
from hvd_ray.dimr.budget import SubLayerCosts, measure_costs, measure_mask
from hvd_ray.dimr.calibration import CalibSeq, place_windows
from hvd_ray.dimr.cost import coarse_logprobs, kl, r_cost
from hvd_ray.dimr.evaluator import SlimEvaluator
from hvd_ray.dimr.greedy import greedy_search
from hvd_ray.dimr.samplers import LocalRandomSampler
from hvd_ray.dimr.search import SearchProblem, run_search
from hvd_ray.dimr.space import decode, param_name, parse_param, random_scores, screen_seeds
from hvd_ray.model import Transformer


# ------------------------------------------------------------------------------------ cost
def _np_r(p, q, alpha, beta):
    return (p * np.maximum(0, np.log(1 - alpha) + np.log(p) - np.log(q))).sum() + (
        q * np.maximum(0, np.log(beta) + np.log(p) - np.log(q))
    ).sum()


def _dists(rng, n, v):
    x = rng.dirichlet(np.full(v, 0.5), size=n)
    return np.clip(x, 1e-12, None) / np.clip(x, 1e-12, None).sum(-1, keepdims=True)


@pytest.mark.parametrize("alpha,beta", [(0.1, 0.5), (0.0, 1.0), (0.5, 0.2)])
def test_r_cost_matches_bruteforce(alpha, beta):
    rng = np.random.default_rng(0)
    p, q = _dists(rng, 16, 7), _dists(rng, 16, 7)  # p = slim q', q = full target
    got = r_cost(torch.tensor(np.log(p)), torch.tensor(np.log(q)), alpha, beta).numpy()
    want = np.array([_np_r(p[i], q[i], alpha, beta) for i in range(16)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert (got >= 0).all() and (got > 0).any()
    same = r_cost(torch.tensor(np.log(q)), torch.tensor(np.log(q)), alpha, beta)
    assert torch.allclose(same, torch.zeros(16), atol=1e-6)


def test_kl_matches_torch_and_numpy():
    rng = np.random.default_rng(1)
    q, s = _dists(rng, 8, 11), _dists(rng, 8, 11)
    got = kl(torch.tensor(np.log(q)), torch.tensor(np.log(s)))
    want = (q * (np.log(q) - np.log(s))).sum(-1)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)
    ref = torch.nn.functional.kl_div(
        torch.tensor(np.log(s)), torch.tensor(np.log(q)), log_target=True, reduction="none"
    ).sum(-1)
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-5)
    assert torch.allclose(kl(torch.tensor(np.log(q)), torch.tensor(np.log(q))), torch.zeros(8), atol=1e-7)


def test_zero_probabilities_and_coarse_bound():
    logq = torch.log(torch.tensor([[0.5, 0.5, 0.0]]))
    logs = torch.log(torch.tensor([[0.25, 0.75, 0.0]]))
    assert torch.isfinite(kl(logq, logs)).all() and torch.isfinite(r_cost(logs, logq)).all()
    # top-k + folded remainder: a lower bound of the full-vocabulary KL, and sums to one
    rng = np.random.default_rng(2)
    q, s = torch.tensor(np.log(_dists(rng, 4, 50))), torch.tensor(np.log(_dists(rng, 4, 50)))
    ids = q.topk(5, -1).indices
    cq, cs = coarse_logprobs(q, ids), coarse_logprobs(s, ids)
    assert torch.allclose(cq.exp().sum(-1), torch.ones(4, dtype=cq.dtype), atol=1e-5)
    assert (kl(cq, cs) <= kl(q, s) + 1e-6).all()
    with pytest.raises(ValueError):
        r_cost(logs, logq, alpha=1.0)
    with pytest.raises(ValueError):
        r_cost(logs, logq, beta=1.5)


# ------------------------------------------------------------------------------------ mask
def test_mask_roundtrip_and_checksum(tmp_path):
    m = SlimMask.parse("attn:3-5,mlp:7,layer:9", 30, model_id="m", model_revision="abc", meta={"budget": 0.6})
    assert (9, "attn") in m.skip and (9, "mlp") in m.skip and len(m.skip) == 6
    assert SlimMask.parse(m.spec(), 30) == SlimMask(30, m.skip)
    assert SlimMask.from_bits(30, m.bits()) == SlimMask(30, m.skip)
    save_mask(m, tmp_path / "a")
    back = load_mask(tmp_path / "a")
    assert back == m and back.meta == {"budget": 0.6}
    assert load_mask(tmp_path / "a" / "mask.json") == m
    with pytest.raises(MaskError, match="revision"):
        load_mask(tmp_path / "a", model_revision="other")
    cfg = type("C", (), {"n_layers": 12})()
    with pytest.raises(MaskError, match="12 layers"):
        load_mask(tmp_path / "a", cfg)
    f = tmp_path / "a" / "mask.json"
    f.write_text(f.read_text().replace('"attn"', '"mlp"', 1))
    with pytest.raises(MaskError, match="checksum"):
        load_mask(tmp_path / "a")
    with pytest.raises(MaskError, match="not found"):
        load_mask(tmp_path / "nowhere")


def test_layer0_never_skipped_and_bad_input():
    with pytest.raises(MaskError, match="layer 0"):
        SlimMask(4, ((0, "attn"),))
    with pytest.raises(MaskError, match="layer 0"):
        SlimMask.parse("layer:0-1", 4)
    with pytest.raises(MaskError):
        SlimMask(4, ((4, "mlp"),))
    with pytest.raises(MaskError):
        SlimMask(4, ((1, "ffn"),))
    with pytest.raises(MaskError):
        SlimMask.parse("attn:x", 4)
    assert all(c[0] != 0 for c in SlimMask.candidates(30)) and len(SlimMask.candidates(30)) == 58
    costs = SubLayerCosts.uniform(30, attn=1.0, mlp=2.0)
    rng = random.Random(0)
    for _ in range(50):
        m = decode(random_scores(30, rng), costs, 0.4)
        assert all(i != 0 for i, _ in m.skip)
        assert costs.kept_fraction(m) <= 0.4 + 1e-9
        assert costs.kept_fraction(m) > 0.4 - 2.0 / costs.block_total - 1e-9  # filled up to the budget
    with pytest.raises(ValueError, match="layer 0"):
        decode(random_scores(30, rng), costs, 0.01)


def test_screen_seeds_rank_by_sensitivity():
    costs = SubLayerCosts.uniform(6)
    cands = SlimMask.candidates(6)
    assert [parse_param(param_name(c)) for c in cands] == cands
    sens = {param_name(c): float(i) for i, c in enumerate(cands)}  # later sub-layers matter more
    seeds = screen_seeds(sens, costs, 5, seed=1)
    assert len(seeds) == 5 and all(set(s) == set(sens) and all(0 <= v <= 1 for v in s.values()) for s in seeds)
    # budget 0.5 of 12 equal sub-layers: layer 0 + the 4 most sensitive are kept, the 6 least skipped
    assert decode(seeds[0], costs, 0.5).skip == tuple(sorted(cands[:6]))


def test_swap_moves_change_the_incumbent_mask():
    import optuna

    costs = SubLayerCosts.uniform(8, attn=1.0, mlp=1.5)
    dists = {param_name(c): optuna.distributions.FloatDistribution(0.0, 1.0) for c in SlimMask.candidates(8)}
    study = optuna.create_study(sampler=LocalRandomSampler(seed=3, costs=costs, budget=0.6))
    best = random_scores(8, random.Random(0))
    study.add_trial(optuna.trial.create_trial(params=best, distributions=dists, value=1.0))
    incumbent = decode(best, costs, 0.6)
    for _ in range(10):
        t = study.ask(dists)
        moved = decode(t.params, costs, 0.6)
        assert moved != incumbent and costs.kept_fraction(moved) <= 0.6 + 1e-9
        assert 1 <= len(set(moved.skip) ^ set(incumbent.skip)) <= 6  # a local move, not a fresh mask
        study.tell(t, 2.0)


# ---------------------------------------------------------------------------------- model
@pytest.fixture(scope="module")
def tiny(tiny_llama):
    torch.manual_seed(0)
    return Transformer.from_pretrained(tiny_llama, dtype=torch.float32)


def _seqs(n=6, seed=0):
    g = random.Random(seed)
    out = [CalibSeq([g.randrange(320) for _ in range(g.randrange(10, 30) + 40)], 0, id=str(i)) for i in range(n)]
    for s in out:
        s.prompt_len = len(s.tokens) - 40
    return place_windows(out, 3, 8, seed)


def test_budget_measurement_is_sane(tiny):
    c = measure_costs(tiny, prefix=32, rounds=3, reps=3)
    assert len(c.attn) == len(c.mlp) == 4 and all(x > 0 for x in c.attn + c.mlp)
    assert c.kept_fraction(SlimMask(4)) == 1.0
    everything = [(i, k) for i in range(4) for k in ("attn", "mlp")]
    assert abs(c.kept_fraction(everything)) < 1e-9
    assert 0 < c.kept_fraction(SlimMask.parse("layer:1-2", 4)) < 1
    assert c.setting["none_s"] < c.full_s  # skipping every block is faster than the full forward
    r = measure_mask(tiny, SlimMask.parse("layer:1-3", 4), prefix=32, rounds=3, reps=3)
    assert r["mask_s"] < r["full_s"] and r["time_ratio"] < 1


def test_evaluator_against_full_forward(tiny):
    seqs = _seqs()
    ev = SlimEvaluator(tiny, seqs, width=8, topk=16)
    full = ev.evaluate([])
    assert full["kl"] < 1e-5 and full["r"] < 1e-5 and full["top1"] == 1.0 and full["run"] == 8.0
    slim = ev.evaluate([(1, "attn"), (2, "mlp")])
    assert slim["kl"] > 1e-6 and slim["r"] > 0
    assert ev.evaluate([]) == full  # evaluation restores the target's K/V: repeatable
    # the evaluator's target log-probs equal a plain full forward of the whole sequence
    s = seqs[0]
    tiny.setup_cache(1, 128)
    lp = torch.log_softmax(tiny(torch.tensor([s.tokens]), [0]).logits[0].float(), -1)
    st = s.starts[0]
    np.testing.assert_allclose(
        ev.logq[0, 0, :, :16].numpy(), lp[st : st + 8].gather(-1, ev.ids[0, 0]).numpy(), atol=1e-4
    )


def test_greedy_meets_budget(tiny):
    ev = SlimEvaluator(tiny, _seqs(4), width=8, topk=16)
    costs = SubLayerCosts.uniform(4)
    mask, info = greedy_search(ev.evaluate, costs, 0.5)
    assert costs.kept_fraction(mask) <= 0.5 and (0, "attn") not in mask.skip and info["evals"] > 0


def _tiny_problem(folder) -> SearchProblem:
    """A search over the tiny model's 4 layers at a 0.6 budget (uniform sub-layer costs)."""
    return SearchProblem(
        model=str(folder),
        dtype="float32",
        device="cpu",
        seqs=_seqs(4),
        costs=SubLayerCosts.uniform(4, attn=1.0, mlp=2.0),
        budget=0.6,
        objective="r",
        width=8,
        topk=16,
    )


def test_tiny_tune_search(tiny_llama, tmp_path):
    import ray

    problem = _tiny_problem(tiny_llama)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        seeds = screen_seeds({param_name(c): float(c[0]) for c in SlimMask.candidates(4)}, problem.costs, 2)
        res = run_search(
            problem,
            trials=8,
            parallel=2,
            startup=4,
            random_every=2,
            storage=str(tmp_path),
            verbose=0,
            seeds=seeds,
            local_sigma=0.05,
        )
    finally:
        ray.shutdown()
    assert len(res.trials) == 8
    assert problem.costs.kept_fraction(res.mask) <= 0.6 + 1e-9
    assert all(i != 0 for i, _ in res.mask.skip)
    assert res.metrics["objective"] == min(t["objective"] for t in res.trials)
    # the decoded best mask is the one that was scored
    assert res.mask.spec() == res.metrics["spec"]


def test_the_search_runs_its_trials_on_a_multi_node_cluster(tiny_llama, tmp_path):
    """On a simulated Ray cluster (``ray.cluster_utils.Cluster``: each extra raylet on this host is
    its own node to the scheduler) whose head offers no CPU, the search joined from the head runs
    every trial on the worker nodes and ends as on one node."""
    import ray
    from ray.cluster_utils import Cluster

    problem = _tiny_problem(tiny_llama)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = {cluster.add_node(num_cpus=1).node_id for _ in range(2)}
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 3
        res = run_search(problem, trials=6, parallel=2, startup=4, storage=str(tmp_path), verbose=0)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert len(res.trials) == 6 and problem.costs.kept_fraction(res.mask) <= 0.6 + 1e-9
    assert {t["node"] for t in res.trials} <= workers  # none on the head, where the driver runs
