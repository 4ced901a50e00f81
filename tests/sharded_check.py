"""Run in a subprocess by test_sharding.py with 8 emulated CPU devices: sharded generate
equals single-device generate, weights and caches are really split, the compiled loop
gathers no whole weight, kv heads fewer than the model axis are duplicated (no collective
moves attention scores or keys/values), and a replicated draft keeps a replicated cache.
Prints one JSON line of findings. Its arguments: the meshes that generate runs on, e.g.
2x4 (default 1x8,2x4,8x1); the engine, trees, kv heads and int8 run on 2x4 whatever."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax.budget import compile_loop  # noqa: E402
from specjax.generate import _prepared, _run  # noqa: E402
from specjax.loop import cache_length  # noqa: E402
from specjax.tools.hlo import collectives  # noqa: E402
from tests.axes_drafter import Tabled  # noqa: E402

ASKED = sys.argv[1] if len(sys.argv) > 1 else "1x8,2x4,8x1"
MESHES = [tuple(int(n) for n in mesh.split("x")) for mesh in ASKED.split(",")]  # (data, model) each

# 6 query heads, 2 kv heads and a vocabulary of 389 divide no model axis of 4 or 8.
CONFIG = specjax.ModelConfig(
    model_type="llama", vocab_size=389, hidden_size=64, num_layers=2, num_heads=6, num_kv_heads=2,
    head_dim=16, intermediate_size=128, max_position_embeddings=128, norm_eps=1e-5,
    tie_word_embeddings=False)
K, MAX_NEW = 3, 12


def random_model(seed, base=None, std=0.1, config=CONFIG):
    model = specjax.models.init(config, jax.random.key(seed), jnp.float32)
    rng = np.random.RandomState(seed)
    ref = model.params if base is None else base.params
    params = jax.tree.map(lambda b, x: np.asarray(b) + std * rng.randn(*x.shape).astype(np.float32)
                          if x.ndim > 1 else np.asarray(b), ref, model.params)
    return specjax.Model(config, jax.tree.map(jnp.asarray, params))


def all_gather_shapes(hlo: str) -> list[tuple[int, ...]]:
    """Result shapes of every all-gather in compiled HLO text (each of a combined one's)."""
    return [shape for op, _, shape in collectives(hlo) if op == "all-gather"]


def detector_sees_a_whole_weight_gather() -> bool:
    """The detector's own check: a program that needs a model-sharded weight whole (it
    returns it replicated) must show up as an all-gather of the weight's full shape."""
    mesh = specjax.make_mesh(data=2, model=4)
    w = jax.device_put(jnp.ones((64, 128)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model")))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    hlo = jax.jit(lambda w: w * 2, out_shardings=replicated).lower(w).compile().as_text()
    return (64, 128) in all_gather_shapes(hlo)


def main():
    assert len(jax.devices()) == 8, jax.devices()
    target = random_model(0)
    draft = random_model(1, base=target, std=0.02)
    folder = tempfile.mkdtemp()
    specjax.save_model(target, folder)
    rng = np.random.RandomState(0)
    prompts, lengths = specjax.pad_prompts(
        [list(rng.randint(0, 389, n)) for n in rng.randint(2, 15, 8)], bucket=16)
    kwargs = dict(draft=draft, max_new_tokens=MAX_NEW, num_draft_tokens=K)
    single = specjax.generate(target, prompts, lengths, **kwargs)
    tree = specjax.Tree(depth=3, top_k=2, nodes=6)
    single_tree = specjax.generate(target, prompts, lengths, max_new_tokens=MAX_NEW,
                                   draft=specjax.DraftModel(draft, tree))
    findings = {"single_accepted": int(single.stats.accepted.sum()), "meshes": {},
                "detector_works": detector_sees_a_whole_weight_gather()}

    full_shapes = set()
    for leaf in jax.tree.leaves(target.params):
        if leaf.ndim >= 2:
            full_shapes.add(tuple(leaf.shape))
            full_shapes.add(tuple(leaf.shape[1:]))  # one layer of a stacked weight
    total_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(target.params))
    total_elements = sum(leaf.size for leaf in jax.tree.leaves(target.params))

    for data, model in MESHES:
        mesh = specjax.make_mesh(data=data, model=model)
        sharded_target = specjax.load_model(folder, dtype=jnp.float32, mesh=mesh)
        read_fraction = specjax.hf.stats["elements_read"] / total_elements
        chunk = specjax.hf.CHUNK_BYTES
        specjax.hf.CHUNK_BYTES = 64  # the same load, copied out of the files 64 bytes at a time
        pieces = specjax.load_model(folder, dtype=jnp.float32, mesh=mesh)
        specjax.hf.CHUNK_BYTES = chunk
        sharded_draft = specjax.shard_model(draft, mesh)
        # One compile gives both the output and the program's text.
        args, static, stream = _prepared(sharded_target, prompts, lengths,
                                         {**kwargs, "draft": sharded_draft, "mesh": mesh})
        executable = compile_loop(args, static, stream)
        out = _run(args, {}, stream, executable)
        hlo = executable.as_text()
        per_device = {}
        for leaf in jax.tree.leaves(sharded_target.params):
            for shard in leaf.addressable_shards:
                per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
        # The compiled loop: which all-gathers does it contain, and of what shapes?
        gathered = all_gather_shapes(hlo)
        S = cache_length(prompts.shape[1], MAX_NEW, K)
        # a layer's [B, G, S, D] of either model (the draft's cache is longer) unsharded, or
        # (with a model axis) whole on heads and head_dim in one device's rows
        whole = [f"f32[{rows},2,{s},16]" for s in (S, S + K + 1)
                 for rows in {8, 8 // data if model > 1 else 8}]
        findings["meshes"][f"{data}x{model}"] = {
            "equal": bool(np.array_equal(np.asarray(out.tokens), np.asarray(single.tokens))
                          and np.array_equal(np.asarray(out.num_tokens), np.asarray(single.num_tokens))),
            "max_device_fraction": max(per_device.values()) / total_bytes,
            "whole_weight_gathers": sorted({str(g) for g in gathered if g in full_shapes}),
            "all_gathers": len(gathered),
            "whole_cache_in_program": any(w in hlo for w in whole),
            # loading: elements copied out of the files per parameter element; jax asks once
            # per distinct slice, so 1 where the rules split everything or nothing
            "read_fraction": read_fraction,
            "pieces_equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
                jax.tree.leaves(target.params), jax.tree.leaves(pieces.params))),
            # every device holds exactly its own slice of each parameter
            "shards_match": all(np.array_equal(np.asarray(shard.data), np.asarray(ref)[shard.index])
                                for leaf, ref in zip(jax.tree.leaves(sharded_target.params),
                                                     jax.tree.leaves(target.params))
                                for shard in leaf.addressable_shards),
            "cache_spec": str(specjax.sharding.cache_shardings(
                specjax.KVCache.init(CONFIG, 8, S), mesh).k[0].spec),
        }
    # A token tree on the mesh that splits both rows and heads (the other meshes' trees
    # add nothing the chains do not show): greedy, it also equals the chain's output.
    mesh = specjax.make_mesh(data=2, model=4)
    out_tree = specjax.generate(specjax.shard_model(target, mesh), prompts, lengths, mesh=mesh, max_new_tokens=MAX_NEW,
                                draft=specjax.DraftModel(specjax.shard_model(draft, mesh), tree))
    findings["tree_equal"] = bool(np.array_equal(np.asarray(out_tree.tokens), np.asarray(single_tree.tokens))
                                  and np.array_equal(np.asarray(out_tree.tokens), np.asarray(single.tokens)))
    findings["engine"] = engine_findings(target, draft)
    findings["int8"] = int8_findings(folder)
    findings["kv_heads"] = kv_head_findings(prompts, lengths)
    findings["prefix_kernel"] = prefix_kernel_findings()
    print(json.dumps(findings))


def engine_findings(target, draft) -> dict:
    """The engine on a 2x4 mesh (slots over data, heads over model), requests staggered and K
    changing with live rows (3 to 0, and back: the draft synced), against single-device
    generate on each request alone."""
    mesh = specjax.make_mesh(data=2, model=4)
    engine = specjax.Engine(specjax.shard_model(target, mesh), draft=specjax.shard_model(draft, mesh), slots=4,
                            max_len=48, num_draft_tokens=(3, 3, 0, 0), mesh=mesh, steps_per_call=4)
    rng = np.random.RandomState(1)
    requests = [(list(rng.randint(0, 389, n)), budget) for n, budget in ((5, 10), (12, 6), (3, 12), (9, 8), (7, 5))]
    with engine:
        submitted = [engine.submit(p, max_new_tokens=b) for p, b in requests]
        got = [r.result(timeout=300) for r in submitted]
    alone, longest = [], max(b for _, b in requests)  # each alone, greedy: its longest budget's run, cut (one compile)
    for p, b in requests:
        out = specjax.generate(target, *specjax.pad_prompts([p]), max_new_tokens=longest)
        alone.append([int(t) for t in np.asarray(out.tokens[0, :b])])
    # A drafter whose state's table [4, 3] has a first dimension of B = 4 slots but is shared
    # by the rows (declared so), and whose `seen` [2, B] has its rows on axis 1.
    tabled = specjax.Engine(specjax.shard_model(target, mesh), draft=Tabled(table_rows=4), slots=4, max_len=48,
                            num_draft_tokens=3, mesh=mesh, steps_per_call=4)
    with tabled:
        tabled_got = [r.result(timeout=300) for r in [tabled.submit(p, max_new_tokens=b) for p, b in requests]]
    draft_state = tabled.runner.state.draft_state
    # Pages on the mesh: the target's and the draft's pools over model (kv heads, or head_dim
    # where they do not divide it), every row's page table over data; a pool of 10 pages of 8
    # for 4 slots of 48.
    paged = specjax.Engine(specjax.shard_model(target, mesh), draft=specjax.shard_model(draft, mesh), slots=4,
                           max_len=48, num_draft_tokens=2, mesh=mesh, steps_per_call=4, kv_pages=10, page_size=8)
    with paged:
        paged_got = [r.result(timeout=300) for r in [paged.submit(p, max_new_tokens=b) for p, b in requests]]
    state = paged.runner.state
    return {"paged": {"equal": paged_got == alone, "free_pages": paged.stats()["free_pages"],
                      "pool_spec": [str(c.k[0].sharding.spec) for c in (state.target_cache, state.draft_state.cache)],
                      "table_spec": str(state.target_cache.pages.sharding.spec)},
            "equal": got == alone, "steps_by_K": {str(k): v for k, v in engine.steps.items()},
            "cache_spec": str(engine.runner.state.target_cache.k[0].sharding.spec),
            "tokens_spec": str(engine.runner.state.tokens.sharding.spec),
            "declared": {"equal": tabled_got == alone, "table_spec": list(draft_state.table.sharding.spec),
                         "seen_spec": list(draft_state.seen.sharding.spec),
                         "table_whole": all(s.data.shape == (4, 3) for s in draft_state.table.addressable_shards),
                         "table": np.asarray(draft_state.table).tolist()}}


# 8 query heads over 2 kv heads: a model axis of 4 takes two copies of each kv head. The
# draft has one layer, so its cache's shapes differ from the target's.
KV_CONFIG = dataclasses.replace(CONFIG, num_heads=8)
KV_DRAFT = dataclasses.replace(KV_CONFIG, num_layers=1)
KV_NEW = 20  # a cache of 48 slots: no other dimension of the program is 48 (or the draft's)


def kv_head_findings(prompts, lengths) -> dict:
    """On a 2x4 mesh, a target with 2 kv heads, and a draft replicated by its own rules:
    the target's kv heads are duplicated to 4 and the output equals one device's; no
    floating-point collective of the compiled loop has a cache-length dimension (attention
    scores [B, G, R, T, S] or keys/values [B, G, S, D]); the same program with head_dim split
    instead (duplicate_kv_heads=False, the old behaviour) has such collectives; the draft's
    cache is whole on each device of a row group, the target's split by heads."""
    mesh = specjax.make_mesh(data=2, model=4)
    target = random_model(0, config=KV_CONFIG)
    # The draft: the target's first layer and head, perturbed (so that some drafts are accepted).
    draft = random_model(1, base=specjax.Model(KV_DRAFT, {**target.params, "layers": target.params["layers"][:1]}),
                         config=KV_DRAFT, std=0.01)
    kwargs = dict(max_new_tokens=KV_NEW, num_draft_tokens=K)
    single = specjax.generate(target, prompts, lengths, draft=draft, **kwargs)
    replicated_draft = specjax.shard_model(draft, mesh, rules=(("batch", "data"),))
    S = cache_length(prompts.shape[1], KV_NEW, K)
    Sd = S + K + 1  # DraftModel.start's cache
    out = {"draft_rules": list(map(list, replicated_draft.rules))}
    for duplicate in (True, False):
        sharded = specjax.shard_model(target, mesh, duplicate_kv_heads=duplicate)
        args, static, stream = _prepared(sharded, prompts, lengths, dict(draft=replicated_draft, mesh=mesh, **kwargs))
        executable = compile_loop(args, static, stream)
        hlo = executable.as_text()
        name = "duplicated" if duplicate else "head_dim_split"
        out[name] = {
            "kv_heads": sharded.config.num_kv_heads,
            "attention_collectives": sorted({f"{op} {dtype}{list(shape)}" for op, dtype, shape in collectives(hlo)
                                             if dtype.startswith(("f", "bf")) and ({S, Sd} & set(shape))}),
        }
        if duplicate:
            got = _run(args, {}, stream, executable)
            out[name]["equal"] = bool(np.array_equal(np.asarray(got.tokens), np.asarray(single.tokens))
                                      and np.array_equal(np.asarray(got.num_tokens), np.asarray(single.num_tokens)))
            out[name]["accepted"] = int(np.asarray(got.stats.accepted).sum())
            # Per-device shapes of each layer's cache in the loop: [B/data, G/model or G, S, D].
            out[name]["draft_cache_whole_per_row_group"] = f"f32[4,2,{Sd},16]" in hlo
            out[name]["target_cache_split_by_heads"] = (f"f32[4,1,{S},16]" in hlo
                                                         and f"f32[4,4,{S},16]" not in hlo)
    return out


def int8_findings(folder) -> dict:
    """int8 on a 2x4 mesh: each scale is split as its weight is along the output channels,
    the sharded model computes what the single-device one does, no whole weight is gathered."""
    mesh = specjax.make_mesh(data=2, model=4)
    single = specjax.load_model(folder, dtype=jnp.float32, quantize="int8")
    sharded = specjax.load_model(folder, dtype=jnp.float32, quantize="int8", mesh=mesh)
    leaves = [x for x in jax.tree.leaves(sharded.params, is_leaf=lambda x: isinstance(x, specjax.Int8))
              if isinstance(x, specjax.Int8)]

    def padded(spec, n):
        return tuple(spec) + (None,) * (n - len(spec))

    follow = all(padded(q.scale.sharding.spec, q.ndim) == padded(
        specjax.sharding.scale_spec(q.value.sharding.spec, q.scale.shape), q.ndim) for q in leaves)
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 389, (8, 16)), jnp.int32)
    a, b = specjax.forward(single, tokens), specjax.forward(sharded, tokens)
    hlo = specjax.models._forward.lower(sharded, tokens).compile().as_text()
    whole = {tuple(q.shape) for q in leaves} | {tuple(q.shape[1:]) for q in leaves}
    return {
        "num_int8": len(leaves),
        "scales_follow_weights": follow,
        "scales_split": sum(any(a is not None for a in q.scale.sharding.spec) for q in leaves),
        "equal": bool(np.allclose(np.asarray(a), np.asarray(b), atol=1e-5)),
        "whole_weight_gathers": sorted({str(g) for g in all_gather_shapes(hlo) if g in whole}),
    }



def prefix_kernel_findings() -> dict:
    """A cached pass on a (data 2, model 4) mesh whose model's rules split its rows and kv
    heads: the TPU's and the GPU's prefix kernels (Pallas' interpreter) run under shard_map,
    each device on its own rows and kv heads, and equal the portable path, with a sliding
    window's floors and without; with no rules (a model not sharded) the pass attends
    portably."""
    from specjax.backend import Backend
    from specjax.models import attention

    mesh = specjax.make_mesh(data=2, model=4)
    rules = specjax.sharding.DEFAULT_RULES
    rng = np.random.RandomState(5)
    B, T, H, G, S, D = 2, 3, 8, 4, 256, 128
    P = jax.sharding.PartitionSpec

    def put(x, *spec):
        return jax.device_put(jnp.asarray(x, jnp.float32), jax.sharding.NamedSharding(mesh, P(*spec)))

    q = put(rng.randn(B, T, H, D), "data", None, "model")
    k, v = (put(rng.randn(B, T, G, D), "data", None, "model") for _ in range(2))
    cache_k, cache_v = (put(rng.randn(B, G, S, D), "data", "model") for _ in range(2))
    mask = jnp.asarray(np.tril(np.ones((T, T), bool))[None].repeat(B, 0))
    prefix = jnp.asarray([200, 7], jnp.int32)
    floors = {"none": None, "window": prefix[:, None] + jnp.arange(T) - 50}
    found = {}
    for name, floor in floors.items():
        args = (q, k, v, mask, cache_k, cache_v, prefix, floor)
        want = attention.cached_attention(*args, 0.125, backend=Backend("cpu"))
        for platform in ("tpu", "gpu"):
            def run(*a, rules=rules, backend=Backend(platform, mesh)):
                return attention.cached_attention(*a, 0.125, backend=backend, kernels=True, interpret=True, rules=rules)
            got = jax.jit(run)(*args)
            jaxpr = str(jax.make_jaxpr(run)(*args))
            portable = str(jax.make_jaxpr(functools.partial(run, rules=None))(*args))
            found[f"{platform} {name}"] = {
                "error": float(np.abs(np.asarray(got) - np.asarray(want)).max()),
                "under_shard_map": "shard_map" in jaxpr and "pallas_call" in jaxpr,
                "without_rules_portable": "pallas_call" not in portable}
    return found


if __name__ == "__main__":
    sys.exit(main())
