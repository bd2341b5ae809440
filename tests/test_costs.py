"""The engine's forward costs, measured on the machine it runs on (engine/costs.py), and the
engine's separate budget for the suffix cache's drafts."""

from __future__ import annotations

import json

import pytest
import torch

from hvd_ray.engine.costs import StepCosts, batch_lengths, interpolate, measure_step_costs, monotone
from hvd_ray.model.transformer import Transformer


def test_measured_costs_are_relative_monotone_cached_and_leave_the_cache_alone(tiny_llama):
    model = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    cache = model.setup_cache(2, 64)
    cache.lengths[1] = 7
    costs = measure_step_costs(model, widths=(1, 2, 4, 8), prefix=16, reps=2)
    assert costs.measured and costs.table[1] == 1.0 and costs.forward_s > 0
    assert list(costs.table) == [1, 2, 4, 8]
    assert all(costs.table[a] <= costs.table[b] for a, b in zip([1, 2, 4], [2, 4, 8]))  # never falls
    assert costs.raw_s[8] > 0 and set(costs.raw_s) == {1, 2, 4, 8}
    assert model.cache is cache and cache.lengths == [0, 7]  # measured in a scratch cache
    assert measure_step_costs(model, widths=(1, 2, 4, 8), prefix=16, reps=2) is costs  # once per model
    # widths beyond the model's context are dropped, not an error
    short = measure_step_costs(model, widths=(1, 2, model.cfg.max_position + 1), prefix=16, reps=1)
    assert list(short.table) == [1, 2]
    # the same widths after a long context; one that does not fit is cut to the model's room
    assert (costs.prefix, costs.long_prefix) == (16, model.cfg.max_position - 8) and costs.long_forward_s > 0
    assert list(costs.long_table) == [1, 2, 4, 8] and costs.long_table[1] == 1.0
    assert all(costs.long_table[a] <= costs.long_table[b] for a, b in zip([1, 2, 4], [2, 4, 8]))
    assert not measure_step_costs(model, widths=(1, 2), prefix=16, reps=1, long_prefix=0).long_table


def test_a_step_costs_file_is_written_once_and_read_by_the_next_process(tiny_llama, tmp_path):
    """A replica that finds its machine's table in the file takes it as timed (no timing: the same
    numbers to the last digit); another kind of machine (here: another thread count) gets its own
    entry; an unreadable file is timed over, never an error."""
    file = str(tmp_path / "costs" / "steps.json")
    first = measure_step_costs(
        Transformer.from_pretrained(tiny_llama, dtype=torch.float32), (1, 2, 4), 16, 2, file=file
    )
    again = measure_step_costs(
        Transformer.from_pretrained(tiny_llama, dtype=torch.float32), (1, 2, 4), 16, 2, file=file
    )
    assert again is not first  # a fresh model: nothing cached on it, so it came from the file
    for name in ("table", "forward_s", "raw_s", "long_table", "long_forward_s", "prefix", "long_prefix"):
        assert getattr(again, name) == getattr(first, name), name
    assert again.measured and again.width_scale == 1.0 and not again.rows  # online fits start afresh
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other = measure_step_costs(
            Transformer.from_pretrained(tiny_llama, dtype=torch.float32), (1, 2, 4), 16, 2, file=file
        )
    finally:
        torch.set_num_threads(threads)
    assert other.raw_s != first.raw_s and len(json.load(open(file))) == 2
    open(file, "w").write("{not json")
    timed = measure_step_costs(
        Transformer.from_pretrained(tiny_llama, dtype=torch.float32), (1, 2, 4), 16, 2, file=file
    )
    assert timed.raw_s != first.raw_s and len(json.load(open(file))) == 1


def test_width_costs_more_after_a_long_context():
    """Every verified token attends over the whole context, so a wide forward costs more, relative
    to a one-token forward, after 4,000 tokens than after 64 (bf16 here: 32 tokens 2.3x against
    1.46x): seconds are linear in the context between the two measured tables and beyond them."""
    costs = StepCosts(
        {1: 1.0, 32: 1.5},
        forward_s=0.01,
        long_table={1: 1.0, 32: 2.5},
        long_forward_s=0.02,
        prefix=64,
        long_prefix=1064,
    )
    assert costs(32) == costs(32, 64) == 1.5 and costs(32, 1064) == pytest.approx(2.5)
    assert costs(32, 564) == pytest.approx((0.005 * 1.5 + 0.01 * 2.5) / 0.015)  # halfway in seconds
    assert costs(32, 564) < costs(32, 1064) < costs(32, 3000) < 3.0  # toward the long table's slope
    assert costs(1, 3000) == 1.0 and costs.per_row(32, 1, 1064) == pytest.approx(2.5)
    # a batch's rows have contexts of their own: its learned per-row term holds them
    assert costs.batch(4, 35, context=3000) == costs.batch(4, 35) == costs(35) + costs.row_at(4) * 3
    assert StepCosts({1: 1.0, 32: 1.5})(32, 5000) == 1.5  # no long table: the one there is


def test_a_timing_spike_is_averaged_not_carried_to_wider_forwards():
    # a noisy 4-token timing: a running maximum would price 8 and 16 tokens at 1.6 too
    fit = monotone({1: 1.0, 2: 1.1, 4: 1.6, 8: 1.3, 16: 1.5, 32: 2.5})
    assert fit[4] == pytest.approx(1.45) and fit[8] == pytest.approx(1.45)  # the violators pooled
    assert fit[16] == pytest.approx(1.5) and fit[32] == pytest.approx(2.5) and fit[1] == pytest.approx(1.0)
    assert monotone({1: 0.05}) == {1: 0.05}


def test_costs_interpolate_and_share_a_forward_across_a_batch():
    costs = StepCosts({1: 1.0, 8: 2.0, 16: 3.0})
    assert costs(4) == pytest.approx(1 + 3 / 7) and costs(32) == pytest.approx(5.0)  # last slope beyond
    assert interpolate({1: 1.0, 8: 2.0}, 0) == 1.0
    assert costs.per_row(1, 1) == 1.0
    assert costs.per_row(1, 8) == pytest.approx(2.0 / 8)  # eight 1-token rows share one forward
    assert costs.per_row(2, 8) == pytest.approx(2.125 / 8)  # a 1-token draft adds one token to the forward


def test_a_batch_s_rows_cost_what_the_engine_s_steps_measured():
    """Each further row of a batch costs ``row`` one-token forwards besides its tokens, learned from
    measured batched forwards (the start-up table times one short sequence and underprices a
    batch, which made every extra verified token look twice as dear as it is)."""
    costs = StepCosts({1: 1.0, 8: 1.2, 16: 2.0}, forward_s=0.01)
    assert costs.batch(8, 8) == costs(8)  # nothing learned yet
    costs.observe(8, 8, 0.01 * (1.2 + 7 * 0.5))  # a batch size's first forward sets its row cost
    assert costs.row_at(8) == pytest.approx(0.5)
    for _ in range(300):
        costs.observe(8, 8, 0.01 * (1.2 + 7 * 0.3))
    assert costs.row_at(8) == pytest.approx(0.3, rel=1e-3)
    assert costs.batch(8, 9) == pytest.approx(costs(9) + 2.1) and costs.per_row(2, 8) == pytest.approx(
        (costs(9) + 2.1) / 8
    )
    costs.observe(1, 1, 1.0)  # a lone row says nothing about rows
    assert costs.row_at(8) == pytest.approx(0.3, rel=1e-3)
    # each batch size has its own (here ~0 per row at 2, ~0.14 at 8): one average priced batch 8 low
    costs.observe(2, 2, 0.01 * costs(2))
    assert costs.row_at(2) == 0.0 and costs.row_at(8) == pytest.approx(0.3, rel=1e-3)
    assert costs.row_at(3) == 0.0 and costs.row_at(6) == pytest.approx(0.3, rel=1e-3)  # the nearest measured
    assert costs.row_at(5) == pytest.approx(0.3, rel=1e-3)  # (a tie goes to the larger batch)
    static = StepCosts({1: 1.0, 8: 1.2})  # a static table has no time unit to learn in
    static.observe(8, 8, 1.0)
    assert static.row_at(8) == 0.0 and not static.rows
    assert StepCosts({1: 1.0, 8: 1.2}, row=0.2).batch(8, 8) == pytest.approx(1.2 + 1.4)  # a prior for every size
    # a dearer base step makes an extra verified token relatively cheaper: a 0.3-token gain now pays
    doubtful = [[0.0]] * 7 + [[0.0, 0.3]]
    assert batch_lengths([0] * 7 + [1], doubtful, StepCosts({1: 1.0, 8: 1.2, 16: 2.0})) == [0] * 8
    assert batch_lengths([0] * 7 + [1], doubtful, costs) == [0] * 7 + [1]


def test_a_table_timed_on_a_busy_box_is_re_fitted_from_the_lone_forwards_decoded_after():
    """The start-up tables are timed once; timed while another process kept the CPU busy they
    priced an 8-token forward at 2.58 one-token ones where a quiet box gives 1.28 (and 32 tokens at
    7.5 against 2.04). The lone verify forwards timed afterwards re-fit the width's share of the
    cost (``width_scale``), against the 1-token time fitted with it."""
    import random

    busy = StepCosts({1: 1.0, 2: 1.4, 8: 2.58, 32: 7.5}, forward_s=0.02, measured=True)
    quiet = {1: 1.0, 2: 1.05, 8: 1.28, 32: 2.04}
    rnd = random.Random(0)
    one = 0.015  # the box is also faster now than at start-up: that is the 1-token time, not the shape
    assert busy(8) == pytest.approx(2.58) and busy.width_scale == 1.0
    for i in range(200):
        k = (2, 5, 9, 17, 33)[i % 5]
        busy.observe(1, k, one * interpolate(quiet, k) * rnd.uniform(0.9, 1.1))
    assert 0.1 < busy.width_scale < 0.25
    assert busy(8) == pytest.approx(1.28, rel=0.15) and busy(32) == pytest.approx(2.04, rel=0.25)
    assert busy.timed(8) == pytest.approx(2.58)  # the start-up tables themselves are kept

    # the same shape on a uniformly slower box: no change of shape to read
    same = StepCosts({1: 1.0, 8: 1.28, 32: 2.04}, forward_s=0.01, measured=True)
    for i in range(200):
        k = (2, 9, 33)[i % 3]
        same.observe(1, k, 0.02 * interpolate(same.table, k) * rnd.uniform(0.9, 1.1))
    assert same.width_scale == pytest.approx(1.0, abs=0.15)

    # forwards all of one width say nothing about the slope; a few forwards are not enough either
    flat = StepCosts({1: 1.0, 8: 2.58, 32: 7.5}, forward_s=0.02, measured=True)
    for _ in range(100):
        flat.observe(1, 17, 0.02)
    assert flat.width_scale == 1.0
    few = StepCosts({1: 1.0, 8: 2.58, 32: 7.5}, forward_s=0.02, measured=True)
    for k in (2, 33, 2, 33, 2):
        few.observe(1, k, 0.02)
    assert few.width_scale == 1.0
    # a lone forward after a long context is read at the tables' context: its 1-token time is longer
    long = StepCosts(
        {1: 1.0, 32: 2.0},
        forward_s=0.01,
        long_table={1: 1.0, 32: 2.0},
        long_forward_s=0.03,
        prefix=64,
        long_prefix=2064,
        measured=True,
    )
    for i in range(100):
        k, ctx = (2, 33)[i % 2], (64, 2064)[(i // 2) % 2]
        long.observe(1, k, long.one_s(ctx) * long(k, ctx), ctx)
    assert long.width_scale == pytest.approx(1.0, abs=1e-6)


def test_the_engine_feeds_its_lone_verify_forwards_to_the_width_fit(tiny_llama):
    """A lone request's verify forwards reach ``StepCosts.observe`` (its width fit), with the
    engine's own timings, and the output stays plain greedy's."""
    from hvd_ray.drafters.suffix import SuffixDrafter
    from hvd_ray.engine import Engine, SamplingParams
    from hvd_ray.engine.policy import Choice

    model = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    measured = measure_step_costs(model, widths=(1, 2, 4, 8, 16), prefix=16, reps=2, long_prefix=0)
    suffix = SuffixDrafter()
    seen = []

    class Observed(StepCosts):
        def observe(self, rows, tokens, seconds, context=0):
            seen.append((rows, tokens, context))
            super().observe(rows, tokens, seconds, context)

    from hvd_ray.engine.policy import DraftPolicy

    class Cached(DraftPolicy):  # a cost policy that always verifies the cache's draft
        costs = Observed(dict(measured.table), measured.forward_s, True)

        def __call__(self, req, engine):
            return Choice(suffix)

    prompts = [[5, 17, 33, 2, 5, 17, 33, 2, 5, 17], [11, 12, 13, 11, 12, 13, 11, 12]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [r.output for r in Engine(model, max_batch=1, max_len=128).generate(prompts, params)]
    policy = Cached()
    eng = Engine(model, drafters=[suffix], policy=policy, max_batch=1, max_len=128)
    reqs = eng.generate(prompts, params)
    assert [r.output for r in reqs] == plain
    steps = sum(len(r.stats.steps) for r in reqs)
    assert len(seen) == steps and all(rows == 1 for rows, _, _ in seen)
    assert any(tokens > 1 for _, tokens, _ in seen)  # drafted steps: a forward wider than one token
    assert len(prompts[0]) <= seen[0][2] < seen[1][2] < len(prompts[0]) + 24  # the context before each step
    assert policy.costs.fit[0] > 0


def test_a_cost_policy_with_a_cache_gets_a_cache_arm_by_default(tiny_llama):
    """A ``DraftPolicy`` with ``costs`` and a ``cache`` but no ``cache_choice`` of its own: the engine
    measures the cache arm too, whose steps the cache drafter drafts as it would alone, and a batch's
    output stays plain greedy's."""
    from hvd_ray.drafters.layerskip import LayerSkipDrafter
    from hvd_ray.drafters.suffix import SuffixDrafter
    from hvd_ray.engine import Engine, SamplingParams
    from hvd_ray.engine.policy import DraftPolicy
    from hvd_ray.engine.speculation_check import ARMS, CACHE

    model = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    suffix, skip = SuffixDrafter(), LayerSkipDrafter(model, [(1, "attn")], min_prob=0.0)

    class ModelFirst(DraftPolicy):  # always the model drafter; the cache arm is the engine's to try
        costs = StepCosts({1: 1.0, 8: 1.1, 16: 1.3})
        cache = suffix

        def __call__(self, req, engine):
            return skip

    prompts = [[5, 17, 33, 2, 5, 17, 33, 2, 5, 17], [11, 12, 13, 11, 12, 13, 11, 12]] * 2
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [r.output for r in Engine(model, max_batch=4, max_len=128).generate(prompts, params)]
    eng = Engine(model, drafters=[suffix, skip], policy=ModelFirst(), max_batch=4, max_len=128)
    assert eng.check.names == ARMS
    reqs = eng.generate(prompts, params)
    assert [r.output for r in reqs] == plain
    cache_steps = [s for r in reqs for s in r.stats.steps if s.arm == CACHE]
    assert cache_steps and all(s.source == "none" or s.source.startswith("suffix") for s in cache_steps)


def test_batch_lengths_weigh_each_row_s_own_tokens_against_its_gain():
    costs = StepCosts({1: 1.0, 8: 1.2, 16: 2.0, 64: 6.0})
    # eight rows, one with a 16-token draft worth 1.5 tokens: its first token pays (9 tokens at
    # cost 1.3 against 8 at 1.2), the second (worth 0.5) not; the plain rows pay for none of it
    gains = [[0.0]] * 7 + [[min(j, 1.5) for j in range(17)]]
    assert batch_lengths([0] * 7 + [16], gains, costs) == [0] * 7 + [1]
    # alone, its first 2 tokens pay (2.5 tokens at cost 1.03 against 1 token at 1.0), the rest not
    assert batch_lengths([16], [gains[-1]], costs) == [2]
    # eight rows that each expect 0.9 of one draft token and little more: one token each
    one = [[0.0, 0.9, 1.2, 1.3]] * 8
    assert batch_lengths([3] * 8, one, costs) == [1] * 8
    # a confident long draft beside seven plain rows is verified whole (40 tokens, not 8 x 33)
    sure = [float(j) for j in range(33)]
    assert batch_lengths([0] * 7 + [32], [[0.0]] * 7 + [sure], costs) == [0] * 7 + [32]
    # the tokens go where they are expected to be accepted: the sure row first, a doubtful one not at all
    doubtful = [0.0, 0.1, 0.15, 0.2]
    assert batch_lengths([3, 32], [doubtful, sure], costs) == [0, 32]
    assert batch_lengths([0, 0], [[0.0], [0.0]], costs) == [0, 0]


def test_the_batch_lengths_are_sized_before_the_model_drafter_runs(tiny_llama):
    """Under a cost policy the engine decides a batch's draft lengths before drafting: at length 0
    the model drafter is not asked at all (its drafts would be thrown away), otherwise it is asked
    for no more than the length; the records say the length was cut (the cost policy does not learn
    the drafter's acceptance from them), and the output stays plain greedy's."""
    from hvd_ray.drafters.layerskip import LayerSkipDrafter
    from hvd_ray.engine import Engine, SamplingParams
    from hvd_ray.engine.policy import Choice

    model = Transformer.from_pretrained(tiny_llama, dtype=torch.float32)
    asked = []

    class Counted(LayerSkipDrafter):
        def propose(self, reqs):
            asked.extend(r.max_tokens for r in reqs)
            return super().propose(reqs)

    drafter = Counted(model, [(1, "attn")], min_prob=0.0)

    from hvd_ray.engine.policy import DraftPolicy

    class Expecting(DraftPolicy):  # a cost policy that always picks the model drafter and expects `gain` tokens
        costs = StepCosts({1: 1.0, 8: 1.2, 16: 2.0, 64: 6.0})

        def __init__(self, gain: float):
            self.gain = gain

        def __call__(self, req, engine):
            return Choice(drafter, gains=[min(float(j), self.gain) for j in range(engine.num_draft_tokens + 1)])

    prompts = [[5, 17, 33, 2], [11, 12, 13, 11], [200, 3, 45, 45]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = [r.output for r in Engine(model, max_batch=4, max_len=64).generate(prompts, params)]
    # 3 rows: expecting nothing, no draft pays; 2 tokens each, a 3 x 3-wide step; 6 each, the whole budget
    for gain, cap in ((0.0, 0), (2.0, 2), (6.0, 6)):
        assert batch_lengths([6] * 3, [[min(float(j), gain) for j in range(7)]] * 3, Expecting.costs) == [cap] * 3
        asked.clear()
        eng = Engine(model, drafters=[drafter], policy=Expecting(gain), max_batch=4, max_len=64, num_draft_tokens=6)
        reqs = eng.generate(prompts, params)
        assert [r.output for r in reqs] == plain
        shared = [s for r in reqs for s in r.stats.steps[:2]]  # the first steps: all three rows decode together
        if cap == 0:
            assert not asked and all(s.capped and s.source == "none" for s in shared)
        else:
            assert asked and max(asked) <= cap and all(s.drafted <= cap for s in shared)
            assert all(s.capped == (cap < 6) for s in shared)


def test_the_suffix_cache_drafts_past_the_model_budget_losslessly(default_folder):
    """num_draft_tokens caps model drafts; the suffix cache drafts by its match up to
    cache_draft_tokens (as SuffixDecoding), and the output is still plain greedy's (fp32)."""
    from transformers import AutoTokenizer

    from hvd_ray.drafters.suffix import SuffixDrafter
    from hvd_ray.engine import Engine, SamplingParams

    model = Transformer.from_pretrained(default_folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(default_folder)
    text = "def add(a, b):\n    return a + b\n\n" * 3
    ids = tok(text, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=40)
    plain = Engine(model, max_batch=1, max_len=256, num_draft_tokens=0).generate([ids], params)[0].output
    eng = Engine(model, drafters=[SuffixDrafter()], max_batch=1, max_len=256, num_draft_tokens=4)
    assert eng.cache_draft_tokens == 64
    req = eng.generate([ids], params)[0]
    assert req.output == plain
    assert max(s.drafted for s in req.stats.steps) > 4  # the repeated text drafts long
    assert Engine(model, max_batch=1, max_len=256, num_draft_tokens=0).cache_draft_tokens == 0


def test_one_slow_drafted_step_does_not_turn_a_batch_plain():
    """A drafted step that also catches EAGLE-3 up on a new prompt takes several plain steps' time
    once: it counts for at most ``outlier`` average steps, so that one step does not outweigh the
    rest, and plain must measure ``margin`` faster before it is preferred."""
    from hvd_ray.engine.speculation_check import CACHE, PLAIN, SpeculationCheck

    check = SpeculationCheck()
    for i in range(40):  # drafted: 12 tokens in 0.15 s (80 tok/s); plain: 8 in 0.15 s (53 tok/s)
        check.record(8, CACHE, 12, 0.15)
        if i % 4 == 0:
            check.record(8, PLAIN, 8, 0.15)
    w = check.arms[(8, CACHE)][2] * (1 - check.adapt)  # the earlier steps' weight, one step on
    check.record(8, CACHE, 8, 0.9)  # the catch-up step: 8.9 tok/s, counted as 0.45 s
    assert check.rate(8, CACHE) == pytest.approx((w * 12 + 8) / (w * 0.15 + 0.45))
    assert check.preferred(8) == CACHE
    check.arms[(8, PLAIN)][0] = 1.05 * check.rate(8, CACHE) * check.arms[(8, PLAIN)][1]  # within the margin
    assert check.preferred(8) == CACHE
    check.arms[(8, PLAIN)][0] = 1.2 * check.rate(8, CACHE) * check.arms[(8, PLAIN)][1]
    assert check.preferred(8) == PLAIN


def test_a_rarely_measured_arm_follows_its_latest_steps():
    """An arm's sums are discounted per step at its batch size, not per step of its own: the cache
    arm, measured at the cold start (an empty global tree) and then only every 16th step while the
    policy's arm leads, takes over once its recent steps are faster; per-sample averages kept ~70 %
    of its weight on the cold steps after three retries, and the batch stayed on the slower arm."""
    from hvd_ray.engine.speculation_check import CACHE, PLAIN, POLICY, SpeculationCheck

    check = SpeculationCheck()
    speed = {CACHE: (2, 0.1), POLICY: (12, 0.1), PLAIN: (8, 0.1)}  # tokens, seconds: the cold start
    for _ in range(24):
        arm = check.arm(16)
        check.record(16, arm, *speed[arm])
    assert check.preferred(16) == POLICY
    speed[CACHE] = (20, 0.1)  # the tree now holds answers: 200 tok/s against the policy's 120
    picked = []
    for _ in range(80):
        arm = check.arm(16)
        picked.append(arm)
        check.record(16, arm, *speed[arm])
    assert check.preferred(16) == CACHE and picked[-16:].count(CACHE) >= 14
    got = check.summary()["16"]  # what GET /stats shows operators
    assert got["preferred"] == CACHE and set(got["arms"]) == {CACHE, POLICY, PLAIN}
    assert got["arms"][CACHE]["tokens_per_s"] == pytest.approx(check.rate(16, CACHE), abs=0.05)
    assert sum(a["steps"] for a in got["arms"].values()) == 104


def test_a_batch_drafts_the_way_that_measures_fastest():
    """Per batch size, the three arms (the cache drafter's own drafts, the policy's choices, none)
    are measured and the fastest taken; the others are retried on a schedule so a change of load
    or prompts is seen; a lone request is always the policy's."""
    from hvd_ray.engine.speculation_check import CACHE, PLAIN, POLICY, SpeculationCheck

    with pytest.raises(ValueError, match="a drafted one first"):
        SpeculationCheck(arms=(PLAIN, CACHE))
    check = SpeculationCheck(explore_plain=64, explore_drafts=16, min_steps=3)
    assert all(check.arm(1) == POLICY for _ in range(100))
    speed = {CACHE: (10, 0.1), POLICY: (12, 0.2), PLAIN: (8, 0.15)}  # tokens, seconds of one step
    picked = []
    for _ in range(300):
        arm = check.arm(8)
        picked.append(arm)
        check.record(8, arm, *speed[arm])
    assert check.preferred(8) == CACHE and check.rate(8, POLICY) == pytest.approx(60.0)
    late = picked[100:]
    assert late.count(POLICY) == 9 and late.count(PLAIN) == 3  # every 16th step (plain's 64th first)
    # the policy's drafts start to pay (a warm cache it rates well): it must beat the cache by ``switch``
    speed[POLICY] = (11.2, 0.1)  # 12 % faster: not enough
    for _ in range(200):
        arm = check.arm(8)
        check.record(8, arm, *speed[arm])
    assert check.preferred(8) == CACHE
    speed[POLICY] = (14, 0.1)  # (its average, retried every 16th step, passes the bar after ~200 steps)
    picked = []
    for _ in range(400):
        arm = check.arm(8)
        picked.append(arm)
        check.record(8, arm, *speed[arm])
    assert check.preferred(8) == POLICY and picked[-100:].count(POLICY) > 85
    # batch sizes are measured apart; one not measured yet decides as the nearest measured one, and
    # measures its own arms on the regular schedule, not every fourth step
    assert check.rate(4, CACHE) is None and check.preferred(4) == POLICY
    early = [check.arm(4) for _ in range(15)]
    assert early.count(POLICY) == 15
    # without a cache drafter: the policy's choices or none
    two = SpeculationCheck(arms=(POLICY, PLAIN))
    assert {two.arm(8) for _ in range(64)} == {POLICY, PLAIN}
