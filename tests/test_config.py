"""ModelConfig: both config.json layouts, round trips, and validation."""

import dataclasses

import pytest

from specjax.config import ModelConfig, UnsupportedConfigError, rope_inv_freq
from tests import tiny

LEGACY_LLAMA3 = {  # transformers 4.x layout: top-level rope_theta and rope_scaling
    "model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("arch", list(tiny.CONFIGS))
def test_hf_config_round_trip(arch):
    config = ModelConfig.from_hf_config(tiny.CONFIGS[arch]().to_dict())
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config
    hash(config)  # a jit cache key


def test_legacy_and_new_rope_layouts_agree():
    legacy = ModelConfig.from_hf_config(LEGACY_LLAMA3)
    assert legacy.rope_theta == 500000.0 and legacy.rope_scaling.rope_type == "llama3"
    new = dict(LEGACY_LLAMA3)
    rope = {**new.pop("rope_scaling"), "rope_theta": new.pop("rope_theta")}
    assert ModelConfig.from_hf_config({**new, "rope_parameters": rope}) == legacy
    assert legacy.head_dim == 16 and legacy.num_kv_heads == 2


def test_llama3_scaling_changes_only_low_frequencies():
    scaled = rope_inv_freq(ModelConfig.from_hf_config(LEGACY_LLAMA3))
    plain = rope_inv_freq(ModelConfig.from_hf_config({**LEGACY_LLAMA3, "rope_scaling": None}))
    assert scaled[0] == plain[0]  # highest frequency untouched
    assert scaled[-1] == pytest.approx(plain[-1] / 8.0)  # lowest divided by factor


def test_qwen2_sliding_layers():
    hf = tiny.CONFIGS["qwen2"]().to_dict()
    hf.update(use_sliding_window=True, sliding_window=4, max_window_layers=1, layer_types=None)
    config = ModelConfig.from_hf_config(hf)
    assert config.layer_windows() == (None, 4)


@pytest.mark.parametrize("change, error, message", [
    ({"model_type": "bert"}, UnsupportedConfigError, "unsupported model_type 'bert'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, UnsupportedConfigError, "rope_type 'dynamic'"),
    ({"partial_rotary_factor": 0.5}, UnsupportedConfigError, "partial_rotary_factor"),
    ({"num_key_value_heads": 3}, ValueError, "not a multiple of num_kv_heads=3"),
    ({"num_hidden_layers": 0}, ValueError, "num_layers must be a positive int"),
])
def test_invalid_configs(change, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf_config({**LEGACY_LLAMA3, **change})


def test_gpt2_unsupported_options():
    hf = tiny.CONFIGS["gpt2"]().to_dict()
    with pytest.raises(UnsupportedConfigError, match="scale_attn_by_inverse_layer_idx"):
        ModelConfig.from_hf_config({**hf, "scale_attn_by_inverse_layer_idx": True})
    with pytest.raises(UnsupportedConfigError, match="activation_function 'relu'"):
        ModelConfig.from_hf_config({**hf, "activation_function": "relu"})


def test_num_params_matches_transformers():
    for arch in tiny.CONFIGS:
        model = tiny.build(arch)
        config = ModelConfig.from_hf_config(model.config.to_dict())
        assert config.num_params() == sum(p.numel() for p in model.parameters()), arch


def test_config_is_frozen():
    config = ModelConfig.from_hf_config(LEGACY_LLAMA3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.vocab_size = 3
