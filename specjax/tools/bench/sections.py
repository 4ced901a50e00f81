"""The bench's sections, each also run alone (`specjax bench --trees-only`, `--heads-only`,
`--training-free-only`, `--auto-k-only`): chains against trees, the draft model against
trained Medusa/EAGLE heads, drafting without a trained drafter (lookahead, retrieval,
prompt lookup), and num_draft_tokens="auto" against every fixed K or node budget.

Each takes loaded models and prompts and returns a JSON-ready dict, logging its table; it
does not load the pair, write files or parse arguments (specjax.tools.bench.pair and
specjax.tools.bench.command do).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import jax
import numpy as np

from specjax import theory
from specjax.drafters import Datastore, DraftModel, EarlyExit, Lookahead, PromptLookup, Retrieval, load_drafter
from specjax.tools.measure import Run, depth_acceptance, pass_time, time_generate
from specjax.tree import Tree


# ---- trees ----------------------------------------------------------------------------

# Top-2 dynamic trees of depths 5..10 against chains of the same depths, and a static tree.
TREES = (Tree(5, 2, 16), Tree(6, 2, 20), Tree(8, 2, 24), Tree(10, 2, 32), Tree(8, 4, 32),
         Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0),
                          (0, 0, 0, 0, 0)]))


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
            run.shape, run.K = str(tree), tree.nodes
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
    return {"runs": [r.as_dict() for r in runs], "verify_cost": costs, "t_target_ms": t_target * 1e3}


# ---- trained heads --------------------------------------------------------------------

HEAD_SHAPES = {"chain": None, "tree": Tree(depth=6, top_k=2, nodes=20)}


def trained_heads(medusa, eagle, log, eagle3=None) -> dict:
    """name -> loaded drafter, for the trained heads whose folders exist."""
    out = {}
    for name, path in (("Medusa", medusa), ("EAGLE", eagle), ("EAGLE-3", eagle3)):
        if path and (Path(path) / "drafter.json").exists():
            out[name] = load_drafter(path)
        elif path:
            log(f"note: no trained {name} drafter at {path}; left out")
    return out


def run_heads(target, draft, trained: dict, prompts, auto: Run, auto_rows, max_new_tokens, repeats,
              log=print) -> dict:
    """The draft model against trained heads (trained: name -> Medusa/Eagle/Eagle3), each as a
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
            run.shape, run.K = str(tree), tree.nodes
            run.speedup, run.exact = run.tokens_per_s / auto.tokens_per_s, rows == auto_rows
            run.depth_acceptance = depth_acceptance(run.traces, tree.depth)
            runs.append(run)
    log(f"\ndraft model vs trained heads (greedy, batch 1; autoregressive {auto.tokens_per_s:.1f} tok/s); "
        f"'at depth k': the fraction of steps that kept >= k drafted tokens")
    log(f"{'drafter':<12} {'shape':<16} {'tok/pass':>8} {'tok/s':>8} {'vs auto':>7} exact  at depth 1..")
    for r in runs:
        log(f"{r.drafter:<12} {r.shape:<16} {r.tokens_per_pass:>8.2f} {r.tokens_per_s:>8.1f} "
            f"{r.speedup:>7.2f} {str(r.exact):<5}  " + " ".join(f"{a:.2f}" for a in r.depth_acceptance))
    return {"runs": [r.as_dict() for r in runs]}


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
        drafters += [(f"{name} chain", Retrieval(store), 8),
                     (f"{name} tree", Retrieval(store, tree=Tree(8, 2, 16)), None)]
    runs = []
    for name, drafter, k in drafters:
        run, rows = time_generate(target, prompts, 1, repeats, drafter, k, name, 0.0, max_new_tokens)
        tree = drafter.resolve(k).tree
        run.shape, run.K = str(tree), tree.nodes
        run.speedup, run.exact = run.tokens_per_s / auto.tokens_per_s, rows == auto_rows
        runs.append(run)
    log(f"\ndrafting without a trained drafter (greedy, batch 1; autoregressive {auto.tokens_per_s:.1f} tok/s)")
    log(f"{'drafter':<28} {'shape':<16} {'tok/pass':>8} {'tok/s':>8} {'vs auto':>7} exact")
    for r in runs:
        log(f"{r.drafter:<28} {r.shape:<16} {r.tokens_per_pass:>8.2f} {r.tokens_per_s:>8.1f} {r.speedup:>7.2f} "
            f"{r.exact}")
    return {"runs": [r.as_dict() for r in runs]}


def _with_documents(datastore: Datastore, documents) -> Datastore:
    """A datastore holding `datastore`'s documents and more."""
    tokens = np.asarray(datastore.tokens)
    cuts = np.flatnonzero(tokens < 0)
    return Datastore.build([d[:-1].tolist() for d in np.split(tokens, cuts + 1)[:-1]] + list(documents))


# ---- num_draft_tokens="auto" against fixed shapes ---------------------------------------


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
    return {"unit": unit, "tree": None if tree is None else str(tree), "rows": rows}
