"""The benchmark script runs end to end (a smoke test; its timings are not asserted)."""

import jax
import pytest

from specjax import theory
from specjax.tools import bench, synthetic


@pytest.mark.slow  # the suite's time on 2 cores (-m slow runs it)
def test_synthetic_bench_runs_and_stays_exact(capsys):
    runs = synthetic.run_synthetic(size="llama-tiny", draft_layers=2, ks=(2,), batches=(1, 2), max_new_tokens=16,
                                   repeats=1, widths=(1, 4))
    assert [(r.drafter, r.batch) for r in runs] == [(d, b) for b in (1, 2) for d in ("none", "small", "target")]
    assert all(r.exact for r in runs if r.drafter != "none")
    assert runs[2].acceptance > 0.9  # the target drafting for itself
    out = capsys.readouterr().out
    assert "weight-read roofline" in out and "pass cost by width" in out and "tok/s" in out


def test_the_synthetic_draft_is_the_targets_own_first_layers():
    """Shared arrays, not copies; the later layers' residual writes scaled down."""
    import jax.numpy as jnp
    import numpy as np

    target, draft = synthetic.build_synthetic_pair("llama-tiny", 2, dtype=jnp.bfloat16)
    assert draft.config.num_layers == 2 and target.dtype == jnp.bfloat16
    assert all(a is b for a, b in zip(jax.tree.leaves(draft.params["layers"]), jax.tree.leaves(target.params["layers"])))
    assert draft.params["embedding"] is target.params["embedding"]
    o = [float(jnp.abs(layer["attn"]["o_kernel"].astype(jnp.float32)).mean()) for layer in target.params["layers"]]
    np.testing.assert_allclose(np.array(o[2:]) / np.mean(o[:2]), synthetic.FAINT["llama"], rtol=0.2)


def test_per_position_acceptance():
    # steps emitting 3, 1, 2 tokens (then a cut last step): n = 2, 0, 1
    assert bench.per_position_acceptance([[3, 1, 2, 1]], 3) == [2 / 3, 1 / 2, 0.0]


def test_theory():
    assert theory.expected_tokens_per_pass(0.0, 4) == 1.0
    assert theory.expected_tokens_per_pass(1.0, 4) == 5.0
    assert abs(theory.expected_tokens_per_pass(0.5, 2) - 1.75) < 1e-12
    assert abs(theory.predicted_speedup(0.5, 2, 0.1) - 1.75 / 1.2) < 1e-12
    for alpha in (0.3, 0.8):
        accepted = sum(alpha ** i for i in range(1, 5))
        assert abs(theory.alpha_from_accepted(accepted, 4) - alpha) < 1e-6
    assert theory.best_num_draft_tokens(0.9, 0.05) > theory.best_num_draft_tokens(0.5, 0.05)


@pytest.mark.slow
def test_tree_bench_runs_and_stays_exact(capsys):
    from specjax import Tree

    target, small = synthetic.build_synthetic_pair("tiny", 2)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    auto, rows = bench.time_generate(target, prompts, 1, 1, max_new_tokens=16)
    report = bench.run_trees(target, small, prompts, auto, rows, 16, 1, 64, trees=(Tree(3, 2, 6),))
    assert [r["shape"] for r in report["runs"]] == ["chain 3", "tree d3 k2 n6"] * 2
    assert all(r["exact"] for r in report["runs"])
    assert set(report["verify_cost"]) >= {1, 7}
    assert "trees vs chains" in capsys.readouterr().out


@pytest.mark.slow
def test_heads_bench_runs_and_stays_exact(capsys):
    """The draft model, Medusa and EAGLE rows (chain and tree) on a tiny synthetic pair:
    every output equal to autoregressive, acceptance given for each depth."""
    import jax

    import specjax

    target, small = synthetic.build_synthetic_pair("tiny", 2)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    auto, rows = bench.time_generate(target, prompts, 1, 1, max_new_tokens=8)
    trained = {"Medusa": specjax.Medusa.init(target, 3, jax.random.key(0)),
               "EAGLE": specjax.Eagle.init(target, jax.random.key(0))}
    report = bench.run_heads(target, small, trained, prompts, auto, rows, 8, 1)
    runs = report["runs"]
    assert [(r["drafter"], r["shape"].split()[0]) for r in runs] == [
        (name, shape) for name in ("draft model", "Medusa", "EAGLE") for shape in ("chain", "tree")]
    assert all(r["exact"] for r in runs)
    assert [len(r["depth_acceptance"]) for r in runs] == [5, 6, 3, 3, 5, 6]
    assert "trained heads" in capsys.readouterr().out


@pytest.mark.slow
def test_training_free_and_auto_k_benches_run_and_stay_exact(capsys):
    """Lookahead and retrieval rows beside prompt lookup and the draft model, every output
    equal to autoregressive; auto K's choice printed beside every fixed K per batch size."""
    import specjax

    target, small = synthetic.build_synthetic_pair("tiny", 2)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8]]
    auto, rows = bench.time_generate(target, prompts, 1, 1, max_new_tokens=8)
    report = bench.run_training_free(target, small, None, prompts, auto, rows, 8, 1, K=3,
                                     lookaheads=(specjax.Lookahead(3, 3, 2),))
    assert [r["drafter"] for r in report["runs"]] == [
        "draft model", "prompt lookup", "lookahead W3 N3 G2", "REST, own outputs chain", "REST, own outputs tree"]
    assert all(r["exact"] for r in report["runs"])
    assert report["runs"][-2]["tokens_per_pass"] > 2.5  # the datastore holds the text being generated
    trees = (specjax.theory.TreeBudgets(2, 2, (2,), ((1.1,), (3.0,)), ((0.9, 0.5),)),)
    profile = specjax.CostProfile((1, 2), ((1.0, 1.2), (1.0, 2.1)), (0.9,), trees)
    report = bench.run_auto(target, small, prompts, (1, 2), (1,), 8, 1, profile)
    chain, (tree,) = report["chain"]["rows"], report["trees"]
    assert [(r["batch"], r["auto_k"]) for r in chain] == [(1, 1), (2, 0)]
    assert set(chain[0]["tokens_per_s"]) == {0, 1}
    assert tree["unit"] == "nodes" and [(r["batch"], r["auto_k"]) for r in tree["rows"]] == [(1, 2), (2, 0)]
    out = capsys.readouterr().out
    assert "num_draft_tokens='auto' vs fixed K" in out and "vs fixed nodes for Tree(2, 2, n)" in out
def test_first_divergence():
    assert bench.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert bench.first_divergence([1, 2], [1, 2, 3]) == 2  # ended early (an EOS the other lacks)


@pytest.mark.slow  # test_synthetic_bench runs the bench; the GPU runs take --profile
def test_measure_profile_writes_what_its_runs_measured(tmp_path):
    """`specjax bench --profile` on the shipped pair, tiny settings: one step per K and per
    tree budget, and acceptance and reach equal to those of independent runs of each shape."""
    from pathlib import Path

    from specjax import DraftModel, Tree
    from specjax.hf import load_model
    from specjax.text import load_tokenizer

    root = Path(__file__).parent.parent / "checkpoints"
    target_path, draft_path = str(root / "target"), str(root / "draft")
    lines = []
    profile = bench.measure_profile(target_path, draft_path, str(tmp_path), max_k=2, batches=(1,), num_prompts=2,
                                    prompt_tokens=16, max_new_tokens=8, repeats=1, tree_family=(2, 2),
                                    tree_nodes=(2, 3), log=lines.append)
    assert profile.batches == (1,) and len(profile.step_ms[0]) == 3 and min(profile.step_ms[0]) > 0
    (family,) = profile.trees
    assert (family.depth, family.top_k, family.nodes) == (2, 2, (2, 3)) and len(family.step_ms[0]) == 2
    target, draft = load_model(target_path), load_model(draft_path)
    prompts = bench.held_out_prompts(load_tokenizer(target_path), 2, 16, seed=1)
    chain, _ = bench.time_generate(target, prompts, 1, 1, draft, 2, max_new_tokens=8)
    assert list(profile.acceptance) == bench.per_position_acceptance(chain.traces, 2)
    for n, reach in zip(family.nodes, family.reach):
        tree, _ = bench.time_generate(target, prompts, 1, 1, DraftModel(draft, Tree(2, 2, n)), None, max_new_tokens=8)
        assert list(reach) == bench.depth_acceptance(tree.traces, 2)
    assert theory.CostProfile.load(tmp_path / "profile.json") == profile
    assert profile.meta["command"].endswith("--profile-tree 2,2 --tree-nodes 2 3")
    assert any("num_draft_tokens='auto' picks K = " in line for line in lines)


@pytest.mark.slow  # the suite's time on 2 cores (-m slow runs it)
def test_specjax_bench_with_no_flags_is_a_quick_side_by_side(tmp_path, capsys):
    """`specjax bench` alone: plain vs the draft's chain, greedy, batch 1, in interleaved
    rounds, a line per pair printed as measured (the median speedup and the rounds' spread)
    and quick.json written (here on two prompts at K = 2, three rounds, briefly)."""
    import json

    from specjax.cli import main

    main(["bench", "--num-prompts", "2", "--prompt-tokens", "16", "--max-new-tokens", "8", "--repeats", "3",
          "-k", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.startswith(" 0.0")]
    assert [(line[2], line[-1]) for line in lines] == [("2", "yes")], out
    report = json.loads((tmp_path / "quick.json").read_text())
    assert [r["speculative"]["K"] for r in report["runs"]] == [2]
    ratios = report["runs"][0]["speculative"]["ratios"]
    assert len(ratios) == 3 and ratios == sorted(ratios) and report["runs"][0]["speculative"]["speedup"] == ratios[1]
    assert lines[0][6] == f"{ratios[0]:.2f}-{ratios[-1]:.2f}", out
    noisy = ratios[-1] - ratios[0] > 0.15 * ratios[1]
    assert ("too noisy to tell" in out) == noisy, out
    assert all(r["plain"]["drafter"] == "none" and r["speculative"]["exact"] for r in report["runs"])
