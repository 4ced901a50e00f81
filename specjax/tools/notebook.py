"""What the Colab notebooks (colab/*.ipynb) call beyond the public API: the switch to their
offline small mode, the devices in words, and drafters measured side by side with the
speedup theory predicts for each, as a table and a plot. (Their prompt encoding, stop ids
and streamed-text printer are specjax.text's, shared with `specjax generate`.)

Measurements are `specjax.time_generate` runs over the same prompts (median of `repeats`
after a compiling run); the prediction is Leviathan et al.'s E[tokens per pass] /
(1 + n c), n the sequential draft passes per step and c one draft pass's cost over one
target pass, both timed here inside compiled loops. It assumes the target verifies a
step's tokens in the time of a one-token pass, as an accelerator nearly does at small
batch; on a CPU wide verification passes cost more, so measured / predicted falls there.
It knows nothing about tokenizers.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import theory
from specjax.cache import KVCache
from specjax.drafters import DraftModel, Eagle, EarlyExit, Medusa
from specjax.generate import pad_prompts
from specjax.models import Model
from specjax.tools.measure import fmt, median_time, pass_time, time_generate

SMALL_ENV = "SPECJAX_SMALL"


def small_mode() -> bool:
    """True when SPECJAX_SMALL=1: notebooks run offline on the shipped pair, with few tokens
    and few training steps; unset (or 0) they use the Hugging Face hub."""
    value = os.environ.get(SMALL_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{SMALL_ENV} must be 1 (small, offline) or 0/unset (hub), got {value!r}")
    return value == "1"


def describe_devices() -> str:
    """The JAX backend and its devices in words, e.g. 'tpu: 8 devices (TPU v2), 1 process'."""
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    return (f"{jax.default_backend()}: {len(devices)} device{'s' * (len(devices) != 1)} "
            f"({', '.join(kinds)}), {jax.process_count()} process{'es' * (jax.process_count() != 1)}")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One configuration to  drafter: None (autoregressive), a `Model` or any
    drafter; K: a chain length, "auto" (chosen from a cost profile), or None for a drafter
    whose own `Tree` fixes the shape (or one that chooses it, such as lookahead)."""

    name: str
    drafter: Any = None
    K: int | str | None = 4


@dataclasses.dataclass
class Measured:
    """One configuration measured over the whole prompt set."""

    name: str
    shape: str  # "autoregressive", "chain K=4", "tree d4 k2 n8", ...
    temperature: float
    tokens_per_s: float
    speedup: float  # over autoregressive decoding, same prompts and temperature
    tokens_per_pass: float  # emitted tokens per target verification pass
    acceptance: float | None  # accepted / drafted draft tokens
    c: float | None  # one draft pass / one target pass (None: no model drafts)
    predicted: float | None  # the speedup theory predicts (see the module's docstring)
    exact: bool | None  # greedy: every row equals autoregressive decoding's


def _seconds_per_iteration(body, args, carry, repeats: int, n: int = 50) -> float:
    """Median seconds of one body(args, carry) -> carry, timed as n calls in a compiled loop."""
    loop = jax.jit(lambda args, carry: jax.lax.fori_loop(0, n, lambda i, c: body(args, c), carry))
    return median_time(lambda: jax.block_until_ready(loop(args, carry)), repeats) / n


def draft_pass_cost(target: Model, drafter, batch: int, cache_len: int, repeats: int,
                    t_target: float | None = None) -> tuple[float | None, str]:
    """(c, how its passes add up): one draft pass's time over one one-token target pass
    (t_target seconds, timed here if not given). "sequential": one pass per depth (a draft
    model, early exit, EAGLE); "once": one per step (Medusa's heads all read one state);
    c None: no model drafts (lookups, retrieval)."""
    if t_target is None:
        t_target = pass_time(target, batch, 1, cache_len, repeats)
    if isinstance(drafter, Model):
        drafter = DraftModel(drafter)
    if isinstance(drafter, DraftModel):
        return pass_time(drafter.model, batch, 1, cache_len, repeats) / t_target, "sequential"
    if isinstance(drafter, EarlyExit):
        return pass_time(target, batch, 1, cache_len, repeats, exit_layer=drafter.num_layers) / t_target, \
            "sequential"
    E = target.config.hidden_size
    if isinstance(drafter, Eagle):
        from specjax.drafters.eagle import eagle_step

        eagle = drafter.bind(target)
        tokens = jnp.ones((batch, 1), jnp.int32)
        positions = jnp.full((batch, 1), cache_len // 2, jnp.int32)

        def body(args, carry):
            params, target_ = args
            features, cache = carry
            logits, features, cache = eagle_step(eagle.config, params, target_, tokens, features, positions, cache)
            return features + (logits[..., :1] > jnp.inf), cache  # keeps the read-out live

        carry = (jnp.zeros((batch, 1, E), target.dtype), KVCache.init(eagle.config, batch, cache_len, target.dtype))
        return _seconds_per_iteration(body, (eagle.params, target), carry, repeats) / t_target, "sequential"
    if isinstance(drafter, Medusa):
        from specjax.drafters.medusa import heads_logits

        def body(args, h):
            params, target_ = args
            return h + (heads_logits(params, target_, h)[..., :1, :1].sum(-1) > jnp.inf)

        h = jnp.zeros((batch, E), target.dtype)
        return _seconds_per_iteration(body, (drafter.params, target), h, repeats) / t_target, "once"
    return None, "none"


def _cost_key(drafter):
    """What a draft pass's cost depends on: shapes and kinds, never weights (so drafters of
    one shape, trained or not, are timed once)."""
    if isinstance(drafter, DraftModel):
        drafter = drafter.model
    if isinstance(drafter, Model):
        return ("model", drafter.config, str(drafter.dtype))
    if isinstance(drafter, EarlyExit):
        return ("early exit", drafter.num_layers)
    if isinstance(drafter, (Eagle, Medusa)):
        return (type(drafter).__name__, jax.tree.map(lambda w: (w.shape, str(w.dtype)), drafter.params).__repr__())
    return ("none",)


def _shape(drafter, K) -> str:
    if drafter is None:
        return "autoregressive"
    tree = getattr(drafter.resolve(K) if hasattr(drafter, "resolve") else drafter, "tree", None)
    if tree is not None:
        return str(tree).replace("chain ", "chain K=")
    return f"chain K={K}" if K is not None else "its own"


def _depth(drafter, K) -> int:
    tree = getattr(drafter, "tree", None)
    return tree.depth if tree is not None else (K or 0)


def compare(target: Model, prompts: list[list[int]], entries, max_new_tokens: int = 32,
            temperatures=(0.0,), batch: int = 1, repeats: int = 1, eos_token_id=None,
            cost_profile=None, mesh=None, seed: int = 0, log=print) -> list[Measured]:
    """For each temperature, autoregressive decoding and then every entry, over the same
    prompts (in batches of `batch`; with a mesh, rows go over its data axis). Each gets
    tok/s, speedup, tokens per pass, acceptance, the draft's cost ratio c (timed once per
    draft shape), theory's predicted speedup and, greedy, whether its output equals
    autoregressive decoding's. An "auto" entry's K is chosen as
    `generate(num_draft_tokens="auto")` chooses it (from cost_profile, or the one shipped
    for this backend), and its prediction is that profile's."""
    if not prompts or len(prompts) % batch:
        raise ValueError(f"compare needs a non-empty prompt list whose length divides into batches of {batch}, "
                         f"got {len(prompts)} prompts")
    if isinstance(temperatures, (int, float)):
        temperatures = (temperatures,)
    options = {} if mesh is None else {"mesh": mesh}
    cache_len = pad_prompts(prompts[:batch])[0].shape[1] + max_new_tokens + 64
    t_target = pass_time(target, batch, 1, cache_len, repeats)
    costs: dict[int, tuple] = {}  # entry index -> (drafter, K, profile, c, kind, passes per step)
    timed: dict = {}  # _cost_key -> (c, kind)
    for i, entry in enumerate(entries):
        drafter, K, profile = entry.drafter, entry.K, None
        if K == "auto":  # None when the profile says speculation loses here: plain decoding
            from specjax.generate import auto_shape

            profile = theory.resolve_profile(cost_profile, jax.default_backend())
            drafter, K = auto_shape(batch, drafter, profile, max_new_tokens)
        if drafter is None:
            c, kind = None, "none"
        else:
            key = _cost_key(drafter)
            if key not in timed:
                timed[key] = draft_pass_cost(target, drafter, batch, cache_len, repeats, t_target)
            c, kind = timed[key]
        depth = _depth(drafter.resolve(K) if hasattr(drafter, "resolve") else drafter, K)
        costs[i] = (drafter, K, profile, c, kind, {"sequential": depth, "once": 1}.get(kind, 0))
    rows = []
    for temperature in temperatures:
        common = dict(temperature=temperature, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                      seed=seed, **options)
        auto, auto_rows = time_generate(target, prompts, batch, repeats, name="autoregressive", **common)
        rows.append(Measured("autoregressive", "autoregressive", temperature, auto.tokens_per_s, 1.0,
                             auto.tokens_per_pass, None, None, 1.0, True if temperature == 0 else None))
        log(format_row(rows[-1]))
        for i, entry in enumerate(entries):
            drafter, K, profile, c, kind, passes = costs[i]
            run, out_rows = time_generate(target, prompts, batch, repeats, drafter, K, entry.name, **common)
            if profile is not None:  # the profile's own prediction, made before anything ran
                predicted = _profile_rate(profile, drafter, K, batch, max_new_tokens) / theory.tokens_per_ms(
                    profile, batch, 0, max_new_tokens)
            elif getattr(drafter, "tree", None) is None and kind == "sequential" and run.steps:
                alpha = theory.alpha_from_accepted(min(run.accepted / run.steps, K), K)  # Leviathan et al.
                predicted = theory.predicted_speedup(alpha, K, c)
            else:
                predicted = run.tokens_per_pass / (1.0 + passes * (c or 0.0))
            shape = ("auto: " if entry.K == "auto" else "") + _shape(drafter, K)
            rows.append(Measured(entry.name, shape, temperature, run.tokens_per_s,
                                 run.tokens_per_s / auto.tokens_per_s, run.tokens_per_pass, run.acceptance, c,
                                 predicted, out_rows == auto_rows if temperature == 0 else None))
            log(format_row(rows[-1]))
    return rows


def _profile_rate(profile, drafter, K, batch, max_new_tokens) -> float:
    """The profile's tokens per ms for what "auto" chose: a chain of K, a tree, or nothing."""
    tree = getattr(drafter, "tree", None)
    if tree is not None:
        return theory.tree_tokens_per_ms(profile, tree.depth, tree.top_k, tree.nodes, batch, max_new_tokens)
    return theory.tokens_per_ms(profile, batch, K or 0, max_new_tokens)


HEADER = (f"{'drafter':<22} {'shape':<22} {'tok/s':>8} {'speedup':>7} {'theory':>6} {'tok/pass':>8} "
          f"{'accept':>6} {'c':>5} exact")


def format_row(r: Measured) -> str:
    return (f"{r.name:<22} {r.shape:<22} {r.tokens_per_s:>8.1f} {r.speedup:>7.2f} {fmt(r.predicted):>6} "
            f"{r.tokens_per_pass:>8.2f} {fmt(r.acceptance):>6} {fmt(r.c):>5} {fmt(r.exact, '')}")


def table(rows: list[Measured]) -> str:
    """The measurements as a text table, one line per configuration."""
    return "\n".join([HEADER] + [format_row(r) for r in rows])


def plot(rows: list[Measured], title: str = ""):
    """Two panels: measured speedup beside theory's prediction, and tokens per target pass
    with the acceptance rate. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    temperatures = len({r.temperature for r in rows}) > 1
    labels = [(r.name if r.shape == "autoregressive" else f"{r.name}\n{r.shape}")
              + (f"\nT={r.temperature:g}" if temperatures else "") for r in rows]
    x = np.arange(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows)), 4))
    left.bar(x - 0.2, [r.speedup for r in rows], 0.4, label="measured")
    left.bar(x + 0.2, [np.nan if r.predicted is None else r.predicted for r in rows], 0.4, label="theory")
    left.axhline(1.0, color="gray", lw=0.8)
    left.set(ylabel="speedup over autoregressive", title=title or "Speedup: measured and predicted")
    right.bar(x - 0.2, [r.tokens_per_pass for r in rows], 0.4, label="tokens per target pass")
    right.set(ylabel="tokens per target pass", title="Tokens per pass and acceptance")
    twin = right.twinx()
    twin.bar(x + 0.2, [np.nan if r.acceptance is None else r.acceptance for r in rows], 0.4, color="tab:orange",
             label="acceptance")
    twin.set(ylabel="accepted / drafted", ylim=(0, 1))
    for ax in (left, right):
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    left.legend()
    right.legend(handles=right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0], loc="upper left")
    fig.tight_layout()
    return fig
