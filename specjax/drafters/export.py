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
    E, H, G, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    R = H // G
    prefix = "layers.0." if format == "speculators" else "midlayer."
    f32 = lambda a: np.ascontiguousarray(np.asarray(a, np.float32))  # noqa: E731
    qkv = np.asarray(p["layer"]["attn"]["qkv_kernel"])  # [G, R+2, D, 2E]
    t = {"fc.weight": f32(np.asarray(p["fuse"]["kernel"]).T), "norm.weight": f32(p["norms"]["out"]["scale"]),
         prefix + "input_layernorm.weight": f32(p["norms"]["token"]["scale"]),
         prefix + "hidden_norm.weight": f32(p["norms"]["feature"]["scale"]),
         prefix + "post_attention_layernorm.weight": f32(p["layer"]["mlp_norm"]["scale"]),
         prefix + "self_attn.q_proj.weight": f32(qkv[:, :R].reshape(H * D, 2 * E)),
         prefix + "self_attn.k_proj.weight": f32(qkv[:, R].reshape(G * D, 2 * E)),
         prefix + "self_attn.v_proj.weight": f32(qkv[:, R + 1].reshape(G * D, 2 * E)),
         prefix + "self_attn.o_proj.weight": f32(np.asarray(p["layer"]["attn"]["o_kernel"]).reshape(H * D, E).T),
         prefix + "mlp.gate_proj.weight": f32(np.asarray(p["layer"]["mlp"]["gate_up_kernel"])[0].T),
         prefix + "mlp.up_proj.weight": f32(np.asarray(p["layer"]["mlp"]["gate_up_kernel"])[1].T),
         prefix + "mlp.down_proj.weight": f32(np.asarray(p["layer"]["mlp"]["down_kernel"]).T)}
    attn = p["layer"]["attn"]
    if "qkv_bias" in attn:
        b = np.asarray(attn["qkv_bias"])
        t.update({prefix + "self_attn.q_proj.bias": f32(b[:, :R].reshape(-1)),
                  prefix + "self_attn.k_proj.bias": f32(b[:, R].reshape(-1)),
                  prefix + "self_attn.v_proj.bias": f32(b[:, R + 1].reshape(-1))})
    if "o_bias" in attn:
        t[prefix + "self_attn.o_proj.bias"] = f32(attn["o_bias"])
    for x in ("q", "k") if "q_norm" in attn else ():
        t[prefix + f"self_attn.{x}_norm.weight"] = f32(attn[f"{x}_norm"]["scale"])
    if "head" in p:
        t["lm_head.weight"] = f32(np.asarray(p["head"]["kernel"]).T)
    if "embedding" in p:
        t["embed_tokens.weight"] = f32(p["embedding"])
    if "input_norm" in p:
        t["input_norm.weight"] = f32(p["input_norm"]["scale"])
    for i, scale in enumerate(np.asarray(p["fc_norm"]["scale"]) if "fc_norm" in p else ()):
        t[f"fc_norm.{i}.weight"] = f32(scale)
    V = c.vocab_size
    draft_vocab = V if head.vocab is None else int(head.vocab.shape[0])
    if head.vocab is not None:
        ids = np.asarray(head.vocab, np.int64)
        t["d2t"] = ids - np.arange(ids.shape[0])
        t["t2d"] = np.isin(np.arange(V), ids)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    layer = {**c.to_hf_config(), "num_hidden_layers": 1, "head_dim": D}
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
