"""ModelConfig: both config.json layouts, round trips, and validation."""

import dataclasses

import numpy as np
import pytest

from specjax.config import ModelConfig, rope_inv_freq
from specjax.hf_config import UnsupportedConfigError
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


@pytest.mark.parametrize("rope, top", [
    ({"beta_fast": 4.0, "beta_slow": 0.25}, {}),  # the tiny model's
    ({"rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
      "beta_slow": 1.0, "truncate": False}, {"head_dim": 64}),  # gpt-oss's
    ({"rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, {"max_position_embeddings": 163840}),  # DeepSeek-V3's
    ({"mscale": 0.707, "mscale_all_dim": 1.0}, {}),  # mscales that differ: their ratio scales cos and sin
    ({"attention_factor": 0.5, "beta_fast": None, "beta_slow": 0}, {}),  # null / 0: transformers' defaults
    ({"factor": None}, {"max_position_embeddings": 64}),  # the factor derived: 64 / 8
    ({"original_max_position_embeddings": None}, {"original_max_position_embeddings": 16}),  # top-level first
])
def test_yarn_rope_is_transformers(rope, top):
    """Frequencies and the factor that scales cos and sin as transformers computes them, for
    the yarn configs of gpt-oss, DeepSeek-V3 and the tiny model, each optional key varied;
    and the config round trip keeps them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    hf = {**tiny.CONFIGS["llama_yarn"]().to_dict(), **top}
    hf["rope_parameters"] = {k: v for k, v in {**YARN, **rope}.items() if v is not None or k == "factor"}
    config = ModelConfig.from_hf_config(hf)
    theirs = tiny.CONFIGS["llama_yarn"]().__class__(**hf)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs)
    np.testing.assert_allclose(rope_inv_freq(config), inv_freq.numpy(), rtol=1e-6)
    assert config.rope_scaling.cos_sin_factor() == pytest.approx(factor, rel=1e-12)
    assert config.rope_scaling.attention_scale() == pytest.approx(yarn_apply_mscale(theirs.rope_parameters, 1.0))
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config


def test_qwen2_sliding_layers():
    hf = tiny.CONFIGS["qwen2"]().to_dict()
    hf.update(use_sliding_window=True, sliding_window=4, max_window_layers=1, layer_types=None)
    config = ModelConfig.from_hf_config(hf)
    assert config.layer_windows() == (None, 4)


@pytest.mark.parametrize("change, error, message", [
    ({"model_type": "bert"}, UnsupportedConfigError, "unsupported model_type 'bert'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, UnsupportedConfigError, "rope_type 'dynamic'"),
    ({"partial_rotary_factor": 0.5}, UnsupportedConfigError, "partial_rotary_factor"),
    ({"num_key_value_heads": 3}, ValueError, "num_key_value_heads=3 does not divide"),
    ({"num_hidden_layers": 0}, ValueError, "num_hidden_layers=0 must be a positive integer"),
])
def test_invalid_configs(change, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf_config({**LEGACY_LLAMA3, **change})


def test_gemma3_legacy_layout_reads_as_transformers_does():
    """transformers 4.x Gemma 3 configs: rope_theta (global), rope_local_base_freq,
    rope_scaling for the global layers only, sliding_window_pattern instead of layer_types."""
    import transformers as tr

    legacy = {k: v for k, v in tiny.CONFIGS["gemma3"]().to_dict().items()
              if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    legacy.update(rope_theta=5000.0, rope_local_base_freq=30.0, sliding_window_pattern=3,
                  rope_scaling={"rope_type": "linear", "factor": 4.0})
    ours = ModelConfig.from_hf_config(legacy)
    theirs = ModelConfig.from_hf_config(tr.Gemma3TextConfig(**legacy).to_dict())
    assert ours == theirs
    assert ours.layer_windows() == (4, 4, None)
    assert (ours.rope_theta, ours.rope_scaling.factor, ours.local_rope_theta) == (5000.0, 4.0, 30.0)
    # The sliding layers' frequencies are their own base's, unscaled.
    local, full = rope_inv_freq(ours, local=True), rope_inv_freq(ours)
    assert local[1] == pytest.approx(30.0 ** (-2 / 16)) and full[1] == pytest.approx(5000.0 ** (-2 / 16) / 4)


def test_gemma2_defaults_alternate_sliding_and_global_layers():
    hf = {k: v for k, v in tiny.CONFIGS["gemma2"]().to_dict().items()
          if k not in ("layer_types", "final_logit_softcapping", "attn_logit_softcapping")}
    config = ModelConfig.from_hf_config(hf)
    assert config.layer_windows() == (5, None, 5)
    assert (config.gemma.attn_softcap, config.gemma.final_softcap) == (50.0, 30.0)  # class defaults


@pytest.mark.parametrize("arch, change, message", [
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                  "long_factor": [2.0] * 4}}, "rope_type 'longrope'.*Phi-3"),
    ("phi3", {"rope_parameters": None, "rope_scaling": {"type": "su", "short_factor": [1.0] * 4}},
     "rope_type 'su'"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
     "partial_rotary_factor"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope scaling of sliding-window layers"),
    ("gemma3", {"model_type": "gemma3"}, "text-only gemma3_text"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}}, "rope_type 'dynamic'"),
])
def test_new_families_refuse_what_they_cannot_compute(arch, change, message):
    with pytest.raises(UnsupportedConfigError, match=message):
        ModelConfig.from_hf_config({**tiny.CONFIGS[arch]().to_dict(), **change})


def test_quantized_checkpoints_are_refused_by_name():
    """gpt-oss's own release holds MXFP4 experts: refused, pointing at a bfloat16 checkpoint."""
    hf = tiny.CONFIGS["gpt_oss"]().to_dict()
    with pytest.raises(UnsupportedConfigError, match="MXFP4.*unsloth/gpt-oss-20b-BF16"):
        ModelConfig.from_hf_config({**hf, "quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}})
    with pytest.raises(UnsupportedConfigError, match="quant_method 'gptq'"):
        ModelConfig.from_hf_config({**LEGACY_LLAMA3, "quantization_config": {"quant_method": "gptq", "bits": 4}})


def test_gpt_oss_defaults_are_its_class_defaults():
    """A gpt-oss config.json without rope, windows or activation keys reads as GptOssConfig
    fills them: yarn (factor 32 over 4,096, truncate false, base 150,000), windows of 128 on
    alternate layers from the first, the clamp at 7 with alpha 1.702, biased attention."""
    import transformers as tr

    hf = {k: v for k, v in tiny.CONFIGS["gpt_oss"]().to_dict().items()
          if k not in ("rope_parameters", "rope_scaling", "rope_theta", "sliding_window", "layer_types",
                       "swiglu_limit", "swiglu_alpha", "attention_bias")}
    ours = ModelConfig.from_hf_config(hf)
    assert ours == ModelConfig.from_hf_config(tr.GptOssConfig(**hf).to_dict())
    assert ours.layer_windows() == (128, None, 128) and ours.rope_theta == 150000.0
    assert (ours.rope_scaling.factor, ours.rope_scaling.truncate, ours.moe.swiglu_limit) == (32.0, False, 7.0)
    assert ours.qkv_bias and ours.out_bias and ours.attn_sinks


# GLM-4.5-Air's config.json in the layout its hub repository uses (transformers 4.x keys: a
# top-level rope_theta and partial_rotary_factor), with 2 of its 46 layers; values written from
# memory, not fetched (the test compares with transformers reading this same dict).
GLM_4_5_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
    "num_hidden_layers": 2, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5, "rope_theta": 1000000, "rope_scaling": None,
    "attention_bias": True, "use_qk_norm": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "hidden_act": "silu", "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338], "torch_dtype": "bfloat16"}


def test_glm4_moe_reads_as_transformers_does():
    """GLM-4.5-Air's own config.json (partial rotary at the top level), and one that leaves
    every optional key out (partial rotary 0.5, eps 1e-5, one group, routed scale 1, the
    first layer dense: Glm4MoeConfig's defaults), read as transformers reads them."""
    import transformers as tr

    air = ModelConfig.from_hf_config(GLM_4_5_AIR)
    assert air == ModelConfig.from_hf_config(tr.Glm4MoeConfig(**GLM_4_5_AIR).to_dict())
    assert (air.partial_rotary_factor, air.rotary_dim, air.rope_theta) == (0.5, 64, 1e6)
    assert air.qkv_bias and not air.out_bias and not air.qk_norm
    assert air.moe.router == "sigmoid_grouped" and air.moe.shared_size == 1408 and air.moe.dense_layers == (0,)
    optional = ("partial_rotary_factor", "rope_theta", "rope_scaling", "rms_norm_eps", "max_position_embeddings",
                "n_group", "topk_group", "first_k_dense_replace", "routed_scaling_factor", "n_shared_experts",
                "attention_bias", "use_qk_norm", "norm_topk_prob", "intermediate_size")
    bare = {k: v for k, v in GLM_4_5_AIR.items() if k not in optional}
    ours = ModelConfig.from_hf_config(bare)
    assert ours == ModelConfig.from_hf_config(tr.Glm4MoeConfig(**bare).to_dict())
    assert (ours.partial_rotary_factor, ours.norm_eps, ours.max_position_embeddings) == (0.5, 1e-5, 131072)
    assert (ours.moe.groups, ours.moe.routed_scale, ours.moe.dense_layers, ours.intermediate_size) == (
        1, 1.0, (0,), 10944)
    # rope_parameters' factor first (transformers 5.x), over the top-level one
    moved = {**bare, "partial_rotary_factor": 0.75, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                         "partial_rotary_factor": 0.25}}
    assert ModelConfig.from_hf_config(moved).rotary_dim == 32


@pytest.mark.parametrize("partial", [0.5, 0.75])
@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                   "beta_fast": 4.0, "beta_slow": 0.25}])
def test_partial_rotary_frequencies_are_transformers(rope, partial):
    """A partial rotary's frequencies are those of a head rotary_dim wide, for each rope type,
    as transformers computes them for glm4_moe (and the round trip keeps the factor)."""
    import transformers as tr
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

    hf = {**tiny.CONFIGS["glm4_moe"]().to_dict(), "partial_rotary_factor": partial,
          "rope_parameters": {**rope, "rope_theta": 100.0, "partial_rotary_factor": partial}}
    config = ModelConfig.from_hf_config(hf)
    theirs = tr.Glm4MoeConfig(**hf)
    init = ROPE_INIT_FUNCTIONS.get(rope["rope_type"], Glm4MoeRotaryEmbedding.compute_default_rope_parameters)
    inv_freq, factor = init(theirs)
    assert config.rotary_dim == int(16 * partial) == 2 * len(inv_freq)
    np.testing.assert_allclose(rope_inv_freq(config), inv_freq.numpy(), rtol=1e-6)
    assert config.rope_scaling.cos_sin_factor() == pytest.approx(factor)
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config


@pytest.mark.parametrize("arch, change", [
    ("qwen3", {"partial_rotary_factor": 0.25}),  # Qwen3-Next's, on a model type that would ignore it
    ("qwen3_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}}),
    ("qwen2", {"rope_parameters": None, "rope_scaling": {"rope_type": "linear", "factor": 2.0,
                                                         "partial_rotary_factor": 0.5}}),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.5}}}),
    ("deepseek_v3", {"partial_rotary_factor": 0.5}),
    ("mixtral", {"partial_rotary_factor": 0.5}),
])
def test_partial_rotary_is_refused_where_it_is_not_glm4_moe(arch, change):
    """Only glm4_moe rotates part of each head; anywhere else a factor != 1 (top level, rope
    parameters, a layer type's rope, legacy rope_scaling) is refused by name, never ignored."""
    with pytest.raises(UnsupportedConfigError, match=f"partial_rotary_factor=0.(25|5) .*not supported for {arch}"):
        ModelConfig.from_hf_config({**tiny.CONFIGS[arch]().to_dict(), **change})
    same = {**tiny.CONFIGS[arch]().to_dict(), "partial_rotary_factor": 1.0}  # 1: the whole head, as without
    assert ModelConfig.from_hf_config(same) == ModelConfig.from_hf_config(tiny.CONFIGS[arch]().to_dict())


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


NAN, INF = float("nan"), float("inf")
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 8}


@pytest.mark.parametrize("arch, change, message", [
    ("llama3", {"rope_theta": 0.0}, "config.json: rope_theta must be a finite number > 0, got 0.0"),
    ("llama3", {"rope_theta": -10000.0}, "rope_theta must be"),
    ("llama3", {"rope_theta": INF}, "rope_theta must be"),
    ("llama3", {"rope_theta": NAN}, "rope_theta must be"),
    ("llama3", {"rms_norm_eps": 0.0}, "config.json: rms_norm_eps must be"),
    ("llama3", {"rms_norm_eps": NAN}, "rms_norm_eps must be"),
    ("llama3", {"rms_norm_eps": INF}, "rms_norm_eps must be"),
    ("llama3", {"rope_scaling": {**LEGACY_LLAMA3["rope_scaling"], "factor": 0.0}}, r"rope_parameters.factor \(or rope_scaling.factor\) must be"),
    ("llama3", {"rope_scaling": {**LEGACY_LLAMA3["rope_scaling"], "high_freq_factor": 1.0}},
     "high_freq_factor .* must exceed low_freq_factor"),
    ("llama3", {"rope_scaling": {**LEGACY_LLAMA3["rope_scaling"], "low_freq_factor": NAN}}, r"rope_parameters.low_freq_factor \(or rope_scaling.low_freq_factor\) must be"),
    ("llama3", {"rope_scaling": "llama3"}, "config.json: rope_scaling=.llama3. must be an object"),
    ("gemma2", {"final_logit_softcapping": 0.0}, "config.json: final_logit_softcapping must be"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be"),
    ("gemma2", {"query_pre_attn_scalar": NAN}, "config.json: query_pre_attn_scalar must be"),
    ("llama3", {"rope_theta": "ten thousand"}, "config.json: rope_theta=.ten thousand. must be a number"),
    ("llama3", {"rope_theta": 1e-300}, "rope_theta must be > 1"),
    ("gemma2", {"attn_logit_softcapping": 1e308}, "attn_logit_softcapping must be a finite number"),
    ("qwen2_sliding", {"layer_types": ["sliding_attention"]}, "layer_types=.* one per layer"),
    ("qwen2_sliding", {"sliding_window": 1.5}, r"sliding_window=1.5 must be an integer in \[1, 2\*\*31\)"),
    ("gpt2", {"layer_norm_epsilon": -1e-5}, "config.json: layer_norm_epsilon must be"),
    ("gemma3", {"rope_local_base_freq": 0.0}, "rope_local_base_freq .* must be"),
    *(("llama_yarn", {"rope_parameters": {**YARN, **change}}, message) for change, message in [
        ({"beta_fast": -1.0}, r"rope_parameters.beta_fast \(or rope_scaling.beta_fast\) must be a finite number > 0"),
        ({"beta_slow": NAN}, "rope_parameters.beta_slow .* must be"),
        ({"attention_factor": 0.0}, "rope_parameters.attention_factor .* must be"),
        ({"original_max_position_embeddings": -8}, "rope_parameters.original_max_position_embeddings .* must be"),
        ({"truncate": "yes"}, "rope_parameters.truncate='yes' .* must be true or false"),
        ({"mscale": "one"}, "rope_parameters holds mscale='one', which must be a number"),
        ({"mscale": -20.0, "mscale_all_dim": 1.0}, "mscale=-20.0 and mscale_all_dim=1.0 give the attention factor"),
        ({"factor": None, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ]),
    ("llama_yarn", {"rope_parameters": {k: v for k, v in YARN.items() if k != "factor"}}, "yarn rope .* needs"),
    ("glm4_moe", {"partial_rotary_factor": 1.5, "rope_parameters": None},
     r"config.json: partial_rotary_factor \(rope_parameters' or top-level\) must be a number in \(0, 1\], got 1.5"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.0}},
     "partial_rotary_factor .* got 0.0"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     r"partial_rotary_factor=0.1 of head_dim=16 rotates .* = 1 lanes, which must be even"),
    ("glm4_moe", {"partial_rotary_factor": "half"}, "config.json: partial_rotary_factor='half' must be a number"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": None}},
     "rope_parameters holds partial_rotary_factor=None, which must be a number"),
])
def test_configs_that_would_compute_garbage_are_refused(arch, change, message):
    """Values that load but give NaN logits or silently wrong ones: refused when read."""
    from specjax.hf_config import InvalidConfigError

    base = LEGACY_LLAMA3 if arch == "llama3" else tiny.CONFIGS[arch]().to_dict()
    if arch == "llama_yarn":
        base = {k: v for k, v in base.items() if k != "rope_scaling"}
    if arch == "gemma3" and "rope_parameters" in base:  # the local base read from the 5.x layout
        base = {**base, "rope_parameters": {**base["rope_parameters"], "sliding_attention": {
            "rope_type": "default", "rope_theta": 0.0}}}
        change = {}
    with pytest.raises(InvalidConfigError, match=message):
        ModelConfig.from_hf_config({**base, **change})
