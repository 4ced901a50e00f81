"""Hugging Face folders: round trips, sharded files, and bad checkpoints named clearly."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tr

import specjax
from specjax.hf import CheckpointError
from tests import tiny


def _assert_same_params(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("arch", ["gpt2", "llama3", "llama_yarn", "qwen2", "mistral", "gpt_oss", "glm4_moe"]
                         + tiny.NEW_FAMILIES)
def test_save_load_round_trip_and_transformers_reads_it(arch, hf_folder, tmp_path):
    folder, torch_model = hf_folder(arch)
    model = specjax.load_model(folder)
    specjax.save_model(model, tmp_path)
    again = specjax.load_model(tmp_path)
    assert again.config == model.config
    _assert_same_params(model.params, again.params)

    reloaded = tr.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="float32").eval()
    tokens = np.random.RandomState(0).randint(0, tiny.VOCAB, (2, 10))
    np.testing.assert_allclose(tiny.logits(reloaded, tokens), tiny.logits(torch_model, tokens),
                               atol=1e-6, rtol=0)


def test_save_model_files_take_the_umask_and_a_tokenizer_may_go_beside_them(hf_folder, tmp_path):
    """model.safetensors gets the mode any new file gets (0644 under a 022 umask, not the
    0600 of the temporary file it is renamed from); save_model(tokenizer=) saves one beside
    the weights (an object or a folder), and without one, loading it says so in a sentence."""
    import os
    import stat

    from specjax.text import NoTokenizerError

    model = specjax.load_model(hf_folder("llama")[0])
    tok = tiny.save_tokenizer(tmp_path / "tok", ["the cat sat on the mat"] * 20)
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(umask)
        try:
            folder = specjax.save_model(model, tmp_path / f"bare{umask:o}")
        finally:
            os.umask(old)
        assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()} == {
            "config.json": mode, "generation_config.json": mode, "model.safetensors": mode}
    with pytest.raises(NoTokenizerError, match=f"^{folder} has no tokenizer .*: load the tokenizer from a folder "
                                               r"that has it, or save one beside the weights with "
                                               r"specjax.save_model\(..., tokenizer=...\)$"):
        specjax.load_tokenizer(folder)
    for given in (tok, tmp_path / "tok"):
        folder = specjax.save_model(model, tmp_path / "whole", tokenizer=given)
        assert specjax.load_tokenizer(folder)("the mat")["input_ids"] == tok("the mat")["input_ids"]
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer"):
        specjax.save_model(model, tmp_path / "never", tokenizer=5)
    assert not (tmp_path / "never").exists()


def test_bfloat16_storage_loads_as_requested_dtype(hf_folder, tmp_path):
    folder, _ = hf_folder("llama")
    model = specjax.load_model(folder)
    specjax.save_model(model, tmp_path, dtype=jnp.bfloat16)
    assert specjax.load_model(tmp_path, dtype=jnp.float32).dtype == jnp.float32
    as_bf16 = specjax.load_model(tmp_path, dtype=jnp.bfloat16)
    assert as_bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(as_bf16.params["embedding"], np.float32),
                               np.asarray(model.params["embedding"]), rtol=1e-2)


def test_sharded_checkpoint(hf_folder, tmp_path):
    _, torch_model = hf_folder("llama")
    torch_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = specjax.load_model(tmp_path)
    tokens = np.arange(12)[None] % tiny.VOCAB
    np.testing.assert_allclose(np.asarray(specjax.forward(model, tokens)),
                               tiny.logits(torch_model, tokens), atol=1e-4, rtol=0)


def test_tokenizer_loads(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"]))
    tr.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(tmp_path)
    loaded = specjax.load_tokenizer(tmp_path)
    assert loaded.decode(loaded.encode("return x")) == "return x"


# ---- bad inputs ------------------------------------------------------------------------


@pytest.fixture
def llama_copy(hf_folder, tmp_path):
    folder, _ = hf_folder("llama")
    shutil.copytree(folder, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_missing_config(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        specjax.load_model(llama_copy)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        specjax.load_model(tmp_path / "nope")


def test_hub_id_offline_says_so():
    with pytest.raises(CheckpointError, match="could not be fetched"):
        specjax.load_model("specjax-test/does-not-exist")


@pytest.mark.parametrize("name", ["specjax-test-does-not-exist", "specjax-test/does-not-exist"])
def test_a_name_that_is_no_local_path_is_tried_as_a_hub_id(name, capsys):
    """With a slash or without one (as "gpt2"): offline, the refusal says it was tried as a
    hub id and is not in the local cache. A path the hub cannot hold is a missing folder."""
    with pytest.raises(CheckpointError, match=f"^{name} is not a local folder, and tried as a Hugging Face hub id it "
                                              f"could not be fetched: it is not in the local cache, and "
                                              f"HF_HUB_OFFLINE is set$"):
        specjax.load_model(name)
    assert capsys.readouterr().err == ""
    with pytest.raises(CheckpointError, match="^checkpoint folder specjax-test/does/not-exist does not exist$"):
        specjax.load_model("specjax-test/does/not-exist")


def test_missing_weights(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        specjax.load_model(llama_copy)


def test_truncated_safetensors(llama_copy):
    file = llama_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        specjax.load_model(llama_copy)


def test_wrong_tensor_shape(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config["intermediate_size"] = 64  # the file holds 48
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight has shape \(48, 32\)"):
        specjax.load_model(llama_copy)


def _edit_tensors(folder, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_missing_tensor(llama_copy):
    _edit_tensors(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensors.*model.layers.1.mlp.up_proj.weight"):
        specjax.load_model(llama_copy)


def test_unexpected_tensor(llama_copy):
    """A bias the config does not declare must not be silently dropped."""
    def add_bias(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.ones(64, np.float32)
    _edit_tensors(llama_copy, add_bias)
    with pytest.raises(CheckpointError, match=r"does not explain.*q_proj.bias"):
        specjax.load_model(llama_copy)


def test_multi_token_prediction_layers_past_the_decoder_are_ignored(hf_folder, tmp_path):
    """A GLM-4.5 checkpoint's MTP layer (num_nextn_predict_layers: model.layers.{L}.*, past its
    L layers) loads as transformers loads it, left out; the same tensors in a Llama's are refused."""
    folder, _ = hf_folder("glm4_moe")
    shutil.copytree(folder, tmp_path / "glm")
    plain = specjax.load_model(folder)

    def add_mtp(t):
        t["model.layers.3.eh_proj.weight"] = np.ones((32, 64), np.float32)
        t["model.layers.3.mlp.experts.0.gate_proj.weight"] = np.ones((16, 32), np.float32)
    _edit_tensors(tmp_path / "glm", add_mtp)
    config = json.loads((tmp_path / "glm" / "config.json").read_text())
    (tmp_path / "glm" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    _assert_same_params(specjax.load_model(tmp_path / "glm").params, plain.params)
    shutil.copytree(hf_folder("llama")[0], tmp_path / "llama")
    _edit_tensors(tmp_path / "llama", lambda t: t.update({"model.layers.2.eh_proj.weight": np.ones((32, 64),
                                                                                                     np.float32)}))
    with pytest.raises(CheckpointError, match=r"does not explain.*model.layers.2.eh_proj.weight"):
        specjax.load_model(tmp_path / "llama")


@pytest.mark.parametrize("change, message", [
    ({"model_type": "falcon"}, "unsupported model_type 'falcon'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "unsupported rope_type 'dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_unsupported_configs(llama_copy, change, message):
    config = json.loads((llama_copy / "config.json").read_text())
    (llama_copy / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(specjax.UnsupportedConfigError, match=message):
        specjax.load_model(llama_copy)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 0}, "hidden_size=0 must be a positive integer"),
    ({"num_hidden_layers": -2}, "num_hidden_layers=-2 must be a positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads=0 must be a positive integer"),
    ({"intermediate_size": "48"}, "intermediate_size='48' must be a positive integer"),
    ({"vocab_size": 10**9}, "vocab_size=1000000000 is absurd"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
    ({"hidden_size": 30, "head_dim": None}, "num_attention_heads=4 does not divide hidden_size=30"),
])
def test_nonsensical_configs_are_refused(llama_copy, change, message):
    """Refused from config.json alone, before a tensor is read or a buffer allocated."""
    config = json.loads((llama_copy / "config.json").read_text())
    (llama_copy / "config.json").write_text(json.dumps({**config, **change}))
    (llama_copy / "model.safetensors").write_bytes(b"never read")
    with pytest.raises(specjax.InvalidConfigError, match=message):
        specjax.load_model(llama_copy)


def test_explicit_head_dim_need_not_divide_the_hidden_size(hf_folder):
    """Llama's H * head_dim may differ from hidden_size (tiny "llama": 4 * 16 != 32)."""
    config = json.loads((hf_folder("llama")[0] / "config.json").read_text())
    assert config["num_attention_heads"] * config["head_dim"] != config["hidden_size"]
    specjax.ModelConfig.from_hf_config(config)
    with pytest.raises(specjax.InvalidConfigError, match="lacks the required key 'intermediate_size'"):
        specjax.ModelConfig.from_hf_config({k: v for k, v in config.items() if k != "intermediate_size"})


def test_pickle_weights_are_refused(llama_copy):
    import torch

    marker = llama_copy / "unpickled"

    class Payload:  # what a hostile pickle does when loaded
        def __reduce__(self):
            return (marker.write_text, ("ran",))

    (llama_copy / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "x": Payload()}, llama_copy / "pytorch_model.bin")
    with pytest.raises(specjax.UnsafeCheckpointError, match=r"pytorch_model.bin.*pickle.*safetensors"):
        specjax.load_model(llama_copy)
    assert not marker.exists()


def test_tensor_of_wrong_dtype_is_named(llama_copy):
    _edit_tensors(llama_copy, lambda t: t.update({"model.norm.weight": np.ones(32, np.int32)}))
    with pytest.raises(CheckpointError, match="model.norm.weight is int32"):
        specjax.load_model(llama_copy)


def test_generation_config_is_read_and_written(llama_copy, tmp_path):
    generation = {"eos_token_id": [1, 7, 9], "bos_token_id": 0, "do_sample": True,
                  "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "use_cache": True}
    (llama_copy / "generation_config.json").write_text(json.dumps(generation))
    model = specjax.load_model(llama_copy)
    g = model.generation_config
    assert g.eos_token_id == (1, 7, 9) and g.bos_token_id == 0
    # transformers' default top_k=50 applies when the file is silent about it
    assert g.sampling() == {"temperature": 0.6, "top_k": 50, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.1}
    assert g.ignored == ()
    reference = tr.GenerationConfig.from_pretrained(llama_copy)
    assert list(g.eos_token_id) == reference.eos_token_id
    specjax.save_model(model, tmp_path)
    assert specjax.load_model(tmp_path).generation_config == g.__class__(**{**g.__dict__, "ignored": ()})
    # without generation_config.json, config.json's ids (all of them) stand in
    (llama_copy / "generation_config.json").unlink()
    config = json.loads((llama_copy / "config.json").read_text())
    (llama_copy / "config.json").write_text(json.dumps({**config, "eos_token_id": [1, 2]}))
    g = specjax.load_model(llama_copy).generation_config
    assert g.eos_token_id == (1, 2) and g.sampling()["temperature"] == 0.0


@pytest.mark.parametrize("generation, message", [
    ({"eos_token_id": [1, tiny.VOCAB]}, "eos_token_id=.* is not a token id"),
    ({"do_sample": True, "temperature": -1.0}, "temperature=-1.0 must be a finite number > 0"),
    ({"do_sample": True, "temperature": float("inf")}, "temperature=inf must be a finite number > 0"),
    ({"do_sample": True, "top_p": 0}, r"top_p=0 must lie in \(0, 1\]"),
])
def test_nonsensical_generation_config_is_refused(llama_copy, generation, message):
    (llama_copy / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(specjax.InvalidConfigError, match=f"generation_config.json: {message}"):
        specjax.load_model(llama_copy)


@pytest.mark.parametrize("arch, stored", [("llama", "float32"), ("gpt2", "bfloat16")])
def test_piecewise_reads_equal_whole_reads(arch, stored, hf_folder, tmp_path, monkeypatch):
    """Copying tensors a few bytes at a time (through transposes, head splits and GPT-2's
    fused qkv, converting bfloat16 storage) gives exactly what one whole read gives."""
    from specjax import hf

    folder, _ = hf_folder(arch)
    whole = specjax.load_model(folder)
    if stored == "bfloat16":
        folder = specjax.save_model(whole, tmp_path, dtype=jnp.bfloat16)
        whole = specjax.load_model(folder)
    monkeypatch.setattr(hf, "CHUNK_BYTES", 100)
    pieces = specjax.load_model(folder)
    _assert_same_params(whole.params, pieces.params)
    assert hf.stats["elements_read"] == sum(x.size for x in jax.tree.leaves(whole.params))


def _memory_check(size):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "load_memory_check.py"
    result = subprocess.run([sys.executable, str(script), "--size", size], capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_load_peak_memory_is_about_the_parameters():
    """A 150 MB bfloat16 checkpoint in 4 shards loads with peak RSS <= 1.1x its size above
    the post-import baseline (it was ~3x when every tensor was read, stacked and cast)."""
    found = _memory_check("small")
    assert found["content_ok"] and found["param_bytes"] == found["checkpoint_bytes"]
    assert found["ratio"] <= 1.1, found


@pytest.mark.slow
def test_load_peak_memory_on_a_1gb_checkpoint():
    found = _memory_check("1g")
    assert found["content_ok"] and found["ratio"] <= 1.1, found


def test_tokenizers_are_compared_on_text(tmp_path):
    from specjax.text import TokenizerMismatchError, check_tokenizers

    a = tiny.save_tokenizer(tmp_path / "a", ["the cat sat on the mat"] * 20)
    same = specjax.load_tokenizer(tmp_path / "a")
    check_tokenizers(a, same)
    # same vocabulary size, other merges: only the ids of real text tell them apart
    b = tiny.save_tokenizer(tmp_path / "b", ["a dog ran to the park"] * 20, vocab_size=len(a))
    with pytest.raises(TokenizerMismatchError, match="differ: on a probe text"):
        check_tokenizers(a, b)


# ---- hostile folders ------------------------------------------------------------------------


def _finishes(fn, seconds=60):
    """fn()'s exception (or None), asserting it returned at all: a read of a FIFO would block."""
    import threading

    box = {}

    def run():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- handed back to the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the load blocked (a special file was read)"
    return box.get("error")


def test_special_files_are_refused_never_read(hf_folder, tmp_path):
    """A FIFO where weights, a shard index's shard or a datastore's arrays should be: a clear
    refusal, not a read that blocks forever."""
    import os

    folder = shutil.copytree(hf_folder("llama")[0], tmp_path / "fifo")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    error = _finishes(lambda: specjax.load_model(folder))
    assert isinstance(error, CheckpointError) and "not a regular file" in str(error), error
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model.safetensors"}}))
    error = _finishes(lambda: specjax.load_model(folder))
    assert isinstance(error, CheckpointError) and "not a regular file" in str(error), error

    store = tmp_path / "store"
    specjax.Datastore.build([[1, 2, 3, 4, 1, 2, 5]]).save(store)
    (store / "tokens.npy").unlink()
    os.mkfifo(store / "tokens.npy")
    error = _finishes(lambda: specjax.Datastore.load(store))
    assert isinstance(error, CheckpointError) and "not a regular file" in str(error), error


def test_a_shard_index_names_only_files_in_its_folder(hf_folder, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(hf_folder("llama")[0], outside)
    folder = shutil.copytree(hf_folder("llama")[0], tmp_path / "indexed")
    (folder / "model.safetensors").unlink()
    for name in ("../outside/model.safetensors", str(outside / "model.safetensors"), ".."):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": name}}))
        with pytest.raises(CheckpointError, match="outside its folder"):
            specjax.load_model(folder)


def test_a_tokenizer_that_needs_its_own_code_is_refused_and_never_runs(tmp_path):
    """An auto_map naming a tokenizer class shipped as Python in the folder: refused without a
    prompt (stdin is not read), and the folder's code never runs."""
    from pathlib import Path

    folder = tmp_path / "custom"
    folder.mkdir()
    shipped = Path(__file__).parent.parent / "checkpoints" / "target"
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(shipped / name, folder / name)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "CustomTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}}))
    marker = tmp_path / "ran"
    (folder / "tokenization_custom.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\nclass CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    with pytest.raises(specjax.hf.UnsafeCheckpointError, match="never runs"):
        specjax.load_tokenizer(folder)
    assert not marker.exists()


def test_a_missing_path_that_looks_like_a_hub_id_is_refused_in_one_line_offline(capsys):
    with pytest.raises(CheckpointError, match="could not be fetched"):
        specjax.load_model("checkpoints-typo/target")  # offline in the tests
    assert capsys.readouterr().err == ""  # offline: the refusal says it all, in one line


def test_config_files_of_absurd_shape_and_non_float_dtypes_are_refused(hf_folder, tmp_path):
    folder = shutil.copytree(hf_folder("llama")[0], tmp_path / "deep")
    with pytest.raises(ValueError, match="dtype must be a floating-point type"):
        specjax.load_model(folder, dtype=jnp.int8)
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nests its JSON too deeply"):
        specjax.load_model(folder)


def _tensor_bytes(folder):
    """(header dict, data bytes) of folder's model.safetensors."""
    raw = (folder / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_tensors(folder, header, data):
    text = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data)


def _poison(folder, value):
    """Every value of the first layer's down projection set to value (NaN, inf)."""
    header, data = _tensor_bytes(folder)
    entry = header["model.layers.0.mlp.down_proj.weight"]
    begin, end = entry["data_offsets"]
    n = (end - begin) // 4
    _write_tensors(folder, header, data[:begin] + np.full(n, value, np.float32).tobytes() + data[end:])


def _shift_offsets(folder, change):
    header, data = _tensor_bytes(folder)
    name = sorted(k for k in header if k != "__metadata__")[0]
    header[name]["data_offsets"] = change(header[name]["data_offsets"])
    _write_tensors(folder, header, data)


@pytest.mark.parametrize("harm, message", [
    (lambda f: _poison(f, np.nan), "parameter layers/0/mlp/down_kernel holds NaN, infinite or absurd values"),
    (lambda f: _poison(f, np.inf), "holds NaN, infinite or absurd values"),
    (lambda f: _poison(f, 1e38), r"magnitude 1e\+38, past 1e\+15"),
    (lambda f: _shift_offsets(f, lambda o: [str(o[0]), str(o[1])]), "must be lists of integers"),
    (lambda f: _shift_offsets(f, lambda o: [float(o[0]), float(o[1])]), "must be lists of integers"),
    (lambda f: _shift_offsets(f, lambda o: [o[0] + 4, o[1] + 4]), "tensors must tile the data"),
    (lambda f: (f / "model.safetensors").write_bytes((100_003).to_bytes(8, "little") + b"[" * 50_000
                                                     + b"]" * 50_000 + b"   " + bytes(64)), "nests its JSON too deeply"),
    (lambda f: (f / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": ["a"]}})),
     "no weight_map object of file names"),
])
def test_hostile_weights_are_refused_clearly(llama_copy, harm, message):
    harm(llama_copy)
    with pytest.raises(CheckpointError, match=message):
        specjax.load_model(llama_copy)


def test_a_tied_config_with_its_own_head_is_refused(hf_folder, tmp_path):
    """The tiny Llama's head is its own: a config that says tied would silently drop it."""
    folder = shutil.copytree(hf_folder("llama")[0], tmp_path / "untied")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from its embedding"):
        specjax.load_model(folder)


@pytest.mark.parametrize("name, content", [
    ("tokenizer.json", "{"), ("tokenizer.json", "[1, 2]"), ("tokenizer.json", "[" * 100_000),
    ("tokenizer_config.json", '"a string"'), ("tokenizer_config.json", '{"tokenizer_class": 5}'),
    ("tokenizer_config.json", '{"bos_token": [1]}'), ("tokenizer.json", None),
])
def test_hostile_tokenizer_files_are_refused_clearly(tmp_path, name, content):
    import os
    from pathlib import Path

    folder = shutil.copytree(Path(__file__).parent.parent / "checkpoints" / "target", tmp_path / "tok")
    (folder / name).unlink(missing_ok=True)
    if content is None:
        os.mkfifo(folder / name)
    else:
        (folder / name).write_text(content)
    error = _finishes(lambda: specjax.load_tokenizer(folder))
    assert isinstance(error, CheckpointError) and str(folder) in str(error), error
