"""EAGLE (Li et al., 2024): a one-layer autoregressive drafter over the target's features.

At position t it reads the pair (embedding of token t+1, the target's final hidden state
f_t), fuses them (fc: [2E] -> [E]), runs one decoder layer of the target's family and
shape, and predicts f_{t+1}; the target's frozen head reads the prediction out as logits
for token t+2. Drafting deeper, the prediction stands in for the feature the target has
not computed yet. Embedding and head are the target's own (shared, never copied).

It keeps its own one-layer KV cache in the drafter's carry. Each step it re-feeds the pairs
of the tokens the last verification pass kept, with the target's real features for them
(`DraftRequest.features`: at most depth + 1 pairs, from position length_before - 1), which
overwrites whatever its own guesses left there, then grows a chain (sampled from its q)
or a `specjax.Tree` (EAGLE-2's dynamic tree, or a static one) with `base.grow`, passing
each node's predicted feature to its children. A row whose prompt is a single token has
no feature before its first pass, so nothing is drafted for it then.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from specjax.cache import KVCache
from specjax.config import ModelConfig
from specjax.hf_config import UnsupportedConfigError
from specjax.drafters import trained
from specjax.drafters.base import DraftRequest, Drafter, Resume, grow, grow_cache_length, shape_for
from specjax.layouts import from_layout2_layer, fuse_legacy_layer
from specjax.models import Model, head_logits
from specjax.models.attention import takes_kernels
from specjax.models.layers import init as normal_init
from specjax.models.transformer import Block, embed_tokens, init_layer, pass_view, rotary_tables
from specjax.tree import Tree


def _as(w, dtype):
    """A floating weight (an array, or a shape alone) in dtype; anything else as it is."""
    if not jnp.issubdtype(w.dtype, jnp.floating) or w.dtype == dtype:
        return w
    if isinstance(w, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(w.shape, dtype, sharding=w.sharding)
    return w.astype(dtype)


def layer_config(target: ModelConfig) -> ModelConfig:
    """The drafter's one layer: the target's family and sizes, full attention, a dense MLP
    (intermediate_size wide) where the target's are experts (as EAGLE-3 heads for MoE
    targets are trained). Latent attention (a DeepSeek-V3 target) is refused: its heads
    draft with the target's own MTP layer (`specjax.Mtp`)."""
    if target.mla is not None:
        raise UnsupportedConfigError(f"EAGLE heads for a {target.model_type} target (latent attention) are not "
                                     f"supported: draft with its MTP layer (specjax.Mtp, specjax.load_drafter of its "
                                     f"folder) or a draft model")
    return dataclasses.replace(target, num_layers=1, layer_types=None, sliding_window=None, moe=None)


def eagle_layer(config: ModelConfig, params: dict, target: Model, tokens, features, positions,
                cache: KVCache | None = None, placement=None, **block):
    """tokens int32 [B, T] (token t+1 of each pair), features [B, T, E] (f_t), positions [B, T]
    -> (predicted features [B, T, E] (f_{t+1}), cache). The embedding is the target's, or
    params' own where they hold one (a published head's); block: `Block`'s options."""
    dtype = features.dtype
    embedding = params["embedding"] if "embedding" in params else target.params["embedding"]
    x = jnp.concatenate([embed_tokens(target.config, embedding, tokens).astype(dtype), features], axis=-1)
    x = x @ params["fc"]["kernel"].astype(dtype) + params["fc"]["bias"].astype(dtype)
    return run_layer(config, params["layer"], target, x, positions, cache, placement, **block)


def eagle_step(config: ModelConfig, params: dict, target: Model, tokens, features, positions,
               cache: KVCache | None = None, placement=None):
    """`eagle_layer`, read out by the target's head: (logits float32 [B, T, V] for token t+2,
    predicted features [B, T, E], cache)."""
    x, cache = eagle_layer(config, params, target, tokens, features, positions, cache, placement)
    return head_logits(target, x), x, cache


def run_layer(config: ModelConfig, layer_params: dict, target: Model, x, positions, cache: KVCache | None = None,
              placement=None, attn_input=None, **block):
    """The drafter's one decoder layer over x [B, T, E] at positions [B, T], writing its
    one-layer cache (if given; a tree's nodes join its held tree) -> (x [B, T, E], cache).
    It attends as its target does: on the target's backend, taking kernels where the
    target's Model.attention does. Shared by EAGLE and EAGLE-3, and published heads (whose
    attention reads `attn_input` or an un-normed x: `Block`'s options, `block`)."""
    backend = target.runs_on
    # (No fused kernel takes latent attention's keys: its passes attend portably, as transformer.decode's.)
    kernels = takes_kernels(target.attention, x.dtype, backend) and config.mla is None
    view = pass_view(config, positions, cache, placement, backend, x.dtype if kernels else None)
    layer_params = jax.tree.map(lambda w: w.astype(x.dtype), layer_params)
    kv = None if cache is None else (cache.k[0], cache.v[0])
    held = None if view.offset is None else (cache.held_tree().k[0], cache.held_tree().v[0])
    x, kv, fresh = Block(config, **block).apply({"params": layer_params}, x, rotary_tables(config, positions)[False],
                                                view, False, kv, held, attn_input)
    if cache is not None:
        cache = cache.replace(k=(kv[0],), v=(kv[1],))
    if held is not None:
        cache = cache.with_tree(fresh[:1], fresh[1:])
    return x, cache


@struct.dataclass
class Eagle(Drafter):
    params: dict  # fc {kernel [2E, E], bias [E]}, layer (one decoder layer's weights)
    config: ModelConfig = struct.field(pytree_node=False)  # the one layer's
    signature: trained.TargetSignature = struct.field(pytree_node=False)
    tree: Tree | None = struct.field(pytree_node=False, default=None)  # None: a chain of K

    wants_features = True
    name = "EAGLE"  # in messages

    @classmethod
    def init(cls, target: Model, key: jax.Array, tree: Tree | None = None) -> "Eagle":
        """Random weights (normal(0.02), unit norms, zero biases), float32."""
        config = layer_config(target.config)
        E = config.hidden_size
        fc_key, layer_key = jax.random.split(key)
        fc = {"kernel": normal_init(fc_key, (2 * E, E), jnp.float32), "bias": jnp.zeros((E,), jnp.float32)}
        return cls({"fc": fc, "layer": init_layer(config, layer_key)}, config,
                   trained.TargetSignature.of(target), tree)

    def advance(self, target: Model, tokens, features, positions, cache=None, placement=None):
        """Its layer over pairs (`eagle_layer`): (outputs [B, T, E], the features passed on; cache)."""
        return eagle_layer(self.config, self.params, target, tokens, features, positions, cache, placement)

    def read(self, target: Model, x):
        """float32 logits [B, T, V] over the target's vocabulary of its outputs x [B, T, E]."""
        return head_logits(target, x)

    @property
    def draft_vocab(self) -> jax.Array | None:
        """The target ids `read`'s logits are over, int32 [Vd]; None: the whole vocabulary."""
        return None

    def resolve(self, K: int | None) -> "Eagle":
        return self.replace(tree=shape_for(self.tree, K, "sampled"))

    def bind(self, target: Model) -> "Eagle":
        """This drafter for target: refused unless it was made for its shape; its layer
        computes as the target's family does (the record keeps only what fixes shapes)."""
        self.signature.check(target, self.name)
        config = layer_config(target.config)
        if self.param_shapes(config) != jax.tree.map(lambda w: tuple(w.shape), self.params):
            raise ValueError(f"this {self.name} drafter's weights do not match the target's sizes (heads, "
                             f"head_dim, MLP width, biases, norms): it was made for another target")
        # Trained drafters keep float32 weights; cast once here, in the target's dtype, not inside
        # every draft step (where XLA converted them per step and a step read twice its bytes).
        return self.replace(config=config, params=jax.tree.map(lambda w: _as(w, target.dtype), self.params))

    def param_shapes(self, config: ModelConfig) -> dict:
        """The shapes its params must have for the layer config `config`."""
        return eagle_shapes(config)

    keeps_cache = True

    def start(self, target: Model, prompts, lengths, max_len, hidden=None, resume: Resume | None = None):
        """Its cache, filled with the prompt's pairs (hidden [B, P, E]: the prefill's states),
        or, resumed, the pairs at resume.positions (hidden: their states) in resume.cache.
        The pair at a prompt's last position has no next token yet (0: re-fed by `propose`)."""
        B, P = prompts.shape
        if resume is None:
            cache = KVCache.init(self.config, B, grow_cache_length(self.tree, max_len), hidden.dtype)
            positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
            next_tokens = jnp.pad(prompts[:, 1:], ((0, 0), (0, 1)))
        else:
            cache, positions = resume.cache, resume.positions
            next_tokens = jnp.take_along_axis(prompts, jnp.minimum(positions + 1, P - 1), axis=1)
            next_tokens = jnp.where(positions + 1 < lengths[:, None], next_tokens, 0)
        return self.advance(target, next_tokens, hidden, positions, cache)[1]

    def propose(self, cache, request: DraftRequest):
        f, length, target = request.features, request.length, request.target
        rows = jnp.arange(length.shape[0])[:, None]
        S = request.tokens.shape[1]

        def forward(cache, tokens, positions, placement=None, features=None):
            features, cache = self.advance(target, tokens, features, positions, cache, placement)
            return cache, self.read(target, features), features

        # Re-feed the kept tokens' pairs with the target's own features; slots from
        # length - 1 on get junk that the tree overwrites or no query sees. Only the root's
        # pair is read out.
        positions = jnp.maximum(f.start[:, None] + jnp.arange(f.hidden.shape[1])[None], 0)  # [B, D+1]
        next_tokens = request.tokens[rows, jnp.minimum(positions + 1, S - 1)]
        features, cache = self.advance(target, next_tokens, f.hidden, positions, cache)
        root = jnp.clip(length - 2 - f.start, 0)[:, None, None]  # the pair whose next token is the root
        features0 = jnp.take_along_axis(features, root, axis=1)  # [B, 1, E]
        logits0 = self.read(target, features0)[:, 0]
        cache, proposal = grow(forward, cache, logits0, length - 1, request, self.tree, features0[:, 0],
                               self.draft_vocab)
        return cache, request.target_cache, proposal.replace(valid=proposal.valid & (length >= 2)[:, None])

    def held(self, cache, tokens, length, features):
        """Below the last pass's first position (`features.start`): `propose` re-feeds the pairs
        from there with the target's own states; the tree it grew left its own past them."""
        return jnp.maximum(features.start, 0)

    def save(self, path):
        """Writes drafter.safetensors and drafter.json into the folder path."""
        return trained.save(path, "eagle", self.params, self.signature,
                            {"layer": self.config.to_hf_config()})

    @classmethod
    def from_record(cls, params, record, signature, tree, folder):
        from specjax.hf import CheckpointError

        record_file, weights_file = folder / trained.RECORD, folder / trained.WEIGHTS
        config = layer_from_record(params, record, signature, folder)
        try:
            want = format_shapes(config, record["format"])
        except (TypeError, ValueError, OverflowError) as e:  # values ModelConfig lets through, no layer has
            raise CheckpointError(f"{record_file}: its \"layer\" is no layer specjax can build ({e})") from None
        got = jax.tree.map(lambda w: tuple(w.shape), params)
        if got != want:
            raise CheckpointError(f"{weights_file}: EAGLE weights {got} do not match its layer's format "
                                  f"{record['format']} shapes {want}")
        params = upgrade(params, config, record["format"])
        return cls(params, config, signature, tree)


def layer_from_record(params, record, signature, folder) -> ModelConfig:
    """The one layer's config from a drafter record's "layer", checked against its target's
    signature and its weights' sizes (CheckpointError names what is wrong)."""
    from specjax.hf import CheckpointError

    record_file = folder / trained.RECORD
    layer = record.get("layer")
    if not isinstance(layer, dict):
        raise CheckpointError(f"{record_file}: a record keeps its layer's config (an object) under "
                              f"\"layer\"; it has {'none' if layer is None else type(layer).__name__}")
    try:
        config = ModelConfig.from_hf_config(layer)
    except ValueError as e:
        raise CheckpointError(f"{record_file}: its \"layer\" is refused: {e}") from None
    mine = (config.num_layers, config.model_type, config.hidden_size, config.vocab_size)
    if mine != (1, signature.model_type, signature.hidden_size, signature.vocab_size):
        raise CheckpointError(f"{record_file}: its \"layer\" must be one layer of its target's model_type, "
                              f"hidden_size and vocab_size; it has (layers, model_type, hidden_size, "
                              f"vocab_size) {mine}")
    # Sizes no tensor holds are refused before the layer's shapes are worked out from them.
    sizes = {n: getattr(config, n) for n in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                             "intermediate_size")}
    if max(sizes.values()) > max((w.size for w in jax.tree.leaves(params)), default=0):
        raise CheckpointError(f"{record_file}: its \"layer\" has sizes {sizes}, one larger than any tensor in "
                              f"{trained.WEIGHTS}")
    return layer_config(config)


@functools.lru_cache(maxsize=64)
def eagle_shapes(config: ModelConfig) -> dict:
    """The shapes of an Eagle's params for a layer config."""
    E = config.hidden_size
    layer = jax.eval_shape(lambda: init_layer(config, jax.random.key(0)))
    return {"fc": {"kernel": (2 * E, E), "bias": (E,)}, "layer": jax.tree.map(lambda w: tuple(w.shape), layer)}


def format_shapes(config: ModelConfig, version: int) -> dict:
    """The shapes of an Eagle's params in a drafter file of format `version`: 3, today's;
    2, qkv_kernel [E, G, R+2, D] and gate_up_kernel [E, 2, F]; 1, q/k/v and gate/up kernels
    and biases apart ([E, H|G, D], [E, F]), as `fuse_legacy_layer` reads them."""
    shapes = eagle_shapes(config)
    if version == trained.FORMAT:
        return shapes
    E, F, G, H, D = config.hidden_size, config.intermediate_size, config.num_kv_heads, config.num_heads, config.head_dim
    attn, mlp = dict(shapes["layer"]["attn"]), dict(shapes["layer"]["mlp"])
    if version == 2:
        attn["qkv_kernel"] = (E, G, H // G + 2, D)
        if "gate_up_kernel" in mlp:
            mlp["gate_up_kernel"] = (E, 2, F)
    else:
        for kind, lead in (("kernel", (E,)), ("bias", ())):
            if f"qkv_{kind}" in attn:
                del attn[f"qkv_{kind}"]
                attn.update({f"q_{kind}": (*lead, H, D), f"k_{kind}": (*lead, G, D), f"v_{kind}": (*lead, G, D)})
            if f"gate_up_{kind}" in mlp:
                del mlp[f"gate_up_{kind}"]
                mlp.update({f"gate_{kind}": (*lead, F), f"up_{kind}": (*lead, F)})
    return {**shapes, "layer": {**shapes["layer"], "attn": attn, "mlp": mlp}}


def upgrade(params: dict, config: ModelConfig, version: int) -> dict:
    """An Eagle's (or Eagle3's) params read from a drafter file of format `version`, with
    their layer in today's layout (as they are, where the file is of today's format)."""
    if version == trained.FORMAT:
        return params
    layer = fuse_legacy_layer(params["layer"], config) if version == 1 else from_layout2_layer(params["layer"])
    return {**params, "layer": jax.tree.map(jnp.asarray, layer)}
