"""Hugging Face folders (config.json + *.safetensors) <-> `Model`.

One table per family says, for every Hugging Face tensor, its name, its shape, which
specjax parameter(s) it becomes and how (transposes, head splits, GPT-2's fused qkv).
Loading checks every tensor against the table (missing, unexpected, wrong shape) before
converting; saving runs the same table backwards, so what `save_model` writes loads in
transformers. This module knows nothing about decoding.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import quant
from specjax.config import ModelConfig
from specjax.models import Model, default_dtype, layers

# Buffers some checkpoints carry that hold no weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


class CheckpointError(ValueError):
    """A checkpoint folder is missing files, or its files are corrupt or do not match the config."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One Hugging Face tensor and the specjax parameters it becomes.

    `name` holds `{i}` for per-layer tensors, which are stacked on a leading [L] axis."""

    name: str
    shape: tuple[int, ...]
    paths: tuple[tuple[str, ...], ...]  # specjax parameter paths it maps to
    to_ours: Callable  # hf array -> tuple of our arrays (one per path)
    to_hf: Callable  # tuple of our arrays -> hf array

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name


def _same(path, shape, name):
    return Tensor(name, shape, (path,), lambda w: (w,), lambda ps: ps[0])


def _linear(path, name, n_in, n_out_shape):
    """A torch Linear weight [out, in] -> kernel [in, *out_shape]."""
    n_out = int(np.prod(n_out_shape))
    return Tensor(name, (n_out, n_in), (path,),
                  lambda w: (w.T.reshape(n_in, *n_out_shape),),
                  lambda ps: ps[0].reshape(n_in, n_out).T)


def _linear_out(path, name, in_shape, n_out):
    """A torch Linear weight [out, in] whose input is heads -> kernel [*in_shape, out]."""
    n_in = int(np.prod(in_shape))
    return Tensor(name, (n_out, n_in), (path,),
                  lambda w: (w.T.reshape(*in_shape, n_out),),
                  lambda ps: ps[0].reshape(n_in, n_out).T)


def _fused_linear(paths, name, n_in, out_shapes):
    """One torch Linear [sum of outs, in] whose output concatenates several kernels
    (Phi-3's qkv_proj, gate_up_proj) -> kernels [in, *out_shape] each."""
    sizes = [int(np.prod(s)) for s in out_shapes]
    splits = np.cumsum(sizes)[:-1]
    return Tensor(name, (sum(sizes), n_in), paths,
                  lambda w: tuple(p.T.reshape(n_in, *s) for p, s in zip(np.split(w, splits), out_shapes)),
                  lambda ps: np.concatenate([p.reshape(n_in, n).T for p, n in zip(ps, sizes)]))


def _bias(path, name, shape):
    n = int(np.prod(shape))
    return Tensor(name, (n,), (path,), lambda w: (w.reshape(shape),), lambda ps: ps[0].reshape(n))


def llama_layout(c: ModelConfig) -> list[Tensor]:
    """The Llama and Gemma families: one Linear per projection, except Phi-3, which fuses
    q, k, v into qkv_proj and gate, up into gate_up_proj (concatenated along the output)."""
    E, H, G, D, F, V = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                        c.intermediate_size, c.vocab_size)
    L = "model.layers.{i}."
    attn, mlp = ("layers", "attn"), ("layers", "mlp")
    out = [
        _same(("embedding",), (V, E), "model.embed_tokens.weight"),
        _same(("final_norm", "scale"), (E,), "model.norm.weight"),
        _same(("layers", "attn_norm", "scale"), (E,), L + "input_layernorm.weight"),
    ]
    if c.family == "gemma":  # a norm before and after each of attention and the MLP
        out += [_same(attn + ("post_norm", "scale"), (E,), L + "post_attention_layernorm.weight"),
                _same(("layers", "mlp_norm", "scale"), (E,), L + "pre_feedforward_layernorm.weight"),
                _same(mlp + ("post_norm", "scale"), (E,), L + "post_feedforward_layernorm.weight")]
    else:
        out.append(_same(("layers", "mlp_norm", "scale"), (E,), L + "post_attention_layernorm.weight"))
    o_proj = _linear_out(attn + ("o_kernel",), L + "self_attn.o_proj.weight", (H, D), E)
    if c.model_type == "phi3":
        out += [_fused_linear(tuple(attn + (n,) for n in ("q_kernel", "k_kernel", "v_kernel")),
                              L + "self_attn.qkv_proj.weight", E, ((H, D), (G, D), (G, D))),
                o_proj,
                _fused_linear(tuple(mlp + (n,) for n in ("gate_kernel", "up_kernel")),
                              L + "mlp.gate_up_proj.weight", E, ((F,), (F,)))]
    else:
        out += [_linear(attn + ("q_kernel",), L + "self_attn.q_proj.weight", E, (H, D)),
                _linear(attn + ("k_kernel",), L + "self_attn.k_proj.weight", E, (G, D)),
                _linear(attn + ("v_kernel",), L + "self_attn.v_proj.weight", E, (G, D)),
                o_proj,
                _linear(mlp + ("gate_kernel",), L + "mlp.gate_proj.weight", E, (F,)),
                _linear(mlp + ("up_kernel",), L + "mlp.up_proj.weight", E, (F,))]
    out.append(_linear(mlp + ("down_kernel",), L + "mlp.down_proj.weight", F, (E,)))
    if c.qk_norm:
        out += [_same(attn + ("q_norm", "scale"), (D,), L + "self_attn.q_norm.weight"),
                _same(attn + ("k_norm", "scale"), (D,), L + "self_attn.k_norm.weight")]
    if c.qkv_bias:
        out += [_bias(attn + ("q_bias",), L + "self_attn.q_proj.bias", (H, D)),
                _bias(attn + ("k_bias",), L + "self_attn.k_proj.bias", (G, D)),
                _bias(attn + ("v_bias",), L + "self_attn.v_proj.bias", (G, D))]
    if c.out_bias:
        out.append(_bias(attn + ("o_bias",), L + "self_attn.o_proj.bias", (E,)))
    if c.mlp_bias:
        out += [_bias(mlp + ("gate_bias",), L + "mlp.gate_proj.bias", (F,)),
                _bias(mlp + ("up_bias",), L + "mlp.up_proj.bias", (F,)),
                _bias(mlp + ("down_bias",), L + "mlp.down_proj.bias", (E,))]
    if not c.tie_word_embeddings:
        out.append(_linear(("lm_head",), "lm_head.weight", E, (V,)))
    return out


def gpt2_layout(c: ModelConfig) -> list[Tensor]:
    """GPT-2 stores Conv1D weights as [in, out] and fuses q, k, v into c_attn."""
    E, H, D, F, V = c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size, c.vocab_size
    L = "transformer.h.{i}."
    attn, mlp = ("layers", "attn"), ("layers", "mlp")
    qkv = tuple(attn + (n,) for n in ("q_kernel", "k_kernel", "v_kernel"))
    qkv_bias = tuple(attn + (n,) for n in ("q_bias", "k_bias", "v_bias"))
    out = [
        _same(("embedding",), (V, E), "transformer.wte.weight"),
        _same(("pos_embedding",), (c.max_position_embeddings, E), "transformer.wpe.weight"),
        _same(("final_norm", "scale"), (E,), "transformer.ln_f.weight"),
        _same(("final_norm", "bias"), (E,), "transformer.ln_f.bias"),
        _same(("layers", "attn_norm", "scale"), (E,), L + "ln_1.weight"),
        _same(("layers", "attn_norm", "bias"), (E,), L + "ln_1.bias"),
        _same(("layers", "mlp_norm", "scale"), (E,), L + "ln_2.weight"),
        _same(("layers", "mlp_norm", "bias"), (E,), L + "ln_2.bias"),
        Tensor(L + "attn.c_attn.weight", (E, 3 * H * D), qkv,
               lambda w: tuple(p.reshape(E, H, D) for p in np.split(w, 3, axis=1)),
               lambda ps: np.concatenate([p.reshape(E, H * D) for p in ps], axis=1)),
        Tensor(L + "attn.c_attn.bias", (3 * H * D,), qkv_bias,
               lambda w: tuple(p.reshape(H, D) for p in np.split(w, 3)),
               lambda ps: np.concatenate([p.reshape(H * D) for p in ps])),
        Tensor(L + "attn.c_proj.weight", (H * D, E), (attn + ("o_kernel",),),
               lambda w: (w.reshape(H, D, E),), lambda ps: ps[0].reshape(H * D, E)),
        _same(attn + ("o_bias",), (E,), L + "attn.c_proj.bias"),
        _same(mlp + ("fc_kernel",), (E, F), L + "mlp.c_fc.weight"),
        _same(mlp + ("fc_bias",), (F,), L + "mlp.c_fc.bias"),
        _same(mlp + ("proj_kernel",), (F, E), L + "mlp.c_proj.weight"),
        _same(mlp + ("proj_bias",), (E,), L + "mlp.c_proj.bias"),
    ]
    if not c.tie_word_embeddings:
        out.append(_linear(("lm_head",), "lm_head.weight", E, (V,)))
    return out


def layout(c: ModelConfig) -> list[Tensor]:
    return gpt2_layout(c) if c.family == "gpt2" else llama_layout(c)


# ---- reading ---------------------------------------------------------------------------


def resolve(path: str | os.PathLike) -> Path:
    """A local folder, or a hub id resolved (downloaded) with huggingface_hub."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    if folder.exists():
        raise CheckpointError(f"{folder} is a file; expected a folder with config.json and *.safetensors")
    name = str(path)
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise CheckpointError(f"checkpoint folder {name} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as e:  # offline, unknown repo, no access: say which and why
        raise CheckpointError(f"{name} is not a local folder and could not be fetched from the "
                              f"Hugging Face hub: {type(e).__name__}: {e}") from e


def read_config(folder: Path) -> ModelConfig:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file} is not valid JSON: {e}") from e
    return ModelConfig.from_hf_config(hf)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        extra = " (it has PyTorch .bin weights: re-save with safe_serialization=True)" if any(
            folder.glob("*.bin")) else ""
        raise CheckpointError(f"{folder} has no *.safetensors weights{extra}")
    return files


def read_tensors(folder: Path) -> dict[str, np.ndarray]:
    """All tensors of a folder's safetensors file(s), as numpy arrays (bfloat16 kept)."""
    from safetensors import SafetensorError, safe_open

    tensors = {}
    for file in _safetensors_files(folder):
        try:
            with safe_open(file, framework="np") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{file} is corrupt or truncated: {e}") from e
    return tensors


def params_from_tensors(tensors: dict[str, np.ndarray], config: ModelConfig, dtype,
                        mesh=None, rules=None, quantize: str | None = None) -> dict:
    """Checks every tensor against the layout, then converts and stacks layers. With a
    mesh, each device receives only its own shard of each parameter. quantize="int8":
    matmul weights and the embedding are quantised on the host, before placement."""
    quant.check_method(quantize)
    tensors = {_canonical(name, config): t for name, t in tensors.items()}
    expected = {}
    for spec in layout(config):
        for i in range(config.num_layers) if spec.per_layer else [None]:
            expected[spec.name.format(i=i)] = spec.shape
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensors the config needs: "
                              f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexpected = sorted(n for n in set(tensors) - set(expected) if not _ignorable(n, config))
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} tensors the config does not "
                              f"explain: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensors[name].shape)}, "
                                  f"but the config implies {shape}")

    params: dict = {}
    for spec in layout(config):
        if spec.per_layer:
            per_layer = [spec.to_ours(tensors[spec.name.format(i=i)]) for i in range(config.num_layers)]
            values = [np.stack(parts) for parts in zip(*per_layer)]
        else:
            values = spec.to_ours(tensors[spec.name])
        for path, value in zip(spec.paths, values):
            if quantize and quant.quantizable(path):
                value = quant.quantize_array(value, quant.CONTRACTED[path[-1]], jnp.dtype(dtype))
            else:
                value = value.astype(jnp.dtype(dtype))
            _set(params, path, _place(value, path, mesh, rules))
    return params


def _place(value, path: tuple[str, ...], mesh, rules):
    """A host array (or int8 pair) onto the device(s); with a mesh, each device gets only
    its shards."""
    if mesh is None:
        return jax.tree.map(jnp.asarray, value)
    from specjax import sharding

    placement = sharding.param_sharding(path, value, mesh, rules or sharding.DEFAULT_RULES)
    return jax.tree.map(lambda v, p: jax.make_array_from_callback(v.shape, p, lambda index: v[index]),
                        value, placement)


def load_model(path: str | os.PathLike, dtype=None, mesh=None, rules=None,
               quantize: str | None = None) -> Model:
    """Loads a Hugging Face folder (or hub id) of a supported architecture.

    dtype: parameter dtype (with quantize: of the scales, norms and activations); default
    float32 on CPU, bfloat16 on TPU/GPU.
    mesh, rules: place each parameter straight into its shards (see specjax.sharding);
    no device ever holds a whole tensor that the rules split.
    quantize: "int8" for int8 weight-only quantisation (see specjax.quant), None for none."""
    folder = resolve(path)
    config = read_config(folder)
    params = params_from_tensors(read_tensors(folder), config, dtype or default_dtype(), mesh, rules,
                                 quantize)
    return Model(config, params)


def load_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer stored beside the weights."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve(path)))


# ---- writing ---------------------------------------------------------------------------


def tensors_from_params(model: Model) -> dict[str, np.ndarray]:
    """Hugging Face tensors of a model's params (int8 weights written dequantised)."""
    c = model.config
    params = jax.tree.map(lambda w: np.asarray(jax.device_get(layers.dequantize(w))), model.params,
                          is_leaf=lambda x: isinstance(x, quant.Int8))
    out = {}
    for spec in layout(c):
        ours = tuple(_get(params, p) for p in spec.paths)
        if spec.per_layer:
            for i in range(c.num_layers):
                out[spec.name.format(i=i)] = spec.to_hf(tuple(o[i] for o in ours))
        else:
            out[spec.name] = spec.to_hf(ours)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_model(model: Model, path: str | os.PathLike, dtype=None) -> Path:
    """Writes config.json + model.safetensors that specjax and transformers both load.

    dtype: storage dtype (default: the params' own; an int8 model is written dequantised,
    in its scales' dtype, so what loads back computes what the int8 model computed)."""
    from safetensors.numpy import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = tensors_from_params(model)
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    hf = model.config.to_hf_config()
    hf["torch_dtype"] = hf["dtype"] = str(next(iter(tensors.values())).dtype)
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# ---- helpers ---------------------------------------------------------------------------


def _canonical(name: str, config: ModelConfig) -> str:
    """GPT-2 checkpoints saved from GPT2Model (the original hub files) lack `transformer.`."""
    if config.family == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
        return "transformer." + name
    return name


def _ignorable(name: str, config: ModelConfig) -> bool:
    return name.endswith(IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")


def _set(tree: dict, path: tuple[str, ...], value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree
