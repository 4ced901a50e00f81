"""config.json and generation_config.json as transformers writes them: which keys hold
what, the defaults transformers' config classes give what a file leaves out, the readers
of what differs by model_type or by transformers version (rope, sliding windows), and the
checks that refuse values that make no sense before anything is allocated.

It turns dicts of plain values into plain values (ModelConfig's and GenerationConfig's
fields, which config.py assembles: config.py imports this module, never the reverse); it
opens no file (hf.py does) and knows nothing of weights, dtypes or devices. Anything a
config asks for that the decoder cannot compute exactly raises `UnsupportedConfigError`
here or in config.py, at load time, never a wrong answer later.
"""

from __future__ import annotations

import math
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# rope_parameters' keys each rope type reads beside rope_theta (yarn's optional ones may be null).
ROPE_KEYS = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                      "mscale_all_dim", "attention_factor", "truncate")}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")  # names transformers gives the tanh-approximated gelu


class UnsupportedConfigError(ValueError):
    """The checkpoint asks for an architecture or feature specjax does not implement."""


class InvalidConfigError(ValueError):
    """A config.json (or generation_config.json) value that makes no sense: a size that is
    not a positive integer, heads that do not divide, an absurd vocabulary."""


# ---- config.json ----------------------------------------------------------------------

# Where a config.json omits head_dim, transformers' class default (else E // H).
DEFAULT_HEAD_DIM = {"qwen3": 128, "gemma2": 256, "gemma3_text": 256, "gpt_oss": 64}
# The model types whose attention_bias puts biases on q, k, v and o.
ATTENTION_BIAS = ("llama", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "gpt_oss")
# Where a config.json omits max_position_embeddings, transformers' class default (else 2048).
DEFAULT_POSITIONS = {"deepseek_v3": 4096, "glm4_moe": 131072}
# Where a config.json omits rms_norm_eps, transformers' class default (else 1e-6).
DEFAULT_NORM_EPS = {"glm4_moe": 1e-5}
# Where a config.json omits the dense layers' intermediate_size, transformers' class default.
DEFAULT_INTERMEDIATE = {"glm4_moe": 10944}
# The model types whose rotary may rotate part of each head (partial_rotary_factor), as
# transformers' modeling file of each applies it (the first int(D * factor) lanes, halves
# rotated within them), with the factor their config class gives where config.json is silent.
# Every other model type refuses a factor != 1: its modeling file may apply it otherwise
# (GLM-4's dense model rotates interleaved pairs) or not at all.
PARTIAL_ROTARY = {"glm4_moe": 0.5}
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}


def _rope_entry(rope: dict, default_theta: float, where: str, max_positions: int,
                original: int | None = None) -> tuple[float, dict[str, Any]]:
    """One rope_parameters dict -> (theta, RopeScaling's fields); refuses what specjax
    cannot compute. max_positions: config.json's max_position_embeddings, and original: its
    top-level original_max_position_embeddings (Phi-3 keeps it there), which transformers puts
    in a llama3 or yarn rope's place, else the rope's own, else max_positions; yarn's factor,
    where null, is max_positions / original (as transformers derives it for DeepSeek-V3)."""
    rope = dict(rope)
    theta = float(rope.pop("rope_theta", default_theta))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type in ("longrope", "su"):
        raise UnsupportedConfigError(
            f"rope_type {rope_type!r} (Phi-3's long-context scaling, {where}) is not supported; "
            f"specjax supports {ROPE_TYPES}: use a checkpoint with plain rope, e.g. Phi-3's "
            f"4k-context variants")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedConfigError(
            f"unsupported rope_type {rope_type!r} ({where}); specjax supports {ROPE_TYPES}")
    if rope_type in ("llama3", "yarn"):
        given = rope.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = (original if original is not None else
                                                    given if given is not None else max_positions)
    fields = {k: rope[k] for k in ROPE_KEYS.get(rope_type, ()) if k in rope}
    if rope_type == "yarn":
        if "factor" not in rope:
            raise InvalidConfigError(f"config.json: a yarn rope ({where}) needs rope_parameters.factor")
        if fields["factor"] is None:  # (a bad original length is refused by ModelConfig's checks)
            original = fields["original_max_position_embeddings"]
            fields["factor"] = max_positions / original if isinstance(original, int) and original > 0 else 1.0
        fields = {k: v for k, v in fields.items() if v is not None}  # null: the default (None, 32, 1, True)
        if not isinstance(fields.get("truncate", True), bool):
            raise InvalidConfigError(f"config.json: rope_parameters.truncate={fields['truncate']!r} ({where}) "
                                     f"must be true or false")
        for k in ("beta_fast", "beta_slow"):  # transformers: `or 32`, `or 1`
            if fields.get(k) == 0:
                del fields[k]
    return theta, {"rope_type": rope_type, **fields}


# Where a config.json gives no rope_theta, its class's default (else 10000).
DEFAULT_THETA = {"gpt_oss": 150000.0}
# GptOssConfig's rope where config.json gives none.
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def read_rope(hf) -> tuple[float, dict[str, Any], float | None]:
    """(theta, RopeScaling's fields) of full-attention layers and the base of sliding ones
    (Gemma 3 only).

    transformers 5.x writes `rope_parameters` (for Gemma 3: one dict per layer type); 4.x
    wrote top-level `rope_theta` / `rope_scaling` (Gemma 3: and `rope_local_base_freq`)."""
    model_type = hf["model_type"]
    params = dict(hf.get("rope_parameters") or {})
    max_positions = hf.get("max_position_embeddings", 2048)
    if model_type != "gemma3_text":
        legacy = hf.get("rope_scaling") or {}
        if model_type == "gpt_oss" and not (legacy or params):  # its class's default rope
            params = dict(GPT_OSS_ROPE)
        theta = hf.get("rope_theta", DEFAULT_THETA.get(model_type, 10000.0))
        theta, scaling = _rope_entry({**legacy, **params}, theta, "rope_parameters", max_positions,
                                     hf.get("original_max_position_embeddings"))
        return theta, scaling, None
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:  # the 4.x layout: rope_scaling applies to the global layers only
        full = {**(hf.get("rope_scaling") or {}), **params}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    theta, scaling = _rope_entry(full, hf.get("rope_theta", 1_000_000.0), "full_attention layers", max_positions)
    local_theta, local_scaling = _rope_entry(local, 10000.0, "sliding_attention layers", max_positions)
    if local_scaling["rope_type"] != "default":
        raise UnsupportedConfigError(
            f"rope scaling of sliding-window layers ({local_scaling['rope_type']!r}) is not supported; "
            f"specjax scales only the full-attention layers' rope, as Gemma 3 checkpoints do")
    return theta, scaling, local_theta


def read_partial_rotary(hf) -> float:
    """The share of each head's lanes rotary rotates (ModelConfig.partial_rotary_factor), read
    as transformers reads it: rope_parameters' (or the legacy rope_scaling's), else config.json's
    top-level key, else the class default (`PARTIAL_ROTARY`; 1 elsewhere). A model type outside
    PARTIAL_ROTARY whose config gives a factor != 1 anywhere (top level, rope_parameters, each
    of Gemma 3's per-layer-type entries, rope_scaling) is refused."""
    model_type = hf["model_type"]
    ropes = [hf.get("rope_scaling") or {}, hf.get("rope_parameters") or {}]
    ropes += [v for rope in ropes for v in rope.values() if isinstance(v, dict)]  # per layer type
    given = [rope["partial_rotary_factor"] for rope in ropes if rope.get("partial_rotary_factor") is not None]
    if model_type not in PARTIAL_ROTARY:
        factors = given + ([hf["partial_rotary_factor"]] if hf.get("partial_rotary_factor") is not None else [])
        if any(f != 1 for f in factors):
            raise UnsupportedConfigError(
                f"partial_rotary_factor={next(f for f in factors if f != 1)!r} (rotary over part of each head) "
                f"is not supported for {model_type}; specjax supports it for {sorted(PARTIAL_ROTARY)}")
        return 1.0
    factor = {**ropes[0], **ropes[1]}.get("partial_rotary_factor")  # as `read_rope` merges them
    factor = hf.get("partial_rotary_factor") if factor is None else factor
    return PARTIAL_ROTARY[model_type] if factor is None else factor


def read_mla(hf) -> dict[str, Any]:
    """Latent attention's fields (config.Mla) of a deepseek_v3 config.json, with
    DeepseekV3Config's defaults; refuses attention biases (its experts: `read_moe`)."""
    if hf.get("attention_bias"):
        raise UnsupportedConfigError("deepseek_v3 with attention_bias=true is not supported")
    return {"q_lora_rank": hf.get("q_lora_rank", 1536), "kv_lora_rank": hf.get("kv_lora_rank", 512),
            "qk_nope_head_dim": hf.get("qk_nope_head_dim", 128), "qk_rope_head_dim": hf.get("qk_rope_head_dim", 64),
            "v_head_dim": hf.get("v_head_dim", 128), "rope_interleave": hf.get("rope_interleave", True)}


def read_windows(hf) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as transformers reads them for each model_type."""
    model_type, L = hf["model_type"], hf["num_hidden_layers"]
    if model_type in ("mistral", "phi3", "mixtral"):  # one window for every layer, if any
        return hf.get("sliding_window", 4096 if model_type == "mistral" else None), None
    if model_type in ("qwen2_moe", "qwen3_moe"):
        if hf.get("use_sliding_window"):  # no released checkpoint sets it
            raise UnsupportedConfigError(f"{model_type} with use_sliding_window=true is not supported")
        return None, None
    if model_type == "gpt_oss":  # sliding and full layers alternating unless layer_types says
        layer_types = tuple(hf.get("layer_types") or (
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)))
        if "sliding_attention" not in layer_types:
            return None, None
        return hf.get("sliding_window", 128), layer_types
    if model_type in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window"):
            return None, None
        layer_types = tuple(hf.get("layer_types") or (
            "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
            for i in range(L)))
    elif model_type in ("gemma2", "gemma3_text"):
        # Gemma 2 alternates sliding and global layers; Gemma 3's older configs give a
        # pattern (every n-th layer global, 6 by default) instead of layer_types.
        every = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern",
                                                           hf.get("_sliding_window_pattern", 6))
        layer_types = tuple(hf.get("layer_types") or (
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(L)))
    else:
        return None, None
    if "sliding_attention" not in layer_types:
        return None, None
    return hf.get("sliding_window", 4096), layer_types


# model_type -> (its key for the number of experts, whether all its layers are sparse and
# its top-k weights always renormalised: Mixtral). transformers 5 writes Qwen3-MoE's count
# as num_local_experts; the released checkpoints say num_experts.
MOE_TYPES = {"qwen2_moe": "num_experts", "qwen3_moe": "num_experts", "mixtral": "num_local_experts",
             "deepseek_v3": "n_routed_experts", "gpt_oss": "num_local_experts", "glm4_moe": "n_routed_experts"}
# DeepSeek-V3's experts ("sigmoid_grouped", shared experts, first_k_dense_replace dense layers
# first), which GLM-4.5 shares: the keys' defaults of each model type's config class.
GROUPED_DEFAULTS = {
    "deepseek_v3": {"first_k_dense_replace": 3, "n_routed_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "norm_topk_prob": True, "n_group": 8, "topk_group": 4,
                    "routed_scaling_factor": 2.5, "n_shared_experts": 1},
    "glm4_moe": {"first_k_dense_replace": 1, "n_routed_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 1408, "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 1.0, "n_shared_experts": 1},
}


def read_moe(hf) -> dict[str, Any] | None:
    """`config.Moe`'s fields from config.json (None for a dense model_type). Which layers are
    sparse follows transformers: a layer not in mlp_only_layers whose number + 1 is a
    multiple of decoder_sparse_step (Qwen); every layer (Mixtral)."""
    model_type = hf["model_type"]
    if model_type not in MOE_TYPES:
        return None
    L = hf["num_hidden_layers"]
    if model_type in GROUPED_DEFAULTS:  # layers from first_k_dense_replace on are sparse
        get = lambda key: hf.get(key, GROUPED_DEFAULTS[model_type][key])  # noqa: E731
        dense = get("first_k_dense_replace")
        if dense >= L:
            return None
        size = get("moe_intermediate_size")
        return {"num_experts": get("n_routed_experts"), "top_k": get("num_experts_per_tok"),
                "expert_size": size, "norm_topk": bool(get("norm_topk_prob")),
                "router": "sigmoid_grouped", "groups": get("n_group"), "top_groups": get("topk_group"),
                "routed_scale": float(get("routed_scaling_factor")),
                "shared_size": size * (get("n_shared_experts") or 0), "dense_layers": tuple(range(dense))}
    count = hf.get(MOE_TYPES[model_type], hf.get("num_local_experts", hf.get("num_experts")))
    if count is None:
        raise InvalidConfigError(f"config.json ({model_type}) lacks {MOE_TYPES[model_type]}, the number of experts")
    if model_type == "mixtral":
        return {"num_experts": count, "top_k": hf.get("num_experts_per_tok", 2),
                "expert_size": hf["intermediate_size"], "norm_topk": True}
    if model_type == "gpt_oss":  # every layer sparse; biases everywhere; the clamped activation
        return {"num_experts": count, "top_k": hf.get("num_experts_per_tok", 4),
                "expert_size": hf.get("intermediate_size", 2880), "router": "topk_softmax",
                "router_bias": True, "expert_bias": True, "swiglu_limit": hf.get("swiglu_limit", 7.0),
                "swiglu_alpha": hf.get("swiglu_alpha", 1.702)}
    step = hf.get("decoder_sparse_step", 1)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise InvalidConfigError(f"config.json: decoder_sparse_step={step!r} must be a positive integer")
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise InvalidConfigError(f"config.json: mlp_only_layers={only!r} must be a list of layer numbers")
    dense = tuple(i for i in range(L) if i in only or (i + 1) % step)
    out = {"num_experts": count, "top_k": hf.get("num_experts_per_tok", 8 if model_type == "qwen3_moe" else 4),
           "expert_size": hf.get("moe_intermediate_size", 768 if model_type == "qwen3_moe" else 1408),
           "norm_topk": bool(hf.get("norm_topk_prob", False)), "dense_layers": dense}
    if model_type == "qwen2_moe":
        out.update(shared_size=hf.get("shared_expert_intermediate_size", 5632), shared_gate=True)
    return out


def write_moe(model_type: str, moe: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """config.json's keys for `config.Moe`'s fields (`read_moe` backwards)."""
    if model_type == "mixtral":
        return {"num_local_experts": moe["num_experts"], "num_experts_per_tok": moe["top_k"]}
    if model_type in GROUPED_DEFAULTS:
        return {"n_routed_experts": moe["num_experts"], "num_experts_per_tok": moe["top_k"],
                "moe_intermediate_size": moe["expert_size"], "norm_topk_prob": moe["norm_topk"],
                "n_group": moe["groups"], "topk_group": moe["top_groups"],
                "routed_scaling_factor": moe["routed_scale"],
                "n_shared_experts": moe["shared_size"] // moe["expert_size"],
                "first_k_dense_replace": len(moe["dense_layers"])}
    if model_type == "gpt_oss":
        return {"num_local_experts": moe["num_experts"], "num_experts_per_tok": moe["top_k"],
                "swiglu_limit": moe["swiglu_limit"], "swiglu_alpha": moe["swiglu_alpha"]}
    out = {"num_experts": moe["num_experts"], "num_experts_per_tok": moe["top_k"],
           "moe_intermediate_size": moe["expert_size"], "norm_topk_prob": moe["norm_topk"],
           "decoder_sparse_step": 1, "mlp_only_layers": list(moe["dense_layers"])}
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = moe["shared_size"]
    return out


def check_quantization(hf) -> None:
    """Refuses a quantized checkpoint (config.json's quantization_config): its tensors are not
    the float weights specjax reads. gpt-oss's own release is MXFP4 (`*_blocks` / `*_scales`
    expert tensors)."""
    quant = hf.get("quantization_config")
    if not isinstance(quant, dict):
        return
    method = quant.get("quant_method")
    if method == "mxfp4":
        raise UnsupportedConfigError(
            "this checkpoint's experts are quantized to MXFP4 (quantization_config.quant_method 'mxfp4', "
            "tensors *_blocks / *_scales), which specjax does not dequantize: use a bfloat16 checkpoint of "
            "the model, e.g. unsloth/gpt-oss-20b-BF16")
    raise UnsupportedConfigError(f"quantized checkpoints (quantization_config.quant_method {method!r}) are not "
                                 f"supported: use the model's float checkpoint (specjax can quantize to int8 "
                                 f"itself when loading)")


def int_if_whole(x: float):
    """transformers' Gemma configs type query_pre_attn_scalar as int."""
    return int(x) if float(x).is_integer() else x


def optional_float(x):
    return None if x is None else float(x)


def first_id(token_id):
    """The first of a list of token ids (GenerationConfig keeps all the EOS ids: generation
    stops on any of them)."""
    if isinstance(token_id, (list, tuple)):
        return token_id[0] if token_id else None
    return token_id


# The names ModelConfig's checks (config._check_positive) give values -> config.json's
# keys, so that a refusal names the key the file holds.
GPT2_KEYS = {"norm_eps": "layer_norm_epsilon"}
ROTARY_KEYS = {"norm_eps": "rms_norm_eps",
               "local_rope_theta": "rope_local_base_freq (or rope_parameters.sliding_attention.rope_theta)",
               "rope scaling factor": "rope_parameters.factor (or rope_scaling.factor)",
               **{f"rope scaling {k}": f"rope_parameters.{k} (or rope_scaling.{k})"
                  for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
                            "beta_slow", "attention_factor")},
               "attn_softcap": "attn_logit_softcapping", "final_softcap": "final_logit_softcapping",
               "partial_rotary_factor": "partial_rotary_factor (rope_parameters' or top-level)"}


# ---- config.json sanity ----------------------------------------------------------------

# Sizes a config.json may give, under the names its families use; each must be a positive
# int when present (None means "not given" for the optional ones: head_dim, n_inner, ...).
SIZE_KEYS = ("vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer",
             "num_attention_heads", "n_head", "num_key_value_heads", "head_dim",
             "intermediate_size", "n_inner", "max_position_embeddings", "n_positions",
             "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
             "shared_expert_intermediate_size",
             "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "n_routed_experts", "n_group", "topk_group")
# Switches a config.json may give: each must be true or false when present.
BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
             "use_bidirectional_attention", "norm_topk_prob", "qkv_bias", "rope_interleave", "use_qk_norm")
# Sizes that may be null (then derived: kv heads = heads, head_dim = E / H, n_inner = 4 E).
OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim", "n_inner", "q_lora_rank")
# No tokenizer comes near this (the largest real vocabularies are ~256k); a larger value is
# a corrupt or hostile file asking for a giant embedding table.
MAX_VOCAB_SIZE = 2**24


# The types of the other values config.json may give (None: absent), checked before any
# is read, so that a wrong one is named by its key.
NUMBER_KEYS = ("rope_theta", "rms_norm_eps", "layer_norm_epsilon", "query_pre_attn_scalar",
               "attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq",
               "partial_rotary_factor", "routed_scaling_factor", "swiglu_limit", "swiglu_alpha")
COUNT_KEYS = {"sliding_window": 1, "max_window_layers": 0, "sliding_window_pattern": 1,
              "_sliding_window_pattern": 1, "pretraining_tp": 1, "first_k_dense_replace": 0,
              "num_nextn_predict_layers": 0, "n_shared_experts": 0}  # key -> least value
MAPPING_KEYS = ("rope_parameters", "rope_scaling")
TEXT_KEYS = ("model_type", "hidden_act", "hidden_activation", "activation_function")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "partial_rotary_factor")
# Those a yarn rope may give as null (transformers' default, or for its factor: derived).
YARN_NULLABLE = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


def _check_types(hf: dict[str, Any]) -> None:
    def bad(key, what):
        raise InvalidConfigError(f"config.json: {key}={hf[key]!r} must be {what}")

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    for key in NUMBER_KEYS:  # null means "none" only for soft-caps; elsewhere it is no number
        if key in hf and not number(hf[key]) and not (hf[key] is None and key.endswith("softcapping")):
            bad(key, "a number")
    for key, least in COUNT_KEYS.items():
        v = hf.get(key)
        if v is None and key in hf and key != "sliding_window":  # a null window: none
            bad(key, f"an integer in [{least}, 2**31)")
        if key == "sliding_window" and v == 0 and hf.get("use_sliding_window") is False:
            continue  # Qwen2-MoE writes 0 for "no window"
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not least <= v < 2**31):
            bad(key, f"an integer in [{least}, 2**31)")
    for key in MAPPING_KEYS:
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            bad(key, "an object")
    for key in TEXT_KEYS:
        if hf.get(key) is not None and not isinstance(hf[key], str):
            bad(key, "a string")
    for key in MAPPING_KEYS:  # the rope values inside (Gemma 3: one mapping per layer type)
        rope = hf.get(key) or {}
        for entry in [rope] + [v for v in rope.values() if isinstance(v, dict)]:
            yarn = entry.get("rope_type", entry.get("type")) == "yarn"
            for name in ROPE_NUMBERS:
                if name in entry and not number(entry[name]) and not (
                        yarn and entry[name] is None and name in YARN_NULLABLE):
                    raise InvalidConfigError(f"config.json: {key} holds {name}={entry[name]!r}, which must be a number")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = hf.get(key)
        ids = v if isinstance(v, list) else [] if v is None else [v]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            bad(key, "a token id (an integer >= 0), a list of them, or null")
    types = hf.get("layer_types")
    if types is not None and (not isinstance(types, list) or any(t not in LAYER_TYPES for t in types)
                              or len(types) != hf.get("num_hidden_layers", len(types))):
        bad("layer_types", f"a list of {LAYER_TYPES}, one per layer")


def check_hf_config(hf: dict[str, Any]) -> None:
    """Refuses config.json values that make no sense, before anything is allocated:
    sizes that are not positive ints, a vocabulary over MAX_VOCAB_SIZE, kv heads that do
    not divide the heads, and a hidden size the heads do not divide when there is no
    explicit head_dim (with one, as in many Llama-family models, H * head_dim may differ
    from the hidden size: the projections map between the two)."""
    for key in SIZE_KEYS:
        value = hf.get(key)
        if value is None and key in hf and key not in OPTIONAL_SIZE_KEYS:
            raise InvalidConfigError(f"config.json: {key}=null must be a positive integer")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidConfigError(f"config.json: {key}={value!r} must be a positive integer")
    _check_types(hf)
    for key in BOOL_KEYS:
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            raise InvalidConfigError(f"config.json: {key}={hf[key]!r} must be true or false")
    vocab = hf.get("vocab_size")
    if vocab is not None and vocab > MAX_VOCAB_SIZE:
        raise InvalidConfigError(f"config.json: vocab_size={vocab} is absurd (more than "
                                 f"{MAX_VOCAB_SIZE}; real vocabularies are below ~300k)")
    E_key, H_key = ("n_embd", "n_head") if "n_embd" in hf else ("hidden_size", "num_attention_heads")
    E, H = hf.get(E_key), hf.get(H_key)
    G = hf.get("num_key_value_heads")
    if H is not None and G is not None and H % G:
        raise InvalidConfigError(f"config.json: num_key_value_heads={G} does not divide "
                                 f"{H_key}={H} (each kv head serves a whole group of heads)")
    latent = hf.get("model_type") == "deepseek_v3"  # its heads' sizes are its own keys'
    if E is not None and H is not None and hf.get("head_dim") is None and E % H and not latent:
        raise InvalidConfigError(f"config.json: {H_key}={H} does not divide {E_key}={E}, and "
                                 f"there is no head_dim to say the size of a head")


# ---- generation_config.json ------------------------------------------------------------

# transformers' defaults for what a generation_config.json leaves out.
_SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
# Keys specjax does not apply, at values that change nothing (transformers' defaults), and
# bookkeeping keys: neither is reported as ignored.
_NO_EFFECT = {"num_beams": 1, "num_return_sequences": 1,
              "length_penalty": 1.0, "no_repeat_ngram_size": 0, "typical_p": 1.0, "min_length": 0,
              "use_cache": True, "early_stopping": False, "output_scores": False,
              "return_dict_in_generate": False, "output_attentions": False,
              "output_hidden_states": False, "output_logits": False, "transformers_version": None,
              "_from_model_config": None, "max_length": None, "max_new_tokens": None}


def generation_fields(generation: dict[str, Any] | None, config: dict[str, Any],
                      vocab_size: int | None = None) -> dict[str, Any]:
    """GenerationConfig's fields, read from generation_config.json as transformers reads it.

    generation: generation_config.json's dict (None when the folder has none); config:
    config.json's dict, whose token ids stand in when generation lacks them; vocab_size:
    token ids outside [0, vocab_size) are refused."""
    source = "generation_config.json" if generation is not None else "config.json"
    generation = dict(generation or {})
    ids = {}
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = generation.get(key, config.get(key))
        values = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (
                    vocab_size is not None and v >= vocab_size):
                raise InvalidConfigError(f"{source}: {key}={value!r} is not a token id of the "
                                         f"vocabulary [0, {vocab_size})")
        ids[key] = values
    sampling = {k: generation.get(k) for k in _SAMPLING_DEFAULTS}
    sampling = {k: _SAMPLING_DEFAULTS[k] if v is None else v for k, v in sampling.items()}
    if not isinstance(sampling["do_sample"], bool):
        raise InvalidConfigError(f"{source}: do_sample={sampling['do_sample']!r} must be true or false")
    t, k, p = sampling["temperature"], sampling["top_k"], sampling["top_p"]
    if not sampling["do_sample"]:  # greedy: transformers does not use them either
        t, k, p = (_SAMPLING_DEFAULTS[key] for key in ("temperature", "top_k", "top_p"))
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
        raise InvalidConfigError(f"{source}: temperature={t!r} must be a finite number > 0")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < 2**31:
        raise InvalidConfigError(f"{source}: top_k={k!r} must be an integer in [0, 2**31)")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise InvalidConfigError(f"{source}: top_p={p!r} must lie in (0, 1]")
    repetition = generation.get("repetition_penalty")
    repetition = 1.0 if repetition is None else repetition
    if isinstance(repetition, bool) or not isinstance(repetition, (int, float)) or not 0 < repetition < math.inf:
        raise InvalidConfigError(f"{source}: repetition_penalty={repetition!r} must be a finite number > 0")
    min_p = generation.get("min_p") if sampling["do_sample"] else None  # greedy: unused, as transformers
    min_p = 0.0 if min_p is None else min_p
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p <= 1:
        raise InvalidConfigError(f"{source}: min_p={min_p!r} must lie in [0, 1]")
    known = set(_SAMPLING_DEFAULTS) | {"eos_token_id", "bos_token_id", "pad_token_id", "repetition_penalty", "min_p"}
    ignored = tuple(sorted(key for key, v in generation.items() if key not in known
                           and v is not None and not (key in _NO_EFFECT and v == _NO_EFFECT[key])
                           and not (key in _NO_EFFECT and _NO_EFFECT[key] is None)))
    return {"eos_token_id": tuple(ids["eos_token_id"]), "bos_token_id": (ids["bos_token_id"] or [None])[0],
            "pad_token_id": (ids["pad_token_id"] or [None])[0], "do_sample": sampling["do_sample"],
            "temperature": float(t), "top_k": k, "top_p": float(p), "min_p": float(min_p),
            "repetition_penalty": float(repetition), "ignored": ignored}
