"""Published EAGLE-3 heads (Li et al., 2025) as their authors' code runs them: the drafters
on the Hugging Face hub trained with SafeAILab/EAGLE, SGLang's SpecForge or Red Hat's
`speculators` (their folders are read by formats.py and written by export.py); and
published EAGLE-1/2 heads (`PublishedEagle`, at the end).

specjax's own `Eagle3` (eagle3.py) is another architecture: it projects [normed embedding,
normed feature] through a matrix of its own into a standard pre-norm layer. A published
head has no such matrix. At position t, with g_t the fused feature (the target's three
layer states through `fc`, or the head's own output one step up the chain):

    a = [input_layernorm(embedding of token t+1), hidden_norm(g_t)]       # [2E]
    x = r + o_proj(attention(q_proj(a), k_proj(a), v_proj(a)))            # r = g_t, or hidden_norm(g_t)
    x = x + mlp(post_attention_layernorm(x))                             # fed back as g
    logits = lm_head(norm(x))                                            # over its Vd draft ids

(SafeAILab/EAGLE cb7e084 eagle/model/cnets.py `Model.forward`, `LlamaDecoderLayeremb`;
speculators c05b95b models/eagle3/core.py; SpecForge a6b6b02 modeling/draft/llama3_eagle.py.)
r is hidden_norm(g_t) where `norm_before_residual` (speculators' option); speculators'
`norm_output` feeds the normed x back (`Layout.feed_normed`); SpecForge's `norm_output:
false` reads x out without the norm (`Layout.out_norm`); speculators' `norm_before_fc` and
SpecForge's and speculators' `fc_norm` norm the target's features before `fc` (params
`input_norm`, `fc_norm`). Draft id i is target id i + d2t[i] (`vocab`).

The layer's family, sizes, norm epsilon and rotary base are the head's own config's (EAGLE's
templates carry no rope_theta: base 10000 whatever the target's), kept through `bind`,
which checks only what the head reads of its target: its hidden size, its vocabulary and
the layers it taps. Drafting is Eagle's (eagle.py): the cache, the re-fed pairs, chains and
trees. This module knows the computation and its shapes, nothing of files.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.backend import Backend
from specjax.config import ModelConfig
from specjax.drafters import trained
from specjax.drafters.eagle import Eagle, _as, eagle_layer, layer_config, run_layer
from specjax.drafters.eagle3 import Eagle3
from specjax.drafters.vocab import check_vocab, head_columns
from specjax.models import Model, head_logits
from specjax.models.layers import Norm
from specjax.models.layers import init as normal_init
from specjax.models.transformer import Block, embed_tokens, pass_view, rotary_tables
from specjax.models.transformer import read_out as head_read_out
from specjax.tree import Tree


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the published heads' writers compute differently (see the module docstring).
    source: the format it was read from ("eagle", "specforge", "speculators"), for messages
    and as `save`'s default."""

    norm_before_residual: bool = False
    feed_normed: bool = False
    out_norm: bool = True
    source: str = "eagle"


def _norm(config: ModelConfig, scale, x, dim: int | None = None):
    return Norm(config, dim).apply({"params": {"scale": scale.astype(x.dtype)}}, x)


@struct.dataclass
class PublishedEagle3(Eagle3):
    """A published EAGLE-3 head (see the module docstring). params: fuse {kernel [nEt, E]},
    optional input_norm {scale [nEt]} and fc_norm {scale [n, Et]}, norms {token, feature,
    out} ({scale [E]} each), layer (`Block(attn_norm=False, attn_in_size=2E)`'s: q, k and v
    over 2E), optional head {kernel [E, Vd]} (None: the target's head), optional embedding
    [V, E] (its own, where it differs from the target's)."""

    layout: Layout = struct.field(pytree_node=False, default=Layout())
    name = "EAGLE-3 (published)"  # in messages

    @classmethod
    def init(cls, target: Model, key: jax.Array, tree: Tree | None = None, feature_layers: tuple | None = None,
             vocab=None, layout: Layout = Layout(source="speculators")) -> "PublishedEagle3":
        """Random weights (normal(0.02), unit norms), float32, for specjax to train
        (`specjax train-eagle --eagle3 --published`): a layer of the target's family and
        sizes; taps feature_layers (hidden_states indices, 1..L-1; None: 2, L/2, L-3); with
        vocab (target ids, sorted), a head of its own over them, else over the whole
        vocabulary, both started from the target's rows. Saved in speculators' format by
        default, which vLLM serves."""
        t = target.config
        if t.family != "llama":
            raise ValueError(f"a published EAGLE-3 head's layer is of the Llama family (llama, mistral, qwen2, "
                             f"qwen3); the target's is {t.model_type}")
        layers = tuple(sorted(feature_layers or default_taps(t.num_layers)))
        if min(layers) < 1 or max(layers) >= t.num_layers or len(set(layers)) < len(layers):
            raise ValueError(f"a published EAGLE-3 head taps distinct hidden_states 1..{t.num_layers - 1} (the "
                             f"inputs of those layers), got {list(layers)}")
        config = layer_config(t)
        E = config.hidden_size
        shapes = published_shapes(config, len(layers), E, None)
        fuse_key, layer_key = jax.random.split(key)
        leaves, treedef = jax.tree.flatten(shapes["layer"], is_leaf=lambda x: isinstance(x, tuple))
        keys = jax.random.split(layer_key, len(leaves))
        def start(k, shape, path):  # unit norms, zero biases, normal(0.02) kernels
            if "norm" in path:
                return jnp.ones(shape, jnp.float32)
            return jnp.zeros(shape, jnp.float32) if "bias" in path else normal_init(k, shape, jnp.float32)

        layer = jax.tree.unflatten(treedef, [start(k, shape, path)
                                             for k, shape, path in zip(keys, leaves, _paths(shapes["layer"]))])
        ids = None if vocab is None else np.sort(check_vocab(vocab, t.vocab_size))
        params = {"fuse": {"kernel": normal_init(fuse_key, (len(layers) * E, E), jnp.float32)},
                  "norms": {k: {"scale": jnp.ones((E,), jnp.float32)} for k in ("token", "feature", "out")},
                  "layer": layer,
                  "head": {"kernel": head_columns(target, np.arange(t.vocab_size) if ids is None else ids)}}
        return cls(params, config, trained.TargetSignature.of(target), tree, layers,
                   None if ids is None else jnp.asarray(ids, jnp.int32), layout)

    @property
    def attn_in_size(self) -> int:
        return 2 * self.config.hidden_size

    def fused(self, features, params=None):
        """The target's concatenated layer states [B, T, nEt] -> g [B, T, E] (`fc`, after the
        feature norms the head has)."""
        p, c = params or self.params, self.config
        if "input_norm" in p:
            features = _norm(c, p["input_norm"]["scale"], features, features.shape[-1])
        if "fc_norm" in p:
            scale = p["fc_norm"]["scale"]  # [n, Et]
            n, Et = scale.shape
            chunks = features.reshape(*features.shape[:-1], n, Et)
            chunks = jax.vmap(lambda s, x: _norm(c, s, x, Et), in_axes=(0, -2), out_axes=-2)(scale, chunks)
            features = chunks.reshape(*features.shape)
        return features @ p["fuse"]["kernel"].astype(features.dtype)

    def token_states(self, params: dict, target: Model, tokens, dtype):
        """tokens [B, T] -> input_layernorm(their embeddings) [B, T, E]."""
        emb = embed_tokens(target.config, params["embedding"] if "embedding" in params
                           else target.params["embedding"], tokens)
        return _norm(self.config, params["norms"]["token"]["scale"], emb.astype(dtype))

    def layer_input(self, params: dict, token_states, g):
        """-> (the residual: g, or hidden_norm(g) where norm_before_residual; what attention
        reads: input_layernorm(embedding) then hidden_norm(g), joined on the last axis,
        [B, T, 2E]) at g [B, T, F] (the target's states, F = nEt, fused first; or its own outputs)."""
        g = g if g.shape[-1] == self.config.hidden_size else self.fused(g, params)
        h = _norm(self.config, params["norms"]["feature"]["scale"], g)
        return (h if self.layout.norm_before_residual else g), jnp.concatenate([token_states, h], axis=-1)

    def layer_output(self, params: dict, target: Model, x):
        """The layer's outputs x [B, T, E] -> (float32 logits [B, T, Vd], the g fed back: x,
        or norm(x) where speculators' norm_output)."""
        fed = self._fed(params, x)
        return self._readout(params, target, fed), fed

    def _fed(self, params: dict, x):
        """What the layer's outputs x pass on (`advance`'s): norm(x) where norm_output, else x."""
        return _norm(self.config, params["norms"]["out"]["scale"], x) if self.layout.feed_normed else x

    def _readout(self, params: dict, target: Model, fed):
        """float32 logits of `_fed`'s states: normed first unless they are, or SpecForge's
        norm_output is false; read by its own head, else the target's."""
        if self.layout.out_norm and not self.layout.feed_normed:
            fed = _norm(self.config, params["norms"]["out"]["scale"], fed)
        if "head" in params:
            return head_read_out(target.config, params["head"]["kernel"].astype(fed.dtype), fed)
        return head_logits(target, fed)

    def advance(self, target: Model, tokens, features, positions, cache=None, placement=None):
        """tokens int32 [B, T] (token t+1 of each pair), features [B, T, F] (the target's, F =
        nEt, or its own outputs, F = E), positions [B, T] -> (outputs [B, T, E]: fed back as
        g, cache)."""
        p = self.params
        residual, a = self.layer_input(p, self.token_states(p, target, tokens, features.dtype), features)
        x, cache = run_layer(self.config, p["layer"], target, residual, positions, cache, placement,
                             attn_input=a, attn_norm=False, attn_in_size=self.attn_in_size)
        return self._fed(p, x), cache

    def read(self, target: Model, x):
        """float32 logits [B, T, Vd] over its draft vocabulary of its outputs x [B, T, E]
        (`advance`'s)."""
        return self._readout(self.params, target, x)

    def bind(self, target: Model) -> "PublishedEagle3":
        """This head for target, refused (ValueError naming what differs) unless target has
        the hidden size its `fc` reads, the vocabulary its ids index and the layers it taps;
        its weights in the target's dtype, its own embedding dropped where it equals the
        target's."""
        t = target.config
        layers = self.feature_layers or default_taps(t.num_layers)
        n, Et = len(layers), self.params["fuse"]["kernel"].shape[0] // len(layers)
        problems = []
        if Et != t.hidden_size:
            problems.append(f"its fc reads {n} target states of {Et}, the target's hidden size is {t.hidden_size}")
        if self.config.vocab_size != t.vocab_size:
            problems.append(f"its vocabulary has {self.config.vocab_size} ids, the target's {t.vocab_size}")
        if max(layers) >= t.num_layers:  # hidden_states[i], the input of layer i; [L] would be the normed output
            problems.append(f"it taps the target's hidden_states {list(layers)} (the inputs of those layers), the "
                            f"target has {t.num_layers} layers (0..{t.num_layers - 1})")
        if problems:
            raise ValueError(f"this {self.name} head ({self.signature.name or 'no target named'}) does not fit the "
                             f"target: {'; '.join(problems)}")
        params = dict(self.params)
        if "embedding" in params and _same_embedding(params["embedding"], target):
            del params["embedding"]  # what EAGLE's loader does: the target's, shared
        config = dataclasses.replace(self.config, max_position_embeddings=max(self.config.max_position_embeddings,
                                                                              t.max_position_embeddings))
        return self.replace(config=config, params=jax.tree.map(lambda w: _as(w, target.dtype), params),
                            feature_layers=layers)

    def param_shapes(self, config: ModelConfig) -> dict:
        n = len(self.feature_layers or (0, 0, 0))
        p = self.params
        return published_shapes(config, n, p["fuse"]["kernel"].shape[0] // n,
                                None if "head" not in p else p["head"]["kernel"].shape[1], "input_norm" in p,
                                "fc_norm" in p, "embedding" in p)

    def save(self, path, format: str | None = None):
        """Writes the head into the folder path in a published format: "speculators" (what
        vLLM reads), "eagle" (SafeAILab/EAGLE's, which SGLang reads) or "specforge"; None:
        the format it was read from. See formats.py."""
        from specjax.drafters.export import write_published

        return write_published(self, path, format or self.layout.source)


@struct.dataclass
class PublishedEagle(Eagle):
    """A published EAGLE-1/2 head (SafeAILab/EAGLE cnets1.py `Model`; EAGLE-2 changed only how
    it drafts): x = fc([embedding of token t+1, f_t]) (f_t: the target's final-normed state;
    fc with a bias unless its config says "bias": false), one decoder layer with no norm
    before its attention (its layer 0 has no input_layernorm), read out by the target's head
    without a norm. Its layer's family, sizes, epsilon and rotary base are its own config's
    (base 10000 where none is named), kept through `bind`. params: fc {kernel [2E, E], bias
    [E]}, layer (`Block(attn_norm=False)`'s), optional embedding [V, E] (its own copy, where
    it differs from the target's)."""

    name = "EAGLE (published)"

    def advance(self, target: Model, tokens, features, positions, cache=None, placement=None):
        return eagle_layer(self.config, self.params, target, tokens, features, positions, cache, placement,
                           attn_norm=False)

    def bind(self, target: Model) -> "PublishedEagle":
        """This head for target, refused (ValueError) unless target has its hidden size and
        vocabulary; its weights in the target's dtype, its own embedding dropped where it
        equals the target's."""
        t = target.config
        if (self.config.hidden_size, self.config.vocab_size) != (t.hidden_size, t.vocab_size):
            raise ValueError(f"this {self.name} head ({self.signature.name or 'no target named'}) was made for a "
                             f"target of hidden size {self.config.hidden_size} and {self.config.vocab_size} ids; "
                             f"this one has {t.hidden_size} and {t.vocab_size}")
        params = dict(self.params)
        if "embedding" in params and _same_embedding(params["embedding"], target):
            del params["embedding"]
        config = dataclasses.replace(self.config, max_position_embeddings=max(self.config.max_position_embeddings,
                                                                              t.max_position_embeddings))
        return self.replace(config=config, params=jax.tree.map(lambda w: _as(w, target.dtype), params))

    def param_shapes(self, config: ModelConfig) -> dict:
        return published_eagle_shapes(config, "embedding" in self.params)

    def save(self, path, format: str = "eagle"):
        """Writes the head into the folder path in EAGLE's format (config.json and
        model.safetensors; see formats.py), which formats.py reads back bit for bit."""
        from specjax.drafters.export import write_published_eagle

        return write_published_eagle(self, path, format)


@functools.lru_cache(maxsize=64)
def published_eagle_shapes(config: ModelConfig, embedding: bool = False) -> dict:
    """The shapes of a PublishedEagle's params for its layer config."""
    E = config.hidden_size
    x = jnp.zeros((1, 1, E), jnp.float32)
    positions = jnp.zeros((1, 1), jnp.int32)
    view = pass_view(config, positions, None, None, Backend("cpu"))
    layer = jax.eval_shape(lambda: Block(config, attn_norm=False).init(
        jax.random.key(0), x, rotary_tables(config, positions)[False], view, False)["params"])
    out = {"fc": {"kernel": (2 * E, E), "bias": (E,)}, "layer": jax.tree.map(lambda w: tuple(w.shape), layer)}
    if embedding:
        out["embedding"] = (config.vocab_size, E)
    return out


def _paths(tree: dict) -> list[str]:
    """The dotted paths of a shapes tree's leaves, in jax.tree order."""
    return [jax.tree_util.keystr(path) for path, _ in
            jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))[0]]


def default_taps(num_layers: int) -> tuple[int, ...]:
    """The target's hidden_states a head that names none taps: 2, L/2 and L-3, as EAGLE's
    code, vLLM and speculators take them (ValueError where those are not three layers)."""
    taps = (2, num_layers // 2, num_layers - 3)
    if len(set(taps)) < 3 or min(taps) < 1:
        raise ValueError(f"a published EAGLE-3 head that names no layers taps the target's hidden_states 2, L/2 "
                         f"and L-3, which for a target of {num_layers} layers are {list(taps)}: not three layers")
    return taps


def _same_embedding(embedding, target: Model) -> bool:
    theirs = target.params["embedding"]
    if not isinstance(theirs, jax.Array) or theirs.shape != embedding.shape:
        return False
    return bool(jnp.array_equal(jnp.asarray(embedding, theirs.dtype), theirs))


@functools.lru_cache(maxsize=64)
def published_shapes(config: ModelConfig, num_features: int, target_hidden: int, draft_vocab: int | None,
                     input_norm: bool = False, fc_norm: bool = False, embedding: bool = False) -> dict:
    """The shapes of a PublishedEagle3's params: its layer config, the number and width of
    the target states it fuses, its own head's vocabulary (None: none) and its options."""
    E = config.hidden_size
    x = jnp.zeros((1, 1, E), jnp.float32)
    positions = jnp.zeros((1, 1), jnp.int32)
    view = pass_view(config, positions, None, None, Backend("cpu"))
    layer = jax.eval_shape(lambda: Block(config, attn_norm=False, attn_in_size=2 * E).init(
        jax.random.key(0), x, rotary_tables(config, positions)[False], view, False, None, None,
        jnp.zeros((1, 1, 2 * E)))["params"])
    out = {"fuse": {"kernel": (num_features * target_hidden, E)},
           "norms": {k: {"scale": (E,)} for k in ("token", "feature", "out")},
           "layer": jax.tree.map(lambda w: tuple(w.shape), layer)}
    if input_norm:
        out["input_norm"] = {"scale": (num_features * target_hidden,)}
    if fc_norm:
        out["fc_norm"] = {"scale": (num_features, target_hidden)}
    if draft_vocab is not None:
        out["head"] = {"kernel": (E, draft_vocab)}
    if embedding:
        out["embedding"] = (config.vocab_size, E)
    return out


def draft_ids(d2t) -> np.ndarray:
    """EAGLE's d2t offsets int [Vd] -> the target id of each draft id, int32 [Vd]."""
    d2t = np.asarray(d2t, np.int64)
    return (np.arange(d2t.shape[0]) + d2t).astype(np.int32)
