"""EAGLE-3 (Li et al., 2025): EAGLE's one-layer drafter over features of three of the
target's layers, predicting tokens rather than features.

At position t it reads token t+1 and a feature g_t. At the root g_t is the target's own:
the residual stream after a low, a middle and a high layer (`feature_layers`), taken from
the verification pass itself (the loop asks the target for those states instead of its
final ones: `Drafter.feature_layers`), concatenated and fused by a learned projection
(fuse: [3E] -> [E]). Deeper, g is the drafter's own output at the previous position. Token
embedding and g are normed apart, concatenated and projected (fc: [2E] -> [E]); one
decoder layer of the target's family and shape follows; its output, normed by the
drafter's own norm, is read out by the target's frozen head as logits for token t+2, and
is the g of the node's children. Nothing asks the output to resemble a target feature:
training (train/heads.py) fits only the tokens, over several unrolled drafting steps
("training-time test": `unrolled`), so that a step learns from inputs like those it gets
when drafting deep.

Drafting is EAGLE's (eagle.py): the same cache, re-feeding of the kept tokens' pairs with
the target's features, and chains or trees grown by `base.grow`.

A reduced draft vocabulary (as EAGLE-3 has): `vocab`, the ids of the target tokens it may
draft (most often the corpus' most frequent: `draft_vocabulary`), and a head of its own
[E, Vd] over them (started from the target's rows for them, then trained) in place of the
target's [E, V]: a draft step reads Vd/V of the head's bytes, and drafts over those Vd
ids (`base.grow`); only its proposed nodes' distributions are spread back over the
target's vocabulary (0 at the tokens it cannot draft), so acceptance sees a distribution
over the target's ids as before: verification stays exact, and a token outside the set is
still emitted, as the target's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.cache import KVCache
from specjax.config import ModelConfig
from specjax.drafters import trained
from specjax.drafters.eagle import Eagle, format_shapes, layer_config, layer_from_record, run_layer, upgrade
from specjax.drafters.vocab import check_tree_fits, check_vocab, head_columns
from specjax.models import Model, head_logits
from specjax.models.layers import MLP, Attention, Norm, softcap
from specjax.models.layers import init as normal_init
from specjax.models.transformer import embed_tokens, init_layer, rotary_tables
from specjax.models.transformer import read_out as head_read_out
from specjax.tree import Tree


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high: layers 2, L/2 and L-3 as EAGLE-3 takes them (1, L/2 and L-1 for
    targets of fewer than 12 layers, where L-3 would sit in the middle)."""
    if num_layers >= 12:
        return 2, num_layers // 2, num_layers - 3
    return 1, max(1, num_layers // 2), max(1, num_layers - 1)


def _norm(config: ModelConfig, params, x):
    return Norm(config).apply({"params": params}, x)


def token_input(config: ModelConfig, params: dict, target: Model, tokens, dtype):
    """tokens [B, T] -> their embeddings (the target's), normed by the drafter: [B, T, E]."""
    emb = embed_tokens(target.config, target.params["embedding"], tokens).astype(dtype)
    return _norm(config, jax.tree.map(lambda w: w.astype(dtype), params["norms"]["token"]), emb)


def fused_input(config: ModelConfig, params: dict, token_states, features):
    """The layer's input [B, T, E] from `token_input` [B, T, E] and features [B, T, F]: the
    target's concatenated layer states (F = n E, fused first) or the drafter's own outputs
    (F = E)."""
    dtype = features.dtype
    if features.shape[-1] != config.hidden_size:
        features = features @ params["fuse"]["kernel"].astype(dtype)
    norm = jax.tree.map(lambda w: w.astype(dtype), params["norms"]["feature"])
    x = jnp.concatenate([token_states, _norm(config, norm, features)], axis=-1)
    return x @ params["fc"]["kernel"].astype(dtype) + params["fc"]["bias"].astype(dtype)


def draft_logits(config: ModelConfig, params: dict, target: Model, x):
    """float32 logits [B, T, Vd] of the layer's outputs x [B, T, E] over the draft
    vocabulary: its own norm, then its own head [E, Vd] if it has one (a reduced draft
    vocabulary), else the target's head (Vd = V)."""
    x = _norm(config, jax.tree.map(lambda w: w.astype(x.dtype), params["norms"]["out"]), x)
    if "head" in params:
        return head_read_out(target.config, params["head"]["kernel"].astype(x.dtype), x)
    return head_logits(target, x)


def eagle3_layer(config: ModelConfig, params: dict, target: Model, tokens, features, positions,
                 cache: KVCache | None = None, placement=None):
    """tokens int32 [B, T] (token t+1 of each pair), features [B, T, F] (g_t), positions [B, T]
    -> (the layer's outputs [B, T, E], cache)."""
    x = fused_input(config, params, token_input(config, params, target, tokens, features.dtype), features)
    return run_layer(config, params["layer"], target, x, positions, cache, placement)


def unrolled(drafter: "Eagle3", params: dict, target: Model, tokens, features, steps: int):
    """Training-time test: `steps` drafting steps over a whole sequence at once, as drafting
    would take them, for an Eagle3 (or a PublishedEagle3: the layer's inputs and read-out
    are the drafter's, `layer_input` and `layer_output`) with params. tokens int32 [B, T]
    (token t+1 at t), features [B, T, nE] (the target's, at t). Step 0 reads the target's
    features; step j reads at t the drafter's step j-1 output at t-1, and its query at t
    sees what it would see drafting j deep from the root t-j: the keys step 0 computed at
    positions <= t-j (the target's features) and the keys step i computed at t-j+i, i =
    1..j (its own chain). -> logits float32 [steps, B, T, Vd] over the draft vocabulary;
    at step j positions t < j have no root and are junk."""
    B, T = tokens.shape
    c = drafter.config
    p = params["layer"]
    attn = Attention(c, drafter.attn_in_size)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cos_sin = rotary_tables(c, positions)[False]
    t = jnp.arange(T)
    G, H, D = c.num_kv_heads, c.num_heads, c.head_dim
    R = H // G
    keys, values, outputs = [], [], []
    g = features
    token_states = drafter.token_states(params, target, tokens, features.dtype)  # the same at every step
    for j in range(steps):
        x, h = drafter.layer_input(params, token_states, g)  # the residual [B, T, E], what attention reads
        q, k, v = attn.apply({"params": p["attn"]}, h, cos_sin, target.runs_on.platform == "cpu",
                             method=Attention.project_qkv)
        keys.append(k)
        values.append(v)
        qg = q.reshape(B, T, G, R, D)
        # Step 0's keys at positions s <= t - j.
        s0 = jnp.einsum("btgrd,bsgd->bgrts", qg, keys[0], preferred_element_type=jnp.float32) * attn.scale
        s0 = jnp.where((t[None, :] <= t[:, None] - j), s0, -jnp.inf)
        # Step i's key at t - j + i (i = 1..j): one score per query, [B, G, R, T] each.
        index = [jnp.clip(t - j + i, 0, T - 1) for i in range(1, j + 1)]
        diag = [jnp.einsum("btgrd,btgd->bgrt", qg, keys[i][:, idx], preferred_element_type=jnp.float32) * attn.scale
                for i, idx in zip(range(1, j + 1), index)]
        scores = jnp.concatenate([s0] + [d[..., None] for d in diag], axis=-1)  # [B, G, R, T, T+j]
        if attn.cap is not None:
            scores = softcap(scores, attn.cap)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bgrts,bsgd->btgrd", probs[..., :T].astype(v.dtype), values[0])
        for n, (i, idx) in enumerate(zip(range(1, j + 1), index)):
            out = out + jnp.einsum("bgrt,btgd->btgrd", probs[..., T + n].astype(v.dtype), values[i][:, idx])
        x = x + attn.apply({"params": p["attn"]}, out.reshape(B, T, H, D), method=Attention.project_out)
        x = x + MLP(c).apply({"params": p["mlp"]}, _norm(c, p["mlp_norm"], x))
        logits, g = drafter.layer_output(params, target, x)
        outputs.append(logits)
        g = jnp.pad(g[:, :-1], ((0, 0), (1, 0), (0, 0)))  # the next step reads at t the output at t-1
    return jnp.stack(outputs)


@struct.dataclass
class Eagle3(Eagle):
    """EAGLE-3: Eagle's drafting over the target's `feature_layers` (see the module docstring)."""

    feature_layers: tuple = struct.field(pytree_node=False, default=None)
    vocab: jax.Array | None = None  # int32 [Vd]: the target ids it drafts (a reduced draft vocabulary)
    name = "EAGLE-3"  # in messages

    @classmethod
    def init(cls, target: Model, key: jax.Array, tree: Tree | None = None,
             feature_layers: tuple | None = None, vocab=None) -> "Eagle3":
        """Random weights (normal(0.02), unit norms, zero biases), float32; with vocab (target
        ids, e.g. `draft_vocabulary`), a head of its own over them (`with_vocab`)."""
        layers = tuple(feature_layers or default_feature_layers(target.config.num_layers))
        _check_layers(layers, target.config.num_layers)
        config = layer_config(target.config)
        E = config.hidden_size
        fuse_key, fc_key, layer_key = jax.random.split(key, 3)
        norm = Norm(config).init(key, jnp.zeros((1, 1, E)))["params"]
        params = {"fuse": {"kernel": normal_init(fuse_key, (len(layers) * E, E), jnp.float32)},
                  "norms": {"token": norm, "feature": norm, "out": norm},
                  "fc": {"kernel": normal_init(fc_key, (2 * E, E), jnp.float32), "bias": jnp.zeros((E,), jnp.float32)},
                  "layer": init_layer(config, layer_key)}
        drafter = cls(params, config, trained.TargetSignature.of(target), tree, layers)
        return drafter if vocab is None else drafter.with_vocab(target, vocab)

    def with_vocab(self, target: Model, vocab) -> "Eagle3":
        """This drafter speaking only the target ids vocab (distinct, in 0..V-1), through a
        head of its own: the target's head's rows for them (what it reads out with now,
        restricted), to be trained further or used as it is."""
        if self.vocab is not None:
            raise ValueError("this EAGLE-3 drafter already has a reduced draft vocabulary")
        self.signature.check(target, self.name)
        ids = np.sort(check_vocab(vocab, target.config.vocab_size))
        head = {"kernel": head_columns(target, ids)}
        return self.replace(params={**self.params, "head": head}, vocab=jnp.asarray(ids))

    def advance(self, target: Model, tokens, features, positions, cache=None, placement=None):
        return eagle3_layer(self.config, self.params, target, tokens, features, positions, cache, placement)

    # What `unrolled` (training) asks of the layer, for params being trained.
    attn_in_size = None  # the width its attention's q, k and v read (None: E)

    def token_states(self, params: dict, target: Model, tokens, dtype):
        """tokens [B, T] -> what the layer takes of them, the same at every unrolled step."""
        return token_input(self.config, params, target, tokens, dtype)

    def layer_input(self, params: dict, token_states, g):
        """-> (the residual stream [B, T, E], what the attention reads) at g [B, T, F]."""
        x = fused_input(self.config, params, token_states, g)
        return x, _norm(self.config, params["layer"]["attn_norm"], x)

    def layer_output(self, params: dict, target: Model, x):
        """The layer's outputs x [B, T, E] -> (float32 logits [B, T, Vd], the g fed back)."""
        return draft_logits(self.config, params, target, x), x

    def read(self, target: Model, x):
        """float32 logits [B, T, Vd] over its draft vocabulary (`draft_logits`)."""
        return draft_logits(self.config, self.params, target, x)

    @property
    def draft_vocab(self) -> jax.Array | None:
        return self.vocab

    def resolve(self, K: int | None) -> "Eagle3":
        drafter = super().resolve(K)
        check_tree_fits(drafter.tree, self.vocab, "EAGLE-3 drafter")
        return drafter

    def bind(self, target: Model) -> "Eagle3":
        _check_layers(self.feature_layers, target.config.num_layers)
        return super().bind(target)

    def param_shapes(self, config: ModelConfig) -> dict:
        return _shapes(config, len(self.feature_layers), None if self.vocab is None else self.vocab.shape[0])

    def save(self, path):
        """Writes drafter.safetensors and drafter.json into the folder path."""
        vocab = {} if self.vocab is None else {"draft_vocab": np.asarray(self.vocab).tolist()}
        return trained.save(path, "eagle3", self.params, self.signature,
                            {"layer": self.config.to_hf_config(), "feature_layers": list(self.feature_layers),
                             **vocab})

    @classmethod
    def from_record(cls, params, record, signature, tree, folder):
        from specjax.hf import CheckpointError

        record_file = folder / trained.RECORD
        layers = record.get("feature_layers")
        if not (isinstance(layers, list) and 1 <= len(layers) <= 16 and all(type(i) is int for i in layers)):
            raise CheckpointError(f"{record_file}: an EAGLE-3 record lists its target's feature layers (1 to 16 "
                                  f"ints) under \"feature_layers\"; it has {layers!r}")
        config = layer_from_record(params, record, signature, folder)
        vocab = record.get("draft_vocab")
        try:
            _check_layers(tuple(layers), 10**6)
            if vocab is not None:
                vocab = check_vocab(vocab, signature.vocab_size, ordered=True)
            want = _shapes(config, len(layers), None if vocab is None else len(vocab), record["format"])
        except (TypeError, ValueError, OverflowError) as e:
            raise CheckpointError(f"{record_file}: no EAGLE-3 drafter specjax can build ({e})") from None
        got = jax.tree.map(lambda w: tuple(w.shape), params)
        if got != want:
            raise CheckpointError(f"{folder / trained.WEIGHTS}: EAGLE-3 weights {got} do not match its record's "
                                  f"shapes {want}")
        params = upgrade(params, config, record["format"])
        return cls(params, config, signature, tree, tuple(layers), None if vocab is None else jnp.asarray(vocab))


def _check_layers(layers: tuple, num_layers: int):
    if not layers or not all(isinstance(i, int) and 1 <= i <= num_layers for i in layers):
        raise ValueError(f"EAGLE-3 feature layers must be layer numbers in 1..{num_layers} (the target's), "
                         f"got {layers!r}")


@functools.lru_cache(maxsize=64)
def _shapes(config: ModelConfig, num_features: int, draft_vocab: int | None = None,
            version: int = trained.FORMAT) -> dict:
    """The shapes of an Eagle3's params for a layer config, number of feature layers and
    reduced draft vocabulary's size (None: it reads out with the target's head), in a
    drafter file of format `version` (its layer's, as eagle.format_shapes)."""
    E = config.hidden_size
    norm = jax.eval_shape(lambda: Norm(config).init(jax.random.key(0), jnp.zeros((1, 1, E)))["params"])
    norm = jax.tree.map(lambda w: tuple(w.shape), norm)
    head = {} if draft_vocab is None else {"head": {"kernel": (E, draft_vocab)}}
    return {**format_shapes(config, version), "fuse": {"kernel": (num_features * E, E)},
            "norms": {"token": norm, "feature": norm, "out": norm}, **head}
