"""Drafters beyond a second model: early exit, prompt lookup, adaptive draft length.
Each keeps greedy output equal to transformers' (sampling exactness: test_sampling.py)."""

import numpy as np
import pytest

import specjax
from tests import tiny

MAX_NEW = 12


def _prompts(batch, seed):
    rng = np.random.RandomState(seed)
    # Short repeated motifs, so that prompt lookup finds matches and also misses.
    return [list(np.tile(rng.randint(2, tiny.VOCAB, rng.randint(2, 5)), 3)[: rng.randint(3, 14)])
            for _ in range(batch)]


DRAFTERS = {
    "early_exit": lambda pair: specjax.EarlyExit(1),
    "prompt_lookup": lambda pair: specjax.PromptLookup(max_ngram=3, min_ngram=1),
    "model_adaptive": lambda pair: pair[1]["near"],
    # a reduced draft vocabulary: the lower ids (the target's others are never drafted)
    "model_reduced_vocab": lambda pair: specjax.DraftModel(pair[1]["near"]).with_vocab(np.arange(60)),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
# (the suite's time on 2 cores: K=2 with -m slow)
@pytest.mark.parametrize("K, batch", [pytest.param(2, 3, marks=pytest.mark.slow), (5, 4)])
def test_greedy_equals_transformers(pair, name, K, batch):
    target, _, torch_model = pair
    prompts = _prompts(batch, seed=K)
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    extra = dict(adaptive_k=True, draft_threshold=0.3) if name == "model_adaptive" else {}
    out = specjax.generate(target, padded, lengths, draft=DRAFTERS[name](pair), max_new_tokens=MAX_NEW,
                           num_draft_tokens=K, **extra)
    assert tiny.rows(out) == [tiny.transformers_greedy(torch_model, p, MAX_NEW) for p in prompts]
    assert (out.stats.drafted <= K * out.stats.steps).all()


def test_early_exit_of_gpt2(hf_folder):
    folder, torch_model = hf_folder("gpt2")
    target = specjax.load_model(folder)
    prompts = _prompts(3, seed=1)
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    out = specjax.generate(target, padded, lengths, draft=specjax.EarlyExit(1),
                           max_new_tokens=MAX_NEW, num_draft_tokens=3)
    assert tiny.rows(out) == [tiny.transformers_greedy(torch_model, p, MAX_NEW) for p in prompts]


def test_prompt_lookup_accepts_many_tokens_on_repetitive_text(pair):
    """Random models soon loop; a prompt made of the target's own looping text repeats
    itself, and prompt lookup proposes its continuation, which is mostly accepted."""
    target, _, _ = pair
    seed = [46, 49, 66, 69]  # this target's greedy text from here settles into "32 8 32 8 ..."
    padded, lengths = specjax.pad_prompts([seed], bucket=16)
    looping = specjax.generate(target, padded, lengths, max_new_tokens=100).tokens[0].tolist()
    padded, lengths = specjax.pad_prompts([seed + looping], bucket=8)
    auto = specjax.generate(target, padded, lengths, max_new_tokens=24)
    out = specjax.generate(target, padded, lengths, draft=specjax.PromptLookup(3, 1),
                           max_new_tokens=24, num_draft_tokens=6)
    np.testing.assert_array_equal(out.tokens, auto.tokens)
    tokens_per_pass = int(out.num_tokens[0]) / int(out.stats.steps[0])
    print(f"prompt lookup on repeated text: {tokens_per_pass:.2f} tokens per target pass, "
          f"acceptance {int(out.stats.accepted[0]) / int(out.stats.drafted[0]):.2f}")
    assert tokens_per_pass > 3.0


def test_prompt_lookup_without_a_match_still_advances(pair):
    target, _, _ = pair
    padded, lengths = specjax.pad_prompts([[5]], bucket=16)  # one token: nothing to match
    out = specjax.generate(target, padded, lengths, draft=specjax.PromptLookup(), max_new_tokens=4,
                           num_draft_tokens=3)
    auto = specjax.generate(target, padded, lengths, max_new_tokens=4)
    np.testing.assert_array_equal(out.tokens, auto.tokens)
    assert out.stats.steps[0] <= 4


def test_adaptive_draft_length_moves_k(pair):
    """With a draft that is often wrong, the schedule shrinks K: fewer drafts than K per step.
    (K = 5 on 4 rows: the adaptive program is [5-4-model_adaptive]'s.)"""
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts(_prompts(4, seed=3), bucket=16)
    fixed = specjax.generate(target, padded, lengths, draft=drafts["far"], max_new_tokens=MAX_NEW,
                             num_draft_tokens=5)
    adaptive = specjax.generate(target, padded, lengths, draft=drafts["far"], max_new_tokens=MAX_NEW,
                                num_draft_tokens=5, adaptive_k=True)
    np.testing.assert_array_equal(fixed.tokens, adaptive.tokens)
    assert (fixed.stats.drafted == 5 * fixed.stats.steps).all()
    assert adaptive.stats.drafted.sum() < fixed.stats.drafted.sum() / 2


def test_confidence_threshold_stops_drafting(pair):
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts(_prompts(4, seed=4), bucket=16)
    kwargs = dict(draft=drafts["near"], max_new_tokens=MAX_NEW, num_draft_tokens=5)  # shapes as above
    base = specjax.generate(target, padded, lengths, **kwargs)
    never = specjax.generate(target, padded, lengths, **kwargs, draft_threshold=1.0)  # no draft is ever that sure
    np.testing.assert_array_equal(base.tokens, never.tokens)
    assert never.stats.drafted.sum() == 0 and (never.stats.steps == MAX_NEW).all()


@pytest.mark.parametrize("drafter, message", [
    (specjax.EarlyExit(2), "num_layers < the target's 2 layers"),
    (specjax.PromptLookup(max_ngram=1, min_ngram=2), "min_ngram <= max_ngram"),
])
def test_bad_drafters(pair, drafter, message):
    target, _, _ = pair
    padded, lengths = specjax.pad_prompts([[3, 4]], bucket=16)
    with pytest.raises(ValueError, match=message):
        specjax.generate(target, padded, lengths, draft=drafter)


def test_a_reduced_draft_vocabulary_reads_out_the_drafts_columns(pair):
    """with_vocab(ids): the draft's own logits at ids (increasing), over those ids alone, from
    a head of its columns for them; nothing else about the draft changes."""
    import jax.numpy as jnp

    from specjax.models import apply

    draft = pair[1]["near"]
    ids = np.array([40, 3, 17, 96])
    reduced = specjax.DraftModel(draft).with_vocab(ids)
    assert reduced.vocab.tolist() == [3, 17, 40, 96] and reduced.head.shape == (draft.config.hidden_size, 4)
    tokens = jnp.array([[5, 9, 31, 2]])
    full = np.asarray(specjax.forward(draft, tokens))  # [1, 4, V]
    _, hidden, _ = apply(draft, tokens, jnp.arange(4)[None])
    whole, part = (np.asarray(d.read(hidden, tiny.VOCAB)) for d in (specjax.DraftModel(draft), reduced))
    np.testing.assert_allclose(whole, full, atol=1e-5)
    assert part.shape == (1, 4, 4)  # over its draft vocabulary's ids, in their order
    np.testing.assert_allclose(part, full[..., [3, 17, 40, 96]], atol=1e-5)


@pytest.mark.parametrize("make, message", [
    (lambda d: specjax.DraftModel(d).with_vocab([1, 1]), "must be distinct"),
    (lambda d: specjax.DraftModel(d).with_vocab([0, tiny.VOCAB]), f"must lie in 0..{tiny.VOCAB - 1}"),
    (lambda d: specjax.DraftModel(d).with_vocab([]), "non-empty"),
    (lambda d: specjax.DraftModel(d).with_vocab([2, 3]).with_vocab([2]), "already drafts from a reduced"),
    (lambda d: specjax.DraftModel(d, specjax.Tree(2, 3, 4)).with_vocab([2, 3]).resolve(None),
     "takes 3 candidates per node, but this draft model drafts from 2 tokens"),
])
def test_bad_draft_vocabularies(pair, make, message):
    with pytest.raises(ValueError, match=message):
        make(pair[1]["near"])


def test_a_draft_vocabulary_past_the_targets_is_refused(pair):
    """A draft with padding rows past the target's vocabulary may list one of them in its
    draft vocabulary (with_vocab checks only its own): generate refuses it, naming the id."""
    import dataclasses

    import jax

    from specjax.models import init

    target = pair[0]
    padded_draft = init(dataclasses.replace(target.config, vocab_size=tiny.VOCAB + 3), jax.random.key(3))
    prompts, lengths = specjax.pad_prompts([[3, 4]], bucket=16)
    drafter = specjax.DraftModel(padded_draft).with_vocab([5, tiny.VOCAB + 1])
    with pytest.raises(ValueError, match=f"holds id {tiny.VOCAB + 1}, outside the target's {tiny.VOCAB} tokens"):
        specjax.generate(target, prompts, lengths, draft=drafter, max_new_tokens=2)


def test_a_saved_draft_vocabulary_is_loaded_beside_its_model(pair, tmp_path):
    """save_vocab writes draft_vocab.json into a draft's folder; DraftModel.load drafts from
    it (and without one, from the whole head); files specjax cannot use are refused, named."""
    import json
    import os

    from specjax.drafters.vocab import VOCAB_FILE, save_vocab
    from specjax.hf import CheckpointError

    folder = tmp_path / "draft"
    specjax.save_model(pair[1]["near"], folder)
    assert specjax.DraftModel.load(folder).vocab is None
    save_vocab(folder, [9, 2, 50], tiny.VOCAB)
    assert json.loads((folder / VOCAB_FILE).read_text()) == {"draft_vocab": [2, 9, 50]}
    loaded = specjax.DraftModel.load(folder, specjax.Tree.chain(3, "sampled"))
    assert loaded.vocab.tolist() == [2, 9, 50] and loaded.tree.nodes == 3 and loaded.head.shape[1] == 3
    for text, message in (("[1, 2]", "not an object"), ("{", "not valid JSON"), ("{}", "non-empty list"),
                          ('{"draft_vocab": [3, 2]}', "must increase"), ('{"draft_vocab": [2, 2]}', "distinct"),
                          (f'{{"draft_vocab": [0, {tiny.VOCAB}]}}', f"must lie in 0..{tiny.VOCAB - 1}"),
                          ('{"draft_vocab": [1.5]}', "integers"), ('{"draft_vocab": "12"}', "non-empty list")):
        (folder / VOCAB_FILE).write_text(text)
        with pytest.raises(CheckpointError, match=message):
            specjax.DraftModel.load(folder)
    (folder / VOCAB_FILE).unlink()
    os.mkfifo(folder / VOCAB_FILE)
    with pytest.raises(CheckpointError, match="not a regular file"):
        specjax.DraftModel.load(folder)


def test_load_drafter_of_a_draft_models_folder_drafts_from_its_saved_vocabulary():
    """The Python call for the shipped recipe: specjax.load_drafter("checkpoints/draft") is
    the DraftModel that `specjax generate` drafts with (its 1024-token draft_vocab.json, read
    out by those head columns alone: its `read`), load_model's keywords passed on."""
    from pathlib import Path

    import jax.numpy as jnp

    from specjax.drafters.vocab import head_columns, read_vocab

    shipped = Path(__file__).parent.parent / "checkpoints"
    drafter = specjax.load_drafter(shipped / "draft")
    model = specjax.load_model(shipped / "draft")
    saved = read_vocab(shipped / "draft", model.config.vocab_size)
    assert isinstance(drafter, specjax.DraftModel) and drafter.tree is None and len(saved) == 1024
    np.testing.assert_array_equal(np.asarray(drafter.vocab), saved)
    np.testing.assert_array_equal(np.asarray(drafter.head), np.asarray(head_columns(model, saved)))
    tree = specjax.Tree(3, 2, 4)
    as_tree = specjax.load_drafter(shipped / "draft", tree, dtype=jnp.bfloat16)
    assert as_tree.tree == tree and as_tree.model.dtype == jnp.bfloat16 and as_tree.vocab.shape == (1024,)
    with pytest.raises(TypeError, match="dtype apply to a draft model's folder"):
        specjax.load_drafter(shipped / "medusa", dtype=jnp.bfloat16)


def test_early_exit_holds_no_copy_of_the_weights():
    """The compiled loop with EarlyExit(2) needs no more scratch memory than plain decoding
    beyond a small fraction of the two layers it drafts with: it reads them in place."""
    import jax
    import jax.numpy as jnp

    from specjax.backend import Backend
    from specjax.loop import generate_loop
    from specjax.models import init
    from specjax.sampling import Sampling

    config = specjax.ModelConfig(model_type="llama", vocab_size=512, hidden_size=256, num_layers=4,
                                 num_heads=4, num_kv_heads=4, head_dim=64, intermediate_size=1024,
                                 max_position_embeddings=256, norm_eps=1e-5, tie_word_embeddings=True)
    target = init(config, jax.random.key(0), jnp.float32)
    two_layers = sum(x.nbytes for x in jax.tree.leaves(target.params["layers"][:2]))

    def scratch(drafter):
        return generate_loop.lower(target, drafter, jnp.ones((1, 16), jnp.int32), jnp.array([8], jnp.int32),
                               jax.random.key(0), Sampling.make(), jnp.int32(-1), jnp.float32(0),
                               max_new_tokens=16, return_trace=False, adaptive_k=False,
                               backend=Backend.default(), rules=None).compile().memory_analysis().temp_size_in_bytes

    assert scratch(specjax.EarlyExit(2).resolve(4)) - scratch(None) < 0.25 * two_layers
