"""A generate call's host-side policy, before anything is traced: the request's checks
(clear errors, named), the shape choices (`pad_prompts`, `auto_shape`), the deterministic
mode's backends, stop ids, and the conversion of generate's arguments into the loop's.
Knows the drafter interface, not what any drafter does; knows nothing of the loop's body.
"""

from __future__ import annotations

import secrets
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import budget, sharding, theory
from specjax.backend import Backend
from specjax.drafters import DraftModel
from specjax.drafters.base import Drafter, verify_room
from specjax.models import Model, check_token_ids
from specjax.grammar import Automaton, Grammar
from specjax.sampling import (FILTERED, LOGPROBS_MODES, MAX_LOGPROBS, Sampling, check_logit_bias, check_penalties,
                              validate)
from specjax.tree import Tree

MIN_PROMPT_BUCKET = 64  # pad_prompts' default: powers of two from this up
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
    if isinstance(draft, Drafter) and draft.fixed_shape:
        raise ValueError(f"num_draft_tokens='auto' does not choose {type(draft).__name__}'s shape (its own "
                         f"arguments set it): leave num_draft_tokens unset")
    tree = draft.tree if isinstance(draft, Drafter) else None
    if tree is None:
        K = theory.choose_num_draft_tokens(profile, int(batch), max_new_tokens=int(max_new_tokens))
        return (draft, K) if K else (None, None)
    if tree.is_static:
        raise ValueError("num_draft_tokens='auto' picks a node budget for a dynamic Tree(depth, top_k, nodes), "
                         "but a static tree (Tree.from_paths) fixes its shape: leave num_draft_tokens unset")
    nodes = theory.choose_tree_nodes(profile, tree.depth, tree.top_k, int(batch), tree.nodes,
                                     max_new_tokens=int(max_new_tokens))
    return (draft.replace(tree=Tree(tree.depth, tree.top_k, nodes)), None) if nodes else (None, None)


def prepare(target, prompts, lengths, draft, key, max_new_tokens, num_draft_tokens, temperature,
            top_k, top_p, min_p, logit_bias, presence_penalty, frequency_penalty, repetition_penalty, grammar,
            eos_token_id,
            return_trace, logprobs, logprobs_mode, prompt_logprobs, adaptive_k,
            draft_threshold, mesh, rules, stream, cost_profile, deterministic):
    """generate's checks and conversions (its arguments, by name): (loop.generate_loop's
    arguments, its static ones, the stream function or None)."""
    if deterministic:
        target = deterministic_target(target, mesh)
    if isinstance(num_draft_tokens, str):
        if num_draft_tokens != "auto":
            raise ValueError(f"num_draft_tokens must be an int, None or 'auto', got {num_draft_tokens!r}")
        draft, num_draft_tokens = auto_shape(np.shape(prompts)[0], draft, cost_profile, max_new_tokens)
    elif cost_profile is not None:
        raise ValueError("cost_profile is read only with num_draft_tokens='auto'")
    # One transfer at most: the values are checked on the host, as given (before any cast).
    abstract = is_abstract(prompts) or is_abstract(lengths)
    values = None if abstract else _host_values(prompts, lengths)
    drafter = _check_request(target, prompts, lengths, values, draft, max_new_tokens, num_draft_tokens,
                             temperature, top_k, top_p, min_p, eos_token_id, draft_threshold)
    penalties = (presence_penalty, frequency_penalty, repetition_penalty)
    if not any(isinstance(x, jax.core.Tracer) for x in penalties):
        penalties = check_penalties(*penalties)
    sampling = Sampling.make(temperature, top_k, top_p, min_p=min_p, **_bias(logit_bias, np.shape(prompts)[0],
                                                                               target.config.vocab_size),
                             **dict(zip(("presence_penalty", "frequency_penalty", "repetition_penalty"), penalties)))
    automaton, grammar_state = _grammar(grammar, np.shape(prompts)[0], target.config.vocab_size)
    if automaton is not None:  # (a constrained row's distribution is masked: the filtered form)
        sampling = sampling.replace(kind=FILTERED)
    if not abstract:  # (a program built for devices that are not here is measured against theirs: plan.py)
        budget.check_shapes(target, drafter, *np.shape(prompts), int(max_new_tokens), mesh,
                            sampled=not sampling.greedy)  # nothing traced yet
    if mesh is not None:  # from host data, each process supplies the shards its devices hold
        prompts, lengths = (sharding.place_rows(x, mesh, rules) for x in (prompts, lengths))
    if abstract:  # shapes only (a program built for devices that need not be here): see aot.py
        prompts, lengths = (jax.ShapeDtypeStruct(x.shape, jnp.int32, sharding=getattr(x, "sharding", None))
                            for x in (prompts, lengths))
    else:
        prompts, lengths = jnp.asarray(prompts).astype(jnp.int32), jnp.asarray(lengths).astype(jnp.int32)

    key = fresh_key() if key is None else key
    eos = padded_stop_ids(eos_token_id)
    # The cache follows the rules the target was sharded with, unless the call names others.
    rules = None if mesh is None else tuple(rules or target.rules or sharding.DEFAULT_RULES)
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be a function or None, got {type(stream).__name__}")
    args = (target, drafter, prompts, lengths, key,
            sampling, eos, jnp.asarray(draft_threshold, jnp.float32), automaton, grammar_state)
    static = dict(max_new_tokens=int(max_new_tokens), return_trace=bool(return_trace),
                  logprobs=logprobs_setting(logprobs, logprobs_mode),
                  prompt_logprobs=(None if prompt_logprobs is None
                                   else logprobs_setting(prompt_logprobs, "raw", "prompt_logprobs")[0]),
                  adaptive_k=bool(adaptive_k), backend=Backend.of(target.params, mesh), rules=rules)
    return args, static, stream


# Backends on which deterministic=True is measured to keep its promise (tests/test_exact.py).
DETERMINISTIC_BACKENDS = ("cpu",)


def deterministic_target(target: Model, mesh) -> Model:
    """The target that computes by fixed-shape bodies (generate's deterministic=True), refused
    where that promise is not verified."""
    backend = jax.default_backend()
    if backend not in DETERMINISTIC_BACKENDS:
        raise ValueError(f"deterministic=True is verified on {DETERMINISTIC_BACKENDS} only; on {backend!r} its "
                         f"bit-for-bit promise is untested (XLA's kernels there may reduce in another order), so it "
                         f"is refused rather than assumed")
    if mesh is not None:
        raise ValueError("deterministic=True does not run on a mesh yet: leave mesh unset")
    return target.replace(exact=True)


def fresh_seed() -> int:
    """A seed in [0, 2**32) from the operating system's entropy."""
    return secrets.randbits(32)


def fresh_key() -> jax.Array:
    """A PRNG key from the operating system's entropy: what a call given no key samples with
    (it returns it in `GenerateOutput.key`, so the call can be reproduced)."""
    return jax.random.key(fresh_seed())


STOP_IDS_BUCKET = 4  # stop-id lists are padded to a multiple of this (with -1, never a token)


def padded_stop_ids(eos_token_id) -> jax.Array:
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


def is_abstract(x) -> bool:
    """True for a jax.ShapeDtypeStruct: a shape and dtype (and maybe a sharding), no values."""
    return isinstance(x, jax.ShapeDtypeStruct)


def _host_values(prompts, lengths):
    """(prompts, lengths) as numpy arrays of their own dtypes, read in one transfer, or None
    where they cannot be read here (traced, or held partly by other processes)."""
    arrays = (prompts, lengths)
    if any(isinstance(x, jax.core.Tracer) or (isinstance(x, jax.Array) and not x.is_fully_addressable)
           for x in arrays):
        return None
    return tuple(np.asarray(x) for x in jax.device_get(arrays))


def logprobs_setting(logprobs, mode, name: str = "logprobs") -> tuple[int, str] | None:
    """generate's logprobs and logprobs_mode (or the Engine's max_logprobs: `name`) as
    `step`'s static (top, mode), checked."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}")
    if logprobs is None:
        return None
    if not isinstance(logprobs, (int, np.integer)) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}] (the top alternatives listed), "
                         f"got {logprobs!r}")
    return int(logprobs), mode


def _grammar(grammar, batch: int, vocab_size: int):
    """(the `Automaton` of generate's grammar (None, one `Grammar` for every row, or a list of
    B, None for a free row), each row's initial state int32 [B]), or (None, None)."""
    if grammar is None:
        return None, None
    rows = list(grammar) if isinstance(grammar, (list, tuple)) else [grammar] * batch
    if len(rows) != batch or not all(g is None or isinstance(g, Grammar) for g in rows):
        raise ValueError(f"grammar must be None, a specjax.Grammar or a list of {batch} of them (None for a free "
                         f"row), got {grammar!r:.200}")
    if all(g is None for g in rows):
        return None, None
    automaton, initial = Automaton.of(rows, vocab_size)
    return automaton, jnp.asarray(initial)


def _bias(logit_bias, batch: int, vocab_size: int) -> dict:
    """`Sampling.make`'s logit-bias arguments from generate's logit_bias (None, one mapping
    for every row, or a list of B: one per row), checked (`check_logit_bias`)."""
    if logit_bias is None or hasattr(logit_bias, "items"):
        return {"logit_bias": check_logit_bias(logit_bias, vocab_size)}
    if not isinstance(logit_bias, (list, tuple)) or len(logit_bias) != batch:
        raise ValueError(f"logit_bias must be None, a {{token id: bias}} mapping or a list of {batch} of them "
                         f"(one per row), got {type(logit_bias).__name__}"
                         f"{f' of {len(logit_bias)}' if isinstance(logit_bias, (list, tuple)) else ''}")
    return {"logit_bias": [check_logit_bias(b, vocab_size) for b in logit_bias], "batch": batch}


def _check_request(target, prompts, lengths, values, draft, max_new_tokens, num_draft_tokens,
                   temperature, top_k, top_p, min_p, eos_token_id, draft_threshold):
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
    validate(temperature, top_k, top_p, min_p)
    if not isinstance(draft_threshold, jax.core.Tracer) and not 0.0 <= float(draft_threshold) <= 1.0:
        raise ValueError(f"draft_threshold must lie in [0, 1], got {draft_threshold}")
    _check_stop_ids(eos_token_id, c.vocab_size)

    if draft is None:
        if num_draft_tokens not in (None, 0):  # as the Engine says it (serve/engine.py)
            raise ValueError(f"num_draft_tokens={num_draft_tokens!r} needs a draft")
        drafter = None
    else:
        if num_draft_tokens is not None and (
                not isinstance(num_draft_tokens, (int, np.integer)) or num_draft_tokens < 1):
            raise ValueError(f"num_draft_tokens must be an int >= 1 with a draft, got {num_draft_tokens!r}")
        if num_draft_tokens is not None and num_draft_tokens >= c.max_position_embeddings:
            raise ValueError(f"num_draft_tokens={num_draft_tokens}: a step would verify more tokens than the "
                             f"target's max_position_embeddings ({c.max_position_embeddings})")
        drafter = DraftModel(draft) if isinstance(draft, Model) else draft
        if not isinstance(drafter, Drafter):
            raise TypeError(f"draft must be None, a specjax.Model or a drafter (a specjax.drafters.Drafter), "
                            f"got {type(draft).__name__}")
        drafter = drafter.resolve(None if num_draft_tokens is None else int(num_draft_tokens)).bind(target)
        width = 1 + verify_room(drafter)  # T: tokens one verification pass scores
        if width > c.max_position_embeddings:
            raise ValueError(f"a step would verify {width} tokens (the drafter's tree of {drafter.tree.nodes} "
                             f"nodes, depth {drafter.tree.depth}), more than the target's "
                             f"max_position_embeddings ({c.max_position_embeddings}): use a smaller tree")
    if longest + max_new_tokens > c.max_position_embeddings:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"{c.model_type} model's max_position_embeddings ({c.max_position_embeddings})")
    if drafter is not None:
        drafter.check_lengths(longest, max_new_tokens)
    return drafter


