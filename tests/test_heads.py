"""Trained draft heads (Medusa, EAGLE, EAGLE-3): exact under greedy (against transformers) and under
sampling (three-token chi-square), chains and trees; the target's states reach them from
the verification pass and are carried for no one else; save/load with clear refusals;
training raises their acceptance; a training run killed with SIGKILL resumes bit for bit."""

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

import specjax
from specjax import Tree
from specjax.hf import CheckpointError
from tests import tiny
from tests.test_tree import (MAX_NEW, STATIC, _greedy_case, _prompts, _sampled_joint,  # noqa: F401
                             exact_joint, tiny_pair)
from tests.test_sampling import _chi_square_p

KEY = jax.random.key(7)
DRAFTERS = {
    "medusa_chain": lambda t: specjax.Medusa.init(t, 3, KEY),
    "medusa_dynamic": lambda t: specjax.Medusa.init(t, 4, KEY, Tree(depth=4, top_k=3, nodes=10)),
    "medusa_static": lambda t: specjax.Medusa.init(t, 4, KEY, Tree.from_paths(STATIC)),
    "eagle_chain": lambda t: specjax.Eagle.init(t, KEY),
    "eagle_dynamic": lambda t: specjax.Eagle.init(t, KEY, Tree(depth=4, top_k=3, nodes=10)),
    "eagle_static": lambda t: specjax.Eagle.init(t, KEY, Tree.from_paths(STATIC, "sampled")),
    "eagle3_chain": lambda t: specjax.Eagle3.init(t, KEY),
    "eagle3_dynamic": lambda t: specjax.Eagle3.init(t, KEY, Tree(depth=4, top_k=3, nodes=10)),
    # a reduced draft vocabulary: every other token id (the target's other tokens are never drafted)
    "eagle3_reduced": lambda t: specjax.Eagle3.init(t, KEY, Tree(depth=4, top_k=3, nodes=10),
                                                    vocab=np.arange(0, t.config.vocab_size, 2)),
}


# (the suite's time on 2 cores: the others with -m slow)
@pytest.mark.parametrize("name", [n if n in ("medusa_chain", "eagle_dynamic", "eagle3_dynamic", "eagle3_reduced")
                                  else pytest.param(n, marks=pytest.mark.slow) for n in DRAFTERS])
def test_greedy_equals_transformers(pair, name):
    """Random heads; a ragged batch of 4 (one prompt of a single token, which has no state
    before its first pass) with an EOS that stops the first row mid-way."""
    target, _, torch_model = pair
    prompts = _prompts(4, seed=3)
    prompts[1] = prompts[1][:1]
    padded, lengths, eos, expected = _greedy_case(target, torch_model, prompts)
    out = specjax.generate(target, padded, lengths, draft=DRAFTERS[name](target), max_new_tokens=MAX_NEW,
                           eos_token_id=eos)
    assert tiny.rows(out) == expected
    assert out.num_tokens[0] < MAX_NEW


# Each drafter family's sampling is checked once by default (its dynamic tree; Medusa's chain too).
@pytest.mark.parametrize("name", ["medusa_chain", pytest.param("medusa_dynamic", marks=pytest.mark.slow),
                                  pytest.param("eagle_dynamic", marks=pytest.mark.slow), "eagle3_dynamic",
                                  pytest.param("eagle_chain", marks=pytest.mark.slow),
                                  pytest.param("eagle3_reduced", marks=pytest.mark.slow)])
def test_sampling_is_exact(tiny_pair, exact_joint, name):  # noqa: F811
    target, _ = tiny_pair
    observed = _sampled_joint(target, DRAFTERS[name](target))
    assert observed[exact_joint == 0].sum() == 0
    assert _chi_square_p(observed, exact_joint) > 1e-3


def _loop_carry_shapes(target, drafter):
    """The shapes of everything any compiled while loop of `generate` carries."""
    padded, lengths = specjax.pad_prompts([[3, 4, 5]], bucket=8)
    jaxpr = jax.make_jaxpr(lambda: specjax.generate(target, padded, lengths, draft=drafter, max_new_tokens=8))()
    return {tuple(v.aval.shape) for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "while"
            for v in e.outvars if hasattr(v.aval, "shape")}


def _all_eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            inner = getattr(p, "jaxpr", None)
            if inner is not None:
                yield from _all_eqns(getattr(inner, "jaxpr", inner))


def test_states_are_carried_only_for_drafters_that_want_them(pair):
    target, drafts, _ = pair
    E, D = target.config.hidden_size, 3
    with_heads = _loop_carry_shapes(target, specjax.Medusa.init(target, D, KEY))
    without = _loop_carry_shapes(target, specjax.DraftModel(drafts["near"]).resolve(D))
    assert (1, D + 1, E) in with_heads
    assert (1, D + 1, E) not in without


def test_save_load_round_trip_and_refusals(pair, hf_folder, tmp_path):
    target, _, _ = pair
    prompts = _prompts(4, seed=3)
    prompts[1] = prompts[1][:1]
    padded, lengths = specjax.pad_prompts(prompts)
    other = specjax.load_model(hf_folder("gpt2")[0])
    for name in ("medusa_dynamic", "eagle_chain", "eagle3_dynamic", "eagle3_reduced"):
        drafter = DRAFTERS[name](target)
        drafter.save(tmp_path / name)
        loaded = specjax.load_drafter(tmp_path / name, tree=drafter.tree)
        assert type(loaded) is type(drafter)
        assert jax.tree.structure(loaded) == jax.tree.structure(drafter)
        # Every weight and the vocabulary equal, under the same structure (its static fields
        # too): generate, a function of the drafter's pytree, then drafts the same.
        for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(drafter)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        with pytest.raises(ValueError, match="made for another target"):
            specjax.generate(other, padded, lengths, draft=loaded, max_new_tokens=4)
    with pytest.raises(CheckpointError, match="not a saved drafter"):
        specjax.load_drafter(tmp_path / "nothing")
    (tmp_path / "medusa_dynamic" / "drafter.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        specjax.load_drafter(tmp_path / "medusa_dynamic")
    (tmp_path / "eagle_chain" / "drafter.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot be read"):
        specjax.load_drafter(tmp_path / "eagle_chain")


@pytest.mark.parametrize("kind, version", [("eagle_chain", 1), ("eagle_chain", 2), ("eagle3_chain", 2)])
def test_an_eagle_saved_in_an_older_layout_loads_converted(pair, tmp_path, kind, version):
    """Format 1 drafter files kept q/k/v and gate/up apart ([E, H, D], [E, G, D], [E, F]);
    format 2 fused them as [E, G, R+2, D] and [E, 2, F]. Both load into today's kernels
    ([G, R+2, D, E], [2, E, F]) with the same numbers; a missing tensor is named."""
    import json

    from safetensors.numpy import load_file, save_file

    target = pair[0]
    eagle = DRAFTERS[kind](target)
    eagle.save(tmp_path / "new")
    tensors = load_file(str(tmp_path / "new" / "drafter.safetensors"))
    c = eagle.config
    E, H, R = c.hidden_size, c.num_heads, c.num_heads // c.num_kv_heads
    qkv = np.moveaxis(tensors.pop("layer.attn.qkv_kernel"), -1, 0)  # [E, G, R+2, D]
    gate_up = np.swapaxes(tensors.pop("layer.mlp.gate_up_kernel"), 0, 1)  # [E, 2, F]
    if version == 2:
        tensors.update({"layer.attn.qkv_kernel": np.ascontiguousarray(qkv),
                        "layer.mlp.gate_up_kernel": np.ascontiguousarray(gate_up)})
    else:
        tensors.update({"layer.attn.q_kernel": np.ascontiguousarray(qkv[:, :, :R].reshape(E, H, -1)),
                        "layer.attn.k_kernel": np.ascontiguousarray(qkv[:, :, R]),
                        "layer.attn.v_kernel": np.ascontiguousarray(qkv[:, :, R + 1]),
                        "layer.mlp.gate_kernel": np.ascontiguousarray(gate_up[:, 0]),
                        "layer.mlp.up_kernel": np.ascontiguousarray(gate_up[:, 1])})
    (tmp_path / "old").mkdir()
    save_file(tensors, str(tmp_path / "old" / "drafter.safetensors"))
    record = json.loads((tmp_path / "new" / "drafter.json").read_text())
    assert record["format"] == 3
    (tmp_path / "old" / "drafter.json").write_text(json.dumps({**record, "format": version}))
    loaded = specjax.load_drafter(tmp_path / "old")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), loaded.params, eagle.params)
    del tensors["layer.mlp.down_kernel"]
    save_file(tensors, str(tmp_path / "old" / "drafter.safetensors"))
    with pytest.raises(CheckpointError, match=f"do not match its (layer's|record's) (format {version} )?shapes"):
        specjax.load_drafter(tmp_path / "old")


SHIPPED = Path(__file__).parent.parent / "checkpoints"  # medusa (format 1), eagle and eagle3 (format 2)
DELETE = object()


def _record(folder, **changes):
    """Rewrites folder's drafter.json with changes (DELETE: the key removed)."""
    record = json.loads((folder / "drafter.json").read_text())
    record.update(changes)
    (folder / "drafter.json").write_text(json.dumps({k: v for k, v in record.items() if v is not DELETE}))


def _layer(folder, **changes):
    """Rewrites the layer config in folder's drafter.json with changes."""
    _record(folder, layer={**json.loads((folder / "drafter.json").read_text())["layer"], **changes})


def _tensors(folder, change):
    """Rewrites folder's drafter.safetensors with change(tensors)."""
    from safetensors.numpy import load_file, save_file

    file = str(folder / "drafter.safetensors")
    save_file(change(load_file(file)), file)


def _poisoned(name, value):
    def change(tensors):
        w = tensors[name].copy()
        w.flat[7] = value
        return {**tensors, name: w}
    return change


# case: (shipped folder, its edit, the file the refusal names, a fragment of the refusal)
HOSTILE = {
    "kind a list": ("medusa", lambda f: _record(f, kind=["medusa"]), "json", "unknown drafter kind"),
    "eagle kind on medusa": ("medusa", lambda f: _record(f, kind="eagle"), "json", '"layer"'),
    "no layer": ("eagle", lambda f: _record(f, layer=DELETE), "json", '"layer"'),
    "eagle3 kind on eagle": ("eagle", lambda f: _record(f, kind="eagle3"), "json", '"feature_layers"'),
    "feature layer 0": ("eagle", lambda f: _record(f, kind="eagle3", feature_layers=[0, 1, 2]), "json",
                        "feature layers must be layer numbers"),
    "draft_vocab repeats": ("eagle3", lambda f: _record(f, draft_vocab=[3, 5, 3]), "json",
                            "draft vocabulary ids must be distinct; 3 repeats"),
    "draft_vocab out of order": ("eagle3", lambda f: _record(f, draft_vocab=[5, 3]), "json", "must increase"),
    "draft_vocab past V": ("eagle3", lambda f: _record(f, draft_vocab=[0, 4096]), "json", "must lie in 0..4095"),
    "draft_vocab floats": ("eagle3", lambda f: _record(f, draft_vocab=[1.0, 2.0]), "json", "token ids (integers)"),
    "draft_vocab empty": ("eagle3", lambda f: _record(f, draft_vocab=[]), "json", "non-empty list"),
    "draft_vocab, no head": ("eagle3", lambda f: _record(f, draft_vocab=[1, 2]), "safetensors",
                             "do not match its record's shapes"),
    "layer a list": ("eagle", lambda f: _record(f, layer=[]), "json", '"layer"'),
    "layer a string": ("eagle", lambda f: _record(f, layer="llama"), "json", '"layer"'),
    "invalid utf-8": ("medusa", lambda f: (f / "drafter.json").write_bytes(b'{"kind": "\xff"}'), "json",
                      "not valid JSON"),
    "nested 100000 deep": ("medusa", lambda f: (f / "drafter.json").write_text("[" * 100000 + "]" * 100000),
                           "json", "too deeply"),
    "format 1.0": ("eagle", lambda f: _record(f, format=1.0), "json", "format 1.0"),
    "format true": ("medusa", lambda f: _record(f, format=True), "json", "format True"),
    "num_heads 4.0": ("medusa", lambda f: _record(f, num_heads=4.0), "json", "num_heads 4.0"),
    "target size text": ("medusa", lambda f: _record(f, target={"model_type": "llama", "hidden_size": "384",
                                                                "vocab_size": 4096}), "json", '"target"'),
    "2**63 layers": ("eagle", lambda f: _layer(f, num_hidden_layers=2**63), "json", "one layer"),
    "head_dim 2**40": ("eagle", lambda f: _layer(f, head_dim=2**40), "json", "larger than any tensor"),
    "odd head_dim": ("eagle", lambda f: _layer(f, head_dim=1), "json", '"layer"'),
    "pad_token_id an object": ("eagle", lambda f: _layer(f, pad_token_id={}), "json", '"layer"'),
    "tensor under a tensor": ("medusa", lambda f: _tensors(f, lambda t: {**t, "kernel.x": t["bias"]}),
                              "safetensors", "kernel.x is named as if inside tensor kernel"),
    "tensor over tensors": ("eagle", lambda f: _tensors(f, lambda t: {**t, "layer": t["fc.bias"]}),
                            "safetensors", "inside tensor layer"),
    "int64 kernel": ("medusa", lambda f: _tensors(f, lambda t: {**t, "kernel": t["kernel"].astype(np.int64)}),
                     "safetensors", "kernel is I64"),
    "float8 kernel": ("eagle", lambda f: _tensors(f, lambda t: {**t, "fc.kernel": t["fc.kernel"].astype(
        ml_dtypes.float8_e4m3fn)}), "safetensors", "fc.kernel is F8_E4M3"),
    "NaN": ("medusa", lambda f: _tensors(f, _poisoned("bias", np.nan)), "safetensors", "bias holds NaN"),
    "inf": ("eagle", lambda f: _tensors(f, _poisoned("layer.mlp.down_kernel", -np.inf)), "safetensors",
            "layer.mlp.down_kernel holds NaN, infinite or absurd"),
    "weights a FIFO": ("medusa", lambda f: ((f / "drafter.safetensors").unlink(),
                                            os.mkfifo(f / "drafter.safetensors")), "safetensors",
                       "not a regular file"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_drafter_files_are_refused_clearly(tmp_path, case):
    """Each bad file of a copy of a shipped drafter is refused with a CheckpointError whose
    one line names the file and the problem (no error from inside, no nonsense accepted)."""
    kind, edit, ext, fragment = HOSTILE[case]
    folder = Path(shutil.copytree(SHIPPED / kind, tmp_path / kind))
    edit(folder)
    with pytest.raises(CheckpointError) as refusal:
        specjax.load_drafter(folder)
    message = str(refusal.value)
    assert f"{folder}/drafter.{ext}" in message and fragment in message and "\n" not in message, message


def test_eagle3_training_time_test_drafts_as_the_loop_does(pair):
    """`unrolled` step j at position t (what training fits) gives the logits that drafting
    j+1 deep from the root t-j gives (the drafter's own `advance` and `read`): the root's
    pair with the target's features over a cache of the earlier pairs, then the drafter's
    own outputs; with a reduced draft vocabulary too (both over its ids)."""
    target = pair[0]
    for drafter in (specjax.Eagle3.init(target, KEY), DRAFTERS["eagle3_reduced"](target)):
        check_unrolled_drafts_as_the_loop_does(drafter.bind(target), target)
    with pytest.raises(ValueError, match="feature layers must be layer numbers in 1..2"):
        specjax.Eagle3.init(target, KEY, feature_layers=(1, 3))


def check_unrolled_drafts_as_the_loop_does(drafter, target):
    """`unrolled` step j at position t equals drafting j+1 deep from the root t-j through the
    drafter's own `advance` (a cache of the earlier pairs with the target's features, then
    its own outputs) and `read`, to 1e-5 (tests/test_published.py's heads too)."""
    from specjax.cache import KVCache
    from specjax.drafters.eagle3 import unrolled
    from specjax.models import apply

    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, tiny.VOCAB)
    positions = jax.numpy.broadcast_to(jax.numpy.arange(11), (2, 11))
    _, taps, _ = apply(target, tokens[:, :-1], positions, taps=drafter.feature_layers)
    assert taps.shape == (2, 11, len(drafter.feature_layers) * target.config.hidden_size)
    # (jitted: op by op, these took most of a minute of the suite)
    steps = jax.jit(unrolled, static_argnums=5)(drafter, drafter.params, target, tokens[:, 1:], taps, 3)
    advance, read = jax.jit(type(drafter).advance), jax.jit(type(drafter).read)
    root = 5
    cache = KVCache.init(drafter.config, 2, 32, jax.numpy.float32)
    _, cache = advance(drafter, target, tokens[:, 1:root + 1], taps[:, :root], positions[:, :root], cache)
    g, cache = advance(drafter, target, tokens[:, root + 1:root + 2], taps[:, root:root + 1],
                       positions[:, root:root + 1], cache)
    np.testing.assert_allclose(steps[0][:, root], read(drafter, target, g)[:, 0], atol=1e-5)
    for j in (1, 2):
        t = root + j
        g, cache = advance(drafter, target, tokens[:, t + 1:t + 2], g, positions[:, t:t + 1], cache)
        np.testing.assert_allclose(steps[j][:, t], read(drafter, target, g)[:, 0], atol=1e-5, err_msg=f"step {j}")


def test_a_reduced_draft_vocabulary_reads_out_the_targets_rows(pair):
    """with_vocab(ids) gives a head of the target's rows for ids: the same logits as the
    whole head at those ids, over those ids alone; vocabularies are the most frequent ids;
    a tree wider than the vocabulary and a second reduction are refused."""
    from specjax.drafters.vocab import draft_vocabulary

    target = pair[0]
    V = target.config.vocab_size
    ids = draft_vocabulary(np.array([[5, 9, 9, 2], [9, 5, 7, 0]]), 3, V)
    np.testing.assert_array_equal(ids, [0, 5, 9])  # 9 thrice, 5 twice, then the lowest of 0, 2, 7 (once each)
    whole = specjax.Eagle3.init(target, KEY)
    reduced = whole.with_vocab(target, ids)
    assert reduced.params["head"]["kernel"].shape == (target.config.hidden_size, 3)
    x = jax.random.normal(jax.random.key(3), (2, 4, target.config.hidden_size))
    full, part = whole.read(target, x), reduced.read(target, x)
    assert part.shape == (2, 4, 3) and reduced.draft_vocab.tolist() == [0, 5, 9] and whole.draft_vocab is None
    np.testing.assert_allclose(part, full[..., ids], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="takes 4 candidates per node, but this EAGLE-3 drafter drafts from 3"):
        reduced.replace(tree=Tree(depth=2, top_k=4, nodes=4)).resolve(None)
    with pytest.raises(ValueError, match="already has a reduced draft vocabulary"):
        reduced.with_vocab(target, ids)
    with pytest.raises(ValueError, match="a draft vocabulary has 1..97 tokens"):
        draft_vocabulary(ids, 0, V)


@pytest.mark.parametrize("kind", ["Eagle", "Eagle3"])
def test_a_layer_of_another_size_is_refused(pair, kind):
    """Same family, width and vocabulary (the signature passes), another MLP width: the
    drafter's weights cannot run as the target's layer, and binding says so."""
    target = pair[0]
    wider = dataclasses.replace(target.config, intermediate_size=2 * target.config.intermediate_size)
    other = specjax.models.init(wider, jax.random.key(0))
    drafter = getattr(specjax, kind).init(other, KEY)
    padded, lengths = specjax.pad_prompts([[3, 4, 5]])
    name = {"Eagle": "EAGLE", "Eagle3": "EAGLE-3"}[kind]
    with pytest.raises(ValueError, match=f"this {name} drafter's weights do not match the target's sizes"):
        specjax.generate(target, padded, lengths, draft=drafter, max_new_tokens=4)


def test_shapes_are_refused_clearly(pair):
    target, _, _ = pair
    with pytest.raises(ValueError, match="at most 3 deep"):
        specjax.generate(target, *specjax.pad_prompts([[3, 4]]), draft=specjax.Medusa.init(target, 3, KEY),
                         num_draft_tokens=5, max_new_tokens=4)
    with pytest.raises(ValueError, match="num_heads >= 1"):
        specjax.Medusa.init(target, 0, KEY)


# ---- training ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def own_text(pair):
    """The target's own greedy continuations of random prompts (what self-distillation
    learns from), in one batch: 48 rows to train on and 16 held out (other prompts)."""
    target = pair[0]
    rows, length = 64, 48
    prompts = np.random.RandomState(0).randint(2, tiny.VOCAB, (rows, 2)).astype(np.int32)
    out = specjax.generate(target, prompts, np.full(rows, 2, np.int32), max_new_tokens=length)
    text = np.concatenate([prompts, np.asarray(out.tokens)], axis=1)  # [rows, 2 + length]
    return text[:48].reshape(-1), text[48:].reshape(-1)


# (the suite's time on 2 cores: test_train trains the shared loop)
@pytest.mark.parametrize("kind", [pytest.param("medusa", marks=pytest.mark.slow),
                                  pytest.param("eagle", marks=pytest.mark.slow),
                                  pytest.param("eagle3", marks=pytest.mark.slow),
                                  pytest.param("eagle3_reduced", marks=pytest.mark.slow)])
def test_training_raises_acceptance_and_stays_exact(pair, own_text, tmp_path, kind):
    from specjax.train import TrainConfig, heads

    target, _, torch_model = pair
    stream, held = own_text
    probe = held[:4 * 16].reshape(4, 16)
    cfg = TrainConfig(steps=100, batch=8, seq_len=32, lr=1e-2, warmup=5, eval_every=100, eval_batches=2,
                      checkpoint_every=100)
    quiet = dict(progress=False, log=lambda s: None, probe_prompts=probe)
    one_step = dataclasses.replace(cfg, steps=1)
    if kind == "medusa":
        untrained = heads.train_medusa(target, 3, stream, held, one_step,
                                       tmp_path / "a", **quiet)[1]
        drafter, trained = heads.train_medusa(target, 3, stream, held, cfg, tmp_path / "b", **quiet)
    else:
        train = heads.train_eagle if kind == "eagle" else heads.train_eagle3
        if kind == "eagle3_reduced":  # the text's 48 most frequent of 97 tokens
            train = functools.partial(heads.train_eagle3, draft_vocab=48)
        untrained = train(target, stream, held, one_step, tmp_path / "a", **quiet)[1]
        drafter, trained = train(target, stream, held, cfg, tmp_path / "b", **quiet)
    assert trained["loss"] < 0.9 * untrained["loss"], (untrained, trained)
    if kind == "eagle3_reduced":
        assert drafter.vocab.shape == (48,) and drafter.params["head"]["kernel"].shape[1] == 48
    if kind.startswith("eagle3"):  # trained over unrolled steps: deeper guesses improve too
        assert trained["depth_2"] > untrained["depth_2"] + 0.1, (untrained, trained)
    if kind != "medusa":  # it sees token t+1: on greedy text it learns to guess t+2 well
        assert trained["depth_1"] > untrained["depth_1"] + 0.2, (untrained, trained)
        # a reduced vocabulary never drafts the tokens it lacks: less to gain in the loop
        gain = 0.2 if kind == "eagle3_reduced" else 0.4
        assert trained["tokens_per_pass"] > untrained["tokens_per_pass"] + gain, (untrained, trained)
    else:  # from h_t alone, on a random tiny target, there is less to learn
        assert trained["tokens_per_pass"] > untrained["tokens_per_pass"], (untrained, trained)
    prompts = _prompts(4, seed=9)
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    out = specjax.generate(target, padded, lengths, draft=drafter.replace(tree=Tree(3, 2, 8)),
                           max_new_tokens=MAX_NEW)
    assert tiny.rows(out) == [tiny.transformers_greedy(torch_model, p, MAX_NEW) for p in prompts]
    assert int(out.stats.accepted.sum()) > 0


CHILD = Path(__file__).with_name("resume_child.py")


def _run_child(kind, run_dir, jax_cache, kill_during_save=False, kill_after=None):
    """Runs the child; with kill_during_save, SIGKILLs it as soon as a checkpoint is being
    written (orbax's temporary directory exists); with kill_after, after that many seconds.
    Children share the persistent compilation cache jax_cache, so that only the first one
    compiles. Returns True if it finished on its own."""
    env = {**os.environ, "PYTHONPATH": str(CHILD.parent.parent), "JAX_COMPILATION_CACHE_DIR": str(jax_cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    proc = subprocess.Popen([sys.executable, str(CHILD), kind, str(run_dir)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start, checkpoints = time.monotonic(), Path(run_dir) / "checkpoints"
    while proc.poll() is None:
        saving = checkpoints.exists() and any("tmp" in p.name for p in checkpoints.iterdir())
        if (kill_during_save and saving) or (kill_after is not None and time.monotonic() - start > kill_after):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return False
        time.sleep(0.002)
    assert proc.returncode == 0
    return True


@pytest.mark.slow  # the shared loop's resume is also checked by test_train's test_resume_gives_the_same_params
@pytest.mark.parametrize("kind", ["eagle", "lm"])
def test_sigkill_at_random_moments_resumes_bit_for_bit(tmp_path, kind):
    """The shared training loop (heads and models alike), killed with SIGKILL while saving
    a checkpoint and at random moments, restarted each time, ends with params bit-equal to
    an unbroken run's. The first unbroken run compiles (and fills the children's compilation
    cache); a second one, which reads its programs from that cache as every later child
    does, must end bit-equal too, and its time is what the kill moments are fractions of."""
    cache = tmp_path / "jax-cache"
    assert _run_child(kind, tmp_path / "straight", cache)
    start = time.monotonic()
    assert _run_child(kind, tmp_path / "again", cache)
    unbroken = time.monotonic() - start  # start-up included
    rng = np.random.RandomState(0)
    broken = tmp_path / "broken"
    assert not _run_child(kind, broken, cache, kill_during_save=True)  # killed while writing step 1
    kills, finished = 1, False
    while not finished:  # then at random moments (a run resumed late may finish first)
        delay = rng.uniform(0.3, 0.8) * unbroken
        finished = (_run_child(kind, broken, cache, kill_after=delay) if kills < 4
                    else _run_child(kind, broken, cache))
        kills += not finished
    assert kills >= 2
    a = np.load(tmp_path / "straight" / "params.npz")
    for other in ("again", "broken"):
        b = np.load(tmp_path / other / "params.npz")
        assert sorted(a) == sorted(b)
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"{other}: {name}")
