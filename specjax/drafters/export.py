"""Published EAGLE-3 heads written in their writers' formats (`write_published`, which
`PublishedEagle3.save` calls): config.json and model.safetensors laid out as SafeAILab/EAGLE,
SpecForge or speculators write them (what each holds: formats.py, which reads them back).
It knows files and the head's params, not how the head computes (published.py)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

FORMATS = ("eagle", "specforge", "speculators")


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32))


def layer_tensors(layer: dict, c, prefix: str) -> dict:
    """A head's decoder layer's params (`Block`'s, q, k and v over any width) as the
    published tensors under prefix (midlayer. or layers.0.), float32."""
    E, H, G, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    R = H // G
    attn = layer["attn"]
    qkv = np.asarray(attn["qkv_kernel"])  # [G, R+2, D, in]
    t = {prefix + "post_attention_layernorm.weight": _f32(layer["mlp_norm"]["scale"]),
         prefix + "self_attn.q_proj.weight": _f32(qkv[:, :R].reshape(H * D, -1)),
         prefix + "self_attn.k_proj.weight": _f32(qkv[:, R].reshape(G * D, -1)),
         prefix + "self_attn.v_proj.weight": _f32(qkv[:, R + 1].reshape(G * D, -1)),
         prefix + "self_attn.o_proj.weight": _f32(np.asarray(attn["o_kernel"]).reshape(H * D, E).T),
         prefix + "mlp.gate_proj.weight": _f32(np.asarray(layer["mlp"]["gate_up_kernel"])[0].T),
         prefix + "mlp.up_proj.weight": _f32(np.asarray(layer["mlp"]["gate_up_kernel"])[1].T),
         prefix + "mlp.down_proj.weight": _f32(np.asarray(layer["mlp"]["down_kernel"]).T)}
    if "qkv_bias" in attn:
        b = np.asarray(attn["qkv_bias"])
        t.update({prefix + "self_attn.q_proj.bias": _f32(b[:, :R].reshape(-1)),
                  prefix + "self_attn.k_proj.bias": _f32(b[:, R].reshape(-1)),
                  prefix + "self_attn.v_proj.bias": _f32(b[:, R + 1].reshape(-1))})
    if "o_bias" in attn:
        t[prefix + "self_attn.o_proj.bias"] = _f32(attn["o_bias"])
    for x in ("q", "k") if "q_norm" in attn else ():
        t[prefix + f"self_attn.{x}_norm.weight"] = _f32(attn[f"{x}_norm"]["scale"])
    if "attn_norm" in layer:
        t[prefix + "input_layernorm.weight"] = _f32(layer["attn_norm"]["scale"])
    return t


def write_published_eagle(head, path, format: str = "eagle") -> Path:
    """Writes head (a PublishedEagle) into the folder path in EAGLE's format (cnets1.py's
    tensors: fc, layers.0.*, embed_tokens where it has its own; config.json a LlamaConfig
    with "bias"), which formats.py reads back bit for bit."""
    if format != "eagle":
        raise ValueError(f"an EAGLE-1/2 head is written in EAGLE's format (\"eagle\"), got {format!r}")
    from safetensors.numpy import save_file

    p, c = jax.device_get(head.params), head.config
    bias = bool(np.any(np.asarray(p["fc"]["bias"])))
    t = {"fc.weight": _f32(np.asarray(p["fc"]["kernel"]).T), **layer_tensors(p["layer"], c, "layers.0.")}
    if bias:
        t["fc.bias"] = _f32(p["fc"]["bias"])
    if "embedding" in p:
        t["embed_tokens.weight"] = _f32(p["embedding"])
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    config = {**c.to_hf_config(), "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
              "head_dim": c.head_dim, "bias": bias, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def write_published(head, path, format: str) -> Path:
    """Writes head (a PublishedEagle3) into the folder path in a published format (FORMATS):
    config.json and model.safetensors, as its writers' code lays them out; formats.py's
    `read_published` reads it back bit for bit (float32 weights)."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    from safetensors.numpy import save_file

    p, c, layout = jax.device_get(head.params), head.config, head.layout
    if format != "speculators" and (layout.norm_before_residual or layout.feed_normed or "input_norm" in p):
        raise ValueError(f"this head uses speculators' options (norm_before_residual, norm_output, norm_before_fc), "
                         f"which the {format} format cannot say: write it as speculators")
    if format == "speculators" and not layout.out_norm:
        raise ValueError("this head reads its output out without the final norm (SpecForge's norm_output: false), "
                         "which the speculators format cannot say: write it as specforge")
    if format == "eagle" and (not layout.out_norm or "fc_norm" in p or head.feature_layers is not None):
        raise ValueError("this head taps chosen layers, or norms its features or not its output, which EAGLE's "
                         "format cannot say: write it as specforge or speculators")
    prefix = "layers.0." if format == "speculators" else "midlayer."
    t = {"fc.weight": _f32(np.asarray(p["fuse"]["kernel"]).T), "norm.weight": _f32(p["norms"]["out"]["scale"]),
         prefix + "input_layernorm.weight": _f32(p["norms"]["token"]["scale"]),
         prefix + "hidden_norm.weight": _f32(p["norms"]["feature"]["scale"]),
         **layer_tensors(p["layer"], c, prefix)}
    if "head" in p:
        t["lm_head.weight"] = _f32(np.asarray(p["head"]["kernel"]).T)
    if "embedding" in p:
        t["embed_tokens.weight"] = _f32(p["embedding"])
    if "input_norm" in p:
        t["input_norm.weight"] = _f32(p["input_norm"]["scale"])
    for i, scale in enumerate(np.asarray(p["fc_norm"]["scale"]) if "fc_norm" in p else ()):
        t[f"fc_norm.{i}.weight"] = _f32(scale)
    V = c.vocab_size
    draft_vocab = V if head.vocab is None else int(head.vocab.shape[0])
    if head.vocab is not None:
        ids = np.asarray(head.vocab, np.int64)
        t["d2t"] = ids - np.arange(ids.shape[0])
        t["t2d"] = np.isin(np.arange(V), ids)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    layer = {**c.to_hf_config(), "num_hidden_layers": 1, "head_dim": c.head_dim}
    layer.pop("architectures", None)
    n = len(head.feature_layers) if head.feature_layers is not None else 3
    target_hidden = int(np.asarray(p["fuse"]["kernel"]).shape[0]) // n
    taps = None if head.feature_layers is None else list(head.feature_layers)
    if format == "speculators":
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                               "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                         "verifier": {"name_or_path": head.signature.name or None,
                                                      "architectures": []}},
                  "transformer_layer_config": layer, "draft_vocab_size": draft_vocab,
                  "norm_before_residual": layout.norm_before_residual, "norm_before_fc": "input_norm" in p,
                  "fc_norm": "fc_norm" in p, "norm_output": layout.feed_normed, "target_hidden_size": target_hidden,
                  "eagle_aux_hidden_state_layer_ids": taps, "torch_dtype": "float32"}
    else:
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
                  "target_hidden_size": target_hidden, "torch_dtype": "float32"}
        if format == "specforge":
            config.update(fc_norm="fc_norm" in p, norm_output=layout.out_norm)
            if taps is not None:
                config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in taps],
                                          "use_aux_hidden_state": True}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
