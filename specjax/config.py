"""ModelConfig: everything the forward pass needs, and nothing else.

It knows Hugging Face `config.json` dictionaries (both the transformers 4.x layout with a
top-level `rope_theta`/`rope_scaling` and the 5.x layout with `rope_parameters`, per layer
type for Gemma 3) and turns them into one frozen, hashable description of a decoder. It
does not know about weights, files, dtypes or devices. Anything a config asks for that the
decoder cannot compute exactly raises `UnsupportedConfigError` here, at load time, never a
wrong answer later.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

Family = Literal["gpt2", "llama", "gemma"]

# model_type -> family. Within the Llama family models differ only in flags this config
# carries (biases, q/k norms, windows); Phi-3 differs only in how its checkpoint fuses
# weights (hf.py). Gemma differs by more than a flag: see `Gemma` below.
SUPPORTED_MODEL_TYPES: dict[str, Family] = {
    "gpt2": "gpt2",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "phi3": "llama",
    "gemma2": "gemma",
    "gemma3_text": "gemma",
}
ROPE_TYPES = ("default", "linear", "llama3")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")  # names transformers gives the tanh-approximated gelu


class UnsupportedConfigError(ValueError):
    """The checkpoint asks for an architecture or feature specjax does not implement."""


class InvalidConfigError(ValueError):
    """A config.json (or generation_config.json) value that makes no sense: a size that is
    not a positive integer, heads that do not divide, an absurd vocabulary."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling (`rope_parameters` minus `rope_theta`)."""

    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


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
    local_rope_theta: float | None = None  # rotary base of sliding-window layers, unscaled (Gemma 3)
    qkv_bias: bool = False  # biases on q, k, v (GPT-2, Qwen2, attention_bias)
    out_bias: bool = False  # bias on the attention output projection (GPT-2, attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over D of each query and key head, before rotary (Qwen3, Gemma 3)
    sliding_window: int | None = None  # keys further back than this are not attended
    layer_types: tuple[str, ...] | None = None  # per layer: full_attention | sliding_attention
    gemma: Gemma | None = None  # the Gemma family's own computation (see `Gemma`)
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
            r = self.rope_scaling
            if r.rope_type != "default":
                _check_positive("rope scaling factor", r.factor)
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

    @property
    def family(self) -> Family:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    def layer_windows(self) -> tuple[int | None, ...]:
        """The attention window of each layer (None: full causal attention)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None
                     for t in self.layer_types)

    def num_params(self) -> int:
        """Parameter count (a tied head counted once)."""
        E, F, D = self.hidden_size, self.intermediate_size, self.head_dim
        qkv = E * D * (self.num_heads + 2 * self.num_kv_heads)
        out = self.num_heads * D * E
        if self.family == "gpt2":
            attn = qkv + out + D * (self.num_heads + 2 * self.num_kv_heads) + E
            layer = attn + 2 * E * F + F + E + 4 * E
            extra = self.max_position_embeddings * E + 2 * E
        else:
            attn = (qkv + out + (D * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0)
                    + (E if self.out_bias else 0) + (2 * D if self.qk_norm else 0))
            norms = (4 if self.family == "gemma" else 2) * E
            layer = attn + 3 * E * F + (2 * F + E if self.mlp_bias else 0) + norms
            extra = E
        head = 0 if self.tie_word_embeddings else E * self.vocab_size
        return self.vocab_size * E + self.num_layers * layer + extra + head

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
        check_hf_config(hf)
        gpt2 = SUPPORTED_MODEL_TYPES[model_type] == "gpt2"
        try:
            return cls._from_gpt2(hf) if gpt2 else cls._from_rotary(hf)
        except KeyError as e:
            raise InvalidConfigError(f"config.json ({model_type}) lacks the required key {e}") from None
        except UnsupportedConfigError:
            raise
        except InvalidConfigError as e:  # a value __post_init__ refused: named as config.json names it
            message = str(e)
            for name, key in (_GPT2_KEYS if gpt2 else _ROTARY_KEYS).items():
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
            bos_token_id=_first(hf.get("bos_token_id")), eos_token_id=_first(hf.get("eos_token_id")),
            pad_token_id=_first(hf.get("pad_token_id")),
        )

    @classmethod
    def _from_rotary(cls, hf):
        """The Llama and Gemma families. Where config.json omits a field, the default is the
        one transformers' config class gives it (they differ by model_type)."""
        model_type = hf["model_type"]
        gemma = SUPPORTED_MODEL_TYPES[model_type] == "gemma"
        if gemma:
            act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
            if act not in GELU_TANH:
                raise UnsupportedConfigError(
                    f"hidden_activation {act!r} is not supported (the tanh gelu {GELU_TANH} is)")
            if hf.get("use_bidirectional_attention"):
                raise UnsupportedConfigError("use_bidirectional_attention=True is not supported: "
                                             "specjax decodes causally")
        else:
            act = hf.get("hidden_act", "silu")
            if act != "silu":
                raise UnsupportedConfigError(f"hidden_act {act!r} is not supported (silu is)")
        if hf.get("pretraining_tp", 1) != 1:
            raise UnsupportedConfigError("pretraining_tp != 1 is not supported")
        theta, scaling, local_theta = _read_rope(hf)
        E, H = hf["hidden_size"], hf["num_attention_heads"]
        G = hf.get("num_key_value_heads") or H
        head_dim = hf.get("head_dim") or DEFAULT_HEAD_DIM.get(model_type) or E // H
        sliding_window, layer_types = _read_windows(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type, vocab_size=hf["vocab_size"], hidden_size=E,
            num_layers=hf["num_hidden_layers"], num_heads=H, num_kv_heads=G, head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=hf.get("tie_word_embeddings", gemma),
            rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
            # Qwen2 always has q/k/v biases; elsewhere attention_bias covers q, k, v and o.
            qkv_bias=model_type == "qwen2" or (model_type in ATTENTION_BIAS and attention_bias),
            out_bias=model_type in ATTENTION_BIAS and attention_bias,
            mlp_bias=model_type == "llama" and bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            sliding_window=sliding_window, layer_types=layer_types,
            gemma=Gemma(
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                # transformers' Gemma 3 reads attn_logit_softcapping but never applies it.
                attn_softcap=_optional_float(hf.get("attn_logit_softcapping", 50.0))
                if model_type == "gemma2" else None,
                final_softcap=_optional_float(hf.get(
                    "final_logit_softcapping", 30.0 if model_type == "gemma2" else None)),
            ) if gemma else None,
            bos_token_id=_first(hf.get("bos_token_id")), eos_token_id=_first(hf.get("eos_token_id")),
            pad_token_id=_first(hf.get("pad_token_id")),
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
        if self.rope_scaling.rope_type == "linear":
            rope["factor"] = self.rope_scaling.factor
        elif self.rope_scaling.rope_type == "llama3":
            rope.update({k: v for k, v in dataclasses.asdict(self.rope_scaling).items()
                         if k != "rope_type"})
        out = {
            "model_type": self.model_type, "architectures": [ARCHITECTURES[self.model_type]],
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
                       query_pre_attn_scalar=_int_if_whole(g.query_pre_attn_scalar),
                       final_logit_softcapping=g.final_softcap,
                       attn_logit_softcapping=g.attn_softcap,
                       # transformers builds a sliding mask even with no sliding layer
                       attention_bias=self.qkv_bias, sliding_window=self.sliding_window or 4096,
                       layer_types=list(self.layer_types or ["full_attention"] * self.num_layers),
                       use_bidirectional_attention=False)
            return out
        out["hidden_act"] = "silu"
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.model_type in ("mistral", "phi3"):
            out["sliding_window"] = self.sliding_window
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


# Where a config.json omits head_dim, transformers' class default (else E // H).
DEFAULT_HEAD_DIM = {"qwen3": 128, "gemma2": 256, "gemma3_text": 256}
# The model types whose attention_bias puts biases on q, k, v and o.
ATTENTION_BIAS = ("llama", "qwen3", "gemma2", "gemma3_text")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}


def _rope_entry(rope: dict, default_theta: float, where: str) -> tuple[float, RopeScaling]:
    """One rope_parameters dict -> (theta, scaling); refuses what specjax cannot compute."""
    rope = dict(rope)
    theta = float(rope.pop("rope_theta", default_theta))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError("partial_rotary_factor != 1 is not supported")
    if rope_type in ("longrope", "su"):
        raise UnsupportedConfigError(
            f"rope_type {rope_type!r} (Phi-3's long-context scaling, {where}) is not supported; "
            f"specjax supports {ROPE_TYPES}: use a checkpoint with plain rope, e.g. Phi-3's "
            f"4k-context variants")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedConfigError(
            f"unsupported rope_type {rope_type!r} ({where}); specjax supports {ROPE_TYPES}")
    return theta, RopeScaling(rope_type=rope_type, **{
        k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                             "original_max_position_embeddings") if k in rope})


def _read_rope(hf) -> tuple[float, RopeScaling, float | None]:
    """(theta, scaling) of full-attention layers and the base of sliding ones (Gemma 3 only).

    transformers 5.x writes `rope_parameters` (for Gemma 3: one dict per layer type); 4.x
    wrote top-level `rope_theta` / `rope_scaling` (Gemma 3: and `rope_local_base_freq`)."""
    model_type = hf["model_type"]
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError("partial_rotary_factor != 1 is not supported")
    params = dict(hf.get("rope_parameters") or {})
    if model_type != "gemma3_text":
        legacy = hf.get("rope_scaling") or {}
        theta, scaling = _rope_entry({**legacy, **params}, hf.get("rope_theta", 10000.0), "rope_parameters")
        return theta, scaling, None
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:  # the 4.x layout: rope_scaling applies to the global layers only
        full = {**(hf.get("rope_scaling") or {}), **params}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    theta, scaling = _rope_entry(full, hf.get("rope_theta", 1_000_000.0), "full_attention layers")
    local_theta, local_scaling = _rope_entry(local, 10000.0, "sliding_attention layers")
    if local_scaling.rope_type != "default":
        raise UnsupportedConfigError(
            f"rope scaling of sliding-window layers ({local_scaling.rope_type!r}) is not supported; "
            f"specjax scales only the full-attention layers' rope, as Gemma 3 checkpoints do")
    return theta, scaling, local_theta


def _read_windows(hf) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as transformers reads them for each model_type."""
    model_type, L = hf["model_type"], hf["num_hidden_layers"]
    if model_type in ("mistral", "phi3"):  # one window for every layer, if any
        return hf.get("sliding_window", 4096 if model_type == "mistral" else None), None
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


def _int_if_whole(x: float):
    """transformers' Gemma configs type query_pre_attn_scalar as int."""
    return int(x) if float(x).is_integer() else x


def _optional_float(x):
    return None if x is None else float(x)


def _first(token_id):
    """The first of a list of token ids (GenerationConfig keeps all the EOS ids: generation
    stops on any of them)."""
    if isinstance(token_id, (list, tuple)):
        return token_id[0] if token_id else None
    return token_id


def rope_inv_freq(config: ModelConfig, local: bool = False):
    """Rotary inverse frequencies [D/2] as transformers computes them (numpy float64), of
    the full-attention layers, or (local=True) of the sliding-window layers."""
    import numpy as np

    D = config.head_dim
    if local and config.local_rope_theta is not None:  # Gemma 3: its own base, unscaled
        return 1.0 / (config.local_rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    s = config.rope_scaling
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled)
    return inv_freq


# ModelConfig's names of the values `_check_positive` checks -> config.json's keys.
_GPT2_KEYS = {"norm_eps": "layer_norm_epsilon"}
_ROTARY_KEYS = {"norm_eps": "rms_norm_eps",
                "local_rope_theta": "rope_local_base_freq (or rope_parameters.sliding_attention.rope_theta)",
                "rope scaling factor": "rope_parameters.factor (or rope_scaling.factor)",
                **{f"rope scaling {k}": f"rope_parameters.{k} (or rope_scaling.{k})"
                   for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")},
                "attn_softcap": "attn_logit_softcapping", "final_softcap": "final_logit_softcapping"}


FLOAT32_MAX = 3.4028234663852886e38


def _check_positive(name: str, value) -> None:
    """Raises InvalidConfigError unless value is a number in (0, float32's largest] (zero,
    negative, infinite, NaN or float32-overflowing values load but compute NaN or silently
    wrong logits)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= FLOAT32_MAX:
        raise InvalidConfigError(f"{name} must be a finite number > 0, got {value!r}")


# ---- config.json sanity ----------------------------------------------------------------

# Sizes a config.json may give, under the names its families use; each must be a positive
# int when present (None means "not given" for the optional ones: head_dim, n_inner, ...).
SIZE_KEYS = ("vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer",
             "num_attention_heads", "n_head", "num_key_value_heads", "head_dim",
             "intermediate_size", "n_inner", "max_position_embeddings", "n_positions")
# Switches a config.json may give: each must be true or false when present.
BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
             "use_bidirectional_attention")
# Sizes that may be null (then derived: kv heads = heads, head_dim = E / H, n_inner = 4 E).
OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim", "n_inner")
# No tokenizer comes near this (the largest real vocabularies are ~256k); a larger value is
# a corrupt or hostile file asking for a giant embedding table.
MAX_VOCAB_SIZE = 2**24


# The types of the other values config.json may give (None: absent), checked before any
# is read, so that a wrong one is named by its key.
NUMBER_KEYS = ("rope_theta", "rms_norm_eps", "layer_norm_epsilon", "query_pre_attn_scalar",
               "attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq",
               "partial_rotary_factor")
COUNT_KEYS = {"sliding_window": 1, "max_window_layers": 0, "sliding_window_pattern": 1,
              "_sliding_window_pattern": 1, "pretraining_tp": 1}  # key -> least value
MAPPING_KEYS = ("rope_parameters", "rope_scaling")
TEXT_KEYS = ("model_type", "hidden_act", "hidden_activation", "activation_function")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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
            for name in ROPE_NUMBERS:
                if name in entry and not number(entry[name]):
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
    if E is not None and H is not None and hf.get("head_dim") is None and E % H:
        raise InvalidConfigError(f"config.json: {H_key}={H} does not divide {E_key}={E}, and "
                                 f"there is no head_dim to say the size of a head")


# ---- generation_config.json ------------------------------------------------------------

# transformers' defaults for what a generation_config.json leaves out.
_SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
# Keys specjax does not apply, at values that change nothing (transformers' defaults), and
# bookkeeping keys: neither is reported as ignored.
_NO_EFFECT = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0,
              "length_penalty": 1.0, "no_repeat_ngram_size": 0, "typical_p": 1.0, "min_length": 0,
              "use_cache": True, "early_stopping": False, "output_scores": False,
              "return_dict_in_generate": False, "output_attentions": False,
              "output_hidden_states": False, "output_logits": False, "transformers_version": None,
              "_from_model_config": None, "max_length": None, "max_new_tokens": None}


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How a model asks to be decoded: generation_config.json (or, without one, the token
    ids of config.json), read as transformers reads it. Frozen and hashable.

    Only what specjax can honour is kept: stop ids and the sampling parameters. Others
    (repetition penalties, beams, ...) are not applied; `ignored` names them."""

    eos_token_id: tuple[int, ...] = ()  # stop ids: a row stops after the first of any
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    do_sample: bool = False  # False: greedy, whatever temperature says
    temperature: float = 1.0
    top_k: int = 50  # transformers' default when sampling; 0 is off
    top_p: float = 1.0
    ignored: tuple[str, ...] = ()  # keys present that specjax does not apply

    def sampling(self) -> dict[str, float]:
        """temperature, top_k, top_p as `specjax.generate` takes them (temperature 0: greedy)."""
        if not self.do_sample:
            return {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}

    @classmethod
    def from_hf(cls, generation: dict[str, Any] | None, config: dict[str, Any],
                vocab_size: int | None = None) -> "GenerationConfig":
        """generation: generation_config.json's dict (None when the folder has none);
        config: config.json's dict, whose token ids stand in when generation lacks them."""
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
        known = set(_SAMPLING_DEFAULTS) | {"eos_token_id", "bos_token_id", "pad_token_id"}
        ignored = tuple(sorted(key for key, v in generation.items() if key not in known
                               and v is not None and not (key in _NO_EFFECT and v == _NO_EFFECT[key])
                               and not (key in _NO_EFFECT and _NO_EFFECT[key] is None)))
        return cls(eos_token_id=tuple(ids["eos_token_id"]),
                   bos_token_id=(ids["bos_token_id"] or [None])[0],
                   pad_token_id=(ids["pad_token_id"] or [None])[0],
                   do_sample=sampling["do_sample"], temperature=float(t), top_k=k, top_p=float(p),
                   ignored=ignored)

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
        return out
