"""`generate`, the library's entry point, and its ahead-of-time forms: a call is checked
and prepared on the host (request.py), refused if it cannot fit (budget.py), then run as one
compiled loop (loop.py), its tokens streamed to the host if asked (streams.py).

This module owns only the public signature and that order; it knows nothing of what the
loop computes or what a drafter does.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import budget, loop, streams
from specjax.budget import MemoryEstimate
from specjax.loop import GenerateOutput, Stats
from specjax.models import Model
from specjax.request import auto_shape, pad_prompts, prepare

__all__ = ["GenerateOutput", "MemoryEstimate", "Stats", "auto_shape", "compile_generate", "compiled_memory",
           "estimate_memory", "generate", "pad_prompts"]


def generate(target: Model, prompts, lengths, draft=None, key=None, max_new_tokens: int = 64,
             num_draft_tokens: int | str | None = None, temperature=0.0, top_k=0, top_p=1.0,
             min_p=0.0, logit_bias=None, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
             grammar=None,
             eos_token_id: int | Sequence[int] | None = None,
             return_trace: bool = False, logprobs: int | None = None, logprobs_mode: str = "raw",
             prompt_logprobs: int | None = None,
             adaptive_k: bool = False, draft_threshold=0.0, mesh=None, rules=None,
             stream: Callable | None = None, cost_profile=None, deterministic: bool = False) -> GenerateOutput:
    """Generates up to max_new_tokens per row; exactly the target's own output distribution.

    target: a `Model`. prompts int [B, P] right-padded, lengths int [B] (see `pad_prompts`).
    draft: None (plain autoregressive decoding), a draft `Model`, or a drafter
        (`specjax.DraftModel`, `specjax.EarlyExit`, `specjax.PromptLookup`, ..., or your own
        subclass of `specjax.Drafter`).
    num_draft_tokens: K, the length of a drafter's chain (default 4). A drafter given a
        `specjax.Tree` proposes that tree instead: leave it unset (a different K is an error).
        Without a draft it must be None or 0 (any other K is refused: nothing drafts it).
        "auto": the static K for this batch size, chosen on the host before compiling by
        `specjax.theory.choose_num_draft_tokens` from `cost_profile` (a `CostProfile`, a
        profile.json path written by `specjax bench --profile`, or None: the profile
        shipped for this JAX backend); K = 0 turns speculation off (plain decoding). A
        drafter with a dynamic Tree(depth, top_k, nodes): its node budget, at most `nodes`,
        by `theory.choose_tree_nodes` (see `auto_shape`).
    temperature, top_k, top_p, min_p: transformers' (0, 0, 1, 0: off), applied in its order
        (`specjax.sampling`); temperature 0 is greedy.
    logit_bias: None, {token id: bias} added to the target's logits before they are warped
        (OpenAI's: up to 300 entries, biases in [-100, 100]; a greedy row takes the argmax
        of the biased logits), or a list of B such mappings, one per row. Speculation stays
        exact: the target's distribution is warped so at every draft position, and a
        drafter that samples drafts under the same settings.
    presence_penalty, frequency_penalty: OpenAI's, as vLLM applies them (0: off; in [-2,
        2]): subtracted from the logit of every id the row's output holds, once and per
        occurrence. repetition_penalty: transformers' and vLLM's (1: off; > 0): an id in the
        prompt or the output has its logit divided by it where positive, multiplied where
        not. Applied after the bias, before temperature. Under speculation each draft
        position is penalized as plain decoding would be had the draft tokens before it
        been emitted, and a sampling drafter drafts under the same penalties.
    grammar: None, a `specjax.Grammar` (a regex, JSON schema or choice compiled for the
        tokenizer: `Grammar.regex(pattern, Vocabulary.of(tokenizer, V))`) every row's output
        must match, or a list of B (None: a free row). The target's distribution at every
        draft position is masked by the state the position's path reaches (greedy: the
        argmax of the allowed tokens), and a drafter drafts under the same masks; the
        automaton lives on the device (specjax.grammar), so no step waits on the host. A
        row ends at EOS (the vocabulary's eos, allowed only where the match is complete)
        when EOS is among its stop ids, or at max_new_tokens.
    Shapes, the tree, K and max_new_tokens are static (and the logit bias's length, rounded
    up to a multiple of 8); the key, the sampling values and eos_token_id are traced. The
    program is built for the least sampling its settings need (`specjax.sampling.kind_of`:
    greedy, sampled, or filtered by top-k/top-p/min-p, a logit bias, a penalty or a grammar), so a greedy call
    holds no distribution or draw; changing the values within a kind never recompiles
    (traced settings, under your own jit, get the filtered program).
    key: a PRNG key; row b samples from fold_in(key, b), and its step at length n from
        fold_in of that and n, so a row's samples depend on neither its neighbours nor the
        steps' K. None: a fresh key from the OS's entropy, returned as `out.key` (its data:
        `key=jax.random.wrap_key_data(out.key)` repeats the call).
    eos_token_id: None, one stop id or several (a row stops after the first of any, as in
        transformers). They travel as int32 [N] padded with -1 to a multiple of 4: lists of
        1-4 ids share one compilation, 5-8 another, and so on.
    return_trace: also return the tokens each step emitted per row (GenerateOutput.trace);
    off, it costs nothing.
    logprobs: None, or n in [0, 20]: also return each new token's log-probability under the
        target and the n likeliest ids with theirs (out.logprobs: chosen [B, max_new_tokens],
        top_ids and top [B, max_new_tokens, n]; 0 past num_tokens), taken from the
        verification pass at the position that scored the token: what plain decoding's pass
        there gives, for every drafter. logprobs_mode: "raw" (the model's distribution,
        log_softmax of its logits: vLLM's raw_logprobs) or "processed" (the one sampled
        from: bias, temperature, top-k, top-p and min-p applied; -inf where a filter removed
        a token; greedy rows: 0 for the argmax). Static; None costs nothing.
    prompt_logprobs: None, or n in [0, 20]: also return each prompt token's log-probability
        given the tokens before it, and the n likeliest ids there (out.prompt_logprobs:
        chosen [B, P], top_ids and top [B, P, n]; raw; 0 at position 0, which nothing
        predicts, and past lengths[b]), from the prefill's own pass, reduced chunk by chunk.
    adaptive_k: move each row's draft depth between 1 and K (the tree's depth) by its last
        step (+2 when the deepest proposed node was accepted, -1 otherwise: transformers'
        heuristic schedule), on the device.
    draft_threshold: a model drafter stops a row's drafting once its own confidence (max
        probability at temperature 1) falls below this (traced; 0 drafts all K).
    mesh, rules: a `specjax.make_mesh` mesh (and optional logical-axis rules; default: the
        rules the target was sharded with): rows go over `data`, caches' heads over `model`,
        as the models' params are (see shard_model).
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
    args, static, stream = prepare(**locals())
    budget.check_fits(args, static, stream)  # refuses, with the numbers, what cannot fit
    return _run(args, static, stream)


def _prepared(target, prompts, lengths, kwargs):
    """prepare(...) for generate's arguments given as they would be to generate."""
    bound = inspect.signature(generate).bind(target, prompts, lengths, **kwargs)
    bound.apply_defaults()
    return prepare(**bound.arguments)


def compile_generate(target: Model, prompts, lengths, **kwargs) -> Callable[[], GenerateOutput]:
    """`generate` compiled ahead of time for these arguments (the same as generate's):
    returns a function of no arguments that runs it, without compiling. Timing this call
    times compilation alone."""
    args, static, stream = _prepared(target, prompts, lengths, kwargs)
    budget.check_fits(args, static, stream)
    executable = budget.compile_loop(args, static, stream)
    return lambda: _run(args, {}, stream, executable)


def compiled_memory(target, prompts, lengths, **kwargs):
    """XLA's memory analysis of `generate(target, prompts, lengths, **kwargs)` compiled
    ahead of time (not run): an object with temp_size_in_bytes, argument_size_in_bytes,
    output_size_in_bytes, ..."""
    return budget.compile_loop(*_prepared(target, prompts, lengths, kwargs)).memory_analysis()


def estimate_memory(target, draft=None, batch: int = 1, prompt_len: int = 64, max_new_tokens: int = 64,
                    num_draft_tokens: int | None = None, **kwargs) -> MemoryEstimate:
    """The memory `generate` needs for `batch` prompts padded to `prompt_len` tokens, with
    this draft (None, a model or a drafter), max_new_tokens and num_draft_tokens; other
    keyword arguments as generate's (mesh, return_trace, ...). Compiles the program ahead of
    time (seconds) and runs nothing."""
    for name, value in (("batch", batch), ("prompt_len", prompt_len)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    prompts = np.zeros((batch, prompt_len), np.int32)
    lengths = np.full((batch,), prompt_len, np.int32)
    return budget.estimate(*_prepared(target, prompts, lengths, dict(
        draft=draft, max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, **kwargs)))


def _run(args, static, stream, executable=None) -> GenerateOutput:
    """Runs the loop (or its AOT executable); with a stream, registers the function under
    a handle that the loop passes back to the host, and waits for the loop's end."""
    run = executable or functools.partial(loop.generate_loop, **static)
    if stream is None:
        return run(*args, stream=None)
    with streams.registered(stream) as handle:
        out = jax.block_until_ready(run(*args, stream=jnp.int32(handle)))
        jax.effects_barrier()
    return out
