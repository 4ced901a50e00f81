"""Multi-token prediction (MTP): the drafter DeepSeek-V3/R1, Kimi-K2 and GLM-4.5/4.6 ship
inside their own checkpoints (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section
2.2), as the `num_nextn_predict_layers` layers stored after the target's
`num_hidden_layers`.

At position t the layer reads the target's final-normed hidden state h_t and the token
t+1, and predicts token t+2:

    e = enorm(embedding(token t+1))            # 0 at position 0 (vLLM masks it: see below)
    x = eh_proj([e, hnorm(h_t)])               # [2E] -> [E]: the embedding first
    x = block(x, position t)                   # a decoder layer of the target's own kind
    logits = shared_head.head(shared_head.norm(x))

Deeper, one MTP layer is re-applied to its own output: at a depth-d node h is the (un-normed)
x of its parent, the token the parent's, the position one further. This follows vLLM
(vllm/model_executor/models/deepseek_mtp.py, `DeepSeekMultiTokenPredictorLayer.forward`
and `compute_logits`, vllm-project/vllm 03356f8; its EAGLE proposer feeds the target's
final-normed states, the pairs at the target's positions t, and the layer's un-normed
output back for the next step), including its zeroing of the embedding at position 0
("not needed by MTP"); SGLang's deepseek_nextn.py concatenates in the same order (its
embedding first, against the report's figure) but does not zero position 0.

The block is `transformer.Block(config, sparse=...)` over the target's own config: latent
attention and DeepSeek's experts for DeepSeek-V3, q/k/v heads for a Llama-family target;
its MLP sparse where the target's config makes its layer number (L + k) sparse
(`layouts.mtp_block_config`). It has a one-layer cache of its own, like EAGLE's layer, and
drafts as EAGLE does (eagle.py): the kept tokens' pairs re-fed with the target's states each
step, chains and trees grown by `base.grow`, the paged engine's caches and prefixes.

Several MTP layers (DeepSeek trained its one with depth 1; vLLM cycles through several by
step): specjax drafts every depth with one of them, re-applied, and asks which
(`Mtp.load(folder, layer=k)`) rather than choosing.

Where the weights live: the target's own folder (`Mtp.load`, `load_drafter`), read by
hf.read_mtp through layouts.mtp_layout, and written back there by `Mtp.save` in the same
layout. Training one for a target that has none: train/heads.py `train_mtp`. This module
knows the computation and its shapes; nothing of files beyond calling those.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.config import ModelConfig
from specjax.drafters import trained
from specjax.drafters.eagle import Eagle, _as, run_layer
from specjax.layouts import mtp_block_config, mtp_layout
from specjax.models import Model, default_dtype, head_logits
from specjax.models.layers import Norm
from specjax.models.layers import init as normal_init
from specjax.models.transformer import embed_tokens, init_layer
from specjax.models.transformer import read_out as head_read_out
from specjax.tree import Tree

MTP_FILE = "mtp.safetensors"  # what `Mtp.save` adds to a target's folder


def mtp_layer_config(target: ModelConfig, sparse: bool) -> ModelConfig:
    """The MTP block's config: the target's family, sizes, rope and attention, one layer,
    full attention, its MLP the experts where sparse (else the dense MLP)."""
    moe = None if target.moe is None else dataclasses.replace(target.moe, dense_layers=() if sparse else (0,))
    return dataclasses.replace(target, num_layers=1, layer_types=None, sliding_window=None, moe=moe)


def _norm(config: ModelConfig, params, x):
    return Norm(config).apply({"params": jax.tree.map(lambda w: w.astype(x.dtype), params)}, x)


def mtp_input(config: ModelConfig, params: dict, target: Model, tokens, features, positions):
    """tokens int32 [B, T] (token t+1), features [B, T, E] (h_t), positions [B, T] -> the
    block's input eh_proj([enorm(embedding), hnorm(h)]) [B, T, E], the embedding 0 at
    position 0. The embedding is the target's, or params' own copy where it differs."""
    dtype = features.dtype
    embedding = params["embedding"] if "embedding" in params else target.params["embedding"]
    e = embed_tokens(target.config, embedding, tokens).astype(dtype)
    e = jnp.where((positions == 0)[..., None], jnp.zeros((), dtype), e)
    x = jnp.concatenate([_norm(config, params["enorm"], e), _norm(config, params["hnorm"], features)], axis=-1)
    return x @ params["eh_proj"]["kernel"].astype(dtype)


def mtp_layer(config: ModelConfig, params: dict, target: Model, tokens, features, positions, sparse: bool,
              cache=None, placement=None, moe_form: str | None = None):
    """`mtp_input` through the block -> (its output x [B, T, E], un-normed: the h of the next
    depth; cache). moe_form: how a sparse block's experts compute (None: by the pass's shape;
    training takes `moe.differentiable_form`)."""
    x = mtp_input(config, params, target, tokens, features, positions)
    return run_layer(config, params["layer"], target, x, positions, cache, placement, sparse=sparse,
                     moe_form=moe_form)


def mtp_logits(config: ModelConfig, params: dict, target: Model, x):
    """float32 logits [B, T, V] of the block's outputs x [B, T, E]: shared_head's norm, then
    its head (params' own copy where it differs from the target's, else the target's)."""
    h = _norm(config, params["head_norm"], x)
    if "head" in params:
        return head_read_out(target.config, params["head"]["kernel"].astype(h.dtype), h)
    return head_logits(target, h)


@functools.lru_cache(maxsize=64)
def mtp_shapes(config: ModelConfig, sparse: bool, head: bool = False, embedding: bool = False) -> dict:
    """The shapes of an Mtp's params for its block's config (`mtp_layer_config`), with its own
    head [E, V] and embedding [V, E] where it keeps them."""
    E, V = config.hidden_size, config.vocab_size
    norm = jax.tree.map(lambda w: tuple(w.shape), jax.eval_shape(
        lambda: Norm(config).init(jax.random.key(0), jnp.zeros((1, 1, E)))["params"]))
    layer = jax.eval_shape(lambda: init_layer(config, jax.random.key(0), sparse))
    out = {"enorm": norm, "hnorm": norm, "eh_proj": {"kernel": (2 * E, E)},
           "layer": jax.tree.map(lambda w: tuple(w.shape), layer), "head_norm": norm}
    if head:
        out["head"] = {"kernel": (E, V)}
    if embedding:
        out["embedding"] = (V, E)
    return out


@struct.dataclass
class Mtp(Eagle):
    """A multi-token-prediction layer as a drafter (see the module docstring). params:
    enorm, hnorm {scale [E]}, eh_proj {kernel [2E, E]}, layer (`Block(config, sparse)`'s),
    head_norm {scale [E]}, optional head {kernel [E, V]} and embedding [V, E] (its own
    copies, where they differ from the target's)."""

    sparse: bool = struct.field(pytree_node=False, default=False)  # its block's MLP is the experts
    name = "MTP"  # in messages

    @classmethod
    def init(cls, target: Model, key: jax.Array, tree: Tree | None = None, from_last_layer: bool = True) -> "Mtp":
        """A new MTP layer for target, float32, to train (`train_mtp`): its block a copy of the
        target's last layer where that layer is of the block's kind (dense or sparse) and
        from_last_layer, else random (normal(0.02)); eh_proj's embedding half random
        (normal(0.02)) and its hidden half the identity, so that it starts by passing the
        target's state on; enorm and hnorm unit, shared_head's norm a copy of the target's
        final norm; the target's own head and embedding (shared, as DeepSeek's are)."""
        t = target.config
        if t.family == "gpt2":
            raise ValueError("an MTP layer's norms are RMSNorms (the Llama and Gemma families'); GPT-2's are not")
        sparse = mtp_block_config(t, 1).sparse(t.num_layers)
        config = mtp_layer_config(t, sparse)
        E = t.hidden_size
        eh_key, layer_key = jax.random.split(key)
        f32 = lambda tree: jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), tree)  # noqa: E731
        if from_last_layer and t.sparse(t.num_layers - 1) == sparse:
            layer = f32(jax.device_get(target.params["layers"][-1]))
        else:
            layer = init_layer(config, layer_key, sparse)
        unit = Norm(config).init(key, jnp.zeros((1, 1, E)))["params"]
        eh = jnp.concatenate([normal_init(eh_key, (E, E), jnp.float32), jnp.eye(E, dtype=jnp.float32)])
        params = {"enorm": unit, "hnorm": unit, "eh_proj": {"kernel": eh}, "layer": layer,
                  "head_norm": f32(jax.device_get(target.params["final_norm"]))}
        return cls(params, config, trained.TargetSignature.of(target), tree, sparse)

    @classmethod
    def load(cls, path, tree: Tree | None = None, layer: int | None = None, dtype=None) -> "Mtp":
        """The MTP layer a target's folder (or hub id) ships: `layer` of its
        num_nextn_predict_layers (None: its only one; a folder of several asks which), its
        weights in dtype (default float32 on CPU, bfloat16 on TPU/GPU; they take the target's
        when used). Missing, unexplained or misshapen tensors raise CheckpointError naming them."""
        from specjax.folders import resolve
        from specjax.hf import read_mtp

        folder = resolve(path)
        config, n, params = read_mtp(folder, layer, dtype or default_dtype())
        k = 0 if layer is None else layer
        sparse = mtp_block_config(config, n).sparse(config.num_layers + k)
        signature = trained.TargetSignature(config.model_type, config.hidden_size, config.vocab_size, str(path))
        return cls(params, mtp_layer_config(config, sparse), signature, tree, sparse)

    def advance(self, target: Model, tokens, features, positions, cache=None, placement=None):
        """Its layer over pairs (`mtp_layer`): (outputs [B, T, E], the h passed on; cache)."""
        return mtp_layer(self.config, self.params, target, tokens, features, positions, self.sparse, cache,
                         placement)

    def read(self, target: Model, x):
        return mtp_logits(self.config, self.params, target, x)

    def bind(self, target: Model) -> "Mtp":
        """This layer for target: refused (ValueError) unless it was made for its shape (its
        model_type, width and vocabulary, then every weight's shape); its weights in the
        target's dtype."""
        self.signature.check(target, self.name)
        config = mtp_layer_config(target.config, self.sparse and target.config.moe is not None)
        want = None if self.sparse and config.moe is None else self.param_shapes(config)
        if want != jax.tree.map(lambda w: tuple(w.shape), self.params):
            raise ValueError(f"this {self.name} layer's weights do not match the target's sizes (heads, latent "
                             f"ranks, MLP or expert widths, norms): it was made for another target")
        return self.replace(config=config, params=jax.tree.map(lambda w: _as(w, target.dtype), self.params))

    def param_shapes(self, config: ModelConfig) -> dict:
        return mtp_shapes(config, self.sparse, "head" in self.params, "embedding" in self.params)

    def save(self, path):
        """Writes this layer into the target's folder `path` (config.json + safetensors) as
        DeepSeek ships one: its tensors, model.layers.{L}.* (`layouts.mtp_layout`, with
        shared_head.head and embed_tokens copies of the target's where it has none of its
        own), in mtp.safetensors in the dtype of the folder's embedding; config.json's
        num_nextn_predict_layers set to 1 (and a shard index, if the folder has one, told
        the new file). Refused where the folder holds another target or declares MTP layers
        already. Returns the folder."""
        from safetensors.numpy import save_file

        from specjax.hf import CheckpointError, _canonical, _read_hf_config, _umask, declared_mtp_layers, read_sources

        folder = Path(path)
        hf = _read_hf_config(folder)
        config = ModelConfig.from_hf_config(hf)
        theirs = (config.model_type, config.hidden_size, config.vocab_size)
        mine = (self.signature.model_type, self.signature.hidden_size, self.signature.vocab_size)
        if theirs != mine:
            raise ValueError(f"{folder} holds another target: (model_type, hidden_size, vocab_size) {theirs}, this "
                             f"MTP layer's {mine}")
        if declared_mtp_layers(hf):
            raise CheckpointError(f"{folder}/config.json declares {declared_mtp_layers(hf)} MTP layer(s) already; "
                                  f"save into a folder of the target without them")
        L = config.num_layers
        if mtp_block_config(config, 1).sparse(L) != self.sparse:
            raise ValueError(f"this MTP layer's MLP is {'sparse' if self.sparse else 'dense'}, but the target's "
                             f"config makes its layer {L} the other kind, which is what a loader builds")
        params = jax.tree.map(lambda w: np.asarray(jax.device_get(w)), dict(self.params))
        sources = {_canonical(n, config): t for n, t in read_sources(folder).items()}
        embedding_name = "model.embed_tokens.weight"
        stored = sources[embedding_name]
        dtype = stored.dtype
        if "embedding" not in params:
            params["embedding"] = np.asarray(stored.array())
        if "head" not in params:
            head = sources[embedding_name if config.tie_word_embeddings else "lm_head.weight"]
            params["head"] = {"kernel": np.asarray(head.array()).T}
        tensors = {}
        for w in mtp_layout(config, 1, embedding=True):
            for i in w.indices(L + 1):
                tensors.update(zip(w.names(i), w.to_hf(tuple(_get(params, p) for p in w.paths))))
        tensors = {k: np.ascontiguousarray(np.asarray(v).astype(dtype)) for k, v in tensors.items()}
        for t in sources.values():
            t.close()
        save_file(tensors, str(folder / MTP_FILE), metadata={"format": "pt"})
        os.chmod(folder / MTP_FILE, 0o666 & ~_umask())
        index = folder / "model.safetensors.index.json"
        if index.exists():
            record = json.loads(index.read_text())
            record.setdefault("weight_map", {}).update({name: MTP_FILE for name in tensors})
            index.write_text(json.dumps(record, indent=2) + "\n")
        hf["num_nextn_predict_layers"] = 1
        (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        return folder


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree
