"""Parity with transformers' PyTorch logits, and cached decoding == one full pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.cache import KVCache
from specjax.models import apply
from tests import tiny

ARCHS = list(tiny.CONFIGS)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_matches_transformers(arch, hf_folder):
    folder, torch_model = hf_folder(arch)
    model = specjax.load_model(folder, dtype=jnp.float32)
    tokens = np.random.RandomState(1).randint(0, tiny.VOCAB, (2, 16))
    ref = tiny.logits(torch_model, tokens)
    assert ref.std() > 0.5, "logits too close to uniform for the comparison to mean much"
    np.testing.assert_allclose(np.asarray(specjax.forward(model, tokens)), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral", "qwen3_moe", "gpt_oss", "deepseek_v3_moe"])
def test_ragged_batch_matches_each_row_alone(arch, hf_folder):
    """Right-padded rows of different lengths in one batch give each row's own logits."""
    folder, torch_model = hf_folder(arch)
    model = specjax.load_model(folder)
    rng = np.random.RandomState(2)
    lengths = [16, 9, 3]
    tokens = np.full((3, 16), 5)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.randint(0, tiny.VOCAB, n)
    out = np.asarray(specjax.forward(model, tokens))
    for b, n in enumerate(lengths):
        ref = tiny.logits(torch_model, tokens[b:b + 1, :n])[0]
        np.testing.assert_allclose(out[b, :n], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["gpt2", "llama3", "mistral", "gemma3", "qwen3_moe", "mixtral", "deepseek_v3",
                                  "deepseek_v3_q", "gpt_oss", "glm4_moe"])
def test_cached_decoding_equals_full_pass(arch, hf_folder):
    """Prefill ragged rows, then feed one token at a time at each row's own offset."""
    folder, _ = hf_folder(arch)
    model = specjax.load_model(folder)
    rng = np.random.RandomState(3)
    B, P, N = 3, 8, 6
    prompt_lengths = np.array([8, 5, 2])
    seqs = rng.randint(0, tiny.VOCAB, (B, P + N))
    full = np.asarray(specjax.forward(model, seqs))

    step = jax.jit(apply)
    cache = KVCache.init(model.config, B, 32)
    # Prefill the padded prompt block; rows shorter than P write stale entries past their end.
    prompt = np.where(np.arange(P)[None] < prompt_lengths[:, None], seqs[:, :P], 0)
    positions = np.broadcast_to(np.arange(P), (B, P))
    logits, _, cache = step(model, prompt, positions, cache)
    for b in range(B):
        n = prompt_lengths[b]
        np.testing.assert_allclose(np.asarray(logits[b, :n]), full[b, :n], atol=1e-4, rtol=0)
    for t in range(N):
        pos = prompt_lengths + t  # each row at its own offset
        token = seqs[np.arange(B), pos][:, None]
        logits, _, cache = step(model, token, pos[:, None], cache)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), full[np.arange(B), pos], atol=1e-4, rtol=0)


def test_stale_cache_entries_are_ignored(hf_folder):
    """Garbage beyond a row's position never changes its logits: masks come from positions."""
    folder, _ = hf_folder("llama")
    model = specjax.load_model(folder)
    tokens = np.random.RandomState(4).randint(0, tiny.VOCAB, (2, 6))
    positions = np.broadcast_to(np.arange(6), (2, 6))
    clean = KVCache.init(model.config, 2, 16)
    dirty = clean.replace(k=tuple(k + 7.0 for k in clean.k), v=tuple(v - 3.0 for v in clean.v))
    run = jax.jit(apply)  # (not op by op: seconds)
    a = run(model, tokens, positions, clean)[0]
    b = run(model, tokens, positions, dirty)[0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_forward_rejects_bad_tokens(hf_folder):
    folder, _ = hf_folder("gpt2")
    model = specjax.load_model(folder)
    with pytest.raises(ValueError, match="token ids"):
        specjax.forward(model, np.array([[1, tiny.VOCAB]]))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        specjax.forward(model, np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        specjax.forward(model, np.zeros((1, 65), np.int32))


def test_a_pass_reads_every_weight_in_place():
    """The compiled cached pass (one token, and a verification's five) copies or transposes
    no weight: each is read where it lies. With layers stacked [L, ...], or the output
    projection contracted over (heads, head_dim) as two axes, XLA laid a copy of weights out
    on every pass. Nor, at 8 rows over 1,040 slots (attending blockwise), any block of the
    cache: it lies head-major [B, G, S, D], as the attention's products read it (a
    [B, S, G, D] cache was relaid out block by block on every pass, 12 copies of 256 slots a
    step: docs/bench/step_profile.txt)."""
    import re
    from pathlib import Path

    target = specjax.load_model(Path(__file__).parent.parent / "checkpoints" / "target", dtype=jnp.float32)
    cache = KVCache.init(target.config, 1, 256)
    # The smallest weight matrix of a layer, o's H x D x E (6 x 64 x 384); the pass's
    # activations, scores and one layer's cache (256 x 2 x 64) are all far smaller.
    c = target.config
    smallest = c.num_heads * c.head_dim * c.hidden_size
    for T in (1, 5):
        tokens, positions = jnp.ones((1, T), jnp.int32), 100 + jnp.arange(T, dtype=jnp.int32)[None]
        hlo = jax.jit(lambda m, c: apply(m, tokens, positions, c)[0]).lower(target, cache).compile().as_text()
        moved = [int(np.prod([int(d) for d in dims.split(",")]))
                 for dims in re.findall(r"= f32\[([\d,]+)\]\{[\d,]+\} (?:copy|transpose)\(", hlo)]
        assert max(moved, default=0) < smallest, (T, max(moved), smallest)
        wide = KVCache.init(c, 8, 1040)
        tokens, positions = jnp.ones((8, T), jnp.int32), jnp.broadcast_to(positions, (8, T))
        hlo = jax.jit(lambda m, c: apply(m, tokens, positions, c)[::2], donate_argnums=1).lower(
            target, wide).compile().as_text()
        shapes = [[int(d) for d in dims.split(",")]
                  for dims in re.findall(r"= f32\[([\d,]+)\]\{[\d,]+\} (?:copy|transpose)\(", hlo)]
        moved = [s for s in shapes if s[-1] == c.head_dim and max(s[:-1]) >= 256]  # keys or values of 256+ slots
        assert moved == [], (T, moved)
