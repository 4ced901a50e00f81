"""The shipped pair (or any --target/--draft) measured whole: `run_pair` (every K and
temperature, batch sizes, every drafter, then the sections of specjax.tools.bench.sections),
`run_divergence` (greedy rows that differ from autoregressive ones in low precision),
`measure_profile` (the cost profile behind num_draft_tokens="auto"), and their tables,
JSON reports and plots.

It loads checkpoints by path and writes reports; the timing itself is specjax.tools.measure's,
the argument parsing specjax.tools.bench.command's.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import jax

from specjax import theory
from specjax.drafters import Datastore, DraftModel, EarlyExit, PromptLookup
from specjax.generate import generate, pad_prompts
from specjax.text import target_tokenizer
from specjax.tools.bench.sections import run_auto, run_heads, run_training_free, run_trees, trained_heads
from specjax.tools.measure import (Run, depth_acceptance, first_divergence, fmt, held_out_prompts, pass_time,
                                   per_position_acceptance, predict, print_runs, row_traces, run_transformers,
                                   time_generate)
from specjax.tree import Tree


# ---- the whole bench -------------------------------------------------------------------


def run_quick(target_path: str, draft_path: str, out_dir: str | None = "bench", ks=(4,), temperatures=(0.0,),
              batches=(1,), num_prompts=8, prompt_tokens=64, max_new_tokens=64, repeats=5,
              tokenizer: str | None = None, log=print) -> dict:
    """`specjax bench` with no section flag: plain decoding against the draft model's chain
    at each K (drafting from the vocabulary saved beside it, as `specjax generate` does) on
    the same held-out prompts, for each temperature and batch size (a minute or
    two for the shipped pair on a 2-core CPU), in `repeats` interleaved rounds (plain, then
    each K, then plain again ...), so that a machine's drift weighs on both sides alike:
    the speedup is the median of the rounds' ratios, with their spread, and a line says
    when the spread is too wide to tell (`NOISE`). Each result is printed as measured and
    quick.json rewritten after it, so an interrupt keeps what was measured; `--sweep` is
    the whole bench."""
    from specjax.hf import load_model

    target, draft = load_model(target_path), DraftModel.load(draft_path)  # (its saved vocabulary, as generate's)
    prompts = held_out_prompts(target_tokenizer(target_path, tokenizer), num_prompts, prompt_tokens)
    log(f"target {target.config.num_params() / 1e6:.2f}M params, draft {draft.model.config.num_params() / 1e6:.2f}M"
        f"{'' if draft.vocab is None else f' drafting from {draft.vocab.shape[0]} ids'}; "
        f"{jax.default_backend()} {target.dtype}; {len(prompts)} held-out prompts of {prompt_tokens} tokens, "
        f"{max_new_tokens} new tokens each; {repeats} interleaved rounds after one that compiles, medians")
    log(f"{'temp':>4} {'batch':>5} {'K':>2} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} "
        f"{'spread':>11} {'accept':>6} {'tok/pass':>8} exact")
    report = {"backend": jax.default_backend(), "num_prompts": len(prompts), "prompt_tokens": prompt_tokens,
              "max_new_tokens": max_new_tokens, "repeats": repeats, "runs": []}
    noisy = []
    for temperature, batch in itertools.product(temperatures, batches):
        def timed(K: int, warm: bool):
            return time_generate(target, prompts, batch, 1, draft if K else None, K, "draft" if K else "none",
                                 temperature, max_new_tokens, warm=warm)

        first = {K: timed(K, warm=True) for K in (0, *ks)}  # (compiles, then one timed round)
        rounds = [{K: run for K, (run, _) in first.items()}]
        for _ in range(repeats - 1):
            rounds.append({K: timed(K, warm=False)[0] for K in (0, *ks)})
        plain_rows = first[0][1]
        plain = _median_run(r[0] for r in rounds)
        for K in ks:
            ratios = sorted(r[K].tokens_per_s / r[0].tokens_per_s for r in rounds)
            run = _median_run(r[K] for r in rounds)
            run.speedup = statistics.median(ratios)
            run.exact = first[K][1] == plain_rows if temperature == 0 else None
            spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}"
            log(f"{temperature:>4.1f} {batch:>5} {K:>2} {plain.tokens_per_s:>11.1f} {run.tokens_per_s:>10.1f} "
                f"{run.speedup:>6.2f}x {spread:>11} {fmt(run.acceptance):>6} {run.tokens_per_pass:>8.2f} "
                f"{ {True: 'yes', False: 'NO'}.get(run.exact, '-')}")
            if ratios[-1] - ratios[0] > NOISE * run.speedup:
                noisy.append(f"K={K} at temperature {temperature:g}, batch {batch}: {spread}")
            report["runs"].append({"plain": _brief(plain), "speculative": {**_brief(run), "ratios": ratios}})
            _write(report, out_dir, "quick.json", lambda line: None)
    if noisy:
        log(f"too noisy to tell: the rounds' speedups spread over more than {NOISE:.0%} of their median "
            f"({'; '.join(noisy)}): the machine's speed moved during the run (other work?); rerun when it is idle, "
            f"or with more --repeats")
    if out_dir:
        log(f"wrote {Path(out_dir) / 'quick.json'}")
    return report


NOISE = 0.15  # a spread of the rounds' speedups wider than this share of their median: too noisy to tell


def _median_run(runs) -> Run:
    """The run of median tokens/s among one configuration's rounds."""
    runs = sorted(runs, key=lambda run: run.tokens_per_s)
    return runs[(len(runs) - 1) // 2]


def _brief(run: Run) -> dict:
    """A run's figures without its per-row traces."""
    return {k: v for k, v in run.as_dict().items() if k not in ("trace", "traces")}


def run_pair(target_path: str, draft_path: str, out_dir: str | None = "bench", ks=range(1, 9),
             temperatures=(0.0, 1.0), batches=(1, 4, 16), num_prompts=16, prompt_tokens=64,
             max_new_tokens=64, repeats=3, hf=False, best_k: int | None = None, only: str | None = None,
             medusa: str | None = None, eagle: str | None = None, eagle3: str | None = None,
             datastore: str | None = None, cost_profile: str | None = None, tokenizer: str | None = None,
             log=print) -> dict:
    """The whole bench, or one section of it: only = "trees", "heads", "training_free" or "auto_k".
    tokenizer: the folder (or hub id) of the target's tokenizer (default: the target's)."""
    from specjax.hf import load_model

    if only not in (None, "trees", "heads", "training_free", "auto_k"):
        raise ValueError(f"unknown bench section {only!r}")
    temperatures = tuple(sorted(set(temperatures) | {0.0}))  # greedy is the reference run
    target, draft = load_model(target_path), load_model(draft_path)
    prompts = held_out_prompts(target_tokenizer(target_path, tokenizer), num_prompts, prompt_tokens)
    cache_len = pad_prompts(prompts)[0].shape[1] + max_new_tokens + max(ks)
    t_target = pass_time(target, 1, 1, cache_len, repeats)
    t_draft = pass_time(draft, 1, 1, cache_len, repeats)
    t_catch_up = pass_time(draft, 1, 2, cache_len, repeats)
    c = t_draft / t_target
    log(f"target {target.config.num_params() / 1e6:.2f}M params, draft {draft.config.num_params() / 1e6:.2f}M; "
        f"{jax.default_backend()} {target.dtype}; {len(prompts)} held-out prompts of {prompt_tokens} tokens, "
        f"{max_new_tokens} new tokens each; median of {repeats}")
    log(f"one target pass {t_target * 1e3:.2f} ms, one draft step {t_draft * 1e3:.2f} ms: c = {c:.3f}")
    trained = trained_heads(medusa, eagle, log, eagle3)
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
        log(f"  {name}, K={K}, T={temperature:g}, batch {batch}: {run.tokens_per_s:.1f} tok/s, "
            f"acceptance {fmt(run.acceptance)}")
        measured.append(_brief(run))
        _write({"complete": False, "runs": measured}, out_dir, "bench.json", lambda line: None)
        return run, rows

    measured = []  # every speculative run so far, written as it comes (an interrupt keeps them)

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
    report = {"complete": True, "trees": trees, "training_free": training_free, "auto_k": auto_k, "c": c,
              "t_target_ms": t_target * 1e3, "t_draft_ms": t_draft * 1e3, "best_k": best_k,
              "runs": [r.as_dict() for r in runs], "batches": [[b.as_dict(), s.as_dict()] for b, s in by_batch],
              "other_drafters": [r.as_dict() for r in others], "per_position_acceptance": positions}
    if hf:
        report["transformers"] = run_transformers(target_path, draft_path, prompts, max_new_tokens,
                                                  repeats, auto[0.0], [r for r in greedy if r.K == best_k][0], log)
    if out_dir:
        _write(report, out_dir, "bench.json", log)
        plot(report, Path(out_dir))
        log(f"wrote plots in {out_dir}/")
    return report


# ---- low precision: rows that diverge ----------------------------------------------------


def run_divergence(target_path: str, draft_path: str, dtype: str = "bfloat16", out_dir: str | None = "bench",
                   ks=(1, 2, 4, 6, 8), batches=(1,), num_prompts=16, prompt_tokens=64, max_new_tokens=64,
                   repeats=3, tokenizer: str | None = None, log=print) -> dict:
    """Greedy speculative decoding against greedy autoregressive decoding of the same pair
    loaded in `dtype`, per K and batch size: how many rows differ, and where each first does.

    In float32 they are equal token for token (the tests' claim). In bfloat16 a verification
    pass over K+1 tokens may round differently from a one-token pass (other matmul shapes,
    other reduction orders), so where two tokens' logits are within rounding of each other
    the argmax can flip, and the rows go separate ways from there. Each row is still the
    target's own greedy choice at every position, given its rounding. Both with and without
    generate's deterministic=True (which closes this), for the draft model and for the
    target drafting for itself. tokenizer: as run_pair's."""
    from specjax.hf import load_model

    target, draft = load_model(target_path, dtype=dtype), load_model(draft_path, dtype=dtype)
    itself = load_model(target_path, dtype=dtype)  # the sharpest probe: every rejection is arithmetic
    prompts = held_out_prompts(target_tokenizer(target_path, tokenizer), num_prompts, prompt_tokens)
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


# ---- the cost profile behind num_draft_tokens="auto" -------------------------------------


PROFILE_TREE, PROFILE_TREE_NODES = (4, 2), (2, 4, 6, 8, 12)  # the tree family a profile measures


def measure_profile(target_path: str, draft_path: str, out_dir: str | None = "bench", max_k: int = 8,
                    batches=(1, 4, 16), num_prompts=16, prompt_tokens=64, max_new_tokens=64, repeats=3,
                    tree_family: tuple[int, int] | None = PROFILE_TREE, tree_nodes=PROFILE_TREE_NODES,
                    tokenizer: str | None = None, log=print) -> theory.CostProfile:
    """The cost profile that `generate(num_draft_tokens="auto")` reads: one whole loop step
    with K = 0..max_k drafts of the draft model per batch size ((the time of generate - the
    time of its prefill) / the loop's steps, greedy), and the draft's per-position
    acceptance at K = max_k; then the same for the draft model growing Tree(depth, top_k, n)
    (tree_family = (depth, top_k)) for every n in tree_nodes, with how deep each budget's
    accepted paths reach. Each repeat times every shape once, in turn (medians of `repeats`).
    Acceptance and reach come from the timed runs' own traces at the first batch size. Held-out prompts other than the bench's (seed 1), so that
    `specjax bench --auto-k-only` checks the choice on text it was not made from. Written
    as profile.json in out_dir. tokenizer: as run_pair's."""
    from specjax.hf import load_model

    target, draft = load_model(target_path), load_model(draft_path)
    prompts = held_out_prompts(target_tokenizer(target_path, tokenizer), num_prompts, prompt_tokens, seed=1)
    shapes = [(draft if K else None, K) for K in range(max_k + 1)]
    if tree_family is not None:
        shapes += [(DraftModel(draft, Tree(*tree_family, n)), None) for n in tree_nodes]
    step_ms, traces = [], []  # traces: each shape's rows' tokens per step, at the first batch size
    for batch in batches:
        # Round-robin: each repeat times the prefill and every shape once, in turn, so that the
        # machine's drift falls on all of them alike (each shape's repeats in a row let it tilt
        # one K against another); each one's median.
        timed = [(None, 0, 1)] + [(drafter, K, max_new_tokens) for drafter, K in shapes]
        runs = [[] for _ in timed]
        for r in range(repeats):
            for i, (drafter, K, new_tokens) in enumerate(timed):
                runs[i].append(time_generate(target, prompts, batch, 1, drafter, K, max_new_tokens=new_tokens,
                                             warm=r == 0)[0])
        seconds = [statistics.median(run.seconds for run in each) for each in runs]
        prefill = runs[0][0]
        row = [1e3 * max(s - seconds[0], 1e-9) / (each[0].loops - prefill.loops)
               for s, each in zip(seconds[1:], runs[1:])]
        if batch == batches[0]:  # greedy: every batch size accepts the same paths
            traces = [each[0].traces for each in runs[1:]]
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


# ---- reports and tables ------------------------------------------------------------------


def _write(report: dict, out_dir: str | None, name: str, log):
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {out / name}")


def _all_traces(target, draft, prompts, K, max_new_tokens):
    padded, lengths = pad_prompts(prompts)
    return row_traces(generate(target, padded, lengths, draft=draft, max_new_tokens=max_new_tokens,
                               num_draft_tokens=K, return_trace=True))


def _print_tables(runs, by_batch, others, positions, best_k, log):
    print_runs(runs + others, log)
    log(f"\nbatch size (greedy, K={best_k}): autoregressive tok/s -> speculative tok/s (speedup)")
    for base, spec in by_batch:
        log(f"  B={base.batch:<3} {base.tokens_per_s:>8.1f} -> {spec.tokens_per_s:>8.1f} ({spec.speedup:.2f}x, "
            f"acceptance {fmt(spec.acceptance)})")
    log(f"acceptance by draft position (greedy, K={len(positions)}): " + " ".join(f"{p:.2f}" for p in positions))


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
