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


@pytest.mark.parametrize("arch", ["gpt2", "llama3", "qwen2", "mistral"] + tiny.NEW_FAMILIES)
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


@pytest.mark.parametrize("change, message", [
    ({"model_type": "falcon"}, "unsupported model_type 'falcon'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "unsupported rope_type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_unsupported_configs(llama_copy, change, message):
    config = json.loads((llama_copy / "config.json").read_text())
    (llama_copy / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(specjax.UnsupportedConfigError, match=message):
        specjax.load_model(llama_copy)
