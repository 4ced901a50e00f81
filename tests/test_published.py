"""Published EAGLE-3 heads (SafeAILab/EAGLE's, SpecForge's and speculators' folders): tiny
heads written as each format's writer lays them out, read by `load_drafter`, draft the
logits of a reference forward written from the authors' code (tests/published_reference.py),
speculate exactly, round-trip bit for bit, and every misfit is refused by name."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tr
from safetensors.torch import save_file

import specjax
from specjax import Tree
from tests import tiny
from tests.published_reference import Head

L = 7  # EAGLE's default taps, hidden_states 2, L/2, L-3: 2, 3, 4
SIZES = dict(E=32, H=4, G=2, D=8, F=48, V=tiny.VOCAB)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny 7-layer Llama (rope base 500000, as Llama-3's) and torch's copy."""
    torch.manual_seed(3)
    config = tr.LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=32, num_hidden_layers=L, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=48, max_position_embeddings=256,
                            rope_theta=500000.0, bos_token_id=0, eos_token_id=1)
    model = tiny.randomized(tr.LlamaForCausalLM(config).eval())
    folder = tmp_path_factory.mktemp("target")
    model.save_pretrained(folder)
    return specjax.load_model(folder), model


def layer_config(head: Head, **extra) -> dict:
    """The head's layer as EAGLE's config.json says it (a LlamaConfig; no rope_theta unless
    given: EAGLE's templates have none)."""
    return {"model_type": "llama", "hidden_size": head.E, "intermediate_size": SIZES["F"],
            "num_attention_heads": head.H, "num_key_value_heads": head.G, "num_hidden_layers": 1,
            "rms_norm_eps": head.eps, "max_position_embeddings": 2048, "hidden_act": "silu",
            "vocab_size": SIZES["V"], "tie_word_embeddings": False, "pad_token_id": 0, **extra}


def write(head: Head, folder, format: str, taps=None, **config):
    """head in folder as `format`'s writer lays it out (config.json and model.safetensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    Vd = head.w["lm_head.weight"].shape[0]
    o = head.options
    if format == "speculators":  # speculators c05b95b config.py: the layer config as a diff over LlamaConfig's
        layer = tr.LlamaConfig(**{k: v for k, v in layer_config(head, **config).items() if k != "model_type"})
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "speculators_version": "0.3.0",
               "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                      "verifier": {"name_or_path": "tiny-llama",
                                                   "architectures": ["LlamaForCausalLM"]}},
               "transformer_layer_config": {"model_type": "llama", **layer.to_diff_dict()},
               "draft_vocab_size": Vd, "norm_before_residual": o["norm_before_residual"],
               "norm_before_fc": "input_norm.weight" in head.w, "fc_norm": "fc_norm.0.weight" in head.w,
               "norm_output": o["norm_output"], "target_hidden_size": None,
               "eagle_aux_hidden_state_layer_ids": taps}
    else:  # EAGLE's template (eagle/traineagle3/config.json) or SpecForge's configs/*.json
        cfg = {**layer_config(head, **config), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": Vd}
        if format == "specforge":
            cfg.update(fc_norm="fc_norm.0.weight" in head.w, norm_output=o["out_norm"])
            if taps is not None:  # SpecForge counts "output of layer k": one less than hidden_states' index
                cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in taps],
                                       "use_aux_hidden_state": True}
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in head.tensors(format).items()}, str(folder / "model.safetensors"))
    return folder


HEADS = {  # name -> (format, Head kwargs, taps (hidden_states indices; None: EAGLE's), extra config)
    "eagle": ("eagle", dict(Vd=40), None, {}),
    "speculators": ("speculators", dict(Vd=40, norm_before_residual=True, norm_output=True, input_norm=True),
                    [1, 3, 6], {}),
    "specforge": ("specforge", dict(Vd=SIZES["V"], fc_norm=True, out_norm=False, base=1e6), [1, 4, 6],
                  {"rope_theta": 1e6, "head_dim": 8}),
}


def make(name, folder, seed=0):
    format, kwargs, taps, config = HEADS[name]
    sizes = {k: v for k, v in SIZES.items()}
    head = Head(**{**sizes, **kwargs, "n": 3, "seed": seed})
    return head, write(head, folder, format, taps, **config), taps


def reference_inputs(torch_target, taps, T=10, seed=0):
    """tokens [T+1], the target's hidden_states at taps for the first T, concatenated [T, 3E]."""
    tokens = torch.randint(2, tiny.VOCAB, (T + 1,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        states = torch_target(tokens[None, :T], output_hidden_states=True).hidden_states
    return tokens, torch.cat([states[i][0] for i in taps], dim=-1)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_draft_logits_equal_the_authors_forward(target, tmp_path, name):
    """At a fixed input, two drafting steps deep (the target's states, then its own output),
    a head's draft logits equal the reference forward's (float32, 1e-5), its draft ids map to
    the reference's target ids, and the taps it asks the target for are the hidden_states
    the reference fed it."""
    from specjax.models import apply

    model, torch_target = target
    head, folder, taps = make(name, tmp_path / name)
    drafter = specjax.load_drafter(folder).bind(model)
    assert isinstance(drafter, specjax.PublishedEagle3)
    taps = taps or [2, L // 2, L - 3]
    assert drafter.feature_layers == tuple(taps)
    tokens, features = reference_inputs(torch_target, taps)
    T = features.shape[0]
    positions = torch.arange(T)
    emb = torch_target.model.embed_tokens.weight[tokens[1:]].detach()
    want0, fed = head.forward(emb, features, positions)
    want1, _ = head.forward(emb, fed, positions)  # a step deeper: its own outputs at the same pairs

    ids = jnp.asarray(tokens.numpy())[None]
    _, ours_taps, _ = apply(model, ids[:, :T], jnp.arange(T)[None], taps=drafter.feature_layers)
    np.testing.assert_allclose(ours_taps[0], features.numpy(), atol=1e-5)
    x, _ = drafter.advance(model, ids[:, 1:], jnp.asarray(features.numpy())[None], jnp.arange(T)[None])
    np.testing.assert_allclose(drafter.read(model, x)[0], want0.detach().numpy(), atol=1e-5)
    x, _ = drafter.advance(model, ids[:, 1:], x, jnp.arange(T)[None])
    np.testing.assert_allclose(drafter.read(model, x)[0], want1.detach().numpy(), atol=1e-5)
    draft = torch.arange(want0.shape[-1])
    expected = head.target_ids(draft).numpy()
    got = np.arange(want0.shape[-1]) if drafter.draft_vocab is None else np.asarray(drafter.draft_vocab)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("name, tree", [("eagle", None), ("speculators", Tree(depth=3, top_k=2, nodes=6)),
                                        pytest.param("specforge", None, marks=pytest.mark.slow)])
def test_greedy_speculation_equals_plain_decoding(target, tmp_path, name, tree):
    model = target[0]
    _, folder, _ = make(name, tmp_path / name)
    drafter = specjax.load_drafter(folder, tree=tree)
    prompts = np.random.RandomState(0).randint(2, tiny.VOCAB, (2, 9)).astype(np.int32)
    lengths = np.array([9, 6], np.int32)
    plain = specjax.generate(model, prompts, lengths, max_new_tokens=24)
    spec = specjax.generate(model, prompts, lengths, draft=drafter, max_new_tokens=24,
                            num_draft_tokens=None if tree else 3)
    assert tiny.rows(spec) == tiny.rows(plain)
    assert int(spec.stats.drafted.sum()) > 0  # it drafted (a random head's drafts are rarely accepted)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_written_heads_read_back_bit_for_bit(target, tmp_path, name):
    """What specjax writes in each format it reads back bit for bit, and a speculators or
    SpecForge head written as EAGLE's format is refused where EAGLE's cannot say its options."""
    _, folder, _ = make(name, tmp_path / name)
    drafter = specjax.load_drafter(folder)
    for format in ("speculators", "specforge", "eagle"):
        if format != name and name != "eagle":  # options only its own format says
            with pytest.raises(ValueError, match="write it as"):
                drafter.save(tmp_path / f"{name}-as-{format}", format=format)
            continue
        back = specjax.load_drafter(drafter.save(tmp_path / f"{name}-as-{format}", format=format))
        assert jax.tree.map(lambda a: a.shape, back.params) == jax.tree.map(lambda a: a.shape, drafter.params)
        for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(drafter.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert back.feature_layers == drafter.feature_layers and back.config == drafter.config
        assert (back.vocab is None) == (drafter.vocab is None)
        if back.vocab is not None:
            np.testing.assert_array_equal(back.vocab, drafter.vocab)
        assert dataclasses_equal(back.layout, drafter.layout, but=("source",))


def dataclasses_equal(a, b, but=()):
    return {k: v for k, v in dataclasses.asdict(a).items() if k not in but} == {
        k: v for k, v in dataclasses.asdict(b).items() if k not in but}


def test_a_pickled_head_is_read_as_tensors_alone(target, tmp_path):
    """pytorch_model.bin (how most published EAGLE heads ship) is read through
    torch.load(weights_only=True): the same head as its safetensors; a pickle holding
    anything but tensors is refused, naming the conversion."""
    head, folder, _ = make("eagle", tmp_path / "st")
    pickled = tmp_path / "bin"
    pickled.mkdir()
    (pickled / "config.json").write_text((folder / "config.json").read_text())
    torch.save(head.tensors("eagle"), pickled / "pytorch_model.bin")
    a, b = specjax.load_drafter(folder), specjax.load_drafter(pickled)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    class Payload:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"fc.weight": Payload()}, pickled / "pytorch_model.bin")
    with pytest.raises(specjax.UnsafeCheckpointError,
                       match=r"holds more than tensors.*weights_only=True.*GLOBAL print"):
        specjax.load_drafter(pickled)


def test_a_pickled_head_s_format_is_told_without_unpickling_and_old_torch_is_refused(tmp_path, monkeypatch):
    """Which head a pytorch_model.bin holds is read from its pickle's strings (its opcodes
    walked, nothing unpickled: torch.load is never called to tell it); reading its tensors
    needs torch >= 2.6, whose weights_only=True runs no code (CVE-2025-32434)."""
    from specjax.drafters.formats import pickled_strings, published_format

    head, folder, _ = make("eagle", tmp_path / "st")
    pickled = tmp_path / "bin"
    pickled.mkdir()
    (pickled / "config.json").write_text((folder / "config.json").read_text())
    torch.save(head.tensors("eagle"), pickled / "pytorch_model.bin")
    want = published_format(folder)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load ran to tell a format"))
    assert published_format(pickled) == want and set(head.tensors("eagle")) <= pickled_strings(
        pickled / "pytorch_model.bin")
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    with pytest.raises(specjax.UnsafeCheckpointError, match=r"torch 2.5.1\+cpu can run code.*CVE-2025-32434"):
        specjax.load_drafter(pickled)


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder, format="eagle", drop=(), **changes):
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    for name in drop:
        del tensors[name]
    tensors.update(changes)
    save_file(tensors, str(folder / "model.safetensors"))


REFUSALS = {  # name -> (edit of an EAGLE-format head's folder, message)
    "no d2t": (lambda f: _edit_tensors(f, drop=("d2t", "t2d")), "needs its d2t map"),
    "t2d disagrees": (lambda f: _edit_tensors(f, t2d=torch.ones(tiny.VOCAB, dtype=torch.bool)),
                      "t2d and d2t disagree"),
    "d2t out of range": (lambda f: _edit_tensors(f, d2t=torch.full((40,), 500, dtype=torch.long)),
                         "d2t maps draft ids to no valid target vocabulary"),
    "a tensor missing": (lambda f: _edit_tensors(f, drop=("midlayer.hidden_norm.weight",)),
                         r"missing \['midlayer.hidden_norm.weight'\]"),
    "a tensor unexplained": (lambda f: _edit_tensors(f, **{"midlayer.extra.weight": torch.zeros(3)}),
                             r"not explained by it \['midlayer.extra.weight'\]"),
    "a wrong shape": (lambda f: _edit_tensors(f, **{"norm.weight": torch.ones(31)}),
                      "norm.weight has shape \\[31\\], its config implies \\[32\\]"),
    "an integer weight": (lambda f: _edit_tensors(f, **{"norm.weight": torch.ones(32, dtype=torch.int32)}),
                          "not a floating-point type"),
    "head_dim against q_proj": (lambda f: _edit_config(f, architectures=["LlamaForCausalLMEagle3"], head_dim=16,
                                                       eagle_config={}), "head_dim 16, but q_proj holds 4 heads of 8"),
    "a sliding window": (lambda f: _edit_config(f, model_type="mistral", sliding_window=64), "sliding window"),
    "another family": (lambda f: _edit_config(f, model_type="gpt2"), "specjax runs llama"),
    "two layers": (lambda f: _edit_tensors(f, **{"layers.1.mlp.down_proj.weight": torch.zeros(32, 48)}),
                   "more than one layer"),
    "taps not distinct": (lambda f: _edit_config(f, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}),
                          "must be distinct layer numbers"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_misfit_heads_are_refused_by_name(tmp_path, case):
    edit, message = REFUSALS[case]
    _, folder, _ = make("eagle", tmp_path / "head")
    edit(folder)
    with pytest.raises(specjax.CheckpointError, match=message):
        specjax.load_drafter(folder)


def test_a_head_for_another_target_is_refused_at_bind(target, pair, tmp_path):
    """A head whose fc reads other states, whose vocabulary or taps do not fit the target is
    refused when bound, naming each; a hub id not in the cache names the cache."""
    _, folder, _ = make("speculators", tmp_path / "head")
    drafter = specjax.load_drafter(folder)
    with pytest.raises(ValueError, match="taps the target's hidden_states \\[1, 3, 6\\].*has 2 layers"):
        drafter.bind(pair[0])
    other = specjax.load_model(_tiny_llama(tmp_path / "wide", hidden=48, vocab=tiny.VOCAB + 3))
    with pytest.raises(ValueError, match="reads 3 target states of 32, the target's hidden size is 48.*"
                                         "vocabulary has 97 ids, the target's 100"):
        drafter.bind(other)
    with pytest.raises(ValueError, match="not three layers"):
        specjax.load_drafter(make("eagle", tmp_path / "eagle")[1]).bind(pair[0])
    with pytest.raises(specjax.CheckpointError, match="not in the local cache, and HF_HUB_OFFLINE is set"):
        specjax.load_drafter("no-such-org/EAGLE3-head")


def _tiny_llama(folder, hidden, vocab):
    config = tr.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=L, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=48, max_position_embeddings=256)
    tr.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_the_engine_and_the_server_take_a_published_head(target, tmp_path):
    """`specjax serve --draft FOLDER` loads a published head (`load_draft`), and a paged
    engine drafting with it (a tree) gives each request what plain decoding gives."""
    from specjax.serve.server import load_draft

    model = target[0]
    _, folder, _ = make("speculators", tmp_path / "head")
    assert isinstance(load_draft(str(folder), model, None, ""), specjax.PublishedEagle3)
    drafter = specjax.load_drafter(folder, tree=Tree(depth=3, top_k=2, nodes=6))
    prompts = [list(p) for p in np.random.RandomState(1).randint(2, tiny.VOCAB, (3, 11))]
    with specjax.Engine(model, draft=drafter, slots=2, max_len=64, kv_pages=16, page_size=8) as engine:
        outs = [engine.submit(p, max_new_tokens=12) for p in prompts]
        got = [r.result(timeout=300) for r in outs]
    for prompt, tokens in zip(prompts, got):
        plain = specjax.generate(model, np.array([prompt], np.int32), np.array([len(prompt)], np.int32),
                                 max_new_tokens=12)
        assert tokens == tiny.rows(plain)[0]


def write_eagle1(head, folder, bias=True):
    """An EAGLE-1/2 head as SafeAILab/EAGLE's files hold it (cnets1.py's state dict; config.json
    a one-layer LlamaConfig with "bias", as eagle/train/*_config.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**layer_config(head), "architectures": ["LlamaForCausalLM"],
                                                    "bias": bias}))
    save_file({k: v.contiguous() for k, v in head.w.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("bias", [True, False])
def test_an_eagle1_head_drafts_as_its_authors_code(target, tmp_path, bias):
    """An EAGLE-1/2 head (fc with or without its bias, no norm before its layer's attention,
    read out by the target's head without a norm, over the target's final-normed states)
    gives the reference's logits two steps deep, carries its copy of the target's embedding
    only until bound, round-trips bit for bit and speculates exactly."""
    from tests.published_reference import Eagle1Head

    model, torch_target = target
    embedding = torch_target.model.embed_tokens.weight.detach()
    head = Eagle1Head(**{k: SIZES[k] for k in ("E", "H", "G", "D", "F", "V")}, bias=bias, embedding=embedding)
    drafter = specjax.load_drafter(write_eagle1(head, tmp_path / "head", bias))
    assert isinstance(drafter, specjax.PublishedEagle) and "embedding" in drafter.params
    bound = drafter.bind(model)
    assert "embedding" not in bound.params  # the target's own, shared
    tokens = torch.randint(2, tiny.VOCAB, (11,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        features = torch_target.model(tokens[None, :10]).last_hidden_state[0]  # final-normed
    T, positions = 10, torch.arange(10)
    emb, lm_head = embedding[tokens[1:]], torch_target.lm_head.weight.detach()
    with torch.no_grad():
        out0 = head.forward(emb, features, positions)
        out1 = head.forward(emb, out0, positions)
    ids = jnp.asarray(tokens.numpy())[None]
    x, _ = bound.advance(model, ids[:, 1:], jnp.asarray(features.numpy())[None], jnp.arange(T)[None])
    np.testing.assert_allclose(bound.read(model, x)[0], (out0 @ lm_head.T).numpy(), atol=1e-5)
    x, _ = bound.advance(model, ids[:, 1:], x, jnp.arange(T)[None])
    np.testing.assert_allclose(bound.read(model, x)[0], (out1 @ lm_head.T).numpy(), atol=1e-5)

    back = specjax.load_drafter(drafter.save(tmp_path / "back"))
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(drafter.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompts = np.random.RandomState(2).randint(2, tiny.VOCAB, (2, 8)).astype(np.int32)
    lengths = np.array([8, 5], np.int32)
    plain = specjax.generate(model, prompts, lengths, max_new_tokens=16)
    spec = specjax.generate(model, prompts, lengths, draft=drafter, max_new_tokens=16, num_draft_tokens=3)
    assert tiny.rows(spec) == tiny.rows(plain)


def write_medusa(heads, folder, num_heads, pickled=False):
    """Medusa heads as FasterDecoding's files hold them: config.json (MedusaConfig) and
    medusa_lm_head.safetensors, or Medusa-1's medusa_lm_head.pt."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": heads.blocks,
                                                    "base_model_name_or_path": "tiny-llama"}))
    if pickled:
        torch.save(heads.w, folder / "medusa_lm_head.pt")
    else:
        save_file({k: v.contiguous() for k, v in heads.w.items()}, str(folder / "medusa_lm_head.safetensors"))
    return folder


@pytest.mark.parametrize("own_out, blocks, pickled", [(True, 1, True), (False, 2, False)])
def test_medusa_heads_draft_as_their_authors_code(target, tmp_path, own_out, blocks, pickled):
    """FasterDecoding's Medusa heads (Medusa-1's with an output layer per head, in a pickle
    read as tensors alone; or read out by the target's head) give the reference's logits;
    the heads are the tensors' (a config that under-counts them, as published ones do, is
    not believed); greedy speculation equals plain decoding."""
    from specjax.drafters.medusa import heads_logits
    from tests.published_reference import MedusaHeads

    model, torch_target = target
    heads = MedusaHeads(SIZES["E"], SIZES["V"], heads=3, blocks=blocks, own_out=own_out)
    drafter = specjax.load_drafter(write_medusa(heads, tmp_path / "medusa", num_heads=2, pickled=pickled))
    assert isinstance(drafter, specjax.Medusa) and drafter.num_heads == 3
    drafter = drafter.bind(model)
    state = torch.randn(5, SIZES["E"], generator=torch.Generator().manual_seed(5))
    want = heads.logits(state, torch_target.lm_head.weight.detach())
    np.testing.assert_allclose(heads_logits(drafter.params, model, jnp.asarray(state.numpy())),
                               want.detach().numpy(), atol=1e-5)
    prompts = np.random.RandomState(3).randint(2, tiny.VOCAB, (2, 8)).astype(np.int32)
    lengths = np.array([8, 6], np.int32)
    plain = specjax.generate(model, prompts, lengths, max_new_tokens=16)
    spec = specjax.generate(model, prompts, lengths, draft=drafter, max_new_tokens=16)
    assert tiny.rows(spec) == tiny.rows(plain)


@pytest.mark.parametrize("name", [pytest.param("eagle", marks=pytest.mark.slow), "speculators"])
def test_unrolled_training_drafts_as_the_loop_does(target, tmp_path, name):
    """`unrolled` over a published head (what training fits) gives, at step j and position
    t, the logits drafting j+1 deep from the root t-j gives through the head's own cache
    (with speculators' options: the normed output fed back)."""
    from tests.test_heads import check_unrolled_drafts_as_the_loop_does

    model = target[0]
    check_unrolled_drafts_as_the_loop_does(specjax.load_drafter(make(name, tmp_path / name)[1]).bind(model), model)


@pytest.mark.slow  # a minute on 2 cores: the default run keeps the round trips and `unrolled` against drafting
def test_a_head_specjax_trains_is_written_as_vllm_reads_it(target, tmp_path):
    """`train_eagle3(published=True)` trains the published architecture (a reduced draft
    vocabulary too): its loss falls and its drafts get accepted; `save` writes speculators'
    format, which reads back bit for bit and speculates exactly; where the speculators
    package is installed, its own loader takes the folder with no tensor missing or left
    over."""
    from specjax.train import TrainConfig, heads

    model = target[0]
    stream, held = tiny.own_text(model)
    cfg = TrainConfig(steps=60, batch=8, seq_len=32, lr=1e-2, warmup=5, eval_every=60, eval_batches=2,
                      checkpoint_every=60)
    quiet = dict(progress=False, log=lambda s: None, probe_prompts=held[:4 * 16].reshape(4, 16), draft_vocab=64,
                 published=True)
    untrained = heads.train_eagle3(model, stream, held, dataclasses.replace(cfg, steps=1), tmp_path / "a", **quiet)[1]
    drafter, trained = heads.train_eagle3(model, stream, held, cfg, tmp_path / "b", **quiet)
    assert isinstance(drafter, specjax.PublishedEagle3) and drafter.vocab.shape == (64,)
    assert trained["loss"] < 0.9 * untrained["loss"] and trained["depth_1"] > untrained["depth_1"] + 0.2, (
        untrained, trained)
    folder = drafter.save(tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    back = specjax.load_drafter(folder)
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(drafter.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompts = np.random.RandomState(9).randint(2, tiny.VOCAB, (3, 9)).astype(np.int32)
    lengths = np.array([9, 7, 4], np.int32)
    spec = specjax.generate(model, prompts, lengths, draft=back, max_new_tokens=24, num_draft_tokens=3)
    assert tiny.rows(spec) == tiny.rows(specjax.generate(model, prompts, lengths, max_new_tokens=24))
    assert int(spec.stats.accepted.sum()) > 0
    # EAGLE's own drafting (a reference from cnets.py, recomputed from scratch) accepts as many tokens at each step
    from safetensors.torch import load_file

    from tests.published_reference import greedy_speculation

    reference = Head(**SIZES, Vd=64, eps=model.config.norm_eps, base=model.config.rope_theta)
    written = load_file(str(folder / "model.safetensors"))
    reference.w = {k.replace("layers.0.", "midlayer."): v for k, v in written.items()}
    traced = specjax.generate(model, prompts, lengths, draft=back, max_new_tokens=24, num_draft_tokens=3,
                              return_trace=True)
    embedding = target[1].model.embed_tokens.weight.detach()
    for b in range(len(prompts)):
        tokens, emitted = greedy_speculation(reference, target[1], embedding, prompts[b, :lengths[b]].tolist(), 3, 24,
                                             list(back.feature_layers))
        assert tokens == tiny.rows(traced)[b]
        steps = np.asarray(traced.trace[b]).copy()
        steps[0] -= 1  # the prefill's token comes in the loop's first step, alone or with that step's tokens
        assert steps[steps > 0].tolist() == emitted, f"row {b}: {steps.tolist()} against {emitted}"
    speculators = pytest.importorskip("speculators.models.eagle3")  # (its own from_pretrained then asks the hub
    # for the verifier's config, and breaks on output_loading_info: transformers' loader beneath it)
    loader = super(speculators.Eagle3DraftModel, speculators.Eagle3DraftModel).from_pretrained
    _, info = loader(str(folder), output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
