"""Multi-token prediction (drafters/mtp.py): a target's own MTP layer, stored after its
decoder's layers as DeepSeek-V3 ships it, read from its folder (checked by name and
shape), computes what vLLM's equations give (a reference written here in torch around
transformers' own decoder layer); drafting with it (a chain, a tree, deterministic passes,
the paged engine) gives plain greedy output; train-mtp's layer learns, is saved beside its
target in the same layout and loads back."""

import copy
import json
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import specjax
from specjax.drafters.mtp import MTP_FILE, Mtp
from specjax.models import apply
from tests import tiny

MAX_NEW = 12


def _with_mtp(folder, name, seed=0, std=0.15):
    """A tiny random `name` target saved in folder with one MTP layer (model.layers.{L}.*):
    its block the layer L of a transformers model of L+1 layers (so of the kind transformers
    builds there: experts from first_k_dense_replace on), random enorm, hnorm, eh_proj,
    shared_head.norm and a head of its own; embed_tokens a copy of the target's. Returns
    (the torch target, that model of L+1 layers, the MTP tensors)."""
    cfg = tiny.CONFIGS[name]()
    L, E, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    grown = copy.deepcopy(cfg)
    grown.num_hidden_layers = L + 1
    if cfg.first_k_dense_replace >= L:  # a dense target: a dense MTP block (specjax's rule, mtp_block_config)
        grown.first_k_dense_replace = L + 1
    torch.manual_seed(seed)
    big = tiny.randomized(tiny.CLASSES[name](grown).eval(), std)
    target = tiny.CLASSES[name](cfg).eval()
    target.load_state_dict({k: v for k, v in big.state_dict().items() if not k.startswith(f"model.layers.{L}.")},
                           strict=False)
    target.save_pretrained(folder)
    with tempfile.TemporaryDirectory() as tmp:  # its block's tensors as transformers writes them
        big.save_pretrained(tmp)
        saved = {k: v for f in Path(tmp).glob("*.safetensors") for k, v in load_file(str(f)).items()}
    P = f"model.layers.{L}."
    g = torch.Generator().manual_seed(seed + 1)
    mtp = {k: v.contiguous() for k, v in saved.items() if k.startswith(P)}
    mtp.update({P + "enorm.weight": 1 + std * torch.randn(E, generator=g),
                P + "hnorm.weight": 1 + std * torch.randn(E, generator=g),
                P + "eh_proj.weight": std * torch.randn(E, 2 * E, generator=g),
                P + "shared_head.norm.weight": 1 + std * torch.randn(E, generator=g),
                P + "shared_head.head.weight": std * torch.randn(V, E, generator=g),
                P + "embed_tokens.weight": big.model.embed_tokens.weight.detach().clone()})
    save_file(mtp, str(Path(folder) / MTP_FILE), metadata={"format": "pt"})
    _edit_config(folder, num_nextn_predict_layers=1)
    return target, big, mtp


def _edit_config(folder, **values):
    file = Path(folder) / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **values}))


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference(target, big, mtp, tokens):
    """float32 logits [B, T-1, V] of the MTP layer at positions 0..T-2 of tokens [B, T], by
    vLLM's DeepSeekMultiTokenPredictorLayer.forward and compute_logits: the embedding of
    token t+1 (zeroed at position 0) through enorm, the target's final-normed h_t through
    hnorm, [e, h] through eh_proj, transformers' decoder layer (the block) at position t,
    shared_head.norm, shared_head.head."""
    cfg = target.config
    L, eps, P = cfg.num_hidden_layers, cfg.rms_norm_eps, f"model.layers.{cfg.num_hidden_layers}."
    t = torch.as_tensor(tokens)
    T = t.shape[1] - 1
    with torch.no_grad():
        h = target.model(t).last_hidden_state  # after the final norm
        e = torch.nn.functional.embedding(t[:, 1:], mtp[P + "embed_tokens.weight"]).clone()
        e[:, 0] = 0
        x = torch.cat([_rms(e, mtp[P + "enorm.weight"], eps), _rms(h[:, :-1], mtp[P + "hnorm.weight"], eps)], -1)
        x = x @ mtp[P + "eh_proj.weight"].T
        positions = torch.arange(T)[None].expand(t.shape[0], T)
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = big.model.layers[L](x, attention_mask=causal, position_ids=positions,
                                  position_embeddings=big.model.rotary_emb(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        return (_rms(out, mtp[P + "shared_head.norm.weight"], eps) @ mtp[P + "shared_head.head.weight"].T).numpy()


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A tiny DeepSeek-V3 target (latent attention, experts, yarn) whose folder ships an MTP
    layer of random weights: (folder, target, torch target, torch grown model, tensors)."""
    folder = tmp_path_factory.mktemp("shipped")
    torch_target, big, mtp = _with_mtp(folder, "deepseek_v3_moe")
    return folder, specjax.load_model(folder, dtype=jnp.float32), torch_target, big, mtp


def _logits(drafter, target, tokens):
    """The drafter's logits at positions 0..T-2 of tokens [B, T], from the target's states."""
    @jax.jit
    def run(bound, target, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        _, h, _ = apply(target, tokens, positions)
        x, _ = bound.advance(target, tokens[:, 1:], h[:, :-1], positions[:, :-1])
        return bound.read(target, x)

    return np.asarray(run(drafter.bind(target), target, jnp.asarray(tokens)))


def test_the_shipped_layer_computes_vllms_equations(shipped):
    folder, target, torch_target, big, mtp = shipped
    drafter = specjax.load_drafter(folder)
    assert isinstance(drafter, Mtp) and drafter.sparse  # layer 3 >= first_k_dense_replace: experts
    # its own head kept; its embed_tokens, a copy of the target's, read as the target's
    assert "head" in drafter.params and "embedding" not in drafter.params
    tokens = np.random.RandomState(0).randint(0, tiny.VOCAB, (2, 9))
    want = _reference(torch_target, big, mtp, tokens)
    np.testing.assert_allclose(_logits(drafter, target, tokens), want, atol=1e-4, rtol=1e-4)
    # the position-0 zeroing matters: without it position 0's logits differ
    assert np.abs(want[:, 0] - want[:, 1]).max() > 1e-2


def test_a_dense_latent_attention_block_too(tmp_path):
    torch_target, big, mtp = _with_mtp(tmp_path, "deepseek_v3", seed=3)
    target = specjax.load_model(tmp_path, dtype=jnp.float32)
    drafter = specjax.load_drafter(tmp_path)
    assert not drafter.sparse
    tokens = np.random.RandomState(1).randint(0, tiny.VOCAB, (1, 7))
    np.testing.assert_allclose(_logits(drafter, target, tokens), _reference(torch_target, big, mtp, tokens),
                               atol=1e-4, rtol=1e-4)


def test_greedy_with_the_shipped_layer_equals_plain_greedy(shipped):
    """A chain of 3 and the deterministic passes, over the target's latent cache and the
    layer's own: plain greedy's tokens (a tree: with a trained layer, below)."""
    folder, target, *_ = shipped
    drafter = specjax.load_drafter(folder)
    rng = np.random.RandomState(1)
    padded, lengths = specjax.pad_prompts([list(rng.randint(2, tiny.VOCAB, n)) for n in (5, 9, 1)])
    plain = tiny.rows(specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW))
    for deterministic in (False, True):
        out = specjax.generate(target, padded, lengths, draft=drafter, num_draft_tokens=3, max_new_tokens=MAX_NEW,
                               deterministic=deterministic)
        assert tiny.rows(out) == plain, deterministic
        assert (out.stats.drafted[:2] > 0).all()  # (the one-token prompt drafts from its second step)


# ---- train-mtp -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(hf_folder, tmp_path_factory):
    """An MTP layer trained 40 steps on a tiny DeepSeek-V3 MoE target (which ships none) on its
    own greedy text, saved into a copy of its folder: (target, folder, untrained and trained
    held-out metrics, held-out rows of its text [8, 42])."""
    from specjax.train import TrainConfig, heads

    source = hf_folder("deepseek_v3_moe")[0]
    target = specjax.load_model(source, dtype=jnp.float32)
    stream, held = tiny.own_text(target)
    cfg = TrainConfig(steps=40, batch=8, seq_len=32, lr=1e-2, warmup=5, eval_every=40, eval_batches=2,
                      checkpoint_every=40)
    drafter, _ = heads.train_mtp(target, stream, held, cfg, tmp_path_factory.mktemp("run"), progress=False,
                                 log=lambda s: None)
    metrics = jax.jit(heads.mtp_objective(target, drafter, cfg)[1])
    batch = jnp.asarray(held[: 4 * 33].reshape(4, 33))
    before = metrics(Mtp.init(target, jax.random.key(0)).params, batch)
    after = metrics(drafter.params, batch)
    folder = tmp_path_factory.mktemp("with_mtp") / "target"
    shutil.copytree(source, folder)
    drafter.save(folder)
    return target, folder, before, after, held.reshape(8, -1)


def test_training_lowers_the_loss_and_the_saved_layer_loads_back(trained):
    target, folder, before, after, _ = trained
    assert float(after["loss"]) < 0.8 * float(before["loss"]), (before, after)
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    names = set(load_file(str(folder / MTP_FILE)))
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.head.weight",
            "model.layers.3.embed_tokens.weight", "model.layers.3.self_attn.kv_b_proj.weight",
            "model.layers.3.mlp.experts.7.down_proj.weight", "model.layers.3.mlp.gate.e_score_correction_bias"} <= names
    again = specjax.load_drafter(folder)
    assert "head" not in again.params and "embedding" not in again.params  # the target's, copied: shared
    assert again.sparse
    assert specjax.load_model(folder, dtype=jnp.float32).config == target.config  # the target ignores it


def test_a_trained_layer_drafts_exactly_and_is_accepted_often(trained):
    target, folder, *_, held = trained
    drafter = specjax.load_drafter(folder)
    padded, lengths = specjax.pad_prompts([list(held[0, :6]), list(held[1, :3]), [4, 50, 7]])  # (text it never saw)
    plain = tiny.rows(specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW))
    for draft, K in ((drafter, 3), (drafter.replace(tree=specjax.Tree(3, 2, 5)), None)):
        out = specjax.generate(target, padded, lengths, draft=draft, num_draft_tokens=K, max_new_tokens=MAX_NEW)
        assert tiny.rows(out) == plain
        accepted, drafted = int(out.stats.accepted.sum()), int(out.stats.drafted.sum())
        print(f"trained MTP, {'chain of 3' if K else 'tree'}: accepted {accepted} of {drafted}")
        assert 0 < accepted < drafted


def test_the_paged_engine_with_the_layer_equals_generate_alone(trained):
    """Paged caches (the target's and the layer's), a shared prefix cached, staggered requests;
    then `specjax serve`'s app over the same engine answers a completion over HTTP with
    generate's tokens (their text, under a tokenizer with a text for every id)."""
    from tests.test_engine import _alone, _staggered

    target, folder, *_ = trained
    drafter = specjax.load_drafter(folder)
    rng = np.random.default_rng(4)
    shared = [int(t) for t in rng.integers(3, 97, 17)]
    requests = [(shared + [5, 6], 10, ()), ([int(t) for t in rng.integers(3, 97, 4)], 14, ()),
                (shared + [9], 8, ())]
    engine = specjax.Engine(target, draft=drafter, slots=2, max_len=48, num_draft_tokens=3, steps_per_call=4,
                            kv_pages=12, page_size=8)
    outputs, _ = _staggered(engine, requests)
    for (prompt, budget, stops), got in zip(requests, outputs):
        assert got == _alone(target, prompt, budget, stops), (len(prompt), budget)
    stats = engine.stats()
    print(f"engine with the MTP layer: {stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} prefix tokens "
          f"found cached")
    assert stats["free_pages"] == 12 and stats["prefix_cache_hits"] >= 16  # the shared prefix's two full pages
    # `specjax serve`'s app over the same engine: a completion of token ids, over HTTP
    from specjax.serve.api import Server
    from tests.test_serve import Live

    corpus = Path(specjax.__file__).with_name("theory.py").read_text().splitlines()
    tokenizer = tiny.save_tokenizer(folder.parent / "served_tokenizer", corpus, vocab_size=tiny.VOCAB)
    assert len(tokenizer) == tiny.VOCAB  # every id the model may answer has a token's text
    prompt, budget, _ = requests[1]
    with engine:
        live = Live(Server(engine, tokenizer, "tiny-moe-mtp"))
        try:
            answer = live.client().completions.create(model="tiny-moe-mtp", prompt=prompt, max_tokens=budget,
                                                      temperature=0)
        finally:
            live.stop()
    alone = _alone(target, prompt, budget, ())
    assert answer.usage.completion_tokens == len(alone)
    assert answer.choices[0].text == tokenizer.decode(alone, skip_special_tokens=True)


# ---- any target whose block specjax runs; files refused by name --------------------------------

@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("glm4_moe", marks=pytest.mark.slow)])
def test_a_gqa_experts_target_round_trips_its_layer(hf_folder, tmp_path, arch):
    """Qwen3-MoE (q/k/v heads, q/k norms, experts) and GLM-4.5 (partial rotary, DeepSeek's
    router): an MTP layer made for it drafts exactly, is written into a copy of its folder in
    DeepSeek's layout and reads back the same; its target then loads as before, and (Qwen3-MoE,
    whose loader ignores only declared MTP layers) refuses the layer once config.json stops
    declaring it."""
    source = hf_folder(arch)[0]
    target = specjax.load_model(source, dtype=jnp.float32)
    drafter = Mtp.init(target, jax.random.key(1))
    padded, lengths = specjax.pad_prompts([[5, 9, 11, 2], [7, 3]])
    plain = tiny.rows(specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW))
    out = specjax.generate(target, padded, lengths, draft=drafter, num_draft_tokens=3, max_new_tokens=MAX_NEW)
    assert tiny.rows(out) == plain
    folder = tmp_path / "qwen"
    shutil.copytree(source, folder)
    drafter.save(folder)
    again = specjax.load_drafter(folder)
    assert jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), again.params, drafter.params) == \
        jax.tree.map(lambda a: True, drafter.params)
    assert "model.layers.3.mlp.experts.0.gate_proj.weight" in load_file(str(folder / MTP_FILE))
    specjax.load_model(folder)
    _edit_config(folder, num_nextn_predict_layers=0)
    if arch == "qwen3_moe":  # (GLM-4.5's loader ignores any layer past its decoder, as transformers does)
        with pytest.raises(specjax.CheckpointError, match=r"tensors the config does not explain: \['model.layers.3"):
            specjax.load_model(folder)
    with pytest.raises(specjax.CheckpointError, match="declares no multi-token-prediction layers.*train-mtp"):
        specjax.load_drafter(folder, mtp=True)


def _tamper(shipped, tmp_path, change):
    folder = tmp_path / "bad"
    shutil.copytree(shipped[0], folder)
    tensors = load_file(str(folder / MTP_FILE))
    change(tensors)
    save_file(tensors, str(folder / MTP_FILE), metadata={"format": "pt"})
    return folder


def test_bad_files_are_refused_by_name(shipped, tmp_path):
    folder = _tamper(shipped, tmp_path, lambda t: [t.pop(k) for k in list(t)])
    with pytest.raises(specjax.CheckpointError, match=r"declares 1 multi-token-prediction layer\(s\) after its 3 "
                                                      r"decoder layers, but MTP layer 0 \(model.layers.3.\*\) has no"):
        specjax.load_drafter(folder)
    shutil.rmtree(folder)
    folder = _tamper(shipped, tmp_path, lambda t: t.pop("model.layers.3.hnorm.weight"))
    with pytest.raises(specjax.CheckpointError, match=r"lacks 1 tensors its config implies: \['model.layers.3.hnorm"):
        specjax.load_drafter(folder)
    shutil.rmtree(folder)
    folder = _tamper(shipped, tmp_path, lambda t: t.update({"model.layers.3.eh_proj.weight": torch.zeros(32, 48)}))
    with pytest.raises(specjax.CheckpointError, match=r"tensor model.layers.3.eh_proj.weight \(MTP layer 0\) has shape "
                                                      r"\[32, 48\], but the target's config implies \[32, 64\]"):
        specjax.load_drafter(folder)
    shutil.rmtree(folder)
    folder = _tamper(shipped, tmp_path, lambda t: t.update({"model.layers.3.extra.weight": torch.zeros(2)}))
    with pytest.raises(specjax.CheckpointError, match=r"tensors the config does not explain: \['model.layers.3.extra"):
        specjax.load_drafter(folder)
    _edit_config(folder, num_nextn_predict_layers=2)
    with pytest.raises(ValueError, match=r"ships 2 MTP layers .* choose it with Mtp.load\(folder, layer=k\)"):
        specjax.load_drafter(folder)
    with pytest.raises(specjax.CheckpointError, match=r"MTP layer 1 \(model.layers.4.\*\) has no tensors"):
        Mtp.load(folder, layer=1)
    with pytest.raises(specjax.CheckpointError, match="declares 2 MTP layer"):
        Mtp.load(shipped[0]).save(folder)


def test_a_layer_for_another_target_is_refused(shipped, hf_folder):
    drafter = specjax.load_drafter(shipped[0])
    other = specjax.load_model(hf_folder("deepseek_v3")[0], dtype=jnp.float32)  # dense, no yarn: another block
    with pytest.raises(ValueError, match="MTP layer's weights do not match the target's sizes"):
        drafter.bind(other)
    with pytest.raises(ValueError, match="made for another target"):
        drafter.bind(specjax.load_model(hf_folder("qwen3_moe")[0], dtype=jnp.float32))
