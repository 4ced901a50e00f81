"""Real context lengths: blockwise attention equals the dense reference (causal, window,
tree placements, soft-cap, GQA, a key limit); chunked prefill + blockwise attention leave
generate's output unchanged (greedy against transformers, trees, trained heads, sampling
exactness); an 8,192-token prompt compiles to under 512 MB of temporaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import models
from specjax.backend import Backend
from specjax.models import attention as attn
from tests import tiny
from tests.test_tree import (MAX_NEW, SAMPLING_DRAFTERS, _greedy_case, _prompts, _sampled_joint,  # noqa: F401
                             exact_joint, tiny_pair)
from tests.test_sampling import _chi_square_p


CPU, GPU_PORTABLE = Backend("cpu"), Backend("gpu", portable=True)


def _dense(q, k, v, mask, scale, cap, heads_first=False):
    return attn.attention(q, k, v, mask, scale, cap, block=k.shape[2 if heads_first else 1], backend=CPU,
                          heads_first=heads_first)


@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("kind", ["causal", "window", "random"])
def test_blockwise_attention_equals_dense(kind, cap):
    rng = np.random.RandomState(0)
    B, T, S, H, G, D = 2, 5, 37, 4, 2, 8  # S not a multiple of the block: the last one slides back
    q, k, v = (jnp.asarray(rng.randn(*shape), jnp.float32) * 2
               for shape in ((B, T, H, D), (B, S, G, D), (B, S, G, D)))
    positions = np.array([[20, 21, 22, 23, 24], [3, 4, 5, 6, 7]])[:, :, None]
    slots = np.arange(S)[None, None, :]
    if kind == "causal":
        mask = slots <= positions
    elif kind == "window":
        mask = (slots <= positions) & (positions - slots < 6)
    else:  # a tree-like placement: any pattern, each query seeing at least its own slot
        mask = (rng.rand(B, T, S) < 0.3) & (slots < 30)
        mask[np.arange(B)[:, None], np.arange(T)[None], 25 + np.arange(T)[None]] = True
    mask = jnp.asarray(np.broadcast_to(mask, (B, T, S)))
    want = _dense(q, k, v, mask, 0.3, cap)
    # Each row's live length: one past the highest slot any of its queries sees.
    limit = jnp.asarray([int(np.max(np.nonzero(np.asarray(mask)[b].any(0))[0])) + 1 for b in range(B)], jnp.int32)
    for block in (4, 7, 16):
        got = attn.attention(q, k, v, mask, 0.3, cap, block=block, backend=CPU)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
        got = attn.attention(q, k, v, mask, 0.3, cap, kv_limit=limit, block=block, backend=CPU)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
        got = jax.jit(lambda *a: attn.attention(*a, 0.3, cap, kv_limit=limit, block=block,  # a GPU's fixed-length loop
                                                backend=GPU_PORTABLE))(q, k, v, mask)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    if cap is None:  # cuDNN's path (it has no soft-cap), through the same call with "xla"
        got = attn.dot_product_attention(q, k, v, mask, 0.3, implementation="xla")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
        # With each row's live length as key_value_seq_lengths (what bounds cuDNN's reads).
        got = attn.dot_product_attention(q, k, v, mask, 0.3, limit, implementation="xla")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
        # A cache's head-major keys, and through `attention` with them.
        heads_first = [jnp.swapaxes(x, 1, 2) for x in (k, v)]
        got = attn.dot_product_attention(q, *heads_first, mask, 0.3, limit, implementation="xla", heads_first=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
        got = attn.attention(q, *heads_first, mask, 0.3, cap, block=7, backend=CPU, heads_first=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def _split_case(kind: str, cap, S: int, D: int, late: bool = False):
    """A cached pass of 5 queries per row (heads 4 over 2 kv heads) over a cache of S slots:
    (cached_attention's arguments, the output of one softmax over the written cache under the
    whole [B, T, S] mask)."""
    rng = np.random.RandomState(3)
    B, T, H, G = 2, 5, 4, 2
    q = jnp.asarray(rng.randn(B, T, H, D), jnp.float32) * 2
    cache_k, cache_v = (jnp.asarray(rng.randn(B, G, S, D), jnp.float32) for _ in range(2))  # head-major
    new_k, new_v = (jnp.asarray(rng.randn(B, T, G, D), jnp.float32) for _ in range(2))
    start = np.array([S - 17, S - 12 if late else 3])  # each row's committed prefix; the pass writes start .. start+T-1
    slots = start[:, None] + np.arange(T)
    rows = np.arange(B)[:, None]
    k_all, v_all = cache_k.at[rows, :, slots].set(new_k), cache_v.at[rows, :, slots].set(new_v)
    if kind == "tree":  # nodes at depths 0 1 1 2 2 (two branches), each seeing its ancestors
        positions = start[:, None] + np.array([0, 1, 1, 2, 2])
        own = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], bool)
    else:
        positions = slots
        own = np.tril(np.ones((T, T), bool))
    own = np.broadcast_to(own, (B, T, T))
    window = 6 if kind == "window" else None
    floor = None if window is None else jnp.asarray(positions - window)
    if window:
        own = own & (positions[:, :, None] - positions[:, None, :] < window)
    s = np.arange(S)
    whole = s[None, None, :] < start[:, None, None]  # [B, T, S]
    if window:
        whole = whole & (positions[:, :, None] - s[None, None, :] < window)
    whole = np.broadcast_to(whole, (B, T, S)).copy()
    whole[rows[:, :, None], np.arange(T)[None, :, None], slots[:, None, :]] = own
    want = _dense(q, k_all, v_all, jnp.asarray(whole), 0.3, cap, heads_first=True)
    return (q, new_k, new_v, jnp.asarray(own), k_all, v_all, jnp.asarray(start), floor, 0.3, cap), want


def _wider(cache):
    """A cache buffer [B, G, S, D] under two more rows of junk (NaN: any read of them shows)."""
    return jnp.concatenate([cache, jnp.full((2,) + cache.shape[1:], jnp.nan, cache.dtype)])


@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("kind", ["causal", "window", "tree"])
def test_prefix_and_in_flight_attention_equals_one_mask(kind, cap):
    """A cached pass's attention over the committed prefix (read in place, per-row lengths)
    and its in-flight keys (own mask), merged by log-sum-exp, equals one softmax over the
    written cache under the whole mask: dense and blockwise (the last block slid back), with
    the predicate loop (a CPU's in blocks smaller than its dense limit) and a GPU's
    fixed-length one; and through the GPU's and the TPU's prefix
    kernels (in Pallas' interpreter). A cache with more rows than the pass (NaN rows past
    its own) gives the same: they are never read."""
    args, want = _split_case(kind, cap, S=37, D=8)
    wide = args[:4] + tuple(_wider(c) for c in args[4:6]) + args[6:]
    for block in (4, 7, 16, 64):
        got = attn.cached_attention(*args, block=block, backend=CPU)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
        got = attn.cached_attention(*wide, block=block, backend=CPU)  # rows past the pass's are not read
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
        # a GPU's fixed-length loop, past the prefix re-reading
        got = jax.jit(lambda *a: attn.cached_attention(*a, block=block, backend=GPU_PORTABLE))(*args)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    for share, loops in ((attn.GPU_SCORES_OVER_CACHE, 1), (10.0, 0)) if cap is None else ():
        # a GPU's pass of few queries: one softmax over the whole cache (each kind of mask once)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(attn, "GPU_SCORES_OVER_CACHE", share)  # (these 10 query rows per kv head of D = 8: few)
            traced = jax.jit(lambda *a: attn.cached_attention(*a, block=5, backend=GPU_PORTABLE)).trace(
                *args)  # past its 5 in-flight keys
        jaxpr = str(traced.jaxpr)
        assert jaxpr.count("scan[") + jaxpr.count("while[") == loops, share
        got = traced.lower().compile()(*args)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    with pytest.MonkeyPatch.context() as patch:  # a CPU visits the prefix in smaller blocks than it goes dense at
        patch.setattr(attn, "CPU_PREFIX_BLOCK", 5)
        got = jax.jit(lambda *a: attn.cached_attention(*a, block=16, backend=CPU))(*args)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    if kind == "window":  # every row far past its window: the blocks below every floor are skipped
        late, want_late = _split_case(kind, cap, S=37, D=8, late=True)
        for platform in ("cpu", "gpu"):
            backend = Backend(platform, portable=True)
            got = jax.jit(lambda *a: attn.cached_attention(*a, block=4, backend=backend))(*late)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want_late), atol=2e-5, rtol=0, err_msg=platform)
    if (kind, cap) not in (("causal", None), ("tree", None), ("window", 3.0)):
        return  # the kernels' cases (interpreted, they take a while)
    args, want = _split_case(kind, cap, S=256, D=128)  # the kernels' shapes: 4 GPU splits, 2 TPU blocks
    if kind == "tree":  # the pass's rows the first of a wider cache's (the engine's narrow runs)
        args = args[:4] + tuple(_wider(c) for c in args[4:6]) + args[6:]
    for platform in ("gpu", "tpu"):
        backend = Backend(platform)
        got = jax.jit(lambda *a: attn.cached_attention(*a, 0.3, cap, backend=backend, kernels=True,
                                                       interpret=True))(*args[:-2])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0, err_msg=platform)


def test_attention_kernels_are_selected_only_where_they_apply(monkeypatch):
    f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16

    def pick(platform, *shape):
        return attn.choose(Backend(platform), *shape)

    if not attn._cudnn_available():  # a program for a GPU traced here without jax's CUDA plugin
        assert pick("gpu", bf16, 1, 1024, 64, None) == "portable"
    monkeypatch.setattr(attn, "_cudnn_available", lambda: True)
    assert pick("cpu", bf16, 512, 1024, 128, None) == "portable"
    assert pick("gpu", bf16, 1, 1024, 64, None) == "cudnn"
    assert pick("gpu", f16, 512, 1024, 128, None) == "cudnn"
    assert pick("gpu", f32, 512, 1024, 128, None) == "portable"  # cuDNN: half precision only
    assert pick("gpu", bf16, 512, 1024, 256, None) == "portable"  # head_dim > 128
    assert pick("gpu", bf16, 512, 1024, 60, None) == "portable"  # not a multiple of 8
    assert pick("gpu", bf16, 512, 1024, 64, 50.0) == "portable"  # soft-cap (Gemma 2)
    assert pick("tpu", bf16, 512, 1024, 128, 50.0) == "splash"
    assert pick("tpu", f32, 512, 1152, 128, None) == "splash"
    assert pick("tpu", bf16, 5, 1024, 128, None) == "portable"  # a decode step of K+1 tokens
    assert pick("tpu", bf16, 512, 1000, 128, None) == "portable"  # S not a multiple of 128
    assert pick("tpu", bf16, 512, 1024, 64, None) == "portable"
    # Portable, or sharded (GSPMD does not partition a custom call): the jnp path.
    assert attn.choose(Backend("tpu", portable=True), bf16, 512, 1024, 128, None) == "portable"
    assert attn.choose(Backend("gpu", portable=True), bf16, 1, 1024, 64, None) == "portable"
    mesh = jax.make_mesh((1,), ("data",))
    assert attn.choose(Backend("tpu", mesh), bf16, 512, 1024, 128, None) == "portable"
    # Which models take kernels: "kernels" wherever the backend allows; "auto" nowhere until
    # measured at the code as it stands (none is: the GPU's ran before the head-major cache);
    # "portable" never.
    for platform in ("cpu", "gpu", "tpu"):
        assert attn.takes_kernels("kernels", bf16, Backend(platform))
        assert not attn.takes_kernels("kernels", bf16, Backend(platform, portable=True))
        assert not attn.takes_kernels("portable", bf16, Backend(platform))
        assert not attn.takes_kernels("auto", bf16, Backend(platform))
    # Once a platform's kernels are measured, "auto" takes them there, in the dtypes measured,
    # on one device only.
    monkeypatch.setattr(attn, "MEASURED_KERNELS", {"gpu": (bf16,)})
    assert attn.takes_kernels("auto", bf16, Backend("gpu"))
    assert not attn.takes_kernels("auto", f16, Backend("gpu"))
    assert not attn.takes_kernels("auto", bf16, Backend("gpu", mesh))
    assert not attn.takes_kernels("auto", bf16, Backend("tpu"))
    assert Backend("cuda").platform == "gpu"
    with pytest.raises(ValueError, match="platform"):
        Backend("metal")


def test_splash_attention_equals_the_portable_path():
    """The TPU kernel itself, run by Pallas' interpreter on CPU: per-row causal masks at
    different offsets with a window, grouped heads, a soft-cap."""
    rng = np.random.RandomState(2)
    B, T, S, H, G, D = 2, 128, 256, 2, 1, 128
    q, k, v = (jnp.asarray(rng.randn(*shape), jnp.float32)
               for shape in ((B, T, H, D), (B, S, G, D), (B, S, G, D)))
    positions = (np.array([100, 3])[:, None] + np.arange(T))[:, :, None]
    slots = np.arange(S)[None, None, :]
    mask = jnp.asarray((slots <= positions) & (positions - slots < 150))
    want = _dense(q, k, v, mask, 0.1, 5.0)
    heads_first = (jnp.swapaxes(x, 1, 2) for x in (k, v))  # [B, G, S, D], as a cache lies
    got = jax.jit(lambda q, k, v, m: attn.splash_attention(q, k, v, m, 0.1, 5.0, interpret=True))(q, *heads_first, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def test_blockwise_attention_differentiates_like_dense():
    rng = np.random.RandomState(1)
    q, k, v = (jnp.asarray(rng.randn(1, 12, 2, 4), jnp.float32) for _ in range(3))
    mask = jnp.tril(jnp.ones((12, 12), bool))[None]
    grad = lambda block: jax.grad(lambda q: attn.attention(q, k, v, mask, 0.5, block=block, backend=CPU).sum())(q)  # noqa: E731
    np.testing.assert_allclose(np.asarray(grad(5)), np.asarray(grad(12)), atol=1e-5)


@pytest.fixture
def small_blocks(monkeypatch):
    """Every attention over more than 4 keys goes blockwise; prompts over 4 tokens in chunks."""
    monkeypatch.setattr(attn, "ATTENTION_BLOCK", 4)
    monkeypatch.setattr(models, "PREFILL_CHUNK", 4)
    jax.clear_caches()
    yield
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.parametrize("blocks", ["dense", "blockwise"])
def test_a_pass_over_a_wider_caches_first_rows_equals_one_over_those_rows(pair, blocks, monkeypatch):
    """The engine's narrow runs pass the state's whole caches to a pass over its first rows:
    a drafter's tree pass (its nodes held beside the buffers) and a chain's over the first
    2 rows of a 3-row cache give the logits, cache rows and held tree of the same pass over
    a 2-row cache, and leave the third row as it was."""
    from specjax.cache import KVCache, tree_placement

    if blocks == "blockwise":
        monkeypatch.setattr(attn, "ATTENTION_BLOCK", 4)
        monkeypatch.setattr(attn, "CPU_PREFIX_BLOCK", 4)
    target = pair[0]
    rng = np.random.default_rng(5)
    prompts = jnp.asarray(rng.integers(3, 97, (3, 9)), jnp.int32)
    _, cache = models.prefill(target, prompts, KVCache.init(target.config, 3, 32, target.dtype), return_hidden=False)
    wide = cache.replace(lengths=jnp.full((2,), 8, jnp.int32))
    narrow = KVCache(k=tuple(b[:2] for b in cache.k), v=tuple(b[:2] for b in cache.v), lengths=wide.lengths)
    tokens = jnp.asarray(rng.integers(3, 97, (2, 4)), jnp.int32)
    depth = np.array([0, 1, 1, 2])  # a root, two children, a grandchild of the first
    sees = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    start = jnp.full((2,), 8, jnp.int32)
    slots = start[:, None] + jnp.arange(4)[None]
    held = tree_placement(start, np.r_[depth, depth + 1], np.pad(np.broadcast_to(sees, (2, 4, 4)), ((0, 0),) * 2
                                                                 + ((0, 4),)), offset=0)  # 4 of 8 held nodes
    for placement, positions in ((held, start[:, None] + depth), (None, slots)):
        run = jax.jit(lambda c, placement=placement, positions=positions: models.apply(
            target, tokens, positions, c if placement is None else c.hold_tree(2, 8), placement=placement))
        (got, _, after), (want, _, want_after) = run(wide), run(narrow)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
        for buf, want_buf, before in zip(after.k + after.v, want_after.k + want_after.v, cache.k + cache.v):
            np.testing.assert_array_equal(np.asarray(buf[:2]), np.asarray(want_buf))
            np.testing.assert_array_equal(np.asarray(buf[2]), np.asarray(before[2]))
            if placement is not None:  # the buffers untouched: the nodes are held
                np.testing.assert_array_equal(np.asarray(buf), np.asarray(before))
        if placement is not None:
            for got_held, want_held in zip(jax.tree.leaves(after.tree), jax.tree.leaves(want_after.tree)):
                np.testing.assert_allclose(np.asarray(got_held), np.asarray(want_held), atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gpt2"])
def test_blockwise_forward_matches_transformers(arch, hf_folder, small_blocks):
    folder, torch_model = hf_folder(arch)
    model = specjax.load_model(folder, dtype=jnp.float32)
    tokens = np.random.RandomState(1).randint(0, tiny.VOCAB, (2, 16))
    np.testing.assert_allclose(np.asarray(specjax.forward(model, tokens)), tiny.logits(torch_model, tokens),
                               atol=1e-4, rtol=0)


@pytest.mark.slow  # the suite's time on 2 cores (-m slow runs it)
def test_chunked_generate_equals_transformers(pair, small_blocks):
    """No draft, a chain, a tree, early exit and a trained head (which reads the chunked
    prefill's states), ragged rows, an EOS: all greedy-exact with 4-slot blocks and 4-token
    chunks. (A static tree and Medusa take the tree's and EAGLE's passes: test_tree, test_heads.)"""
    target, drafts, torch_model = pair
    prompts = _prompts(4, seed=3)
    prompts[1] = prompts[1][:1]
    padded, lengths, eos, expected = _greedy_case(target, torch_model, prompts)
    key = jax.random.key(7)
    drafters = [None, drafts["near"], specjax.DraftModel(drafts["far"], specjax.Tree(depth=4, top_k=3, nodes=10)),
                specjax.EarlyExit(1, specjax.Tree(depth=3, top_k=2, nodes=6)), specjax.Eagle.init(target, key)]
    for drafter in drafters:
        out = specjax.generate(target, padded, lengths, draft=drafter, max_new_tokens=MAX_NEW,
                               eos_token_id=eos)
        assert tiny.rows(out) == expected, type(drafter).__name__


@pytest.mark.slow  # (the suite's time on 2 cores; chunked attention's equality and tree sampling run by default)
def test_chunked_tree_sampling_is_exact(tiny_pair, exact_joint, small_blocks):
    target, draft = tiny_pair
    observed = _sampled_joint(target, SAMPLING_DRAFTERS["model_static_sampled"](draft))
    assert observed[exact_joint == 0].sum() == 0
    assert _chi_square_p(observed, exact_joint) > 1e-3


LONG = specjax.ModelConfig(model_type="llama", vocab_size=256, hidden_size=128, num_layers=2, num_heads=8,
                           num_kv_heads=2, head_dim=16, intermediate_size=256,
                           max_position_embeddings=16384, norm_eps=1e-5, tie_word_embeddings=True)


def _temporaries(target, draft, P):
    from specjax.generate import compiled_memory

    prompts, lengths = jnp.ones((1, P), jnp.int32), jnp.array([P], jnp.int32)
    return compiled_memory(target, prompts, lengths, draft=draft, max_new_tokens=64).temp_size_in_bytes


def test_long_prompt_compiles_small():
    """One 8,192-token prompt on a 2-layer 8-head model: the program's temporaries stay
    under 512 MB, autoregressive and speculative (they were 6.2 GB with a one-pass prefill
    over the whole buffer)."""
    target = models.init(LONG, jax.random.key(0), jnp.float32)
    draft = models.init(LONG.__class__(**{**LONG.__dict__, "num_layers": 1}), jax.random.key(1), jnp.float32)
    for d in (None, draft):
        assert _temporaries(target, d, 8192) < 512 * 2**20


# ---- estimate_memory and the refusal ---------------------------------------------------


@pytest.mark.parametrize("batch, prompt_len, use_draft", [(1, 64, False), (2, 1024, True)])
def test_estimate_memory_agrees_with_the_compiled_program(batch, prompt_len, use_draft):
    target = models.init(LONG, jax.random.key(0), jnp.float32)
    draft = models.init(LONG.__class__(**{**LONG.__dict__, "num_layers": 1}), jax.random.key(1), jnp.float32)
    draft = draft if use_draft else None
    est = specjax.estimate_memory(target, draft, batch=batch, prompt_len=prompt_len, max_new_tokens=32,
                                  num_draft_tokens=3 if use_draft else None)
    from specjax.generate import compiled_memory

    m = compiled_memory(target, np.ones((batch, prompt_len), np.int32), np.full(batch, prompt_len, np.int32),
                        draft=draft, max_new_tokens=32, num_draft_tokens=3 if use_draft else None)
    compiled = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    assert abs(est.total - compiled) <= 0.1 * compiled
    weights = sum(x.nbytes for x in jax.tree.leaves(target.params)) + (
        0 if draft is None else sum(x.nbytes for x in jax.tree.leaves(draft.params)))
    assert est.weights == weights
    S = prompt_len + 32 + (3 if use_draft else 0)
    target_cache = 2 * LONG.num_layers * batch * S * LONG.num_kv_heads * LONG.head_dim * 4
    assert est.caches >= target_cache and est.caches <= est.temporaries


def test_oversized_request_is_refused_with_the_numbers(pair, monkeypatch):
    from specjax import budget, memory

    target = pair[0]
    prompts, lengths = specjax.pad_prompts([[3, 4, 5]])
    monkeypatch.setattr(memory, "device_free_bytes", lambda mesh=None: 2 ** 10)  # a 1 kB device
    monkeypatch.setattr(budget, "_verdicts", {})
    with pytest.raises(specjax.InsufficientMemoryError, match=r"needs [0-9.]+ MB .* 0\.0 MB free"):
        specjax.generate(target, prompts, lengths, max_new_tokens=8)
    monkeypatch.setattr(memory, "device_free_bytes", lambda mesh=None: 2 ** 40)
    assert specjax.generate(target, prompts, lengths, max_new_tokens=8).num_tokens[0] == 8


# ---- fewer programs ---------------------------------------------------------------------


def test_prompts_pad_to_powers_of_two_and_caches_to_multiples_of_128():
    from specjax.loop import cache_length

    for longest, P in [(1, 64), (64, 64), (65, 128), (1000, 1024), (8192, 8192), (8193, 16384)]:
        assert specjax.pad_prompts([[1] * longest, [2]])[0].shape == (2, P)
    assert specjax.pad_prompts([[1] * 17], bucket=16)[0].shape == (1, 32)
    with pytest.raises(ValueError, match="bucket"):
        specjax.pad_prompts([[1]], bucket=0)
    assert cache_length(1024, 64, 4) == 1152 and cache_length(64, 64, 0) == 128
    assert cache_length(16, 12, 10) == 48  # short caches: a multiple of 16


def test_a_mixed_workload_compiles_one_program_per_bucket(pair):
    from specjax.loop import generate_loop

    target = pair[0]
    jax.clear_caches()
    rng = np.random.RandomState(0)
    for n in [3, 40, 64, 65, 100, 110, 5, 120]:  # buckets 64 and 128
        padded, lengths = specjax.pad_prompts([list(rng.randint(2, tiny.VOCAB, n))])
        specjax.generate(target, padded, lengths, max_new_tokens=4)
    assert generate_loop._cache_size() == 2
