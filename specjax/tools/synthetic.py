"""`specjax bench --synthetic SIZE`: a random pair that agrees, and how close decoding comes
to reading the weights at the memory's speed. No checkpoint is needed.

The target is random, but its layers past the first `draft_layers` write only faintly into
the residual stream (their output projections scaled down), so the draft, which is the
target's own first layers and head (the same arrays, not copies), really agrees with it.
Llama-shaped sizes (llama-1b: Llama-3.2-1B's shape; llama-8b: Llama-3-8B's) are built leaf
by leaf in the requested dtype, so an 8B bfloat16 pair needs 16 GB and no float32 copy.

What it prints: the measured device-memory read bandwidth; the weight-read roofline (weight
bytes / bandwidth: the time a one-token pass cannot beat at batch 1) and the one-token pass
as a multiple of it; the weights alone (every matmul once, no attention) likewise; the
pass cost by width; plain and speculative tok/s per batch size, with the draft and with the
target drafting for itself; and with --hf, transformers' plain and assisted generation on
the same weights. It knows models and timing; it does not know checkpoints or tokenizers.
"""

from __future__ import annotations

import dataclasses
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from specjax.tools.aot import pass_reads
from specjax.config import ModelConfig
from specjax.models import Model
from specjax.models.layers import gate_up_matmul, qkv_matmul
from specjax.models.transformer import init_params
from specjax.quant import path_names
from specjax.tools.measure import (Run, median_time, pass_time, predict, print_runs, run_transformers,
                                   time_generate)

SIZES = {
    "tiny": dict(model_type="gpt2", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                 num_kv_heads=4, head_dim=16, intermediate_size=256, max_position_embeddings=256),
    "gpt2-small": dict(model_type="gpt2", vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
                       num_kv_heads=12, head_dim=64, intermediate_size=3072, max_position_embeddings=1024),
    "llama-tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=16, intermediate_size=256, max_position_embeddings=512),
    "llama-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                     num_kv_heads=8, head_dim=64, intermediate_size=8192, max_position_embeddings=8192,
                     rope_theta=500000.0),
    "llama-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                     num_kv_heads=8, head_dim=128, intermediate_size=14336, max_position_embeddings=8192,
                     rope_theta=500000.0, tie_word_embeddings=False),
}
# What the target's layers past the draft's write into the residual stream, scaled down.
RESIDUAL_OUTPUTS = ("o_kernel", "o_bias", "down_kernel", "down_bias", "proj_kernel", "proj_bias")
# By how much, per family: the values of the first GPU measurements (docs/bench/gpu), so
# that speculative numbers compare with them.
FAINT = {"gpt2": 0.01, "llama": 0.05}


def synthetic_config(size: str) -> ModelConfig:
    shape = dict(SIZES[size])
    gpt2 = shape["model_type"] == "gpt2"
    return ModelConfig(norm_eps=1e-5, tie_word_embeddings=shape.pop("tie_word_embeddings", True),
                       qkv_bias=gpt2, out_bias=gpt2, mlp_bias=gpt2, **shape)


def build_synthetic_pair(size: str, draft_layers: int, seed: int = 0, dtype=jnp.float32) -> tuple[Model, Model]:
    """(target, draft) of `size` in `dtype`: normal(0.02) weights made in dtype, one leaf at a
    time, unit norms, zero biases; the embedding (and an untied head) x10 so that logits are
    far from uniform and greedy choices stable; layers >= draft_layers write FAINT-ly. The
    draft is the target's first draft_layers layers, final norm and head (shared arrays)."""
    config = synthetic_config(size)
    if not 1 <= draft_layers < config.num_layers:
        raise ValueError(f"draft_layers must lie in [1, {config.num_layers}), got {draft_layers}")
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(seed)))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    normal = jax.jit(lambda key, shape: jax.random.normal(key, shape, dtype) * jnp.asarray(0.02, dtype),
                     static_argnums=1)

    def leaf(path, shape, key):
        names = path_names(path)
        if names[-1] == "scale":
            return jnp.ones(shape.shape, dtype)
        if names[-1].endswith("bias"):
            return jnp.zeros(shape.shape, dtype)
        w = normal(key, shape.shape)
        if names[0] in ("embedding", "lm_head"):
            w = w * jnp.asarray(10.0, dtype)
        if names[0] == "layers" and int(names[1]) >= draft_layers and names[-1] in RESIDUAL_OUTPUTS:
            w = w * jnp.asarray(FAINT[config.family], dtype)
        return w

    params = jax.tree_util.tree_unflatten(treedef, [leaf(p, s, k) for (p, s), k in zip(leaves, keys)])
    draft = Model(dataclasses.replace(config, num_layers=draft_layers),
                  {**params, "layers": params["layers"][:draft_layers]})
    return Model(config, params), draft


def weight_bytes(model: Model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(model.params))


READS = (  # read-only reductions of a [n / 1024, 1024] bfloat16 array, each reading it once
    lambda x: jnp.sum(x.astype(jnp.float32), axis=0),  # column sums
    lambda x: jnp.sum(x.astype(jnp.float32), axis=1),  # row sums
    jnp.max,
)


def read_bandwidth(repeats: int = 10) -> float:
    """Bytes per second the default device reads, measured: the fastest of READS over a large
    array (2 GiB on an accelerator, 64 MiB on CPU), as a decoding pass reads its weights. One
    reduction alone can under-read a card: on an H200 the column sums read 2.4-2.9 TB/s in
    four runs while the 8B weights-only chain read its 15.0 GB in 3.80 ms, 3.95 TB/s
    (docs/bench/gpu/README.md)."""
    n = 2**30 if jax.default_backend() != "cpu" else 2**25
    x = jax.random.normal(jax.random.key(1), (n // 1024, 1024), jnp.bfloat16)  # not constant: nothing to compress
    seconds = min(median_time(lambda: jax.block_until_ready(read(x)), repeats)
                  for read in map(jax.jit, READS))
    return 2 * n / seconds


def weights_only_time(model: Model, repeats: int = 3) -> float:
    """Seconds of a pass that only multiplies one token's activation through every matmul
    weight once, as the layers multiply them (no attention, no cache, no norms): what XLA
    achieves on the weights alone. Timed as 50 passes in one compiled loop."""
    c = model.config
    R = c.num_heads // c.num_kv_heads

    def layer(x, w):  # x [1, E]
        qkv = qkv_matmul(x, w["attn"]["qkv_kernel"])  # [1, G, R+2, D]
        heads = (qkv[:, :, :R] + qkv[:, :, R:R + 1] + qkv[:, :, R + 1:]).reshape(1, c.num_heads, c.head_dim)
        h = x + jnp.einsum("bhd,hde->be", heads, w["attn"]["o_kernel"]) * 1e-3
        mlp = w["mlp"]
        if "gate_up_kernel" in mlp:
            gate, up = gate_up_matmul(h, mlp["gate_up_kernel"])  # [1, F] each
            y = jax.nn.silu(gate) * up
            return h + (y @ mlp["down_kernel"]) * 1e-3
        return h + (jax.nn.gelu(h @ mlp["fc_kernel"]) @ mlp["proj_kernel"]) * 1e-3

    tied = c.tie_word_embeddings
    passes = 50

    @jax.jit
    def loop(params, x):
        def one(i, x):
            for w in params["layers"]:
                x = layer(x, w)
            head = params["embedding"] if tied else params["lm_head"]
            logits = jnp.einsum("be,ve->bv" if tied else "be,ev->bv", x, head)
            return x + logits[:, :1] * 1e-6
        return jax.lax.fori_loop(0, passes, one, x)

    x = jnp.full((1, c.hidden_size), 0.01, model.dtype)
    return median_time(lambda: jax.block_until_ready(loop(model.params, x)), repeats) / passes


def run_synthetic(size="gpt2-small", draft_layers=2, ks=(1, 2, 4, 6), batches=(1,), prompt_len=32,
                  max_new_tokens=64, repeats=3, seed=0, dtype="float32", self_draft: bool = True,
                  widths=(1, 2, 4, 8, 16, 32), hf: bool = False, log=print) -> list[Run]:
    """The measurements the module docstring lists; returns every timed Run (batch by batch:
    plain, the draft for each K, then the target drafting for itself for each K)."""
    jdtype = jnp.dtype(dtype)
    target, small = build_synthetic_pair(size, draft_layers, seed, jdtype)
    rng = np.random.RandomState(seed)
    cache_len = 1024 if max(widths) + prompt_len + max_new_tokens + max(ks) < 1024 else 4096
    log(f"target: {size}, {target.config.num_params() / 1e6:.1f}M params, {weight_bytes(target) / 1e9:.3f} GB; "
        f"draft: its first {draft_layers} layers and head; {jax.default_backend()} {dtype}, prompt {prompt_len}, "
        f"{max_new_tokens} new tokens, median of {repeats}")
    bandwidth = read_bandwidth()
    roofline = pass_reads(target) / bandwidth  # an untied embedding: a pass gathers only its rows
    t_target = pass_time(target, 1, 1, cache_len, repeats)
    t_weights = weights_only_time(target, repeats)
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s -> weight-read roofline {roofline * 1e3:.3f} ms per pass at batch 1")
    log(f"one-token pass ({cache_len}-slot cache): {t_target * 1e3:.3f} ms = {t_target / roofline:.2f}x the roofline "
        f"({roofline / t_target * 100:.0f}% of the bandwidth); the weights alone: {t_weights * 1e3:.3f} ms "
        f"= {t_weights / roofline:.2f}x")
    widths_ms = {T: pass_time(target, 1, T, cache_len, repeats) * 1e3 for T in widths}
    log("pass cost by width, batch 1 (ms): " + ", ".join(f"T={T}: {ms:.3f}" for T, ms in widths_ms.items()))
    costs = {"small": (pass_time(small, 1, 1, cache_len, repeats), pass_time(small, 1, 2, cache_len, repeats)),
             "target": (t_target, pass_time(target, 1, 2, cache_len, repeats))}
    log(f"one draft step: {costs['small'][0] * 1e3:.3f} ms (c = {costs['small'][0] / t_target:.3f})")
    runs = []
    drafts = [("small", small)] + ([("target", target)] if self_draft else [])
    for batch in batches:
        prompts = [list(rng.randint(0, target.config.vocab_size, prompt_len)) for _ in range(batch)]
        auto, auto_rows = time_generate(target, prompts, batch, repeats, max_new_tokens=max_new_tokens)
        runs.append(auto)
        for name, draft in drafts:
            t_step, t_catch_up = costs[name]
            for K in ks:
                run, rows = time_generate(target, prompts, batch, repeats, draft, K, name, 0.0, max_new_tokens)
                if batch == 1:
                    predict(run, K, t_target, t_step, t_catch_up, pass_time(target, 1, K + 1, cache_len, repeats))
                run.speedup = run.tokens_per_s / auto.tokens_per_s
                run.exact = rows == auto_rows
                runs.append(run)
        if batch == 1:
            log(f"batch 1 plain decoding: {auto.tokens_per_s:.1f} tok/s = {auto.tokens_per_s * roofline * 100:.0f}% "
                f"of the roofline's {1 / roofline:.0f} tok/s")
    print_runs(runs, log)
    if hf:
        _transformers_on_the_same_weights(target, small, runs, max_new_tokens, repeats, prompt_len, seed, log)
    return runs


def _transformers_on_the_same_weights(target, small, runs, max_new_tokens, repeats, prompt_len, seed, log):
    """Saves the pair as Hugging Face folders and times transformers on them (batch 1)."""
    from specjax.hf import save_model

    prompts = [list(np.random.RandomState(seed).randint(0, target.config.vocab_size, prompt_len))]
    auto = next(r for r in runs if r.drafter == "none" and r.batch == 1)
    spec = max((r for r in runs if r.drafter == "small" and r.batch == 1), key=lambda r: r.tokens_per_s)
    with tempfile.TemporaryDirectory() as folder:
        save_model(target, f"{folder}/target")
        save_model(small, f"{folder}/draft")
        run_transformers(f"{folder}/target", f"{folder}/draft", prompts, max_new_tokens, repeats, auto, spec, log)
