"""Benchmarks behind `specjax bench`: autoregressive vs speculative `generate`, timed side
by side in one run, with the speedup theory predicts set beside the measured one.

    specjax bench                         # the shipped pair on held-out stdlib code
    specjax bench --hf                    # ... and transformers' generate on the same pair
    specjax bench --synthetic llama-1b    # no checkpoints: a random Llama-3.2-1B-shaped pair, the
                                          # weight-read roofline, pass costs (see specjax.tools.synthetic)
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

The package, by section (each module's docstring says what it owns):

    specjax.tools.bench.pair      run_pair (the whole bench), run_divergence, measure_profile;
                                  their tables, JSON reports and plots
    specjax.tools.bench.sections  trees, trained heads, training-free drafters, auto K
    specjax.tools.bench.command   the flags (add_arguments, run_from_args, main)
    specjax.tools.measure         (below the bench) the timing and statistics it runs on

This module re-exports their public names, so `specjax.tools.bench.time_generate` and the
like keep working; `python -m specjax.tools.bench` runs `main`.
"""

from specjax.tools.bench.command import add_arguments, main, run_from_args
from specjax.tools.bench.pair import (PROFILE_TREE, PROFILE_TREE_NODES, measure_profile, plot, run_divergence,
                                      run_pair)
from specjax.tools.bench.sections import (HEAD_SHAPES, LOOKAHEADS, TREES, run_auto, run_auto_k, run_heads,
                                          run_training_free, run_trees, trained_heads)
from specjax.tools.measure import (Run, depth_acceptance, first_divergence, held_out_prompts, median_time,
                                   pass_time, per_position_acceptance, predict, row_traces, run_transformers,
                                   time_generate)

__all__ = [
    "HEAD_SHAPES", "LOOKAHEADS", "PROFILE_TREE", "PROFILE_TREE_NODES", "Run", "TREES", "add_arguments",
    "depth_acceptance", "first_divergence", "held_out_prompts", "main", "measure_profile", "median_time",
    "pass_time", "per_position_acceptance", "plot", "predict", "row_traces", "run_auto", "run_auto_k",
    "run_divergence", "run_from_args", "run_heads", "run_pair", "run_training_free",
    "run_transformers", "run_trees", "time_generate", "trained_heads",
]
