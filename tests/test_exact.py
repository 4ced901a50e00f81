"""deterministic=True: the target computes the same bits for a token whichever pass computes
it, so that greedy speculative output equals greedy plain output bit for bit in bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.cache import KVCache
from specjax.models import apply
from tests import tiny


@pytest.fixture(scope="module")
def target(hf_folder):
    return specjax.load_model(hf_folder("llama")[0], dtype=jnp.bfloat16)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def test_a_token_gets_the_same_bits_from_every_pass(target, exact=True):
    """The plain step (one token), a verification pass (K+1 tokens), a pass of another batch,
    a full pass without a cache and a pass over a longer cache: the same logits, bit for
    bit. (Without the flag, the batch of one and the long cache differ: measured.)"""
    exact = target.replace(exact=exact)
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, tiny.VOCAB, (3, 20)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (3, 20))
    run = jax.jit(apply)
    _, _, cache = run(exact, tokens[:, :12], positions[:, :12], KVCache.init(target.config, 3, 48, jnp.bfloat16))
    step = run(exact, tokens[:, 12:13], positions[:, 12:13], cache)[0][:, 0]
    for K in (1, 4):
        verify = run(exact, tokens[:, 12:13 + K], positions[:, 12:13 + K], cache)[0]
        np.testing.assert_array_equal(_bits(verify[:, 0]), _bits(step), err_msg=f"K={K}")
    one_row = run(exact, tokens[1:2, 12:13], positions[1:2, 12:13], jax.tree.map(lambda x: x[1:2], cache))[0][0, 0]
    np.testing.assert_array_equal(_bits(one_row), _bits(step[1]))
    full = run(exact, tokens[:, :13], positions[:, :13])[0][:, 12]
    np.testing.assert_array_equal(_bits(full), _bits(step))
    # the cache's length changes nothing either
    _, _, long_cache = run(exact, tokens[:, :12], positions[:, :12], KVCache.init(target.config, 3, 1024, jnp.bfloat16))
    long_step = run(exact, tokens[:, 12:13], positions[:, 12:13], long_cache)[0][:, 0]
    np.testing.assert_array_equal(_bits(long_step), _bits(step))


def test_greedy_output_is_plain_greedy_output_bit_for_bit(target):
    """The target drafting for itself: every rejection it would suffer is arithmetic. With
    the flag, a chain and a tree give the plain rows, and a row alone is the row in its
    batch."""
    rng = np.random.RandomState(1)
    prompts = [list(rng.randint(2, tiny.VOCAB, n)) for n in (5, 9, 14)]
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    common = dict(max_new_tokens=20, deterministic=True)
    plain = specjax.generate(target, padded, lengths, **common)
    itself = specjax.Model(target.config, target.params)
    for draft, K in ((specjax.DraftModel(itself), 3), (specjax.DraftModel(itself, specjax.Tree(3, 2, 5)), None)):
        spec = specjax.generate(target, padded, lengths, draft=draft, num_draft_tokens=K, **common)
        np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens), err_msg=str(draft.tree))
        np.testing.assert_array_equal(np.asarray(spec.num_tokens), np.asarray(plain.num_tokens))
    alone = specjax.generate(target, padded[2:], lengths[2:], draft=draft, **common)
    np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(plain.tokens[2]))


def test_the_flag_is_refused_where_it_is_not_verified(target, monkeypatch):
    padded, lengths = specjax.pad_prompts([[3, 4, 5]])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="deterministic=True is verified on .*'cpu'.* only"):
        specjax.generate(target, padded, lengths, deterministic=True)


def test_sampling_stays_exact_in_distribution_with_the_flag():
    """The flag changes how the target's bits are computed, not the acceptance rule: the
    joint distribution of two sampled tokens is still the target's (chi-square, as in
    test_sampling)."""
    from tests.test_sampling import PROMPT, V, _chi_square_p, _exact_joint, _tiny

    target = _tiny(0, 0.6)
    draft = _tiny(1, 0.15, base=target)
    rows = 3000
    prompts = np.tile(np.array(PROMPT, np.int32), (rows, 1))
    out = specjax.generate(target, prompts, np.full(rows, len(PROMPT), np.int32), draft=draft,
                           key=jax.random.key(3), max_new_tokens=2, num_draft_tokens=2, temperature=1.0,
                           deterministic=True)
    t = np.asarray(out.tokens)
    observed = np.bincount(t[:, 0] * V + t[:, 1], minlength=V * V).reshape(V, V)
    assert _chi_square_p(observed, _exact_joint(target, 1.0, 0, 1.0)) > 1e-3


@pytest.mark.parametrize("arch", ["llama_yarn", "gpt_oss", "glm4_moe"])
def test_an_exact_pass_matches_transformers(arch, hf_folder):
    """The deterministic pass computes what transformers does for the families whose
    attention or rope differ from Llama's by more than a flag (YaRN's cos/sin factor;
    gpt-oss's sinks and experts; GLM-4.5's partial rotary and grouped router)."""
    folder, torch_model = hf_folder(arch)
    model = specjax.load_model(folder, dtype=jnp.float32).replace(exact=True)
    tokens = np.random.RandomState(1).randint(0, tiny.VOCAB, (2, 16))
    positions = np.broadcast_to(np.arange(16), (2, 16))
    logits = jax.jit(apply)(model, tokens, positions)[0]
    np.testing.assert_allclose(np.asarray(logits), tiny.logits(torch_model, tokens), atol=1e-4, rtol=0)
