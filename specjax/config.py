"""ModelConfig: everything the forward pass needs, and nothing else.

It turns Hugging Face `config.json` dictionaries into one frozen, hashable description of
a decoder, and back; GenerationConfig does the same for generation_config.json. What the
files' keys mean, the defaults transformers gives what they leave out, and the checks of
their values are hf_config.py's; this module assembles the fields it reads. It does not
know about weights, files, dtypes or devices. Anything a config asks for that the decoder
cannot compute exactly raises `UnsupportedConfigError`, at load time, never a wrong answer
later.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from specjax import hf_config
from specjax.hf_config import ROPE_TYPES, InvalidConfigError, UnsupportedConfigError
from specjax.rope import rope_cos_sin_factor, rope_inv_freq, yarn_mscale  # noqa: F401 (the first two re-exported)

Family = Literal["gpt2", "llama", "gemma"]

# model_type -> family. Within the Llama family models differ only in flags this config
# carries (biases, q/k norms, windows, experts: `Moe`); Phi-3 differs only in how its
# checkpoint fuses weights (hf.py). Gemma differs by more than a flag: see `Gemma` below.
SUPPORTED_MODEL_TYPES: dict[str, Family] = {
    "gpt2": "gpt2",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "phi3": "llama",
    "qwen2_moe": "llama",
    "qwen3_moe": "llama",
    "mixtral": "llama",
    "gpt_oss": "llama",
    "gemma2": "gemma",
    "gemma3_text": "gemma",
    "deepseek_v3": "llama",  # RMSNorm and SwiGLU; its attention is latent (see `Mla`)
    "glm4_moe": "llama",  # DeepSeek-V3's experts under GQA attention with partial rotary
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling (`rope_parameters` minus `rope_theta`)."""

    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear, llama3 and yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3 and yarn
    beta_fast: float = 32.0  # yarn: the ramp's bounds, in rotations over the original length
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn: with mscale_all_dim, the attention factor's numerator ...
    mscale_all_dim: float | None = None  # ... and denominator (DeepSeek-V3; see `attention_scale`)
    attention_factor: float | None = None  # yarn: cos and sin scaled by this (None: from factor, mscales)
    truncate: bool = True  # yarn: the ramp's bounds rounded outwards to whole dimensions

    def cos_sin_factor(self) -> float:
        """What the rotary tables' cos and sin are multiplied by (transformers'
        attention_scaling): 1 but for yarn, whose attention_factor it is, or where a config
        gives none, 0.1 log(factor) + 1 (with mscale and mscale_all_dim: the ratio of
        that formula at each)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def attention_scale(self) -> float:
        """What multiplies a DeepSeek-style (MLA) attention's score scale besides head_dim ** -0.5:
        yarn_mscale(factor, mscale_all_dim) squared where mscale_all_dim is given and nonzero
        (transformers' `yarn_apply_mscale`, which DeepSeek-V3 applies for every rope type
        but default), else 1. The decoders of this module's other families do not apply it."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


@dataclasses.dataclass(frozen=True)
class Gemma:
    """What the Gemma family (Gemma 2, Gemma 3 text) computes beyond a Llama decoder.

    Present exactly when the family is "gemma". Its presence also means what has no number
    to carry: the embedding is scaled by sqrt(E); every RMSNorm scales by (1 + w) in
    float32; the MLP is GeGLU (tanh gelu); and the outputs of attention and of the MLP
    are normed again before they join the residual stream (pre- and post-norms)."""

    query_pre_attn_scalar: float  # attention scores are scaled by this ** -0.5, not D ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap), before the mask
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)


ROUTERS = ("softmax", "topk_softmax", "sigmoid_grouped")  # how a token's experts and their weights are chosen (see `Moe.router`)


@dataclasses.dataclass(frozen=True)
class Moe:
    """A mixture of experts in place of the dense MLP (SwiGLU) on every layer but `dense_layers`.

    Each token's router logits (x . router, [X]) choose its top_k experts and their weights;
    the layer's output is the weighted sum of those experts' SwiGLU MLPs (each I wide), plus
    a shared expert's where `shared_size` is set. No token is ever dropped: every expert a
    token chose computes it (models/moe.py)."""

    num_experts: int  # X
    top_k: int  # k experts per token
    expert_size: int  # I, each expert's MLP width
    # "softmax": softmax over all X logits in float32, the top k kept (Qwen2/3-MoE, Mixtral);
    # "topk_softmax": the k largest logits, then a softmax over those k (gpt-oss);
    # "sigmoid_grouped" (DeepSeek-V3, GLM-4.5): sigmoid scores in float32; the experts chosen by the
    # scores plus a per-expert bias (`router_bias`), among the top_groups of `groups` groups
    # (a group ranked by its two best), weighted by their unbiased scores (renormalised where
    # norm_topk) times routed_scale
    router: str = "softmax"
    norm_topk: bool = False  # the k weights renormalised to sum to 1 (Mixtral always; Qwen's norm_topk_prob)
    shared_size: int = 0  # a shared expert's MLP width, which every token runs (0: none)
    shared_gate: bool = False  # the shared expert's output scaled by sigmoid(x . w) (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (intermediate_size wide) instead
    groups: int = 1  # sigmoid_grouped: the experts' groups (n_group)
    top_groups: int = 1  # sigmoid_grouped: the groups a token's experts may come from (topk_group)
    routed_scale: float = 1.0  # sigmoid_grouped: the routed experts' weights' factor (routed_scaling_factor)
    router_bias: bool = False  # a bias [X] added to the router's logits (gpt-oss; sigmoid_grouped has its own, which only chooses)
    expert_bias: bool = False  # biases on each expert's gate, up and down projections (gpt-oss)
    # gpt-oss's clamped activation (models/moe.py `clamped_swiglu`): gate <= limit, up in
    # [-limit, limit], (up + 1) * gate * sigmoid(alpha gate). None: SwiGLU.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        for name in ("num_experts", "top_k", "expert_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidConfigError(f"{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise InvalidConfigError(f"num_experts_per_tok={self.top_k} exceeds the {self.num_experts} experts")
        if self.router not in ROUTERS:
            raise UnsupportedConfigError(f"unsupported router {self.router!r}; specjax supports {ROUTERS}")
        if not isinstance(self.shared_size, int) or self.shared_size < 0:
            raise InvalidConfigError(f"shared expert width must be an int >= 0, got {self.shared_size!r}")
        if self.swiglu_limit is not None:
            _check_positive("swiglu_limit", self.swiglu_limit)
            if isinstance(self.swiglu_alpha, bool) or not isinstance(self.swiglu_alpha, (int, float)) or not (
                    abs(self.swiglu_alpha) <= FLOAT32_MAX):
                raise InvalidConfigError(f"swiglu_alpha must be a finite number, got {self.swiglu_alpha!r}")
        if self.router == "sigmoid_grouped":
            if not (isinstance(self.groups, int) and isinstance(self.top_groups, int)
                    and 1 <= self.top_groups <= self.groups and self.num_experts % self.groups == 0
                    and self.num_experts // self.groups >= 2):
                raise InvalidConfigError(
                    f"n_group={self.groups!r} must divide the {self.num_experts} experts into groups of at least 2 "
                    f"(a group is ranked by its two best), and topk_group={self.top_groups!r} lie in [1, n_group]")
            if self.top_k > self.top_groups * (self.num_experts // self.groups):
                raise InvalidConfigError(f"num_experts_per_tok={self.top_k} exceeds the experts of topk_group="
                                         f"{self.top_groups} groups")
            _check_positive("routed_scaling_factor", self.routed_scale)


@dataclasses.dataclass(frozen=True)
class Mla:
    """Multi-head latent attention (DeepSeek-V2/V3): present exactly when model_type is
    deepseek_v3. Each token's keys and values are one shared latent of `kv_lora_rank`
    numbers (normed) and one shared rotary key of `qk_rope_head_dim`, from which every head's
    key and value are projected (kv_b_proj). A cache holds only those (models/mla.py says
    how the heads attend to them without expanding them). ModelConfig's head_dim is the
    rotary part's (`qk_rope_head_dim`), num_kv_heads 1."""

    q_lora_rank: int | None  # None: one q_proj [E -> H (nope + rope)]; else q_a_proj, its norm, q_b_proj
    kv_lora_rank: int  # r: the latent's width
    qk_nope_head_dim: int  # the part of a head's query and key without rotary
    qk_rope_head_dim: int  # the rotary part (one rotary key shared by every head)
    v_head_dim: int  # a head's value
    rope_interleave: bool = True  # the rotary lanes come in pairs (x0, x1), (x2, x3), ... (transformers')

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What a cache holds a token a layer: the latent and the rotary key, r + rope."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer of the GPT-2, Llama or Gemma family. Frozen and hashable:
    it is the static half of `specjax.Model` and a jit cache key."""

    model_type: str  # the HF model_type it came from (a key of SUPPORTED_MODEL_TYPES)
    vocab_size: int  # V
    hidden_size: int  # E, the residual width
    num_layers: int  # L
    num_heads: int  # H, query heads
    num_kv_heads: int  # G, key/value heads (GQA when G < H)
    head_dim: int  # D
    intermediate_size: int  # F, MLP width
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    rope_theta: float = 10000.0  # rotary base (not GPT-2); of the full-attention layers
    rope_scaling: RopeScaling = RopeScaling()  # of the full-attention layers
    # the share of each head's D lanes rotary rotates: the first `rotary_dim` = int(D * this),
    # halves rotated within them (GLM-4.5's 0.5); the rest pass through (1.0: all of them)
    partial_rotary_factor: float = 1.0
    local_rope_theta: float | None = None  # rotary base of sliding-window layers, unscaled (Gemma 3)
    qkv_bias: bool = False  # biases on q, k, v (GPT-2, Qwen2, attention_bias)
    out_bias: bool = False  # bias on the attention output projection (GPT-2, attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over D of each query and key head, before rotary (Qwen3, Gemma 3)
    sliding_window: int | None = None  # keys further back than this are not attended
    layer_types: tuple[str, ...] | None = None  # per layer: full_attention | sliding_attention
    attn_sinks: bool = False  # a learned logit per query head joins its softmax (gpt-oss: `sinks` [H])
    gemma: Gemma | None = None  # the Gemma family's own computation (see `Gemma`)
    moe: Moe | None = None  # experts in place of the MLP (see `Moe`); None: dense
    mla: Mla | None = None  # latent attention (DeepSeek-V3), in place of q/k/v heads (see `Mla`)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"unsupported model_type {self.model_type!r}; specjax supports "
                f"{sorted(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.family != "gpt2" and self.head_dim % 2:
            raise InvalidConfigError(f"head_dim={self.head_dim} must be even: rotary embedding rotates halves")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        _check_positive("norm_eps", self.norm_eps)
        if self.family != "gpt2":
            _check_positive("rope_theta", self.rope_theta)
            if self.rope_theta <= 1:  # frequencies past 1 overflow float32 for small bases
                raise InvalidConfigError(f"rope_theta must be > 1, got {self.rope_theta!r}")
            if self.local_rope_theta is not None:
                _check_positive("local_rope_theta", self.local_rope_theta)
            p = self.partial_rotary_factor
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
                raise InvalidConfigError(f"partial_rotary_factor must be a number in (0, 1], got {p!r}")
            if self.rotary_dim < 2 or self.rotary_dim % 2:
                raise InvalidConfigError(
                    f"partial_rotary_factor={p!r} of head_dim={self.head_dim} rotates int({self.head_dim} * {p!r}) = "
                    f"{self.rotary_dim} lanes, which must be even and at least 2: rotary embedding rotates halves")
            r = self.rope_scaling
            if r.rope_type != "default":
                _check_positive("rope scaling factor", r.factor)
            if r.rope_type == "yarn":
                for name in ("original_max_position_embeddings", "beta_fast", "beta_slow"):
                    _check_positive(f"rope scaling {name}", getattr(r, name))
                if r.attention_factor is not None:
                    _check_positive("rope scaling attention_factor", r.attention_factor)
                elif not 0 < r.cos_sin_factor() <= FLOAT32_MAX:  # mscale and mscale_all_dim's ratio
                    raise InvalidConfigError(
                        f"rope_parameters' mscale={r.mscale!r} and mscale_all_dim={r.mscale_all_dim!r} give the "
                        f"attention factor {r.cos_sin_factor()!r}, which must be a finite number > 0")
            if r.rope_type == "llama3":
                for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                    _check_positive(f"rope scaling {name}", getattr(r, name))
                if not r.high_freq_factor > r.low_freq_factor:
                    raise InvalidConfigError(f"rope scaling high_freq_factor ({r.high_freq_factor}) must exceed "
                                             f"low_freq_factor ({r.low_freq_factor})")
        if self.gemma is not None:
            _check_positive("query_pre_attn_scalar", self.gemma.query_pre_attn_scalar)
            for name in ("attn_softcap", "final_softcap"):
                if getattr(self.gemma, name) is not None:
                    _check_positive(name, getattr(self.gemma, name))
        if self.rope_scaling.rope_type not in ROPE_TYPES:
            raise UnsupportedConfigError(
                f"unsupported rope_type {self.rope_scaling.rope_type!r}; specjax supports {ROPE_TYPES}")
        if self.family == "gpt2" and self.num_kv_heads != self.num_heads:
            raise ValueError("GPT-2 has no grouped-query attention: num_kv_heads must equal num_heads")
        if (self.family == "gemma") != (self.gemma is not None):
            raise ValueError(f"model_type {self.model_type!r} needs gemma=Gemma(...) exactly when "
                             f"its family is gemma")
        if (self.model_type == "deepseek_v3") != (self.mla is not None):
            raise ValueError(f"model_type {self.model_type!r} needs mla=Mla(...) exactly when it is deepseek_v3")
        if self.mla is not None:
            m = self.mla
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                value = getattr(m, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise InvalidConfigError(f"{name} must be a positive int, got {value!r}")
            if m.q_lora_rank is not None and (isinstance(m.q_lora_rank, bool) or not isinstance(m.q_lora_rank, int)
                                              or m.q_lora_rank < 1):
                raise InvalidConfigError(f"q_lora_rank must be a positive int or null, got {m.q_lora_rank!r}")
            if self.num_kv_heads != 1 or self.head_dim != m.qk_rope_head_dim:
                raise ValueError("latent attention has one shared key head (num_kv_heads=1) whose rotary part is "
                                 "head_dim (= qk_rope_head_dim)")
            if self.qkv_bias or self.out_bias or self.qk_norm or self.sliding_window is not None:
                raise UnsupportedConfigError("latent attention with biases, q/k norms or sliding windows is not "
                                             "supported")
            if self.partial_rotary_factor != 1:
                raise UnsupportedConfigError("latent attention with partial_rotary_factor != 1 is not supported "
                                             "(its rotary part is qk_rope_head_dim)")
        if self.family == "gpt2" and (self.qk_norm or self.local_rope_theta is not None):
            raise ValueError("GPT-2 has no rotary embedding and no q/k norms")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_layers} layers")
            unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise UnsupportedConfigError(f"unsupported layer types {sorted(unknown)}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types names sliding_attention but sliding_window is None")
        if self.moe is not None:
            if self.family != "llama":
                raise ValueError(f"experts (moe) are supported in the Llama family, not {self.family}")
            outside = [i for i in self.moe.dense_layers if not 0 <= i < self.num_layers]
            if outside:
                raise InvalidConfigError(f"dense (mlp_only) layers {outside} lie outside the {self.num_layers} layers")

    @property
    def family(self) -> Family:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    def layer_windows(self) -> tuple[int | None, ...]:
        """The attention window of each layer (None: full causal attention)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None
                     for t in self.layer_types)

    @property
    def rotary_dim(self) -> int:
        """The lanes of each query and key head rotary rotates, the first int(D * partial_rotary_factor)
        (transformers' `dim`: its frequencies are those of a head this wide)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def sparse(self, layer: int) -> bool:
        """Whether the layer's MLP is a mixture of experts (`Moe`) rather than dense."""
        return self.moe is not None and layer not in self.moe.dense_layers

    def cache_dims(self) -> tuple[int, int, int]:
        """(G, D_k, D_v): a layer's cache buffers' heads and widths, keys [B, G, S, D_k] and
        values [B, G, S, D_v]. Latent attention's: (1, r + rope, 0), its keys the latent and
        the rotary key, and no value buffer (its values are its keys: cache.py)."""
        if self.mla is not None:
            return 1, self.mla.latent_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    def num_params(self) -> int:
        """Parameter count (a tied head counted once)."""
        E, F, D = self.hidden_size, self.intermediate_size, self.head_dim
        qkv = E * D * (self.num_heads + 2 * self.num_kv_heads)
        out = self.num_heads * D * E
        if self.mla is not None:
            m, H = self.mla, self.num_heads
            q = (E * H * m.qk_head_dim if m.q_lora_rank is None
                 else E * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * m.qk_head_dim)
            kv = E * m.latent_dim + m.kv_lora_rank + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
            qkv, out = q + kv, H * m.v_head_dim * E
        if self.family == "gpt2":
            attn = qkv + out + D * (self.num_heads + 2 * self.num_kv_heads) + E
            layer = attn + 2 * E * F + F + E + 4 * E
            extra = self.max_position_embeddings * E + 2 * E
        else:
            attn = (qkv + out + (D * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0)
                    + (E if self.out_bias else 0) + (2 * D if self.qk_norm else 0)
                    + (self.num_heads if self.attn_sinks else 0))
            norms = (4 if self.family == "gemma" else 2) * E
            layer = attn + norms
            extra = E + sum(self.mlp_params(i) for i in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else E * self.vocab_size
        return self.vocab_size * E + self.num_layers * layer + extra + head

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """The parameters of a rotary-family layer's MLP (dense, or router, experts and shared
        expert); active: only those one token reads (its top_k experts, not all X)."""
        E, F = self.hidden_size, self.intermediate_size
        if not self.sparse(layer):
            return 3 * E * F + (2 * F + E if self.mlp_bias else 0)
        m = self.moe
        n = m.top_k if active else m.num_experts
        experts = n * 3 * E * m.expert_size + (n * (2 * m.expert_size + E) if m.expert_bias else 0)
        return ((E + m.router_bias) * m.num_experts + experts + 3 * E * m.shared_size
                + (E if m.shared_gate else 0))

    def num_active_params(self) -> int:
        """Parameters one token's pass reads (a dense model's: all; a MoE's: its top_k experts
        of each sparse layer, the embedding as a head only when tied)."""
        inactive = sum(self.mlp_params(i) - self.mlp_params(i, active=True) for i in range(self.num_layers))
        return self.num_params() - inactive

    # ---- Hugging Face config.json -------------------------------------------------------

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Reads a config.json dict of a supported model_type."""
        model_type = hf.get("model_type")
        if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
            archs = hf.get("architectures")
            hint = (" (for Gemma 3, specjax reads the text-only gemma3_text / Gemma3ForCausalLM "
                    "checkpoints)" if model_type == "gemma3" else "")
            raise UnsupportedConfigError(
                f"unsupported model_type {model_type!r} (architectures {archs}); specjax "
                f"supports {sorted(SUPPORTED_MODEL_TYPES)}{hint}")
        hf_config.check_hf_config(hf)
        hf_config.check_quantization(hf)
        gpt2 = SUPPORTED_MODEL_TYPES[model_type] == "gpt2"
        try:
            return cls._from_gpt2(hf) if gpt2 else cls._from_rotary(hf)
        except KeyError as e:
            raise InvalidConfigError(f"config.json ({model_type}) lacks the required key {e}") from None
        except UnsupportedConfigError:
            raise
        except InvalidConfigError as e:  # a value __post_init__ refused: named as config.json names it
            message = str(e)
            for name, key in (hf_config.GPT2_KEYS if gpt2 else hf_config.ROTARY_KEYS).items():
                if message.startswith(name + " "):
                    message = key + message[len(name):]
            raise InvalidConfigError(f"config.json: {message}") from None
        except (TypeError, AttributeError, OverflowError) as e:  # a list where a number is due, ...
            raise InvalidConfigError(f"config.json ({model_type}) holds a value of the wrong type: {e}") from None
        except ValueError as e:  # text where a number is due, a window of -5, ...
            raise InvalidConfigError(f"config.json ({model_type}): {e}") from None

    @classmethod
    def _from_gpt2(cls, hf):
        if hf.get("scale_attn_by_inverse_layer_idx"):
            raise UnsupportedConfigError("GPT-2 scale_attn_by_inverse_layer_idx=True is not supported")
        if not hf.get("scale_attn_weights", True):
            raise UnsupportedConfigError("GPT-2 scale_attn_weights=False is not supported")
        if hf.get("activation_function", "gelu_new") != "gelu_new":
            raise UnsupportedConfigError(
                f"GPT-2 activation_function {hf['activation_function']!r} is not supported (gelu_new is)")
        E, H = hf["n_embd"], hf["n_head"]
        if E % H:
            raise ValueError(f"n_embd={E} is not a multiple of n_head={H}")
        return cls(
            model_type="gpt2", vocab_size=hf["vocab_size"], hidden_size=E,
            num_layers=hf["n_layer"], num_heads=H, num_kv_heads=H, head_dim=E // H,
            intermediate_size=hf.get("n_inner") or 4 * E,
            max_position_embeddings=hf["n_positions"],
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=hf.get("tie_word_embeddings", True),
            qkv_bias=True, out_bias=True, mlp_bias=True,
            **{k: hf_config.first_id(hf.get(k)) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        )

    @classmethod
    def _from_rotary(cls, hf):
        """The Llama and Gemma families. Where config.json omits a field, the default is the
        one transformers' config class gives it (they differ by model_type)."""
        model_type = hf["model_type"]
        gemma = SUPPORTED_MODEL_TYPES[model_type] == "gemma"
        if gemma:
            act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
            if act not in hf_config.GELU_TANH:
                raise UnsupportedConfigError(
                    f"hidden_activation {act!r} is not supported (the tanh gelu {hf_config.GELU_TANH} is)")
            if hf.get("use_bidirectional_attention"):
                raise UnsupportedConfigError("use_bidirectional_attention=True is not supported: "
                                             "specjax decodes causally")
        else:
            act = hf.get("hidden_act", "silu")
            if act != "silu":
                raise UnsupportedConfigError(f"hidden_act {act!r} is not supported (silu is)")
        if hf.get("pretraining_tp", 1) != 1:
            raise UnsupportedConfigError("pretraining_tp != 1 is not supported")
        theta, scaling, local_theta = hf_config.read_rope(hf)
        E, H = hf["hidden_size"], hf["num_attention_heads"]
        G = hf.get("num_key_value_heads") or H
        head_dim = hf.get("head_dim") or hf_config.DEFAULT_HEAD_DIM.get(model_type) or E // H
        mla = None
        if model_type == "deepseek_v3":
            mla = Mla(**hf_config.read_mla(hf))
            G, head_dim = 1, mla.qk_rope_head_dim  # one shared key head; rotary over its rope part
        sliding_window, layer_types = hf_config.read_windows(hf)
        attention_bias = bool(hf.get("attention_bias", model_type == "gpt_oss"))
        moe = hf_config.read_moe(hf)
        return cls(
            model_type=model_type, vocab_size=hf["vocab_size"], hidden_size=E,
            num_layers=hf["num_hidden_layers"], num_heads=H, num_kv_heads=G, head_dim=head_dim,
            intermediate_size=(hf["intermediate_size"] if moe is None else hf.get("intermediate_size")
                               or hf_config.DEFAULT_INTERMEDIATE.get(model_type) or hf["moe_intermediate_size"]),
            max_position_embeddings=hf.get("max_position_embeddings",
                                           hf_config.DEFAULT_POSITIONS.get(model_type, 2048)),
            norm_eps=float(hf.get("rms_norm_eps", hf_config.DEFAULT_NORM_EPS.get(model_type, 1e-6))),
            tie_word_embeddings=hf.get("tie_word_embeddings", gemma),
            rope_theta=theta, rope_scaling=RopeScaling(**scaling), local_rope_theta=local_theta,
            partial_rotary_factor=hf_config.read_partial_rotary(hf),
            # Qwen2 always has q/k/v biases (Qwen2-MoE: qkv_bias); GLM-4.5's attention_bias covers q, k and v;
            # elsewhere attention_bias covers q, k, v and o.
            qkv_bias=(model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
                      or (model_type in hf_config.ATTENTION_BIAS + ("glm4_moe",) and attention_bias)),
            out_bias=model_type in hf_config.ATTENTION_BIAS and attention_bias,
            mlp_bias=model_type == "llama" and bool(hf.get("mlp_bias", False)),
            qk_norm=(model_type in ("qwen3", "qwen3_moe", "gemma3_text")
                     or (model_type == "glm4_moe" and bool(hf.get("use_qk_norm", False)))),
            attn_sinks=model_type == "gpt_oss",
            moe=None if moe is None else Moe(**moe),
            sliding_window=sliding_window, layer_types=layer_types, mla=mla,
            gemma=Gemma(
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                # transformers' Gemma 3 reads attn_logit_softcapping but never applies it.
                attn_softcap=hf_config.optional_float(hf.get("attn_logit_softcapping", 50.0))
                if model_type == "gemma2" else None,
                final_softcap=hf_config.optional_float(hf.get(
                    "final_logit_softcapping", 30.0 if model_type == "gemma2" else None)),
            ) if gemma else None,
            **{k: hf_config.first_id(hf.get(k)) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that transformers loads back into the same architecture."""
        # None written out: some classes default to ids outside a small vocabulary (Phi-3's 32000)
        tokens = {k: getattr(self, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        if self.family == "gpt2":
            return {
                "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "vocab_size": self.vocab_size, "n_embd": self.hidden_size,
                "n_layer": self.num_layers, "n_head": self.num_heads,
                "n_inner": self.intermediate_size, "n_positions": self.max_position_embeddings,
                "layer_norm_epsilon": self.norm_eps, "activation_function": "gelu_new",
                "tie_word_embeddings": self.tie_word_embeddings, **tokens,
            }
        rope = {"rope_type": self.rope_scaling.rope_type, "rope_theta": self.rope_theta}
        if self.model_type in hf_config.PARTIAL_ROTARY:  # (absent, its class's default)
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        if self.rope_scaling.rope_type == "linear":
            rope["factor"] = self.rope_scaling.factor
        elif self.rope_scaling.rope_type in ("llama3", "yarn"):
            rope.update({k: getattr(self.rope_scaling, k) for k in hf_config.ROPE_KEYS[self.rope_scaling.rope_type]
                         if getattr(self.rope_scaling, k) is not None})
        out = {
            "model_type": self.model_type, "architectures": [hf_config.ARCHITECTURES[self.model_type]],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            **tokens,
        }
        if self.model_type == "gemma3_text":  # rope per layer type; no legacy keys
            out["rope_parameters"] = {
                "full_attention": rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": self.local_theta}}
        else:
            out.update(rope_parameters=rope, rope_theta=self.rope_theta,
                       rope_scaling=None if self.rope_scaling.rope_type == "default" else rope)
        if self.family == "gemma":
            g = self.gemma
            out.update(hidden_activation="gelu_pytorch_tanh",
                       query_pre_attn_scalar=hf_config.int_if_whole(g.query_pre_attn_scalar),
                       final_logit_softcapping=g.final_softcap,
                       attn_logit_softcapping=g.attn_softcap,
                       # transformers builds a sliding mask even with no sliding layer
                       attention_bias=self.qkv_bias, sliding_window=self.sliding_window or 4096,
                       layer_types=list(self.layer_types or ["full_attention"] * self.num_layers),
                       use_bidirectional_attention=False)
            return out
        out["hidden_act"] = "silu"
        if self.mla is not None:
            m = self.mla
            out.update(
                # transformers' latent attention expands every head's key itself: its kv heads
                # must be the query heads (it would repeat fewer)
                num_key_value_heads=self.num_heads, head_dim=m.qk_rope_head_dim,
                q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=m.rope_interleave,
                attention_bias=False, first_k_dense_replace=self.num_layers, num_nextn_predict_layers=0)
        if self.model_type in ("llama", "qwen3", "qwen3_moe", "gpt_oss", "glm4_moe"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "glm4_moe":  # (its checkpoints' MTP layers are not loaded: none written)
            out.update(use_qk_norm=self.qk_norm, first_k_dense_replace=self.num_layers, num_nextn_predict_layers=0)
        if self.model_type == "qwen2_moe":
            out["qkv_bias"] = self.qkv_bias
        if self.moe is not None:
            out.update(hf_config.write_moe(self.model_type, dataclasses.asdict(self.moe), self.num_layers))
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.model_type in ("mistral", "phi3", "mixtral"):
            out["sliding_window"] = self.sliding_window
        if self.model_type == "gpt_oss":  # (its class alternates windows where layer_types is absent)
            out["sliding_window"] = self.sliding_window
            out["layer_types"] = list(self.layer_types or ["full_attention"] * self.num_layers)
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = self.sliding_window is not None
            out["sliding_window"] = self.sliding_window
            if self.layer_types is not None:
                out["layer_types"] = list(self.layer_types)
                out["max_window_layers"] = self.layer_types.index("sliding_attention")
        return out

    @property
    def local_theta(self) -> float:
        """The rotary base of sliding-window layers."""
        return self.rope_theta if self.local_rope_theta is None else self.local_rope_theta


FLOAT32_MAX = 3.4028234663852886e38


def _check_positive(name: str, value) -> None:
    """Raises InvalidConfigError unless value is a number in (0, float32's largest] (zero,
    negative, infinite, NaN or float32-overflowing values load but compute NaN or silently
    wrong logits)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= FLOAT32_MAX:
        raise InvalidConfigError(f"{name} must be a finite number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How a model asks to be decoded: generation_config.json (or, without one, the token
    ids of config.json), read as transformers reads it. Frozen and hashable.

    Only what specjax can honour is kept: stop ids and the sampling parameters (the
    repetition penalty too, which transformers applies greedy or not). Others (beams,
    n-gram bans, ...) are not applied; `ignored` names them."""

    eos_token_id: tuple[int, ...] = ()  # stop ids: a row stops after the first of any
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    do_sample: bool = False  # False: greedy, whatever temperature says
    temperature: float = 1.0
    top_k: int = 50  # transformers' default when sampling; 0 is off
    top_p: float = 1.0
    min_p: float = 0.0  # 0 is off
    repetition_penalty: float = 1.0  # 1 is off
    ignored: tuple[str, ...] = ()  # keys present that specjax does not apply

    def sampling(self) -> dict[str, float]:
        """temperature, top_k, top_p, min_p and repetition_penalty as `specjax.generate` takes
        them (temperature 0: greedy)."""
        if not self.do_sample:
            return {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                    "repetition_penalty": self.repetition_penalty}
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty}

    @classmethod
    def from_hf(cls, generation: dict[str, Any] | None, config: dict[str, Any],
                vocab_size: int | None = None) -> "GenerationConfig":
        """generation: generation_config.json's dict (None when the folder has none);
        config: config.json's dict, whose token ids stand in when generation lacks them.
        Values that make no sense raise InvalidConfigError (see `hf_config.generation_fields`)."""
        return cls(**hf_config.generation_fields(generation, config, vocab_size))

    def to_hf(self) -> dict[str, Any]:
        """A generation_config.json dict that transformers reads back the same."""
        out: dict[str, Any] = {}
        if self.eos_token_id:
            out["eos_token_id"] = (self.eos_token_id[0] if len(self.eos_token_id) == 1
                                   else list(self.eos_token_id))
        for key in ("bos_token_id", "pad_token_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.do_sample:
            out.update(do_sample=True, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
            if self.min_p:
                out["min_p"] = self.min_p
        if self.repetition_penalty != 1.0:
            out["repetition_penalty"] = self.repetition_penalty
        return out
