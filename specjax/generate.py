"""The decoding loop: autoregressive and speculative, one machinery, one `lax.while_loop`.

Invariant at the top of every step: row b holds `length[b]` final tokens in `tokens`; the
target's cache holds correct entries for positions < length[b] - 1 (the last token is in
no cache yet); entries at or beyond that are stale and masked by position, never cleared.

One step, all shapes fixed:
  1. the drafter proposes a token tree per row (a chain of K drafts is the tree where each
     node has one child): N tokens, their parents, which were proposed, and the
     distributions q they were drawn from (None when deterministic);
  2. the target scores [last token, the N nodes] in one pass, node i at position
     length-1+depth(i), written at slot length-1+i and seeing the prefix, its ancestors
     and itself; p is its warped distribution at all N+1 of them. A drafter may add a
     `Branch` of tokens to the same pass (after the nodes, under its own mask, unseen by
     them); it gets the target's logits for those back through `observe`;
  3. `acceptance.accept` walks each row's tree: it keeps the longest path the target
     agrees with (n nodes) and draws one token of the target's own;
  4. those n+1 tokens are written at each row's own offset and length += n+1 (cut at EOS
     and at max_new_tokens); the accepted path's keys/values move to the slots of their
     positions (nothing moves for a chain: its nodes are already there). Rolling back the
     rest of the tree is only this: its entries are now beyond length-1, stale and masked;
  5. a row that emitted EOS or reached max_new_tokens is done: its state is frozen under
     masks while the other rows go on, and drafters are told. The loop ends when every
     row is done.
Autoregressive decoding is the same step with an empty tree and no drafter.

The loop knows drafters only through the interface in `specjax.drafters`, and nothing of
tokenizers or files.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import io_callback

from specjax import acceptance, memory, sharding, theory
from specjax.cache import KVCache, move, tree_placement
from specjax.drafters import DraftModel, DraftRequest, Lookahead, Proposal
from specjax.drafters.base import Features, verify_room
from specjax.drafters.model import check_vocabularies
from specjax.models import Model, apply, check_token_ids, layers, prefill
from specjax.sampling import Sampling, validate, warp
from specjax.tree import Tree, ancestors, depths, with_branch


@struct.dataclass
class Stats:
    steps: jax.Array  # int32 [B]: target verification passes the row took part in
    drafted: jax.Array  # int32 [B]: draft tokens proposed to the row
    accepted: jax.Array  # int32 [B]: draft tokens accepted and emitted in the row


@struct.dataclass
class GenerateOutput:
    tokens: jax.Array  # int32 [B, max_new_tokens]: new tokens only; 0 after num_tokens[b]
    num_tokens: jax.Array  # int32 [B]: tokens generated, an emitted EOS included
    stats: Stats
    # int32 [B, max_new_tokens]: tokens each step emitted per row (0 once the row is done);
    # None unless generate(..., return_trace=True).
    trace: jax.Array | None = None


@struct.dataclass
class LoopState:
    tokens: jax.Array  # int32 [B, S]: prompt then generated tokens; slots >= length are junk
    length: jax.Array  # int32 [B]: final tokens per row (prompt + generated)
    target_cache: KVCache  # L x [B, S, G, D]; valid below length - 1
    draft_state: Any  # the drafter's own carry (e.g. its KV cache); None without a drafter
    k_limit: jax.Array  # int32 [B]: how deep each row may draft next step (the depth unless adaptive)
    done: jax.Array  # bool [B]: row emitted EOS or reached max_new_tokens; frozen since
    key: jax.Array  # PRNG key, split once per step
    stats: Stats
    step: jax.Array  # int32 []: steps taken
    trace: jax.Array | None  # int32 [B, max_new_tokens] tokens emitted per step, if asked for
    features: Features | None = None  # the target's hidden states, for drafters that want them


MIN_PROMPT_BUCKET = 64  # pad_prompts' default: powers of two from this up
CACHE_MULTIPLE = 128  # caches of at least this many slots are rounded up to a multiple of it
SHORT_CACHE_MULTIPLE = 16  # shorter ones (tiny tests, short prompts) to a multiple of this


def pad_prompts(prompts: Sequence[Sequence[int]], bucket: int | None = None):
    """Right-pads token-id lists so that prompts of different lengths share one compilation:
    by default to the next power of two of at least MIN_PROMPT_BUCKET (64, 128, ..., so
    prompts of 1 to 8,192 tokens need at most 8 programs per batch size); with `bucket`, to
    a multiple of it instead. Returns (int32 [B, P], int32 [B])."""
    if len(prompts) == 0:
        raise ValueError("pad_prompts needs at least one prompt")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError(f"prompt {int(lengths.argmin())} is empty; every prompt needs at least one token")
    longest = int(lengths.max())
    if bucket is None:
        P = max(MIN_PROMPT_BUCKET, 1 << (longest - 1).bit_length())
    else:
        if not isinstance(bucket, (int, np.integer)) or bucket < 1:
            raise ValueError(f"bucket must be an int >= 1 or None, got {bucket!r}")
        P = -(-longest // bucket) * bucket
    out = np.zeros((len(prompts), P), np.int32)
    for b, p in enumerate(prompts):
        out[b, : len(p)] = p
    return out, lengths


def cache_length(P: int, max_new_tokens: int, room: int) -> int:
    """The loop's cache length S for prompts [B, P]: P + max_new_tokens + room (a drafter's
    furthest write), rounded up to a multiple of CACHE_MULTIPLE (SHORT_CACHE_MULTIPLE below
    it) so that key blocks and hardware tiles divide it."""
    S = P + max_new_tokens + room
    m = CACHE_MULTIPLE if S >= CACHE_MULTIPLE else SHORT_CACHE_MULTIPLE
    return -(-S // m) * m


def generate(target: Model, prompts, lengths, draft=None, key=None, max_new_tokens: int = 64,
             num_draft_tokens: int | str | None = None, temperature=0.0, top_k=0, top_p=1.0,
             eos_token_id: int | Sequence[int] | None = None, return_trace: bool = False,
             adaptive_k: bool = False, draft_threshold=0.0, mesh=None, rules=None,
             stream: Callable | None = None, cost_profile=None, deterministic: bool = False) -> GenerateOutput:
    """Generates up to max_new_tokens per row; exactly the target's own output distribution.

    target: a `Model`. prompts int [B, P] right-padded, lengths int [B] (see `pad_prompts`).
    draft: None (plain autoregressive decoding), a draft `Model`, or a drafter
        (`specjax.DraftModel`, `specjax.EarlyExit`, `specjax.PromptLookup`, or anything with
        their interface).
    num_draft_tokens: K, the length of a drafter's chain (default 4). A drafter given a
        `specjax.Tree` proposes that tree instead: leave it unset (a different K is an error).
        "auto": the static K for this batch size, chosen on the host before compiling by
        `specjax.theory.choose_num_draft_tokens` from `cost_profile` (a `CostProfile`, a
        profile.json path written by `specjax bench --profile`, or None: the profile
        shipped for this JAX backend); K = 0 turns speculation off (plain decoding). A
        drafter with a dynamic Tree(depth, top_k, nodes): its node budget, at most `nodes`,
        by `theory.choose_tree_nodes` (see `auto_shape`).
    Shapes, the tree, K and max_new_tokens are static; the key, temperature, top_k, top_p
    and eos_token_id are traced, so changing them never recompiles.
    eos_token_id: None, one stop id or several (a row stops after the first of any, as in
        transformers). They travel as int32 [N] padded with -1 to a multiple of 4: lists of
        1-4 ids share one compilation, 5-8 another, and so on.
    return_trace: also return the tokens each step emitted per row (GenerateOutput.trace);
    off, it costs nothing.
    adaptive_k: move each row's draft depth between 1 and K (the tree's depth) by its last
        step (+2 when the deepest proposed node was accepted, -1 otherwise: transformers'
        heuristic schedule), on the device.
    draft_threshold: a model drafter stops a row's drafting once its own confidence (max
        probability at temperature 1) falls below this (traced; 0 drafts all K).
    mesh, rules: a `specjax.make_mesh` mesh (and optional logical-axis rules): rows go over
        `data`, caches' heads over `model`, as the models' params are (see shard_model).
    stream: a function called on the host after every step, from inside the compiled loop
        (an ordered io_callback), as stream(tokens int32 [B, K+1], counts int32 [B]): row b
        gained tokens[b, :counts[b]] (0 for finished rows), so the calls concatenated per row
        are exactly out.tokens[b, :out.num_tokens[b]]. Streaming calls compile once whatever
        the function; None leaves the callback out of the program. With a stream, generate
        returns only once the loop has finished (and its calls have all been made); with a
        mesh, the calls happen in the process that holds the first device.
    deterministic: the target computes every token by fixed-shape bodies whose bits do not
        depend on the pass (models/exact.py), so that greedy output equals greedy plain
        decoding with the flag bit for bit in any dtype, for every drafter, K and tree, and
        a row's output does not depend on the rest of its batch. Slower (measured in
        docs/bench/exact.txt); CPU only for now, where it is verified; refused with a mesh.
    """
    args, static, stream = _prepare(**locals())
    memory.check_fits(args, static, stream)  # refuses, with the numbers, what cannot fit
    return _run(args, static, stream)


def compile_generate(target: Model, prompts, lengths, **kwargs) -> Callable[[], GenerateOutput]:
    """`generate` compiled ahead of time for these arguments (the same as generate's):
    returns a function of no arguments that runs it, without compiling. Timing this call
    times compilation alone."""
    bound = inspect.signature(generate).bind(target, prompts, lengths, **kwargs)
    bound.apply_defaults()
    args, static, stream = _prepare(**bound.arguments)
    memory.check_fits(args, static, stream)
    handle = None if stream is None else jnp.int32(0)
    executable = _generate.lower(*args, **static, stream=handle).compile()
    return lambda: _run(args, {}, stream, executable)


def auto_shape(batch: int, draft, cost_profile=None, max_new_tokens: int = 64, backend: str | None = None):
    """num_draft_tokens="auto": (draft, num_draft_tokens) for this batch size and output
    length from the cost profile. A chain gets its K; a drafter with a dynamic
    Tree(depth, top_k, nodes) gets the same tree with the node budget chosen among those the
    profile measured for that family, up to `nodes`. Where speculation loses: (None, None),
    plain decoding.

    Without a cost_profile on a backend (default: JAX's) for which specjax ships none (only
    CPU's is measured; see specjax/profiles), the choice is the conservative one: plain
    decoding, which is never slower, with a warning saying how to measure a profile. On a GPU
    a draft step of a small pair costs about as much as a target pass (the step is bound by
    kernel launches: docs/bench/gpu), so no K can be assumed to pay there."""
    if draft is None:
        raise ValueError("num_draft_tokens='auto' needs a draft (there is nothing to speculate with)")
    backend = backend or jax.default_backend()
    profile = theory.resolve_profile(cost_profile, backend)
    if profile is None:
        warnings.warn(f"num_draft_tokens='auto': specjax ships no cost profile for the {backend!r} backend, so "
                      f"speculation stays off here (plain decoding, never slower). Measure one on this machine "
                      f"with `specjax bench --profile` and pass cost_profile=PATH", stacklevel=3)
        return None, None
    if isinstance(draft, Lookahead):
        raise ValueError("num_draft_tokens='auto' does not choose Lookahead's shape (window, ngram and guesses "
                         "set it): leave num_draft_tokens unset")
    tree = getattr(draft, "tree", None)
    if tree is None:
        K = theory.choose_num_draft_tokens(profile, int(batch), max_new_tokens=int(max_new_tokens))
        return (draft, K) if K else (None, None)
    if tree.is_static:
        raise ValueError("num_draft_tokens='auto' picks a node budget for a dynamic Tree(depth, top_k, nodes), "
                         "but a static tree (Tree.from_paths) fixes its shape: leave num_draft_tokens unset")
    nodes = theory.choose_tree_nodes(profile, tree.depth, tree.top_k, int(batch), tree.nodes,
                                     max_new_tokens=int(max_new_tokens))
    return (draft.replace(tree=Tree(tree.depth, tree.top_k, nodes)), None) if nodes else (None, None)


def _prepare(target, prompts, lengths, draft, key, max_new_tokens, num_draft_tokens, temperature,
             top_k, top_p, eos_token_id, return_trace, adaptive_k, draft_threshold, mesh, rules,
             stream, cost_profile, deterministic):
    """generate's checks and conversions: (_generate's arguments, its static ones, stream)."""
    if deterministic:
        target = _deterministic(target, mesh)
    if isinstance(num_draft_tokens, str):
        if num_draft_tokens != "auto":
            raise ValueError(f"num_draft_tokens must be an int, None or 'auto', got {num_draft_tokens!r}")
        draft, num_draft_tokens = auto_shape(np.shape(prompts)[0], draft, cost_profile, max_new_tokens)
    elif cost_profile is not None:
        raise ValueError("cost_profile is read only with num_draft_tokens='auto'")
    # One transfer at most: the values are checked on the host, as given (before any cast).
    values = _host_values(prompts, lengths)
    drafter = _check_request(target, prompts, lengths, values, draft, max_new_tokens, num_draft_tokens,
                             temperature, top_k, top_p, eos_token_id, draft_threshold)
    memory.check_shapes(target, drafter, *np.shape(prompts), int(max_new_tokens), mesh)  # nothing traced yet
    if mesh is not None:  # from host data, each process supplies the shards its devices hold
        prompts, lengths = (sharding.place_rows(x, mesh, rules) for x in (prompts, lengths))
    prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)

    key = jax.random.key(0) if key is None else key
    eos = stop_ids(eos_token_id)
    rules = None if mesh is None else tuple(rules or sharding.DEFAULT_RULES)
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be a function or None, got {type(stream).__name__}")
    args = (target, drafter, prompts.astype(jnp.int32), lengths.astype(jnp.int32), key,
            Sampling.make(temperature, top_k, top_p), eos, jnp.asarray(draft_threshold, jnp.float32))
    static = dict(max_new_tokens=int(max_new_tokens), return_trace=bool(return_trace),
                  adaptive_k=bool(adaptive_k), mesh=mesh, rules=rules)
    return args, static, stream


# Backends on which deterministic=True is measured to keep its promise (tests/test_exact.py).
DETERMINISTIC_BACKENDS = ("cpu",)


def _deterministic(target: Model, mesh) -> Model:
    backend = jax.default_backend()
    if backend not in DETERMINISTIC_BACKENDS:
        raise ValueError(f"deterministic=True is verified on {DETERMINISTIC_BACKENDS} only; on {backend!r} its "
                         f"bit-for-bit promise is untested (XLA's kernels there may reduce in another order), so it "
                         f"is refused rather than assumed")
    if mesh is not None:
        raise ValueError("deterministic=True does not run on a mesh yet: leave mesh unset")
    return target.replace(exact=True)


# ---- stop ids ---------------------------------------------------------------------------

STOP_IDS_BUCKET = 4  # stop-id lists are padded to a multiple of this (with -1, never a token)


def stop_ids(eos_token_id) -> jax.Array:
    """None, one id or several -> int32 [N], padded with -1 to a multiple of STOP_IDS_BUCKET."""
    ids = jnp.asarray([] if eos_token_id is None else eos_token_id, jnp.int32).reshape(-1)
    n = max(STOP_IDS_BUCKET, -(-ids.shape[0] // STOP_IDS_BUCKET) * STOP_IDS_BUCKET)
    return jnp.pad(ids, (0, n - ids.shape[0]), constant_values=-1)


def _check_stop_ids(eos_token_id, vocab_size: int):
    if eos_token_id is None or isinstance(eos_token_id, jax.core.Tracer):
        return
    ids = np.asarray(eos_token_id)
    if ids.ndim > 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
        raise ValueError(f"eos_token_id must be None, an int or a list of ints, got {eos_token_id!r}")
    bad = [int(i) for i in ids.reshape(-1) if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"eos_token_id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def _is_stop(tokens: jax.Array, stop: jax.Array) -> jax.Array:
    """bool [...]: which of tokens int32 [...] are among the stop ids int32 [N]."""
    return (tokens[..., None] == stop).any(axis=-1)


# ---- streaming ----------------------------------------------------------------------------

_streams: dict[int, Callable] = {}  # handle -> the stream function of a call in progress
_handles = itertools.count()


def _stream_to_host(handle, tokens, counts):
    _streams[int(handle)](np.asarray(tokens), np.asarray(counts))


def _run(args, static, stream, executable=None) -> GenerateOutput:
    """Runs _generate (or its AOT executable); with a stream, registers the function
    under a handle that the loop passes back to the host, and waits for the loop's end."""
    run = executable or functools.partial(_generate, **static)
    if stream is None:
        return run(*args, stream=None)
    handle = next(_handles) % 2**31
    _streams[handle] = stream
    try:
        out = jax.block_until_ready(run(*args, stream=jnp.int32(handle)))
        jax.effects_barrier()
    finally:
        del _streams[handle]
    return out


def _host_values(prompts, lengths):
    """(prompts, lengths) as numpy arrays of their own dtypes, read in one transfer, or None
    where they cannot be read here (traced, or held partly by other processes)."""
    arrays = (prompts, lengths)
    if any(isinstance(x, jax.core.Tracer) or (isinstance(x, jax.Array) and not x.is_fully_addressable)
           for x in arrays):
        return None
    return tuple(np.asarray(x) for x in jax.device_get(arrays))


def _check_request(target, prompts, lengths, values, draft, max_new_tokens, num_draft_tokens,
                   temperature, top_k, top_p, eos_token_id, draft_threshold):
    """Clear errors for bad requests; returns the drafter, its shape resolved (None without a
    draft). values: (prompts, lengths) as numpy, or None where they cannot be read (then
    only shapes and dtypes are checked)."""
    c = target.config
    shape, length_shape = np.shape(prompts), np.shape(lengths)
    if len(shape) != 2 or length_shape != shape[:1]:
        raise ValueError(f"prompts must be [B, P] and lengths [B]; got {shape} and {length_shape}")
    dtypes = (np.dtype(prompts.dtype if hasattr(prompts, "dtype") else np.asarray(prompts).dtype),
              np.dtype(lengths.dtype if hasattr(lengths, "dtype") else np.asarray(lengths).dtype))
    if not all(np.issubdtype(d, np.integer) for d in dtypes):
        raise ValueError(f"prompts and lengths must be integers, got {dtypes[0]} and {dtypes[1]}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    longest = shape[1]
    if values is not None:
        tokens, lengths = values
        if lengths.min() < 1:
            raise ValueError(f"prompt {int(lengths.argmin())} is empty (length {int(lengths.min())}); "
                             f"prompts need a token")
        if lengths.max() > shape[1]:
            raise ValueError(f"lengths go up to {int(lengths.max())} but prompts hold {shape[1]} tokens")
        longest = int(lengths.max())
        check_token_ids(tokens, c.vocab_size)
    validate(temperature, top_k, top_p)
    if not isinstance(draft_threshold, jax.core.Tracer) and not 0.0 <= float(draft_threshold) <= 1.0:
        raise ValueError(f"draft_threshold must lie in [0, 1], got {draft_threshold}")
    _check_stop_ids(eos_token_id, c.vocab_size)

    if draft is None:
        drafter = None
    else:
        if num_draft_tokens is not None and (
                not isinstance(num_draft_tokens, (int, np.integer)) or num_draft_tokens < 1):
            raise ValueError(f"num_draft_tokens must be an int >= 1 with a draft, got {num_draft_tokens!r}")
        if num_draft_tokens is not None and num_draft_tokens >= c.max_position_embeddings:
            raise ValueError(f"num_draft_tokens={num_draft_tokens}: a step would verify more tokens than the "
                             f"target's max_position_embeddings ({c.max_position_embeddings})")
        drafter = DraftModel(draft) if isinstance(draft, Model) else draft
        if not all(hasattr(drafter, a) for a in ("resolve", "start", "propose")):
            raise TypeError(f"draft must be None, a specjax.Model or a drafter, got {type(draft).__name__}")
        drafter = drafter.resolve(None if num_draft_tokens is None else int(num_draft_tokens))
        if hasattr(drafter, "bind"):
            drafter = drafter.bind(target)
        width = 1 + verify_room(drafter)  # T: tokens one verification pass scores
        if width > c.max_position_embeddings:
            raise ValueError(f"a step would verify {width} tokens (the drafter's tree of {drafter.tree.nodes} "
                             f"nodes, depth {drafter.tree.depth}), more than the target's "
                             f"max_position_embeddings ({c.max_position_embeddings}): use a smaller tree")
    models = [target]
    if isinstance(drafter, DraftModel):
        check_vocabularies(c.vocab_size, drafter.model)
        models.append(drafter.model)
    for m in models:
        if longest + max_new_tokens > m.config.max_position_embeddings:
            raise ValueError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"{m.config.model_type} model's max_position_embeddings "
                f"({m.config.max_position_embeddings})")

    return drafter


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "return_trace", "adaptive_k",
                                             "mesh", "rules"))
def _generate(target: Model, drafter, prompts, lengths, key, sampling: Sampling, eos, threshold,
              *, max_new_tokens: int, return_trace: bool, adaptive_k: bool,
              mesh, rules, stream=None) -> GenerateOutput:
    """eos: int32 [N] stop ids padded with -1. stream: None, or int32 [] (a handle of
    `_streams`; being None or not is part of the jit key, so None costs nothing). A sharded
    program's attention takes the portable path (layers.portable_attention)."""
    with layers.portable_attention(mesh is not None):
        return _loop(target, drafter, prompts, lengths, key, sampling, eos, threshold,
                     max_new_tokens=max_new_tokens, return_trace=return_trace, adaptive_k=adaptive_k,
                     mesh=mesh, rules=rules, stream=stream)


def _loop(target: Model, drafter, prompts, lengths, key, sampling: Sampling, eos, threshold,
          *, max_new_tokens: int, return_trace: bool, adaptive_k: bool, mesh, rules, stream) -> GenerateOutput:
    """_generate's body, traced inside it."""
    B, P = prompts.shape
    N, D = (0, 0) if drafter is None else (drafter.tree.nodes, drafter.tree.depth)
    # Room for the furthest tree node (or drafter write) of an unfinished row.
    S = cache_length(P, max_new_tokens, verify_room(drafter))
    rows = jnp.arange(B)[:, None]  # [B, 1]
    offsets = jnp.arange(D + 1)[None, :]  # [1, D+1]: a path of up to D nodes, then the target's token

    # The drafter's caches follow its own model's rules (a replicated draft: a replicated
    # cache, rows still over data); drafters without a sharded model of their own, likewise.
    draft_model = getattr(drafter, "model", None)
    draft_rules = getattr(draft_model, "rules", None) if isinstance(draft_model, Model) else None
    draft_rules = draft_rules or (None if rules is None else sharding.replicated_rules(rules))

    def place(state: LoopState) -> LoopState:
        """Pins the carry's layout on a mesh: rows over data; the target cache's heads over
        model by `rules`, the drafter's caches by its own rules."""
        if mesh is None:
            return state

        def constrain(x, cache_rules):
            if isinstance(x, KVCache):
                return jax.lax.with_sharding_constraint(x, sharding.cache_shardings(x, mesh, cache_rules))
            if getattr(x, "ndim", 0) >= 1 and x.shape[0] == B:
                return jax.lax.with_sharding_constraint(x, sharding.batch_sharding(x.shape, mesh, rules))
            return x

        is_cache = lambda x: isinstance(x, KVCache)  # noqa: E731
        return state.replace(**{
            name: jax.tree.map(lambda x: constrain(x, draft_rules if name == "draft_state" else rules),
                               getattr(state, name), is_leaf=is_cache)
            for name in state.__dataclass_fields__})

    # Prefill. The padded prompt block is written whole: slots past a row's length are
    # stale and will be overwritten before any query can see them.
    # Long prompts go in chunks (models.prefill); hidden [B, P, E] only for drafters that read it.
    wants_features = drafter is not None and getattr(drafter, "wants_features", False)
    cache = KVCache.init(target.config, B, S, target.dtype)
    hidden, cache = prefill(target, prompts, cache, return_hidden=wants_features)
    tokens = jnp.zeros((B, S), jnp.int32).at[:, :P].set(prompts)
    zeros = jnp.zeros((B,), jnp.int32)
    features, draft_state = None, None
    if wants_features:
        # The prompt's states up to position length-2, the last one a drafter may read now.
        first = lengths - 2
        features = Features(jnp.take_along_axis(hidden, jnp.clip(first[:, None] + offsets, 0, P - 1)[..., None],
                                                axis=1), first)
        draft_state = drafter.start(target, prompts, lengths, S, hidden=hidden)
    elif drafter is not None:
        draft_state = drafter.start(target, prompts, lengths, S)
    state = LoopState(
        tokens=tokens, length=lengths, target_cache=cache.replace(lengths=lengths - 1),
        draft_state=draft_state, features=features,
        k_limit=jnp.full((B,), D, jnp.int32),
        done=jnp.zeros((B,), bool), key=key, stats=Stats(zeros, zeros, zeros),
        step=jnp.zeros((), jnp.int32),
        trace=jnp.zeros((B, max_new_tokens), jnp.int32) if return_trace else None)

    def step(state: LoopState) -> LoopState:
        key, draft_key, accept_key = jax.random.split(state.key, 3)
        length, active = state.length, ~state.done
        if drafter is None:
            draft_state, cache = None, state.target_cache
            proposal = Proposal(jnp.zeros((B, 0), jnp.int32), np.zeros((0,), np.int32),
                                jnp.zeros((B, 0), bool), None)
        else:
            draft_state, cache, proposal = drafter.propose(state.draft_state, DraftRequest(
                target=target, target_cache=state.target_cache, tokens=state.tokens, length=length,
                done=state.done, key=draft_key, sampling=sampling, k_limit=state.k_limit,
                threshold=threshold, features=state.features))
        valid = proposal.valid & active[:, None]  # [B, N]

        # Verify: one target pass over [last token, the N nodes], node i at slot
        # length-1+i and position length-1+depth(i). A fixed tree's masks are constants;
        # a chain needs none beyond the causal one.
        parents, branch = proposal.parents, proposal.branch
        ancestor = ancestors(parents)  # [N+1, N+1], or [B, N+1, N+1] per row
        depth = depths(ancestor)  # [N+1] or [B, N+1]
        chain = isinstance(parents, np.ndarray) and np.array_equal(parents, np.arange(N)) and branch is None
        last = state.tokens[rows[:, 0], length - 1]
        verify = jnp.concatenate([last[:, None], proposal.tokens]
                                 + ([] if branch is None else [branch.tokens]), axis=1)  # [B, T]
        T = verify.shape[1]  # N+1, then the branch's X tokens if a drafter asked for them
        offsets_all, sees = (depth, ancestor) if branch is None else with_branch(depth, ancestor, branch)
        start = length - 1  # the root's slot
        slots = start[:, None] + jnp.arange(T)[None]  # [B, T]
        placement = None if chain else tree_placement(
            start, slots, offsets_all, jnp.broadcast_to(sees, (B, T, T)), S)
        logits, hidden, cache = apply(target, verify, start[:, None] + offsets_all, cache, placement=placement)
        if branch is not None:  # the drafter reads the target's logits for its branch
            draft_state = drafter.observe(draft_state, logits[:, N + 1:], active)
            logits = logits[:, : N + 1]
        p = warp(logits, sampling)  # [B, N+1, V]
        n, path, extra = acceptance.accept(accept_key, proposal.tokens, parents, valid, proposal.q, p, D)
        if not chain:  # the path's node at depth j+1 moves to slot length+j
            cache = move(cache, start[:, None] + path, jnp.where(offsets[:, :D] < n[:, None],
                                                                 length[:, None] + offsets[:, :D], S))

        # The row's new tokens: the path's then the target's own; cut after EOS and at the
        # max_new_tokens budget; nothing for rows already done.
        path_tokens = jnp.take_along_axis(verify, path, axis=1)  # [B, D]
        new = jnp.where(offsets < n[:, None], jnp.pad(path_tokens, ((0, 0), (0, 1))), extra[:, None])
        count = n + 1
        eos_at = _is_stop(new, eos) & (offsets < count[:, None])
        count = jnp.where(eos_at.any(axis=1), jnp.argmax(eos_at, axis=1) + 1, count)
        count = jnp.minimum(count, max_new_tokens - (length - lengths))
        count = jnp.where(active, count, 0)
        keep = offsets < count[:, None]
        tokens = state.tokens.at[rows, jnp.where(keep, length[:, None] + offsets, S)].set(new, mode="drop")
        new_length = length + count
        done = state.done | (eos_at & keep).any(axis=1) | (new_length - lengths >= max_new_tokens)

        a = active.astype(jnp.int32)
        stats = Stats(steps=state.stats.steps + a, drafted=state.stats.drafted + valid.sum(axis=1),
                      accepted=state.stats.accepted + jnp.minimum(n, count))
        k_limit = state.k_limit
        if adaptive_k:  # transformers' heuristic: +2 after a clean sweep, -1 after a rejection
            reach = jnp.max(jnp.where(valid, depth[..., 1:], 0), axis=1, initial=0)  # deepest proposed
            grown = jnp.where(n >= reach, k_limit + 2, k_limit - 1)
            k_limit = jnp.where(active, jnp.clip(grown, 1, D), k_limit)
        trace = None if state.trace is None else state.trace.at[:, state.step].set(count)
        features = None if state.features is None else Features(  # the root's state, then the path's
            jnp.take_along_axis(hidden, jnp.pad(path, ((0, 0), (1, 0)))[..., None], axis=1), start)
        if stream is not None:  # the host receives the step's kept tokens, steps in order
            io_callback(_stream_to_host, None, stream, jnp.where(keep, new, 0), count, ordered=True)
        return LoopState(tokens=tokens, length=new_length,
                         target_cache=cache.replace(lengths=new_length - 1),
                         draft_state=draft_state, k_limit=k_limit, done=done, key=key, stats=stats,
                         step=state.step + 1, trace=trace, features=features)

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: place(step(s)), place(state))

    num_tokens = state.length - lengths
    cols = jnp.arange(max_new_tokens)[None, :]
    out = state.tokens[rows, lengths[:, None] + cols]
    out = jnp.where(cols < num_tokens[:, None], out, 0)
    return GenerateOutput(tokens=out, num_tokens=num_tokens, stats=state.stats, trace=state.trace)
