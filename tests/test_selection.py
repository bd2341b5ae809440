"""Selection: features φ_t, the pickle-free yield predictor and its training (``training.predictor``,
jobs/train_predictor.py), and the policies (decisions, offline simulation, and inside the real engine)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from test_label_traces import DEPTH, MAX_NEW, MIN_PROB, SKIP, replay_config, tiny_labels, tiny_setup

from hvd_ray.drafters.base import Draft
from hvd_ray.drafters.layerskip import LayerSkipDrafter, parse_skip
from hvd_ray.drafters.suffix import SuffixDrafter
from hvd_ray.engine import Engine, SamplingParams
from hvd_ray.model.transformer import Transformer
from hvd_ray.selection.cost_policy import CostPolicy
from hvd_ray.selection.features import (
    FEATURES,
    FLAGS,
    HISTORY_SLICE,
    SPEC,
    FeatureSpec,
    VocabFlags,
    features,
    history_features,
    token_flags,
    with_history,
)
from hvd_ray.selection.policy import (
    CACHE,
    MODEL,
    NONE,
    AlwaysCache,
    AlwaysModel,
    OraclePolicy,
    ScoreRule,
    StepView,
    TauPolicy,
    extended,
    verify_cost,
)
from hvd_ray.selection.predictor import YieldPredictor
from hvd_ray.traces.labeler import label_traces_local
from hvd_ray.traces.labels import META_FILE
from hvd_ray.traces.simulate import simulate, simulate_trace, trace_labels_from_table
from hvd_ray.training.predictor import TrainConfig, load_labels, train

ROOT = Path(__file__).resolve().parents[1]


def flag(text, name, special=False):
    return token_flags(text, special)[FLAGS.index(name)]


def test_token_flags():
    assert flag(" def", "code") and flag(" def", "space_start") and flag(" def", "word")
    assert flag("\n   ", "ws") and flag("\n   ", "newline") and not flag("\n   ", "word")
    assert flag('":', "quote") and flag('":', "json_delim") and flag('":', "punct")
    assert flag(' {"', "open_br") and flag("]}", "close_br") and not flag("]}", "open_br")
    assert flag("```", "code") and flag(" return", "code") and not flag(" returned", "code")
    assert flag("2024", "digit") and not flag("abc", "digit")
    assert flag("<|im_end|>", "special", special=True) and not flag("<|im_end|>", "special")
    assert token_flags("") == (0,) * len(FLAGS)


def test_vocab_flags_from_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_setup()["tokenizer"])
    vf = VocabFlags.from_tokenizer(tok)
    assert vf.table.shape == (len(tok), len(FLAGS))
    ids = tok.encode(' def f():\n    return {"a": [1, 2]}\n```')
    texts = [tok.decode([i]) for i in ids]
    for i, text in zip(ids, texts):
        assert tuple(vf.of(i).astype(int)) == token_flags(text)
    assert vf.of(tok.convert_tokens_to_ids("<|im_end|>"))[FLAGS.index("special")] == 1
    share = vf.share(ids)
    assert share[FLAGS.index("code")] == pytest.approx(sum(flag(t, "code") for t in texts) / len(ids))
    assert not vf.share([]).any() and not vf.of(10**9).any()


def test_history_features():
    assert not history_features([]).any()
    h = [(True, 3), (False, 1), (True, 5), (False, 0), (True, 2)]
    np.testing.assert_allclose(history_features(h), [(1 + 5 + 0 + 2) / 4, (3 + 5 + 2) / 3, 3 / 5, 5])
    long = [(i % 3 == 0, i) for i in range(40)]
    f = history_features(long)
    assert f[3] == 16 and f[2] == pytest.approx(sum(i % 3 == 0 for i in range(24, 40)) / 16)
    assert f[1] == pytest.approx(np.mean([39, 36, 33, 30]))


def test_features_vector_and_spec():
    vf = VocabFlags.from_texts(["a", " b", "{", "}", "\n", ":"])
    d = Draft.chain([2, 5, 3], [1.0, 0.5, 0.25], score=1.75, match_len=4, source="suffix-global")
    hist = [(True, 2), (False, 1)]
    phi = features(d, prompt_len=10, generated=5, max_tokens=20, last_token=1, history=hist, flags=vf)
    assert phi.dtype == np.float32 and phi.shape == (len(SPEC),) == (len(FEATURES),)
    named = dict(zip(SPEC.names, phi.tolist()))
    assert (named["score"], named["match_len"], named["draft_len"], named["is_global"]) == (1.75, 4, 3, 1)
    assert named["mean_prob"] == pytest.approx(1.75 / 3) and named["last_prob"] == 0.25
    assert (named["prompt_len"], named["generated"], named["rel_pos"]) == (10, 5, 0.25)
    assert named["acc_mean4"] == 1.5 and named["cache_acc_mean4"] == 2 and named["cache_rate16"] == 0.5
    assert named["last_space_start"] == 1 and named["last_word"] == 1
    assert named["draft_open_br"] == pytest.approx(1 / 3) and named["draft_json_delim"] == pytest.approx(1 / 3)
    empty = features(
        Draft(source="suffix-request"), prompt_len=3, generated=1, max_tokens=0, last_token=0, history=[], flags=vf
    )
    assert empty[:6].tolist() == [0] * 6 and empty[8] == 0
    other = with_history(phi, [])
    assert not other[HISTORY_SLICE].any()
    mask = np.ones(len(phi), bool)
    mask[HISTORY_SLICE] = False
    np.testing.assert_array_equal(other[mask], phi[mask])
    assert FeatureSpec.from_dict(json.loads(SPEC.to_json())) == SPEC
    with pytest.raises(ValueError, match="feature spec mismatch"):
        SPEC.check(FeatureSpec(SPEC.names[:-1], SPEC.version))


def fit_small_mlp(n_features: int, seed: int = 0):
    from sklearn.neural_network import MLPRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(seed)
    X = rng.normal(size=(400, n_features)) * rng.uniform(0.1, 30, n_features)
    X[:, 5] = 3.0  # a constant feature: the scaler's scale is 1 there
    y = np.maximum(0, X[:, 0] / 10 + X[:, 1] ** 2 / 100 + rng.normal(0, 0.1, 400))
    pipe = make_pipeline(
        StandardScaler(), MLPRegressor(hidden_layer_sizes=(32, 16), max_iter=60, random_state=seed)
    ).fit(X, y)
    return pipe, X


def test_predictor_artifact_matches_sklearn_without_pickle(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence warnings of the short fit
        pipe, X = fit_small_mlp(len(SPEC))
    pred = YieldPredictor.from_sklearn(pipe[-1], pipe[0].mean_, pipe[0].scale_, SPEC, {"tau": 6})
    pred.save(tmp_path / "art")
    assert sorted(p.name for p in (tmp_path / "art").iterdir()) == ["predictor.json", "predictor.npz"]
    meta = json.loads((tmp_path / "art" / "predictor.json").read_text())
    assert meta["feature_spec"]["names"] == list(SPEC.names) and len(meta["scaler"]["mean"]) == len(SPEC)
    with np.load(tmp_path / "art" / "predictor.npz", allow_pickle=False) as z:
        assert all(z[k].dtype == np.float64 for k in z.files)
    loaded = YieldPredictor.load(tmp_path / "art")
    ref = pipe.predict(X)
    np.testing.assert_allclose(loaded.predict(X), ref, rtol=1e-9, atol=1e-9)
    for i in range(0, 400, 37):
        assert loaded.predict(X[i]) == pytest.approx(ref[i], rel=1e-9, abs=1e-9)
    assert loaded.meta == {"tau": 6}
    bad = FeatureSpec(SPEC.names[:-1] + ("something_else",), SPEC.version)
    with pytest.raises(ValueError, match="mismatch"):
        YieldPredictor.load(tmp_path / "art", spec=bad)


def constant_predictor(value: float) -> YieldPredictor:
    """A real (linear, one-layer) predictor that always says ``value``."""
    n = len(SPEC)
    return YieldPredictor([np.zeros((n, 1))], [np.array([value])], np.zeros(n), np.ones(n))


def test_verify_cost_table():
    assert [verify_cost(k) for k in (1, 8, 16, 32)] == [1.0, 1.2, 1.32, 1.71]
    assert verify_cost(4) == pytest.approx(1 + 0.2 * 3 / 7)
    assert verify_cost(64) == pytest.approx(1.71 + 0.39 / 16 * 32)
    assert verify_cost(0) == 1.0


def test_policy_decisions():
    phi = np.zeros(len(SPEC), np.float32)
    phi[0] = 7.5  # score
    view = StepView(phi, cache_len=10, model_len=5, y_cache=2, y_model=3)
    assert TauPolicy(constant_predictor(7)).decide(view) == (CACHE, 7.0)
    assert TauPolicy(constant_predictor(6)).decide(view) == (MODEL, 6.0)  # strictly above τ
    assert TauPolicy(constant_predictor(9)).decide(StepView(phi, 0, 5)) == (MODEL, 0.0)
    assert ScoreRule(tau=6).decide(view)[0] == CACHE and ScoreRule(tau=8).decide(view)[0] == MODEL
    assert OraclePolicy().decide(view)[0] == MODEL
    assert OraclePolicy().decide(StepView(phi, 10, 5, 3, 3))[0] == CACHE
    assert OraclePolicy().decide(StepView(phi, 0, 0, 0, 0))[0] == NONE
    with pytest.raises(ValueError):
        OraclePolicy().decide(StepView(phi, 1, 1))
    cost = CostPolicy(constant_predictor(7), model_accept=1.0)
    assert cost.decide(view) == (CACHE, 7.0)
    r = cost.rates(view, 7.0)
    assert r[CACHE] == pytest.approx(8 / verify_cost(11)) and r[NONE] == 1.0
    assert r[MODEL] == pytest.approx(2 / (verify_cost(6) + 5 * 0.86))
    assert CostPolicy(constant_predictor(0), model_accept=1.0).decide(view)[0] == NONE  # drafting costs more
    cheap = CostPolicy(constant_predictor(0), model_accept=4.0, model_token_cost=0.05)
    assert cheap.decide(view)[0] == MODEL
    assert AlwaysCache().decide(view)[0] == CACHE and AlwaysModel().decide(view)[0] == MODEL


def test_offline_simulation_on_labels():
    """The offline simulator re-walks the replay's own simulated run exactly (same rule, same
    labels -> same step starts), and the oracle is at least as good as either fixed source."""
    lab = tiny_labels()
    traces = trace_labels_from_table(lab)
    d = lab.to_pydict()
    for k, tl in enumerate(traces):
        path = []
        simulate_trace(tl, ScoreRule(tau=6.0), model_depth=DEPTH, path=path)
        starts = [d["t"][i] for i in range(lab.num_rows) if d["seq"][i] == k and d["step_start"][i]]
        choices = [d["sim_cache"][i] for i in range(lab.num_rows) if d["seq"][i] == k and d["step_start"][i]]
        assert [t for t, _, _ in path] == starts
        assert [c == CACHE for _, c, _ in path] == choices
    res = {
        name: simulate(traces, p, model_depth=DEPTH)
        for name, p in {"cache": AlwaysCache(), "model": AlwaysModel(), "oracle": OraclePolicy()}.items()
    }
    for r in res.values():
        assert r["tokens"] == sum(tl.n for tl in traces) and r["traces"] == len(traces)
        assert r["forwards_per_1k_tokens"] == pytest.approx(1000 * (r["steps"] + r["traces"]) / r["tokens"])
    assert res["oracle"]["mean_accepted_per_forward"] >= max(
        res["cache"]["mean_accepted_per_forward"], res["model"]["mean_accepted_per_forward"]
    )
    assert res["cache"]["cache_share"] == 1 and res["model"]["model_share"] == 1
    assert simulate(traces, AlwaysModel(), model_depth=0)["mean_accepted_per_forward"] == 1.0  # no drafter

    class AlwaysUnion(AlwaysCache):
        def decide(self, view):
            return "union", None

    for tl in traces:  # a union step gains the deeper of its two drafts' labels, and pays for both
        path = []
        one = simulate_trace(tl, AlwaysUnion(), model_depth=DEPTH, path=path)
        assert all(acc == max(tl.y_cache[t], tl.y_model[t]) for t, _, acc in path)
        from hvd_ray.selection.policy import LAYERSKIP_TOKEN_COST

        want = sum(
            verify_cost(1 + tl.cache_len[t] + tl.model_len[t]) + tl.model_len[t] * LAYERSKIP_TOKEN_COST
            for t, *_ in path
        )
        assert one.union_steps == one.steps and one.cost == pytest.approx(want)
    assert simulate(traces, AlwaysUnion(), model_depth=DEPTH)["union_share"] == 1


def write_labels(tmp_path: Path) -> Path:
    """The tiny traces' labels, cold and repeated (``label_traces.py --repeat``)."""
    s = tiny_setup()
    folder = tmp_path / "labels"
    folder.mkdir()
    pq.write_table(label_traces_local(str(s["traces"]), replay_config(s, repeat=True)), folder / "part-0.parquet")
    (folder / META_FILE).write_text(json.dumps({"feature_spec": SPEC.to_dict(), "model_depth": DEPTH}))
    return folder


def test_train_predictor_job(tmp_path):
    out = tmp_path / "pred"
    opts = TrainConfig(
        labels=[str(write_labels(tmp_path))], out=str(out), grid="paper", max_iter=30, importance_rows=200
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = train(opts)
    assert {"predictor.json", "predictor.npz", "report.json", "report.md"} <= {p.name for p in out.iterdir()}
    assert not any(p.suffix in (".pkl", ".pickle", ".joblib") for p in out.iterdir())
    pred = YieldPredictor.load(out)
    assert report["numpy_vs_sklearn_max_abs_diff"] < 1e-9
    assert report["traces"] == {"train": 3, "validation": 1, "test": 2}  # the traces' own split
    assert report["test"]["rows"] == report["trainable_rows"]["test"] > 0
    assert report["latency_single_phi"]["p50_us"] < 1000
    assert set(report["policies_test"]) >= {"always-cache", "always-model", "oracle", "cost", "tau>6"}
    # per regime: the repeated traces' step starts are reported apart, and their policies replayed apart
    by = report["test_step_starts_by_regime"]
    assert set(by) == {"cold", "repeat"} and by["repeat"]["rows"] > 0 and by["cold"]["rows"] > 0
    assert report["policies_by_regime"]["cold"] == report["policies_test"]
    rep, cold = report["policies_by_regime"]["repeat"], report["policies_test"]
    assert rep["always-cache"]["mean_accepted_per_forward"] > cold["always-cache"]["mean_accepted_per_forward"]
    assert "| repeat | always-cache |" in (out / "report.md").read_text()
    v1 = tmp_path / "labels-v1"  # a label folder from before the regime column reads as cold
    v1.mkdir()
    pq.write_table(tiny_labels().drop_columns(["regime"]), v1 / "part-0.parquet")
    (v1 / META_FILE).write_text(json.dumps({"feature_spec": SPEC.to_dict(), "model_depth": DEPTH}))
    table, _ = load_labels([str(v1)])
    assert set(table.column("regime").to_pylist()) == {"cold"} and table.num_rows == tiny_labels().num_rows
    assert pred.meta["model_depth"] == DEPTH and pred.meta["positions"] == "all"
    assert "Policies on the test traces" in (out / "report.md").read_text()
    assert isinstance(pred.predict(np.zeros(len(SPEC), np.float32)), float)


@pytest.mark.parametrize("which", ["tau", "cost"])
def test_policies_drive_the_engine_losslessly(which):
    """TauPolicy / CostPolicy as the engine's policy hook: the output is plain greedy's, both
    sources get used, and (when the engine takes Choice) each step records ŷ."""
    s = tiny_setup()
    model = Transformer.from_pretrained(s["folder"], dtype=torch.float32)
    suffix = SuffixDrafter()
    layerskip = LayerSkipDrafter(model, parse_skip(SKIP), depth=DEPTH, min_prob=MIN_PROB)
    from transformers import AutoTokenizer

    flags = VocabFlags.from_tokenizer(AutoTokenizer.from_pretrained(s["tokenizer"]), model.cfg.vocab_size)
    # a real linear predictor: ŷ = the suffix score (so both sides of τ occur)
    w = np.zeros((len(SPEC), 1))
    w[0, 0] = 1.0
    pred = YieldPredictor([w], [np.zeros(1)], np.zeros(len(SPEC)), np.ones(len(SPEC)))
    policy = (
        TauPolicy(pred, suffix, layerskip, flags, tau=1.0)
        if which == "tau"
        else CostPolicy(pred, suffix, layerskip, flags, model_accept=1.0, model_token_cost=0.05)
    )
    engine = Engine(model, drafters=[suffix, layerskip], policy=policy, max_batch=2, max_len=512, num_draft_tokens=16)
    reqs = engine.generate(s["prompts"], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [r.output for r in reqs] == s["outputs"]
    sources = {st.source for r in reqs for st in r.stats.steps}
    assert "layerskip" in sources and sources & {"suffix-request", "suffix-global"}
    # every step the policy decided records ŷ (SpeculationCheck may decode a batch step plainly, or
    # with the cache drafter's own drafts)
    assert all(st.predicted is not None for r in reqs for st in r.stats.steps if st.arm in (None, "policy"))
    assert all(st.source == "none" for r in reqs for st in r.stats.steps if st.plain)
    assert all(st.source != "layerskip" for r in reqs for st in r.stats.steps if st.arm == "cache")
    if which == "cost":  # batch steps measured every arm (speculation_check.SpeculationCheck), all lossless above
        assert {st.arm for r in reqs for st in r.stats.steps} >= {"cache", "policy"}
    if which == "tau":  # ŷ (= the suffix score here) decided each step: cache above τ, model at or below
        steps = [st for r in reqs for st in r.stats.steps]
        assert all(st.predicted > 1.0 for st in steps if st.source.startswith("suffix"))
        assert all(st.predicted <= 1.0 for st in steps if st.source == "layerskip")


class _Eagle:
    """What CostPolicy reads of a model drafter: its name (to match step records) and depth."""

    name, depth = "eagle3", 5


def test_cost_policy_learns_the_model_side_and_ignores_one_off_outliers():
    """Online calibration: the model drafter's measured acceptance and drafting time move the
    estimates; a single huge drafting time (the first draft's prompt catch-up) is clipped."""
    from hvd_ray.engine.request import StepRecord

    pol = CostPolicy(constant_predictor(0.0), model=_Eagle(), model_token_cost=0.1, model_accept=2.0, adapt=0.2)
    fwd = 0.010
    pol.learn(StepRecord("eagle3", 3, 1, draft_s=0.5, verify_s=fwd * 1.05))  # catch-up: 50 forwards
    assert pol.model_draft_cost < 0.3 * 3  # clipped to a few times the prior, not 50
    for _ in range(60):
        pol.learn(StepRecord("eagle3", 2, 0, draft_s=0.002, verify_s=fwd * 1.03))
        pol.learn(StepRecord("suffix-request", 8, 5, draft_s=0.0001, verify_s=fwd * 1.2))
    assert pol.model_accept < 0.1 and abs(pol.model_len_seen - 2) < 0.1
    assert 0.1 < pol.model_draft_cost < 0.3  # ~0.2 forwards per draft
    fixed = CostPolicy(constant_predictor(0.0), model=_Eagle(), model_accept=2.0, adapt=0.0)
    fixed.learn(StepRecord("eagle3", 3, 0, draft_s=0.5, verify_s=fwd))
    assert fixed.model_accept == 2.0 and fixed.model_draft_cost is None


def test_cost_policy_judges_the_model_per_request_and_calibrates_the_cache():
    """One request where the model drafter fails must not price it out for the next request (a
    global average would, and a priced-out drafter is never re-measured); the cache side scales ŷ
    by what its drafts really got accepted, per tree."""
    from hvd_ray.engine.request import StepRecord

    pol = CostPolicy(constant_predictor(4.0), model=_Eagle(), model_token_cost=0.05, model_accept=2.0, adapt=0.2)
    assert pol.request_model("a", 5) == (2.0, 5.0)  # the priors
    for _ in range(8):
        m_a, _ = pol.request_model("a", 5, StepRecord("eagle3", 5, 0, draft_s=0.004, verify_s=0.01))
        pol.learn(StepRecord("eagle3", 5, 0, draft_s=0.004, verify_s=0.01))
    assert m_a == pytest.approx(2.0 * 2 / (2 + 8))  # the request's own evidence dominates
    assert pol.request_model("b", 5)[0] == 2.0  # a new request starts from the prior again
    view = StepView(np.zeros(3, np.float32), cache_len=0, model_len=5)
    assert pol.decide(view, None, m_a)[0] == NONE and pol.decide(view, None, 2.0)[0] == MODEL

    # an empty model draft (the head's confidence floor cut it) shortens that request's drafts only
    empty = StepRecord("eagle3", 0, 0, draft_s=0.001, verify_s=0.01)
    pol.learn(empty)
    m_c, len_c = pol.request_model("c", 5, empty)
    assert len_c == pytest.approx(2 * 5 / 3)
    m_d, len_d = pol.request_model("d", 5)
    assert len_d == 5.0
    assert pol.decide(view, None, m_d, len_d)[0] == MODEL  # the next request still tries it
    assert pol.decide(view, None, m_c, len_c)[0] == MODEL  # one empty draft is one of three
    fresh = CostPolicy(constant_predictor(0.0), model=_Eagle(), model_token_cost=0.05, model_accept=2.0, adapt=0.2)
    fresh.learn(empty)  # the very first model step came back empty
    fresh.request_model("x", 5, empty)
    assert fresh.model_len_seen == 0.0 and fresh.decide(view, None, 2.0)[0] == NONE  # a global length prices it out
    assert fresh.decide(view, None, *fresh.request_model("y", 5))[0] == MODEL
    fixed = CostPolicy(constant_predictor(0.0), model=_Eagle(), model_accept=2.0, adapt=0.0)
    assert fixed.request_model("z", 5, StepRecord("eagle3", 5, 0, draft_s=0.004, verify_s=0.01)) == (2.0, None)

    for _ in range(40):  # global-tree drafts get half of what the predictor promises
        pol.learn_cache("suffix-global", 2.0, 4.0)
    assert pol.cache_scale["suffix-global"] == pytest.approx(0.5, rel=0.05)
    assert "suffix-request" not in pol.cache_scale
    both = StepView(np.zeros(3, np.float32), cache_len=8, model_len=5)
    assert pol.rates(both, 4.0, "suffix-global")["cache"] < pol.rates(both, 4.0, "suffix-request")["cache"]
    assert pol.cache_key("suffix-global", 3) == "suffix-global"
    assert pol.cache_key("suffix-global", 40) == "suffix-global/long"  # repeats are calibrated apart


def test_cost_policy_extends_confident_cache_drafts_and_shrinks_drafts_with_the_batch():
    """A cache draft predicted to be taken whole is verified past the model budget, toward the cache
    drafter's own length, as far as the measured costs say the longer forward pays, at a rate its
    window vouches for (a one-token window little, a 16-token one much); an unsure one is cut to the
    model budget; the same draft is worth only its first tokens when eight requests share a forward,
    each row paying for its own tokens (fp32 costs measured on an AVX2 CPU)."""
    from hvd_ray.engine.costs import StepCosts

    costs = StepCosts({1: 1.0, 2: 1.77, 8: 1.83, 16: 2.23, 32: 2.9, 64: 3.5, 128: 6.0})
    pol = CostPolicy(constant_predictor(16.0), cost_table=costs, adapt=0.2)
    sure = StepView(np.zeros(len(SPEC), np.float32), cache_len=16, model_len=0, cache_long=64)
    assert pol.decide(sure)[0] == CACHE and sure.take == 32
    assert extended(16.0, 16, 32) > 26 and extended(1.0, 1, 9) < 3 and extended(0.5, 1, 9) == 0.5
    # the start of a repeated answer (a one-token window, nine tokens drafted): still worth its width
    # where 2 tokens cost about what 10 do, though rated at ~3 tokens, not 9
    start = StepView(np.zeros(len(SPEC), np.float32), cache_len=1, model_len=0, cache_long=9)
    assert CostPolicy(constant_predictor(1.0), cost_table=costs).decide(start)[0] == CACHE and start.take >= 8
    unsure = StepView(np.zeros(len(SPEC), np.float32), cache_len=16, model_len=0, cache_long=64)
    pol2 = CostPolicy(constant_predictor(4.0), cost_table=costs)
    assert pol2.decide(unsure)[0] == CACHE and unsure.take == 16
    weak = StepView(np.zeros(len(SPEC), np.float32), cache_len=16, model_len=0, cache_long=64)
    assert CostPolicy(constant_predictor(0.5), cost_table=costs).decide(weak)[0] == NONE  # 2 tokens cost 1.77x
    some = CostPolicy(constant_predictor(1.5), cost_table=costs)
    alone = StepView(np.zeros(len(SPEC), np.float32), cache_len=16, model_len=0, cache_long=64)
    busy = StepView(np.zeros(len(SPEC), np.float32), cache_len=16, model_len=0, cache_long=64, batch=8)
    assert some.decide(alone)[0] == CACHE and alone.take == 16  # 2.5 tokens for 2.23x
    # eight rows share one packed forward: the same draft now pays for its first 2 tokens only (1.5
    # expected for 5 % more time), and a faint one for none
    assert some.decide(busy)[0] == CACHE and busy.take == 2
    faint = StepView(np.zeros(len(SPEC), np.float32), cache_len=16, model_len=0, cache_long=64, batch=8)
    assert CostPolicy(constant_predictor(0.1), cost_table=costs).decide(faint)[0] == NONE


def test_cost_policy_rates_a_draft_the_predictor_says_nothing_about_by_its_tree():
    """Below zero the predictor is out of its training range, not an estimate: such a draft is
    rated by its tree probabilities (at batch 8 these drafts were taken for ~1.1 tokens, as their
    probabilities said, and rated at 0 they were declined)."""
    from hvd_ray.engine.costs import StepCosts

    costs = StepCosts({1: 1.0, 2: 1.77, 8: 1.83, 16: 2.23, 32: 2.9, 64: 3.5, 128: 6.0}, row=0.34)
    probs = [0.9, 0.6, 0.3, 0.1]
    for y, want in ((-2.0, CACHE), (0.01, NONE)):  # 0.01: an estimate, and a poor one
        view = StepView(np.zeros(len(SPEC), np.float32), cache_len=4, model_len=0, batch=8, cache_probs=probs)
        pol = CostPolicy(constant_predictor(y), cost_table=costs)
        choice, _ = pol.decide(view, "suffix-request")
        assert choice == want
    assert pol.cache_yield(0.0, view, 2, "suffix-request") == pytest.approx(1.5)
    view.take = 4
    assert pol.gains(CACHE, view, -2.0, "suffix-request", 0.0) == pytest.approx([0.0, 0.9, 1.5, 1.8, 1.9])


def test_cost_policy_relearns_the_cache_from_steps_that_did_not_verify_it():
    """The cache draft made to decide is scored against what the step emitted, so a tree whose
    scale fell is re-measured while the model drafter is chosen (the warm-cache trap)."""
    from hvd_ray.drafters.base import Draft
    from hvd_ray.engine.request import Request, SamplingParams, StepRecord

    pol = CostPolicy(constant_predictor(1.0), model=_Eagle(), model_accept=2.0, adapt=0.3)
    pol.cache_scale["suffix-global"] = 0.1  # one bad draft pushed it to the floor
    req = Request("r", [1, 2, 3], SamplingParams())
    truth = [7, 8, 9]
    for _step in range(6):
        n0 = len(req.output)
        pol._shadow.setdefault("r", []).append((Draft.chain([7, 8, 9, 10]), 1.0, "suffix-global", n0, None, 4, 4))
        req.output += truth  # the model drafter's step emitted 2 accepted + 1 bonus, all as cached
        pol.shadow(req, StepRecord("eagle3", 5, 2, 0.001, 0.01))
    assert pol.cache_scale["suffix-global"] > 2.0  # 3 matched where 1 was predicted


def test_cost_policy_scores_a_cache_draft_over_its_whole_length():
    """A 12-token cache draft whose first 5 tokens are right, next to model steps that emit 3 tokens
    each: the tree's scale learns 5 accepted over the whole draft's probability mass once the
    output leaves the draft, not 3 of 3 after the first step (which made a batch's 9-token caps
    promise twice what they delivered)."""
    from hvd_ray.drafters.base import Draft
    from hvd_ray.engine.request import Request, SamplingParams, StepRecord

    pol = CostPolicy(constant_predictor(1.0), model=_Eagle(), adapt=1.0)
    req = Request("r", [1, 2, 3], SamplingParams())
    pol._shadow["r"] = [(Draft.chain(range(100, 112), [0.9] * 12), 1.0, "suffix-global", 0, None, 12, 12)]
    truth = [100, 101, 102, 103, 104, 0, 0, 0, 0]
    req.output += truth[:3]
    pol.shadow(req, StepRecord("eagle3", 2, 2, 0.001, 0.01))
    assert "suffix-global" not in pol.tree_scale and len(pol._shadow["r"]) == 1  # waits: 3 of 3 so far
    req.output += truth[3:6]
    pol.shadow(req, StepRecord("eagle3", 2, 2, 0.001, 0.01))
    assert pol.tree_scale["suffix-global"] == pytest.approx(5 / (0.9 * 12)) and not pol._shadow["r"]


@pytest.mark.parametrize("report", ["all_positions", "response_only", "none"])
def test_hvd_cost_prior_reads_the_heads_training_report(tmp_path, report):
    """The cost policy's acceptance prior for an EAGLE-3 head is its training report's
    all-positions held-out MAT (optimistic on purpose: every request tries the head early), the
    headline figure for a report without it, and the predictor's training mean for a head without
    a report."""
    from transformers import AutoTokenizer

    from hvd_ray.model.eagle3_head import Eagle3Head
    from hvd_ray.selection.hvd import build_hvd

    s = tiny_setup()
    model = Transformer.from_pretrained(s["folder"], dtype=torch.float32)
    Eagle3Head.from_target(model, draft_vocab_size=64, seed=0).save(tmp_path)
    heldout = {"mean_accepted_tokens_per_forward": 1.8}
    if report == "all_positions":
        heldout["all_positions"] = {"mean_accepted_tokens_per_forward": 3.1}
    if report != "none":
        (tmp_path / "training.json").write_text(json.dumps({"heldout": heldout}))
    drafters, pol = build_hvd(
        model,
        AutoTokenizer.from_pretrained(s["tokenizer"]),
        policy="cost",
        model_drafter="eagle3",
        eagle3_head=str(tmp_path),
        slots=1,
        max_len=256,
    )
    assert isinstance(pol, CostPolicy) and pol.model is drafters[1]
    expected = {
        "all_positions": 2.1,
        "response_only": 0.8,
        "none": float(pol.predictor.meta.get("model_mean_accept", 1.0)),
    }[report]
    assert pol.prior_accept == pytest.approx(expected)


def test_cost_policy_reaches_past_the_match_at_the_start_of_a_repeat():
    """HVD's suffix drafter reaches ``CACHE_OFFSET`` tokens past its match. Where a 2-token forward
    costs about twice a 1-token one (fp32 on an AVX2 CPU), the match-sized drafts at the start of a
    repeated answer (1, 2, 3 tokens) rarely pay and the longer ones do, so the cost policy verifies
    past the match; φ_t still describes the match-sized draft, the one trace replay labels."""
    from transformers import AutoTokenizer

    from hvd_ray.engine.costs import StepCosts
    from hvd_ray.selection.hvd import CACHE_OFFSET, suffix_config
    from hvd_ray.selection.policy import AlwaysCache, unextended

    s = tiny_setup()
    model = Transformer.from_pretrained(s["folder"], dtype=torch.float32)
    flags = VocabFlags.from_tokenizer(AutoTokenizer.from_pretrained(s["tokenizer"]), model.cfg.vocab_size)
    costs = StepCosts({1: 1.0, 2: 1.77, 8: 1.83, 16: 2.23, 32: 2.9, 64: 3.5, 128: 6.0})
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    prompt, want = s["prompts"][0], s["outputs"][0]
    assert suffix_config("tau").max_spec_offset == 0 and suffix_config("cost").max_spec_offset == CACHE_OFFSET

    def repeat(cache, policy):
        engine = Engine(model, drafters=[cache], policy=policy, max_batch=1, max_len=512, num_draft_tokens=16)
        outs = [engine.generate([prompt], params)[0] for _ in range(2)]  # the second holds the first's answer
        assert [r.output for r in outs] == [want, want]
        return outs[1].stats.steps

    cache = SuffixDrafter(suffix_config("cost"))
    steps = repeat(cache, CostPolicy(constant_predictor(1.0), cache, None, flags, cost_table=costs))
    plain = SuffixDrafter()
    base = repeat(plain, AlwaysCache(plain, None, flags))
    assert steps[0].source.startswith("suffix") and steps[0].drafted > base[0].drafted
    # the repeat's first 26 tokens in two steps (8 + 18) against four (1 + 3 + 7 + 15); its tail
    # (the constant ŷ = 1 rates 2-token windows at half) takes a few short steps either way
    assert sum(x.accepted for x in steps[:2]) >= sum(x.accepted for x in base[:4]) >= 20

    cache.begin("probe", prompt + want[:1])  # one output token: the match is short, the draft is not
    long = cache.speculate("probe", 64)
    cache.end("probe")
    assert len(long) > long.match_len == unextended(long, cache)
    assert unextended(long, plain) == len(long)  # a drafter without an offset: the draft itself


def test_union_tree_shares_common_paths_and_marks_the_model_part():
    """Two drafts as one tree: a path both take is verified once; the marks say which nodes the
    second draft (the model's) has, so a step can tell what it alone would have got."""
    cache = Draft.chain([5, 6, 7, 8], [0.9, 0.8, 0.5, 0.4], source="suffix-request")
    model = Draft.chain([5, 6, 9], [0.7, 0.6, 0.5], source="eagle3")
    u = Draft.union(cache, model)
    assert (u.token_ids, u.parents, u.marks) == ([5, 6, 7, 8, 9], [-1, 0, 1, 2, 1], [True, True, False, False, True])
    assert u.source == "union" and not u.is_chain and u.probs == [0.9, 0.8, 0.5, 0.4, 0.5]
    assert u.truncated(3).marks == [True, True, False]
    apart = Draft.union(Draft.chain([1, 2]), Draft.chain([3]))
    assert apart.parents == [-1, 0, -1] and apart.marks == [False, False, True]
    assert Draft.union(Draft(), model).token_ids == [5, 6, 9]
    with pytest.raises(ValueError, match="sampled"):
        Draft.union(cache, Draft.chain([1], dists=torch.ones(1, 4)))


def test_cost_policy_verifies_both_drafts_where_the_cache_draft_is_doubtful():
    """The union's yield is the deeper of two paths: P(either) per depth. It is chosen where the
    cache draft is doubtful and the model draft cheap, not where either alone is clearly better,
    and only for a lone request (under load the batch's drafts are sized per row)."""
    from hvd_ray.engine.request import StepRecord
    from hvd_ray.selection.policy import UNION, model_curve, union_yield

    curve = model_curve(1.5, 4)
    assert len(curve) == 4 and sum(curve) == pytest.approx(1.5, abs=1e-6)
    assert all(a > b for a, b in zip(curve, curve[1:])) and model_curve(5.0, 4) == [1.0] * 4
    assert union_yield([0.5, 0.25], [0.5]) == pytest.approx(0.75 + 0.25)
    assert union_yield([1.0, 1.0], [0.3, 0.1]) == pytest.approx(2.0)  # a sure path leaves nothing to add
    costs = {1: 1.0, 2: 1.01, 4: 1.03, 8: 1.15, 16: 1.4, 32: 1.8, 64: 2.7}
    doubtful = StepView(np.zeros(len(SPEC), np.float32), cache_len=4, model_len=4, cache_probs=[0.5, 0.3, 0.2, 0.1])
    pol = CostPolicy(
        constant_predictor(0.6),
        model=_Eagle(),
        cost_table=costs,
        model_accept=1.5,
        model_token_cost=0.05,
        adapt=0.0,
        union=True,
    )
    choice, _ = pol.decide(doubtful)
    assert choice == UNION and 1 <= doubtful.take_union <= 4
    r = pol.rates(doubtful, 0.6)
    assert r[UNION] > max(r[CACHE], r[MODEL], r[NONE])
    plain = CostPolicy(
        constant_predictor(0.6), model=_Eagle(), cost_table=costs, model_accept=1.5, model_token_cost=0.05, adapt=0.0
    )
    assert UNION not in plain.rates(doubtful, 0.6) and plain.decide(doubtful)[0] == MODEL
    sure = StepView(np.zeros(len(SPEC), np.float32), cache_len=4, model_len=4, cache_probs=[1.0, 1.0, 1.0, 1.0])
    confident = CostPolicy(
        constant_predictor(4.0),
        model=_Eagle(),
        cost_table=costs,
        model_accept=1.5,
        model_token_cost=0.05,
        adapt=0.0,
        union=True,
    )
    assert confident.decide(sure)[0] == CACHE  # the model draft would only cost
    loaded = StepView(
        np.zeros(len(SPEC), np.float32), cache_len=4, model_len=4, cache_probs=[0.5, 0.3, 0.2, 0.1], batch=4
    )
    assert UNION not in pol.rates(loaded, 0.6)
    # after a long context each verified token costs more (engine/costs.py): a 16-token cache draft
    # worth 2 tokens pays after 64 tokens and loses to the model's 5 after 4,000, and the union
    # takes fewer of the cache's tokens there
    from hvd_ray.engine.costs import StepCosts

    timed = StepCosts(
        costs,
        forward_s=0.01,
        long_table={1: 1.0, 2: 1.1, 4: 1.25, 8: 1.5, 16: 1.9, 32: 2.6, 64: 3.6},
        long_forward_s=0.02,
        prefix=64,
        long_prefix=2048,
    )

    def at(context: int) -> StepView:
        return StepView(
            np.zeros(len(SPEC), np.float32), cache_len=16, model_len=4, cache_probs=[0.6] * 16, context=context
        )

    by_context = CostPolicy(
        constant_predictor(2.0), model=_Eagle(), cost_table=timed, model_accept=1.5, model_token_cost=0.05, adapt=0.0
    )
    assert by_context.decide(at(64))[0] == CACHE and by_context.decide(at(4000))[0] == MODEL
    both = CostPolicy(
        constant_predictor(0.6),
        model=_Eagle(),
        cost_table=timed,
        model_accept=1.5,
        model_token_cost=0.05,
        adapt=0.0,
        union=True,
    )
    short, long = at(64), at(4000)
    assert both.decide(short)[0] == both.decide(long)[0] == UNION and long.take_union < short.take_union
    # the model side learns from a union step what its own draft got, not what the union got
    learner = CostPolicy(constant_predictor(0.6), model=_Eagle(), model_accept=2.0, adapt=0.5, union=True)
    step = StepRecord("union", 6, 3, draft_s=0.001, verify_s=0.01, union=(3, 1))
    learner.learn(step)
    assert learner.model_accept == pytest.approx(1.5) and learner.model_len_seen == 3.0
    assert learner.request_model("a", 5, step) == pytest.approx(((2 * 2.0 + 1) / 3, (2 * 5 + 3) / 3))
