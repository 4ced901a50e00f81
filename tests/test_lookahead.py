"""Lookahead decoding: the trie of guesses a row proposes, one Jacobi step of the pool and
the window, the branch invisible to verification (greedy output equal to transformers' on
a ragged batch with EOS, drafts accepted), the joint distribution of three sampled tokens
exact, and bad settings refused clearly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.drafters.base import DraftRequest
from specjax.drafters.lookahead import LookaheadState
from specjax.sampling import Sampling
from tests import tiny
from tests.test_sampling import _chi_square_p
from tests.test_tree import _sampled_joint, exact_joint, tiny_pair  # noqa: F401  (fixtures)

MAX_NEW = 24


def _request(text, k_limit=3):
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, : len(text)] = text
    return DraftRequest(target=None, target_cache=None, tokens=jnp.asarray(tokens), length=jnp.array([len(text)]),
                        done=jnp.array([False]), key=jax.random.key(0), sampling=Sampling.make(0.0, 0, 1.0),
                        k_limit=jnp.array([k_limit]), threshold=jnp.float32(0))


def _state(grams, seen, window):
    return LookaheadState(window=jnp.asarray([window], jnp.int32), pool=jnp.asarray([grams], jnp.int32),
                          seen=jnp.asarray([seen], jnp.int32), clock=jnp.asarray([100], jnp.int32))


def test_guesses_form_a_trie_most_recent_first():
    drafter = specjax.Lookahead(window=2, ngram=4, guesses=3, pool_size=5).resolve(None)
    # Pool: n-grams starting with 7 seen at 3, 9, 5 and 1 (the oldest is not among the 3
    # guesses); one starting with 8; an empty slot (never matched although its token is 7).
    state = _state([[7, 1, 2, 3], [7, 1, 2, 4], [7, 1, 5, 6], [8, 1, 2, 3], [7, 9, 9, 9]], [3, 9, 5, 4, -1],
                   window=[[0, 0]] * 3)
    _, _, p = drafter.propose(state, _request([5, 7]))
    nodes = list(zip(np.asarray(p.tokens[0]).tolist(), np.asarray(p.parents[0]).tolist(),
                     np.asarray(p.valid[0]).tolist()))
    # Depth-major, guesses by recency: [1,2,4] (seen 9), [1,5,6] (5), [1,2,3] (3).
    assert [(t, par) for t, par, v in nodes if v] == [(1, 0), (2, 1), (5, 1), (4, 4), (6, 5), (3, 4)]
    assert p.q is None and p.branch.tokens.shape == (1, 2 * 3)
    # Depth is capped by the row's k_limit.
    _, _, p = drafter.propose(state, _request([5, 7], k_limit=1))
    assert np.asarray(p.tokens[0])[np.asarray(p.valid[0])].tolist() == [1]


def test_branch_layout_is_the_jacobi_window():
    drafter = specjax.Lookahead(window=3, ngram=3, guesses=1).resolve(None)
    branch = drafter._branch(jnp.arange(6, dtype=jnp.int32).reshape(1, 2, 3))
    # Level l, column i at offset 1+i+l; sees level 0 up to column i and its own column above.
    assert branch.offsets.tolist() == [1, 2, 3, 2, 3, 4]
    assert branch.sees.astype(int).tolist() == [
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]]
    assert drafter.target_room == 2 + 2 * 3


def test_a_jacobi_step_fills_the_pool_once_per_ngram():
    drafter = specjax.Lookahead(window=3, ngram=3, guesses=1, pool_size=4).resolve(None)
    # Window levels [[1, 1, 4], [2, 2, 5]]: columns (1, 2), (1, 2), (4, 5). The pool holds
    # (4, 5, 6) (seen at 50) and two older n-grams.
    state = _state([[4, 5, 6], [9, 9, 9], [8, 8, 8], [0, 0, 0]], [50, 10, 20, -1], window=[[1, 1, 4], [2, 2, 5]])
    after = jnp.asarray([[0, 0, 0, 3, 3, 6]])  # the argmax per branch token; the last level's count
    logits = jax.nn.one_hot(after, 10)
    new = drafter.observe(state, logits, jnp.array([True]))
    grams = {tuple(g): int(s) for g, s in zip(np.asarray(new.pool[0]).tolist(), np.asarray(new.seen[0]))}
    # (1, 2, 3) twice in one step is stored once, stamped by its later column; (4, 5, 6)
    # is refreshed; it went to the empty slot, the rest kept.
    assert grams == {(1, 2, 3): 101, (4, 5, 6): 102, (9, 9, 9): 10, (8, 8, 8): 20}
    assert np.asarray(new.window[0]).tolist() == [[2, 2, 5], [3, 3, 6]]
    assert new.clock.tolist() == [103]
    # A full pool replaces its least recently seen n-gram; an inactive row keeps its state.
    newer = drafter.observe(new, jax.nn.one_hot(jnp.asarray([[0, 0, 0, 7, 7, 7]]), 10), jnp.array([True]))
    assert (9, 9, 9) not in {tuple(g) for g in np.asarray(newer.pool[0]).tolist()}
    frozen = drafter.observe(new, logits, jnp.array([False]))
    assert np.array_equal(frozen.pool, new.pool) and np.array_equal(frozen.window, new.window)


def test_prompt_ngrams_seed_the_pool():
    drafter = specjax.Lookahead(window=2, ngram=3, guesses=2, pool_size=8).resolve(None)
    prompts = jnp.asarray([[1, 2, 3, 1, 2, 3, 0, 0]])
    state = drafter.start(None, prompts, jnp.array([6]), 32)
    stored = {tuple(g) for g, s in zip(np.asarray(state.pool[0]).tolist(), np.asarray(state.seen[0])) if s >= 0}
    assert stored == {(1, 2, 3), (2, 3, 1), (3, 1, 2)}  # each once; nothing from the padding
    assert set(np.asarray(state.window).ravel().tolist()) <= {1, 2, 3}


def test_greedy_equals_transformers(pair):
    target, _, torch_model = pair
    rng = np.random.RandomState(3)
    prompts = [list(rng.randint(2, tiny.VOCAB, n)) for n in (3, 9, 1, 13)]
    prompts[1] = prompts[1][:4] * 3  # a repetitive row, so that guesses are accepted
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    plain = specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW)
    eos = int(plain.tokens[0, 6])
    expected = [tiny.transformers_greedy(torch_model, p, MAX_NEW, eos) for p in prompts]
    out = specjax.generate(target, padded, lengths, draft=specjax.Lookahead(window=4, ngram=3, guesses=4),
                           max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert tiny.rows(out) == expected
    assert out.num_tokens[0] < MAX_NEW  # the EOS row stopped early
    assert int(out.stats.accepted.sum()) > 0


@pytest.mark.slow  # the suite's time on 2 cores (-m slow runs it)
def test_sampling_is_exact(tiny_pair, exact_joint):  # noqa: F811
    target, _ = tiny_pair
    observed = _sampled_joint(target, specjax.Lookahead(window=2, ngram=3, guesses=2))
    assert observed[exact_joint == 0].sum() == 0
    assert _chi_square_p(observed, exact_joint) > 1e-3


def test_bad_settings_are_refused(pair):
    target, _, _ = pair
    padded, lengths = specjax.pad_prompts([[5, 6]], bucket=16)
    bad = [
        (specjax.Lookahead(window=0), {}, "window must be an int >= 1"),
        (specjax.Lookahead(ngram=1), {}, "ngram must be an int >= 2"),
        (specjax.Lookahead(guesses=2.5), {}, "guesses must be an int >= 1"),
        (specjax.Lookahead(window=8, pool_size=4), {}, "must hold at least one step's n-grams"),
        (specjax.Lookahead(), {"num_draft_tokens": 3}, "conflicts"),
    ]
    for drafter, kw, message in bad:
        with pytest.raises(ValueError, match=message):
            specjax.generate(target, padded, lengths, draft=drafter, max_new_tokens=2, **kw)
