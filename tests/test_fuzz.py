"""Fuzz tests: values hypothesis chooses, from hostile to merely odd, end either in a clear
refusal (one of specjax's errors, naming what is wrong) or in a correct answer: never a
NaN, a crash from deep inside, or a hang.

Two sections: the inputs of a `generate` call (one compiled shape, values fuzzed), and the
files of a checkpoint folder (config values, JSON types, file kinds, shard paths).
Examples are derandomized (the same 100 per test on every run); SPECJAX_FUZZ_EXAMPLES=N
searches N fresh ones.
"""

import json
import os
import shutil
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specjax
from specjax.hf import CheckpointError
from specjax.hf_config import InvalidConfigError, UnsupportedConfigError
from tests import tiny

# SPECJAX_FUZZ_EXAMPLES=N: N fresh random examples per test instead of the fixed 100 (a deeper
# search, run by hand; the suite's are derandomized).
EXAMPLES = os.environ.get("SPECJAX_FUZZ_EXAMPLES")
FUZZ = settings(max_examples=int(EXAMPLES or 100), deadline=None, derandomize=not EXAMPLES, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
REFUSALS = (CheckpointError, InvalidConfigError, UnsupportedConfigError)

# JSON values of every kind, the odd numbers included (json.dumps writes NaN and Infinity,
# which Python's json reads back, as transformers' configs are read).
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=6)


@pytest.fixture(scope="module")
def llama(hf_folder):
    folder, _ = hf_folder("llama")
    return folder, json.loads((folder / "config.json").read_text())


@pytest.fixture
def scratch(llama, tmp_path):
    """A fresh copy of the tiny Llama folder for each example (hypothesis reuses tmp_path)."""
    def copy():
        target = tmp_path / "ckpt"
        shutil.rmtree(target, ignore_errors=True)
        return shutil.copytree(llama[0], target)
    return copy


def _loads_and_computes(folder) -> bool:
    """True when the folder loads and a forward pass gives finite logits; False when it is
    refused with one of specjax's errors (whose message names the file or the key). Anything
    else fails the test."""
    try:
        model = specjax.load_model(folder)
    except REFUSALS as e:
        assert str(e) and "\n" not in str(e).strip(), e
        return False
    logits = np.asarray(specjax.forward(model, np.array([[1, 2, 3, 4]], np.int32)))
    assert np.isfinite(logits).all(), "a config that loads must compute finite logits"
    return True


# ---- inputs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(hf_folder):
    return specjax.load_model(hf_folder("llama")[0])


@FUZZ
@given(tokens=st.lists(st.integers(-2**63, 2**63 - 1), min_size=6, max_size=6),
       lengths=st.lists(st.integers(-2**63, 2**63 - 1), min_size=2, max_size=2),
       temperature=st.floats(allow_nan=True, allow_infinity=True),
       top_k=st.integers(-2**40, 2**40), top_p=st.floats(allow_nan=True, allow_infinity=True),
       eos=st.one_of(st.none(), st.integers(-2**40, 2**40), st.lists(st.integers(-5, 200), max_size=5)))
def test_generate_refuses_or_answers_whatever_the_values(target, tokens, lengths, temperature, top_k, top_p, eos):
    prompts = np.array(tokens, np.int64).reshape(2, 3)
    lengths = np.array(lengths, np.int64)
    try:
        out = specjax.generate(target, prompts, lengths, max_new_tokens=3, temperature=temperature,
                               top_k=top_k, top_p=top_p, eos_token_id=eos)
    except ValueError as e:
        assert str(e)
        return
    # it ran: every value was in range, and so is what came out
    assert ((0 <= prompts) & (prompts < tiny.VOCAB)).all() and ((1 <= lengths) & (lengths <= 3)).all()
    tokens_out = np.asarray(out.tokens)
    assert ((0 <= tokens_out) & (tokens_out < tiny.VOCAB)).all()


# ---- files: config values -------------------------------------------------------------------

CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "max_position_embeddings", "rope_theta", "rms_norm_eps",
               "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias", "hidden_act",
               "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "sliding_window")


@FUZZ
@given(key=st.sampled_from(CONFIG_KEYS), value=JSON_VALUES)
def test_any_config_value_is_refused_clearly_or_computes(llama, scratch, key, value):
    folder = scratch()
    (folder / "config.json").write_text(json.dumps({**llama[1], key: value}))
    _loads_and_computes(folder)


@FUZZ
@given(key=st.sampled_from(("eos_token_id", "bos_token_id", "pad_token_id", "do_sample", "temperature",
                            "top_k", "top_p", "min_p", "repetition_penalty")), value=JSON_VALUES,
       do_sample=st.booleans())
def test_any_generation_config_value_is_refused_clearly_or_honoured(scratch, key, value, do_sample):
    folder = scratch()
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": do_sample, key: value}))
    try:
        g = specjax.load_model(folder).generation_config
    except REFUSALS as e:
        assert "generation_config.json" in str(e), e
        return
    sampling = g.sampling()
    assert 0 <= sampling["temperature"] < float("inf") and sampling["top_k"] >= 0 and 0 < sampling["top_p"] <= 1
    assert 0 <= sampling["min_p"] <= 1 and 0 < sampling["repetition_penalty"] < float("inf")
    assert all(isinstance(i, int) and 0 <= i < tiny.VOCAB for i in g.eos_token_id)


# ---- files: JSON types ----------------------------------------------------------------------


@FUZZ
@given(name=st.sampled_from(("config.json", "generation_config.json", "model.safetensors.index.json")),
       value=JSON_VALUES)
def test_a_json_file_of_any_shape_is_refused_clearly_or_loads(scratch, name, value):
    folder = scratch()
    (folder / name).write_text(json.dumps(value))
    if name == "model.safetensors.index.json":
        (folder / "model.safetensors").rename(folder / "weights.safetensors")
    if _loads_and_computes(folder):  # of these, only a mapping of generation settings is usable
        assert name == "generation_config.json" and isinstance(value, dict), value


@FUZZ
@given(data=st.binary(max_size=300))
def test_bytes_of_any_kind_in_place_of_a_json_file_are_refused(scratch, data):
    folder = scratch()
    (folder / "config.json").write_bytes(data)
    with pytest.raises(REFUSALS):
        specjax.load_model(folder)


# ---- files: weights and their kinds ---------------------------------------------------------


@FUZZ
@given(cut=st.integers(0, 2**16), flips=st.lists(st.integers(0, 2**16), max_size=4), header=st.booleans())
def test_damaged_weights_are_refused_clearly_or_load_as_written(scratch, cut, flips, header):
    """Safetensors bytes cut short or flipped: in the header, a refusal; in the data, the
    values change (a checkpoint has no checksum to tell) and the load is clean, or refused
    where a value became NaN, infinite or absurd."""
    folder = scratch()
    weights = folder / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    for i in flips:
        raw[i % header_end if header else header_end + i % (len(raw) - header_end)] ^= 0x5A
    weights.write_bytes(bytes(raw[:len(raw) - cut % len(raw)] if cut else raw))
    try:
        specjax.load_model(folder)
    except REFUSALS as e:
        assert "safetensors" in str(e) or "tensor" in str(e) or "absurd values" in str(e), e


@pytest.mark.parametrize("kind", ["fifo", "folder", "device", "empty", "dangling link"])
def test_weights_that_are_not_a_regular_file_are_refused_without_reading(scratch, kind):
    folder = scratch()
    weights = folder / "model.safetensors"
    weights.unlink()
    {"fifo": lambda: os.mkfifo(weights), "folder": weights.mkdir, "device": lambda: weights.symlink_to("/dev/zero"),
     "empty": weights.touch, "dangling link": lambda: weights.symlink_to(folder / "gone")}[kind]()
    box = {}
    thread = threading.Thread(target=lambda: box.update(error=_error(lambda: specjax.load_model(folder))),
                              daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"loading blocked on a {kind}"
    assert isinstance(box["error"], CheckpointError), box["error"]


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- handed back to the test
        return e
    return None


# ---- files: shard paths ---------------------------------------------------------------------

PATHS = st.one_of(st.text(max_size=12), st.sampled_from(["..", ".", "/", "/etc/passwd", "../ckpt/x", "a/../../b",
                                                        "./model-1.safetensors", "~", "model-1.safetensors/"]))


@FUZZ
@given(name=PATHS)
def test_a_shard_index_names_files_of_its_folder_or_is_refused(scratch, name):
    folder = scratch()
    (folder / "model.safetensors").rename(folder / "model-1.safetensors")
    index = json.loads(json.dumps({"weight_map": {}}))
    from safetensors import safe_open

    with safe_open(folder / "model-1.safetensors", "np") as f:
        keys = list(f.keys())
    index["weight_map"] = {k: "model-1.safetensors" for k in keys}
    index["weight_map"][keys[0]] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if _loads_and_computes(folder):  # only the one real shard, named plainly, loads
        assert name == "model-1.safetensors"
