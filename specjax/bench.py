"""Benchmarks behind `specjax bench`: autoregressive vs speculative `generate`, timed side
by side in one run, with the speedup theory predicts set beside the measured one.

    specjax bench                         # the shipped pair on held-out stdlib code
    specjax bench --hf                    # ... and transformers' generate on the same pair
    specjax bench --synthetic llama-1b    # no checkpoints: a random Llama-3.2-1B-shaped pair, the
                                          # weight-read roofline, pass costs (see specjax.synthetic)
    specjax bench --profile               # only the cost profile behind num_draft_tokens="auto"
    specjax bench --training-free-only    # lookahead, retrieval (REST), prompt lookup vs the draft model
    specjax bench --auto-k-only           # num_draft_tokens="auto" against every fixed K, per batch size
    specjax bench --dtype bfloat16        # low precision: rows that diverge from autoregressive

Times are medians over --repeats runs after a warm-up (compile) run; machines are noisy, so
read the ratios. "theory" is Leviathan et al.: E[tokens per pass] / (K c + 1) with alpha
fitted to the measured accepted drafts per step and c the measured cost of one draft step
over one target pass. "passes" replaces (K c + 1) by the measured time of the step's own
model passes (draft catch-up, K-1 draft steps, verification): measured / passes is what
the loop costs beyond the models' own work.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax import theory
from specjax.cache import KVCache, tree_placement
from specjax.drafters import Datastore, DraftModel, EarlyExit, Lookahead, PromptLookup, Retrieval
from specjax.generate import generate, pad_prompts
from specjax.models import Model, apply
from specjax.tree import Tree, ancestors, depths


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
    tree: with a tree's placement (its mask built in the pass), as tree verification runs."""
    cache = KVCache.init(model.config, batch, cache_len, model.dtype)
    tokens = jnp.ones((batch, T), jnp.int32)
    start = jnp.full((batch,), cache_len // 2, jnp.int32)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)
    passes = 50

    @jax.jit
    def loop(model, cache):
        def one(i, cache):
            placement = None
            if tree:  # the mask's content does not change the cost; a chain's shape serves
                anc = ancestors(np.arange(T - 1, dtype=np.int32))
                placement = tree_placement(start + i % 2, positions, depths(anc),
                                           jnp.broadcast_to(anc, (batch, T, T)), cache_len)
            logits, _, cache = apply(model, tokens, positions, cache, exit_layer=exit_layer,
                                     placement=placement)
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
            num_draft_tokens=K if K in (None, "auto") else max(K, 1), temperature=temperature,
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


def row_traces(out) -> list[list[int]]:
    """A GenerateOutput's (with return_trace) tokens per step, row by row."""
    trace, steps = np.asarray(out.trace), np.asarray(out.stats.steps)
    return [trace[b, : steps[b]].tolist() for b in range(trace.shape[0])]


def depth_acceptance(traces: list[list[int]], depth: int) -> list[float]:
    """Per depth k = 1..depth, the fraction of steps that kept at least k drafted tokens,
    from each row's tokens per step (accepted + 1); a row's last step, which may be cut
    short, is left out."""
    accepted = np.array([c - 1 for t in traces for c in t[:-1]])
    return [float(np.mean(accepted >= k)) if accepted.size else 0.0 for k in range(1, depth + 1)]


def per_position_acceptance(traces: list[list[int]], K: int) -> list[float]:
    """P(draft i accepted | drafts 1..i-1 accepted), from tokens emitted per step (n + 1 in
    a step that was not cut short; the last step of a row may be, and is left out)."""
    accepted = np.array([c - 1 for t in traces for c in t[:-1]])
    if accepted.size == 0:
        return []
    return [float(np.mean(accepted[accepted >= i - 1] >= i)) if np.any(accepted >= i - 1) else 0.0
            for i in range(1, K + 1)]


def predict(run: Run, K: int, t_target: float, t_step: float, t_catch_up: float, t_verify: float):
    """Sets the run's two predicted speedups from measured pass times (seconds): Leviathan
    et al.'s E[tokens per pass] / (K c + 1), alpha fitted to the accepted drafts per step;
    and tokens per pass x one target pass / the step's own model passes (draft catch-up,
    K-1 draft steps, the K+1-token verification)."""
    alpha = theory.alpha_from_accepted(run.accepted / run.steps, K)
    run.theory = theory.predicted_speedup(alpha, K, t_step / t_target)
    run.passes = run.tokens_per_pass * t_target / (t_catch_up + (K - 1) * t_step + t_verify)
    run.verify_ms = t_verify * 1e3


# ---- prompts ---------------------------------------------------------------------------


def held_out_prompts(tokenizer, num_prompts: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """Windows of held-out standard-library code (modules the shipped pair never saw),
    each starting at a line that opens a def or class."""
    from specjax.train.data import split_corpus

    _, texts, _ = split_corpus()
    rng = np.random.RandomState(seed)
    prompts = []
    for _ in range(1000):
        if len(prompts) == num_prompts:
            break
        text = texts[rng.randint(len(texts))]
        starts = [i for i, line in enumerate(text.splitlines(keepends=True))
                  if line.lstrip().startswith(("def ", "class "))]
        if not starts:
            continue
        lines = text.splitlines(keepends=True)
        start = starts[rng.randint(len(starts))]
        ids = tokenizer.encode("".join(lines[start:]), add_special_tokens=False)
        if len(ids) >= prompt_tokens + 64:
            prompts.append(ids[:prompt_tokens])
    return prompts


# ---- the shipped pair (or any --target/--draft) -----------------------------------------


def run_pair(target_path: str, draft_path: str, out_dir: str | None = "bench", ks=range(1, 9),
             temperatures=(0.0, 1.0), batches=(1, 4, 16), num_prompts=16, prompt_tokens=64,
             max_new_tokens=64, repeats=3, hf=False, best_k: int | None = None, only: str | None = None,
             medusa: str | None = None, eagle: str | None = None, datastore: str | None = None,
             cost_profile: str | None = None, log=print) -> dict:
    """The whole bench, or one section of it: only = "trees", "heads", "training_free" or "auto_k"."""
    from specjax.hf import load_model, load_tokenizer

    if only not in (None, "trees", "heads", "training_free", "auto_k"):
        raise ValueError(f"unknown bench section {only!r}")
    temperatures = tuple(sorted(set(temperatures) | {0.0}))  # greedy is the reference run
    target, draft = load_model(target_path), load_model(draft_path)
    tokenizer = load_tokenizer(target_path)
    prompts = held_out_prompts(tokenizer, num_prompts, prompt_tokens)
    cache_len = pad_prompts(prompts)[0].shape[1] + max_new_tokens + max(ks)
    t_target = pass_time(target, 1, 1, cache_len, repeats)
    t_draft = pass_time(draft, 1, 1, cache_len, repeats)
    t_catch_up = pass_time(draft, 1, 2, cache_len, repeats)
    c = t_draft / t_target
    log(f"target {target.config.num_params() / 1e6:.2f}M params, draft {draft.config.num_params() / 1e6:.2f}M; "
        f"{jax.default_backend()} {target.dtype}; {len(prompts)} held-out prompts of {prompt_tokens} tokens, "
        f"{max_new_tokens} new tokens each; median of {repeats}")
    log(f"one target pass {t_target * 1e3:.2f} ms, one draft step {t_draft * 1e3:.2f} ms: c = {c:.3f}")
    trained = _trained_heads(medusa, eagle, log)
    datastore = Datastore.load(datastore) if datastore and Path(datastore).exists() else None
    if datastore is None:
        log("note: no datastore; retrieval runs only on the target's own outputs")
    if only == "auto_k":
        report = run_auto(target, draft, prompts, batches, ks, max_new_tokens, repeats, cost_profile, log=log)
        _write(report, out_dir, "auto_k.json", log)
        return report
    if only is not None:
        auto, auto_rows = time_generate(target, prompts, 1, repeats, None, 0, "none", 0.0, max_new_tokens)
        if only == "trees":
            report = run_trees(target, draft, prompts, auto, auto_rows, max_new_tokens, repeats, cache_len + 64,
                               log=log)
        elif only == "heads":
            report = run_heads(target, draft, trained, prompts, auto, auto_rows, max_new_tokens, repeats, log=log)
        else:
            report = run_training_free(target, draft, datastore, prompts, auto, auto_rows, max_new_tokens,
                                       repeats, log=log)
        _write({only: report}, out_dir, f"{only}.json", log)
        return {only: report}

    def speculate(K, temperature, batch, drafter=None, name="draft", on=None, **options):
        run, rows = time_generate(target, on or prompts, batch, repeats, drafter or draft, K, name,
                                  temperature, max_new_tokens, **options)
        if name == "draft":
            if K not in verify_times:
                verify_times[K] = pass_time(target, 1, K + 1, cache_len, repeats)
            predict(run, K, t_target, t_draft, t_catch_up, verify_times[K])
        return run, rows

    verify_times: dict[int, float] = {}
    runs: list[Run] = []
    auto = {}
    for temperature in temperatures:
        auto[temperature], auto_rows = time_generate(target, prompts, 1, repeats, None, 0, "none",
                                                     temperature, max_new_tokens)
        runs.append(auto[temperature])
        for K in ks:
            run, rows = speculate(K, temperature, 1)
            run.speedup = run.tokens_per_s / auto[temperature].tokens_per_s
            run.exact = rows == auto_rows if temperature == 0 else None
            runs.append(run)
        if temperature == 0:
            auto_greedy_rows = auto_rows
    greedy = [r for r in runs if r.drafter == "draft" and r.temperature == 0]
    best_k = best_k or max(greedy, key=lambda r: r.speedup).K
    by_batch = []
    for batch in batches:
        base, _ = time_generate(target, prompts, batch, repeats, None, 0, "none", 0.0, max_new_tokens)
        spec, _ = speculate(best_k, 0.0, batch)
        spec.speedup = spec.tokens_per_s / base.tokens_per_s
        by_batch.append((base, spec))
    # Every drafter on the same prompts (greedy, batch 1), and prompt lookup where it shines:
    # text that repeats itself (each prompt followed by its own first half again).
    L = target.config.num_layers
    others = []
    depths = sorted({max(1, L // 3), max(1, L // 2)})  # two depths where the target has them
    for name, drafter, K, options in (
            ("draft, adaptive", None, max(ks), dict(adaptive_k=True)),
            *((f"early exit {n}", EarlyExit(n), best_k, {}) for n in depths),
            ("prompt lookup", PromptLookup(3, 1), best_k, {})):
        run, rows = speculate(K, 0.0, 1, drafter, name, **options)
        run.speedup = run.tokens_per_s / auto[0.0].tokens_per_s
        run.exact = rows == auto_greedy_rows
        others.append(run)
    repetitive = [p + p[: len(p) // 2] + p for p in prompts]
    base, base_rows = time_generate(target, repetitive, 1, repeats, None, 0, "none (repetitive)",
                                    0.0, max_new_tokens)
    run, rows = speculate(best_k, 0.0, 1, PromptLookup(3, 1), "lookup (repetitive)", on=repetitive)
    run.speedup, run.exact = run.tokens_per_s / base.tokens_per_s, rows == base_rows
    others += [base, run]
    # Per-position acceptance over every row of every prompt, at the largest K.
    full_traces = _all_traces(target, draft, prompts, max(ks), max_new_tokens)
    positions = per_position_acceptance(full_traces, max(ks))

    _print_tables(runs, by_batch, others, positions, best_k, log)
    trees = run_trees(target, draft, prompts, auto[0.0], auto_greedy_rows, max_new_tokens, repeats,
                      cache_len + 64, log=log)
    training_free = run_training_free(target, draft, datastore, prompts, auto[0.0], auto_greedy_rows,
                                      max_new_tokens, repeats, K=best_k, log=log)
    auto_k = run_auto(target, draft, prompts, batches, ks, max_new_tokens, repeats, cost_profile, log=log)
    report = {"trees": trees, "training_free": training_free, "auto_k": auto_k, "c": c,
              "t_target_ms": t_target * 1e3, "t_draft_ms": t_draft * 1e3, "best_k": best_k,
              "runs": [_as_dict(r) for r in runs], "batches": [[_as_dict(b), _as_dict(s)] for b, s in by_batch],
              "other_drafters": [_as_dict(r) for r in others], "per_position_acceptance": positions}
    if hf:
        report["transformers"] = run_transformers(target_path, draft_path, prompts, max_new_tokens,
                                                  repeats, auto[0.0], [r for r in greedy if r.K == best_k][0], log)
    if out_dir:
        _write(report, out_dir, "bench.json", log)
        plot(report, Path(out_dir))
        log(f"wrote plots in {out_dir}/")
    return report


def first_divergence(row: list[int], reference: list[int]) -> int | None:
    """The first position where a generated row differs from the reference row (one ending
    early counts as differing where it ends); None when they are equal."""
    for i, (a, b) in enumerate(zip(row, reference)):
        if a != b:
            return i
    return None if len(row) == len(reference) else min(len(row), len(reference))


def run_divergence(target_path: str, draft_path: str, dtype: str = "bfloat16", out_dir: str | None = "bench",
                   ks=(1, 2, 4, 6, 8), batches=(1,), num_prompts=16, prompt_tokens=64, max_new_tokens=64,
                   repeats=3, log=print) -> dict:
    """Greedy speculative decoding against greedy autoregressive decoding of the same pair
    loaded in `dtype`, per K and batch size: how many rows differ, and where each first does.

    In float32 they are equal token for token (the tests' claim). In bfloat16 a verification
    pass over K+1 tokens may round differently from a one-token pass (other matmul shapes,
    other reduction orders), so where two tokens' logits are within rounding of each other
    the argmax can flip, and the rows go separate ways from there. Each row is still the
    target's own greedy choice at every position, given its rounding. Both with and without
    generate's deterministic=True (which closes this), for the draft model and for the
    target drafting for itself."""
    from specjax.hf import load_model, load_tokenizer

    target, draft = load_model(target_path, dtype=dtype), load_model(draft_path, dtype=dtype)
    itself = load_model(target_path, dtype=dtype)  # the sharpest probe: every rejection is arithmetic
    prompts = held_out_prompts(load_tokenizer(target_path), num_prompts, prompt_tokens)
    log(f"{jax.default_backend()} {dtype}; {len(prompts)} held-out prompts of {prompt_tokens} tokens, "
        f"{max_new_tokens} new tokens each, greedy; speculative rows compared with autoregressive rows "
        f"of the same batch size and the same deterministic flag")
    log(f"{'flag':>4} {'drafter':>7} {'batch':>5} {'K':>2} {'tok/s':>8} {'vs auto':>7} {'diverging rows':>14}  "
        f"first divergence (positions)")
    results = []
    for deterministic in (False, True):
        for batch in batches:
            auto, auto_rows = time_generate(target, prompts, batch, repeats, max_new_tokens=max_new_tokens,
                                            deterministic=deterministic)
            for (name, drafter), K in itertools.product((("draft", draft), ("itself", itself)), ks):
                run, rows = time_generate(target, prompts, batch, repeats, drafter, K, name, 0.0, max_new_tokens,
                                          deterministic=deterministic)
                first = [first_divergence(r, a) for r, a in zip(rows, auto_rows)]
                where = sorted(f for f in first if f is not None)
                results.append({"deterministic": deterministic, "drafter": name, "batch": batch, "K": K,
                                "rows": len(rows), "diverging": len(where), "first_divergence": first,
                                "tokens_per_s": run.tokens_per_s, "auto_tokens_per_s": auto.tokens_per_s,
                                "acceptance": run.acceptance})
                log(f"{'on' if deterministic else 'off':>4} {name:>7} {batch:>5} {K:>2} {run.tokens_per_s:>8.1f} "
                    f"{run.tokens_per_s / auto.tokens_per_s:>7.2f} {len(where):>6} of {len(rows):<5}  "
                    f"{' '.join(map(str, where)) or '-'}")
    total = sum(r["diverging"] for r in results)
    log(f"{total} of {sum(r['rows'] for r in results)} rows diverge from autoregressive output")
    report = {"dtype": dtype, "backend": jax.default_backend(), "max_new_tokens": max_new_tokens, "runs": results}
    _write(report, out_dir, f"divergence_{dtype}.json", log)
    return report


PROFILE_TREE, PROFILE_TREE_NODES = (4, 2), (2, 4, 6, 8, 12)  # the tree family a profile measures


def measure_profile(target_path: str, draft_path: str, out_dir: str | None = "bench", max_k: int = 8,
                    batches=(1, 4, 16), num_prompts=16, prompt_tokens=64, max_new_tokens=64, repeats=3,
                    tree_family: tuple[int, int] | None = PROFILE_TREE, tree_nodes=PROFILE_TREE_NODES,
                    log=print) -> theory.CostProfile:
    """The cost profile that `generate(num_draft_tokens="auto")` reads: one whole loop step
    with K = 0..max_k drafts of the draft model per batch size ((the time of generate - the
    time of its prefill) / the loop's steps, greedy), and the draft's per-position
    acceptance at K = max_k; then the same for the draft model growing Tree(depth, top_k, n)
    (tree_family = (depth, top_k)) for every n in tree_nodes, with how deep each budget's
    accepted paths reach. Acceptance and reach come from the timed runs' own traces at the
    first batch size. Held-out prompts other than the bench's (seed 1), so that
    `specjax bench --auto-k-only` checks the choice on text it was not made from. Written
    as profile.json in out_dir."""
    from specjax.hf import load_model, load_tokenizer

    target, draft = load_model(target_path), load_model(draft_path)
    prompts = held_out_prompts(load_tokenizer(target_path), num_prompts, prompt_tokens, seed=1)
    shapes = [(draft if K else None, K) for K in range(max_k + 1)]
    if tree_family is not None:
        shapes += [(DraftModel(draft, Tree(*tree_family, n)), None) for n in tree_nodes]
    step_ms, traces = [], []  # traces: each shape's rows' tokens per step, at the first batch size
    for batch in batches:
        prefill, _ = time_generate(target, prompts, batch, repeats, max_new_tokens=1)
        row = []
        for drafter, K in shapes:
            run, _ = time_generate(target, prompts, batch, repeats, drafter, K, max_new_tokens=max_new_tokens)
            row.append(1e3 * max(run.seconds - prefill.seconds, 1e-9) / (run.loops - prefill.loops))
            if batch == batches[0]:  # greedy: every batch size accepts the same paths
                traces.append(run.traces)
        step_ms.append(row)
        log(f"batch {batch}: one loop step with K = 0..{max_k} drafts "
            f"{' '.join(f'{t:.2f}' for t in row[: max_k + 1])} ms"
            + ("" if tree_family is None else f"; Tree({tree_family[0]}, {tree_family[1]}, n) for n = "
               f"{' '.join(map(str, tree_nodes))}: {' '.join(f'{t:.2f}' for t in row[max_k + 1:])} ms"))
    acceptance = per_position_acceptance(traces[max_k], max_k)
    log(f"per-position acceptance at K = {max_k}: {' '.join(f'{a:.2f}' for a in acceptance)}")
    trees = ()
    if tree_family is not None:
        reach = tuple(tuple(depth_acceptance(t, tree_family[0])) for t in traces[max_k + 1:])
        trees = (theory.TreeBudgets(*tree_family, tuple(tree_nodes), tuple(tuple(r[max_k + 1:]) for r in step_ms),
                                    reach),)
        for n, r in zip(tree_nodes, trees[0].reach):
            log(f"Tree({tree_family[0]}, {tree_family[1]}, {n}): P(a step keeps >= d drafts), d = 1..: "
                f"{' '.join(f'{a:.2f}' for a in r)}")
    command = (f"specjax bench --profile --batches {' '.join(map(str, batches))} -k {max_k} "
               f"--num-prompts {num_prompts} --repeats {repeats}")
    if tree_family is not None:
        command += f" --profile-tree {tree_family[0]},{tree_family[1]} --tree-nodes {' '.join(map(str, tree_nodes))}"
    profile = theory.CostProfile(tuple(batches), tuple(tuple(r[: max_k + 1]) for r in step_ms), tuple(acceptance),
                                 trees, {"backend": jax.default_backend(), "dtype": str(target.dtype),
                                         "target": str(target_path), "draft": str(draft_path), "command": command})
    for batch in batches:
        choice = f"K = {theory.choose_num_draft_tokens(profile, batch, max_new_tokens=max_new_tokens)}"
        if tree_family is not None:
            nodes = theory.choose_tree_nodes(profile, *tree_family, batch, max(tree_nodes), max_new_tokens)
            choice += f" for a chain, nodes = {nodes} for Tree({tree_family[0]}, {tree_family[1]}, n)"
        log(f"batch {batch}: num_draft_tokens='auto' picks {choice} for {max_new_tokens} new tokens")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        profile.save(Path(out_dir) / "profile.json")
        log(f"wrote {Path(out_dir) / 'profile.json'}")
    return profile


def _write(report: dict, out_dir: str | None, name: str, log):
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {out / name}")


# ---- trees ----------------------------------------------------------------------------

# Top-2 dynamic trees of depths 5..10 against chains of the same depths, and a static tree.
TREES = (Tree(5, 2, 16), Tree(6, 2, 20), Tree(8, 2, 24), Tree(10, 2, 32), Tree(8, 4, 32),
         Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0),
                          (0, 0, 0, 0, 0)]))


def describe(tree: Tree) -> str:
    if tree.is_chain:
        return f"chain {tree.depth}"
    return f"{'static' if tree.is_static else 'tree'} d{tree.depth} k{tree.top_k} n{tree.nodes}"


def run_trees(target, draft, prompts, auto: Run, auto_rows, max_new_tokens, repeats, cache_len,
              trees=TREES, log=print) -> dict:
    """Chains against trees for the draft model and early exit (greedy, batch 1): tokens per
    target pass, tok/s, speedup, exactness; the verification pass's measured cost by node
    count; and what the tokens per pass predict on an accelerator, where a pass over up to
    ~64 tokens costs about what one token costs at batch 1: tokens per pass / (1 + depth x c),
    c the measured one-token cost of a draft step over a target pass."""
    L = target.config.num_layers
    t_target = pass_time(target, 1, 1, cache_len, repeats)
    exit_layers = max(1, L // 2)
    drafters = {"draft": (lambda tree: DraftModel(draft, tree), pass_time(draft, 1, 1, cache_len, repeats)),
                f"early exit {exit_layers}": (lambda tree: EarlyExit(exit_layers, tree),
                                              pass_time(target, 1, 1, cache_len, repeats, exit_layer=exit_layers))}
    shapes = sorted({t.depth for t in trees})
    runs = []
    for name, (make, t_draft) in drafters.items():
        for tree in [Tree.chain(d) for d in shapes] + list(trees):
            run, rows = time_generate(target, prompts, 1, repeats, make(tree), None, name, 0.0, max_new_tokens)
            run.shape, run.K = describe(tree), tree.nodes
            run.speedup, run.exact = run.tokens_per_s / auto.tokens_per_s, rows == auto_rows
            run.accelerator = run.tokens_per_pass / (1 + tree.depth * t_draft / t_target)
            runs.append(run)
    costs = {T: pass_time(target, 1, T, cache_len, repeats, tree=T > 1) / t_target
             for T in sorted({1} | {t.depth + 1 for t in trees} | {t.nodes + 1 for t in trees})}
    log(f"\ntrees vs chains (greedy, batch 1; autoregressive {auto.tokens_per_s:.1f} tok/s); "
        f"'accel' = tokens per pass / (1 + depth x c): the speedup if every pass cost its one-token time")
    log(f"{'drafter':<14} {'shape':<18} {'tok/pass':>8} {'tok/s':>8} {'speedup':>7} {'accel':>6} exact")
    for r in runs:
        log(f"{r.drafter:<14} {r.shape:<18} {r.tokens_per_pass:>8.2f} {r.tokens_per_s:>8.1f} "
            f"{r.speedup:>7.2f} {r.accelerator:>6.2f} {r.exact}")
    log("target verification pass over T tokens (tree mask), in one-token passes: " +
        ", ".join(f"T={T}: {c:.2f}" for T, c in costs.items()))
    return {"runs": [_as_dict(r) for r in runs], "verify_cost": costs, "t_target_ms": t_target * 1e3}


HEAD_SHAPES = {"chain": None, "tree": Tree(depth=6, top_k=2, nodes=20)}


def run_heads(target, draft, trained: dict, prompts, auto: Run, auto_rows, max_new_tokens, repeats,
              log=print) -> dict:
    """The draft model against trained heads (trained: name -> Medusa/Eagle), each as a
    chain and as a tree (greedy, batch 1): tokens per target pass, acceptance by depth
    (the fraction of steps that kept at least k drafted tokens), tok/s and the ratio to
    autoregressive, and whether the output equals it."""
    drafters = {"draft model": DraftModel(draft), **trained}
    runs = []
    for name, drafter in drafters.items():
        heads = getattr(drafter, "num_heads", None)  # Medusa: its heads fix the depth
        for shape, tree in HEAD_SHAPES.items():
            if tree is None:  # a chain: Medusa's of its heads (top-1 each), the others' of 5
                tree = Tree.chain(5, "sampled") if heads is None else Tree.chain(heads, "top_k")
            elif heads is not None:  # as many nodes as its depth allows
                k = tree.top_k
                tree = Tree(depth=heads, top_k=k, nodes=min(tree.nodes, k + (heads - 1) * k * k))
            run, rows = time_generate(target, prompts, 1, repeats, drafter.replace(tree=tree), None, name,
                                      0.0, max_new_tokens)
            run.shape, run.K = describe(tree), tree.nodes
            run.speedup, run.exact = run.tokens_per_s / auto.tokens_per_s, rows == auto_rows
            run.depth_acceptance = depth_acceptance(run.traces, tree.depth)
            runs.append(run)
    log(f"\ndraft model vs trained heads (greedy, batch 1; autoregressive {auto.tokens_per_s:.1f} tok/s); "
        f"'at depth k': the fraction of steps that kept >= k drafted tokens")
    log(f"{'drafter':<12} {'shape':<16} {'tok/pass':>8} {'tok/s':>8} {'vs auto':>7} exact  at depth 1..")
    for r in runs:
        log(f"{r.drafter:<12} {r.shape:<16} {r.tokens_per_pass:>8.2f} {r.tokens_per_s:>8.1f} "
            f"{r.speedup:>7.2f} {str(r.exact):<5}  " + " ".join(f"{a:.2f}" for a in r.depth_acceptance))
    return {"runs": [_as_dict(r) for r in runs]}


# ---- drafting without a trained drafter --------------------------------------------------

LOOKAHEADS = (Lookahead(5, 4, 5), Lookahead(7, 5, 7), Lookahead(10, 4, 10))


def run_training_free(target, draft, datastore, prompts, auto: Run, auto_rows, max_new_tokens, repeats,
                      K: int = 4, lookaheads=LOOKAHEADS, log=print) -> dict:
    """Lookahead and retrieval (REST) beside prompt lookup and the draft model (greedy, batch
    1): tokens per target pass, tok/s, the ratio to autoregressive, exactness. Retrieval runs
    on `datastore` (None: left out) and on a datastore that also holds the target's own
    outputs for these prompts (the text being generated: its best case)."""
    drafters = [("draft model", DraftModel(draft), K), ("prompt lookup", PromptLookup(3, 1), K)]
    drafters += [(f"lookahead W{d.window} N{d.ngram} G{d.guesses}", d, None) for d in lookaheads]
    stores = {} if datastore is None else {"REST": datastore}
    own = [p + r for p, r in zip(prompts, auto_rows)]
    stores["REST, own outputs"] = own if datastore is None else _with_documents(datastore, own)
    for name, store in stores.items():
        store = store if isinstance(store, Datastore) else Datastore.build(store)
        drafters += [(f"{name} chain", Retrieval(store), 8), (f"{name} tree", Retrieval(store, tree=Tree(8, 2, 16)), None)]
    runs = []
    for name, drafter, k in drafters:
        run, rows = time_generate(target, prompts, 1, repeats, drafter, k, name, 0.0, max_new_tokens)
        tree = drafter.resolve(k).tree
        run.shape, run.K = describe(tree), tree.nodes
        run.speedup, run.exact = run.tokens_per_s / auto.tokens_per_s, rows == auto_rows
        runs.append(run)
    log(f"\ndrafting without a trained drafter (greedy, batch 1; autoregressive {auto.tokens_per_s:.1f} tok/s)")
    log(f"{'drafter':<28} {'shape':<16} {'tok/pass':>8} {'tok/s':>8} {'vs auto':>7} exact")
    for r in runs:
        log(f"{r.drafter:<28} {r.shape:<16} {r.tokens_per_pass:>8.2f} {r.tokens_per_s:>8.1f} {r.speedup:>7.2f} {r.exact}")
    return {"runs": [_as_dict(r) for r in runs]}


def _with_documents(datastore: Datastore, documents) -> Datastore:
    """A datastore holding `datastore`'s documents and more."""
    tokens = np.asarray(datastore.tokens)
    cuts = np.flatnonzero(tokens < 0)
    return Datastore.build([d[:-1].tolist() for d in np.split(tokens, cuts + 1)[:-1]] + list(documents))


def run_auto(target, draft, prompts, batches, ks, max_new_tokens, repeats, cost_profile=None, log=print) -> dict:
    """Auto's chain K against every fixed K, then, for every tree family the profile
    measured, auto's node budget against every measured budget."""
    profile = theory.resolve_profile(cost_profile, jax.default_backend())
    if profile is None:
        raise ValueError(f"no cost profile is shipped for the {jax.default_backend()!r} backend: measure one with "
                         f"`specjax bench --profile` and pass --cost-profile PATH")
    chain = run_auto_k(target, draft, prompts, batches, ks, max_new_tokens, repeats, profile, log=log)
    trees = [run_auto_k(target, draft, prompts, batches, family.nodes, max_new_tokens, repeats, profile,
                        tree=Tree(family.depth, family.top_k, max(family.nodes)), log=log) for family in profile.trees]
    return {"chain": chain, "trees": trees}


def run_auto_k(target, draft, prompts, batches, ks, max_new_tokens, repeats, cost_profile=None, tree=None,
               log=print) -> dict:
    """num_draft_tokens="auto" against every fixed K in ks (0: autoregressive) per batch size
    (greedy): its choice, its tok/s over the best fixed K's and over autoregressive, each the
    median of `repeats` rounds that time every shape once (after one untimed round). With a
    dynamic `tree`, auto's node budget for DraftModel(draft, tree) against Tree(depth, top_k,
    n) for every n in ks instead."""
    from specjax.generate import auto_shape

    if tree is None:
        unit, auto_drafter = "K", draft
        fixed_shapes = {K: (draft if K else None, K) for K in (0, *ks)}
    else:
        unit, auto_drafter = "nodes", DraftModel(draft, tree)
        fixed_shapes = {0: (None, 0), **{n: (DraftModel(draft, Tree(tree.depth, tree.top_k, n)), None) for n in ks}}
    shapes = {**fixed_shapes, "auto": (auto_drafter, "auto")}
    rows = []
    for batch in batches:
        # Round robin: every shape once per round, so that the machine's drift falls on all alike.
        samples = {label: [] for label in shapes}
        for r in range(repeats + 1):  # round 0 compiles and warms up; its times are dropped
            for label, (drafter, K) in shapes.items():
                options = {"cost_profile": cost_profile} if label == "auto" else {}
                run, _ = time_generate(target, prompts, batch, 1, drafter, K, str(label), 0.0, max_new_tokens,
                                       warm=False, **options)
                if r:
                    samples[label].append(run.tokens_per_s)
        rate = {label: statistics.median(v) for label, v in samples.items()}
        fixed = {label: rate[label] for label in fixed_shapes}
        chosen, K = auto_shape(batch, auto_drafter, cost_profile, max_new_tokens)
        choice = 0 if chosen is None else K if tree is None else chosen.tree.nodes
        best = max(fixed, key=fixed.get)
        rows.append({"batch": batch, "tokens_per_s": fixed, "auto_k": choice, "auto_tokens_per_s": rate["auto"],
                     "best_k": best, "auto_over_best": rate["auto"] / fixed[best],
                     "auto_over_autoregressive": rate["auto"] / fixed[0]})
    family = "" if tree is None else f" for Tree({tree.depth}, {tree.top_k}, n), n = nodes"
    log(f"\nnum_draft_tokens='auto' vs fixed {unit}{family} (greedy; tok/s; {unit} = 0 is autoregressive)")
    log(f"{'batch':>5} " + " ".join(f"{unit + '=' + str(K):>8}" for K in fixed_shapes) + f" {'auto':>14} "
        f"{'best':>8} {'auto/best':>9} {'auto/AR':>7}")
    for r in rows:
        log(f"{r['batch']:>5} " + " ".join(f"{r['tokens_per_s'][K]:>8.1f}" for K in fixed_shapes)
            + f" {unit + '=' + str(r['auto_k']) + ' ' + format(r['auto_tokens_per_s'], '.1f'):>14} "
            f"{unit + '=' + str(r['best_k']):>8} {r['auto_over_best']:>9.2f} {r['auto_over_autoregressive']:>7.2f}")
    return {"unit": unit, "tree": None if tree is None else describe(tree), "rows": rows}


def _all_traces(target, draft, prompts, K, max_new_tokens):
    padded, lengths = pad_prompts(prompts)
    return row_traces(generate(target, padded, lengths, draft=draft, max_new_tokens=max_new_tokens,
                               num_draft_tokens=K, return_trace=True))


def _as_dict(run: Run) -> dict:
    d = dataclasses.asdict(run)
    d.update(acceptance=run.acceptance, tokens_per_pass=run.tokens_per_pass)
    return d


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _print_runs(runs, log):
    log(f"\n{'drafter':<20} {'temp':>4} {'K':>2} {'tok/s':>8} {'speedup':>7} {'accept':>6} "
        f"{'tok/pass':>8} {'verify ms':>9} {'theory':>6} {'passes':>6} {'meas/theory':>11} "
        f"{'meas/passes':>11} exact")
    for r in runs:
        log(f"{r.drafter:<20} {r.temperature:>4.1f} {r.K:>2} {r.tokens_per_s:>8.1f} {r.speedup:>7.2f} "
            f"{_fmt(r.acceptance):>6} {r.tokens_per_pass:>8.2f} {_fmt(r.verify_ms):>9} "
            f"{_fmt(r.theory):>6} {_fmt(r.passes):>6} {_fmt(r.theory and r.speedup / r.theory):>11} "
            f"{_fmt(r.passes and r.speedup / r.passes):>11} {_fmt(r.exact, '')}")


def _print_tables(runs, by_batch, others, positions, best_k, log):
    _print_runs(runs + others, log)
    log(f"\nbatch size (greedy, K={best_k}): autoregressive tok/s -> speculative tok/s (speedup)")
    for base, spec in by_batch:
        log(f"  B={base.batch:<3} {base.tokens_per_s:>8.1f} -> {spec.tokens_per_s:>8.1f} ({spec.speedup:.2f}x, "
            f"acceptance {_fmt(spec.acceptance)})")
    log(f"acceptance by draft position (greedy, K={len(positions)}): " + " ".join(f"{p:.2f}" for p in positions))


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


# ---- plots -----------------------------------------------------------------------------


def plot(report: dict, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if r["drafter"] == "draft"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for temperature in sorted({r["temperature"] for r in runs}):
        rs = [r for r in runs if r["temperature"] == temperature]
        ax.plot([r["K"] for r in rs], [r["speedup"] for r in rs], "o-", label=f"measured, T={temperature:g}")
        ax.plot([r["K"] for r in rs], [r["theory"] for r in rs], "x--", label=f"theory, T={temperature:g}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xlabel="draft tokens per step (K)", ylabel="speedup over autoregressive", title="Speedup vs K")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_k.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    positions = report["per_position_acceptance"]
    ax.bar(range(1, len(positions) + 1), positions)
    ax.set(xlabel="draft position i", ylabel="P(accept d_i | d_1..d_{i-1} accepted)", ylim=(0, 1),
           title="Acceptance by draft position (greedy)")
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    batches = report["batches"]
    sizes = [b["batch"] for b, _ in batches]
    ax.plot(sizes, [b["tokens_per_s"] for b, _ in batches], "o-", label="autoregressive")
    ax.plot(sizes, [s["tokens_per_s"] for _, s in batches], "o-", label=f"speculative, K={report['best_k']}")
    ax.set(xscale="log", xticks=sizes, xticklabels=[str(s) for s in sizes], xlabel="batch size",
           ylabel="tokens/s", title="Throughput vs batch size (greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s_vs_batch.png", dpi=120)

    fig, ax = plt.subplots(figsize=(7, 3))
    best = [r for r in runs if r["temperature"] == 0 and r["K"] == report["best_k"]][0]
    ax.bar(range(len(best["trace"])), best["trace"])
    ax.set(xlabel="step", ylabel="tokens emitted", title=f"Tokens per step over one generation (K={best['K']})")
    fig.tight_layout()
    fig.savefig(out / "tokens_per_step.png", dpi=120)
    plt.close("all")


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    run_from_args(parser.parse_args(argv))


def _trained_heads(medusa, eagle, log) -> dict:
    """name -> loaded drafter, for the trained heads whose folders exist."""
    from specjax.drafters import load_drafter

    out = {}
    for name, path in (("Medusa", medusa), ("EAGLE", eagle)):
        if path and (Path(path) / "drafter.json").exists():
            out[name] = load_drafter(path)
        elif path:
            log(f"note: no trained {name} drafter at {path}; left out")
    return out


def add_arguments(parser):
    from specjax.cli import default_checkpoint

    parser.add_argument("--target", default=default_checkpoint("target"))
    parser.add_argument("--draft", default=default_checkpoint("draft"))
    parser.add_argument("--synthetic", choices=["tiny", "gpt2-small", "llama-tiny", "llama-1b", "llama-8b"],
                        help="benchmark a random pair instead, in the backend's default dtype (see specjax.synthetic)")
    parser.add_argument("--draft-layers", type=int, default=2, help="--synthetic: the draft's depth")
    parser.add_argument("-k", "--ks", type=int, nargs="+", default=None, help="K values (default 1..8)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench", help="folder for bench.json and the plots")
    parser.add_argument("--hf", action="store_true", help="also time transformers' generate (needs torch)")
    parser.add_argument("--trees-only", action="store_true",
                        help="only the chains-vs-trees comparison (writes trees.json)")
    parser.add_argument("--heads-only", action="store_true",
                        help="only the draft model vs trained Medusa/EAGLE heads (writes heads.json)")
    parser.add_argument("--profile", action="store_true",
                        help="only measure the cost profile for num_draft_tokens='auto' (writes profile.json; "
                             "K up to the largest -k)")
    parser.add_argument("--training-free-only", action="store_true",
                        help="only lookahead and retrieval against prompt lookup and the draft model "
                             "(writes training_free.json)")
    parser.add_argument("--auto-k-only", action="store_true",
                        help="only num_draft_tokens='auto' against every fixed K per batch size (writes auto_k.json)")
    parser.add_argument("--profile-tree", default=",".join(map(str, PROFILE_TREE)), metavar="DEPTH,TOP_K",
                        help="the dynamic tree family --profile measures node budgets of ('none': chains only)")
    parser.add_argument("--tree-nodes", type=int, nargs="+", default=list(PROFILE_TREE_NODES),
                        help="the node budgets --profile measures for --profile-tree")
    parser.add_argument("--datastore", default=default_checkpoint("datastore"), help="a datastore for retrieval")
    parser.add_argument("--cost-profile", default=None, help="profile.json for 'auto' (default: the shipped one)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="bfloat16: only count rows of greedy speculative output that diverge from "
                             "autoregressive output, and where (writes divergence_bfloat16.json)")
    parser.add_argument("--medusa", default=default_checkpoint("medusa"), help="a saved Medusa drafter")
    parser.add_argument("--eagle", default=default_checkpoint("eagle"), help="a saved EAGLE drafter")


def _tree_family(text: str) -> tuple[int, int] | None:
    if text == "none":
        return None
    try:
        depth, top_k = (int(x) for x in text.split(","))
        Tree(depth, top_k, 1)
    except ValueError as e:
        raise SystemExit(f"--profile-tree {text!r}: give DEPTH,TOP_K such as 8,2, or none ({e})") from None
    return depth, top_k


def run_from_args(args):
    if args.dtype != "float32":
        sections = ("synthetic", "profile", "trees_only", "heads_only", "training_free_only", "auto_k_only", "hf")
        if any(getattr(args, name) for name in sections):
            raise SystemExit("--dtype bfloat16 runs the divergence count alone; leave out "
                             + ", ".join("--" + name.replace("_", "-") for name in sections))
        run_divergence(args.target, args.draft, args.dtype, args.out, ks=tuple(args.ks or (1, 2, 4, 6, 8)),
                       batches=tuple(args.batches), num_prompts=args.num_prompts, prompt_tokens=args.prompt_tokens,
                       max_new_tokens=args.max_new_tokens, repeats=args.repeats)
        return
    if args.profile:
        measure_profile(args.target, args.draft, args.out, max_k=max(args.ks or [8]), batches=tuple(args.batches),
                        num_prompts=args.num_prompts, prompt_tokens=args.prompt_tokens,
                        max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                        tree_family=_tree_family(args.profile_tree), tree_nodes=tuple(args.tree_nodes))
        return
    run_pair(args.target, args.draft, args.out, ks=tuple(args.ks or range(1, 9)),
             temperatures=tuple(args.temperatures), batches=tuple(args.batches),
             num_prompts=args.num_prompts, prompt_tokens=args.prompt_tokens,
             max_new_tokens=args.max_new_tokens, repeats=args.repeats, hf=args.hf,
             only=next((name for name in ("trees", "heads", "training_free", "auto_k")
                        if getattr(args, f"{name}_only")), None),
             medusa=args.medusa, eagle=args.eagle, datastore=args.datastore, cost_profile=args.cost_profile)


if __name__ == "__main__":
    main()
