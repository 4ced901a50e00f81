"""DeepSeek-V3's latent attention (models/mla.py): its cache holds the latent and the rotary
key a token a layer, and nothing else; every way specjax decodes (a draft model's chain, a
token tree, the deterministic passes, the paged engine with cached prefixes and chunked
prefill) gives what plain greedy decoding gives; with its experts (models/moe.py) too.
(Parity with transformers' logits and cached decoding against a full pass: test_models.py,
whose tiny configs include it.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import budget, loop
from specjax.cache import KVCache
from specjax.config import ModelConfig
from specjax.hf_config import UnsupportedConfigError
from specjax.memory import nbytes
from specjax.models import apply
from tests import tiny


@pytest.fixture(scope="module")
def target(hf_folder):
    return specjax.load_model(hf_folder("deepseek_v3")[0], dtype=jnp.float32)


def test_the_cache_holds_the_latent_and_the_rope_key_a_token(target):
    c = target.config
    latent = c.mla.kv_lora_rank + c.mla.qk_rope_head_dim  # 16 + 8
    cache = KVCache.init(c, 2, 40)
    assert len(cache.k) == c.num_layers and cache.latent
    assert all(k.shape == (2, 1, 40, latent) and v.shape == (2, 1, 40, 0) for k, v in zip(cache.k, cache.v))
    per_token = c.num_layers * latent * 4  # float32: 3 layers x 24 numbers, not 4 heads x (16 + 8) x 2
    assert KVCache.nbytes(c, 2, 40, jnp.float32) == nbytes(cache) - nbytes(cache.lengths) == 2 * 40 * per_token
    S = budget.cache_length(10, 20, budget.verify_room(None))
    assert budget.shape_bound(target, None, 2, 10, 20)["caches"] == 2 * S * per_token
    paged = cache.in_pages(5, 8, 4)
    assert paged.k[0].shape == (5, 1, 8, latent) and paged.v[0].shape == (5, 1, 8, 0)


def test_refused_by_name(hf_folder):
    from specjax.hf_config import InvalidConfigError

    hf = tiny.CONFIGS["deepseek_v3"]().to_dict()
    moe = tiny.CONFIGS["deepseek_v3_moe"]().to_dict()
    assert ModelConfig.from_hf_config(hf).moe is None  # first_k_dense_replace = every layer: dense
    with pytest.raises(InvalidConfigError, match="n_group=3 must divide the 8 experts"):
        ModelConfig.from_hf_config({**moe, "n_group": 3})
    with pytest.raises(InvalidConfigError, match="num_experts_per_tok=5 exceeds the experts of topk_group=2"):
        ModelConfig.from_hf_config({**moe, "num_experts_per_tok": 5})
    with pytest.raises(UnsupportedConfigError, match="deepseek_v3 with attention_bias"):
        ModelConfig.from_hf_config({**hf, "attention_bias": True})


def test_save_and_load_round_trip(target, tmp_path):
    folder = specjax.save_model(target, tmp_path / "ds")
    again = specjax.load_model(folder, dtype=jnp.float32)
    assert again.config == target.config
    tokens = np.random.RandomState(0).randint(0, tiny.VOCAB, (1, 7))
    np.testing.assert_array_equal(np.asarray(specjax.forward(again, tokens)), np.asarray(specjax.forward(target, tokens)))


def test_greedy_with_a_draft_and_a_tree_equals_plain_greedy(target, hf_folder):
    """A draft model's chain (deferred writes, commits) and its token tree (held trees,
    placements) over the latent cache: plain greedy decoding's tokens, which are
    transformers' own."""
    rng = np.random.RandomState(1)
    prompts = [list(rng.randint(2, tiny.VOCAB, n)) for n in (5, 9, 3)]
    padded, lengths = specjax.pad_prompts(prompts)
    plain = specjax.generate(target, padded, lengths, max_new_tokens=12)
    assert tiny.rows(plain)[0] == tiny.transformers_greedy(hf_folder("deepseek_v3")[1], prompts[0], 12)
    near = tiny.noisy(target, 0.002, 1)
    for draft, K in ((near, 3), (specjax.DraftModel(near, specjax.Tree(3, 2, 5)), None)):
        spec = specjax.generate(target, padded, lengths, draft=draft, num_draft_tokens=K, max_new_tokens=12)
        assert tiny.rows(spec) == tiny.rows(plain), draft
        assert int(np.sum(spec.stats.accepted)) > 0


@pytest.mark.slow  # the suite's time on 2 cores (test_models holds its logits against transformers')
def test_greedy_with_experts_equals_plain_greedy(hf_folder):
    """DeepSeek-V3's experts (group-limited sigmoid router, a shared expert) under latent
    attention: a draft model's chain gives plain greedy decoding's tokens, transformers'."""
    folder, torch_model = hf_folder("deepseek_v3_moe")
    target = specjax.load_model(folder, dtype=jnp.float32)
    rng = np.random.RandomState(3)
    prompts = [list(rng.randint(2, tiny.VOCAB, n)) for n in (6, 11)]
    padded, lengths = specjax.pad_prompts(prompts)
    plain = specjax.generate(target, padded, lengths, max_new_tokens=10)
    assert tiny.rows(plain)[1] == tiny.transformers_greedy(torch_model, prompts[1], 10)
    spec = specjax.generate(target, padded, lengths, draft=tiny.noisy(target, 0.002, 1), num_draft_tokens=3,
                            max_new_tokens=10)
    assert tiny.rows(spec) == tiny.rows(plain)


def test_deterministic_passes(target):
    """models/exact.py over the latent cache: a step and a verification pass give the same
    bits, and they are the portable pass's logits."""
    exact = target.replace(exact=True)
    tokens = jnp.asarray(np.random.RandomState(2).randint(0, tiny.VOCAB, (2, 14)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(14, dtype=jnp.int32), (2, 14))
    run = jax.jit(apply)
    _, _, cache = run(exact, tokens[:, :10], positions[:, :10], KVCache.init(target.config, 2, 32))
    step = run(exact, tokens[:, 10:11], positions[:, 10:11], cache)[0][:, 0]
    verify = run(exact, tokens[:, 10:14], positions[:, 10:14], cache)[0]
    np.testing.assert_array_equal(np.asarray(verify[:, 0]), np.asarray(step))
    full = np.asarray(specjax.forward(target, tokens))
    np.testing.assert_allclose(np.asarray(verify), full[:, 10:14], atol=1e-4, rtol=0)


def test_the_paged_engine_equals_generate_alone(target):
    """The engine with pages of the latent cache (a draft model's tree, chunked prefill, a
    cached prefix): every request what `generate` gives it alone, every page back."""
    from tests.test_engine import REQUESTS, _alone, _staggered

    near = specjax.DraftModel(tiny.noisy(target, 0.002, 1), specjax.Tree(3, 2, 6))
    engine = specjax.Engine(target, draft=near, slots=3, max_len=64, steps_per_call=4, kv_pages=7, page_size=8,
                            prefill_chunk=16)
    shared = [int(t) for t in np.random.default_rng(7).integers(3, 97, 26)]
    requests = REQUESTS[:4] + [(shared + [5, 9], 10, ()), (shared + [44, 2, 71], 10, ())]
    try:
        outputs, submitted = _staggered(engine, requests)
    finally:
        if engine._thread is not None:
            engine.stop()
    for (prompt, budget_, stops), got in zip(requests, outputs):
        assert got == _alone(target, prompt, budget_, stops), len(prompt)
    assert submitted[-1].cached_tokens == 24  # the shared prompt's 3 full pages
    assert engine.stats()["free_pages"] == 7 and engine.pages.owners() == []
    for cache in loop.caches(engine.runner.state):
        assert cache.k[0].shape == (7 + 1, 1, 8, 24) and cache.v[0].shape[-1] == 0
