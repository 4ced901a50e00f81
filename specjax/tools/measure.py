"""Timing and statistics of `generate`, shared by the bench (specjax.tools.bench), the
synthetic pair (specjax.tools.synthetic) and the notebooks' comparisons
(specjax.tools.notebook): medians of timed calls, one pass's cost inside a compiled loop, a
whole prompt set timed as a `Run`, acceptance from tokens per step, theory's predicted
speedups, the held-out prompts, and transformers' generate timed on the same checkpoints.
The held-out prompts (specjax.train.data's) and acceptance from a
trace (row_traces, depth_acceptance, per_position_acceptance: specjax.theory's) live in
the core, which trains and probes with them; this module re-exports them.

It owns measurement, not experiments: it does not know the bench's sections, its tables
beyond one list of runs, plots, reports on disk, or the command line.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import theory
from specjax.cache import KVCache, tree_placement
from specjax.generate import generate, pad_prompts
from specjax.models import Model, apply, commit
from specjax.theory import depth_acceptance, per_position_acceptance, row_traces  # noqa: F401 (re-exported)
from specjax.tree import ancestors, depths


# ---- timing ----------------------------------------------------------------------------


def median_time(fn, repeats: int, warm: bool = True) -> float:
    if warm:
        fn()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pass_time(model: Model, batch: int, T: int, cache_len: int, repeats: int, exit_layer=None,
              tree: bool = False) -> float:
    """Median seconds of one cached forward pass over T tokens per row, timed as 50 passes
    inside one compiled loop (as generate runs them: no Python dispatch in between).
    tree: with a tree's placement (its mask built in the pass), as tree verification runs:
    its keys pending, then committed, all T of them (a step commits the accepted path)."""
    cache = KVCache.init(model.config, batch, cache_len, model.dtype)
    tokens = jnp.ones((batch, T), jnp.int32)
    start = jnp.full((batch,), cache_len // 2, jnp.int32)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)
    passes = 50

    @jax.jit
    def loop(model, cache):
        def one(i, cache):
            placement, at = None, positions
            if tree:  # the mask's content does not change the cost; a chain's shape serves
                anc = ancestors(np.arange(T - 1, dtype=np.int32))
                at = positions + i % 2  # a start that moves: nothing of the placement is loop-invariant
                placement = tree_placement(at[:, 0], depths(anc), jnp.broadcast_to(anc, (batch, T, T)))
            logits, _, cache, *pending = apply(model, tokens, at, cache, exit_layer=exit_layer,
                                               placement=placement, defer=tree)
            if pending:
                cache = commit(cache, pending[0], jnp.broadcast_to(jnp.arange(T), (batch, T)), at[:, 0])
            return cache.replace(lengths=cache.lengths + (logits[:, 0, 0] > jnp.inf))  # keep it live
        return jax.lax.fori_loop(0, passes, one, cache)

    return median_time(lambda: jax.block_until_ready(loop(model, cache)), repeats) / passes


@dataclasses.dataclass
class Run:
    """One timed configuration over the whole prompt set."""

    drafter: str
    K: int  # draft tokens per step (a tree's node count)
    temperature: float
    batch: int
    seconds: float
    tokens: int
    steps: int  # target passes summed over rows
    drafted: int
    accepted: int
    tokens_per_s: float = 0.0
    speedup: float = 1.0
    theory: float | None = None
    passes: float | None = None
    verify_ms: float | None = None  # one target pass over K+1 tokens, in a compiled loop
    exact: bool | None = None
    trace: list | None = None  # tokens per step of the first row of the first batch
    traces: list | None = None  # tokens per step of every row
    shape: str = ""  # "chain" or the tree: depth/top_k/nodes
    accelerator: float | None = None  # predicted speedup where a pass costs its one-token time
    depth_acceptance: list | None = None  # per depth k: the fraction of steps keeping >= k drafts
    loops: int = 0  # loop steps summed over batches (each runs until its slowest row is done)

    @property
    def acceptance(self):
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_pass(self):
        return self.tokens / self.steps

    def as_dict(self) -> dict:
        """Every field, with acceptance and tokens per pass: a report's JSON row."""
        return {**dataclasses.asdict(self), "acceptance": self.acceptance, "tokens_per_pass": self.tokens_per_pass}


def _num_draft_tokens(drafter, K):
    """generate's num_draft_tokens for time_generate's K: None or "auto" as they are; without
    a drafter, 0 is none at all (generate refuses a K it would have nothing to draft with)."""
    if K in (None, "auto"):
        return K
    return (K or None) if drafter is None else max(K, 1)


def time_generate(target, prompts: list[list[int]], batch: int, repeats: int, drafter=None, K=0,
                  name="none", temperature=0.0, max_new_tokens=64, eos_token_id=None, seed=0, warm=True,
                  **options) -> tuple[Run, list]:
    """Runs every prompt (in batches of `batch`) and times the whole set; returns the Run and
    the generated rows (for exactness checks). K=None: the drafter's own tree fixes the shape;
    "auto": generate's num_draft_tokens="auto"."""
    groups = [prompts[i: i + batch] for i in range(0, len(prompts), batch)]
    padded = [pad_prompts(g) for g in groups]
    result = {}

    def call():
        result["outs"] = [jax.block_until_ready(generate(
            target, p, l, draft=drafter, key=jax.random.key(seed), max_new_tokens=max_new_tokens,
            num_draft_tokens=_num_draft_tokens(drafter, K), temperature=temperature,
            eos_token_id=eos_token_id,
            return_trace=True, **options)) for p, l in padded]

    seconds = median_time(call, repeats, warm)
    outs = [jax.tree.map(np.asarray, o) for o in result["outs"]]
    total = lambda f: int(sum(f(o).sum() for o in outs))  # noqa: E731
    rows = [o.tokens[b, : o.num_tokens[b]].tolist() for o in outs for b in range(o.tokens.shape[0])]
    traces = [t for o in outs for t in row_traces(o)]
    run = Run(name, K if isinstance(K, int) else 0, temperature, batch, seconds, total(lambda o: o.num_tokens),
              total(lambda o: o.stats.steps), total(lambda o: o.stats.drafted),
              total(lambda o: o.stats.accepted), trace=traces[0], traces=traces,
              loops=sum(int(o.stats.steps.max()) for o in outs))
    run.tokens_per_s = run.tokens / seconds
    return run, rows


def predict(run: Run, K: int, t_target: float, t_step: float, t_catch_up: float, t_verify: float):
    """Sets the run's two predicted speedups from measured pass times (seconds): Leviathan
    et al.'s E[tokens per pass] / (K c + 1), alpha fitted to the accepted drafts per step;
    and tokens per pass x one target pass / the step's own model passes (draft catch-up,
    K-1 draft steps, the K+1-token verification)."""
    alpha = theory.alpha_from_accepted(run.accepted / run.steps, K)
    run.theory = theory.predicted_speedup(alpha, K, t_step / t_target)
    run.passes = run.tokens_per_pass * t_target / (t_catch_up + (K - 1) * t_step + t_verify)
    run.verify_ms = t_verify * 1e3


def first_divergence(row: list[int], reference: list[int]) -> int | None:
    """The first position where a generated row differs from the reference row (one ending
    early counts as differing where it ends); None when they are equal."""
    for i, (a, b) in enumerate(zip(row, reference)):
        if a != b:
            return i
    return None if len(row) == len(reference) else min(len(row), len(reference))


# ---- prompts ---------------------------------------------------------------------------


def held_out_prompts(tokenizer, num_prompts: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """specjax.train.data.held_out_prompts (imported when first called, as before: training's
    modules stay out of a measurement that needs no prompts)."""
    from specjax.train.data import held_out_prompts

    return held_out_prompts(tokenizer, num_prompts, prompt_tokens, seed)


# ---- tables ----------------------------------------------------------------------------


def fmt(x, spec=".2f") -> str:
    """A number in `spec`, or "-" for None."""
    return "-" if x is None else format(x, spec)


def print_runs(runs, log):
    """Runs as a table: speed, acceptance, the two predictions and exactness, one line each."""
    log(f"\n{'drafter':<20} {'temp':>4} {'K':>2} {'tok/s':>8} {'speedup':>7} {'accept':>6} "
        f"{'tok/pass':>8} {'verify ms':>9} {'theory':>6} {'passes':>6} {'meas/theory':>11} "
        f"{'meas/passes':>11} exact")
    for r in runs:
        log(f"{r.drafter:<20} {r.temperature:>4.1f} {r.K:>2} {r.tokens_per_s:>8.1f} {r.speedup:>7.2f} "
            f"{fmt(r.acceptance):>6} {r.tokens_per_pass:>8.2f} {fmt(r.verify_ms):>9} "
            f"{fmt(r.theory):>6} {fmt(r.passes):>6} {fmt(r.theory and r.speedup / r.theory):>11} "
            f"{fmt(r.passes and r.speedup / r.passes):>11} {fmt(r.exact, '')}")


# ---- transformers on the same checkpoints -----------------------------------------------


def run_transformers(target_path, draft_path, prompts, max_new_tokens, repeats, auto: Run, spec: Run, log):
    """transformers' generate, batch 1 (it refuses more for assisted decoding), greedy: plain,
    assistant_model, prompt_lookup_num_tokens. float32 on CPU; on a CUDA GPU, bfloat16 there."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, torch.get_num_threads()))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=dtype).to(device).eval()
    modes = {"plain": {}, "assistant_model": {"assistant_model": draft},
             "prompt_lookup_num_tokens": {"prompt_lookup_num_tokens": 10}}
    results = {}
    for name, extra in modes.items():
        def call():
            with torch.no_grad():
                out = [target.generate(torch.tensor([p], device=device), max_new_tokens=max_new_tokens,
                                       min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **extra)
                       for p in prompts]
            if device == "cuda":
                torch.cuda.synchronize()
            return out
        seconds = median_time(call, repeats)
        tokens = len(prompts) * max_new_tokens
        results[name] = {"tokens_per_s": tokens / seconds}
    log(f"\ntransformers (torch, {str(dtype).split('.')[-1]} on {device}, batch 1, greedy) on the same "
        f"checkpoints and prompts:")
    for name, r in results.items():
        log(f"  {name:<26} {r['tokens_per_s']:>8.1f} tok/s; specjax speculative (K={spec.K}) is "
            f"{spec.tokens_per_s / r['tokens_per_s']:.2f}x, specjax autoregressive "
            f"{auto.tokens_per_s / r['tokens_per_s']:.2f}x")
    return results
