"""Published EAGLE-3 heads' folders, read (`read_published`: `load_drafter` calls it for a
folder that holds one) in the formats their writers use (export.py writes them):

- "eagle": SafeAILab/EAGLE's (cb7e084 eagle/model/cnets.py, ea_model.py): config.json, a
  LlamaConfig (architectures ["LlamaForCausalLMEagle3"], or the training template's
  ["LlamaForCausalLM"] with draft_vocab_size), and tensors fc.weight [E, 3Et],
  midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
  midlayer.self_attn.{q,k,v}_proj.weight [., 2E], o_proj, midlayer.mlp.*, norm.weight,
  lm_head.weight [Vd, E], d2t int64 [Vd] and t2d bool [V] (absent where Vd = V), maybe
  embed_tokens.weight. It always taps the target's hidden_states 2, L/2 and L-3, runs rope
  base 10000 where the config has no rope_theta, and D = E / heads.
- "specforge": SGLang's SpecForge (a6b6b02 modeling/draft/llama3_eagle.py): the same
  tensors and config, with its keys: `eagle_config.eagle_aux_hidden_state_layer_ids`
  counted one lower than hidden_states' index (SGLang adds 1), `fc_norm` (fc_norm.{i}.weight
  [Et] before fc), `norm_output` (false: lm_head reads the un-normed output), `head_dim`.
- "speculators": Red Hat's (c05b95b models/eagle3): config.json with speculators_model_type
  "eagle3", the layer's config under transformer_layer_config (a diff against its
  model_type's transformers defaults; no model_type: qwen3), draft_vocab_size,
  norm_before_residual, norm_before_fc, fc_norm, norm_output, target_hidden_size,
  eagle_aux_hidden_state_layer_ids (hidden_states' index; none: 2, L/2, L-3), the verifier's
  name; tensors layers.0.* for midlayer.*, input_norm.weight, fc_norm.{i}.weight, and
  embed_tokens.weight.

Weights are model.safetensors, or pytorch_model.bin read with torch.load(weights_only=True)
(tensors only, no code) where torch is installed; every tensor's name, dtype and shape is
checked against the config before one is read. It knows files; published.py computes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.drafters import trained
from specjax.drafters.medusa import Medusa
from specjax.drafters.published import (Layout, PublishedEagle, PublishedEagle3, draft_ids, published_eagle_shapes,
                                        published_shapes)
from specjax.drafters.vocab import check_vocab
from specjax.folders import CheckpointError, UnsafeCheckpointError, _read_json, check_regular

EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
MAX_ELEMENTS = 2 ** 34  # no head holds more (a 70B target's: about 2^31)
LAYER_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
              "hidden_act", "attention_bias", "mlp_bias", "vocab_size")


def published_format(folder: Path) -> str | None:
    """The published format of the head in folder (config.json's say), or None: not one."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None
    config = _read_json(config_file)
    if config.get("speculators_model_type") is not None:
        return "speculators"
    if "medusa_num_heads" in config:
        return "medusa"
    architectures = config.get("architectures") or []
    eagle3 = any(a in EAGLE_ARCHITECTURES for a in architectures if isinstance(a, str)) or (
        "draft_vocab_size" in config and config.get("num_hidden_layers") == 1
        and "midlayer.hidden_norm.weight" in _tensor_names(folder))
    if not eagle3:
        names = _tensor_names(folder) if config.get("num_hidden_layers") == 1 else set()
        eagle1 = {"fc.weight", "layers.0.self_attn.q_proj.weight"} <= names and "lm_head.weight" not in names
        return "eagle1" if eagle1 else None
    return "specforge" if any(k in config for k in ("eagle_config", "fc_norm", "norm_output")) else "eagle"


def read_published(folder: Path, tree=None):
    """The published head in folder (`published_format`: a PublishedEagle3, a PublishedEagle
    or a Medusa), drafting tree (None: a chain). Anything that does not fit raises
    CheckpointError naming it."""
    source = published_format(folder)
    if source == "medusa":
        return _read_medusa(folder, tree)
    if source == "eagle1":
        return _read_eagle1(folder, tree)
    return _read_eagle3(folder, source, tree)


def _read_eagle3(folder: Path, source: str, tree) -> PublishedEagle3:
    config_file = folder / "config.json"
    raw = _read_json(config_file)
    if source == "speculators":
        kind = raw.get("speculators_model_type")
        if kind != "eagle3":
            raise CheckpointError(f"{config_file}: a speculators {kind!r} model; specjax reads its \"eagle3\" heads")
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise CheckpointError(f"{config_file}: a speculators head keeps its layer's config under "
                                  f"\"transformer_layer_config\" (an object)")
        layer = _with_defaults(layer, config_file)
        options = {k: _flag(raw, k, False, config_file) for k in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                                   "norm_output")}
        layout = Layout(norm_before_residual=options["norm_before_residual"], feed_normed=options["norm_output"],
                        source=source)
        taps = raw.get("eagle_aux_hidden_state_layer_ids")
        names = {"midlayer.": "layers.0."}
        verifier = _dig(raw, "speculators_config", "verifier", "name_or_path") or ""
        target_hidden, draft_vocab = raw.get("target_hidden_size"), raw.get("draft_vocab_size", 32000)
    else:
        layer = raw
        options = {"norm_before_fc": False, "fc_norm": source == "specforge" and _flag(raw, "fc_norm", False,
                                                                                        config_file)}
        layout = Layout(out_norm=_flag(raw, "norm_output", True, config_file), source=source)
        eagle_config = raw.get("eagle_config") or {}
        taps = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
        if taps is not None and source == "specforge":  # "output of layer k": hidden_states[k + 1]
            taps = [i + 1 for i in taps] if _int_list(taps) else taps
        names = {}
        verifier, target_hidden, draft_vocab = "", raw.get("target_hidden_size"), raw.get("draft_vocab_size")
    layer_config, sources = _layer_config(layer, folder, names, config_file, source)
    E, V = layer_config.hidden_size, layer_config.vocab_size
    if taps is not None and not (_int_list(taps) and 1 <= len(taps) <= 16 and len(set(taps)) == len(taps)
                                 and min(taps) >= 1):
        raise CheckpointError(f"{config_file}: eagle_aux_hidden_state_layer_ids must be distinct layer numbers "
                              f"(hidden_states indices >= 1), got {taps!r}")
    fc = sources.get("fc.weight")
    if fc is None or len(fc.shape) != 2 or fc.shape[0] != E:
        raise CheckpointError(f"{folder}: fc.weight must be [{E}, n x the target's hidden size], got "
                              f"{None if fc is None else list(fc.shape)}")
    n = 3 if taps is None else len(taps)
    if target_hidden is None:
        target_hidden, rest = divmod(fc.shape[1], n)
        if rest:
            raise CheckpointError(f"{folder}: fc.weight reads {fc.shape[1]} values, not {n} target states")
    head = sources.get("lm_head.weight")
    if draft_vocab is None:
        draft_vocab = V if head is None else head.shape[0]
    for name, value in (("draft_vocab_size", draft_vocab), ("target_hidden_size", target_hidden)):
        if not trained.positive_int(value):
            raise CheckpointError(f"{config_file}: {name} must be a positive integer, got {value!r}")
    shapes = published_shapes(layer_config, n, target_hidden, None if head is None else draft_vocab,
                              options["norm_before_fc"], options["fc_norm"], "embed_tokens.weight" in sources)
    params = _params(sources, shapes, layer_config, folder, n)
    vocab = _vocab(sources, draft_vocab, V, folder)
    signature = trained.TargetSignature("", target_hidden, V, str(verifier))
    return PublishedEagle3(params, layer_config, signature, tree, None if taps is None else tuple(sorted(taps)),
                           vocab, layout)


def _flag(config: dict, key: str, default: bool, where: Path) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _dig(tree, *keys):
    for key in keys:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _int_list(values) -> bool:
    return isinstance(values, list) and all(type(v) is int for v in values)


def _with_defaults(diff: dict, where: Path) -> dict:
    """speculators' transformer_layer_config (`to_diff_dict`: what differs from its
    model_type's transformers defaults) with those defaults filled in."""
    from transformers import AutoConfig

    model_type = diff.get("model_type", "qwen3")
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in diff.items() if k != "model_type"}).to_dict()
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{where}: transformer_layer_config of model_type {model_type!r} is refused by "
                              f"transformers: {e}") from None


def _layer_config(layer: dict, folder: Path, names: dict, where: Path, source: str):
    """The head's one layer as a ModelConfig (its own family, sizes, epsilon, rope; head_dim
    from its q_proj where the format ignores the config's), and its tensors located under
    specjax's names for them (midlayer.*)."""
    sources = {_renamed(name, names): t for name, t in _tensors(folder).items()}
    hf = {k: layer[k] for k in LAYER_KEYS if layer.get(k) is not None}
    types = layer.get("layer_types")
    if layer.get("use_sliding_window") or (isinstance(types, list) and types[:1] == ["sliding_attention"]) or (
            layer.get("model_type") == "mistral" and layer.get("sliding_window") is not None):
        raise CheckpointError(f"{where}: the head's layer attends through a sliding window "
                              f"({layer.get('sliding_window')!r}); specjax's published heads attend to every position")
    hf.setdefault("model_type", "llama")
    if hf["model_type"] not in ("llama", "qwen3", "qwen2", "mistral"):
        raise CheckpointError(f"{where}: a head's layer of model_type {hf['model_type']!r}; specjax runs llama, "
                              f"qwen2, qwen3 and mistral layers")
    q = sources.get("midlayer.self_attn.q_proj.weight")
    heads = layer.get("num_attention_heads")
    if q is None or len(q.shape) != 2 or not trained.positive_int(heads) or q.shape[0] % heads:
        raise CheckpointError(f"{folder}: midlayer.self_attn.q_proj.weight ({None if q is None else list(q.shape)}) "
                              f"must be [num_attention_heads ({heads!r}) x head_dim, 2 x hidden_size]")
    head_dim = q.shape[0] // heads
    if source not in ("eagle", "eagle1") and layer.get("head_dim") not in (None, head_dim):
        raise CheckpointError(f"{where}: head_dim {layer.get('head_dim')!r}, but q_proj holds {heads} heads of "
                              f"{head_dim}")
    hf.update(num_hidden_layers=1, head_dim=head_dim, tie_word_embeddings=False)
    extra = sorted(n for n in sources if n.startswith("layers.") or n.startswith("midlayer.layers."))
    if extra:
        raise CheckpointError(f"{folder}: a head of more than one layer ({extra[:3]}); specjax runs one")
    try:
        config = ModelConfig.from_hf_config(hf)
    except ValueError as e:
        raise CheckpointError(f"{where}: the head's layer is refused: {e}") from None
    return dataclasses.replace(config, layer_types=None, sliding_window=None), sources


def _renamed(name: str, names: dict) -> str:
    for theirs, ours in names.items():
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return name


def _tensor_names(folder: Path) -> set[str]:
    """The names of the folder's tensors, to tell formats apart: its safetensors' (their
    headers), or, for a pickle alone, every string its pickle holds (a superset of its
    tensors' names: `pickled_strings`), read without unpickling anything."""
    if list(folder.glob("*.safetensors")):
        try:
            return set(_tensors(folder))
        except CheckpointError:
            return set()
    pickled = folder / "pytorch_model.bin"
    return pickled_strings(pickled) if pickled.is_file() else set()


def pickled_strings(path: Path) -> set[str]:
    """Every string constant in a torch file's pickle (a zip's data.pkl, or a legacy file's
    first pickle), read by walking its opcodes (`pickletools.genops`): nothing is
    unpickled, no code runs. Empty where it is no pickle."""
    import pickletools
    import zipfile

    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                data = archive.read(name) if name is not None else b""
        else:
            data = path.read_bytes()
        return {arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str) and "UNICODE" in op.name}
    except Exception:  # noqa: BLE001 - a file that is not a pickle names no tensors
        return set()


# torch.load(weights_only=True) can run code before torch 2.6 (CVE-2025-32434).
SAFE_TORCH = (2, 6)


def _tensors(folder: Path, pickled: tuple[str, ...] = ("pytorch_model.bin",)) -> dict:
    """The folder's tensors by name, located (shape, dtype) but not read: its safetensors, or
    its pickled weights (`pickled`' first file found) through torch.load(weights_only=True,
    mmap=True)."""
    from specjax.hf import read_sources

    if list(folder.glob("*.safetensors")):
        return read_sources(folder)
    pickled = next((folder / name for name in pickled if (folder / name).is_file()), None)
    if pickled is None:
        return read_sources(folder)  # names what is missing, or refuses other pickles
    check_regular(pickled)
    convert = (f"python -c \"import torch, safetensors.torch as s; s.save_file(torch.load('{pickled}', "
               f"weights_only=True), '{folder / 'model.safetensors'}')\"")
    try:
        import torch
    except ImportError:
        raise UnsafeCheckpointError(f"{pickled} is a torch pickle; without torch installed specjax will not read "
                                    f"it (unpickling can run code). Convert it once: {convert}") from None
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if version < SAFE_TORCH:
        raise UnsafeCheckpointError(f"{pickled} is a torch pickle, and torch {torch.__version__} can run code while "
                                    f"loading one even with weights_only=True (CVE-2025-32434): install torch >= "
                                    f"{'.'.join(map(str, SAFE_TORCH))}, or convert it once elsewhere: {convert}")
    try:
        state = torch.load(pickled, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - weights_only refuses anything but tensors: say so
        why = next((line.strip() for line in str(e).splitlines() if "Unsupported global" in line),
                   str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise UnsafeCheckpointError(f"{pickled} holds more than tensors, or is no torch file: torch.load(weights_only="
                                    f"True) refused it ({why}); specjax reads heads' tensors alone") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"{pickled} does not hold a dict of named tensors")
    return {name: _Torch(t) for name, t in state.items()}


class _Torch:
    """A torch tensor behind hf._Stored's interface (shape, dtype, array())."""

    def __init__(self, tensor):
        self.tensor, self.shape = tensor, tuple(tensor.shape)
        import torch
        self.dtype = np.dtype("bool") if tensor.dtype == torch.bool else (
            np.dtype(jnp.bfloat16) if tensor.dtype == torch.bfloat16 else
            np.dtype(str(tensor.dtype).removeprefix("torch.")))

    def array(self) -> np.ndarray:
        import torch
        t = self.tensor.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(jnp.bfloat16)
        return t.numpy()


def _layer_tensors(shapes: dict, config: ModelConfig, in_size: int) -> dict:
    """The published names (midlayer.*) and shapes of a head's layer's tensors, for its
    params' shapes (`Block`'s: biases and q/k norms where it has them; in_size: the width
    q, k and v read)."""
    E, H, G, D, F = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    m = "midlayer."
    out = {m + "self_attn.q_proj.weight": (H * D, in_size), m + "self_attn.k_proj.weight": (G * D, in_size),
           m + "self_attn.v_proj.weight": (G * D, in_size), m + "self_attn.o_proj.weight": (E, H * D),
           m + "mlp.gate_proj.weight": (F, E), m + "mlp.up_proj.weight": (F, E), m + "mlp.down_proj.weight": (E, F),
           m + "post_attention_layernorm.weight": (E,)}
    attn = shapes["attn"]
    if "qkv_bias" in attn:
        out.update({m + "self_attn.q_proj.bias": (H * D,), m + "self_attn.k_proj.bias": (G * D,),
                    m + "self_attn.v_proj.bias": (G * D,)})
    if "o_bias" in attn:
        out[m + "self_attn.o_proj.bias"] = (E,)
    if "q_norm" in attn:
        out.update({m + "self_attn.q_norm.weight": (D,), m + "self_attn.k_norm.weight": (D,)})
    if "attn_norm" in shapes:
        out[m + "input_layernorm.weight"] = (E,)
    return out


def _layer_params(read, shapes: dict, config: ModelConfig, in_size: int) -> dict:
    """A head's layer's params in specjax's layout from its published tensors (`read(name)`:
    float32)."""
    E, H, G, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    R, m = H // G, "midlayer."
    q, k, v = (read(m + f"self_attn.{x}_proj.weight") for x in "qkv")
    attn = {"qkv_kernel": np.concatenate([q.reshape(G, R, D, in_size), k.reshape(G, 1, D, in_size),
                                          v.reshape(G, 1, D, in_size)], axis=1),
            "o_kernel": read(m + "self_attn.o_proj.weight").T.reshape(H, D, E)}
    if "qkv_bias" in shapes["attn"]:
        qb, kb, vb = (read(m + f"self_attn.{x}_proj.bias") for x in "qkv")
        attn["qkv_bias"] = np.concatenate([qb.reshape(G, R, D), kb.reshape(G, 1, D), vb.reshape(G, 1, D)], axis=1)
    if "o_bias" in shapes["attn"]:
        attn["o_bias"] = read(m + "self_attn.o_proj.bias")
    for x in ("q", "k") if "q_norm" in shapes["attn"] else ():
        attn[f"{x}_norm"] = {"scale": read(m + f"self_attn.{x}_norm.weight")}
    out = {"attn": attn, "mlp_norm": {"scale": read(m + "post_attention_layernorm.weight")},
           "mlp": {"gate_up_kernel": np.stack([read(m + f"mlp.{x}_proj.weight").T for x in ("gate", "up")]),
                   "down_kernel": read(m + "mlp.down_proj.weight").T}}
    if "attn_norm" in shapes:
        out["attn_norm"] = {"scale": read(m + "input_layernorm.weight")}
    return out


def _checked(sources: dict, expected: dict, folder: Path, ignored=()):
    """A reader of the tensors `expected` ({name: shape}) once each is there with its shape
    and a floating dtype and no other is (but `ignored`): read(name) -> float32, finite."""
    unexplained = sorted(set(sources) - set(expected) - set(ignored))
    missing = sorted(set(expected) - set(sources))
    if missing or unexplained:
        raise CheckpointError(f"{folder}: the head's tensors do not match its config: "
                              + "; ".join(f"{what} {names[:6]}" for what, names in
                                          (("missing", missing), ("not explained by it", unexplained)) if names))
    for name, shape in expected.items():
        got = sources[name]
        if tuple(got.shape) != tuple(shape):
            raise CheckpointError(f"{folder}: tensor {name} has shape {list(got.shape)}, its config implies "
                                  f"{list(shape)}")
        if not jnp.issubdtype(got.dtype, jnp.floating):
            raise CheckpointError(f"{folder}: tensor {name} is {got.dtype}, not a floating-point type")
    if sum(int(np.prod(s)) for s in expected.values()) > MAX_ELEMENTS:
        raise CheckpointError(f"{folder}: a head of more than {MAX_ELEMENTS} values; refused")

    def read(name):
        from specjax.hf import check_finite

        a = np.asarray(sources[name].array(), np.float32)
        check_finite(a, f"{folder}: tensor {name}")
        return a

    return read


def _params(sources: dict, shapes: dict, config: ModelConfig, folder: Path, n: int) -> dict:
    """An EAGLE-3 head's params in specjax's layout, once every tensor is there with its
    shape and a floating dtype, and none is left unexplained."""
    E = config.hidden_size
    want = {"fc.weight": ("fuse", "kernel"), "midlayer.input_layernorm.weight": ("norms", "token", "scale"),
            "midlayer.hidden_norm.weight": ("norms", "feature", "scale"), "norm.weight": ("norms", "out", "scale"),
            "lm_head.weight": ("head", "kernel"), "embed_tokens.weight": ("embedding",),
            "input_norm.weight": ("input_norm", "scale")}
    want = {k: v for k, v in want.items() if _has(shapes, v)}
    expected = {name: _hf_shape(name, _get(shapes, path)) for name, path in want.items()}
    expected.update(_layer_tensors(shapes["layer"], config, 2 * E))
    if "fc_norm" in shapes:
        expected.update({f"fc_norm.{i}.weight": (shapes["fc_norm"]["scale"][1],) for i in range(n)})
    read = _checked(sources, expected, folder, ignored=("d2t", "t2d"))
    params: dict = {"layer": _layer_params(read, shapes["layer"], config, 2 * E)}
    for name, path in want.items():
        a = read(name)
        _set(params, path, a.T.reshape(_get(shapes, path)) if name.endswith(("fc.weight", "lm_head.weight")) else a)
    if "fc_norm" in shapes:
        _set(params, ("fc_norm", "scale"), np.stack([read(f"fc_norm.{i}.weight") for i in range(n)]))
    return _placed(params, shapes, folder)


def _placed(params: dict, shapes: dict, folder: Path) -> dict:
    got = jax.tree.map(lambda w: tuple(w.shape), params)
    if got != shapes:  # a layer option this reader does not convert (mlp biases, ...)
        raise CheckpointError(f"{folder}: specjax cannot convert this head's layer: its params {got} against "
                              f"{shapes}")
    return jax.tree.map(jax.device_put, params)


def _read_eagle1(folder: Path, tree) -> PublishedEagle:
    """A published EAGLE-1/2 head (SafeAILab/EAGLE cnets1.py; its tensors under layers.0.*,
    fc.weight [E, 2E] and fc.bias unless its config says "bias": false, maybe its copy of
    the target's embed_tokens)."""
    config_file = folder / "config.json"
    raw = _read_json(config_file)
    config, sources = _layer_config(raw, folder, {"midlayer.": "layers.0."}, config_file, "eagle1")
    if "midlayer.self_attn.q_proj.bias" in sources:  # EAGLE reads qkv_bias (Qwen2 heads)
        config = dataclasses.replace(config, qkv_bias=True)
    E = config.hidden_size
    bias = _flag(raw, "bias", True, config_file)
    shapes = published_eagle_shapes(config, "embed_tokens.weight" in sources)
    expected = {"fc.weight": (E, 2 * E), **_layer_tensors(shapes["layer"], config, E)}
    if bias:
        expected["fc.bias"] = (E,)
    if "embedding" in shapes:
        expected["embed_tokens.weight"] = shapes["embedding"]
    read = _checked(sources, expected, folder)
    params = {"fc": {"kernel": read("fc.weight").T, "bias": read("fc.bias") if bias else np.zeros(E, np.float32)},
              "layer": _layer_params(read, shapes["layer"], config, E)}
    if "embedding" in shapes:
        params["embedding"] = read("embed_tokens.weight")
    signature = trained.TargetSignature("", E, config.vocab_size, "")
    return PublishedEagle(_placed(params, shapes, folder), config, signature, tree)


def _read_medusa(folder: Path, tree) -> Medusa:
    """FasterDecoding's Medusa heads (medusa_model.py e2a5d20): config.json's
    medusa_num_heads / medusa_num_layers, medusa_lm_head.safetensors (or .pt, read as
    tensors alone) with {h}.{r}.linear.weight [E, E] and .bias [E] per block and, in
    Medusa-1's files, {h}.{R}.weight [V, E]: the head's own output layer (else the target's
    reads it out). The heads are the tensors' (the config may under-count them: Medusa's
    loader forces 5)."""
    config_file = folder / "config.json"
    raw = _read_json(config_file)
    sources = _tensors(folder, pickled=("medusa_lm_head.pt",))
    heads = sorted({int(n.split(".")[0]) for n in sources if n.split(".")[0].isdigit()})
    R = raw.get("medusa_num_layers", 1)
    if not heads or heads != list(range(len(heads))) or not trained.positive_int(R):
        raise CheckpointError(f"{folder}: Medusa heads are tensors {{h}}.{{r}}.linear.weight for heads 0..H-1 and "
                              f"medusa_num_layers >= 1 blocks; found heads {heads[:8]} and medusa_num_layers {R!r}")
    first = sources.get("0.0.linear.weight")
    if first is None or len(first.shape) != 2 or first.shape[0] != first.shape[1]:
        raise CheckpointError(f"{folder}: tensor 0.0.linear.weight must be [E, E], got "
                              f"{None if first is None else list(first.shape)}")
    E, H = first.shape[0], len(heads)
    out = sources.get(f"0.{R}.weight")
    expected = {f"{h}.{r}.linear.{k}": (E, E) if k == "weight" else (E,)
                for h in range(H) for r in range(R) for k in ("weight", "bias")}
    if out is not None:
        if len(out.shape) != 2 or out.shape[1] != E:
            raise CheckpointError(f"{folder}: tensor 0.{R}.weight (a head's output layer) must be [V, {E}], got "
                                  f"{list(out.shape)}")
        expected.update({f"{h}.{R}.weight": tuple(out.shape) for h in range(H)})
    read = _checked(sources, expected, folder)
    params = {"kernel": np.stack([np.stack([read(f"{h}.{r}.linear.weight").T for r in range(R)]) for h in range(H)]),
              "bias": np.stack([np.stack([read(f"{h}.{r}.linear.bias") for r in range(R)]) for h in range(H)])}
    if out is not None:
        params["out"] = {"kernel": np.stack([read(f"{h}.{R}.weight").T for h in range(H)])}
    V = out.shape[0] if out is not None else raw.get("vocab_size", 0)
    name = raw.get("base_model_name_or_path") or ""
    signature = trained.TargetSignature("", E, V if trained.positive_int(V) else 0, str(name))
    return Medusa(jax.tree.map(jax.device_put, params), signature, tree)


def _has(tree: dict, path: tuple) -> bool:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _hf_shape(name: str, ours: tuple) -> tuple:
    """A tensor's shape in the published file from its param's in specjax's layout."""
    if name.endswith("o_proj.weight"):
        H, D, E = ours
        return (E, H * D)
    if name.endswith(("fc.weight", "proj.weight", "lm_head.weight")):
        return tuple(reversed(ours))
    return ours


def _vocab(sources: dict, draft_vocab: int, V: int, folder: Path):
    """The target id of each draft id (int32 [Vd]) from d2t, checked against t2d; None where
    the head drafts the whole vocabulary."""
    d2t, t2d = sources.get("d2t"), sources.get("t2d")
    if d2t is None:
        if draft_vocab != V:
            raise CheckpointError(f"{folder}: a head of {draft_vocab} draft ids for a vocabulary of {V} needs its "
                                  f"d2t map (draft id -> target id offsets), which it lacks")
        return None
    if tuple(d2t.shape) != (draft_vocab,) or not np.issubdtype(d2t.dtype, np.integer):
        raise CheckpointError(f"{folder}: d2t must be integers [{draft_vocab}], got {d2t.dtype} {list(d2t.shape)}")
    try:
        ids = check_vocab(draft_ids(d2t.array()).tolist(), V, ordered=True)
    except ValueError as e:
        raise CheckpointError(f"{folder}: d2t maps draft ids to no valid target vocabulary: {e}") from None
    if t2d is not None:
        if tuple(t2d.shape) != (V,) or t2d.dtype != np.bool_:
            raise CheckpointError(f"{folder}: t2d must be bool [{V}], got {t2d.dtype} {list(t2d.shape)}")
        if not np.array_equal(np.flatnonzero(t2d.array()), np.asarray(ids)):
            raise CheckpointError(f"{folder}: t2d and d2t disagree on which target ids the head drafts")
    return jnp.asarray(ids, jnp.int32)
