"""num_draft_tokens="auto": the choice of K, or of a dynamic tree's node budget, from a cost
profile (pure arithmetic), the profile's JSON and refusals, the shipped CPU default, and
generate picking K or the budget (or turning speculation off) per batch size with its
output unchanged."""

import json

import numpy as np
import pytest

import specjax
from specjax import theory
from specjax.theory import CostProfile, TreeBudgets, choose_num_draft_tokens, choose_tree_nodes, expected_tokens_per_step
from specjax.tree import Tree


def profile(target_ms, draft_ms, acceptance, batches=None):
    """A profile whose step with K drafts costs a target pass over K+1 tokens and K draft steps."""
    batches = batches or tuple(range(1, len(target_ms) + 1))
    steps = tuple(tuple(t + K * d for K, t in enumerate(row)) for row, d in zip(target_ms, draft_ms))
    return CostProfile(tuple(batches), steps, tuple(acceptance))


def test_expected_tokens_per_step():
    assert expected_tokens_per_step([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens_per_step([0.5, 0.5, 0.5], 2) == 1.75
    assert expected_tokens_per_step([1.0, 0.0, 1.0], 3) == 2.0  # nothing past a sure rejection
    with pytest.raises(ValueError, match="known for 3 positions"):
        expected_tokens_per_step([0.5] * 3, 4)


def test_free_verification_and_sure_acceptance_take_the_deepest_k():
    p = profile([[10.0] * 9], [0.0], [1.0] * 8)
    # 72 new tokens: 9 a step at K = 8 take 8 steps, 8 a step 9 (at 64, K = 7 and 8 tie on 8
    # steps and the smaller K wins).
    assert choose_num_draft_tokens(p, 1, max_new_tokens=72) == 8
    assert choose_num_draft_tokens(p, 1, max_new_tokens=64) == 7
    assert choose_num_draft_tokens(p, 1, max_k=5, max_new_tokens=72) == 5


def test_speculation_is_off_where_it_loses():
    # Verification costs grow with every token and drafts are rarely accepted: K = 0.
    assert choose_num_draft_tokens(profile([[10.0 * t for t in range(1, 10)]], [1.0], [0.3] * 8), 1) == 0
    # Nothing is ever accepted: K = 0 even when passes are free.
    assert choose_num_draft_tokens(profile([[10.0] * 9], [0.0], [0.0] * 8), 1) == 0


def test_k_shrinks_with_the_batch():
    """Batch 1 verifies 9 tokens for the price of 1 (memory bound); batch 16 pays for every
    token (compute bound): speculation on at 1, off at 16, in between at batch 4."""
    flat = [10.0 + 0.2 * t for t in range(1, 10)]
    steep = [40.0 * t for t in range(1, 10)]
    middle = [(f + s) / 2 for f, s in zip(flat, steep)]
    p = profile([flat, middle, steep], [1.0, 2.0, 4.0], [0.8] * 8, batches=(1, 8, 16))
    ks = [choose_num_draft_tokens(p, b) for b in (1, 4, 8, 16, 64)]
    assert ks[0] >= 4 and ks[3] == 0 and ks[4] == 0
    assert ks == sorted(ks, reverse=True), ks
    # Interpolation between measured batch sizes, and the smallest's costs below it.
    assert p.cost(4, 0) == pytest.approx(flat[0] + (middle[0] - flat[0]) * 3 / 7)
    assert p.cost(1, 2) == pytest.approx(flat[2] + 2 * 1.0)


def test_per_position_acceptance_matters():
    """The same mean acceptance, front-loaded or back-loaded, gives different choices."""
    costs = [[10.0 + 2.0 * t for t in range(1, 10)]]
    front = choose_num_draft_tokens(profile(costs, [1.0], [0.95, 0.9, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1]), 1)
    assert front == 2


def test_profile_json_round_trip_and_refusals(tmp_path):
    p = profile([[1.0, 2.0, 3.0]], [0.5], [0.7, 0.6])
    p.save(tmp_path / "p.json")
    back = CostProfile.load(tmp_path / "p.json")
    assert back == p and back.max_k == 2
    d = p.to_dict()
    for change, message in [
        (lambda d: d.update(format="x"), "not a specjax cost profile"),
        (lambda d: d.update(version=9), "version 9"),
        (lambda d: d.pop("acceptance"), "lacks 'acceptance'"),
        (lambda d: d.update(acceptance=[1.5]), r"lie in \[0, 1\]"),
        (lambda d: d.update(batches=[4, 1], step_ms=[[1.0], [1.0]]), "ascending"),
        (lambda d: d.update(step_ms=[[1.0], [1.0]]), "one entry per batch size"),
        (lambda d: d.update(step_ms=[[1.0, -2.0]]), "positive times"),
        (lambda d: d.update(version=1), "measure it again"),
    ]:
        bad = json.loads(json.dumps(d))
        change(bad)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            CostProfile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="no cost profile at"):
        CostProfile.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="prices K in 0..2"):
        p.cost(1, 3)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        choose_num_draft_tokens(p, 0)


def test_shipped_cpu_profile():
    p = theory.default_profile("cpu")
    assert p.max_k >= 4 and p.meta["backend"] == "cpu"
    for batch in (1, 2, 4, 8, 16, 64):
        assert 0 <= choose_num_draft_tokens(p, batch) <= p.max_k
    with pytest.raises(ValueError, match="no cost profile is shipped for the 'nothing' backend"):
        theory.default_profile("nothing")


def test_generate_auto_picks_k_per_batch(pair, tmp_path):
    """A profile that speculates at batch 1 only: batch 1 drafts at most its K per step,
    batch 2 drafts nothing; the output is the target's greedy output either way."""
    target, drafts, _ = pair
    flat = [10.0] * 4 + [1000.0] * 5  # passes over 1..4 tokens cost the same, more cost a lot
    steep = [10.0 * t for t in range(1, 10)]
    p = profile([flat, steep], [0.1, 5.0], [0.9] * 8)
    assert [choose_num_draft_tokens(p, b) for b in (1, 2)] == [3, 0]
    p.save(tmp_path / "profile.json")
    prompts = [[5, 6, 7, 8], [9, 10]]
    for batch in (1, 2):
        padded, lengths = specjax.pad_prompts(prompts[:batch], bucket=16)
        plain = specjax.generate(target, padded, lengths, max_new_tokens=10)
        out = specjax.generate(target, padded, lengths, draft=drafts["near"], max_new_tokens=10,
                               num_draft_tokens="auto", cost_profile=str(tmp_path / "profile.json"))
        np.testing.assert_array_equal(out.tokens, plain.tokens)
        if batch == 1:
            assert 0 < out.stats.drafted[0] <= 3 * out.stats.steps[0]
        else:
            assert int(out.stats.drafted.sum()) == 0


def test_auto_refusals(pair):
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts([[5, 6]], bucket=16)
    for kw, error, message in [
        (dict(num_draft_tokens="auto"), ValueError, "needs a draft"),
        (dict(draft=drafts["near"], num_draft_tokens="best"), ValueError, "an int, None or 'auto'"),
        (dict(draft=specjax.DraftModel(drafts["near"], Tree.from_paths([(0,), (1,)])), num_draft_tokens="auto"),
         ValueError, "static tree"),
        (dict(draft=specjax.DraftModel(drafts["near"], Tree(2, 2, 3)), num_draft_tokens="auto"),
         ValueError, r"not Tree\(2, 2, n\): measure that family"),
        (dict(draft=specjax.Lookahead(3, 3, 2), num_draft_tokens="auto"), ValueError, "Lookahead's shape"),
        (dict(draft=drafts["near"], cost_profile="p.json"), ValueError, "only with num_draft_tokens='auto'"),
        (dict(draft=drafts["near"], num_draft_tokens="auto", cost_profile=3), TypeError, "cost_profile must be"),
    ]:
        with pytest.raises(error, match=message):
            specjax.generate(target, padded, lengths, max_new_tokens=2, **kw)



def test_a_longer_pass_never_looks_cheaper():
    """Timing noise (a 5-token pass measured faster than a 4-token one) is evened out upwards."""
    p = profile([[10.0, 12.0, 14.0, 30.0, 11.0, 40.0]], [0.0], [0.9] * 5)
    assert p.cost(1, 4) == 30.0 and p.cost(1, 3) == 30.0 and p.cost(1, 5) == 40.0
    assert choose_num_draft_tokens(p, 1) == 2


def test_the_slowest_row_sets_a_batch_s_steps():
    """A batch runs until its slowest row is done: with uncertain acceptance the expected
    steps grow with the batch (and shrink with certainty), and the choice follows."""
    reach = theory.chain_reach((0.7,) * 4, 4)
    steps = [theory.expected_steps(reach, b, 64) for b in (1, 4, 16)]
    assert steps[0] < steps[1] < steps[2]
    assert 64 / expected_tokens_per_step([0.7] * 4, 4) == pytest.approx(steps[0], rel=0.1)
    assert theory.expected_steps((1.0,) * 4, 16, 64) == 13.0  # 5 tokens a step, surely
    assert theory.expected_steps((), 16, 64) == 64.0
    # Equal step costs at both batch sizes: speculation pays at batch 1 and not at 16,
    # only because batch 16 waits for its slowest row.
    p = profile([[10.0, 16.0], [10.0, 16.0]], [0.0, 0.0], [0.7], batches=(1, 16))
    assert [choose_num_draft_tokens(p, b, min_gain=1.0) for b in (1, 16)] == [1, 0]


def test_an_engine_s_slots_weigh_one_row_s_tokens():
    """An engine refills a slot as its row finishes, so it weighs one row's expected tokens a
    step, not the slowest row's: at the step costs above (10 and 16 ms, acceptance 0.7) K = 1
    pays for 16 rows (1.7 tokens in 1.6x the time) where a batch of 16 does not; 0 is off
    unless a K beats it by min_gain; without K = 0 among the choices, the best K."""
    choose = theory.choose_slot_k
    assert choose((0.7,), {0: 10.0, 1: 16.0}, 16, min_gain=1.0) == 1
    assert choose((0.7,), {0: 10.0, 1: 16.0}, 16) == 0  # 1.06x: under MIN_GAIN
    assert choose((0.9, 0.9), {0: 10.0, 1: 16.0, 2: 19.0}, 8) == 2  # 2.71 tokens in 1.9x the time
    assert choose((0.5, 0.2), {0: 10.0, 1: 16.0, 2: 19.0}, 8) == 0  # 1.5 tokens in 1.6x, 1.6 in 1.9x
    assert choose((0.5, 0.2), {1: 16.0, 2: 19.0}, 8) == 1  # speculation cannot be off: the best K
    assert choose((0.9,), {0: 5.0}, 3) == 0
    for bad in ({}, {0: 10.0, 1: 0.0}):
        with pytest.raises(ValueError, match="step_ms must price"):
            choose((0.7,), bad, 1)


def test_a_small_predicted_gain_leaves_speculation_off():
    """K = 1 is predicted ~6% faster than plain decoding at batch 1: within a measured
    profile's noise, so off by default (min_gain 1.1) and on when any gain will do; the
    same for a tree's budget."""
    p = profile([[10.0, 16.0]], [0.0], [0.7])
    gain = theory.tokens_per_ms(p, 1, 1) / theory.tokens_per_ms(p, 1, 0)
    assert 1.0 < gain < theory.MIN_GAIN
    assert choose_num_draft_tokens(p, 1) == 0 and choose_num_draft_tokens(p, 1, min_gain=1.0) == 1
    t = tree_profile([[16.0, 30.0, 40.0]], [(0.7, 0.0, 0.0), (0.8, 0.1, 0.0), (0.8, 0.2, 0.0)], batches=(1,),
                     chain_ms=[[10.0, 16.0]])
    assert 1.0 < theory.tree_tokens_per_ms(t, 3, 2, 2, 1) / theory.tokens_per_ms(t, 1, 0) < theory.MIN_GAIN
    assert choose_tree_nodes(t, 3, 2, 1, 6) == 0 and choose_tree_nodes(t, 3, 2, 1, 6, min_gain=1.0) == 2
    with pytest.raises(ValueError, match="min_gain must be >= 1"):
        choose_num_draft_tokens(p, 1, min_gain=0.9)


def tree_profile(step_ms, reach, nodes=(2, 4, 6), batches=(1, 2), chain_ms=None):
    """A chain profile (K = 0 at 10 ms) with one Tree(3, 2, n) family."""
    chain_ms = chain_ms or [[10.0, 12.0]] * len(batches)
    return CostProfile(batches, tuple(map(tuple, chain_ms)), (0.5,),
                       (TreeBudgets(3, 2, nodes, tuple(map(tuple, step_ms)), tuple(map(tuple, reach))),))


def test_tree_budget_trades_reach_for_step_cost():
    """A larger budget reaches deeper; it is chosen while its deeper reach pays for its step,
    never past the tree's own nodes, and not at all where every budget loses."""
    reach = [(0.6, 0.2, 0.05), (0.8, 0.5, 0.3), (0.9, 0.7, 0.5)]
    cheap = tree_profile([[11.0, 11.5, 12.0], [11.0, 40.0, 60.0]], reach)
    assert choose_tree_nodes(cheap, 3, 2, batch=1, max_nodes=6) == 6
    assert choose_tree_nodes(cheap, 3, 2, batch=1, max_nodes=5) == 4  # the tree's own nodes cap it
    assert choose_tree_nodes(cheap, 3, 2, batch=2, max_nodes=6) == 2  # 4 and 6 cost too much at batch 2
    steep = tree_profile([[30.0, 40.0, 50.0]] * 2, reach)
    assert choose_tree_nodes(steep, 3, 2, batch=1, max_nodes=6) == 0  # speculation off
    # the prediction behind the choice: tokens over expected steps times the measured step
    expected = 64 / (theory.expected_steps(reach[2], 1, 64) * 12.0)
    assert theory.tree_tokens_per_ms(cheap, 3, 2, 6, 1) == pytest.approx(expected)
    for call, message in [
        (lambda: choose_tree_nodes(cheap, 4, 2, 1, 6), r"measured Tree\(3, 2, n\), not Tree\(4, 2, n\)"),
        (lambda: choose_tree_nodes(cheap, 3, 2, 1, 1), "none within this tree's 1 nodes"),
        (lambda: theory.tree_tokens_per_ms(cheap, 3, 2, 5, 1), "not n = 5"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()


def test_tree_budgets_json_round_trip_and_refusals(tmp_path):
    p = tree_profile([[11.0, 11.5, 12.0], [11.0, 40.0, 60.0]], [(0.6, 0.2, 0.05), (0.8, 0.5, 0.3), (0.9, 0.7, 0.5)])
    p.save(tmp_path / "p.json")
    assert CostProfile.load(tmp_path / "p.json") == p
    for change, message in [
        (lambda t: t.update(reach=[[0.6, 0.7, 0.1]] * 3), "never grow with depth"),
        (lambda t: t.update(reach=[[0.6, 0.2]] * 3), "one value per depth 1..3"),
        (lambda t: t.update(step_ms=[[1.0, 2.0]] * 2), "one positive time per budget"),
        (lambda t: t.update(step_ms=[[1.0, 2.0, 3.0]]), "one entry per batch size"),
        (lambda t: t.update(nodes=[4, 2, 6]), "ascending"),
        (lambda t: t.pop("reach"), "lacks 'reach'"),
    ]:
        bad = json.loads(json.dumps(p.to_dict()))
        change(bad["trees"][0])
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            CostProfile.load(tmp_path / "bad.json")


def test_generate_auto_picks_a_node_budget_per_batch(pair):
    """A profile that verifies a 4-node tree at batch 1 and nothing at batch 2: batch 1
    verifies at most 4 of the tree's 6 nodes per step, batch 2 drafts nothing; the output is
    the target's greedy output either way."""
    target, drafts, _ = pair
    p = tree_profile([[10.5, 11.0, 40.0], [30.0, 40.0, 50.0]], [(0.9, 0.5, 0.2), (0.95, 0.8, 0.6), (1.0, 0.9, 0.8)])
    assert [choose_tree_nodes(p, 3, 2, b, 6) for b in (1, 2)] == [4, 0]
    drafter = specjax.DraftModel(drafts["near"], Tree(3, 2, 6))
    prompts = [[5, 6, 7, 8], [9, 10]]
    for batch in (1, 2):
        padded, lengths = specjax.pad_prompts(prompts[:batch], bucket=16)
        plain = specjax.generate(target, padded, lengths, max_new_tokens=10)
        out = specjax.generate(target, padded, lengths, draft=drafter, max_new_tokens=10,
                               num_draft_tokens="auto", cost_profile=p)
        np.testing.assert_array_equal(out.tokens, plain.tokens)
        if batch == 1:
            assert 0 < out.stats.drafted[0] <= 4 * out.stats.steps[0] and out.stats.accepted[0] > 0
        else:
            assert int(out.stats.drafted.sum()) == 0


def test_auto_without_a_profile_for_the_backend_decodes_plainly(pair):
    """No profile ships for GPUs: 'auto' there is plain decoding (never slower), with a warning
    that says how to measure one; CPU's shipped profile is found as before."""
    from specjax.generate import auto_shape

    _, drafts, _ = pair
    assert theory.resolve_profile(None, "gpu") is None
    with pytest.warns(UserWarning, match="no cost profile for the 'gpu' backend.*specjax bench --profile"):
        assert auto_shape(1, drafts["near"], backend="gpu") == (None, None)
    assert theory.resolve_profile(None, "cpu") == theory.default_profile("cpu")
