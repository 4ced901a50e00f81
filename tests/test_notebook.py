"""specjax.tools.notebook: the small-mode switch and the side-by-side measurement the notebooks
plot (on the tiny test pair)."""

import dataclasses

import numpy as np
import pytest

import specjax
from specjax import theory
from specjax.tools import notebook


def test_small_mode_reads_the_environment(monkeypatch):
    monkeypatch.delenv("SPECJAX_SMALL", raising=False)
    assert notebook.small_mode() is False
    monkeypatch.setenv("SPECJAX_SMALL", "1")
    assert notebook.small_mode() is True
    monkeypatch.setenv("SPECJAX_SMALL", "0")
    assert notebook.small_mode() is False
    monkeypatch.setenv("SPECJAX_SMALL", "yes")
    with pytest.raises(ValueError, match="SPECJAX_SMALL must be 1"):
        notebook.small_mode()


@pytest.mark.slow  # the Colab notebooks run compare in small mode (test_colab)
def test_compare_measures_every_entry_beside_theory(pair):
    target, drafts, _ = pair
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, target.config.vocab_size, 12).tolist() for _ in range(2)]
    profile = theory.CostProfile((1,), ((1.0, 1.2, 1.4, 1.6),), (0.9, 0.9, 0.9))
    entries = [notebook.Entry("near", drafts["near"], 3),
               notebook.Entry("near again", specjax.DraftModel(drafts["far"]), 3),  # same shape: timed once
               notebook.Entry("lookup", specjax.PromptLookup(), 3),
               notebook.Entry("auto", drafts["near"], "auto")]
    rows = notebook.compare(target, prompts, entries, max_new_tokens=8, temperatures=(0.0, 1.0),
                            cost_profile=profile, log=lambda line: None)
    assert [(r.name, r.temperature) for r in rows] == [
        (n, t) for t in (0.0, 1.0) for n in ("autoregressive", "near", "near again", "lookup", "auto")]
    greedy = rows[:5]
    assert all(r.exact for r in greedy) and all(r.exact is None for r in rows[5:])
    near, again, lookup, auto = greedy[1:]
    assert near.c is not None and near.c > 0 and near.c == again.c  # one timing per draft shape
    assert lookup.c is None and lookup.predicted == pytest.approx(lookup.tokens_per_pass)
    assert near.predicted == pytest.approx(theory.predicted_speedup(
        theory.alpha_from_accepted(min((near.tokens_per_pass - 1), 3), 3), 3, near.c), rel=0.2)
    K = theory.choose_num_draft_tokens(profile, 1, max_new_tokens=8)
    assert auto.shape == f"auto: chain K={K}"
    rate = [theory.tokens_per_ms(profile, 1, k, 8) for k in (0, K)]
    assert auto.predicted == pytest.approx(rate[1] / rate[0])
    assert all(r.tokens_per_s > 0 and r.speedup > 0 for r in rows)
    assert "near" in notebook.table(rows) and len(notebook.table(rows).splitlines()) == len(rows) + 1
    fig = notebook.plot(rows)
    assert len(fig.axes) == 3


def test_compare_refuses_prompts_that_do_not_fill_batches(pair):
    with pytest.raises(ValueError, match="batches of 2"):
        notebook.compare(pair[0], [[1, 2, 3]], [], batch=2)


def test_measured_is_a_plain_record():
    assert {f.name for f in dataclasses.fields(notebook.Measured)} >= {"speedup", "predicted", "acceptance", "exact"}
