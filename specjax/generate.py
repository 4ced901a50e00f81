"""The decoding loop: autoregressive and speculative, one machinery, one `lax.while_loop`.

Invariant at the top of every step: row b holds `length[b]` final tokens in `tokens`; the
target's cache holds correct entries for positions < length[b] - 1 (the last token is in
no cache yet); entries at or beyond that are stale and masked by position, never cleared.

One step, all shapes fixed:
  1. the drafter proposes K tokens d and the probabilities q they were drawn from;
  2. the target scores [last token, d_1..d_K] at positions length-1 .. length+K-1 in one
     pass, giving its warped probabilities p at K+1 positions;
  3. `acceptance.accept` keeps n leading drafts and draws one token of the target's own;
  4. those n+1 tokens are written at each row's own offset and length += n+1 (cut at EOS
     and at max_new_tokens). Rolling back the rejected drafts is only this: the target
     wrote their keys/values, and they are now beyond length-1, stale and masked;
  5. a row that emitted EOS or reached max_new_tokens is done: its state is frozen under
     masks while the other rows go on. The loop ends when every row is done.
Autoregressive decoding is the same step with K = 0 and no drafter.

The loop knows drafters only through the interface in `specjax.drafters`, and nothing of
tokenizers or files.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import io_callback

from specjax import acceptance, sharding
from specjax.cache import KVCache
from specjax.drafters import DraftModel, DraftRequest, Proposal
from specjax.drafters.model import check_vocabularies
from specjax.models import Model, apply, check_token_ids
from specjax.sampling import Sampling, validate, warp


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
    target_cache: KVCache  # [L, B, S, G, D]; valid below length - 1
    draft_state: Any  # the drafter's own carry (e.g. its KV cache); None without a drafter
    k_limit: jax.Array  # int32 [B]: drafts each row may propose next step (K unless adaptive)
    done: jax.Array  # bool [B]: row emitted EOS or reached max_new_tokens; frozen since
    key: jax.Array  # PRNG key, split once per step
    stats: Stats
    step: jax.Array  # int32 []: steps taken
    trace: jax.Array | None  # int32 [B, max_new_tokens] tokens emitted per step, if asked for


def pad_prompts(prompts: Sequence[Sequence[int]], bucket: int = 64):
    """Right-pads token-id lists to a multiple of `bucket`, so that prompts of different
    lengths share one compilation. Returns (int32 [B, P], int32 [B])."""
    if len(prompts) == 0:
        raise ValueError("pad_prompts needs at least one prompt")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError(f"prompt {int(lengths.argmin())} is empty; every prompt needs at least one token")
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1, got {bucket}")
    P = -(-int(lengths.max()) // bucket) * bucket
    out = np.zeros((len(prompts), P), np.int32)
    for b, p in enumerate(prompts):
        out[b, : len(p)] = p
    return out, lengths


def generate(target: Model, prompts, lengths, draft=None, key=None, max_new_tokens: int = 64,
             num_draft_tokens: int = 4, temperature=0.0, top_k=0, top_p=1.0,
             eos_token_id: int | Sequence[int] | None = None, return_trace: bool = False,
             adaptive_k: bool = False, draft_threshold=0.0, mesh=None, rules=None,
             stream: Callable | None = None) -> GenerateOutput:
    """Generates up to max_new_tokens per row; exactly the target's own output distribution.

    target: a `Model`. prompts int [B, P] right-padded, lengths int [B] (see `pad_prompts`).
    draft: None (plain autoregressive decoding), a draft `Model`, or a drafter
        (`specjax.EarlyExit`, `specjax.PromptLookup`, or anything with their interface).
    Shapes, num_draft_tokens (K) and max_new_tokens are static; the key, temperature, top_k,
    top_p and eos_token_id are traced, so changing them never recompiles.
    eos_token_id: None, one stop id or several (a row stops after the first of any, as in
        transformers). They travel as int32 [N] padded with -1 to a multiple of 4: lists of
        1-4 ids share one compilation, 5-8 another, and so on.
    return_trace: also return the tokens each step emitted per row (GenerateOutput.trace);
    off, it costs nothing.
    adaptive_k: move each row's draft length between 1 and K by its last step (+2 when every
        draft was accepted, -1 otherwise: transformers' heuristic schedule), on the device.
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
    """
    return _run(*_prepare(**locals()))


def compile_generate(target: Model, prompts, lengths, **kwargs) -> Callable[[], GenerateOutput]:
    """`generate` compiled ahead of time for these arguments (the same as generate's):
    returns a function of no arguments that runs it, without compiling. Timing this call
    times compilation alone."""
    bound = inspect.signature(generate).bind(target, prompts, lengths, **kwargs)
    bound.apply_defaults()
    args, static, stream = _prepare(**bound.arguments)
    handle = None if stream is None else jnp.int32(0)
    executable = _generate.lower(*args, **static, stream=handle).compile()
    return lambda: _run(args, {}, stream, executable)


def _prepare(target, prompts, lengths, draft, key, max_new_tokens, num_draft_tokens, temperature,
             top_k, top_p, eos_token_id, return_trace, adaptive_k, draft_threshold, mesh, rules,
             stream):
    """generate's checks and conversions: (_generate's arguments, its static ones, stream)."""
    drafter, K = _check_request(target, jnp.asarray(prompts), jnp.asarray(lengths), draft,
                                max_new_tokens, num_draft_tokens, temperature, top_k, top_p,
                                eos_token_id, draft_threshold)
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
    static = dict(max_new_tokens=int(max_new_tokens), K=K, return_trace=bool(return_trace),
                  adaptive_k=bool(adaptive_k), mesh=mesh, rules=rules)
    return args, static, stream


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


def _check_request(target, prompts, lengths, draft, max_new_tokens, num_draft_tokens,
                   temperature, top_k, top_p, eos_token_id, draft_threshold):
    """Clear errors for bad requests (values that are traced are not checked); returns the
    drafter and the static K."""
    c = target.config
    if prompts.ndim != 2 or lengths.shape != prompts.shape[:1]:
        raise ValueError(f"prompts must be [B, P] and lengths [B]; got {prompts.shape} and {lengths.shape}")
    if not (jnp.issubdtype(prompts.dtype, jnp.integer) and jnp.issubdtype(lengths.dtype, jnp.integer)):
        raise ValueError(f"prompts and lengths must be integers, got {prompts.dtype} and {lengths.dtype}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    longest = prompts.shape[1]
    if not isinstance(lengths, jax.core.Tracer):
        if lengths.min() < 1:
            raise ValueError(f"prompt {int(lengths.argmin())} is empty (length 0); prompts need a token")
        if lengths.max() > prompts.shape[1]:
            raise ValueError(f"lengths go up to {int(lengths.max())} but prompts hold {prompts.shape[1]} tokens")
        longest = int(lengths.max())
    check_token_ids(prompts, c.vocab_size)
    validate(temperature, top_k, top_p)
    if not isinstance(draft_threshold, jax.core.Tracer) and not 0.0 <= float(draft_threshold) <= 1.0:
        raise ValueError(f"draft_threshold must lie in [0, 1], got {draft_threshold}")
    _check_stop_ids(eos_token_id, c.vocab_size)

    if draft is None:
        drafter, K = None, 0
    else:
        if not isinstance(num_draft_tokens, (int, np.integer)) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be an int >= 1 with a draft, got {num_draft_tokens!r}")
        K = int(num_draft_tokens)
        drafter = DraftModel(draft) if isinstance(draft, Model) else draft
        if not (hasattr(drafter, "init") and hasattr(drafter, "propose")):
            raise TypeError(f"draft must be None, a specjax.Model or a drafter, got {type(draft).__name__}")
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

    return drafter, K


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "K", "return_trace", "adaptive_k",
                                             "mesh", "rules"))
def _generate(target: Model, drafter, prompts, lengths, key, sampling: Sampling, eos, threshold,
              *, max_new_tokens: int, K: int, return_trace: bool, adaptive_k: bool,
              mesh, rules, stream=None) -> GenerateOutput:
    """eos: int32 [N] stop ids padded with -1. stream: None, or int32 [] (a handle of
    `_streams`; being None or not is part of the jit key, so None costs nothing)."""
    B, P = prompts.shape
    S = P + max_new_tokens + K  # room for the furthest draft of an unfinished row
    rows = jnp.arange(B)[:, None]  # [B, 1]
    offsets = jnp.arange(K + 1)[None, :]  # [1, K+1]

    def place(state: LoopState) -> LoopState:
        """Pins the carry's layout on a mesh: rows over data, cache heads over model."""
        if mesh is None:
            return state

        def constrain(x):
            if isinstance(x, KVCache):
                return jax.lax.with_sharding_constraint(x, sharding.cache_shardings(x, mesh, rules))
            if getattr(x, "ndim", 0) >= 1 and x.shape[0] == B:
                return jax.lax.with_sharding_constraint(x, sharding.batch_sharding(x.shape, mesh, rules))
            return x

        return jax.tree.map(constrain, state, is_leaf=lambda x: isinstance(x, KVCache))

    # Prefill. The padded prompt block is written whole: slots past a row's length are
    # stale and will be overwritten before any query can see them.
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    cache = KVCache.init(target.config, B, S, target.dtype)
    _, _, cache = apply(target, prompts, positions, cache)
    tokens = jnp.zeros((B, S), jnp.int32).at[:, :P].set(prompts)
    zeros = jnp.zeros((B,), jnp.int32)
    state = LoopState(
        tokens=tokens, length=lengths, target_cache=cache.replace(lengths=lengths - 1),
        draft_state=None if drafter is None else drafter.init(target, prompts, lengths, S),
        k_limit=jnp.full((B,), K, jnp.int32),
        done=jnp.zeros((B,), bool), key=key, stats=Stats(zeros, zeros, zeros),
        step=jnp.zeros((), jnp.int32),
        trace=jnp.zeros((B, max_new_tokens), jnp.int32) if return_trace else None)

    def step(state: LoopState) -> LoopState:
        key, draft_key, accept_key = jax.random.split(state.key, 3)
        length, active = state.length, ~state.done
        if drafter is None:
            draft_state, cache = None, state.target_cache
            proposal = Proposal(jnp.zeros((B, 0), jnp.int32),
                                jnp.zeros((B, 0, target.config.vocab_size), jnp.float32), zeros)
        else:
            draft_state, cache, proposal = drafter.propose(state.draft_state, DraftRequest(
                target=target, target_cache=state.target_cache, tokens=state.tokens, length=length,
                key=draft_key, sampling=sampling, k_limit=state.k_limit, threshold=threshold, K=K))
        drafts = proposal.drafts

        # Verify: one target pass over [last token, d_1..d_K].
        last = state.tokens[rows[:, 0], length - 1]
        verify = jnp.concatenate([last[:, None], drafts], axis=1)  # [B, K+1]
        logits, _, cache = apply(target, verify, length[:, None] - 1 + offsets, cache)
        p = warp(logits, sampling)  # [B, K+1, V]
        n, extra = acceptance.accept(accept_key, drafts, proposal.q, p, proposal.num_drafted)

        # The row's new tokens: d_1..d_n then the target's own; cut after EOS and at the
        # max_new_tokens budget; nothing for rows already done.
        new = jnp.where(offsets < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), extra[:, None])
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
        stats = Stats(steps=state.stats.steps + a, drafted=state.stats.drafted + proposal.num_drafted * a,
                      accepted=state.stats.accepted + jnp.minimum(n, count))
        k_limit = state.k_limit
        if adaptive_k:  # transformers' heuristic: +2 after a clean sweep, -1 after a rejection
            grown = jnp.where(n >= proposal.num_drafted, k_limit + 2, k_limit - 1)
            k_limit = jnp.where(active, jnp.clip(grown, 1, K), k_limit)
        trace = None if state.trace is None else state.trace.at[:, state.step].set(count)
        if stream is not None:  # the host receives the step's kept tokens, steps in order
            io_callback(_stream_to_host, None, stream, jnp.where(keep, new, 0), count, ordered=True)
        return LoopState(tokens=tokens, length=new_length,
                         target_cache=cache.replace(lengths=new_length - 1),
                         draft_state=draft_state, k_limit=k_limit, done=done, key=key, stats=stats,
                         step=state.step + 1, trace=trace)

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: place(step(s)), place(state))

    num_tokens = state.length - lengths
    cols = jnp.arange(max_new_tokens)[None, :]
    out = state.tokens[rows, lengths[:, None] + cols]
    out = jnp.where(cols < num_tokens[:, None], out, 0)
    return GenerateOutput(tokens=out, num_tokens=num_tokens, stats=state.stats, trace=state.trace)
