"""`Model`: a config (static) and its params (leaves), one pytree that passes through jit.

This module knows how to run a model (`apply`, `forward`) and make a random one (`init`).
It does not know about files (see hf.py, checkpoint.py) or decoding (see generate.py), nor
where a program runs: whoever builds one binds its models to a `Backend` (`Model.on`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.backend import Backend
from specjax.cache import KVCache, Pending, Placement
from specjax.cache import commit as cache_commit
from specjax.config import GenerationConfig, ModelConfig
from specjax.models import exact
from specjax.models.attention import takes_kernels
from specjax.models.transformer import decode, init_params, read_out
from specjax.sampling import logprobs

# {"embedding", "layers": [one dict per layer], "final_norm", ...}: every weight its own
# array (see transformer.py for why layers are not stacked).
Params = Any
ATTENTION = ("auto", "portable", "kernels")  # Model.attention's choices


@struct.dataclass
class Model:
    config: ModelConfig = struct.field(pytree_node=False)
    params: Params
    # How the checkpoint asks to be decoded (stop ids, sampling defaults): what `load_model`
    # read from generation_config.json; None for models made otherwise. `generate` does not
    # read it (its arguments say everything); the `specjax generate` command does.
    generation_config: GenerationConfig | None = struct.field(pytree_node=False, default=None)
    # The logical-axis rules its params were placed by (`shard_model`, `load_model(mesh=...)`);
    # None: not sharded. Under a mesh, `generate` lays out this model's cache by them.
    rules: tuple | None = struct.field(pytree_node=False, default=None)
    # True: every pass computes each token by fixed-shape bodies (models/exact.py), so that
    # its bits do not depend on the pass; what `generate(deterministic=True)` sets.
    exact: bool = struct.field(pytree_node=False, default=False)
    # How its passes attend (static: part of every program's jit key). "kernels": where the
    # platform a program is built for has a fused kernel for a pass, it takes it (cuDNN and
    # the Pallas prefix kernel on a GPU, splash and the Pallas prefix kernel on a TPU:
    # models/attention.py says where each applies). "portable": the jnp path on every
    # platform. "auto" (the default): kernels where they have been measured on their
    # hardware at the code as it stands (attention.MEASURED_KERNELS), portable elsewhere. A
    # sharded program takes only the prefix kernel, under shard_map, and only with "kernels".
    attention: str = struct.field(pytree_node=False, default="auto")
    # Where the program it runs in runs (static): set by whoever builds that program
    # (`on`: generate, the engine, aot.py). None: not bound, traced for the default
    # backend's devices, unsharded (`Backend.default`), as `jax.jit` of it would run.
    backend: Backend | None = struct.field(pytree_node=False, default=None)

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(map(repr, ATTENTION))}, got {self.attention!r}")

    @property
    def dtype(self):
        return self.params["embedding"].dtype

    def on(self, backend: Backend) -> "Model":
        """The model bound to the backend of the program about to be built."""
        return self.replace(backend=backend)

    @property
    def runs_on(self) -> Backend:
        """Its backend: the one it is bound to, else the default backend's."""
        return self.backend or Backend.default()


def default_dtype():
    """float32 on CPU (bfloat16 is several times slower there), bfloat16 on TPU/GPU."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def cast(params: Params, dtype) -> Params:
    return jax.tree.map(lambda x: x.astype(dtype), params)


def init(config: ModelConfig, key: jax.Array, dtype=None) -> Model:
    """A randomly initialised model (normal(0.02) weights, unit norms, zero biases)."""
    return Model(config, cast(init_params(config, key), dtype or default_dtype()))


def apply(model: Model, tokens: jax.Array, positions: jax.Array, cache: KVCache | None = None,
          exit_layer: int | None = None, placement: Placement | None = None, taps: tuple | None = None,
          defer: bool = False):
    """tokens, positions int32 [B, T] -> (logits float32 [B, T, V], hidden [B, T, E], cache).

    exit_layer: run only the first exit_layer layers, then the final norm and head.
    placement: where the tokens go in the cache and what they see, when not "slot =
    position, causal" (a token tree; see cache.Placement).
    taps: None, or layer numbers (1..L) whose output states make `hidden` instead,
    concatenated: [B, T, len(taps) E] (EAGLE-3's features).
    defer: the caller writes the keys and values it keeps (a verification pass's accepted
    path): a fourth result holds them (`cache.Pending`; transformer.decode says which passes
    leave the cache unwritten)."""
    backend = model.runs_on
    if model.exact:
        return exact.decode(model.config, model.params, tokens, positions, cache, placement, num_layers=exit_layer,
                            taps=taps, defer=defer, flat=backend.platform == "cpu")
    return decode(model.config, model.params, tokens, positions, cache, placement, num_layers=exit_layer, taps=taps,
                  backend=backend, kernels=takes_kernels(model.attention, model.dtype, backend), rules=model.rules,
                  defer=defer)


def commit(model: Model, cache: KVCache, pending: Pending, kept: jax.Array, start: jax.Array) -> KVCache:
    """`cache.commit` (kept int32 [B, M] of a deferred pass's tokens to slots start[b] ..) of
    a pass of `model`, in the form its backend writes (`Backend.consecutive_writes`)."""
    return cache_commit(cache, pending, kept, start, consecutive=model.runs_on.consecutive_writes)


# Prompts longer than this are prefilled in chunks of this many tokens (one pass each,
# looped inside the caller's compiled program), so that no pass holds activations or masks
# for the whole prompt at once. A module constant so that tests can shrink it.
PREFILL_CHUNK = 512


def prefill(model: Model, tokens: jax.Array, cache: KVCache, return_hidden: bool = True,
            chunk: int | None = None, taps: tuple | None = None, start: jax.Array | None = None,
            score: int | None = None):
    """Writes tokens int32 [B, P] at positions start..start+P-1 of every row into the cache
    (start int32 [B], default 0: a row whose cache holds positions < start already, a cached
    prefix or earlier chunks, attends to them): one pass when P <= chunk (default
    PREFILL_CHUNK), else ceil(P / chunk) passes of `chunk` tokens in a `lax.scan`, each
    attending over the cache written so far. Returns (hidden [B, P, E] (the final-normed
    states, or the `taps`' states, as `apply` gives them) or None, cache), and with score=n
    (static) a third: each position's `Logprobs` of the next token (position i: tokens[:,
    i+1]'s raw log-probability, [B, P]; the last one's is of a pad) and the top n [B, P, n],
    reduced chunk by chunk (no [B, P, V] is held).

    The last chunk is right-padded with token 0 at positions P and on: their entries land
    at slots the caller treats as stale (or beyond the buffer, dropped), like the padding of
    a padded prompt. It does not touch cache.lengths and knows nothing about decoding."""
    B, P = tokens.shape
    C = int(chunk or PREFILL_CHUNK)
    if C < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {C}")
    first = jnp.zeros((B, 1), jnp.int32) if start is None else jnp.asarray(start, jnp.int32).reshape(B, 1)
    following = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))  # [B, P]: each position's next token

    def scored(logits, next_tokens):
        return None if score is None else logprobs(logits, next_tokens, None, score, "raw")

    if P <= C:
        positions = first + jnp.arange(P, dtype=jnp.int32)
        logits, hidden, cache = apply(model, tokens, positions, cache, taps=taps)
        out = ((hidden if return_hidden else None), cache)
        return out if score is None else out + (scored(logits, following),)
    n = -(-P // C)
    split = lambda x: jnp.pad(x, ((0, 0), (0, n * C - P))).reshape(B, n, C).transpose(1, 0, 2)  # noqa: E731 [n, B, C]

    def one(cache, xs):
        i, chunk_tokens, next_tokens = xs
        positions = first + i * C + jnp.arange(C, dtype=jnp.int32)  # [B, C]
        logits, hidden, cache = apply(model, chunk_tokens, positions, cache, taps=taps)
        return cache, ((hidden if return_hidden else None), scored(logits, next_tokens))

    cache, (hidden, scores) = jax.lax.scan(one, cache, (jnp.arange(n, dtype=jnp.int32), split(tokens),
                                                        split(following)))
    whole = lambda x: jnp.moveaxis(x, 0, 1).reshape((B, n * C) + x.shape[3:])[:, :P]  # noqa: E731 [n, B, C, ...]
    out = (whole(hidden) if return_hidden else None), cache
    return out if score is None else out + (jax.tree.map(whole, scores),)


def head_logits(model: Model, hidden: jax.Array) -> jax.Array:
    """The model's own read-out of final hidden states [..., E]: float32 logits [..., V]
    (its lm_head, or its embedding when tied; int8 or float; Gemma's soft-cap)."""
    tied = model.config.tie_word_embeddings
    return read_out(model.config, model.params["embedding" if tied else "lm_head"], hidden, transposed=tied)


@jax.jit
def _forward(model: Model, tokens: jax.Array) -> jax.Array:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return apply(model, tokens, positions)[0]


def forward(model: Model, tokens) -> jax.Array:
    """Full causal pass without a cache: tokens int [B, T] -> float32 logits [B, T, V].

    Right padding is harmless: a token never attends to positions after its own. Token ids
    are checked on the host as given, before any cast."""
    if not isinstance(tokens, jax.core.Tracer):
        tokens = np.asarray(jax.device_get(tokens))
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers, got {tokens.dtype}")
    c = model.config
    if tokens.shape[1] > c.max_position_embeddings:
        raise ValueError(f"{tokens.shape[1]} tokens exceed max_position_embeddings="
                         f"{c.max_position_embeddings}")
    check_token_ids(tokens, c.vocab_size)
    return _forward(model, jnp.asarray(tokens, jnp.int32))


def check_token_ids(tokens, vocab_size: int):
    """Raises if concrete token ids fall outside [0, vocab_size) (traced ids are not checked)."""
    if isinstance(tokens, jax.core.Tracer) or tokens.size == 0:
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got range [{lo}, {hi}]")
